"""Lesson 08: the memory of a data-parallel rank -- what it holds, and what mixed precision, GradScaler,
accumulation and activation checkpointing change.

    python lessons/08_memory.py                                        # one process
    torchrun --standalone --nproc_per_node=2 lessons/08_memory.py      # 2 ranks: the table adds DDP buckets
    torchrun --standalone --nproc_per_node=2 lessons/08_memory.py --micro-batch 512 --width 512
    python benchmarks/memory_speed.py                                  # step time of each setting, CUDA peak

What to look for:
1. The bytes a rank holds after one Adam step, measured from the tensors (each storage once): parameters P,
   gradients P, DDP's buckets P (the flat copy of the gradients the all-reduce works on), Adam's state 2P
   (exp_avg, exp_avg_sq) plus a 4-byte `step` per parameter tensor, and one micro-batch's activations. Every
   data-parallel rank holds all of it: sharding (ZeRO, FSDP) cuts the replicated parameters, gradients and
   optimizer state; accumulation and checkpointing cut the activations.
2. Activations: autograd saves 4 B (64 + w (3 depth + 2)) bytes for the residual MLP, exactly. Activation
   checkpointing keeps each block's input only, 4 B (64 + w (depth + 2)): 56% less at width 256 and depth 4,
   the same gradients, paid for with a second forward (benchmarks/memory_speed.py times it). Accumulation over
   k = 4 micro-batches holds about a quarter. bf16 autocast halves the activations but keeps a bf16 copy of
   each weight whose input needs a gradient (all but the stem's) until backward: at width 256 and micro-batch
   128 that costs more than it saves; at --width 512 --micro-batch 512 it saves (0.78 x plain).
3. bf16 autocast stays within 1e-3 of fp32 after 5 optimizer steps (parameters and update stay fp32).
4. fp16 needs a GradScaler; under accumulation unscale_/step/update run once per optimizer step, after the
   last micro-step; a second unscale_ before update() raises.

Sources: https://pytorch.org/docs/stable/amp.html, https://pytorch.org/docs/stable/notes/amp_examples.html,
https://pytorch.org/docs/stable/checkpoint.html; ZeRO (Rajbhandari et al. 2020): with mixed-precision Adam a
rank holds 2 + 2 + 12 bytes per parameter, the count the sharding lesson starts from; Chen et al. 2016
(checkpointing).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from common.data import digits_split
from common.data_parallel.micro_batches import CountingScaler, micro_batch_stream, no_sync_unless
from common.harness.env import DistInfo, LessonError
from common.harness.ranks import print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import CommCounter
from common.measure.differences import max_abs_diff_all, max_over_ranks
from common.measure.memory import held_bytes, residual_mlp_activation_bytes, saved_activation_bytes
from common.measure.precision import autocast_context
from common.models import ResidualMLP

TOL = 1e-5


@dataclass
class Run:
    """What every section shares: the options, this rank, the report, the model (`model` is the DDP
    wrapper under torchrun, `raw_model` the ResidualMLP inside), its initial weights, the training
    set, and this rank's micro-batch x (B, 1, 8, 8), y (B,)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    model: torch.nn.Module
    raw_model: ResidualMLP
    init_state: dict
    train_set: TensorDataset
    x: torch.Tensor
    y: torch.Tensor


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch", type=int, default=128, help="samples per rank, a multiple of 4")
    p.add_argument("--width", type=int, default=256, help="hidden width of the residual MLP")
    p.add_argument("--depth", type=int, default=4, help="residual blocks")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps of the bf16 vs fp32 run")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate of that run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here (JSON)")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank fails alike, nobody waits in a collective.
    if args.micro_batch < 4 or args.micro_batch % 4:
        raise LessonError(
            f"--micro-batch must be a positive multiple of 4 (accumulation splits it into 4), "
            f"got {args.micro_batch}"
        )
    if args.width < 1 or args.depth < 1 or args.steps < 1 or args.lr <= 0:
        raise LessonError("--width, --depth, --steps and --lr must be positive")
    return args


# ------------------------------------------------------------------- 1. the bytes a rank holds, measured
def bytes_held(run: Run, counter: CommCounter) -> tuple[dict, int]:
    """1. One DDP + Adam step, then count what this rank holds. Returns (bytes by kind, Adam's states)."""
    # warm-up: DDP builds its final buckets after iteration 1
    F.cross_entropy(run.model(run.x), run.y).backward()
    run.raw_model.zero_grad(set_to_none=True)
    optimizer = torch.optim.Adam(run.raw_model.parameters(), lr=1e-3)
    counter.reset()
    # (B, 10) logits; the gradients are all-reduced in buckets
    F.cross_entropy(run.model(run.x), run.y).backward()
    optimizer.step()
    params = list(run.raw_model.parameters())
    held = held_bytes(params, [q.grad for q in params], optimizer, together=True)
    # the flat bucket buffers of one all-reduce round (0 without DDP)
    held["ddp_buckets"] = counter.bytes
    held["activations"] = saved_activation_bytes(run.raw_model, lambda: run.raw_model(run.x))
    optimizer.zero_grad(set_to_none=True)
    P = 4 * sum(q.numel() for q in params)
    rows = ["parameters", "gradients", "ddp_buckets", "optimizer_state", "activations"]
    total = sum(held[r] for r in rows)
    table = "\n".join(
        f"  {r:<16} {held[r]:>10} {held[r] / P:>6.2f} P {100 * held[r] / total:>5.1f}%"
        for r in rows
    )
    run.report.value(
        "bytes_held",
        held,
        "\n1. bytes this rank holds after one Adam step (P = 4 x parameters = {P} bytes):\n{table}",
        P=P,
        table=table,
    )
    run.report.value(
        "replicated_state_share",
        1 - held["activations"] / total,
        "  replicated on every rank (what sharding cuts): {value:.1%} of the total",
    )
    return held, len(optimizer.state)


def report_bytes_held(run: Run, held: dict, n_state: int) -> None:
    """1, continued: each kind of bytes against its count from the parameters and the shapes."""
    raw_model, B, report = run.raw_model, len(run.x), run.report
    w, d = raw_model.stem.out_features, len(raw_model.blocks)  # width, depth
    P = 4 * sum(q.numel() for q in raw_model.parameters())
    # parameters, gradients and (under DDP) buckets: P each. gradient_as_bucket_view=True would make .grad
    # views into the buckets: P saved
    exact = {"parameter": "parameters", "gradient": "gradients", "ddp_bucket": "ddp_buckets"}
    for name, kind in exact.items():
        if kind != "ddp_buckets" or run.info.distributed:
            report.claim(
                f"{name}_bytes_exact", held[kind], "==", P, "  {k} = P = {value} bytes", k=kind
            )
    report.claim(
        "adam_state_bytes_exact",
        held["optimizer_state"],
        "==",
        2 * P + 4 * n_state,
        "  Adam state = 2P + 4 bytes x {n} step counters = {value} bytes",
        n=n_state,
    )
    report.claim(
        "storages_not_shared",
        held["all_three_counted_together"],
        "==",
        held["parameters"] + held["gradients"] + held["optimizer_state"],
        "  parameters, gradients and state counted together: {value} bytes, no storage shared",
    )
    report.claim(
        "activation_bytes_exact",
        held["activations"],
        "==",
        residual_mlp_activation_bytes(B, w, d),
        "  activations = 4 x {B} x (64 + {w} x (3 x {d} + 2)) = {value} bytes",
        B=B,
        w=w,
        d=d,
    )


def checkpointing_gradients(run: Run) -> None:
    """2. Checkpointing recomputes each block's forward in backward: the same gradients."""
    grads = {}
    for ck in (False, True):  # synchronised backward under DDP, with and without checkpointing
        run.raw_model.checkpointing = ck
        F.cross_entropy(run.model(run.x), run.y).backward()
        grads[ck] = [p.grad.detach().clone() for p in run.raw_model.parameters()]
        run.raw_model.zero_grad(set_to_none=True)
    run.raw_model.checkpointing = False
    print0("\n2. activations (saved-tensor bytes of one forward, parameters excluded)")
    gap = max_over_ranks(max_abs_diff_all(grads[True], grads[False]))
    text = "  checkpointing vs plain: gradients differ by {value:.1e}"
    run.report.claim("checkpointing_same_gradients", gap, "<=", TOL, text)


def activation_table(raw_model, x, report: Report) -> None:
    """2, continued: saved bytes by micro-batch, with and without checkpointing, against the shapes."""
    w, d = raw_model.stem.out_features, len(raw_model.blocks)  # width, depth
    by_micro = [
        {
            "micro_batch": b,
            "plain_bytes": raw_model.activation_bytes(x[:b]),
            "checkpointing_bytes": raw_model.activation_bytes(x[:b], checkpointing=True),
        }
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        if b <= len(x)
    ]
    lines = [
        f"  {r['micro_batch']:>11} {r['plain_bytes']:>12} {r['checkpointing_bytes']:>20}"
        for r in by_micro
    ]
    report.value(
        "activation_bytes_by_micro_batch",
        by_micro,
        "  micro-batch  plain bytes  checkpointing bytes\n{rows}",
        rows="\n".join(lines),
    )
    off = sum(
        r["plain_bytes"] != residual_mlp_activation_bytes(r["micro_batch"], w, d)
        or r["checkpointing_bytes"] != residual_mlp_activation_bytes(r["micro_batch"], w, d, True)
        for r in by_micro
    )
    text = "  rows that differ from 4 B (64 + w (3d + 2)) and 4 B (64 + w (d + 2)): {value}"
    report.claim("activation_rows_off_formula", off, "==", 0, text)


def activation_savings(raw_model, x, report: Report) -> None:
    """2, continued: what checkpointing, accumulation and bf16 save at this micro-batch."""
    # micro-batch, width, depth
    B, w, d = len(x), raw_model.stem.out_features, len(raw_model.blocks)
    plain_b = raw_model.activation_bytes(x)
    ck_b = raw_model.activation_bytes(x, checkpointing=True)
    cut = 1 - ck_b / plain_b
    # 40% is the bar at the default shape; a shallow or narrow model saves less: there the shapes' cut is it
    shapes = residual_mlp_activation_bytes(B, w, d, True) / residual_mlp_activation_bytes(B, w, d)
    report.claim(
        "checkpointing_cut",
        cut,
        ">=",
        min(0.40, 1 - shapes),
        "  checkpointing at micro-batch {B}: {value:.1%} fewer activation bytes (the shapes say {cut:.1%})",
        B=B,
        cut=1 - shapes,
    )
    if (w, d) == (256, 4):
        text = "  ... |cut - 56%| = {value:.3f} (the docstring's number at width 256, depth 4)"
        report.claim("checkpointing_cut_as_stated", abs(cut - 0.56), "<=", 0.01, text)
    with autocast_context(x.device, "bf16"):
        bf16_b = raw_model.activation_bytes(x)
    saved = {
        "plain": plain_b,
        "accumulation k=4": raw_model.activation_bytes(x[: B // 4]),
        "bf16 autocast": bf16_b,
        "checkpointing": ck_b,
    }
    report.value(
        "saved_activation_bytes",
        saved,
        "  one step's activations (MB): {mb}",
        mb=", ".join(f"{k} {v / 1e6:.3f}" for k, v in saved.items()),
    )
    report.claim(
        "accumulation_k4_activation_share",
        saved["accumulation k=4"] / plain_b,
        "<=",
        0.3,
        "  accumulation, k = 4 micro-batches of B / 4: {value:.3f} x plain",
    )
    text = "  checkpointing: {value:.3f} x plain"
    report.claim("checkpointing_activation_share", ck_b / plain_b, "<=", max(0.6, shapes), text)
    bf16_activations(raw_model, saved, plain_b, report)


def bf16_activations(raw_model, saved: dict, plain_b: int, report: Report) -> None:
    """2, continued: what bf16 autocast saves, and the bf16 weight copies it keeps."""
    # Activations: half of plain, all of them in bf16, plus the bf16 weight copies autocast keeps
    copies = raw_model.bf16_weight_copy_bytes()
    report.claim(
        "bf16_activation_bytes_exact",
        saved["bf16 autocast"],
        "==",
        plain_b // 2 + copies,
        "  bf16 autocast: {value} bytes = plain / 2 + {copies} bytes of bf16 weight copies",
        copies=copies,
    )
    outweigh = copies >= plain_b / 2
    why = "its bf16 weight copies outweigh the halving"
    if not outweigh:
        why = "the halving outweighs its copies"
    report.claim(
        "bf16_activation_share",
        saved["bf16 autocast"] / plain_b,
        ">=" if outweigh else "<=",
        1.0,
        "  bf16 autocast: {value:.3f} x plain ({why})",
        why=why,
    )


def bf16_vs_fp32(run: Run) -> None:
    """3. bf16 autocast vs fp32: the same SGD run, k = 2 micro-batches of 8 per step."""
    finals = {}
    for precision in ("fp32", "bf16"):
        run.raw_model.load_state_dict(run.init_state)
        opt = torch.optim.SGD(run.raw_model.parameters(), lr=run.args.lr, momentum=0.9)
        stream = micro_batch_stream(
            run.train_set, 8, run.info.world_size, run.info.rank, run.args.seed
        )
        for _step in range(run.args.steps):
            for micro_step in range(2):
                xb, yb = (t.to(run.info.device) for t in next(stream))
                with no_sync_unless(run.model, last=micro_step == 1):
                    with autocast_context(run.info.device, precision):
                        # autocast: logits bf16, loss fp32
                        loss = F.cross_entropy(run.model(xb), yb) / 2
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finals[precision] = [p.detach().clone() for p in run.raw_model.parameters()]
    bf16_diff = max_over_ranks(max_abs_diff_all(finals["bf16"], finals["fp32"]))
    change = max_over_ranks(max_abs_diff_all(finals["fp32"], run.init_state.values()))
    print0(f"\n3. bf16 autocast vs fp32 after {run.args.steps} optimizer steps")
    # bf16 keeps 8 significant bits (relative rounding up to 2^-8 = 0.4%) in matmul inputs and outputs; the
    # parameters, gradients and the update stay fp32: under 1% of the largest change here, well within 1e-3.
    run.report.claim(
        "bf16_close_to_fp32",
        bf16_diff,
        "<=",
        1e-3,
        "  max |parameter difference| {value:.1e} (largest fp32 parameter change {change:.1e})",
        change=change,
    )
    run.report.claim(
        "bf16_really_ran", bf16_diff, ">=", 1e-7, "  ... and not 0 (bf16 really ran): {value:.1e}"
    )


def fp16_with_grad_scaler(run: Run) -> torch.optim.Optimizer:
    """4. fp16 + GradScaler under accumulation: 8 micro-batches, k = 4 -> exactly 2 steps. Returns the
    optimizer (the double-unscale demo reuses it)."""
    dev = run.info.device
    scaler, k, errors = CountingScaler(dev.type), 4, 0
    opt = torch.optim.SGD(run.raw_model.parameters(), lr=run.args.lr)
    run.raw_model.load_state_dict(run.init_state)
    try:
        for micro_step in range(8):
            last = (micro_step + 1) % k == 0
            xb, yb = run.x[micro_step::8], run.y[micro_step::8]  # (B / 8, 1, 8, 8)
            with no_sync_unless(run.model, last):
                with autocast_context(dev, "fp16"):
                    loss = F.cross_entropy(run.model(xb), yb) / k
                scaler.scale(loss).backward()  # gradients carry the scale factor, accumulated
            if last:
                scaler.unscale_(opt)  # once: divides the accumulated gradients by the scale
                torch.nn.utils.clip_grad_norm_(
                    run.raw_model.parameters(), 1.0
                )  # on the true gradients
                # skipped if any inf/NaN; every rank sees the same synchronised gradients
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
    except Exception as e:  # counted, and claimed absent
        errors += 1
        run.report.value("scaler_error", f"{type(e).__name__}: {e}", "  GradScaler error: {value}")
    run.report.value(
        "scaler_counts",
        scaler.counts,
        "\n4. fp16 + GradScaler({device!r}), 8 micro-batches, k = {k}: {value}",
        device=dev.type,
        k=k,
    )
    for what in ("unscale_", "step", "update"):
        run.report.claim(
            f"scaler_{what.strip('_')}_calls",
            scaler.counts[what],
            "==",
            8 // k,
            "  {what}: {value} calls, once per optimizer step",
            what=what,
        )
    run.report.claim("scaler_errors", errors, "==", 0, "  errors: {value}")
    return opt


def double_unscale(run: Run, opt: torch.optim.Optimizer) -> None:
    """4, continued: the classic mistake, unscale_ on every micro-step, raises at the second."""
    wrong, message = torch.amp.GradScaler(run.info.device.type), "no error"
    for micro_step in range(2):
        with no_sync_unless(run.model, last=False):
            with autocast_context(run.info.device, "fp16"):
                wrong.scale(
                    F.cross_entropy(run.model(run.x[micro_step::8]), run.y[micro_step::8])
                ).backward()
        try:
            wrong.unscale_(opt)
        except RuntimeError as e:
            message = str(e).split("\n")[0]
    opt.zero_grad(set_to_none=True)
    run.report.value("double_unscale_error", message, "  unscale_ on every micro-step: {value}")
    text = "  ... the second unscale_ before update() raises: {value}"
    run.report.claim("double_unscale_raises", int("already been called" in message), "==", 1, text)


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        B, dev = args.micro_batch, info.device  # micro-batch per rank
        report = Report(info)
        train_set, _ = digits_split(path=args.data)  # (1438, 1, 8, 8), every rank
        set_seed(args.seed)
        raw_model = ResidualMLP(args.width, args.depth).to(dev)
        init_state = copy.deepcopy(raw_model.state_dict())
        model = DDP(raw_model, device_ids=info.device_ids) if info.distributed else raw_model
        counter = CommCounter().register(model) if info.distributed else CommCounter()
        idx = (torch.arange(B) + info.rank * B) % len(train_set)  # this rank's micro-batch
        x = train_set.tensors[0][idx].to(dev)  # (B, 1, 8, 8)
        y = train_set.tensors[1][idx].to(dev)  # (B,)
        report.record("world_size", info.world_size)
        report.record("micro_batch", B)
        report.record("width", args.width)
        report.record("depth", args.depth)
        report.value(
            "n_params",
            sum(p.numel() for p in raw_model.parameters()),
            "world_size {W}, ResidualMLP width {a.width} depth {a.depth}: {value} parameters; "
            "micro-batch {a.micro_batch} per rank",
            W=info.world_size,
            a=args,
        )
        run = Run(args, info, report, model, raw_model, init_state, train_set, x, y)
        held, n_state = bytes_held(run, counter)
        report_bytes_held(run, held, n_state)
        checkpointing_gradients(run)
        activation_table(raw_model, x, report)
        activation_savings(raw_model, x, report)
        bf16_vs_fp32(run)
        double_unscale(run, fp16_with_grad_scaler(run))
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
