"""Lesson 19: context parallelism -- the sequence split over ranks, ring attention by hand, load-balanced.

Run it:

    python lessons/19_context_parallel.py                                      # cp = 1: the whole sequence
    torchrun --standalone --nproc_per_node=2 lessons/19_context_parallel.py    # cp = 2
    torchrun --standalone --nproc_per_node=4 lessons/19_context_parallel.py    # cp = 4

All ranks form one cp group (`Grid(info, cp=world_size)`); each holds S/cp tokens of the same sequences, and
their activations in every layer. The zig-zag split cuts the 64-token digits into 2cp chunks, so cp is a power
of two (cp 3, 5, 6, 7 are refused with one line), and cp must divide --heads (8 by default, for Ulysses).

What to look for:
- Why the sequence is the problem: attention written out saves a B x H x S x S matrix for backward (4x the
  bytes at 2S); ring attention saves only O(S/cp) per rank (q, k, v, out and the log-sum-exp).
- Ring attention (common/context_parallel/ring_attention.py: keys and values travel around the cp ranks while
  each rank attends its queries to the block it holds): output and q, k, v gradients equal causal SDPA on the
  whole sequence; each rank sends cp - 1 key/value blocks forward, 2cp - 1 backward (their gradients travel
  home). At step s rank r holds rank (r - s) mod cp's block, identified from the values that arrived.
- Causal load balance: with contiguous chunks the last rank has most unmasked query-key pairs; the zig-zag
  split (chunks r and 2cp-1-r) gives every rank the same count. Counted exactly; the idle time is [perf].
- Training the causal transformer of common/models.py on the digits read as 64 pixel tokens with cp
  (common/context_parallel/training.py): it follows the one-process model and its loss falls.
- Ulysses: two all-to-alls switch the split from tokens to heads (cp must divide the heads); bytes compared.
  The default 8 heads give each rank >= 2 heads at cp 2 and 4, so a wrong head order would show.
- PyTorch's `torch.distributed.tensor.experimental.context_parallel`, tried on this build: what happened.

Sources: Liu et al. 2023, Ring Attention (https://arxiv.org/abs/2310.01889); Jacobs et al. 2023,
DeepSpeed-Ulysses (https://arxiv.org/abs/2309.14509); the Ultra-Scale Playbook's context-parallelism section
(https://huggingface.co/spaces/nanotron/ultrascale-playbook); picotron's context_parallel/; torchtitan's
context parallelism and https://pytorch.org/tutorials/prototype/context_parallel.html (CUDA only).
"""

from __future__ import annotations

import argparse
import copy
import textwrap
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from common.context_parallel.ring_attention import (
    RingStats,
    Split,
    causal_pairs,
    off_schedule,
    owners,
    ring_attention,
    time_forward,
)
from common.context_parallel.torch_cp import try_context_parallel
from common.context_parallel.training import (
    TrainedPair,
    held_out_loss,
    one_process_step,
    sum_grads,
    token_loss,
)
from common.context_parallel.ulysses import ulysses_attention
from common.data import PIXEL_VOCAB, digit_sequences, next_token_targets
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import all_gather_objects
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import count_collectives
from common.measure.differences import max_abs_diff, max_abs_diff_all, max_over_ranks, nan_max
from common.measure.memory import saved_bytes_of
from common.models import CausalTransformer
from common.planning.transformer import matmul_attention

TOL = 1e-5  # float32: sums of a few hundred terms in another order differ by ~1e-7 relative
D_MODEL, LAYERS, SEQ = 32, 2, 64  # the transformer; a digit is 64 pixel tokens
LR = 0.1  # SGD, momentum 0.9
NAIVE_S = (128, 256)  # where attention written out is measured


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=64, help="S of the checks (<= 1024), 2cp | S")
    p.add_argument("--heads", type=int, default=8, help="attention heads; cp must divide them")
    p.add_argument("--batch-size", type=int, default=32, help="sequences a step, on every cp rank")
    p.add_argument("--steps", type=int, default=30, help="training steps, at least 20")
    p.add_argument("--timing-seq-len", type=int, default=1024, help="S of the idle-time timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes its numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    check_args(args, cp=read_torchrun_env()[2])  # before any process group: all ranks fail alike
    return args


def check_args(args: argparse.Namespace, cp: int) -> None:
    """Refuse, with one line, what would make a claim fail or the splits impossible (cp = the world size)."""
    # the bound 1e-5 is absolute: q, k, v gradients sum over S terms
    if not 1 <= args.seq_len <= 1024:
        raise LessonError(f"--seq-len must be in 1..1024 (got {args.seq_len}): 1e-5 is absolute")
    if args.steps < 20 or args.batch_size < 1:
        raise LessonError("--steps must be >= 20 (time for the loss to fall), --batch-size >= 1")
    if args.heads < 1 or D_MODEL % args.heads:
        raise LessonError(f"--heads must divide the model width {D_MODEL}, got {args.heads}")
    if args.heads % cp:
        raise LessonError(
            f"cp = {cp} must divide the head count {args.heads}: Ulysses gives each rank "
            "heads/cp whole heads"
        )
    lengths = {
        "--seq-len": args.seq_len,
        "--timing-seq-len": args.timing_seq_len,
        "the digits": SEQ,
    }
    for name, s in lengths.items():
        if s < 1 or s % (2 * cp):
            raise LessonError(
                f"{name}: sequence length {s} is not divisible by 2 x cp = {2 * cp}: the "
                "zig-zag split cuts it into 2cp equal chunks"
            )


@dataclass
class Run:
    """What the sections share: options, rank, report, the grid (one cp group: S/cp tokens a rank)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    grid: Grid


def qkv(args, B: int, S: int, device) -> list[torch.Tensor]:
    """q, k, v of the whole sequence (B, H, S, D=8), the same on every rank (same seed)."""
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randn(B, args.heads, S, 8, generator=g).to(device) for _ in range(3)]


def activation_memory(run: Run) -> None:
    """Section 1: bytes saved for backward by attention, against S and against cp."""
    cp, cp_rank, dev = run.grid.size("cp"), run.grid.coords["cp"], run.info.device
    B, S = 2, run.args.seq_len
    # attention written out (the S x S scores and their softmax are tensors autograd keeps), fixed S
    naive = {s: saved_bytes_of(matmul_attention, qkv(run.args, B, s, dev)) for s in NAIVE_S}
    (s1, b1), (s2, b2) = naive.items()
    sizes = f"at S={s1}: {b1}, at S={s2}: {b2}"
    text = "attention written out, B={B} H={a.heads} D=8: bytes saved for backward {sizes}"
    run.report.value("naive_saved_bytes", naive, text, B=B, a=run.args, sizes=sizes)
    run.report.claim(
        "naive_attention_bytes_grow_with_s_squared",
        b2 / b1,
        ">=",
        3.0,
        "  doubling S multiplies them by {value:.2f} (the S x S softmax dominates; linear: 2)",
    )
    split = Split("zigzag", cp)
    whole = qkv(run.args, B, S, dev)
    one = saved_bytes_of(partial(ring_attention, split=Split("zigzag", 1)), whole)
    mine = [split.take(t, cp_rank, 2) for t in whole]
    ring = partial(ring_attention, split=split, group=run.grid.group("cp"))
    per_rank = saved_bytes_of(ring, mine)
    want = B * run.args.heads * (S // cp) * (4 * 8 + 1) * 4  # q, k, v, out: D floats a token; lse 1
    run.report.claim(
        "ring_saved_bytes_per_rank",
        per_rank,
        "==",
        want,
        "ring attention at cp={cp}: bytes saved per rank {value} = B x H x S/cp x (4D + 1) x 4\n"
        "  (q, k, v, out and the log-sum-exp; no S x S matrix)",
        cp=cp,
    )
    run.report.claim(
        "ring_saved_bytes_fall_with_cp",
        per_rank * cp / one,
        "==",
        1.0,
        "  x cp / the whole sequence on one process ({one} bytes) = {value}: 1/cp per rank",
        one=one,
    )


def ring_run(run: Run, kind: str, dout_seed: int = 1) -> dict:
    """Ring attention with `kind` split vs SDPA on the whole sequence, forward and backward."""
    cp_rank, group = run.grid.coords["cp"], run.grid.group("cp")
    split = Split(kind, run.grid.size("cp"))
    whole = [t.requires_grad_() for t in qkv(run.args, 2, run.args.seq_len, run.info.device)]
    ref = F.scaled_dot_product_attention(*whole, is_causal=True)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(dout_seed))
    dout = dout.to(run.info.device)
    ref.backward(dout)
    mine = [split.take(t.detach(), cp_rank, 2).requires_grad_() for t in whole]
    stats = RingStats(blocks=[])  # keep the key block in hand at each step, as it arrived
    out = ring_attention(*mine, split, group, stats)
    out.backward(split.take(dout, cp_rank, 2))
    diffs = [max_abs_diff(out, split.take(ref, cp_rank, 2))]
    diffs += [max_abs_diff(m.grad, split.take(w.grad, cp_rank, 2)) for m, w in zip(mine, whole)]
    block = sum(t.numel() * t.element_size() for t in mine[1:])  # this rank's k and v
    held = owners(stats.blocks, whole[1].detach(), split)  # whose keys they are, from their values
    diff = max_over_ranks(nan_max(diffs), group)
    return {"diff": diff, "stats": stats, "block": block, "held": held}


def ring_equals_full(run: Run) -> dict:
    """Section 2: ring attention = SDPA on the whole sequence; the bytes each rank sends, counted."""
    cp = run.grid.size("cp")
    rings = {kind: ring_run(run, kind) for kind in ("zigzag", "contiguous")}
    for kind, ring in rings.items():
        run.report.claim(
            f"ring_{kind}_equals_sdpa",
            ring["diff"],
            "<=",
            TOL,
            "ring attention, {kind} split, cp={cp}, S={S}: max |ring - SDPA on the whole sequence|\n"
            "  over output and q, k, v gradients = {value:.1e}",
            kind=kind,
            cp=cp,
            S=run.args.seq_len,
        )
    held = all_gather_objects(rings["zigzag"]["held"], run.info)  # held[r][s]: -1 if nobody's
    lines = [f"  rank {r}, steps 0..{cp - 1}: the blocks of ranks {h}" for r, h in enumerate(held)]
    run.report.value("ring_held", held, "\n".join(lines))
    run.report.claim(
        "ring_holds_rank_r_minus_s",
        off_schedule(held, cp),
        "==",
        0,
        "  (rank r, step s) where the block in hand, matched by its values, is not rank (r - s) mod "
        "cp's: {value}",
    )
    sent, block = rings["zigzag"]["stats"].sent, rings["zigzag"]["block"]
    run.report.claim(
        "ring_forward_bytes_sent",
        sent["forward"] / block,
        "==",
        cp - 1,
        "  bytes each rank hands to isend in forward: {sent} = {value:g} x its key/value block\n"
        "  ({block} bytes) = cp - 1 blocks, to the next rank only",
        sent=sent["forward"],
        block=block,
    )
    run.report.claim(
        "ring_backward_bytes_sent",
        sent["backward"] / block,
        "==",
        2 * cp - 1 if cp > 1 else 0,
        "  in backward: {sent} = {value:g} blocks = (cp - 1) key/value blocks again\n"
        "  + cp blocks of their gradients dk, dv (they travel on until they are home)",
        sent=sent["backward"],
    )
    return rings


def load_balance(run: Run, rings: dict) -> None:
    """Section 3: unmasked query-key pairs per rank, counted by the ring itself, for both splits."""
    cp, S, pairs = run.grid.size("cp"), run.args.seq_len, {}
    for kind in ("contiguous", "zigzag"):
        pairs[kind] = all_gather_objects(rings[kind]["stats"].pairs, run.info)
        text = "{kind} split: unmasked query-key pairs per rank {value}"
        run.report.value(f"pairs_{kind}", pairs[kind], text, kind=kind)
        run.report.claim(
            f"pairs_{kind}_total",
            sum(pairs[kind]),
            "==",
            causal_pairs(S),
            "  their sum {value} = S (S + 1) / 2 for S={S}: every causal pair once",
            S=S,
        )
        ratio = max(pairs[kind]) / min(pairs[kind])
        if kind == "contiguous":
            c = S // cp  # tokens a rank; rank r sees r whole chunks and its diagonal
            want = ((cp - 1) * c * c + causal_pairs(c)) / causal_pairs(c)
            text = "  max/min = {value:.2f} = ((cp-1) c^2 + c(c+1)/2) / (c(c+1)/2), c = S/cp\n"
            text += "  (the last rank works most)"
        else:
            want = 1.0
            text = "  max/min = {value}: chunks r and 2cp-1-r hold the same pairs on every rank"
        run.report.claim(f"pairs_{kind}_max_over_min", ratio, "==", want, text)
    if cp > 1:
        idle_time(run)


def idle_time(run: Run) -> None:
    """The step's idle time under each split, measured (a timing, so [perf]): wall time minus compute."""
    whole = qkv(run.args, 1, run.args.timing_seq_len, run.info.device)
    for kind in ("contiguous", "zigzag"):
        split = Split(kind, run.grid.size("cp"))
        mine = [split.take(t, run.grid.coords["cp"], 2) for t in whole]
        facts = all_gather_objects(time_forward(*mine, split, run.grid.group("cp")), run.info)
        wall = max(w for w, _ in facts)  # the step ends when the slowest rank does
        idle = [wall - c for _, c in facts]  # not computing: waiting for neighbours, or done
        run.report.perf(
            f"idle_{kind}",
            idle,
            "{kind}, S={S}, ring forward: wall {wall:.1f} ms; compute (ms) {compute}; idle {idle}",
            kind=kind,
            S=run.args.timing_seq_len,
            wall=wall * 1e3,
            compute=" ".join(f"{c * 1e3:.1f}" for _, c in facts),
            idle=" ".join(f"{i * 1e3:.1f}" for i in idle),
        )


def ulysses(run: Run, rings: dict) -> None:
    """Section 5: the heads split instead of the sequence, with two all-to-alls."""
    cp, cp_rank, group = run.grid.size("cp"), run.grid.coords["cp"], run.grid.group("cp")
    split = Split("contiguous", cp)  # all-to-all puts rank i's chunk in place i: contiguous
    whole = [t.requires_grad_() for t in qkv(run.args, 2, run.args.seq_len, run.info.device)]
    ref = F.scaled_dot_product_attention(*whole, is_causal=True)
    ref.square().sum().backward()
    mine = [split.take(t.detach(), cp_rank, 2).requires_grad_() for t in whole]
    with count_collectives() as fwd:
        out = ulysses_attention(*mine, group=group)
    with count_collectives() as bwd:
        out.square().sum().backward()
    diffs = [max_abs_diff(out, split.take(ref, cp_rank, 2))]
    diffs += [max_abs_diff(m.grad, split.take(w.grad, cp_rank, 2)) for m, w in zip(mine, whole)]
    run.report.claim(
        "ulysses_equals_sdpa",
        max_over_ranks(nan_max(diffs), group),
        "<=",
        TOL,
        "Ulysses at cp={cp}: max |Ulysses - SDPA| over output and q, k, v gradients = {value:.1e}",
        cp=cp,
    )
    run.report.claim(
        "ulysses_all_to_alls",
        fwd.calls.get("all_to_all_single", 0),
        "==",
        2 if cp > 1 else 0,
        "  all-to-alls in forward: {value} (q, k, v stacked; the output), in backward: {bwd}",
        bwd=bwd.calls.get("all_to_all_single", 0),
    )
    sent = fwd.bytes.get("all_to_all_single", 0) * (cp - 1) // cp  # (cp-1)/cp of each buffer leaves
    block = rings["zigzag"]["block"] // 2  # one of k, v: the same size as q
    run.report.claim(
        "ulysses_forward_bytes_sent",
        sent / block,
        "==",
        4 * (cp - 1) / cp,
        "  bytes each rank sends in forward: {sent} = {value:g} x {block} = 4 (cp-1)/cp x q's block\n"
        "  (q, k, v and out); the ring sends {ring} = 2 (cp-1) blocks",
        sent=sent,
        block=block,
        ring=rings["zigzag"]["stats"].sent["forward"],
    )


def train(run: Run) -> TrainedPair:
    """Section 4: the causal transformer trained with cp = world size, and the one-process model."""
    cp, group, dev = run.grid.size("cp"), run.grid.group("cp"), run.info.device
    set_seed(run.args.seed)
    full = CausalTransformer(PIXEL_VOCAB, D_MODEL, run.args.heads, LAYERS, max_len=SEQ).to(dev)
    split = Split("zigzag", cp)
    model = copy.deepcopy(full).set_attention(partial(ring_attention, split=split, group=group))
    positions = split.positions(run.grid.coords["cp"], SEQ).to(dev)  # chunks r and 2cp-1-r
    train_tokens, test_tokens = (t.to(dev) for t in digit_sequences())
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (full, model)]
    g = torch.Generator().manual_seed(run.args.seed)  # the same sequences on every cp rank
    test_before = held_out_loss(model, test_tokens, positions, group)
    losses = {"one_process": [], "cp": []}
    for _step in range(run.args.steps):
        pick = torch.randint(len(train_tokens), (run.args.batch_size,), generator=g).to(dev)
        x = train_tokens[pick]  # (B, 64)
        losses["one_process"].append(one_process_step(full, opts[0], x))  # the whole sequence
        loss_sum, total, n = token_loss(model, x, positions, group)
        opts[1].zero_grad()
        (loss_sum / n).backward()  # this rank's share of the mean over all B x 63 targets
        sum_grads(model, group)  # sum the shares: each rank's tokens gave part of every gradient
        opts[1].step()
        losses["cp"].append(total / n)
    run.report.record("losses", losses)
    targets = int((next_token_targets(x)[:, positions] != -100).sum())
    per_rank = all_gather_objects((loss_sum.item(), targets), run.info)
    run.report.value(
        "targets_per_rank",
        [c for _, c in per_rank],
        "training, zig-zag cp={cp}: targets per rank {value} (a sequence's last token has none)",
        cp=cp,
    )
    wrong = sum(s / c for s, c in per_rank) / cp
    run.report.value(
        "mean_of_means_error",
        abs(wrong - losses["cp"][-1]),
        "  last step: the mean of per-rank mean losses is off the token mean by {value:.1e}",
    )
    return TrainedPair(full, model, positions, test_tokens, test_before, losses)


def trained(run: Run, pair: TrainedPair) -> None:
    """Section 4's claims: the cp model followed the one-process model, and its test loss fell."""
    group = run.grid.group("cp")
    gaps = (abs(a - b) for a, b in zip(pair.losses["cp"], pair.losses["one_process"]))
    run.report.claim(
        "training_follows_one_process",
        max_over_ranks(nan_max(gaps), group),
        "<=",
        TOL,
        "  {steps} SGD steps: max |loss cp - loss one process| = {value:.1e}",
        steps=run.args.steps,
    )
    diff = max_over_ranks(max_abs_diff_all(pair.model.parameters(), pair.full.parameters()), group)
    run.report.claim(
        "training_params_equal_one_process",
        diff,
        "<=",
        TOL,
        "  max |parameter cp - parameter one process| after training = {value:.1e}",
    )
    after = held_out_loss(pair.model, pair.test_tokens, pair.positions, group)
    run.report.claim(
        "training_loss_falls",
        after / pair.test_before,
        "<=",
        0.8,
        "  test loss per pixel {before:.3f} before training, {after:.3f} after: ratio {value:.2f}",
        before=pair.test_before,
        after=after,
    )


def pytorch_context_parallel(run: Run) -> None:
    """Section 6: PyTorch's own context parallelism, tried here; what happened is a value, not a claim."""
    mesh, dev = run.grid.submesh("cp"), run.info.device
    outcome = "not tried: it needs a process group (torchrun)"
    if mesh is not None:
        tried = try_context_parallel(mesh, qkv(run.args, 2, run.args.seq_len, dev))
        outcome = all_gather_objects(tried, run.info)[0]  # rank 0's, as every rank's line
    where = f", cp={run.grid.size('cp')}, {dev.type}" if mesh is not None else ""
    wrapped = textwrap.fill(outcome, 110, initial_indent="  ", subsequent_indent="  ")
    text = "torch.distributed.tensor.experimental.context_parallel{where}:\n{wrapped}"
    run.report.value("pytorch_context_parallel", outcome, text, where=where, wrapped=wrapped)


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        run = Run(args, info, Report(info), Grid(info, cp=info.world_size))
        run.report.value("grid", run.grid.describe(), "\n".join(run.grid.describe()))
        activation_memory(run)  # 1. why the sequence is the problem
        rings = ring_equals_full(run)  # 2. ring attention = SDPA; its bytes
        load_balance(run, rings)  # 3. contiguous vs zig-zag work
        trained(run, train(run))  # 4. training with cp
        ulysses(run, rings)  # 5. the heads split
        pytorch_context_parallel(run)  # 6. what PyTorch ships
        run.report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
