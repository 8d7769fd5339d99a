"""The knobs of lessons 17 and 18 timed, weak-scaling efficiency against this machine's own limit, and the input side.

    python benchmarks/ddp_knobs.py                       # all three parts, 3 alternating repetitions (~10 min here)
    python benchmarks/ddp_knobs.py --parts knobs --reps 5 --compile    # + torch.compile (inductor; minutes on CPU)

1. knobs (one torchrun launch, 2 ranks): every variant is built once, then each repetition times every variant
   (`--steps` steps after 2 warm-ups, median, the slower rank's) in a rotated order. A variant's ratio is its
   step time over the default's in the SAME repetition; we report the median ratio and its min..max over
   repetitions. "default again" is the default timed a second time: its spread is this machine's noise floor,
   and a knob whose ratio range includes 1.0, or whose median is within that floor of 1.0, is "within noise".
2. scaling: samples/s for 1 process alone, 2 independent processes side by side (no communication: this
   machine's own limit for two processes), and 2 DDP ranks, for per-process batches and model widths; all three
   inside one 2-rank launch, seconds apart, in rotated order per repetition (rank 1 idles in a barrier while
   rank 0 runs alone), medians reported. Efficiency = DDP / (2 x alone); the
   limit = side by side / (2 x alone); we state the smallest batch whose efficiency reaches 0.85 x the limit.
3. input: a training loop fed by a DataLoader whose samples cost CPU (a random shift and noise per digit), for
   processes x workers x OMP threads against the cores, and persistent_workers with short epochs. pin_memory +
   non_blocking only matter with a GPU (page-locked host memory lets the copy overlap): measured only on CUDA.
Writes `--out` (JSON, default benchmarks/ddp_knobs.json: the notebook of lesson 17 plots it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common.compression.hooks import comm_hook
from common.data import digits_split
from common.data_parallel.micro_batches import no_sync_unless
from common.harness.env import LessonError
from common.harness.ranks import all_gather_objects
from common.harness.session import add_distributed_args, distributed_session, run_main
from common.measure.bandwidth import time_calls
from common.models import ResidualMLP
from common.run.launch import torchrun_command
from common.run.processes import REPO_ROOT, run_command

KNOBS = [
    "default",
    "default again",
    "bucket_cap_mb=0.1",
    "bucket_cap_mb=1",
    "bucket_cap_mb=100",
    "gradient_as_bucket_view",
    "static_graph",
    "fp16 hook",
    "bf16 hook",
    "powersgd1 (1 bucket)",
    "powersgd4 (1 bucket)",
    "no_sync k=4",
    "sync every micro-step k=4",
]


def ddp_variant(name: str, info, args):
    """A `step()` closure for knob `name`: one optimizer step on `args.batch` samples per rank."""
    torch.manual_seed(0)
    raw = ResidualMLP(width=args.width).to(info.device)
    kw = {"bucket_cap_mb": float(name.split("=")[1])} if name.startswith("bucket_cap_mb") else {}
    kw.update(
        {"gradient_as_bucket_view": True} if name == "gradient_as_bucket_view" else {},
        **({"static_graph": True} if name == "static_graph" else {}),
        **({"bucket_cap_mb": 100.0} if "1 bucket" in name else {}),
    )
    model = DDP(raw, device_ids=[info.local_rank] if info.device.type == "cuda" else None, **kw)
    if "hook" in name or "powersgd" in name:
        # "fp16 hook" -> "fp16", "powersgd1 (1 bucket)" -> "powersgd1"
        hook, state = comm_hook(name.split()[0])
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(raw.parameters(), lr=0.01, momentum=0.9)
    x, y = (
        torch.randn(args.batch, 64, device=info.device),
        torch.randint(10, (args.batch,), device=info.device),
    )
    k = 4 if "k=4" in name else 1
    chunks = list(zip(x.chunk(k), y.chunk(k)))

    def step():
        for i, (xi, yi) in enumerate(chunks):
            last = i == k - 1 or name.startswith("sync every")
            with no_sync_unless(model, last=last):
                (F.cross_entropy(model(xi), yi) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def compiled_variant(info, args):
    """(step, seconds of the first step) for torch.compile (inductor) of the default DDP model."""
    torch.manual_seed(0)
    raw = ResidualMLP(width=args.width).to(info.device)
    compiled = torch.compile(
        DDP(raw, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    )
    opt = torch.optim.SGD(raw.parameters(), lr=0.01, momentum=0.9)
    x, y = (
        torch.randn(args.batch, 64, device=info.device),
        torch.randint(10, (args.batch,), device=info.device),
    )

    def step():
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()  # dynamo traces, DDPOptimizer splits at bucket boundaries, inductor compiles each piece
    return step, time.perf_counter() - t0


def knobs_worker(info, args) -> dict:
    names = KNOBS + (["torch.compile (inductor)"] if args.compile else [])
    steps = {name: ddp_variant(name, info, args) for name in KNOBS}
    compile_s = None
    if args.compile:
        steps[names[-1]], compile_s = compiled_variant(info, args)
    times = {n: [] for n in names}
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotated: none always first
        for name in order:
            mine = 1e3 * statistics.median(
                time_calls(steps[name], args.steps, 2, info.device, False)
            )
            times[name].append(max(all_gather_objects(mine, info)))  # the slower rank sets the step
    return {"times_ms": times, "compile_s": compile_s}


class ShiftedDigits(Dataset):
    """Digits with a random shift of up to 1 pixel and Gaussian noise per sample: CPU work per __getitem__."""

    def __init__(self, base, work: int):
        self.x, self.y, self.work = base.tensors[0], base.tensors[1], work

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        for _ in range(self.work):  # stands for decoding / augmenting a real image
            x = torch.roll(
                x,
                shifts=(int(torch.randint(-1, 2, ())), int(torch.randint(-1, 2, ()))),
                dims=(1, 2),
            )
            x = x + 0.01 * torch.randn_like(x)
        return x, self.y[i]


def throughput_worker(info, args) -> dict:
    """samples/s for each (batch, width) and repetition, three ways inside one 2-rank launch, seconds apart (so
    that the load of other users hits them alike): rank 0 alone (rank 1 waits in a barrier, idle), both ranks
    side by side without communication (this machine's limit), and DDP. Returns {mode: {"batch,width": [...]}}."""
    configs = [(b, args.width) for b in args.batches] + [(args.batch, w) for w in args.widths]
    out = {m: {f"{b},{w}": [] for b, w in configs} for m in ("alone", "independent", "ddp")}
    for rep in range(args.reps):
        for batch, width in configs:
            torch.manual_seed(0)
            raw = ResidualMLP(width=width).to(info.device)
            x, y = (
                torch.randn(batch, 64, device=info.device),
                torch.randint(10, (batch,), device=info.device),
            )
            models = {"alone": raw, "independent": raw, "ddp": DDP(raw)}
            modes = list(models)[rep % 3 :] + list(models)[: rep % 3]  # rotated per repetition
            for mode in modes:
                model, opt = models[mode], torch.optim.SGD(raw.parameters(), lr=0.01)

                def step():
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                torch.distributed.barrier()  # start together; for "alone" rank 1 just waits here
                rate = (
                    batch / statistics.median(time_calls(step, args.steps, 2, info.device, False))
                    if (mode != "alone" or info.rank == 0)
                    else 0.0
                )
                torch.distributed.barrier()
                out[mode][f"{batch},{width}"].append(sum(all_gather_objects(rate, info)))
    return out


def input_worker(info, args) -> dict:
    train, _ = digits_split()
    data = ShiftedDigits(train, work=args.input_work)
    pin = info.device.type == "cuda" and args.pin_memory
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, seed=0)
    loader = DataLoader(
        data,
        batch_size=args.batch,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=pin,
        persistent_workers=args.persistent and args.workers > 0,
    )
    model = (
        DDP(ResidualMLP().to(info.device)) if info.distributed else ResidualMLP().to(info.device)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0, n = time.perf_counter(), 0
    # short epochs: worker start-up recurs each epoch unless persistent
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(info.device, non_blocking=pin), y.to(info.device, non_blocking=pin)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += len(y)
    rate = n / (time.perf_counter() - t0)
    return {"samples_per_s": sum(all_gather_objects(rate, info))}


def launch(nproc, worker_args: list, env=None, timeout_s=900) -> dict:
    """Run this file as a worker (torchrun with nproc processes, or plain python for None); its JSON."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp_knobs_{os.getpid()}.json"
    cmd = torchrun_command(
        Path(__file__).resolve(), nproc, [*worker_args, "--worker-out", str(out)]
    )
    proc = run_command(cmd, timeout_s=timeout_s, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def summarize_knobs(times: dict) -> list[dict]:
    """Per knob: ratios to the default of the same repetition, median and min..max, and whether within noise."""
    ratios = {
        n: [t / d for t, d in zip(ts, times["default"])]
        for n, ts in times.items()
        if n != "default"
    }
    floor = max(abs(r - 1) for r in ratios["default again"])  # the default against itself
    rows = []
    for name, rs in ratios.items():
        med = statistics.median(rs)
        rows.append(
            {
                "knob": name,
                "ms_median": statistics.median(times[name]),
                "ratio": med,
                "min": min(rs),
                "max": max(rs),
                "within_noise": min(rs) <= 1 <= max(rs) or abs(med - 1) <= floor,
            }
        )
    # no_sync is compared with the same 4 micro-steps syncing each time (the default does one batch of 32)
    rs = [a / b for a, b in zip(times["no_sync k=4"], times["sync every micro-step k=4"])]
    rows.append(
        {
            "knob": "no_sync k=4 / sync every k=4",
            "ms_median": None,
            "ratio": statistics.median(rs),
            "min": min(rs),
            "max": max(rs),
            "within_noise": min(rs) <= 1 <= max(rs),
        }
    )
    return rows


def summarize_scaling(runs: dict, args) -> dict:
    """Medians over repetitions; efficiency and limit per configuration; the batch reaching 0.85 x the limit."""
    med = {mode: {k: statistics.median(v) for k, v in per.items()} for mode, per in runs.items()}
    rows = []
    for key, alone in med["alone"].items():
        batch, width = map(int, key.split(","))
        eff, limit = med["ddp"][key] / (2 * alone), med["independent"][key] / (2 * alone)
        # per repetition, each mode against the "alone" of the same repetition: the spread of the efficiency
        per_rep = [d / (2 * a) for d, a in zip(runs["ddp"][key], runs["alone"][key])]
        rows.append(
            {
                "batch": batch,
                "width": width,
                "alone": alone,
                "independent": med["independent"][key],
                "ddp": med["ddp"][key],
                "efficiency": eff,
                "limit": limit,
                "relative": eff / limit,
                "eff_min": min(per_rep),
                "eff_max": max(per_rep),
            }
        )
    by_batch = [r for r in rows if r["width"] == args.width and r["batch"] in args.batches]
    by_batch.sort(key=lambda r: r["batch"])
    reach = next((r["batch"] for r in by_batch if r["relative"] >= 0.85), None)
    # a noisy machine can cross once and fall back: also the smallest batch from which every larger one stays
    stays = next(
        (
            r["batch"]
            for i, r in enumerate(by_batch)
            if all(q["relative"] >= 0.85 for q in by_batch[i:])
        ),
        None,
    )
    return {"rows": rows, "batch_reaching_085_of_limit": reach, "batch_staying_085_of_limit": stays}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--parts",
        nargs="+",
        choices=["knobs", "scaling", "input"],
        default=["knobs", "scaling", "input"],
    )
    p.add_argument(
        "--reps", type=int, default=3, help="alternating repetitions (>= 3 for a spread)"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median)")
    p.add_argument(
        "--batch", type=int, default=32, help="samples per process per step (knobs, widths, input)"
    )
    p.add_argument(
        "--width",
        type=int,
        default=256,
        help="ResidualMLP width (depth 4): 256 = lesson 17's model",
    )
    p.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[8, 32, 128, 512, 2048],
        help="scaling: per process",
    )
    p.add_argument(
        "--widths", type=int, nargs="+", default=[64, 1024], help="scaling: model widths at --batch"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="knobs: add torch.compile (inductor), compile time apart",
    )
    p.add_argument(
        "--input-work", type=int, default=8, help="input: roll + noise passes per sample"
    )
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "ddp_knobs.json"))
    # worker options (the orchestrator passes them to the launches it makes)
    p.add_argument(
        "--worker", choices=["knobs", "throughput", "input"], default=None, help=argparse.SUPPRESS
    )
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--persistent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pin-memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=3, help=argparse.SUPPRESS)
    add_distributed_args(p, timeout_s=600)
    args = p.parse_args()
    if args.reps < 1 or args.steps < 1 or args.batch < 4 or args.batch % 4:
        raise LessonError(
            "--reps and --steps must be positive, --batch a positive multiple of 4 (no_sync k=4)"
        )
    return args


def run_worker(args) -> None:
    """A launched worker: its part's measurement, written by rank 0 to --worker-out."""
    with distributed_session(args) as info:
        fn = {"knobs": knobs_worker, "throughput": throughput_worker, "input": input_worker}[
            args.worker
        ]
        result = fn(info, args)
        if info.master_process:
            Path(args.worker_out).write_text(json.dumps(result))


def knobs_part(args, common: list, report: dict) -> None:
    """Part 1: every knob's step time over the default's, in one 2-rank launch."""
    res = launch(
        2,
        [
            "--worker",
            "knobs",
            "--reps",
            str(args.reps),
            *common,
            *(["--compile"] * args.compile),
        ],
    )
    report["knobs"] = summarize_knobs(res["times_ms"])
    report["compile_s"] = res["compile_s"]
    print(
        f"\n1. knobs, 2 ranks, batch {args.batch}/rank: step time / default's, median [min..max] of {args.reps}; "
        f"default {statistics.median(res['times_ms']['default']):.1f} ms"
    )
    for r in report["knobs"]:
        ms = f"{r['ms_median']:7.1f} ms" if r["ms_median"] else " " * 10
        print(
            f"  {r['knob']:<29} {ms}  x{r['ratio']:.2f} [{r['min']:.2f}..{r['max']:.2f}]"
            f"  {'within noise' if r['within_noise'] else 'outside noise'}"
        )
    if res["compile_s"] is not None:
        print(
            f"  torch.compile: first step (compile) {res['compile_s']:.1f} s, reported apart from the ratio"
        )


def scaling_part(args, common: list, report: dict) -> None:
    """Part 2: weak scaling against this machine's own limit for two processes."""
    runs = launch(
        2,
        [
            "--worker",
            "throughput",
            "--reps",
            str(args.reps),
            *common,
            "--batches",
            *map(str, args.batches),
            "--widths",
            *map(str, args.widths),
        ],
    )
    report["scaling"] = summarize_scaling(runs, args)
    print(
        "\n2. weak scaling (samples/s, medians): efficiency = DDP / (2 x alone), limit = side by side / "
        "(2 x alone)"
    )
    for r in report["scaling"]["rows"]:
        print(
            f"  batch {r['batch']:>5}/process, width {r['width']:>5}: alone {r['alone']:>9,.0f}, side by side "
            f"{r['independent']:>9,.0f}, DDP {r['ddp']:>9,.0f}; efficiency {r['efficiency']:.2f} "
            f"[{r['eff_min']:.2f}..{r['eff_max']:.2f}], limit {r['limit']:.2f}, ratio {r['relative']:.2f}"
        )
    print(
        f"  width {args.width}: efficiency first reaches 0.85 x the limit at batch "
        f"{report['scaling']['batch_reaching_085_of_limit']}; stays above it from batch "
        f"{report['scaling']['batch_staying_085_of_limit']} (None: not within the sweep)"
    )


def input_rates(args, procs: int, workers: int, threads: int, persistent: bool, pin: bool) -> list:
    """Samples per second of all processes, one launch per repetition, for one input configuration."""
    rates = []
    for _ in range(args.reps):
        wa = [
            "--worker",
            "input",
            "--batch",
            str(args.batch),
            "--workers",
            str(workers),
            "--input-work",
            str(args.input_work),
            *(["--persistent"] * persistent),
            *(["--pin-memory"] * pin),
        ]
        rates.append(launch(procs, wa, env={"OMP_NUM_THREADS": str(threads)})["samples_per_s"])
    return rates


def input_part(args, report: dict) -> None:
    """Part 3: a DataLoader whose samples cost CPU, for processes x workers x threads against the cores."""
    rows, cores = [], os.cpu_count()
    print(
        f"\n3. input: DataLoader feeding DDP, batch {args.batch}/process, {args.input_work} passes per sample; "
        f"samples/s of all processes, median [min..max] of {args.reps}"
    )
    configs = [
        (1, 0, 1, False, False),
        (1, 0, 2, False, False),
        (1, 1, 1, False, False),
        (1, 2, 1, False, False),
        (1, 2, 1, True, False),
        (2, 0, 1, False, False),
        (2, 1, 1, False, False),
        (2, 2, 1, False, False),
        (2, 2, 1, True, False),
    ]
    # pin_memory + non_blocking: page-locked host memory, the copy can overlap
    if torch.cuda.is_available():
        configs += [(1, 2, 1, True, True)]
    for procs, workers, threads, persistent, pin in configs:
        rates = input_rates(args, procs, workers, threads, persistent, pin)
        load = procs * (1 + workers) * threads
        rows.append(
            {
                "processes": procs,
                "workers": workers,
                "omp_threads": threads,
                "persistent": persistent,
                "pin_memory": pin,
                "busy_threads": load,
                "cores": cores,
                "samples_per_s": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
            }
        )
        print(
            f"  procs {procs} x (1 + workers {workers}) x OMP {threads} = {load} threads on {cores} cores, "
            f"persistent {str(persistent):<5}{' pin_memory' * pin}: {statistics.median(rates):8,.0f} samples/s "
            f"[{min(rates):,.0f}..{max(rates):,.0f}]"
        )
    report["input"] = rows
    if not torch.cuda.is_available():
        print(
            "  pin_memory + non_blocking: GPU-only (page-locked host memory); not measured: no CUDA here"
        )


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "load_before": os.getloadavg()[0],
        "args": vars(args),
    }
    print(
        f"machine: {report['machine']}; load average {report['load_before']:.1f} (others share these cores)"
    )
    common = ["--steps", str(args.steps), "--batch", str(args.batch), "--width", str(args.width)]
    if "knobs" in args.parts:
        knobs_part(args, common, report)
    if "scaling" in args.parts:
        scaling_part(args, common, report)
    if "input" in args.parts:
        input_part(args, report)
    report["load_after"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"\nwrote {args.out}; load average {report['load_before']:.1f} before, {report['load_after']:.1f} after"
    )


if __name__ == "__main__":
    run_main(main)
