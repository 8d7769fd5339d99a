"""Lesson 10: tensor parallelism -- one layer split over ranks (column and row parallel), by hand and with DTensor.

Run it:

    python lessons/10_tensor_parallel.py                                      # tp = 1: nothing is split
    torchrun --standalone --nproc_per_node=2 lessons/10_tensor_parallel.py    # tp = 2
    torchrun --standalone --nproc_per_node=4 lessons/10_tensor_parallel.py    # tp = 4

All ranks form one tp group (`Grid(info, tp=world_size)`); every tp rank sees the same batch and holds 1/tp of
each split weight. A digit image is read as a sequence of S = 8 rows (tokens) of 8 pixels, embedded to H features.

What to look for:
- By hand (common/tensor_parallel.py): the MLP block with fc1 split by output features (column parallel) and fc2
  by input features (row parallel), joined by f (identity forward, all-reduce backward) and g (all-reduce
  forward, identity backward). Output, input gradient and every weight gradient equal the unsplit block
  (<= 1e-5); one all-reduce forward and one backward, each of B x S x H x 4 bytes, in the tp group; each rank
  holds 1/tp of the weight matrices. Self-attention split by heads costs the same one + one.
- With PyTorch: `parallelize_module(block, grid.submesh("tp"), {"fc1": ColwiseParallel(), "fc2":
  RowwiseParallel()})` gives the same numbers and the same collectives. Attention with q, k and v each
  ColwiseParallel costs three all-reduces in backward (each projection sums its own input gradient), where the
  hand-built block shares one f.
- Sequence parallelism (at tp > 1): LayerNorm works on S/tp tokens per rank; an all-gather and a reduce-scatter
  replace each all-reduce (the same bytes: a ring all-reduce is a reduce-scatter then an all-gather) and each
  rank saves fewer activation bytes for backward.
- Training on the digits: the split model's losses and parameters follow the unsplit model's step by step.

Sources: Shoeybi et al. 2019, Megatron-LM, section 3 (https://arxiv.org/abs/1909.08053); Korthikanti et al. 2022,
sequence parallelism (https://arxiv.org/abs/2205.05198);
https://pytorch.org/docs/stable/distributed.tensor.parallel.html and the tutorial
https://pytorch.org/tutorials/intermediate/TP_tutorial.html; torchtitan's
`distributed/tensor_parallel.py` for a full model's plan.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from common.counters import count_collectives
from common.data import digits_split
from common.dtensor_counts import count_dtensor_collectives, saved_local_bytes
from common.grid import Grid
from common.ranks import print0
from common.results import Report
from common.session import (LessonError, add_distributed_args, distributed_session, read_torchrun_env, run_main,
                            set_seed)
from common.tensor_parallel import (MLP, Block, SelfAttention, TPAttention, TPMLP, check_tp_degree,
                                    digits_transformer, max_over_ranks, max_shard_diff, tensor_parallelize)

SEQ = 8  # tokens per image: its 8 rows
TOL = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=32, help="H, features per token; tp must divide it")
    p.add_argument("--heads", type=int, default=4, help="attention heads; tp must divide them (default 4)")
    p.add_argument("--batch-size", type=int, default=32, help="B, images per step, the same on every tp rank")
    p.add_argument("--steps", type=int, default=40, help="training steps on the digits (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # validated before any process group: every rank fails alike, none waits
    if min(args.hidden, args.heads, args.batch_size) < 1 or args.steps < 10 or args.lr <= 0:
        raise LessonError("--hidden, --heads and --batch-size must be >= 1, --steps >= 10 and --lr > 0")
    check_tp_degree(read_torchrun_env()[2], args.hidden, args.heads)  # tp = the world size
    return args


def split_vs_unsplit(full, split, x, grid: Grid, counter, shard_seq: bool = False):
    """Run both on x (B, S, H) with the loss sum(y**2) / (B*S*H); return the largest difference (over all
    ranks) of output, input gradient and weight gradients, and the collectives `counter` saw in the split
    forward and backward.
    shard_seq: the split module reads and writes this rank's S/tp tokens (sequence parallelism)."""
    tp_rank, tp = grid.coords["tp"], grid.size("tp")
    cut = (lambda t: t.chunk(tp, 1)[tp_rank]) if shard_seq else (lambda t: t)  # (B, S, H) -> (B, S/tp, H)
    xf = x.clone().requires_grad_()
    yf = full(xf)
    yf.square().sum().div(yf.numel()).backward()  # a mean, as training losses are: O(1) gradients
    xs = cut(x).clone().requires_grad_()
    with counter() as fwd:
        ys = split(xs)
    with counter() as bwd:
        ys.square().sum().div(yf.numel()).backward()  # the same per-element gradient with S/tp tokens
    diffs = [(ys - cut(yf)).abs().max().item(), (xs.grad - cut(xf.grad)).abs().max().item(),
             max_shard_diff(full, split, tp_rank, grads=True)]
    return max_over_ranks(max(diffs)), fwd, bwd


def calls(c) -> str:
    """'all_gather x1, reduce_scatter x1': the calls of a CollectiveCount, as text."""
    return ", ".join(f"{op} x{n}" for op, n in sorted(c.calls.items())) or "none"


def counted(c, op: str = "all_reduce") -> tuple[int, int, set]:
    """(calls, bytes, groups) of `op` in a CollectiveCount."""
    return c.calls.get(op, 0), c.bytes.get(op, 0), {g for (o, g) in c.groups if o == op}


def hand_built(report: Report, grid: Grid, x: torch.Tensor, heads: int) -> None:
    """Section 1: the Megatron MLP and attention, split by hand; equalities, collectives, weight bytes."""
    tp_rank, tp = grid.coords["tp"], grid.size("tp")
    B, S, H = x.shape
    act_bytes = B * S * H * x.element_size()  # what g sums in forward and f in backward
    want = 1 if tp > 1 else 0  # at tp = 1 f and g are identities: nothing to add up
    for name, full in (("mlp", MLP(H).to(x.device)), ("attention", SelfAttention(H, heads).to(x.device))):
        split = (TPMLP if name == "mlp" else TPAttention)(full, tp_rank, tp, grid.group("tp"))
        diff, fwd, bwd = split_vs_unsplit(full, split, x, grid, count_collectives)
        report.claim(f"hand_{name}_equals_unsplit", diff, "<=", TOL,
                     f"by hand, {name} at tp={tp}: max |split - unsplit| over output, input gradient and weight "
                     "gradients = {value:.1e}")
        (fc, fb, fg), (bc, bb, bg) = counted(fwd), counted(bwd)
        report.claim(f"hand_{name}_allreduces_forward", fc, "==", want,
                     f"  all-reduces in forward (g): {{value}}, of {fb // max(fc, 1)} bytes = B x S x H x 4")
        report.claim(f"hand_{name}_allreduces_backward", bc, "==", want,
                     f"  all-reduces in backward (f): {{value}}, of {bb // max(bc, 1)} bytes")
        report.claim(f"hand_{name}_allreduce_bytes", fb + bb, "==", 2 * want * act_bytes,
                     "  bytes all-reduced per forward + backward: {value} = 2 x B x S x H x 4 at tp > 1")
        report.claim(f"hand_{name}_in_tp_group", int(fg | bg <= {tuple(grid.ranks_in("tp"))}), "==", 1,
                     f"  every all-reduce travelled in the tp group {grid.ranks_in('tp')}: {{value}}")
        weights = [(n, p) for n, p in split.named_parameters() if n.endswith("weight")]
        split_w = sum(p.numel() * p.element_size() for _, p in weights)
        full_w = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if n.endswith("weight"))
        report.claim(f"hand_{name}_weight_bytes_fraction", split_w / full_w, "==", 1 / tp,
                     f"  weight-matrix bytes per rank: {split_w} of {full_w} = {{value:.3f}} = 1/tp "
                     "(the row-parallel bias stays whole on every rank)")


def with_dtensor(report: Report, grid: Grid, x: torch.Tensor, heads: int) -> None:
    """Section 2: the same blocks split by parallelize_module; DTensor's collectives counted by CommDebugMode."""
    mesh, tp_rank = grid.submesh("tp"), grid.coords["tp"]
    H = x.shape[-1]
    full = MLP(H).to(x.device)
    split = parallelize_module(copy.deepcopy(full), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    diff, fwd, bwd = split_vs_unsplit(full, split, x, grid, count_dtensor_collectives)
    report.claim("dtensor_mlp_equals_unsplit", diff, "<=", TOL,
                 "parallelize_module, MLP: max |split - unsplit| (output, input and weight gradients) = {value:.1e}")
    _, hand_fwd, hand_bwd = split_vs_unsplit(full, TPMLP(full, tp_rank, grid.size("tp"), grid.group("tp")), x,
                                             grid, count_collectives)
    every = lambda c: (c.calls, c.bytes, c.groups)  # noqa: E731  every op, not only the all-reduces
    same = (every(fwd), every(bwd)) == (every(hand_fwd), every(hand_bwd))
    report.claim("dtensor_mlp_collectives_as_by_hand", int(same), "==", 1,
                 f"  its collectives: forward {calls(fwd)}, backward {calls(bwd)}, the same calls, bytes and group as "
                 "by hand: {value}")
    full = SelfAttention(H, heads).to(x.device)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel()}
    diff, fwd, bwd = split_vs_unsplit(full, parallelize_module(copy.deepcopy(full), mesh, plan), x, grid,
                                      count_dtensor_collectives)
    report.claim("dtensor_attention_equals_unsplit", diff, "<=", TOL,
                 "parallelize_module, attention: max |split - unsplit| = {value:.1e}")
    report.value("dtensor_attention_backward_allreduces", bwd.calls.get("all_reduce", 0),
                 "  all-reduces in its backward: {value} (q, k and v each sum their input gradient; by hand: 1)")


def sequence_parallel(report: Report, grid: Grid, x: torch.Tensor) -> None:
    """Section 3: LayerNorm on S/tp tokens per rank; all-gather + reduce-scatter instead of the all-reduce."""
    mesh, tp_rank, tp = grid.submesh("tp"), grid.coords["tp"], grid.size("tp")
    B, S, H = x.shape
    full = Block(H).to(x.device)  # x + mlp(norm2(x)), no attention
    tp_block = parallelize_module(copy.deepcopy(full), mesh, {"mlp.fc1": ColwiseParallel(),
                                                               "mlp.fc2": RowwiseParallel()})
    sp_block = parallelize_module(copy.deepcopy(full), mesh, {
        "norm2": SequenceParallel(),                           # (B, S/tp, H) in, (B, S/tp, H) out
        "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),    # all-gather the tokens: (B, S, H)
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))})  # reduce-scatter: (B, S/tp, H)
    diff, fwd, bwd = split_vs_unsplit(full, sp_block, x, grid, count_dtensor_collectives, shard_seq=True)
    report.claim("sequence_parallel_equals_unsplit", diff, "<=", TOL,
                 "sequence parallel block (norm + MLP): max |split - unsplit| on this rank's tokens = {value:.1e}")
    report.claim("sequence_parallel_collectives", int(fwd.calls == bwd.calls == {"all_gather": 1,
                                                                                  "reduce_scatter": 1}), "==", 1,
                 f"  forward {calls(fwd)}, backward {calls(bwd)}: one all-gather + one reduce-scatter each way: "
                 "{value}")
    with count_dtensor_collectives() as without:  # the same block without sequence parallelism, forward + backward
        tp_block(x.clone().requires_grad_()).sum().backward()
    sp_bytes = sum(c.bytes.get(op, 0) for c in (fwd, bwd) for op in ("all_gather", "reduce_scatter"))
    ar_bytes = counted(without)[1]
    # Ring costs per rank for a buffer of N bytes: all-reduce 2 (tp-1)/tp N, all-gather and reduce-scatter
    # (tp-1)/tp N each. So the same bytes travel when the gathered + scattered buffers are twice the all-reduced.
    report.claim("sequence_parallel_same_bytes", sp_bytes / (2 * ar_bytes), "==", 1,
                 f"  all-gather + reduce-scatter buffers {sp_bytes} bytes / (2 x {ar_bytes} bytes all-reduced without "
                 "sequence parallelism) = {value}: on a ring the same bytes travel (an all-reduce is a reduce-scatter "
                 "then an all-gather)")
    saved = {}
    for name, block, xin in (("tp", tp_block, x), ("sp", sp_block, x.chunk(tp, 1)[tp_rank])):
        with saved_local_bytes(exclude=list(block.parameters())) as s:
            block(xin.clone().requires_grad_()).sum().backward()
        saved[name] = s.bytes
    norm_saved = (B * S * H + 2 * B * S) * x.element_size()  # LayerNorm keeps its input, mean and 1/std
    report.claim("sequence_parallel_saves_less", saved["tp"] - saved["sp"], "==", norm_saved * (tp - 1) // tp,
                 f"  activation bytes saved for backward per rank: {saved['tp']} -> {saved['sp']}, {{value}} fewer "
                 "= the norm's input and statistics x (tp-1)/tp")


def train(report: Report, grid: Grid, args: argparse.Namespace) -> None:
    """Section 4: the split model trains on the digits exactly like the unsplit one."""
    device = grid.info.device
    tp_rank, tp = grid.coords["tp"], grid.size("tp")
    set_seed(args.seed)
    full = digits_transformer(args.hidden, args.heads, layers=1).to(device)
    split = tensor_parallelize(full, tp_rank, tp, grid.group("tp"))  # every rank cut its shards from one init
    train_set, test_set = digits_split()
    images, labels = train_set.tensors
    g = torch.Generator().manual_seed(args.seed)  # the same batches on every rank: tp ranks share the data
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in (full, split)]
    tx, ty = (t.to(device) for t in test_set.tensors)  # (359, 1, 8, 8), (359,)
    with torch.no_grad():
        test_before = F.cross_entropy(split(tx.squeeze(1)), ty).item()
    losses = {"unsplit": [], "split": []}
    for step in range(args.steps):
        pick = torch.randint(len(labels), (args.batch_size,), generator=g)
        x, y = images[pick].squeeze(1).to(device), labels[pick].to(device)  # x (B, 8, 8): 8 tokens of 8 pixels
        for (name, model), opt in zip((("unsplit", full), ("split", split)), opts):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    report.record("losses", losses)
    gap = max_over_ranks(max(abs(a - b) for a, b in zip(losses["unsplit"], losses["split"])))
    report.claim("training_follows_unsplit", gap, "<=", TOL,
                 f"training, {args.steps} SGD steps on the digits at tp={tp}: max |loss split - loss unsplit| = "
                 "{value:.1e}")
    report.claim("training_params_equal_unsplit", max_over_ranks(max_shard_diff(full, split, tp_rank)), "<=", TOL,
                 "  max |parameter shard - unsplit slice| after training = {value:.1e}")
    with torch.no_grad():
        logits = split(tx.squeeze(1))  # (359, 10): the held-out digits, less noisy than a few training batches
    after = F.cross_entropy(logits, ty).item()
    report.claim("training_loss_falls", after / test_before, "<=", 0.8, f"  test loss of the split model "
                 f"{test_before:.3f} before training, {after:.3f} after: ratio {{value:.2f}}")
    report.value("test_accuracy", (logits.argmax(1) == ty).float().mean().item(),
                 "  test accuracy of the split model: {value:.3f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        report = Report(info)
        grid = Grid(info, tp=info.world_size)
        report.value("grid", grid.describe(), "\n".join(grid.describe()))
        set_seed(args.seed)
        x = torch.randn(args.batch_size, SEQ, args.hidden).to(info.device)  # (B, S, H), the same on every rank
        hand_built(report, grid, x, args.heads)
        if grid.size("tp") > 1:  # DTensor needs a mesh with something to split
            with_dtensor(report, grid, x, args.heads)
            sequence_parallel(report, grid, x)
        else:
            print0("tp = 1: parallelize_module and sequence parallelism need tp > 1 (torchrun, 2+ processes)")
        train(report, grid, args)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
