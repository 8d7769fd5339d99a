"""Lesson 06: gradient accumulation, mixed precision and activation checkpointing under DDP.

Run it:

    python lessons/06_gradient_accumulation.py                                    # one process: k = 8 micro-steps
    torchrun --standalone --nproc_per_node=2 lessons/06_gradient_accumulation.py  # 2 ranks: k = 4 micro-steps
    torchrun --standalone --nproc_per_node=2 lessons/06_gradient_accumulation.py --precision bf16 --checkpointing
    torchrun --standalone --nproc_per_node=2 lessons/06_gradient_accumulation.py --global-batch 64 --micro-batch 8

    # on GPUs: the same commands; the table then also shows peak CUDA memory, and --precision fp16 uses a
    # GradScaler on CUDA (it runs on CPU too in torch 2.13, where it is only useful as a demonstration)

What to look for:
- The global batch is fixed (16) and the number of micro-steps follows from it:
  grad_accum_steps = global_batch / (micro_batch x world_size) = 16 / (2 x 2) = 4 with 2 ranks, 16 / 2 = 8 alone.
- "accumulated vs one step on the global batch": max |difference| < 1e-5 for gradients and parameters. Not
  dividing the loss by grad_accum_steps, or dividing by the running micro_step + 1, gives k-fold / wrong
  gradients; with micro-batches of different sizes, weight by samples (sum of losses / global batch).
- All-reduce calls per optimizer step: with no_sync() one reduction round per optimizer step, without it one
  per micro-step -- k times the calls and bytes for the same gradient. no_sync() must hold the FORWARD: DDP arms
  its reducer in forward, so a forward outside no_sync() with only backward inside still all-reduces.
- Gradient clipping and GradScaler.unscale_/step/update run once per optimizer step, after the last
  (synchronising) backward. A second unscale_ before update() raises.
- bf16 autocast stays within 1e-3 of fp32 after 5 steps; it halves activation bytes but keeps a bf16 copy of
  each weight for backward, which at this width and micro-batch costs more than it saves (table, row 3: 1.988 MB
  against fp32's 1.868 MB at micro-batch 128).
- "not dividing + clipping" ends with the right parameters although its gradient is k times too large: the clip
  rescales any gradient above the threshold to the same norm, hiding the missing 1/k; the gradient column shows it.
- Activation checkpointing: identical gradients, 56% fewer saved-activation bytes for this model, paid for with
  a recomputed forward (the [perf] table). Accumulation cuts activation bytes by about k, not the parameters,
  gradients or optimizer state.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

from common.checkpoint import write_results
from common.data import digits_split
from common.ranks import gather_to_rank0, global_mean, max_param_diff_across_ranks, print0
from common.session import (DistInfo, LessonError, add_distributed_args, distributed_session, read_torchrun_env,
                            run_main, set_seed)
from common.counters import CommCounter, saved_tensor_bytes
from common.metrics import evaluate
from common.models import mlp

PRECISIONS = ("fp32", "bf16", "fp16")


# ----------------------------------------------------------------------------------------------------- model
class ResidualMLP(nn.Module):
    """A stack of residual GELU MLP blocks for flattened 8x8 digits; no BatchNorm.

    Shapes: x (B, 1, 8, 8) or (B, 64) -> logits (B, 10).

        stem   Linear(64 -> w)                                  (B, w)
        block  h + Linear(w -> w) . GELU . Linear(w -> w) (h)    (B, w), `depth` times (common.models.mlp)
        head   GELU . Linear(w -> 10)                            (B, 10)

    Why no BatchNorm: BatchNorm normalises each micro-batch with its own mean and variance, so k micro-batches
    of 2 are not the same computation as one batch of 16 and the accumulation proof could not hold (lesson 05).
    LayerNorm would be fine (per sample); plain residual blocks keep the model small.

    With `checkpointing=True` each block runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
    (https://pytorch.org/docs/stable/checkpoint.html): autograd keeps only the block's input and recomputes
    the block's forward during backward. Per block that keeps 1 tensor of (B, w) instead of 3 (the first
    Linear's input, the GELU's input and the second Linear's input).
    """

    def __init__(self, width: int = 256, depth: int = 4, in_features: int = 64, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(mlp([width, width, width], activation=nn.GELU) for _ in range(depth))
        self.head = nn.Sequential(nn.GELU(), nn.Linear(width, num_classes))
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))  # (B, w)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                # Keeps only `h` (B, w) for backward; the block's inner tensors are recomputed during backward.
                h = h + checkpoint(block, h, use_reentrant=False)
            else:
                h = h + block(h)
        return self.head(h)


def saved_activation_bytes(model: nn.Module, run) -> int:
    """Bytes autograd keeps for backward while `run()` executes, parameters excluded.

    `common.counters.saved_tensor_bytes` counts every saved storage once; a Linear saves its weight, which is
    memory that exists anyway, so parameters are excluded. Under autocast the low-precision weight copies
    autocast makes ARE counted: they live until backward. A checkpointed block (use_reentrant=False) saves its
    input through the same hooks, so the count includes it (checked: 4 blocks of a (128, 256) input each add
    4 x 131072 bytes); the tensors it recomputes in backward are not saved and not counted.

    Returns:
        bytes (int); `run` is a callable doing one forward (its outputs must stay alive until it returns).
    """
    with saved_tensor_bytes(exclude=model.parameters()) as saved:
        out = run()
    del out
    return saved.bytes


def autocast_context(device: torch.device, precision: str):
    """torch.autocast for bf16/fp16 on this device type; a no-op for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def grad_accum_steps_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """grad_accum_steps k such that k x micro_batch x world_size = global_batch.

    Raises:
        LessonError: a size below 1, or global_batch not divisible by micro_batch x world_size.
    """
    if global_batch < 1 or micro_batch < 1:
        raise LessonError(f"--global-batch and --micro-batch must be positive, got {global_batch} and {micro_batch}")
    per_round = micro_batch * world_size
    if global_batch % per_round:
        raise LessonError(f"--global-batch {global_batch} is not divisible by --micro-batch x world_size = "
                          f"{micro_batch} x {world_size} = {per_round}")
    return global_batch // per_round


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step over ALL ranks "
                   "(default 16, or micro-batch x world_size x grad-accum-steps when that is given)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per rank per forward/backward (default 2)")
    p.add_argument("--grad-accum-steps", type=int, default=None,
                   help="micro-steps per optimizer step, k (default: global-batch / (micro-batch x world_size))")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the training run (default 40)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm, applied once per optimizer step")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="training run: fp32, bf16 autocast, or fp16 autocast + GradScaler")
    p.add_argument("--checkpointing", action="store_true", help="training run with activation checkpointing")
    p.add_argument("--width", type=int, default=256, help="hidden width of the residual MLP (default 256)")
    p.add_argument("--depth", type=int, default=4, help="residual blocks (default 4)")
    p.add_argument("--bench-batch", type=int, default=256,
                   help="global batch of the memory/time table (default 256; divisible by world_size x 8)")
    p.add_argument("--bench-repeats", type=int, default=10, help="timed optimizer steps per table row (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank reads the same argv and environment, so every rank
    # raises the same one-line LessonError and nobody waits in a collective for a rank that already left.
    _, _, world_size, _ = read_torchrun_env()
    if args.grad_accum_steps is not None and args.grad_accum_steps <= 0:
        raise LessonError(f"--grad-accum-steps must be a positive integer, got {args.grad_accum_steps}")
    if args.global_batch is None:
        args.global_batch = 16 if args.grad_accum_steps is None else \
            args.grad_accum_steps * args.micro_batch * world_size
    k = grad_accum_steps_for(args.global_batch, args.micro_batch, world_size)
    if args.grad_accum_steps is not None and args.grad_accum_steps != k:
        raise LessonError(f"--grad-accum-steps {args.grad_accum_steps} disagrees with --global-batch "
                          f"{args.global_batch} / (--micro-batch {args.micro_batch} x world_size {world_size}) = {k}")
    args.grad_accum_steps = k
    if args.steps < 1 or args.lr <= 0 or args.clip <= 0:
        raise LessonError("--steps, --lr and --clip must be positive")
    if args.width < 1 or args.depth < 1 or args.bench_repeats < 1:
        raise LessonError("--width, --depth and --bench-repeats must be positive")
    if args.bench_batch < 1 or args.bench_batch % (8 * world_size):
        raise LessonError(f"--bench-batch {args.bench_batch} must be a positive multiple of 8 x world_size = "
                          f"{8 * world_size} (the table splits it into 4 micro-steps per rank)")
    return args


# ------------------------------------------------------------------------------------------ the proof pieces
def wrap(raw_model: nn.Module, info: DistInfo):
    """(model, counter): DDP with a counting comm hook under a process group, the raw model otherwise."""
    counter = CommCounter()
    if not info.distributed:
        return raw_model, counter
    model = DDP(raw_model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    counter.register(model)  # counts DDP's bucket all-reduces, then averages them as DDP's default hook does
    return model, counter


def one_accumulated_step(model, raw_model, counter, micro_batches, variant: str, clip: float | None, lr: float,
                         info: DistInfo) -> dict:
    """One optimizer step of plain SGD from raw_model's current weights, accumulating over `micro_batches`.

    micro_batches: this rank's list of (x, y); their sizes may differ. `variant` picks the loss scaling and
    the synchronisation:
        "no_sync"             forward+backward of micro-steps 0..k-2 inside model.no_sync(); loss / k
        "require_grad_sync"   model.require_backward_grad_sync = (micro_step == k - 1) before each forward
        "always_sync"         no no_sync(): every backward all-reduces; loss / k
        "backward_only_no_sync"  forward OUTSIDE no_sync(), only backward inside; loss / k
        "no_divide"           like no_sync but the loss is not divided: the gradient is k times too large
        "running_divide"      loss / (micro_step + 1): micro-step i gets weight 1/(i+1)
        "sample_weighted"     sum of per-sample losses / this rank's samples: right for unequal micro-batches
        "clip_each_micro_step"  clip_grad_norm_ after every backward, also on partial un-synchronised gradients
    clip: max gradient norm applied once after the last backward (None: no clipping).

    Returns:
        {"grads": [tensor per parameter] after the last backward (synchronised), "calls", "bytes"}
        and raw_model's parameters are updated in place (p -= lr * grad, clipped when clip is given).
    """
    k = len(micro_batches)
    n_local = sum(len(y) for _, y in micro_batches)
    raw_model.zero_grad(set_to_none=True)
    counter.reset()
    ddp = isinstance(model, DDP)
    for micro_step, (x, y) in enumerate(micro_batches):
        last = micro_step == k - 1
        sync_ctx = model.no_sync() if ddp and not last and variant not in ("always_sync", "require_grad_sync",
                                                                         "backward_only_no_sync") else nullcontext()
        if ddp and variant == "require_grad_sync":
            model.require_backward_grad_sync = last  # what no_sync() sets and restores, nanoGPT style
        with sync_ctx:
            logits = model(x)
            if variant == "sample_weighted":
                loss = F.cross_entropy(logits, y, reduction="sum") / n_local
            elif variant == "no_divide":
                loss = F.cross_entropy(logits, y)
            elif variant == "running_divide":
                loss = F.cross_entropy(logits, y) / (micro_step + 1)
            else:
                loss = F.cross_entropy(logits, y) / k  # mean over the micro-batch / k = mean over k x m samples
        bwd_ctx = model.no_sync() if ddp and not last and variant == "backward_only_no_sync" else nullcontext()
        with bwd_ctx:
            loss.backward()
        if variant == "clip_each_micro_step":
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
    if ddp:
        model.require_backward_grad_sync = True
    grads = [p.grad.detach().clone() for p in raw_model.parameters()]
    if clip is not None:  # after the synchronising backward: the norm of the global gradient, same on all ranks
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
    with torch.no_grad():
        for p in raw_model.parameters():
            p -= lr * p.grad
    raw_model.zero_grad(set_to_none=True)
    return {"grads": grads, "calls": counter.calls, "bytes": counter.bytes}


def reference_step(raw_model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float | None, lr: float) -> list:
    """One SGD step on the whole global batch in one forward (mean loss), in place; returns the gradients."""
    raw_model.zero_grad(set_to_none=True)
    F.cross_entropy(raw_model(x), y).backward()
    grads = [p.grad.detach().clone() for p in raw_model.parameters()]
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
    with torch.no_grad():
        for p in raw_model.parameters():
            p -= lr * p.grad
    raw_model.zero_grad(set_to_none=True)
    return grads


def max_diff(a, b) -> float:
    return max((u.float() - v.float()).abs().max().item() for u, v in zip(a, b))


def uneven_sizes(n: int, k: int) -> list[int]:
    """Split n samples into k micro-batches of DIFFERENT sizes (all >= 1 when n >= k): [n-k+1, 1, 1, ...]."""
    return [n - (k - 1)] + [1] * (k - 1) if k > 1 else [n]


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts its unscale_/step/update calls (for the once-per-optimizer-step proof)."""

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


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up (CUDA synchronised around each)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        W, k, m, G = info.world_size, args.grad_accum_steps, args.micro_batch, args.global_batch
        dev = info.device
        train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
        set_seed(args.seed)
        raw_model = ResidualMLP(args.width, args.depth).to(dev)
        init_state = copy.deepcopy(raw_model.state_dict())
        model, counter = wrap(raw_model, info)  # .to(device) -> DDP; raw_model is what we read and save
        n_params = sum(p.numel() for p in raw_model.parameters())
        print0(f"world_size {W}  backend {info.backend or 'none'}  device {dev.type}  model ResidualMLP "
               f"width {args.width} depth {args.depth} ({n_params} parameters, no BatchNorm)")
        print0(f"global batch {G} = micro_batch {m} x world_size {W} x grad_accum_steps {k}")
        results = {"world_size": W, "backend": info.backend, "device": dev.type, "global_batch": G,
                   "micro_batch": m, "grad_accum_steps": k, "n_params": n_params}

        # -------- 1. Proof: k micro-steps == one step on the global batch (same 16 samples, same init). ------
        # Every rank draws the same global batch; rank r's micro-step j holds samples (j*W + r)*m ... + m.
        g = torch.Generator().manual_seed(args.seed + 1)
        idx = torch.randperm(len(train_set), generator=g)[:G]
        gx, gy = train_set.tensors[0][idx].to(dev), train_set.tensors[1][idx].to(dev)
        mine = [torch.arange((j * W + info.rank) * m, (j * W + info.rank + 1) * m) for j in range(k)]
        micro = [(gx[i], gy[i]) for i in mine]
        # DDP rebuilds its gradient buckets after the first synchronised backward (in the order gradients became
        # ready), so the bucket count of iteration 1 can differ from every later one: warm up once, then count.
        raw_model.load_state_dict(init_state)
        F.cross_entropy(model(micro[0][0]), micro[0][1]).backward()
        raw_model.zero_grad(set_to_none=True)

        def compare(variant, batches, clip, ref_grads, ref_params):
            raw_model.load_state_dict(init_state)
            out = one_accumulated_step(model, raw_model, counter, batches, variant, clip, args.lr, info)
            return {"grad_max_abs_diff": max_diff(out["grads"], ref_grads),
                    "param_max_abs_diff": max_diff(raw_model.parameters(), ref_params),
                    "allreduce_calls": out["calls"], "allreduce_bytes": out["bytes"]}

        raw_model.load_state_dict(init_state)
        ref_grads = reference_step(raw_model, gx, gy, None, args.lr)  # no clipping: the plain SGD step
        ref_params = [p.detach().clone() for p in raw_model.parameters()]
        ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g_) for g_ in ref_grads])).item()
        variants = ["no_sync", "no_divide", "running_divide"]
        if info.distributed:
            variants[1:1] = ["require_grad_sync", "always_sync", "backward_only_no_sync"]
        proof = {v: compare(v, micro, None, ref_grads, ref_params) for v in variants}
        # Unequal micro-batch sizes (same samples, split [n-k+1, 1, 1, ...] on every rank): mean/k overweights
        # the lone samples; summing per-sample losses and dividing by the samples is exact.
        local_idx = torch.cat(mine)
        sizes = uneven_sizes(len(local_idx), k)
        uneven = [(gx[c], gy[c]) for c in torch.split(local_idx, sizes)]
        proof["uneven_mean_over_k"] = compare("no_sync", uneven, None, ref_grads, ref_params)
        proof["uneven_sample_weighted"] = compare("sample_weighted", uneven, None, ref_grads, ref_params)
        # Clipping at half the global gradient norm, so that it acts: once after sync is exact; clipping every
        # micro-step clips partial (and, under no_sync, per-rank) gradients. Not dividing by k is hidden in the
        # parameters by clipping (same direction, norm capped) but not in the gradient norm you log.
        clip = 0.5 * ref_norm
        raw_model.load_state_dict(init_state)
        ref_grads_c = reference_step(raw_model, gx, gy, clip, args.lr)
        ref_params_c = [p.detach().clone() for p in raw_model.parameters()]
        for name, v in (("clip_after_sync", "no_sync"), ("clip_each_micro_step", "clip_each_micro_step"),
                        ("no_divide+clip", "no_divide")):
            proof[name] = compare(v, micro, clip, ref_grads_c, ref_params_c)
        # Worst case over ranks: every rank compared its own copy with the reference.
        worst = gather_to_rank0({v: (d["grad_max_abs_diff"], d["param_max_abs_diff"]) for v, d in proof.items()},
                                info)
        if info.master_process:
            for v in proof:
                proof[v]["grad_max_abs_diff"] = max(w[v][0] for w in worst)
                proof[v]["param_max_abs_diff"] = max(w[v][1] for w in worst)
        results["proof"] = proof
        results.update({"uneven_sizes": sizes, "reference_grad_norm": ref_norm, "proof_clip": clip})
        print0(f"\n1. {k} accumulated micro-steps vs one SGD step on the same {G}-sample global batch "
               f"(max |difference| over ranks)")
        print0(f"{'variant':<22} {'grads':>9} {'params':>9} {'all-reduce calls':>17}")
        for v, d in proof.items():
            if v == "clip_after_sync":
                print0(f"with clipping at {clip:.4f} = half the global gradient norm:")
            print0(f"{v:<22} {d['grad_max_abs_diff']:>9.1e} {d['param_max_abs_diff']:>9.1e} "
                   f"{d['allreduce_calls']:>17}")
        print0(f"(uneven micro-batch sizes per rank: {sizes})")

        # -------- 2. All-reduce calls and bytes per optimizer step against k (same micro-batch of 2). -------
        comm = []
        if info.distributed:
            for kk in (1, 2, 4, 8):
                batches = [(gx[:m], gy[:m])] * kk  # the data does not matter for counting
                row = {"k": kk}
                for v, tag in (("no_sync", "accum"), ("always_sync", "every_micro_step")):
                    raw_model.load_state_dict(init_state)
                    out = one_accumulated_step(model, raw_model, counter, batches, v, args.clip, args.lr, info)
                    row[f"{tag}_calls"], row[f"{tag}_bytes"] = out["calls"], out["bytes"]
                comm.append(row)
            print0(f"\n2. all-reduce per optimizer step, micro-batch {m} (one reduction round = "
                   f"{comm[0]['accum_calls']} bucket all-reduces of this rank's gradient bytes)")
            print0(f"{'k':>3} {'calls no_sync':>14} {'calls every step':>17} {'MB no_sync':>11} {'MB every step':>14}")
            for r in comm:
                print0(f"{r['k']:>3} {r['accum_calls']:>14} {r['every_micro_step_calls']:>17} "
                       f"{r['accum_bytes'] / 1e6:>11.3f} {r['every_micro_step_bytes'] / 1e6:>14.3f}")
        results["comm_by_k"] = comm

        # -------- 3. Mixed precision: bf16 autocast vs fp32 after a few steps; GradScaler once per step. ----
        n_mp = 5
        finals = {}
        for prec in ("fp32", "bf16"):
            raw_model.load_state_dict(init_state)
            opt = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)
            for step in range(n_mp):
                for micro_step, (x, y) in enumerate(micro):
                    ctx = model.no_sync() if info.distributed and micro_step < k - 1 else nullcontext()
                    with ctx:
                        with autocast_context(dev, prec):
                            loss = F.cross_entropy(model(x), y) / k  # autocast: logits bf16, loss in fp32
                        loss.backward()
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            finals[prec] = [p.detach().clone() for p in raw_model.parameters()]
        bf16_diff = max_diff(finals["bf16"], finals["fp32"])
        fp32_change = max_diff(finals["fp32"], [init_state[n].to(dev) for n, _ in raw_model.named_parameters()])
        # bf16 keeps 8 significant bits (relative rounding up to 2^-8 = 0.4%) in matmul inputs and outputs; the
        # parameters, gradients and the update stay fp32. Stated tolerance: 1e-3 absolute after 5 steps, i.e.
        # a few percent of the largest fp32 parameter change (printed); measured here about 2e-4.
        bf16_tol = 1e-3
        # GradScaler (fp16): 8 micro-batches with k = 4 -> exactly 2 optimizer steps, each unscale/clip/step/update.
        scaler = CountingScaler(dev.type)
        raw_model.load_state_dict(init_state)
        opt = torch.optim.SGD(raw_model.parameters(), lr=args.lr)
        scaler_k, scaler_error, eight = 4, None, (micro * 8)[:8]
        try:
            for micro_step, (x, y) in enumerate(eight):
                last = (micro_step + 1) % scaler_k == 0
                ctx = model.no_sync() if info.distributed and not last else nullcontext()
                with ctx:
                    with autocast_context(dev, "fp16"):
                        loss = F.cross_entropy(model(x), y) / scaler_k
                    scaler.scale(loss).backward()  # gradients carry the scale factor, accumulated
                if last:
                    scaler.unscale_(opt)  # once: divides the accumulated grads by the scale
                    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip)  # on true gradients
                    scaler.step(opt)  # skipped if any inf/NaN; all ranks see the same synced grads
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
        except Exception as e:  # reported, and asserted absent by the tests
            scaler_error = f"{type(e).__name__}: {e}"
        # The classic mistake: unscale_ on every micro-step. The second call before update() raises.
        wrong = torch.amp.GradScaler(dev.type)
        double_unscale_error = None
        for micro_step, (x, y) in enumerate(micro[:2]):
            with (model.no_sync() if info.distributed else nullcontext()):
                with autocast_context(dev, "fp16"):
                    loss = F.cross_entropy(model(x), y) / k
                wrong.scale(loss).backward()
            try:
                wrong.unscale_(opt)
            except RuntimeError as e:
                double_unscale_error = str(e).split("\n")[0]
        opt.zero_grad(set_to_none=True)
        results["mixed_precision"] = {"steps": n_mp, "bf16_vs_fp32_param_max_abs_diff": bf16_diff,
                                      "fp32_param_max_abs_change": fp32_change,
                                      "bf16_tolerance": bf16_tol, "scaler_device": dev.type,
                                      "scaler_micro_batches": 8, "scaler_k": scaler_k, "scaler_counts": scaler.counts,
                                      "scaler_error": scaler_error, "double_unscale_error": double_unscale_error}
        print0(f"\n3. mixed precision: after {n_mp} optimizer steps, bf16 autocast vs fp32 max |parameter "
               f"difference| {bf16_diff:.1e} ({'<' if bf16_diff < bf16_tol else '>='} tolerance {bf16_tol:g}; "
               f"largest fp32 parameter change {fp32_change:.1e})")
        print0(f"   fp16 + GradScaler({dev.type!r}), 8 micro-batches, k = {scaler_k}: unscale_ "
               f"{scaler.counts['unscale_']}, step {scaler.counts['step']}, update {scaler.counts['update']}, "
               f"error: {scaler_error or 'none'}")
        print0(f"   unscale_ on every micro-step: {double_unscale_error or 'no error'}")

        # -------- 4. Activation checkpointing: same gradients, fewer saved bytes, a recomputed forward. -----
        raw_model.load_state_dict(init_state)
        bx, by = gx[:m], gy[:m]
        grads_ck = {}
        for ck in (False, True):
            raw_model.checkpointing = ck
            raw_model.zero_grad(set_to_none=True)
            F.cross_entropy(model(bx), by).backward()  # synchronised: DDP + checkpoint(use_reentrant=False)
            grads_ck[ck] = [p.grad.detach().clone() for p in raw_model.parameters()]
        raw_model.zero_grad(set_to_none=True)
        ck_grad_diff = max_diff(grads_ck[True], grads_ck[False])
        per_rank_bench = args.bench_batch // W
        bench_idx = torch.arange(per_rank_bench) % len(train_set)
        bench_x, bench_y = train_set.tensors[0][bench_idx].to(dev), train_set.tensors[1][bench_idx].to(dev)

        def act_bytes(batch: int, ck: bool, prec: str = "fp32") -> int:
            raw_model.checkpointing = ck
            with autocast_context(dev, prec):
                n = saved_activation_bytes(raw_model, lambda: raw_model(bench_x[:batch]))
            raw_model.checkpointing = False
            return n

        plain_b, ck_b = act_bytes(per_rank_bench, False), act_bytes(per_rank_bench, True)
        ck_cut = 1 - ck_b / plain_b
        by_micro = [{"micro_batch": b, "plain_bytes": act_bytes(b, False), "checkpointing_bytes": act_bytes(b, True)}
                    for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= per_rank_bench]
        results["checkpointing"] = {"grad_max_abs_diff_vs_plain": ck_grad_diff, "micro_batch": per_rank_bench,
                                    "plain_activation_bytes": plain_b, "checkpointing_activation_bytes": ck_b,
                                    "activation_bytes_cut": ck_cut, "activation_bytes_by_micro_batch": by_micro}
        print0(f"\n4. activation checkpointing (use_reentrant=False, one checkpoint per block): gradients vs plain "
               f"max |difference| {ck_grad_diff:.1e}")
        print0(f"   saved-activation bytes per rank at micro-batch {per_rank_bench}: plain {plain_b / 1e6:.3f} MB, "
               f"checkpointing {ck_b / 1e6:.3f} MB ({100 * ck_cut:.0f}% less)")
        print0(f"   {'micro-batch':>11} {'plain MB':>9} {'ckpt MB':>9}")
        for r in by_micro:
            print0(f"   {r['micro_batch']:>11} {r['plain_bytes'] / 1e6:>9.3f} {r['checkpointing_bytes'] / 1e6:>9.3f}")

        # -------- 5. The table: one optimizer step on the bench global batch, four ways. -------------------
        def bench_step(kk: int, prec: str, ck: bool):
            mb = per_rank_bench // kk
            opt = torch.optim.SGD(raw_model.parameters(), lr=1e-4)
            # fp16 needs loss scaling (its gradients underflow); a disabled scaler is a pass-through for the rest
            scaler = torch.amp.GradScaler(dev.type, enabled=prec == "fp16")

            def step():
                raw_model.checkpointing = ck
                for micro_step in range(kk):
                    ctx = model.no_sync() if info.distributed and micro_step < kk - 1 else nullcontext()
                    with ctx:
                        with autocast_context(dev, prec):
                            loss = F.cross_entropy(model(bench_x[micro_step * mb:(micro_step + 1) * mb]),
                                                   bench_y[micro_step * mb:(micro_step + 1) * mb]) / kk
                        scaler.scale(loss).backward()
                scaler.unscale_(opt)  # once per optimizer step, before clipping
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                raw_model.checkpointing = False
            return step, mb

        table = []
        rows = [("plain", 1, "fp32", False), ("accumulation k=4", 4, "fp32", False), ("bf16 autocast", 1, "bf16", False),
                ("checkpointing", 1, "fp32", True)]
        if dev.type == "cuda":
            rows.insert(3, ("fp16 + GradScaler", 1, "fp16", False))  # the scaler's cost is small; shown on CUDA
        for name, kk, prec, ck in rows:
            raw_model.load_state_dict(init_state)
            step, mb = bench_step(kk, prec, ck)
            raw_model.checkpointing = ck
            with autocast_context(dev, prec):
                saved = saved_activation_bytes(raw_model, lambda: raw_model(bench_x[:mb]))
            raw_model.checkpointing = False
            peak = None
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(dev)
            secs = timed(step, dev, args.bench_repeats)
            t = gather_to_rank0(secs, info)
            table.append({"name": name, "k": kk, "micro_batch": mb, "precision": prec, "checkpointing": ck,
                          "saved_activation_bytes": saved, "peak_cuda_bytes": peak,
                          "step_s": max(t) if t else secs})
        results["table"] = table
        print0(f"\n5. one optimizer step on a global batch of {args.bench_batch} ({per_rank_bench} per rank)")
        print0(f"   {'setting':<20} {'micro-batch':>11} {'saved MB':>9}")
        for r in table:
            print0(f"   {r['name']:<20} {r['micro_batch']:>11} {r['saved_activation_bytes'] / 1e6:>9.3f}")
        plain_s = table[0]["step_s"]
        for r in table:
            peak = f", peak CUDA {r['peak_cuda_bytes'] / 1e6:.1f} MB" if r["peak_cuda_bytes"] is not None else ""
            print0(f"[perf] {r['name']:<20} step {1e3 * r['step_s']:8.1f} ms ({r['step_s'] / plain_s:.2f}x plain)"
                   f"{peak}")
        if comm:
            print0(f"[perf] accumulation k=4 vs the same global batch in one go: "
                   f"{table[1]['step_s'] / plain_s:.2f}x the step time")

        # -------- 6. Train: lesson 03's loop with accumulation (the pattern to copy). ----------------------
        raw_model.load_state_dict(init_state)
        raw_model.checkpointing = args.checkpointing
        optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)
        scaler = torch.amp.GradScaler(dev.type, enabled=args.precision == "fp16")  # fp16 only: bf16 needs none
        sampler = DistributedSampler(train_set, num_replicas=W, rank=info.rank, shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_size=m, sampler=sampler, drop_last=True)

        def micro_batches():
            epoch = 0
            while True:
                sampler.set_epoch(epoch)
                yield from loader
                epoch += 1

        batches = micro_batches()
        counter.reset()
        loss_sum = seen = 0.0
        history = []
        for step in range(args.steps):
            for micro_step in range(k):
                x, y = next(batches)
                x, y = x.to(dev), y.to(dev)  # (m, 1, 8, 8), (m,)
                # Only the last micro-step all-reduces. no_sync() must hold the forward too: DDP prepares its
                # reducer in forward when require_backward_grad_sync is True.
                sync = micro_step == k - 1 or not info.distributed
                with (nullcontext() if sync else model.no_sync()):
                    with autocast_context(dev, args.precision):
                        loss = F.cross_entropy(model(x), y)  # mean over this micro-batch
                    # / k: backward ADDS into .grad, so k means summed would be k times the mean we want.
                    scaler.scale(loss / k).backward()
                loss_sum += loss.item() * len(y)
                seen += len(y)
            scaler.unscale_(optimizer)  # once per optimizer step (a no-op when the scaler is disabled)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip)  # after sync: the global gradient
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)  # frees .grad memory instead of writing zeros
            if (step + 1) % 10 == 0 or step + 1 == args.steps:
                train_loss = global_mean(loss_sum, seen, info)
                history.append({"step": step + 1, "train_loss": train_loss})
                print0(f"step {step + 1:>3}/{args.steps}  train_loss {train_loss:.4f}")
                loss_sum = seen = 0.0
        raw_model.checkpointing = False
        train_calls = counter.calls
        final = evaluate(model, test_set, info)
        max_rank_diff = max_param_diff_across_ranks(raw_model, info)
        print0(f"\n6. training ({args.precision}{', checkpointing' if args.checkpointing else ''}): {args.steps} "
               f"optimizer steps x {k} micro-steps, all-reduce calls {train_calls} "
               f"({train_calls / args.steps:g} per optimizer step)")
        print0(f"final test_loss {final['loss']:.4f}  test_acc {final['accuracy']:.4f}  "
               f"max parameter difference across ranks {max_rank_diff:.1e}")
        results.update({"history": history, "train_allreduce_calls": train_calls, "train_steps": args.steps,
                        "precision": args.precision, "checkpointing_run": args.checkpointing,
                        "final_test_loss": final["loss"], "final_test_accuracy": final["accuracy"],
                        "max_param_diff_across_ranks": max_rank_diff})
        write_results(args.results, results, info)


if __name__ == "__main__":
    run_main(main)
