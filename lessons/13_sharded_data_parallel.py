"""Lesson 13: sharded data parallelism -- ZeRO 1, 2, 3 by hand, then FSDP2 and sharded checkpoints that reshard.

    python lessons/13_sharded_data_parallel.py                                   # world of one: plain Adam
    torchrun --standalone --nproc_per_node=2 lessons/13_sharded_data_parallel.py
    torchrun --standalone --nproc_per_node=4 lessons/13_sharded_data_parallel.py --save-sharded /tmp/ckpt13
    torchrun --standalone --nproc_per_node=2 lessons/13_sharded_data_parallel.py --load-sharded /tmp/ckpt13
    torchrun --standalone --nproc_per_node=2 benchmarks/sharding_speed.py        # step times, largest model

Lesson 08 ends with the bytes a DDP rank holds: all parameters, gradients and Adam's two fp32 copies, on every
rank. Here each rank keeps 1/N of them. The model: lesson 08's ResidualMLP, width 33, depth 2, 6973 parameters in
units of 2145, 2244, 2244, 340; the stem's is odd, so it is padded (common/zero.py; padding never reaches the model).

What to look for:
1. ZeRO by hand, each stage vs DDP after --steps Adam steps on the same global batches: equal (<= 1e-6).
2. Bytes a rank holds (storages counted once): optimizer state 1/N from stage 1, gradients at the end of backward
   1/N from stage 2, parameters at rest 1/N at stage 3, within the padding; activations untouched (lesson 08).
3. Bytes per rank per step in the ring model (what NCCL sends), from the buffers handed to the collectives:
   DDP's all-reduce 2 Psi (N-1)/N; stages 1-2 a reduce-scatter and an all-gather, the same; stage 3 all-gathers
   twice (forward, backward): 1.5x. A model, not wire bytes: gloo, which runs here, implements reduce-scatter as
   an all-reduce (ProcessGroupGloo), so on CPU stages 1-2 really move 1.5x and stage 3 2x.
4. `ZeroRedundancyOptimizer` equals stage 1; `fully_shard` per block, then the root, equals stage 3 and sends
   1.5x (more here: it pads each parameter's rows, 1.64x at width 33 on 4 ranks); reshard_after_forward=False
   keeps the full parameters from forward to the end of backward (stage 2's peak; 1/N at rest) and sends stage 2's
   bytes; MixedPrecisionPolicy(bf16 params, fp32 reduce) halves the all-gathers (its distance to fp32 is recorded,
   not bounded: any two Adam runs stay within ~2 lr per step). Not run: CPUOffloadPolicy (a PCIe copy each way and
   a CPU update per step), prefetching (`set_modules_to_forward_prefetch`: one more block's parameters held).
5. A sharded checkpoint saved by 4 ranks loads on 2 (difference 0.0) and training continues as on 4; the full
   state dict loads into the plain model; no COMPLETE.json (an unfinished save) or another model: exit 2.

Sources: ZeRO, Rajbhandari et al. 2020 (arxiv.org/abs/1910.02054); PyTorch FSDP, Zhao et al. 2023
(arxiv.org/abs/2304.11277); pytorch.org/docs/stable/ distributed.fsdp.fully_shard, distributed.checkpoint, .optim.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common.counters import CommCounter, count_collectives
from common.data import digits_split
from common.grid import Grid
from common.memory import ResidualMLP, saved_activation_bytes
from common.precision import max_diff, worst_over_ranks
from common.results import Report
from common.session import (LessonError, add_distributed_args, distributed_session, rank0_only, read_torchrun_env,
                            run_main, set_seed)
from common.sharded_checkpoint import (FULL_MODEL, check_complete, load_sharded, mark_complete, model_signature,
                                       save_sharded)
from common.shard_accounting import full_params, held_bytes, moved_bytes
from common.zero import ZeRO, check_stages, check_world_size

TOL = 1e-6
CONTINUED = "after_more_steps.pt"  # the saving world's parameters --more-steps later: what a loader must reach


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=33, help="ResidualMLP width (33: the stem's 2145 needs padding)")
    p.add_argument("--depth", type=int, default=2, help="residual blocks (default 2)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks (default 64)")
    p.add_argument("--steps", type=int, default=5, help="Adam steps of every comparison (default 5)")
    p.add_argument("--more-steps", type=int, default=3, help="steps after the checkpoint (default 3)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to build by hand (default 1,2,3)")
    p.add_argument("--save-sharded", metavar="DIR", help="save here (default: a temporary folder), then load it back")
    p.add_argument("--load-sharded", metavar="DIR", help="skip the save; load DIR, saved by any number of ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validated before any process group: every rank fails alike and none waits in a collective.
    args.stages = check_stages(args.stages)
    world_size = read_torchrun_env()[2]
    if min(args.width, args.depth, args.steps, args.more_steps, args.global_batch) < 1 or args.lr <= 0:
        raise LessonError("--width, --depth, --steps, --more-steps, --global-batch and --lr must be positive")
    if args.global_batch % world_size:
        raise LessonError(f"--global-batch {args.global_batch} cannot be split over {world_size} ranks")
    plain = ResidualMLP(args.width, args.depth)
    check_world_size({name: sum(p.numel() for p in u.parameters()) for name, u in units(plain)}, world_size)
    if args.save_sharded and args.load_sharded:
        raise LessonError("give --save-sharded or --load-sharded, not both")
    if args.load_sharded:
        args.marker = check_complete(args.load_sharded, model_signature(plain))
    return args


def units(model: ResidualMLP) -> list:
    """(name, module) of the flat units: the stem, each residual block, the head."""
    return [("stem", model.stem), *((f"blocks.{i}", b) for i, b in enumerate(model.blocks)), ("head", model.head)]


def global_batches(train_set, first: int, count: int, args, info) -> list:
    """Steps first .. first+count-1 of one fixed stream of global batches; this rank's 1/N slice of each."""
    x_all, y_all = train_set.tensors
    perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed))
    b = args.global_batch // info.world_size  # per-rank micro-batch
    idx = [perm[(step * args.global_batch + info.rank * b + torch.arange(b)) % len(perm)]
           for step in range(first, first + count)]
    return [(x_all[i].to(info.device), y_all[i].to(info.device)) for i in idx]  # (b, 1, 8, 8), (b,) each


def train(model, step, data, probe=None) -> list[float]:
    """forward, backward, probe() after the last backward (what a rank holds then), step(), no gradients left."""
    losses = []
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if probe is not None and i == len(data) - 1:
            probe()
        step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fsdp2(model, mesh, reshard_after_forward: bool = True, mp_policy=None):
    """fully_shard each block (its own all-gather and reduce-scatter), then the root (stem and head)."""
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        N, dev, report = info.world_size, info.device, Report(info)
        grid = Grid(info, dp=N)  # one process: sizes 1, no group, no mesh
        group, mesh = grid.group("dp"), grid.submesh("dp")
        train_set, _ = digits_split(path=args.data)
        data = global_batches(train_set, 0, args.steps, args, info)
        set_seed(args.seed)
        init = ResidualMLP(args.width, args.depth).to(dev).state_dict()

        def fresh(same_init: bool = True) -> ResidualMLP:  # a new model: the shared initial values, or new ones
            m = ResidualMLP(args.width, args.depth).to(dev)
            if same_init:
                m.load_state_dict(init)
            return m

        adam = partial(torch.optim.Adam, lr=args.lr)
        n = sum(p.numel() for p in fresh().parameters())
        padded = {name: -(-sum(p.numel() for p in u.parameters()) // N) * N for name, u in units(fresh())}
        psi, psi_p = 4 * n, 4 * sum(padded.values())  # bytes of the parameters, and of the padded flat buffers
        report.results.update(world_size=N, global_batch=args.global_batch, steps=args.steps, n_params=n)
        report.value("padded_units", padded, f"world_size {N}, ResidualMLP width {args.width} depth {args.depth}: {n} "
                     f"parameters, Psi = {psi} bytes; flat units padded to {{value}} elements ({psi_p} bytes)")

        # -------- 1. the reference: DDP (one process: plain Adam), gradients in DDP's buckets ------------------
        raw = fresh()
        model = DDP(raw, gradient_as_bucket_view=True, device_ids=[info.local_rank] if dev.type == "cuda" else None) \
            if info.distributed else raw
        comm = CommCounter().register(model) if info.distributed else CommCounter()
        opt, grads, table = adam(raw.parameters()), {}, {}
        report.record("ddp_losses", train(model, opt.step, data, lambda: grads.update(
            held_bytes([], [p.grad for p in raw.parameters()], opt))))
        ref = [p.detach().clone() for p in raw.parameters()]
        activations = saved_activation_bytes(raw, lambda: raw(data[0][0]))  # lesson 08: the same for every row
        table["DDP"] = {**held_bytes(list(raw.parameters()), [], opt), "gradients": grads["gradients"],
                        "activations": activations, "moved": moved_bytes({"all_reduce": comm.bytes}, N) / args.steps}
        report.claim("ddp_bytes_as_formula", table["DDP"]["moved"], "==", 2 * psi * (N - 1) / N,
                     f"1. {'DDP' if info.distributed else 'one process, plain Adam'}: {{value:.0f}} ring-model bytes per rank per step = 2 Psi (N-1)/N, Psi = {psi}")

        # -------- 2. ZeRO stages by hand, each against DDP -----------------------------------------------------
        hand = {}
        for s in args.stages:
            m = fresh()
            zero = ZeRO(m, [u for _, u in units(m)], s, group=group, lr=args.lr)
            with count_collectives() as c:
                train(m, zero.step, data, lambda: grads.update(held_bytes(
                    [], [p.grad for p in m.parameters()] + [u.shard.grad for u in zero.units], zero.optimizer)))
            hand[s] = zero.full_parameters()
            table[f"stage {s}"] = {**held_bytes([*m.parameters(), *(u.shard for u in zero.units)], [], zero.optimizer),
                                   "gradients": grads["gradients"], "activations": activations,
                                   "moved": moved_bytes(c.bytes, N) / args.steps}
            report.claim(f"stage{s}_equals_ddp", worst_over_ranks([max_diff(hand[s], ref)], info)[0], "<=", TOL,
                         f"2. ZeRO stage {s} by hand vs DDP after {args.steps} Adam steps: max |difference| {{value:.1e}}")
            same_shapes = all(p.shape == q.shape for p, q in zip(m.parameters(), fresh().parameters()))
            report.claim(f"stage{s}_padding_untouched", int(zero.padding_is_zero() and same_shapes), "==", 1,
                         "  the padding of every shard is still 0, the model has its own shapes: {value}")
            gathers, moved = (2 if s == 3 else 1), table[f"stage {s}"]["moved"]  # stage 3: before forward and backward
            report.claim(f"stage{s}_bytes_as_formula", moved, "==", (gathers + 1) * psi_p * (N - 1) / N,
                         f"  ring-model bytes per rank per step {{value:.0f}} = ({gathers} all-gather + 1 reduce-scatter) x "
                         f"Psi_padded (N-1)/N; calls {', '.join(f'{k} x{v}' for k, v in sorted(c.calls.items()))}")
            if N > 1:  # DDP's all-reduce is a reduce-scatter + an all-gather: stages 1-2 send the same, stage 3 1.5x
                report.claim(f"stage{s}_bytes_vs_ddp", abs(moved / table["DDP"]["moved"] - gathers / 2 - 0.5), "<=",
                             0.01, f"  = {moved / table['DDP']['moved']:.3f}x DDP's bytes: |ratio - "
                             f"{gathers / 2 + 0.5}| = {{value:.4f}} (the padding)")

        # -------- 3. what each rank holds, and what it sends ---------------------------------------------------
        ddp = table["DDP"]
        cols = ("parameters", "gradients", "optimizer_state", "activations", "moved")
        report.value("memory_table", table, "3. bytes per rank (parameters at rest, gradients at the end of backward, "
                     "Adam state; bytes sent per step)\n  " + f"{'':<9}" + "".join(f"{c:>16}" for c in cols) + "\n" +
                     "\n".join(f"  {k:<9}" + "".join(f"{row[c]:>16.0f}" for c in cols) for k, row in table.items()))
        for s in args.stages:  # + 0.01: the padding (< N elements per unit) and Adam's 4-byte step counters
            for what in ("optimizer_state", "gradients", "parameters")[:s]:  # stage s shards the first s of these
                report.claim(f"stage{s}_{what}_share", table[f"stage {s}"][what] / ddp[what], "<=", 1 / N + 0.01,
                             f"  stage {s}: {what} {{value:.3f}} of DDP's (1/N = {1 / N:.3f}, + padding)")
        if 1 in args.stages and N > 1:
            report.claim("stage1_gradients_not_sharded", table["stage 1"]["gradients"] / ddp["gradients"], ">=", 1.0,
                         "  stage 1 still ends backward holding all gradients: {value:.3f} of DDP's")
        if not info.distributed:
            report.finish(args.results)  # FSDP2, ZeroRedundancyOptimizer and DCP need a process group
            return

        # -------- 4. PyTorch's versions ------------------------------------------------------------------------
        raw = fresh()
        model = DDP(raw, device_ids=[info.local_rank] if dev.type == "cuda" else None)
        zro = ZeroRedundancyOptimizer(raw.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
        train(model, zro.step, data)
        if 1 in hand:
            report.claim("zero_redundancy_optimizer_equals_stage1", worst_over_ranks(
                [max_diff(raw.parameters(), hand[1])], info)[0], "<=", TOL,
                "4. ZeroRedundancyOptimizer (whole tensors per rank, then broadcasts) vs stage 1: {value:.1e}")
        runs = {}
        for name, kw in (("fsdp2", {}), ("fsdp2_no_reshard", {"reshard_after_forward": False}),
                         ("fsdp2_bf16", {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                            reduce_dtype=torch.float32)})):
            m = fsdp2(fresh(), mesh, **kw)
            opt = adam(m.parameters())
            with count_collectives() as c:
                train(m, opt.step, data, lambda: grads.update(held_bytes([], [p.grad for p in m.parameters()], opt)))
            runs[name] = (m, opt, full_params(m), moved_bytes(c.bytes, N) / args.steps)
            if name == "fsdp2":
                table["FSDP2"] = {**held_bytes(list(m.parameters()), [], opt), "gradients": grads["gradients"],
                                  "activations": activations, "moved": runs[name][3]}
                report.value("fsdp2_memory", table["FSDP2"], "  fully_shard per block, then the root: "
                             + ", ".join(f"{k} {v:.0f}" for k, v in table["FSDP2"].items()))
        if 3 in hand:
            report.claim("fsdp2_equals_stage3", worst_over_ranks([max_diff(runs["fsdp2"][2], hand[3])], info)[0],
                         "<=", TOL, "  fully_shard (reshard_after_forward=True) vs stage 3: {value:.1e}")
        # FSDP2 pads each parameter's rows (dim 0) to a multiple of N, not one flat buffer per unit
        psi_f = 4 * sum(-(-p.shape[0] // N) * N * p[0].numel() for p in fresh().parameters())
        for name, gathers in (("fsdp2", 2), ("fsdp2_no_reshard", 1)):
            report.claim(f"{name}_bytes_as_formula", runs[name][3], "==", (gathers + 1) * psi_f * (N - 1) / N,
                         f"  {name}: {{value:.0f}} ring-model bytes per rank per step = ({gathers} all-gather + 1 "
                         f"reduce-scatter) x Psi_rows_padded (N-1)/N: {runs[name][3] / max(ddp['moved'], 1):.3f}x DDP's")
        bf16_diff = worst_over_ranks([max_diff(runs["fsdp2_bf16"][2], runs["fsdp2"][2])], info)[0]  # a value only:
        report.value("bf16_params_vs_fp32", bf16_diff, "  MixedPrecisionPolicy(bf16 params, fp32 reduce) vs fp32: "
                     "{value:.1e}")  # not a claim: ANY two Adam runs stay within ~2 lr per step of each other
        report.claim("bf16_really_ran", bf16_diff, ">=", 1e-6, "  ... and not 0 (bf16 really ran): {value:.1e}")
        if N > 1:
            report.claim("bf16_moves_fewer_bytes", runs["fsdp2_bf16"][3] / runs["fsdp2"][3], "<=", 0.7,
                         "  its bf16 all-gathers halve those bytes: {value:.3f}x fp32's (reduce-scatter stays fp32)")

        # -------- 5. sharded checkpoints ---------------------------------------------------------------------
        model, opt = runs["fsdp2"][:2]
        more = global_batches(train_set, args.steps, args.more_steps, args, info)
        ck = [args.load_sharded or args.save_sharded or (tempfile.mkdtemp() if info.master_process else None)]
        dist.broadcast_object_list(ck)  # the temporary folder rank 0 made
        ck = Path(ck[0])
        if not args.load_sharded:
            save_sharded(model, opt, ck, info)  # each rank writes its shards; rank 0 the full model too
            train(model, opt.step, more)  # the saving world keeps training: the reference a loader must reach
            continued = [t.cpu() for t in full_params(model)]  # every rank takes part in the all-gathers
            if info.master_process:
                torch.save(continued, ck / CONTINUED)
            mark_complete(ck, info, model=model_signature(fresh()), world_size=N, step=args.steps)
        marker = check_complete(ck, model_signature(fresh()))
        loaded = fsdp2(fresh(same_init=False), mesh)  # other initial values: the load must overwrite them
        load_sharded(loaded, opt := adam(loaded.parameters()), ck)  # opt: a fresh Adam, its state from the files
        full = torch.load(ck / FULL_MODEL, map_location=dev, weights_only=True)
        report.claim("sharded_load_equals_saved", worst_over_ranks([max_diff(full_params(loaded), full.values())],
                     info)[0], "==", 0.0, f"5. sharded checkpoint saved by {marker['world_size']} ranks, loaded by {N}: "
                     "max |difference| {value}")
        with torch.no_grad():  # (64, 10) logits of the loaded, sharded model (every rank takes part)
            logits = loaded(x_probe := train_set.tensors[0][:64].to(dev))
        report.record("continued_losses", train(loaded, opt.step, more))
        reference = torch.load(ck / CONTINUED, map_location=dev, weights_only=True)
        report.claim("continued_training_matches_saving_world", worst_over_ranks(
            [max_diff(full_params(loaded), reference)], info)[0], "<=", TOL,
            f"  {args.more_steps} more steps on {N} ranks vs the saving world's own {args.more_steps}: {{value:.1e}}")
        with rank0_only(info, "the single-process reader") as mine:
            if mine:
                plain = ResidualMLP(args.width, args.depth).to(dev)
                result = plain.load_state_dict(full, strict=True)  # raises on a missing or unexpected key
                report.value("full_state_dict_strict_keys", len(result.missing_keys) + len(result.unexpected_keys),
                             f"  {FULL_MODEL} (get_model_state_dict(full_state_dict=True, cpu_offload=True)) "
                             "into the plain model, strict: missing + unexpected keys = {value}")
                with torch.no_grad():
                    report.claim("full_state_dict_same_outputs", (plain(x_probe) - logits).abs().max().item(), "<=",
                                 TOL, "  its outputs vs the sharded model's: max |difference| {value:.1e}")
                if not (args.save_sharded or args.load_sharded):
                    shutil.rmtree(ck, ignore_errors=True)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
