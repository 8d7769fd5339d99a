"""Lesson 08: the memory of a data-parallel rank -- what it holds, and what mixed precision, GradScaler,
accumulation and activation checkpointing change.

    python lessons/08_memory.py                                        # one process
    torchrun --standalone --nproc_per_node=2 lessons/08_memory.py      # 2 ranks: the table adds DDP buckets
    torchrun --standalone --nproc_per_node=2 lessons/08_memory.py --micro-batch 512 --width 512
    python benchmarks/memory_speed.py                                  # step time of each setting, CUDA peak

What to look for:
1. The bytes a rank holds after one Adam step, measured from the tensors (storage bytes, each storage once):
   parameters P, gradients P, DDP's buckets P (a flat copy of the gradients that the all-reduce works on),
   Adam's state 2P (exp_avg and exp_avg_sq, fp32) plus a 4-byte `step` per parameter tensor, and the
   activations of one micro-batch. Every data-parallel rank holds all of it: the replicated parameters,
   gradients and optimizer state are what sharding (ZeRO, FSDP) cuts; activations are what accumulation and
   checkpointing cut.
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

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.data import digits_split
from common.harness.env import LessonError
from common.harness.ranks import print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import CommCounter
from common.measure.memory import (
    ResidualMLP,
    micro_batch_stream,
    no_sync_unless,
    residual_mlp_activation_bytes,
    saved_activation_bytes,
    storage_bytes,
)
from common.measure.precision import autocast_context, max_diff, worst_over_ranks

TOL = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--micro-batch",
        type=int,
        default=128,
        help="samples per rank per forward (a multiple of 4)",
    )
    p.add_argument(
        "--width", type=int, default=256, help="hidden width of the residual MLP (default 256)"
    )
    p.add_argument("--depth", type=int, default=4, help="residual blocks (default 4)")
    p.add_argument(
        "--steps", type=int, default=5, help="optimizer steps of the bf16 vs fp32 run (default 5)"
    )
    p.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate of that run (default 0.05)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
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
def bytes_a_rank_holds(raw_model, optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state of one rank in bytes, each storage counted once.

    Call it after `optimizer.step()` and before `zero_grad`, when all three exist. For Adam the state is
    exp_avg and exp_avg_sq (one fp32 tensor per parameter each) and a 0-d fp32 `step` per parameter tensor.
    """
    params = list(raw_model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params),
        "optimizer_state": storage_bytes(state),
        "all_three_counted_together": storage_bytes([*params, *(p.grad for p in params), *state]),
    }


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts its unscale_/step/update calls (for the once-per-optimizer-step claims)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer):
        self.counts["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.counts["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.counts["update"] += 1
        return super().update(new_scale)


def bytes_held(model, raw_model, counter, x, y, info, report: Report) -> None:
    """1. One DDP + Adam step, then count what this rank holds."""
    B, w, d = (
        len(x),
        raw_model.stem.out_features,
        len(raw_model.blocks),
    )  # micro-batch, width, depth
    F.cross_entropy(
        model(x), y
    ).backward()  # warm-up: DDP builds its final buckets after iteration 1
    raw_model.zero_grad(set_to_none=True)
    optimizer = torch.optim.Adam(raw_model.parameters(), lr=1e-3)
    counter.reset()
    F.cross_entropy(
        model(x), y
    ).backward()  # (B, 10) logits; the gradients are all-reduced in buckets
    optimizer.step()
    held = bytes_a_rank_holds(raw_model, optimizer)
    held["ddp_buckets"] = (
        counter.bytes
    )  # the flat bucket buffers of one all-reduce round (0 without DDP)
    held["activations"] = saved_activation_bytes(raw_model, lambda: raw_model(x))
    optimizer.zero_grad(set_to_none=True)
    P = 4 * sum(p.numel() for p in raw_model.parameters())
    rows = ["parameters", "gradients", "ddp_buckets", "optimizer_state", "activations"]
    total = sum(held[r] for r in rows)
    table = "\n".join(
        f"  {r:<16} {held[r]:>10} {held[r] / P:>6.2f} P {100 * held[r] / total:>5.1f}%"
        for r in rows
    )
    report.value(
        "bytes_held",
        held,
        f"\n1. bytes this rank holds after one Adam step (P = 4 x parameters = "
        f"{P} bytes):\n{table}",
    )
    report.claim(
        "parameter_bytes_exact", held["parameters"], "==", P, "  parameters = P = {value} bytes"
    )
    report.claim(
        "gradient_bytes_exact", held["gradients"], "==", P, "  gradients = P = {value} bytes"
    )
    report.claim(
        "adam_state_bytes_exact",
        held["optimizer_state"],
        "==",
        2 * P + 4 * len(optimizer.state),
        f"  Adam state = 2P + 4 bytes x {len(optimizer.state)} step counters = {{value}} bytes",
    )
    report.claim(
        "storages_not_shared",
        held["all_three_counted_together"],
        "==",
        held["parameters"] + held["gradients"] + held["optimizer_state"],
        "  parameters, gradients and state counted together: {value} bytes, no storage shared",
    )
    if (
        info.distributed
    ):  # gradient_as_bucket_view=True would make .grad views into the buckets: P saved
        report.claim(
            "ddp_bucket_bytes_exact",
            held["ddp_buckets"],
            "==",
            P,
            "  DDP buckets = P = {value} bytes",
        )
    report.claim(
        "activation_bytes_exact",
        held["activations"],
        "==",
        residual_mlp_activation_bytes(B, w, d),
        f"  activations = 4 x {B} x (64 + {w} x (3 x {d} + 2)) = {{value}} bytes",
    )
    report.value(
        "replicated_state_share",
        1 - held["activations"] / total,
        "  replicated on every rank (what sharding cuts): {value:.1%} of the total",
    )


def act_bytes(raw_model, x, batch: int, ck: bool, precision: str = "fp32") -> int:
    """Saved-tensor bytes of one forward of x[:batch], with or without checkpointing, under `precision`."""
    raw_model.checkpointing = ck
    with autocast_context(x.device, precision):
        # a copy: the slice x[:batch] is a view that keeps (and would count) all of x's storage
        n = saved_activation_bytes(raw_model, lambda: raw_model(x[:batch].clone()))
    raw_model.checkpointing = False
    return n


def activations(model, raw_model, x, y, info, report: Report) -> None:
    """2. Activations: checkpointing, accumulation, bf16."""
    B, w, d = (
        len(x),
        raw_model.stem.out_features,
        len(raw_model.blocks),
    )  # micro-batch, width, depth
    grads = {}
    for ck in (False, True):  # synchronised backward under DDP, with and without checkpointing
        raw_model.checkpointing = ck
        F.cross_entropy(model(x), y).backward()
        grads[ck] = [p.grad.detach().clone() for p in raw_model.parameters()]
        raw_model.zero_grad(set_to_none=True)
    print0("\n2. activations (saved-tensor bytes of one forward, parameters excluded)")
    gap = worst_over_ranks([max_diff(grads[True], grads[False])], info)[0]
    report.claim(
        "checkpointing_same_gradients",
        gap,
        "<=",
        TOL,
        "  checkpointing vs plain: gradients differ by {value:.1e}",
    )
    by_micro = [
        {
            "micro_batch": b,
            "plain_bytes": act_bytes(raw_model, x, b, False),
            "checkpointing_bytes": act_bytes(raw_model, x, b, True),
        }
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        if b <= B
    ]
    lines = [
        f"  {r['micro_batch']:>11} {r['plain_bytes']:>12} {r['checkpointing_bytes']:>20}"
        for r in by_micro
    ]
    report.value(
        "activation_bytes_by_micro_batch",
        by_micro,
        "  micro-batch  plain bytes  checkpointing bytes\n" + "\n".join(lines),
    )
    off = sum(
        r["plain_bytes"] != residual_mlp_activation_bytes(r["micro_batch"], w, d)
        or r["checkpointing_bytes"] != residual_mlp_activation_bytes(r["micro_batch"], w, d, True)
        for r in by_micro
    )
    report.claim(
        "activation_rows_off_formula",
        off,
        "==",
        0,
        "  rows that differ from 4 B (64 + w (3d + 2)) and 4 B (64 + w (d + 2)): {value}",
    )
    plain_b, ck_b = act_bytes(raw_model, x, B, False), act_bytes(raw_model, x, B, True)
    cut = 1 - ck_b / plain_b
    # 40% is the bar at the default shape; a shallow or narrow model saves less: there the shapes' cut is it
    shapes_cut = 1 - residual_mlp_activation_bytes(B, w, d, True) / residual_mlp_activation_bytes(
        B, w, d
    )
    report.claim(
        "checkpointing_cut",
        cut,
        ">=",
        min(0.40, shapes_cut),
        f"  checkpointing at micro-batch {B}: {{value:.1%}} fewer activation bytes (the shapes say "
        f"{shapes_cut:.1%})",
    )
    if (w, d) == (256, 4):
        report.claim(
            "checkpointing_cut_as_stated",
            abs(cut - 0.56),
            "<=",
            0.01,
            "  ... |cut - 56%| = {value:.3f} (the docstring's number at width 256, depth 4)",
        )
    saved = {
        "plain": plain_b,
        "accumulation k=4": act_bytes(raw_model, x, B // 4, False),
        "bf16 autocast": act_bytes(raw_model, x, B, False, "bf16"),
        "checkpointing": ck_b,
    }
    report.value(
        "saved_activation_bytes",
        saved,
        "  one optimizer step's activations: "
        + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in saved.items()),
    )
    report.claim(
        "accumulation_k4_activation_share",
        saved["accumulation k=4"] / plain_b,
        "<=",
        0.3,
        "  accumulation, k = 4 micro-batches of B / 4: {value:.3f} x plain",
    )
    report.claim(
        "checkpointing_activation_share",
        ck_b / plain_b,
        "<=",
        max(0.6, 1 - shapes_cut),
        "  checkpointing: {value:.3f} x plain",
    )
    bf16_activations(raw_model, saved, plain_b, report)


def bf16_activations(raw_model, saved: dict, plain_b: int, report: Report) -> None:
    """2, continued: what bf16 autocast saves, and the bf16 weight copies it keeps."""
    # autocast saves a bf16 copy of a Linear's weight when backward needs it for the input's gradient: every
    # Linear but the stem, whose input x needs none. Activations: half of plain, all of them in bf16.
    copies = 2 * sum(
        p.numel()
        for n, p in raw_model.named_parameters()
        if n.endswith("weight") and n[:4] != "stem"
    )
    report.claim(
        "bf16_activation_bytes_exact",
        saved["bf16 autocast"],
        "==",
        plain_b // 2 + copies,
        f"  bf16 autocast: {{value}} bytes = plain / 2 + {copies} bytes of bf16 weight copies",
    )
    outweigh = copies >= plain_b / 2
    why = (
        "(its bf16 weight copies outweigh the halving)"
        if outweigh
        else "(the halving outweighs its copies)"
    )
    report.claim(
        "bf16_activation_share",
        saved["bf16 autocast"] / plain_b,
        ">=" if outweigh else "<=",
        1.0,
        "  bf16 autocast: {value:.3f} x plain " + why,
    )


def bf16_vs_fp32(model, raw_model, init_state, train_set, args, info, report: Report) -> None:
    """3. bf16 autocast vs fp32: the same SGD run, k = 2 micro-batches of 8 per step."""
    finals = {}
    for precision in ("fp32", "bf16"):
        raw_model.load_state_dict(init_state)
        opt = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=0.9)
        stream = micro_batch_stream(train_set, 8, info.world_size, info.rank, args.seed)
        for _step in range(args.steps):
            for micro_step in range(2):
                xb, yb = (t.to(info.device) for t in next(stream))
                with no_sync_unless(model, last=micro_step == 1):
                    with autocast_context(info.device, precision):
                        loss = (
                            F.cross_entropy(model(xb), yb) / 2
                        )  # autocast: logits bf16, loss fp32
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finals[precision] = [p.detach().clone() for p in raw_model.parameters()]
    bf16_diff, change = worst_over_ranks(
        [max_diff(finals["bf16"], finals["fp32"]), max_diff(finals["fp32"], init_state.values())],
        info,
    )
    print0(f"\n3. bf16 autocast vs fp32 after {args.steps} optimizer steps")
    # bf16 keeps 8 significant bits (relative rounding up to 2^-8 = 0.4%) in matmul inputs and outputs; the
    # parameters, gradients and the update stay fp32: under 1% of the largest change here, well within 1e-3.
    report.claim(
        "bf16_close_to_fp32",
        bf16_diff,
        "<=",
        1e-3,
        f"  max |parameter difference| {{value:.1e}} (largest fp32 parameter change {change:.1e})",
    )
    report.claim(
        "bf16_really_ran", bf16_diff, ">=", 1e-7, "  ... and not 0 (bf16 really ran): {value:.1e}"
    )


def fp16_with_grad_scaler(model, raw_model, init_state, x, y, args, info, report: Report):
    """4. fp16 + GradScaler under accumulation: 8 micro-batches, k = 4 -> exactly 2 steps. Returns the
    optimizer (the double-unscale demo reuses it)."""
    dev = info.device
    scaler, k, errors = CountingScaler(dev.type), 4, 0
    opt = torch.optim.SGD(raw_model.parameters(), lr=args.lr)
    raw_model.load_state_dict(init_state)
    try:
        for micro_step in range(8):
            last = (micro_step + 1) % k == 0
            xb, yb = x[micro_step::8], y[micro_step::8]  # (B / 8, 1, 8, 8)
            with no_sync_unless(model, last):
                with autocast_context(dev, "fp16"):
                    loss = F.cross_entropy(model(xb), yb) / k
                scaler.scale(loss).backward()  # gradients carry the scale factor, accumulated
            if last:
                scaler.unscale_(opt)  # once: divides the accumulated gradients by the scale
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)  # on the true gradients
                scaler.step(
                    opt
                )  # skipped if any inf/NaN; every rank sees the same synchronised gradients
                scaler.update()
                opt.zero_grad(set_to_none=True)
    except Exception as e:  # counted, and claimed absent
        errors += 1
        report.value("scaler_error", f"{type(e).__name__}: {e}", "  GradScaler error: {value}")
    report.value(
        "scaler_counts",
        scaler.counts,
        f"\n4. fp16 + GradScaler({dev.type!r}), 8 micro-batches, k = {k}: {{value}}",
    )
    for what in ("unscale_", "step", "update"):
        report.claim(
            f"scaler_{what.strip('_')}_calls",
            scaler.counts[what],
            "==",
            8 // k,
            f"  {what}: {{value}} calls, once per optimizer step",
        )
    report.claim("scaler_errors", errors, "==", 0, "  errors: {value}")
    return opt


def double_unscale(model, opt, x, y, info, report: Report) -> None:
    """4, continued: the classic mistake, unscale_ on every micro-step, raises at the second."""
    wrong, message = torch.amp.GradScaler(info.device.type), "no error"
    for micro_step in range(2):
        with no_sync_unless(model, last=False):
            with autocast_context(info.device, "fp16"):
                wrong.scale(F.cross_entropy(model(x[micro_step::8]), y[micro_step::8])).backward()
        try:
            wrong.unscale_(opt)
        except RuntimeError as e:
            message = str(e).split("\n")[0]
    opt.zero_grad(set_to_none=True)
    report.value("double_unscale_error", message, "  unscale_ on every micro-step: {value}")
    report.claim(
        "double_unscale_raises",
        int("already been called" in message),
        "==",
        1,
        "  ... the second unscale_ before update() raises: {value}",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        W, B, dev, w, d = info.world_size, args.micro_batch, info.device, args.width, args.depth
        report = Report(info)
        train_set, _ = digits_split(path=args.data)  # (1438, 1, 8, 8), every rank
        set_seed(args.seed)
        raw_model = ResidualMLP(w, d).to(dev)
        init_state = copy.deepcopy(raw_model.state_dict())
        model = raw_model
        if info.distributed:
            model = DDP(raw_model, device_ids=[info.local_rank] if dev.type == "cuda" else None)
        counter = CommCounter().register(model) if info.distributed else CommCounter()
        idx = (torch.arange(B) + info.rank * B) % len(train_set)  # this rank's micro-batch
        x, y = (
            train_set.tensors[0][idx].to(dev),
            train_set.tensors[1][idx].to(dev),
        )  # (B, 1, 8, 8), (B,)
        n_params = sum(p.numel() for p in raw_model.parameters())
        report.results.update(world_size=W, micro_batch=B, width=w, depth=d)
        report.value(
            "n_params",
            n_params,
            f"world_size {W}, ResidualMLP width {w} depth {d}: {{value}} "
            f"parameters; micro-batch {B} per rank",
        )
        bytes_held(model, raw_model, counter, x, y, info, report)
        activations(model, raw_model, x, y, info, report)
        bf16_vs_fp32(model, raw_model, init_state, train_set, args, info, report)
        opt = fp16_with_grad_scaler(model, raw_model, init_state, x, y, args, info, report)
        double_unscale(model, opt, x, y, info, report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
