"""Lesson 14: FSDP2 in practice: HSDP, mixed precision, reshard_after_forward, meta-device init, accumulation.

    torchrun --standalone --nproc_per_node=4 lessons/14_fsdp2_in_practice.py                 # HSDP 2 x 2
    torchrun --standalone --nproc_per_node=4 lessons/14_fsdp2_in_practice.py --replicate 1   # FSDP over 4
    torchrun --standalone --nproc_per_node=8 lessons/14_fsdp2_in_practice.py --replicate 2   # HSDP 2 x 4
    python lessons/14_fsdp2_in_practice.py                                                   # a world of one

The knobs a practitioner turns, each with a number, on lesson 13's model with two buffers in front
(NormalisedMLP, common/sharding/fsdp.py: width 32, depth 2, 6634 parameters in 3 units: 2 blocks, the root).

What to look for (section 1 on a 2-D mesh; sections 2-8 plain FSDP on a 1-D mesh of all the ranks):
1. HSDP: `fully_shard` on a 2-D mesh (dp_replicate, dp_shard), both dims data parallel, sharded in a dp_shard
   group, replicated across dp_replicate (shards all-reduced): one process's result, the bytes predicted.
2. Prefetch: backward all-gathers the next block ahead by default; on a GPU forward overlaps the next one by
   default, `set_modules_to_forward_prefetch` issues it earlier from the CPU, one block more held (on gloo
   nothing runs ahead by default, nothing overlaps: a GPU's overlap is stated, not measured).
3. Mixed precision: param_dtype=bf16 alone reduces in bf16 (reduce_dtype defaults to it): half the bytes, a
   rounding error (vs the local gradients averaged in float64) that reduce_dtype=float32 has not.
4. reshard_after_forward (every unit, the root too): True all-gathers each twice a step, False once and holds
   them from forward to backward, an int k keeps 1/k and gathers backward in groups of k.
5. Meta device, `fully_shard`, `to_empty`: `reset_parameters()` draws each shard from its rank's generator;
   `init_like_eager` equals eager, a layer in full at a time; a full state dict on rank 0 loads one tensor per
   broadcast (`broadcast_from_rank0`), then the model's `init_buffers()`: equal to eager.
6. Accumulation: `set_requires_gradient_sync(False)` but on the last micro-step: the global batch's result,
   1/k of the reduce-scatters, every gradient held unsharded across micro-steps.
7. `clip_grad_norm_` on DTensor gradients is one process's norm; Adam's state is sharded (rows padded / N).
8. CPUOffloadPolicy: pin_memory=True (default) needs an accelerator; pin_memory=False runs on a CPU, moving
   nothing. (Lines starting USDT or with CPUAllocator come from the allocation tracer: ignore them.)

Sources: pytorch.org/docs/stable/distributed.fsdp.fully_shard.html; torchtitan; arxiv.org/abs/2304.11277.
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

from common.data import digits_split, global_batch_slices
from common.harness.env import DistInfo, read_torchrun_env
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
    exact_mean_gradients,
    fsdp_units,
    full_values,
    init_like_eager,
    meta_sharded,
    padded_bytes,
    predicted_step_bytes,
    reset_sharded,
    shard_blocks_then_root,
)
from common.sharding.fsdp_steps import (
    backward_outcome,
    check_fsdp2_options,
    gradient_bytes,
    one_backward,
    one_process,
    one_step_profile,
    train_sharded,
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
    check_fsdp2_options(args, read_torchrun_env()[2], DTYPES)  # before any process group
    return args


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


# -------- 1. HSDP: a 2-D mesh, sharded inside a group, replicated across groups
def hsdp(run: Run, ref: list) -> None:
    shard = run.info.world_size // run.args.replicate
    grid = Grid(run.info, dp_replicate=run.args.replicate, dp_shard=shard)  # init_device_mesh
    lines = [line.replace("= 1 ranks", "= 1 rank") for line in grid.describe()]
    run.report.value("mesh", grid.sizes, "1. HSDP mesh " + lines[0] + " (outer dim first)")
    run.report.value("groups", lines[1:], "  " + "\n  ".join(lines[1:]))
    text = "  both dims are data parallel: {value} different {slices} of each global batch"
    slices = "slices" if run.info.world_size > 1 else "slice"
    run.report.value("data_ranks", run.info.world_size, text, slices=slices)
    model = shard_blocks_then_root(run.fresh(), grid.mesh)  # fully_shard(mesh=2-D mesh) is HSDP
    with count_collectives() as c:
        train_sharded(model, run.batches, run.mine, run.args.lr)
    text = "  HSDP vs one process on the global batch after {steps} steps: {value:.1e}"
    diff = run.worst(full_params(model), ref)
    run.report.claim("hsdp_equals_one_process", diff, "<=", EQUAL, text, steps=run.args.steps)
    want = predicted_step_bytes(run.fresh(), shard, run.args.replicate)
    for op, where in ((AG, "in dp_shard"), (RS, "in dp_shard"), (AR, "across dp_replicate")):
        if op in want:
            text = "  {op} {where}: {value:.0f} bytes a step, predicted from the shapes"
            moved = c.bytes.get(op, 0) / run.args.steps
            run.report.claim(f"hsdp_{op}_bytes", moved, "==", want[op], text, op=op, where=where)
    group_of = {AG: grid.ranks_in("dp_shard"), RS: grid.ranks_in("dp_shard")}
    group_of[AR] = grid.ranks_in("dp_replicate")
    wrong = sum(n for (op, ranks), n in c.groups.items() if list(ranks) != group_of.get(op))
    text = "  collectives outside the group the mesh gives them: {value:.0f}"
    run.report.claim("hsdp_groups_as_mesh", max_over_ranks(wrong), "==", 0, text)
    memory_between(run, model, shard)


def memory_between(run: Run, model, shard: int) -> None:
    """Parameter bytes a rank holds at rest: DDP (all of them), HSDP (1/shard), FSDP over the world (1/N)."""
    n = run.info.world_size
    fsdp = shard_blocks_then_root(run.fresh(), run.mesh)
    held = {  # the most any rank holds (a last rank's rows may be fewer: FSDP2 pads its storage)
        "DDP": storage_bytes(run.fresh().parameters()),
        "HSDP": int(max_over_ranks(storage_bytes(local_shard(p) for p in model.parameters()))),
        "FSDP": int(max_over_ranks(storage_bytes(local_shard(p) for p in fsdp.parameters()))),
    }
    row = ", ".join(f"{k} {v}" for k, v in held.items())
    text = "  parameter bytes a rank holds at rest: {row}"
    run.report.value("parameter_bytes", held, text, row=row)
    want = padded_bytes(run.fresh().parameters(), shard) // shard
    text = "  HSDP: {value} = rows padded to {shard}, / {shard}"
    run.report.claim("hsdp_parameter_bytes", held["HSDP"], "==", want, text, shard=shard)
    if 1 < shard < n:  # a true 2-D mesh: strictly between the two
        gap = min(held["DDP"] - held["HSDP"], held["HSDP"] - held["FSDP"])
        text = "  HSDP strictly between DDP and FSDP: the smaller gap is {value} bytes"
        run.report.claim("hsdp_memory_between", gap, ">=", 1, text)


# -------- 2. prefetching: the order of the all-gathers, and the gathered parameters held
def prefetching(run: Run) -> None:
    n = run.info.world_size
    units = fsdp_units(run.fresh())
    text = "sections 2-8: plain FSDP, fully_shard on a 1-D mesh of all {value} {ranks}"
    run.report.value("plain_fsdp_mesh", n, text, ranks="ranks" if n > 1 else "rank")
    if n == 1:  # a world of one gathers nothing: no order to show
        return run.report.value("prefetch", "nothing to gather", "2. prefetching: {value}")
    x, y = run.mine(run.batches[0][0])[0], run.mine(run.batches[0][1])[0]
    runs = prefetch_runs(lambda: shard_blocks_then_root(run.fresh(), run.mesh), x, y)
    run.report.record("prefetch_logs", {how: outcome["log"] for how, outcome in runs.items()})
    imp, off, exp = runs["implicit"], runs["none"], runs["explicit"]
    text = "2. prefetch: all-gathers in backward before its 1st reduce-scatter: implicit {value}"
    run.report.claim("prefetch_implicit_backward", imp["backward_gathers"], "==", 2, text)
    text = "  prefetch off: {value} (each block all-gathered only when its own backward begins)"
    run.report.claim("prefetch_none_backward", off["backward_gathers"], "==", 1, text)
    text = "  explicit backward prefetch: places where the backward order differs from implicit's: {value}"
    unlike = exp["unlike_implicit"]
    run.report.claim("prefetch_explicit_backward_as_implicit", unlike, "==", 0, text)
    text = "  forward: all-gathers before block 0 computes: explicit {value} (block 1 too), implicit {i}"
    got, i = exp["forward_gathers"], imp["forward_gathers"]
    run.report.claim("prefetch_explicit_forward", got, "==", 3, text, i=i)
    root, block = padded_bytes(units[-1], n), padded_bytes(units[0], n)
    for how, k in (("implicit", 1), ("explicit", 2)):  # set_modules_to_forward_prefetch: +1
        text = "  peak gathered parameter bytes in forward, {how}: {value} = root {r} + {k} x block {b}"
        got, want = int(max_over_ranks(runs[how]["peak"])), root + k * block
        run.report.claim(
            f"prefetch_{how}_peak", got, "==", want, text, how=how, r=root, k=k, b=block
        )
    if run.info.device.type == "cpu":  # gloo's all-gather returns done: compute waits for it
        text = (
            "  all-gathers in flight while a layer computes: {value} (a GPU's overlap: stated only)"
        )
        run.report.claim("prefetch_no_overlap_here", exp["in_flight"], "==", 0, text)


# -------- 3. mixed precision: what reduce_dtype changes
def mixed_precision(run: Run) -> None:
    low = DTYPES[run.args.param_dtype]
    n = run.info.world_size
    x, y = run.mine(run.batches[0][0])[0], run.mine(run.batches[0][1])[0]  # this rank's slice

    def build(**kw):
        policy = MixedPrecisionPolicy(**kw)
        return shard_blocks_then_root(run.fresh(), run.mesh, mp_policy=policy)

    _, b32 = one_backward(build(), x, y)
    exact = exact_mean_gradients(build(param_dtype=low), x, y)  # the same local grads, in float64
    scale = max(t.abs().max().item() for t in exact)  # the error: max|diff| / max|g|
    rows = {}
    for name, reduce in (("reduce_low", None), ("reduce_fp32", torch.float32)):
        g, b = one_backward(build(param_dtype=low, reduce_dtype=reduce), x, y)
        share = b.get(RS, 0) / max(b32.get(RS, 0), 1)  # no reduce-scatter in a world of one
        rows[name] = {"error": run.worst(g, exact) / scale, "rs_share": share, **b}
    run.report.record("mixed_precision", rows)
    lo, hi, dt = rows["reduce_low"], rows["reduce_fp32"], run.args.param_dtype
    text = "3. param_dtype={low}: the sharded gradients are {value} (the sharded parameters' dtype)"
    run.report.value("grad_dtype", lo["grad_dtype"], text, low=dt)
    if n > 1:
        text = "  reduce_dtype=None: reduce-scatter bytes {value} of fp32's (it reduces in {low})"
        run.report.claim("mp_reduce_default_halves_bytes", lo["rs_share"], "==", 0.5, text, low=dt)
        text = "  reduce_dtype=float32: reduce-scatter bytes {value} of fp32's"
        run.report.claim("mp_reduce_fp32_bytes", hi["rs_share"], "==", 1.0, text)
        text = "  reduction error vs the {low} local grads averaged in float64:"
        text += " reduce_dtype=float32 {value:.1e}"
        run.report.claim("mp_reduce_fp32_exact", hi["error"], "<=", 1e-6, text, low=dt)
        text = "  reduce_dtype=None: {value:.1e} (rounded to {low}: at least its eps / 16, {b:.1e})"
        b = torch.finfo(low).eps / 16  # the largest gradients' rounding: up to eps / 4 of max|g|
        run.report.claim("mp_reduce_low_rounds", lo["error"], ">=", b, text, low=dt, b=b)


# -------- 4. reshard_after_forward: what stays gathered between forward and backward
def reshard_after_forward(run: Run) -> None:
    n = run.info.world_size
    full = padded_bytes(run.fresh().parameters(), n)  # every unit gathered, rows padded to N
    count = len(fsdp_units(run.fresh()))
    # setting: (all-gathers a step, of them in groups smaller than N, parameter bytes held after forward)
    gathered = count if n > 1 else 0  # a world of one gathers nothing
    want = {True: (2 * gathered, 0, full // n), False: (gathered, 0, full)}
    if run.args.reshard_int:  # forward gathers over N; backward over k ranks, from the 1/k kept
        want[run.args.reshard_int] = (2 * count, count, full // run.args.reshard_int)
    rows = {}
    for k, (gathers, small, held) in want.items():
        model = shard_blocks_then_root(run.fresh(), run.mesh, reshard_after_forward=k)
        got = rows[str(k)] = one_step_profile(model, *run.batches[0], run.mine)
        name = f"reshard_{str(k).lower()}" if isinstance(k, bool) else "reshard_int"
        lead = "4. " if k is True else "  "
        text = lead + "reshard_after_forward={k}: {value} all-gathers a step"
        run.report.claim(f"{name}_all_gathers", got["all_gathers"], "==", gathers, text, k=k)
        text = "    of them in groups smaller than the world: {value}"
        run.report.claim(f"{name}_small_groups", got["in_smaller_groups"], "==", small, text)
        text = "    parameter bytes held from forward to backward: {value} (all gathered: {full})"
        run.report.claim(f"{name}_held_bytes", got["params"], "==", held, text, full=full)
    run.report.record("reshard_rows", rows)


# -------- 5. a model that does not fit one rank: meta device, fully_shard, to_empty, initialise
def meta_init(run: Run) -> None:
    model_bytes = storage_bytes(run.fresh().parameters())
    eager = full_values(run.fresh())
    built = (run.args.width, run.args.depth, run.mesh, run.info.device)
    naive = reset_sharded(meta_sharded(*built), run.args.seed)
    text = "5. meta, fully_shard, to_empty, reset_parameters(): differs from eager{many}: {value}"
    many = " (on more than one rank)" if run.info.world_size > 1 else ""
    differs = run.worst(full_values(naive), eager) > EQUAL
    run.report.value("reset_parameters_differs", differs, text, many=many)
    model = meta_sharded(*built)
    with allocations(run.info.device) as trace:
        largest = init_like_eager(model, run.args.seed)
    text = "  init_like_eager, buffers included: {value}"
    diff = run.worst(full_values(model), eager)
    run.report.claim("meta_init_equals_eager", diff, "==", 0.0, text)
    text = "  it holds one layer in full at a time: the largest, {value:.2f} of the model"
    run.report.claim("meta_init_one_layer_at_a_time", largest / model_bytes, "<=", 0.99, text)
    text = "  its peak allocation, gloo's buffers included (they vary): {value:.2f} of the model"
    run.report.perf("meta_init_peak", max_over_ranks(trace.peak / model_bytes), text)
    broadcast_load(run, eager, meta_sharded(*built), model_bytes)


def broadcast_load(run: Run, eager: list, model, model_bytes: int) -> None:
    """A full state dict on rank 0 only (as read from a checkpoint), into the sharded meta-built model."""
    sentinel = 7.0
    model.pixel_mean.fill_(sentinel)  # to_empty left them uninitialised: a known value instead
    model.pixel_scale.fill_(sentinel)
    # the other ranks pass nothing; rank 0 a copy: set_model_state_dict turns the values into DTensors
    full = {k: v.clone() for k, v in run.init.items()} if run.info.master_process else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with allocations(run.info.device) as trace, count_collectives() as c:
        set_model_state_dict(model, full, options=options)
    sent = [b for op, b in c.log if op == "broadcast"]  # a call per tensor: _broadcast_state_dict
    text = "  broadcast_from_rank0 load: {n} broadcasts, the largest {value} bytes (model: {m})"
    want = max(t.numel() * t.element_size() for t in run.init.values())
    got, n = max(sent, default=0), len(sent)
    run.report.claim("broadcast_one_tensor_at_a_time", got, "==", want, text, n=n, m=model_bytes)
    mean = run.worst([model.pixel_mean], [eager[-2]])  # persistent: in the state dict, broadcast
    text = "  pixel_mean (persistent) loaded: max |difference| from eager {value}"
    run.report.claim("broadcast_loads_persistent_buffer", mean, "==", 0.0, text)
    left = run.worst([model.pixel_scale], [torch.full_like(model.pixel_scale, sentinel)])
    text = "  pixel_scale (non-persistent, in no state dict) left as it was: {value}"
    run.report.value("buffer_skipped", left == 0.0, text)
    model.init_buffers()  # NormalisedMLP's own method (not FSDP's): the buffers from their formula
    text = "  after the model's init_buffers(): max |difference| from eager {value}"
    diff = run.worst(full_values(model), eager)
    run.report.claim("broadcast_load_equals_eager", diff, "==", 0.0, text)
    text = "  the other ranks' peak allocation, gloo's buffers included (varies): {value:.2f} of it"
    # the ranks that never had the full state dict
    peaks = all_gather_objects(trace.peak, run.info)[1:]
    if peaks:
        run.report.perf("broadcast_peak", max(peaks) / model_bytes, text)


# -------- 6. gradient accumulation: set_requires_gradient_sync
def accumulation(run: Run, ref: list) -> None:
    n = run.info.world_size
    k = run.args.micro_steps
    counted = {}
    for sync_each in (False, True):
        model = shard_blocks_then_root(run.fresh(), run.mesh)
        with count_collectives() as c:
            train_sharded(model, run.batches, run.mine, run.args.lr, micro=k, sync_each=sync_each)
        counted[sync_each] = c.calls.get(RS, 0)
        if not sync_each:
            text = "6. {k} micro-steps, gradient sync on the last only, vs one process: {value:.1e}"
            diff = run.worst(full_params(model), ref)
            run.report.claim("accumulation_equals_one_process", diff, "<=", EQUAL, text, k=k)
    a, b = counted[True], counted[False]
    if n > 1:  # a world of one reduce-scatters nothing
        text = "  reduce-scatters: {a} synced every micro-step, {b} on the last only: {value:g} x fewer"
        fewer = a / max(b, 1)
        run.report.claim("accumulation_fewer_reduce_scatters", fewer, "==", k, text, a=a, b=b)
    params = list(run.fresh().parameters())
    want = {False: storage_bytes(params), True: padded_bytes(params, n) // n}
    xm = run.mine(run.batches[0][0], k)[0]  # micro-step 1's batch
    ym = run.mine(run.batches[0][1], k)[0]
    for sync in (False, True):  # the gradients it leaves held: unsharded (sync off) or sharded (on)
        model = shard_blocks_then_root(run.fresh(), run.mesh)
        model.set_requires_gradient_sync(sync)
        one_backward(model, xm, ym)
        text = "  gradients held after micro-step 1, sync {sync}: {value} bytes ({what})"
        what = "sharded, rows padded" if sync else "unsharded: all of them"
        name = f"accumulation_held_sync_{str(sync).lower()}"
        held = int(max_over_ranks(gradient_bytes(model)))  # the most any rank holds
        run.report.claim(name, held, "==", want[sync], text, sync=sync, what=what)


# -------- 7. clipping and the optimizer state
def clipping_and_state(run: Run) -> None:
    n = run.info.world_size
    model, plain = shard_blocks_then_root(run.fresh(), run.mesh), run.fresh()
    x, y = run.batches[0]
    F.cross_entropy(model(run.mine(x)[0]), run.mine(y)[0]).backward()
    F.cross_entropy(plain(x), y).backward()  # one process, the global batch
    at = 0.5 * nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()  # it clips
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=at)  # a DTensor: over all shards
    norm, want = norm.full_tensor().item(), nn.utils.clip_grad_norm_(plain.parameters(), at).item()
    text = "7. clip_grad_norm_ on DTensors: norm {norm:.6f},"
    text += " relative difference from one process's: {value:.1e}"
    rel = abs(norm - want) / want
    run.report.claim("clip_norm_equals_one_process", rel, "<=", 1e-6, text, norm=norm)
    grads = [p.grad.full_tensor() for p in model.parameters()]
    text = "  the clipped gradients (max_norm: half the norm) vs one process's: max |difference| {value:.1e}"
    diff = run.worst(grads, [p.grad for p in plain.parameters()])
    run.report.claim("clipped_grads_equal", diff, "<=", 1e-6, text)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    state = [local_shard(t) for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    params, held = list(plain.parameters()), storage_bytes(state)  # zeros_like: the rows, unpadded
    want = 2 * padded_bytes(params, n) // n + 4 * len(params)  # exp_avg, exp_avg_sq; 4-byte steps
    text = "  Adam's state, the most a rank holds: {value} bytes = 2 x rows padded / {n} + 4 x {t}"
    held_most, t = int(max_over_ranks(held)), len(params)
    run.report.claim("adam_state_sharded", held_most, "==", want, text, n=n, t=t)
    text = "    (4 bytes of `step` per parameter tensor; the least a rank holds, chunks short: {value})"
    run.report.value("adam_state_least", int(-max_over_ranks(-held)), text)


# -------- 8. CPU offload: what runs here
def not_here(run: Run) -> None:
    x, y, dev = run.mine(run.batches[0][0])[0], run.mine(run.batches[0][1])[0], run.info.device.type
    for pin in (True, False):  # pin_memory=True pins the CPU copies: that needs an accelerator
        policy = CPUOffloadPolicy(pin_memory=pin)
        build = lambda: shard_blocks_then_root(run.fresh(), run.mesh, offload_policy=policy)  # noqa: E731
        got = backward_outcome(build, x, y)
        text = ("8. " if pin else "  ") + "CPUOffloadPolicy(pin_memory={pin}) on {dev}: {value}"
        run.report.value(f"cpu_offload_pin_{str(pin).lower()}", got, text, pin=pin, dev=dev)
    if dev == "cpu":
        text = "  offload from a CPU to the CPU {value}"
        run.report.value("cpu_offload_here", "moves nothing", text)


def main() -> None:
    world_of_one()
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        train_set, _ = digits_split(path=args.data)
        set_seed(args.seed)
        init = NormalisedMLP(args.width, args.depth).to(info.device).state_dict()
        batches = global_batch_slices(  # whole global batches (rank 0 of 1): run.mine slices them
            train_set, args.steps, args.global_batch, args.seed, 0, 1, device=info.device
        )
        mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))
        run = Run(args, info, report, batches, init, mesh)
        report.record("world_size", info.world_size)
        text = "world_size {n}, NormalisedMLP width {w} depth {d}: {value} parameters, {u} units"
        n_params, u = sum(t.numel() for t in run.fresh().parameters()), len(fsdp_units(run.fresh()))
        report.value("n_params", n_params, text, n=info.world_size, w=args.width, d=args.depth, u=u)
        ref = one_process(run.fresh(), run.batches, args.lr)  # every rank alike
        hsdp(run, ref)
        prefetching(run)
        mixed_precision(run)
        reshard_after_forward(run)
        meta_init(run)
        accumulation(run, ref)
        clipping_and_state(run)
        not_here(run)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
