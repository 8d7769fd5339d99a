"""Step time (and, on CUDA, peak memory) of lesson 08's settings: what each memory saving costs in time.

    python benchmarks/memory_speed.py                                        # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=2 benchmarks/memory_speed.py      # DDP, 2 ranks
    python benchmarks/memory_speed.py --batch 1024 --width 1024 --repeats 20

One optimizer step (SGD, clip, GradScaler when fp16) on `--batch` samples per rank, five ways: plain fp32;
accumulation over k = 4 micro-batches (no_sync() for the first 3); bf16 autocast; fp16 autocast + GradScaler
(CUDA only: on CPU it runs but means nothing); activation checkpointing (one checkpoint per residual block).
Each row: the saved-activation bytes of one micro-step's forward (deterministic, lesson 08 explains them),
the median step time over `--repeats` steps after one warm-up (the slowest rank's), and on CUDA the peak
`torch.cuda.max_memory_allocated` of one step. Times depend on the machine and its load: `[perf]` lines.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.data_parallel.micro_batches import no_sync_unless
from common.harness.env import DistInfo, LessonError
from common.harness.ranks import gather_to_rank0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.bandwidth import time_calls
from common.measure.memory import saved_activation_bytes
from common.measure.precision import autocast_context
from common.models import ResidualMLP


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--batch", type=int, default=256, help="samples per rank per optimizer step (multiple of 4)"
    )
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10, help="timed optimizer steps per row (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the table here as JSON")
    add_distributed_args(p)
    args = p.parse_args()
    if args.batch < 4 or args.batch % 4 or args.repeats < 1 or args.width < 1 or args.depth < 1:
        raise LessonError(
            "--batch must be a positive multiple of 4; --repeats, --width, --depth positive"
        )
    return args


@dataclass
class Bench:
    """What every row measures on: the options, this rank, the model (DDP around `raw_model` under
    torchrun) and this rank's batch x (batch, 64) flattened 8x8 inputs, y (batch,)."""

    args: argparse.Namespace
    info: DistInfo
    model: torch.nn.Module
    raw_model: ResidualMLP
    x: torch.Tensor
    y: torch.Tensor


def optimizer_step(b: Bench, k: int, precision: str, opt, scaler) -> None:
    """One optimizer step of k micro-steps: no_sync but on the last, autocast, the scaler, clipping."""
    mb, dev = b.args.batch // k, b.info.device
    for micro_step in range(k):
        with no_sync_unless(b.model, last=micro_step == k - 1):
            with autocast_context(dev, precision):
                x, y = (
                    b.x[micro_step * mb : (micro_step + 1) * mb],
                    b.y[micro_step * mb : (micro_step + 1) * mb],
                )
                loss = F.cross_entropy(b.model(x), y) / k
            scaler.scale(loss).backward()
    scaler.unscale_(opt)  # once per optimizer step, before clipping
    torch.nn.utils.clip_grad_norm_(b.raw_model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def measure(b: Bench, name: str, k: int, precision: str, ck: bool) -> dict:
    """One row: the activation bytes one micro-batch saves, the peak CUDA memory of a step (on CUDA) and
    the median step time, the slower rank's."""
    mb, dev, raw_model = b.args.batch // k, b.info.device, b.raw_model
    opt = torch.optim.SGD(raw_model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "fp16")  # disabled: a pass-through

    def step():
        raw_model.checkpointing = ck
        optimizer_step(b, k, precision, opt, scaler)
        raw_model.checkpointing = False

    raw_model.checkpointing = ck
    with autocast_context(dev, precision):
        saved = saved_activation_bytes(raw_model, lambda: raw_model(b.x[:mb].clone()))
    raw_model.checkpointing = False
    peak = None
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev)
    secs = gather_to_rank0(
        statistics.median(time_calls(step, b.args.repeats, 1, dev, False)), b.info
    )
    return {
        "name": name,
        "k": k,
        "micro_batch": mb,
        "precision": precision,
        "checkpointing": ck,
        "saved_activation_bytes": saved,
        "peak_cuda_bytes": peak,
        "step_s": max(secs) if secs else None,
    }


def report_table(report: Report, table: list[dict]) -> None:
    """The rows as [perf] lines on rank 0 (the gathered times live there)."""
    for r in table:
        peak = (
            f", peak CUDA {r['peak_cuda_bytes'] / 1e6:.1f} MB"
            if r["peak_cuda_bytes"] is not None
            else ""
        )
        report.perf(
            r["name"],
            r["step_s"],
            f"{r['name']:<18} micro-batch {r['micro_batch']:>5}, saved "
            f"{r['saved_activation_bytes'] / 1e6:7.3f} MB, step {{value:.4f}} s "
            f"({r['step_s'] / table[0]['step_s']:.2f}x plain){peak}",
        )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        dev, report = info.device, Report(info)
        set_seed(args.seed)
        raw_model = ResidualMLP(args.width, args.depth).to(dev)
        model = DDP(raw_model, device_ids=info.device_ids) if info.distributed else raw_model
        x = torch.randn(args.batch, 64, device=dev)  # (batch, 64): flattened 8x8 inputs
        y = torch.randint(10, (args.batch,), device=dev)
        rows = [
            ("plain", 1, "fp32", False),
            ("accumulation k=4", 4, "fp32", False),
            ("bf16 autocast", 1, "bf16", False),
            ("checkpointing", 1, "fp32", True),
        ]
        if dev.type == "cuda":  # fp16 gradients underflow without a scaler
            rows.insert(3, ("fp16 + GradScaler", 1, "fp16", False))
        bench = Bench(args, info, model, raw_model, x, y)
        table = [measure(bench, *row) for row in rows]
        if info.master_process:
            report_table(report, table)
        report.record("table", table)
        report.record("world_size", info.world_size)
        report.write(args.results)


if __name__ == "__main__":
    run_main(main)
