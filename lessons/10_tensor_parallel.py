"""Lesson 10: tensor parallelism -- a layer split over ranks (column, row parallel), by hand and with DTensor.

Run it:

    python lessons/10_tensor_parallel.py                                      # tp = 1: nothing is split
    torchrun --standalone --nproc_per_node=2 lessons/10_tensor_parallel.py    # tp = 2
    torchrun --standalone --nproc_per_node=4 lessons/10_tensor_parallel.py    # tp = 4

All ranks form one tp group (`Grid(info, tp=world_size)`); every tp rank sees the same batch and holds 1/tp of
each split weight. A digit image is read as a sequence of S = 8 rows (tokens) of 8 pixels, embedded to H
features. tp must divide H, the head count and S (sequence parallelism splits the tokens): 1, 2, 4 or 8 ranks.

What to look for, section by section:
1. By hand (common/tensor_parallel/layers.py): the MLP block with fc1 split by output features (column
   parallel) and fc2 by input features (row parallel), joined by f (identity forward, all-reduce backward) and
   g (all-reduce forward, identity backward). Output, input gradient and every weight gradient equal the
   unsplit block (<= 1e-5); one all-reduce forward and one backward, each of B x S x H x 4 bytes.
   Self-attention split by heads costs the same one + one.
2. With PyTorch: `parallelize_module(block, grid.submesh("tp"), {"fc1": ColwiseParallel(), "fc2":
   RowwiseParallel()})` turns each parameter into a DTensor: a global tensor described by its mesh and one
   *placement* per mesh dimension. `Shard(d)`: each rank holds 1/tp of it along dimension d (fc1's weight is
   Shard(0), fc2's Shard(1)); `Replicate()`: every rank holds all of it (fc2's bias); `Partial()`: every rank
   holds a full-shape tensor and the value is their sum (what a row-parallel matmul produces before g).
   `t.redistribute(placements=[...])` changes a placement and runs the collective that takes
   (Partial -> Replicate: all-reduce; Shard -> Replicate: all-gather; Partial -> Shard: reduce-scatter);
   `t.full_tensor()` is redistribute-to-Replicate, then the local tensor. Same numbers and the same
   collectives as by hand. Attention with q, k and v each ColwiseParallel costs three all-reduces in backward
   (each projection sums its own input gradient), where the hand-built block shares one f.
3. Sequence parallelism (at tp > 1): LayerNorm works on S/tp tokens per rank, so around the MLP an all-gather
   (tokens in) and a reduce-scatter (tokens out) replace g's all-reduce, and in backward a reduce-scatter and
   an all-gather replace f's: the same bytes on a ring (an all-reduce is a reduce-scatter then an all-gather),
   and each rank saves fewer activation bytes. Not all of it, though: the LayerNorm's weight and bias are
   Replicate, and each rank's gradient of them comes from its own S/tp tokens only, so after backward they are
   Partial: measured, the worst rank's is at least (tp-1)/tp of it away. Two more all-reduces (one
   per parameter, H floats each) make them whole; the optimizer step runs them (measured), or `redistribute`.
4. Training on the digits: the split model's losses, parameters and held-out test loss follow the unsplit
   model's step by step. How far the loss falls depends on --steps, --batch-size and --lr (it is printed, and
   the test checks it at the defaults); what is claimed for every option is that the split model does exactly
   what the unsplit one does. A learning rate that makes the unsplit run diverge (NaN) fails every equality
   claim, as it must, and the lesson exits 1. The two runs: common/tensor_parallel/training.py.

Sources: Shoeybi et al. 2019, Megatron-LM, section 3 (https://arxiv.org/abs/1909.08053); Korthikanti et al.
2022, sequence parallelism (https://arxiv.org/abs/2205.05198);
https://pytorch.org/docs/stable/distributed.tensor.html (placements, redistribute),
https://pytorch.org/docs/stable/distributed.tensor.parallel.html and the tutorial
https://pytorch.org/tutorials/intermediate/TP_tutorial.html; torchtitan's
`distributed/tensor_parallel.py` for a full model's plan.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import count_collectives
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max
from common.measure.dtensor_counts import count_dtensor_collectives
from common.measure.memory import saved_bytes
from common.tensor_parallel.compare import placements, split_vs_unsplit, weight_bytes
from common.tensor_parallel.layers import (
    MLP,
    TPMLP,
    Block,
    SelfAttention,
    TPAttention,
    check_tp_degree,
    max_shard_diff,
)
from common.tensor_parallel.training import loss_on, train_both

SEQ = 8  # tokens per image: its 8 rows
TOL = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=32, help="H, features per token; tp divides it")
    p.add_argument("--heads", type=int, default=4, help="attention heads; tp divides them")
    p.add_argument("--batch-size", type=int, default=32, help="B, images per step, every tp rank")
    p.add_argument("--steps", type=int, default=40, help="training steps on the digits")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # validated before any process group: every rank fails alike, none waits
    if min(args.hidden, args.heads, args.batch_size, args.steps) < 1 or args.lr <= 0:
        raise LessonError("--hidden, --heads, --batch-size and --steps must be >= 1 and --lr > 0")
    tp = read_torchrun_env()[2]  # tp = the world size
    check_tp_degree(tp, args.hidden, args.heads)
    if SEQ % tp:  # section 3 gives each rank S/tp whole tokens; DTensor's Shard(1) needs equal ones
        raise LessonError(
            f"sequence parallelism splits an image's S = {SEQ} tokens over the tp ranks: "
            f"tp = {tp} must divide {SEQ} (1, 2, 4 or 8 processes)"
        )
    return args


@dataclass
class Run:
    """What the sections share: options, rank, report, the tp grid, the input x (B, S, H) every rank holds."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    grid: Grid
    x: torch.Tensor


def calls(c) -> str:
    """'all_gather x1, reduce_scatter x1': the calls of a CollectiveCount, as text."""
    return ", ".join(f"{op} x{n}" for op, n in sorted(c.calls.items())) or "none"


def counted(c, op: str = "all_reduce") -> tuple[int, int]:
    """(calls, bytes) of `op` in a CollectiveCount."""
    return c.calls.get(op, 0), c.bytes.get(op, 0)


def hand_built(run: Run) -> None:
    """Section 1: the Megatron MLP and attention, split by hand; equalities, collectives, weight bytes."""
    tp_rank, tp = run.grid.coords["tp"], run.grid.size("tp")
    B, S, H = run.x.shape
    act_bytes = B * S * H * run.x.element_size()  # what g sums in forward and f in backward
    want = 1 if tp > 1 else 0  # at tp = 1 f and g are identities: nothing to add up
    blocks = {
        "mlp": (MLP(H).to(run.x.device), TPMLP),
        "attention": (SelfAttention(H, run.args.heads).to(run.x.device), TPAttention),
    }
    for name, (full, split_class) in blocks.items():
        split = split_class(full, tp_rank, tp, run.grid.group("tp"))
        diff, fwd, bwd = split_vs_unsplit(full, split, run.x, run.grid, count_collectives)
        run.report.claim(
            f"hand_{name}_equals_unsplit",
            diff,
            "<=",
            TOL,
            "by hand, {block} at tp={tp}: max |split - unsplit| (output, gradients) = {value:.1e}",
            block=name,
            tp=tp,
        )
        (fc, fb), (bc, bb) = counted(fwd), counted(bwd)
        text = "  all-reduces in forward (g): {value}"
        run.report.claim(f"hand_{name}_allreduces_forward", fc, "==", want, text)
        text = "  all-reduces in backward (f): {value}"
        run.report.claim(f"hand_{name}_allreduces_backward", bc, "==", want, text)
        run.report.claim(
            f"hand_{name}_allreduce_bytes",
            fb + bb,
            "==",
            2 * want * act_bytes,
            "  bytes all-reduced, forward + backward: {value} = 2 x B x S x H x 4 at tp > 1",
        )
        # by construction (each shard is a chunk of the full matrix), so a number to read, not a claim
        run.report.value(
            f"hand_{name}_weight_bytes",
            [weight_bytes(split), weight_bytes(full)],
            "  weight-matrix bytes per rank: {value[0]} of {value[1]} (1/tp; biases left out)",
        )


def with_dtensor(run: Run) -> None:
    """Section 2: the same blocks split by parallelize_module; DTensor's collectives counted."""
    mesh, tp_rank = run.grid.submesh("tp"), run.grid.coords["tp"]
    H = run.x.shape[-1]
    full = MLP(H).to(run.x.device)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    split = parallelize_module(copy.deepcopy(full), mesh, plan)
    shown = placements(split)
    rows = "\n".join(f"  {name:<10} {placement}" for name, placement in shown.items())
    text = "parallelize_module, MLP: parameter placements\n{rows}"
    run.report.value("dtensor_mlp_placements", shown, text, rows=rows)
    diff, fwd, bwd = split_vs_unsplit(full, split, run.x, run.grid, count_dtensor_collectives)
    text = "  max |split - unsplit| (output, input and weight gradients) = {value:.1e}"
    run.report.claim("dtensor_mlp_equals_unsplit", diff, "<=", TOL, text)
    hand = TPMLP(full, tp_rank, run.grid.size("tp"), run.grid.group("tp"))
    _, hand_fwd, hand_bwd = split_vs_unsplit(full, hand, run.x, run.grid, count_collectives)

    def every(c):  # every op, not only the all-reduces
        return c.calls, c.bytes, c.groups

    same = (every(fwd), every(bwd)) == (every(hand_fwd), every(hand_bwd))
    run.report.claim(
        "dtensor_mlp_collectives_as_by_hand",
        int(same),
        "==",
        1,
        "  forward {fwd}, backward {bwd}: calls, bytes and group as by hand: {value}",
        fwd=calls(fwd),
        bwd=calls(bwd),
    )
    full = SelfAttention(H, run.args.heads).to(run.x.device)
    plan = {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "proj": RowwiseParallel(),
    }
    split = parallelize_module(copy.deepcopy(full), mesh, plan)
    diff, fwd, bwd = split_vs_unsplit(full, split, run.x, run.grid, count_dtensor_collectives)
    text = "parallelize_module, attention: max |split - unsplit| = {value:.1e}"
    run.report.claim("dtensor_attention_equals_unsplit", diff, "<=", TOL, text)
    run.report.value(
        "dtensor_attention_backward_allreduces",
        bwd.calls.get("all_reduce", 0),
        "  all-reduces in its backward: {value} (q, k and v each sum their input gradient; "
        "by hand: 1)",
    )


def sp_blocks(full: Block, mesh):
    """The block (x + mlp(norm2(x))) split two ways: tensor parallel only, and with sequence parallelism."""
    tp_plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    sp_plan = {
        "norm2": SequenceParallel(),  # (B, S/tp, H) in, (B, S/tp, H) out
        "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),  # all-gather the tokens: (B, S, H)
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter: (B, S/tp, H)
    }
    tp_block = parallelize_module(copy.deepcopy(full), mesh, tp_plan)
    sp_block = parallelize_module(copy.deepcopy(full), mesh, sp_plan)
    return tp_block, sp_block


def sequence_parallel(run: Run) -> None:
    """Section 3: LayerNorm on S/tp tokens per rank; all-gather + reduce-scatter instead of the all-reduce."""
    mesh, tp_rank, tp = run.grid.submesh("tp"), run.grid.coords["tp"], run.grid.size("tp")
    B, S, H = run.x.shape
    full = Block(H).to(run.x.device)  # x + mlp(norm2(x)), no attention
    tp_block, sp_block = sp_blocks(full, mesh)
    count = count_dtensor_collectives
    diff, fwd, bwd = split_vs_unsplit(full, sp_block, run.x, run.grid, count, shard_seq=True)
    text = "sequence parallel block (norm + MLP): max |split - unsplit| on this rank's tokens = {value:.1e}"
    run.report.claim("sequence_parallel_equals_unsplit", diff, "<=", TOL, text)
    one_each = fwd.calls == bwd.calls == {"all_gather": 1, "reduce_scatter": 1}
    run.report.claim(
        "sequence_parallel_collectives",
        int(one_each),
        "==",
        1,
        "  one all-gather + one reduce-scatter each way: {value} (forward: {fwd})",
        fwd=calls(fwd),
    )
    norm_gradients(run, sp_block, full)
    # the block without sequence parallelism, forward + backward
    with count_dtensor_collectives() as without:
        tp_block(run.x.clone().requires_grad_()).sum().backward()
    sp_ops = ("all_gather", "reduce_scatter")
    sp_bytes = sum(c.bytes.get(op, 0) for c in (fwd, bwd) for op in sp_ops)
    ar_bytes = counted(without)[1]
    # Ring costs per rank for a buffer of N bytes: all-reduce 2 (tp-1)/tp N, all-gather and reduce-scatter
    # (tp-1)/tp N each. So the same bytes travel when the gathered + scattered buffers are twice the
    # all-reduced ones.
    run.report.claim(
        "sequence_parallel_same_bytes",
        sp_bytes / (2 * ar_bytes),
        "==",
        1,
        "  all-gather + reduce-scatter bytes {sp} / (2 x {ar} all-reduced without) = {value}",
        sp=sp_bytes,
        ar=ar_bytes,
    )
    saved = {}
    for name, block, xin in (
        ("tp", tp_block, run.x),
        ("sp", sp_block, run.x.chunk(tp, 1)[tp_rank]),
    ):
        with saved_bytes(exclude=list(block.parameters())) as s:
            block(xin.clone().requires_grad_()).sum().backward()
        saved[name] = s.bytes
    norm_saved = (
        B * S * H + 2 * B * S
    ) * run.x.element_size()  # LayerNorm keeps its input, mean and 1/std
    run.report.claim(
        "sequence_parallel_saves_less",
        saved["tp"] - saved["sp"],
        "==",
        norm_saved * (tp - 1) // tp,
        "  activation bytes saved per rank: {tp} -> {sp}, {value} fewer (the norm's, x (tp-1)/tp)",
        tp=saved["tp"],
        sp=saved["sp"],
    )


def norm_gradients(run: Run, sp_block: Block, full: Block) -> None:
    """The sequence-parallel LayerNorm's weight and bias gradients, right after backward: Partial (each rank
    holds its tokens' share), until an all-reduce per parameter (redistribute, or the optimizer step) sums
    them."""
    pairs = [(sp_block.norm2.weight, full.norm2.weight), (sp_block.norm2.bias, full.norm2.bias)]
    kinds = sorted({", ".join(map(repr, p.grad.placements)) for p, _ in pairs})
    # The tp shares sum to the full gradient g, so the worst rank's share is at least (tp-1)/tp |g| away from
    # g (0.5 at tp = 2): bound 0.25. A gradient already summed in backward would be 0 away and fail it.
    off = [(p.grad.to_local() - f.grad).norm().item() / f.grad.norm().item() for p, f in pairs]
    run.report.claim(
        "sequence_parallel_norm_grads_partial",
        max_over_ranks(nan_max(off)),
        ">=",
        0.25,
        "  LayerNorm weight, bias gradients: {kinds}, worst |local - full| / |full| = {value:.2f}",
        kinds=", ".join(kinds),
    )
    with count_dtensor_collectives() as summed:
        whole = [p.grad.redistribute(placements=[Replicate()]) for p, _ in pairs]
    after = nan_max(max_abs_diff(w.to_local(), f.grad) for w, (_, f) in zip(whole, pairs))
    run.report.claim(
        "sequence_parallel_norm_grad_allreduces",
        counted(summed)[0],
        "==",
        len(pairs),
        "  redistribute(Partial -> Replicate): {calls}, {value} more all-reduces, one per parameter",
        calls=calls(summed),
    )
    text = "  ... after them, max |local - full| = {value:.1e}"
    run.report.claim(
        "sequence_parallel_norm_grads_equal_after", max_over_ranks(after), "<=", TOL, text
    )
    # lr 0: only to see what a step communicates
    opt = torch.optim.SGD([p for p, _ in pairs], lr=0.0)
    with count_dtensor_collectives() as stepped:
        opt.step()
    run.report.value(
        "sequence_parallel_norm_step_allreduces",
        counted(stepped)[0],
        "  an optimizer step on these Partial gradients all-reduces them itself: {value} "
        "all-reduces",
    )


def train(run: Run) -> None:
    """Section 4: the split model trains on the digits exactly like the unsplit one."""
    trained = train_both(run.grid, run.args)
    run.report.record("losses", trained.losses)
    bad = [i for i, loss in enumerate(trained.losses["unsplit"]) if not math.isfinite(loss)]
    if bad:  # the equality claims below then fail on NaN, as they must; say why once
        loss = trained.losses["unsplit"][bad[0]]
        print0(
            f"training: the unsplit run itself diverged at step {bad[0]} "
            f"(loss {loss}): --lr {run.args.lr:g} is too large for this model and batch"
        )
    gap = max_over_ranks(
        nan_max(abs(a - b) for a, b in zip(trained.losses["unsplit"], trained.losses["split"]))
    )
    run.report.claim(
        "training_follows_unsplit",
        gap,
        "<=",
        TOL,
        "training, {steps} SGD steps at tp={tp}: max |loss split - loss unsplit| = {value:.1e}",
        steps=run.args.steps,
        tp=run.grid.size("tp"),
    )
    params_diff = max_over_ranks(max_shard_diff(trained.full, trained.split, run.grid.coords["tp"]))
    text = "  max |parameter shard - unsplit slice| after training = {value:.1e}"
    run.report.claim("training_params_equal_unsplit", params_diff, "<=", TOL, text)
    after = {
        name: loss_on(m, trained.test)
        for name, m in (("unsplit", trained.full), ("split", trained.split))
    }
    run.report.claim(
        "training_test_loss_equals_unsplit",
        max_over_ranks(abs(after["split"] - after["unsplit"])),
        "<=",
        TOL,
        "  held-out test loss, split vs unsplit model: max |difference| = {value:.1e}",
    )
    run.report.value(
        "test_loss_ratio",
        after["split"] / trained.before,
        "  test loss of the split model {before:.3f} before training, {after:.3f} after: "
        "ratio {value:.2f}",
        before=trained.before,
        after=after["split"],
    )
    with torch.no_grad():
        accuracy = (
            (trained.split(trained.test[0]).argmax(1) == trained.test[1]).float().mean().item()
        )
    run.report.value("test_accuracy", accuracy, "  test accuracy of the split model: {value:.3f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        report = Report(info)
        grid = Grid(info, tp=info.world_size)
        report.value("grid", grid.describe(), "\n".join(grid.describe()))
        set_seed(args.seed)
        # x (B, S, H): the same on every rank (same seed)
        x = torch.randn(args.batch_size, SEQ, args.hidden).to(info.device)
        run = Run(args, info, report, grid, x)
        hand_built(run)  # 1. by hand
        if grid.size("tp") > 1:  # at tp = 1 there is nothing to split
            with_dtensor(run)  # 2. with parallelize_module
            sequence_parallel(run)  # 3. sequence parallelism
        else:
            print0("tp = 1: parallelize_module and sequence parallelism skipped: nothing to split")
        train(run)  # 4. training on the digits
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
