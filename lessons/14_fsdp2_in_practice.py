"""Lesson 14: FSDP2 in practice: HSDP, mixed precision, reshard_after_forward, meta-device init, accumulation.

    torchrun --standalone --nproc_per_node=4 lessons/14_fsdp2_in_practice.py                 # HSDP 2 x 2
    torchrun --standalone --nproc_per_node=4 lessons/14_fsdp2_in_practice.py --replicate 1   # FSDP over 4
    torchrun --standalone --nproc_per_node=8 lessons/14_fsdp2_in_practice.py --replicate 2   # HSDP 2 x 4
    python lessons/14_fsdp2_in_practice.py                                                   # a world of one

Lesson 13 built ZeRO by hand and showed `fully_shard` against it. Here are the knobs a practitioner turns,
each with a number that says what it does, on lesson 13's model with two buffers in front (NormalisedMLP,
common/sharding/fsdp.py: width 32, depth 2, 6634 parameters in 3 units: 2 blocks, then the root).

What to look for:
1. HSDP: `fully_shard` on a 2-D mesh (dp_replicate, dp_shard); both dims are data parallel. Sharded in a
   dp_shard group (all-gather, reduce-scatter), replicated across dp_replicate (shards all-reduced): equal to
   one process, bytes as predicted, 1/shard of the parameters per rank, between DDP's and FSDP's.
2. Prefetching: FSDP2 all-gathers the next block ahead (backward: by default; forward: when told), one block
   more held; the order measured. On gloo nothing overlaps: the overlap a GPU gets is stated, not measured.
3. Mixed precision: param_dtype=bf16 alone reduces in bf16 (reduce_dtype defaults to param_dtype): half the
   reduce-scatter bytes, a larger gradient error than reduce_dtype=float32; sharded gradients stay float32.
4. reshard_after_forward: True all-gathers each block twice a step (the root, unset, keeps its own), False
   once and holds them from forward to backward, an int k keeps 1/k and all-gathers backward in groups of k.
5. Meta device, `fully_shard`, `to_empty`: `reset_parameters()` on DTensors draws each shard from its
   rank's generator (not eager's values on a CPU); `init_like_eager` equals eager, buffers included, a layer
   at a time; a full state dict on rank 0 only (`broadcast_from_rank0=True`) loads equal, the other ranks'
   peak allocation below the model's bytes.
6. Accumulation: `set_requires_gradient_sync(False)` but on the last micro-step equals the global batch with
   k times fewer reduce-scatters; the price: every gradient held unsharded across micro-steps.
7. `clip_grad_norm_` on DTensor gradients is one process's norm; Adam's state is sharded (rows padded / N).
8. CPUOffloadPolicy on a CPU-only build, tried: its error is the value.

Sources: pytorch.org/docs/stable/distributed.fsdp.fully_shard.html; torchtitan (parallelize_llama,
--training.mixed_precision_reduce); PyTorch FSDP (arxiv.org/abs/2304.11277).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from common.data import digits_split
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import all_gather_objects
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.allocations import allocations
from common.measure.counters import count_collectives, local_shard
from common.measure.differences import max_abs_diff_all, max_over_ranks
from common.measure.memory import storage_bytes
from common.sharding.accounting import full_params
from common.sharding.fsdp import (
    NormalisedMLP,
    fsdp_units,
    full_values,
    gradient_bytes,
    init_like_eager,
    one_backward,
    one_process,
    one_step_profile,
    padded_bytes,
    predicted_step_bytes,
    shard_blocks_then_root,
    world_of_one,
)
from common.sharding.prefetch import prefetch_runs

EQUAL = 1e-5  # max |difference| of parameters after a few SGD steps: float32 rounding is ~1e-7
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
AG, RS, AR = "all_gather_single", "reduce_scatter_single", "all_reduce"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=32, help="NormalisedMLP width (default 32)")
    p.add_argument("--depth", type=int, default=2, help="residual blocks (default 2)")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks")
    p.add_argument("--steps", type=int, default=3, help="SGD steps of each comparison (default 3)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--replicate", type=int, default=0, help="HSDP replicas (default 2 if N>=4)")
    p.add_argument("--reshard-int", type=int, default=0, help="reshard_after_forward=k (N/2)")
    p.add_argument("--micro-steps", type=int, default=2, help="micro-steps accumulated (default 2)")
    p.add_argument("--param-dtype", default="bf16", help="mixed precision: bf16 or fp16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    check_args(args, read_torchrun_env()[2])
    return args


def check_args(args: argparse.Namespace, n: int) -> None:
    """Every rank checks the same numbers before any process group: every rank fails alike."""
    sizes = (args.width, args.depth, args.steps, args.global_batch, args.micro_steps, args.lr)
    if min(sizes) <= 0:
        raise LessonError("--width, --depth, --steps, --global-batch, --micro-steps, --lr: > 0")
    if args.param_dtype not in DTYPES:
        raise LessonError(f"unknown --param-dtype {args.param_dtype!r}: choose bf16 or fp16")
    args.replicate = args.replicate or (2 if n >= 4 and n % 2 == 0 else 1)
    if args.replicate < 1 or n % args.replicate:
        raise LessonError(f"--replicate {args.replicate} does not divide the world of {n} ranks")
    if args.global_batch % (n * args.micro_steps):
        raise LessonError(f"--global-batch {args.global_batch} is not {n} x {args.micro_steps} x b")
    divisors = [k for k in range(2, n) if n % k == 0]
    if not args.reshard_int:  # half the world where that is a proper divisor, else the largest one
        args.reshard_int = n // 2 if n // 2 in divisors else max(divisors, default=0)
    if args.reshard_int and args.reshard_int not in divisors:
        raise LessonError(f"--reshard-int {args.reshard_int} must divide {n}, in 2 .. {n - 1}")


@dataclass
class Run:
    """What every section shares: the arguments, the world, the report, the batches, the initial values."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    batches: list  # [(x (B, 1, 8, 8), y (B,))] global batches, one per step
    init: dict  # the eager model's state dict, built after manual_seed(seed)
    mesh: object  # 1-D DeviceMesh over the world: plain FSDP

    def fresh(self) -> NormalisedMLP:
        m = NormalisedMLP(self.args.width, self.args.depth).to(self.info.device)
        m.load_state_dict(self.init)  # every comparison starts from the same values
        return m

    def mine(self, x: torch.Tensor, parts: int = 1) -> list[torch.Tensor]:
        """This rank's slice of a global batch (rank r: the r-th of N), cut into `parts` micro-batches."""
        b = len(x) // self.info.world_size
        return list(x[self.info.rank * b : (self.info.rank + 1) * b].chunk(parts))

    def worst(self, a, b) -> float:  # max |a - b| over ranks, NaN-safe
        return max_over_ranks(max_abs_diff_all(a, b))


def train(s: Run, model: nn.Module, micro: int = 1, sync_each: bool = False) -> None:
    """`--steps` SGD steps; each accumulates `micro` micro-batches (loss / micro) of this rank's slice."""
    opt = torch.optim.SGD(model.parameters(), lr=s.args.lr)  # on DTensors: updates the local shards
    for x, y in s.batches:
        for i, (xm, ym) in enumerate(zip(s.mine(x, micro), s.mine(y, micro))):
            if micro > 1:  # reduce-scatter only after the last micro-step's backward
                model.set_requires_gradient_sync(sync_each or i == micro - 1)
            (F.cross_entropy(model(xm), ym) / micro).backward()
        opt.step()
        opt.zero_grad()


# -------- 1. HSDP: a 2-D mesh, sharded inside a group, replicated across groups
def hsdp(s: Run, ref: list) -> None:
    args, info, report = s.args, s.info, s.report
    shard = info.world_size // args.replicate
    grid = Grid(info, dp_replicate=args.replicate, dp_shard=shard)  # init_device_mesh
    lines = grid.describe()
    report.value("mesh", grid.sizes, "1. HSDP mesh " + lines[0] + " (outer dim first)")
    report.value("groups", lines[1:], "  " + "\n  ".join(lines[1:]))
    text = "  both dims are data parallel: {value} different slices of each global batch"
    report.value("data_ranks", info.world_size, text)
    model = shard_blocks_then_root(s.fresh(), grid.mesh)  # fully_shard(mesh=2-D mesh) is HSDP
    with count_collectives() as c:
        train(s, model)
    text = "  HSDP vs one process on the global batch after {steps} steps: {value:.1e}"
    diff, steps = s.worst(full_params(model), ref), args.steps
    report.claim("hsdp_equals_one_process", diff, "<=", EQUAL, text, steps=steps)
    want = predicted_step_bytes(s.fresh(), shard, args.replicate)
    for op, where in ((AG, "in dp_shard"), (RS, "in dp_shard"), (AR, "across dp_replicate")):
        if op in want:
            text = "  {op} {where}: {value:.0f} bytes a step, predicted from the shapes"
            moved = c.bytes.get(op, 0) / args.steps
            report.claim(f"hsdp_{op}_bytes", moved, "==", want[op], text, op=op, where=where)
    group_of = {AG: grid.ranks_in("dp_shard"), RS: grid.ranks_in("dp_shard")}
    group_of[AR] = grid.ranks_in("dp_replicate")
    wrong = sum(n for (op, ranks), n in c.groups.items() if list(ranks) != group_of.get(op))
    text = "  collectives outside the group the mesh gives them: {value:.0f}"
    report.claim("hsdp_groups_as_mesh", max_over_ranks(wrong), "==", 0, text)
    memory_between(s, model, shard)


def memory_between(s: Run, model, shard: int) -> None:
    """Parameter bytes a rank holds at rest: DDP (all of them), HSDP (1/shard), FSDP over the world (1/N)."""
    n, report = s.info.world_size, s.report
    fsdp = shard_blocks_then_root(s.fresh(), s.mesh)
    held = {
        "DDP": storage_bytes(s.fresh().parameters()),
        "HSDP": storage_bytes(local_shard(p) for p in model.parameters()),
        "FSDP": storage_bytes(local_shard(p) for p in fsdp.parameters()),
    }
    row = ", ".join(f"{k} {v}" for k, v in held.items())
    report.value("parameter_bytes", held, "  parameter bytes a rank holds at rest: {row}", row=row)
    want = padded_bytes(s.fresh().parameters(), shard) // shard
    text = "  HSDP: {value} = rows padded to {shard}, / {shard}"
    report.claim("hsdp_parameter_bytes", held["HSDP"], "==", want, text, shard=shard)
    if 1 < shard < n:  # a true 2-D mesh: strictly between the two
        gap = min(held["DDP"] - held["HSDP"], held["HSDP"] - held["FSDP"])
        text = "  HSDP strictly between DDP and FSDP: the smaller gap is {value} bytes"
        report.claim("hsdp_memory_between", gap, ">=", 1, text)


# -------- 2. prefetching: the order of the all-gathers, and the gathered parameters held
def prefetching(s: Run) -> None:
    report, n, d, units = s.report, s.info.world_size, s.args.depth, fsdp_units(s.fresh())
    if n == 1:  # a world of one gathers nothing: no order to show
        return report.value("prefetch", "nothing to gather", "2. prefetching: {value}")
    x, y = s.mine(s.batches[0][0])[0], s.mine(s.batches[0][1])[0]
    runs = prefetch_runs(lambda: shard_blocks_then_root(s.fresh(), s.mesh), x, y)
    report.record("prefetch_logs", {how: r["log"] for how, r in runs.items()})
    imp, off, exp = runs["implicit"], runs["none"], runs["explicit"]
    text = (
        "2. prefetch: backward all-gathers before the 1st reduce-scatter {value} implicit, {o} none"
    )
    got, o = imp["backward_gathers"], off["backward_gathers"]
    report.claim("prefetch_implicit_backward", got, "==", min(2, d), text, o=o)
    text = "  none: {value} (each block all-gathered only when its own backward begins)"
    report.claim("prefetch_none_backward", o, "==", 1, text)
    text = "  explicit set_modules_to_backward_prefetch (block before): entries unlike implicit's {value}"
    report.claim("prefetch_explicit_backward_as_implicit", exp["unlike_implicit"], "==", 0, text)
    text = "  forward: all-gathers before block 0 computes {value} explicit (block 1 too), {i} implicit"
    got, i = exp["forward_gathers"], imp["forward_gathers"]
    report.claim("prefetch_explicit_forward", got, "==", 2 + (d > 1), text, i=i)
    root, block = padded_bytes(units[-1], n), padded_bytes(units[0], n)
    for how, k in (("implicit", 1), ("explicit", min(2, d))):  # set_modules_to_forward_prefetch: +1
        text = "  peak gathered parameter bytes in forward, {how}: {value} = root {r} + {k} x block {b}"
        got, want = runs[how]["peak"], root + k * block
        report.claim(f"prefetch_{how}_peak", got, "==", want, text, how=how, r=root, k=k, b=block)
    if s.info.device.type == "cpu":  # gloo's all-gather returns done: compute waits for it
        text = "  all-gathers still in flight while a layer computes: {value}: on gloo nothing overlaps"
        report.claim("prefetch_no_overlap_here", exp["in_flight"], "==", 0, text)
    text = "  what a GPU gets from it: the next all-gather overlaps compute (own stream): {value}"
    report.value("prefetch_on_gpu", "stated, not measured here", text)


# -------- 3. mixed precision: what reduce_dtype changes
def mixed_precision(s: Run) -> None:
    report, low = s.report, DTYPES[s.args.param_dtype]
    x, y = s.mine(s.batches[0][0])[0], s.mine(s.batches[0][1])[0]  # this rank's slice

    def gradients(policy: MixedPrecisionPolicy) -> tuple[list, dict]:
        return one_backward(shard_blocks_then_root(s.fresh(), s.mesh, mp_policy=policy), x, y)

    g32, b32 = gradients(MixedPrecisionPolicy())
    scale = max(g.abs().max().item() for g in g32)
    rows = {}
    for name, reduce in (("reduce_low", None), ("reduce_fp32", torch.float32)):
        g, b = gradients(MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce))
        share = b.get(RS, 0) / max(b32.get(RS, 0), 1)  # no reduce-scatter in a world of one
        rows[name] = {"error": s.worst(g, g32) / scale, "rs_share": share, **b}
    report.record("mixed_precision", rows)
    lo, hi, dt = rows["reduce_low"], rows["reduce_fp32"], s.args.param_dtype
    text = "3. param_dtype={low}: the sharded gradients are {value} (the sharded parameters' dtype)"
    report.value("grad_dtype", lo["grad_dtype"], text, low=dt)
    if s.info.world_size > 1:
        text = "  reduce_dtype=None: reduce-scatter bytes {value} of fp32's (it reduces in {low})"
        report.claim("mp_reduce_default_halves_bytes", lo["rs_share"], "==", 0.5, text, low=dt)
        text = "  reduce_dtype=float32: reduce-scatter bytes {value} of fp32's"
        report.claim("mp_reduce_fp32_bytes", hi["rs_share"], "==", 1.0, text)
        text = "  gradient error vs fp32, max|diff|/max|g|: {lo:.1e} (None), {hi:.1e} (fp32): x{value:.1f}"
        e = {"lo": lo["error"], "hi": hi["error"]}  # a NaN error fails the claim
        report.claim("mp_reduce_fp32_smaller_error", e["lo"] / e["hi"], ">=", 1.0, text, **e)


# -------- 4. reshard_after_forward: what stays gathered between forward and backward
def reshard_after_forward(s: Run) -> None:
    args, report, n = s.args, s.report, s.info.world_size
    full = padded_bytes(s.fresh().parameters(), n)  # every unit gathered, rows padded to N
    count = len(fsdp_units(s.fresh()))
    # setting: (all-gathers a step, of them in groups smaller than N, parameter bytes held after forward)
    gathered = count if n > 1 else 0  # a world of one gathers nothing
    want = {True: (2 * gathered, 0, full // n), False: (gathered, 0, full)}
    if args.reshard_int:  # forward gathers over N; backward over k ranks, from the 1/k kept
        want[args.reshard_int] = (2 * count, count, full // args.reshard_int)
    rows = {}
    for k, (gathers, small, held) in want.items():
        model = shard_blocks_then_root(s.fresh(), s.mesh, reshard_after_forward=k)
        got = rows[str(k)] = one_step_profile(model, *s.batches[0], s.mine)
        name = f"reshard_{str(k).lower()}" if isinstance(k, bool) else "reshard_int"
        lead = "4. " if k is True else "  "
        text = lead + "reshard_after_forward={k}: {value} all-gathers a step"
        report.claim(f"{name}_all_gathers", got["all_gathers"], "==", gathers, text, k=k)
        text = "    of them in groups smaller than the world: {value}"
        report.claim(f"{name}_small_groups", got["in_smaller_groups"], "==", small, text)
        text = "    parameter bytes held from forward to backward: {value} (all gathered: {full})"
        report.claim(f"{name}_held_bytes", got["params"], "==", held, text, full=full)
    report.record("reshard_rows", rows)


# -------- 5. a model that does not fit: meta device, fully_shard, to_empty, initialise
def meta_model(s: Run) -> NormalisedMLP:
    with torch.device("meta"):  # shapes only: no memory, no random numbers drawn
        model = NormalisedMLP(s.args.width, s.args.depth)
    shard_blocks_then_root(model, s.mesh)
    return model.to_empty(device=s.info.device)  # each rank allocates its shards, uninitialised


def meta_init(s: Run) -> None:
    args, report = s.args, s.report
    eager, model_bytes = full_values(s.fresh()), storage_bytes(s.fresh().parameters())
    naive = meta_model(s)
    torch.manual_seed(args.seed)
    for m in naive.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()  # on DTensors: each rank's generator draws its own shard
    naive.init_buffers()
    text = "5. meta, fully_shard, to_empty, reset_parameters(): differs from eager: {value}"
    report.value("reset_parameters_differs", s.worst(full_values(naive), eager) > EQUAL, text)
    model = meta_model(s)
    with allocations(s.info.device) as trace:
        largest = init_like_eager(model, args.seed)
    text = "  init_like_eager (one layer in full at a time), buffers included: {value}"
    report.claim("meta_init_equals_eager", s.worst(full_values(model), eager), "==", 0.0, text)
    peak = max_over_ranks(trace.peak / model_bytes)
    text = "  init_like_eager's peak allocation: {value:.2f} of the model (largest layer {l:.2f})"
    # the full model never: one layer at a time (when gloo frees its buffers varies the peak: [perf])
    l = largest / model_bytes  # noqa: E741
    report.claim("meta_init_peak_below_model", peak, "<=", 0.99, text, perf=True, l=l)
    broadcast_load(s, eager, model_bytes)


def broadcast_load(s: Run, eager: list, model_bytes: int) -> None:
    """A full state dict on rank 0 only (as read from a checkpoint), into the sharded meta-built model."""
    info, report = s.info, s.report
    model = meta_model(s)
    # the other ranks pass nothing; rank 0 a copy: set_model_state_dict turns the values into DTensors
    full = {k: v.clone() for k, v in s.init.items()} if info.master_process else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with allocations(info.device) as trace:
        set_model_state_dict(model, full, options=options)
    skipped = s.worst(full_values(model), eager) > 0  # pixel_scale is in no state dict
    text = "  broadcast_from_rank0 load; before init_buffers() it differs from eager: {value}"
    report.value("buffer_skipped_differs", skipped, text)
    model.init_buffers()
    text = "  after init_buffers(): max |difference| {value}"
    report.claim("broadcast_load_equals_eager", s.worst(full_values(model), eager), "==", 0.0, text)
    peaks = all_gather_objects(trace.peak, info)[1:]  # the ranks that never had the full state dict
    if peaks:  # torch broadcasts one tensor at a time (_broadcast_state_dict), never the model
        text = "  the other ranks' peak allocation during the load: {value:.2f} of the model"
        worst = max(peaks) / model_bytes
        report.claim("broadcast_peak_below_model", worst, "<=", 0.99, text, perf=True)


# -------- 6. gradient accumulation: set_requires_gradient_sync
def accumulation(s: Run, ref: list) -> None:
    report, n, k = s.report, s.info.world_size, s.args.micro_steps
    counted = {}
    for sync_each in (False, True):
        model = shard_blocks_then_root(s.fresh(), s.mesh)
        with count_collectives() as c:
            train(s, model, micro=k, sync_each=sync_each)
        counted[sync_each] = c.calls.get(RS, 0)
        if not sync_each:
            text = "6. {k} micro-steps, gradient sync on the last only, vs one process: {value:.1e}"
            diff = s.worst(full_params(model), ref)
            report.claim("accumulation_equals_one_process", diff, "<=", EQUAL, text, k=k)
    text = "  reduce-scatters: {a} synced every micro-step, {b} on the last only: x{value:g}"
    ratio = counted[True] / max(counted[False], 1)
    if n > 1:  # a world of one reduce-scatters nothing
        a, b = counted[True], counted[False]
        report.claim("accumulation_fewer_reduce_scatters", ratio, "==", k, text, a=a, b=b)
    params = list(s.fresh().parameters())
    want = {False: storage_bytes(params), True: padded_bytes(params, n) // n}
    xm, ym = s.mine(s.batches[0][0], k)[0], s.mine(s.batches[0][1], k)[0]  # micro-step 1's batch
    for sync in (False, True):  # the gradients it leaves held: unsharded (sync off) or sharded (on)
        model = shard_blocks_then_root(s.fresh(), s.mesh)
        model.set_requires_gradient_sync(sync)
        one_backward(model, xm, ym)
        text = "  gradients held after micro-step 1, sync {sync}: {value} bytes ({what})"
        what = "sharded, rows padded" if sync else "unsharded: all of them"
        name = f"accumulation_held_sync_{str(sync).lower()}"
        report.claim(name, gradient_bytes(model), "==", want[sync], text, sync=sync, what=what)


# -------- 7. clipping and the optimizer state
def clipping_and_state(s: Run) -> None:
    report, n = s.report, s.info.world_size
    model, plain = shard_blocks_then_root(s.fresh(), s.mesh), s.fresh()
    x, y = s.batches[0]
    F.cross_entropy(model(s.mine(x)[0]), s.mine(y)[0]).backward()
    F.cross_entropy(plain(x), y).backward()  # one process, the global batch
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # a DTensor: over all shards
    norm, want = norm.full_tensor().item(), nn.utils.clip_grad_norm_(plain.parameters(), 0.5).item()
    text = "7. clip_grad_norm_ on DTensor gradients: norm {norm:.6f}, vs one process's: {value:.1e}"
    rel = abs(norm - want) / want  # relative
    report.claim("clip_norm_equals_one_process", rel, "<=", 1e-6, text, norm=norm)
    grads = [p.grad.full_tensor() for p in model.parameters()]
    text = "  the clipped gradients vs one process's: max |difference| {value:.1e}"
    diff = s.worst(grads, [p.grad for p in plain.parameters()])
    report.claim("clipped_grads_equal", diff, "<=", 1e-6, text)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    state = [local_shard(t) for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    params = list(plain.parameters())
    want = 2 * padded_bytes(params, n) // n + 4 * len(params)  # exp_avg, exp_avg_sq; 4-byte steps
    text = "  Adam's state per rank: {value} bytes = 2 x rows padded / {n} + 4 per step (one process: {full})"
    full = 8 * sum(p.numel() for p in params) + 4 * len(params)
    report.claim("adam_state_sharded", storage_bytes(state), "==", want, text, n=n, full=full)


# -------- 8. what does not run here
def not_here(s: Run) -> None:
    try:
        model = shard_blocks_then_root(s.fresh(), s.mesh, offload_policy=CPUOffloadPolicy())
        x, y = s.batches[0]
        F.cross_entropy(model(s.mine(x)[0]), s.mine(y)[0]).backward()
        outcome = "ran"
    except Exception as e:  # the behaviour of this build is the value
        outcome = f"{type(e).__name__}: {e}"
    text = "8. CPUOffloadPolicy on this {dev} build: {value}"
    s.report.value("cpu_offload", outcome, text, dev=s.info.device.type)


def main() -> None:
    world_of_one()
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        train_set, _ = digits_split(path=args.data)
        set_seed(args.seed)
        init = NormalisedMLP(args.width, args.depth).to(info.device).state_dict()
        x_all, y_all = train_set.tensors
        perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed))
        batches = [
            (x_all[i].to(info.device), y_all[i].to(info.device))
            for i in perm[: args.steps * args.global_batch].view(args.steps, -1)
        ]
        mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))
        s = Run(args, info, report, batches, init, mesh)
        n_params = sum(t.numel() for t in s.fresh().parameters())
        report.record("world_size", info.world_size)
        text = "world_size {n}, NormalisedMLP width {w} depth {d}: {value} parameters, {u} units"
        u = len(fsdp_units(s.fresh()))
        report.value("n_params", n_params, text, n=info.world_size, w=args.width, d=args.depth, u=u)
        ref = one_process(s.fresh(), s.batches, args.lr)  # every rank alike
        hsdp(s, ref)
        prefetching(s)
        mixed_precision(s)
        reshard_after_forward(s)
        meta_init(s)
        accumulation(s, ref)
        clipping_and_state(s)
        not_here(s)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
