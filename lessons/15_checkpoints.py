"""Lesson 15: checkpoints of sharded state -- torch.distributed.checkpoint (DCP), any world size, never lost.

    torchrun --standalone --nproc_per_node=4 lessons/15_checkpoints.py          # every section, in seconds
    torchrun --standalone --nproc_per_node=4 lessons/15_checkpoints.py --save /tmp/ckpt15
    torchrun --standalone --nproc_per_node=2 lessons/15_checkpoints.py --load /tmp/ckpt15   # 4 -> 2

Lesson 13 leaves each rank holding 1/N of the parameters and of Adam's state (FSDP2): no rank can
torch.save the model alone. Here: lesson 13's ResidualMLP (width 33, depth 2), Adam, a fixed stream of
global batches of 64 (common.data.global_batch_slices), --steps steps, a checkpoint, --more-steps.

What to look for:
1. dcp.save: every rank writes the chunks it holds into its own file (__R_0.distcp), the coordinator
   .metadata (which chunk of which tensor is where). DDP's replicated state is written once in all.
2. Resharding: ranks 0 .. N/2-1, a process group of their own, load the N-rank checkpoints (each reads
   the chunks that overlap its new shards, from whichever files hold them): equal (0.0), and --more-steps
   on the same global batches follow the N-rank run. --load ROOT: the same in a launch of its own.
3. One process: get_model_state_dict(full_state_dict=True, cpu_offload=True) gathers the whole model to
   rank 0, which writes full_model.pt; a plain python process loads it with load_state_dict(strict=True).
4. dcp.async_save returns a Future once the state is staged (copied into CPU memory); a thread writes while
   training goes on, and the checkpoint is the state at the call. On CPU the copy and the writer share the
   cores with training: the loop is blocked for less time, not for free ([perf] lines).
5. Never a lost checkpoint: a new folder per save; every rank's files, a barrier, then COMPLETE.json, last
   and atomic; a loader takes the newest folder with a marker. A save killed before its marker leaves the
   last complete checkpoint loadable (common/checkpoint/sharded.py).

Sources: pytorch.org/docs/stable/distributed.checkpoint.html; the recipes distributed_checkpoint_recipe
and distributed_async_checkpoint_recipe (pytorch.org/tutorials/recipes).
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint.sharded import (
    FULL_MODEL,
    MARKER,
    agreed_folder,
    async_save_sharded,
    bytes_by_rank,
    check_complete,
    check_world_size_can_continue,
    chunks_written,
    latest_complete,
    load_sharded,
    mark_complete,
    save_sharded,
    step_folder,
)
from common.checkpoint.train_state import model_signature
from common.data import digits_split, global_batch_slices
from common.harness.atomic import atomic_write
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, rank0_only, run_main
from common.measure.differences import max_abs_diff_all, max_over_ranks, relative_difference
from common.models import ResidualMLP
from common.sharding.accounting import full_params
from common.sharding.fsdp import shard_blocks_then_root

EQUAL = (
    1e-3  # bound on relative_difference: float32 rounding stays far below it, a real error near 1
)

AFTER = "after_more_steps.pt"  # the saving world's parameters --more-steps later: a loader's target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=33, help="ResidualMLP width (default 33)")
    p.add_argument("--depth", type=int, default=2, help="residual blocks (default 2)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks")
    p.add_argument("--steps", type=int, default=3, help="Adam steps before the checkpoint")
    p.add_argument("--more-steps", type=int, default=2, help="steps after it (default 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument(
        "--save", metavar="ROOT", help="keep the checkpoints here (default: a temp folder)"
    )
    p.add_argument("--load", metavar="ROOT", help="skip the save: load ROOT's newest complete ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validated before any process group: every rank reads the same files and fails alike, in one line.
    world_size = read_torchrun_env()[2]
    if min(args.width, args.depth, args.steps, args.more_steps, args.global_batch) < 1:
        raise LessonError("--width, --depth, --steps, --more-steps and --global-batch must be >= 1")
    if world_size < 2:
        raise LessonError("run it on 2 or more processes: torchrun --nproc_per_node=4 (or 2) ...")
    if args.save and args.load:
        raise LessonError("give --save or --load, not both")
    if args.load:
        signature = model_signature(ResidualMLP(args.width, args.depth))
        for kind in ("fsdp2", "ddp"):
            found = latest_complete(Path(args.load) / kind, signature)
            check_world_size_can_continue(found[1], found[0], world_size)
            setattr(args, f"{kind}_folder", found[0])
        for name in ("global_batch", "steps", "more_steps", "lr", "seed"):  # the saved run's
            setattr(args, name, found[1][name])
    elif args.global_batch % world_size:
        raise LessonError(f"--global-batch {args.global_batch} cannot be split over {world_size}")
    return args


@dataclass
class Run:
    """What every section shares: arguments, the world, the report, the data, the checkpoint root."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    train_set: object
    root: Path

    def model(self, seed: int) -> ResidualMLP:
        torch.manual_seed(seed)  # the same values on every rank: fully_shard broadcasts nothing
        return ResidualMLP(self.args.width, self.args.depth).to(self.info.device)

    def batches(self, first: int, steps: int, rank=None, world_size=None) -> list:
        """Global-batch steps first .. first + steps: `rank`'s slice of `world_size` (default: ours)."""
        a, info = self.args, self.info
        rank = info.rank if rank is None else rank
        world_size = world_size or info.world_size
        return global_batch_slices(
            self.train_set, steps, a.global_batch, a.seed, rank, world_size, first, info.device
        )


def train(model, opt, data) -> None:
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def world_of(ranks: list[int], device_type: str):
    """A process group of `ranks` (every rank of the world calls new_group) and, on its members, its mesh."""
    group = dist.new_group(ranks)
    return group, DeviceMesh.from_group(group, device_type) if dist.get_rank() in ranks else None


# -------- 1. the sharded save: every rank writes its own chunks; the marker comes last
def save_and_continue(run: Run, kind: str, model, raw, opt) -> Path:
    """Save `raw` (the unwrapped model) after --steps into root/kind/step_N, train `model` --more-steps (the
    target a loader must reach), then mark the folder complete."""
    folder = step_folder(run.root / kind, run.args.steps)
    save_sharded(raw, opt, folder, run.info)
    train(model, opt, run.batches(run.args.steps, run.args.more_steps))
    after = [t.cpu() for t in full_params(raw)]  # every rank takes part in FSDP2's all-gathers
    if run.info.master_process:
        atomic_write(folder / AFTER, lambda f: torch.save(after, f))
    facts = {k: getattr(run.args, k) for k in ("global_batch", "steps", "more_steps", "lr", "seed")}
    signature = model_signature(ResidualMLP(run.args.width, run.args.depth))
    mark_complete(folder, run.info, model=signature, world_size=run.info.world_size, **facts)
    return folder


def sharded_save(run: Run) -> tuple[Path, Path]:
    """FSDP2 and DDP trained --steps on N ranks and saved into root/fsdp2 and root/ddp."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, run.info.device.type)
    model = shard_blocks_then_root(run.model(run.args.seed), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=run.args.lr)
    train(model, opt, run.batches(0, run.args.steps))
    fsdp_folder = save_and_continue(run, "fsdp2", model, model, opt)
    ddp = DDP(run.model(run.args.seed))
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=run.args.lr)
    train(ddp, ddp_opt, run.batches(0, run.args.steps))
    ddp_folder = save_and_continue(run, "ddp", ddp, ddp.module, ddp_opt)
    chunks = chunks_written(fsdp_folder)
    run.report.record("fsdp2_chunks", chunks)
    # FSDP2 gives rank k rows [k c, (k + 1) c) of every tensor it shards, c = ceil(rows / N)
    sharded = [c for c in chunks if c["sizes"]]  # Adam's 0-d step counters are replicated
    held_by = [c["offsets"][0] // -(-c["shape"][0] // run.info.world_size) for c in sharded]
    wrong = sum(c["rank"] != k for c, k in zip(sharded, held_by))
    run.report.claim(
        "each_rank_writes_its_shard",
        wrong,
        "==",
        0,
        "1. FSDP2 on {N} ranks: {n} chunks, each in the file of the rank that holds it; elsewhere: {value}",
        N=run.info.world_size,
        n=len(sharded),
    )
    per_rank = bytes_by_rank(chunks, run.info.world_size)
    text = "  tensor bytes in each rank's file: {value}"
    run.report.value("fsdp2_bytes_per_file", per_rank, text)
    ddp_written_once(run, ddp_folder, ddp.module, ddp_opt)
    return fsdp_folder, ddp_folder


def ddp_written_once(run: Run, folder: Path, model, opt) -> None:
    """DCP de-duplicates replicated tensors: one replica's bytes in all, spread over the ranks' files."""
    chunks = chunks_written(folder)
    state = [*model.state_dict().values()]
    state += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    one_replica = sum(t.numel() * t.element_size() for t in state)
    written = sum(c["bytes"] for c in chunks)
    by_rank = bytes_by_rank(chunks, run.info.world_size)
    run.report.claim(
        "ddp_state_written_once",
        written - one_replica,
        "==",
        0,
        "  DDP on {N} ranks: {written} bytes, by rank {by_rank}; beyond one replica: {value}",
        N=run.info.world_size,
        written=written,
        by_rank=by_rank,
    )


# -------- 2. resharding: another world loads the N-rank checkpoints and continues
def reshard(run: Run, ranks: list[int], fsdp_folder: Path, ddp_folder: Path):
    """The world `ranks` (a group of its own) loads both checkpoints; returns its FSDP2 model's logits."""
    group, mesh = world_of(ranks, run.info.device.type)
    if mesh is None:  # not one of the loading world's ranks
        return None
    signature = model_signature(ResidualMLP(run.args.width, run.args.depth))
    saved = check_complete(fsdp_folder, signature)
    model = shard_blocks_then_root(
        run.model(run.args.seed + 1), mesh
    )  # other initial values: the load must overwrite them
    opt = torch.optim.Adam(
        model.parameters(), lr=run.args.lr
    )  # a fresh Adam: its state comes from files
    load_sharded(model, opt, fsdp_folder, group)
    full = torch.load(fsdp_folder / FULL_MODEL, weights_only=True)
    run.report.claim(
        "sharded_load_equals_saved",
        max_over_ranks(max_abs_diff_all(full_params(model), full.values()), group),
        "==",
        0.0,
        "2. FSDP2 checkpoint saved by {saved} ranks, loaded by {M}: max |difference| {value}",
        saved=saved["world_size"],
        M=len(ranks),
    )
    read_plan(run, fsdp_folder, len(ranks))
    with torch.no_grad():  # (64, 10) logits of the loaded, sharded model, for section 3
        logits = model(run.train_set.tensors[0][:64].to(run.info.device))
    continue_and_compare(
        run, "continued_training_matches_saving_world", model, opt, fsdp_folder, group
    )
    reshard_ddp(run, ranks, group, ddp_folder)
    return logits


def read_plan(run: Run, folder: Path, M: int) -> None:
    """Bytes each loading rank reads from each saving rank's file: its new rows, c' = ceil(rows / M), overlap
    the saved chunks' rows (computed from .metadata: what dcp.load's plan reads)."""
    chunks = [c for c in chunks_written(folder) if c["sizes"]]
    saved_by = 1 + max(c["rank"] for c in chunks)
    plan = [[0] * saved_by for _ in range(M)]
    for c in chunks:
        row_bytes = c["bytes"] // c["sizes"][0] if c["sizes"][0] else 0
        per = -(-c["shape"][0] // M)  # rows per loading rank
        for k in range(M):
            lo, hi = (
                max(k * per, c["offsets"][0]),
                min((k + 1) * per, c["offsets"][0] + c["sizes"][0]),
            )
            plan[k][c["rank"]] += max(0, hi - lo) * row_bytes
    lines = "\n".join(
        f"    rank {k} of {M} reads {row} bytes from files 0..{saved_by - 1}"
        for k, row in enumerate(plan)
    )
    run.report.value(
        "read_plan", plan, "  which saved file each loading rank reads:\n{lines}", lines=lines
    )


def continue_and_compare(run: Run, name: str, model, opt, folder: Path, group) -> None:
    """--more-steps on the same global batches, against the saving world's own (its after_more_steps.pt)."""
    start = [p.detach().clone() for p in full_params(model)]
    k, M = dist.get_rank(group), dist.get_world_size(group)
    train(model, opt, run.batches(run.args.steps, run.args.more_steps, k, M))
    target = torch.load(folder / AFTER, weights_only=True)
    apart = relative_difference(full_params(model), target, start)
    run.report.claim(
        name,
        max_over_ranks(apart, group),
        "<=",
        EQUAL,
        "  {more} more steps on {world} vs the saving world's own: {value:.1e} of their change",
        more=run.args.more_steps,
        world=f"{M} rank" if M == 1 else f"{M} ranks",
    )


def reshard_ddp(run: Run, ranks: list[int], group, folder: Path) -> None:
    """DDP's state, written once by N ranks, loaded by len(ranks): every replica gets all of it."""
    model = DDP(run.model(run.args.seed + 1), process_group=group)
    opt = torch.optim.Adam(model.parameters(), lr=run.args.lr)
    load_sharded(model.module, opt, folder, group)
    full = torch.load(folder / FULL_MODEL, weights_only=True)
    saved = check_complete(folder, model_signature(model.module))
    run.report.claim(
        "params_equal_at_the_switch",
        max_over_ranks(max_abs_diff_all(model.module.parameters(), full.values()), group),
        "==",
        0.0,
        "  DDP checkpoint saved by {saved} ranks, loaded by {M}: parameters max |difference| {value}",
        saved=saved["world_size"],
        M=len(ranks),
    )
    continue_and_compare(
        run, "ddp_continued_training_matches_saving_world", model, opt, folder, group
    )


# -------- 3. one process: the full state dict
def one_process(run: Run, folder: Path, logits) -> None:
    """Rank 0 alone, as a plain python process would: full_model.pt into the plain model, strict."""
    with rank0_only(run.info, "the single-process reader") as mine:
        if not mine:
            return
        plain = ResidualMLP(run.args.width, run.args.depth)
        full = torch.load(folder / FULL_MODEL, map_location="cpu", weights_only=True)
        plain.load_state_dict(full, strict=True)  # raises on a missing or unexpected key
        with (
            torch.no_grad()
        ):  # the same parameters, computed whole instead of gathered: rounding at most
            out = plain(run.train_set.tensors[0][:64])
        run.report.claim(
            "full_state_dict_same_outputs",
            max_abs_diff_all([out], [logits.cpu()]) / max(logits.abs().max().item(), 1e-30),
            "<=",
            1e-6,
            "3. {file} ({n} tensors) in a plain model, strict: outputs vs the sharded model's {value:.1e}",
            file=FULL_MODEL,
            n=len(full),
        )


# -------- 4. async save: the loop goes on while a thread writes
def async_save(run: Run) -> None:
    mesh = DeviceMesh.from_group(dist.group.WORLD, run.info.device.type)
    model = shard_blocks_then_root(run.model(run.args.seed), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=run.args.lr)
    train(model, opt, run.batches(0, run.args.steps))
    t0 = time.perf_counter()
    save_sharded(
        model, opt, step_folder(run.root / "sync", run.args.steps), run.info, full_model=False
    )
    sync_s = time.perf_counter() - t0
    writer = dist.new_group(
        backend="gloo"
    )  # the writer thread's collectives, never the loop's group
    snapshot = [t.clone() for t in full_params(model)]
    folder = step_folder(run.root / "async", run.args.steps)
    t0 = time.perf_counter()
    future = async_save_sharded(model, opt, folder, writer)
    blocked_s = time.perf_counter() - t0
    train(model, opt, run.batches(run.args.steps, run.args.more_steps))
    trained_s = time.perf_counter() - t0 - blocked_s
    future.result()  # a real loop checks it before its next save
    mark_complete(folder, run.info, world_size=run.info.world_size, step=run.args.steps)
    moved = max_over_ranks(max_abs_diff_all(full_params(model), snapshot))
    fresh = shard_blocks_then_root(run.model(run.args.seed + 1), mesh)
    load_sharded(fresh, torch.optim.Adam(fresh.parameters(), lr=run.args.lr), folder)
    run.report.claim(
        "async_save_is_the_state_at_the_call",
        max_over_ranks(max_abs_diff_all(full_params(fresh), snapshot)),
        "==",
        0.0,
        "4. async_save, {more} steps (moved {moved:.1e}), then the load vs the state at the call: {value}",
        more=run.args.more_steps,
        moved=moved,
    )
    run.report.perf(
        "async_blocked_s",
        blocked_s,
        "async_save returned a {kind} in {value:.4f} s (dcp.save: {sync:.4f} s); {more} steps: {t:.4f} s",
        kind=type(future).__name__,
        sync=sync_s,
        more=run.args.more_steps,
        t=trained_s,
    )


# -------- 5. never a lost checkpoint
def never_lost(run: Run, folder: Path) -> None:
    """The marker is the newest file; a save killed before its marker leaves the last complete one."""
    marker = (folder / MARKER).stat().st_mtime_ns
    newer = [f.name for f in folder.iterdir() if f.stat().st_mtime_ns > marker]
    run.report.claim(
        "marker_written_last",
        len(newer),
        "==",
        0,
        "5. files written after {folder}'s marker: {value} (the marker comes last)",
        folder=folder.name,
    )
    killed = step_folder(run.root / "fsdp2", run.args.steps + run.args.more_steps)
    model = shard_blocks_then_root(
        run.model(run.args.seed), DeviceMesh.from_group(dist.group.WORLD, run.info.device.type)
    )
    save_sharded(
        model, torch.optim.Adam(model.parameters()), killed, run.info
    )  # ... killed here: no marker
    dist.barrier()
    signature = model_signature(ResidualMLP(run.args.width, run.args.depth))
    found, marker = latest_complete(run.root / "fsdp2", signature)
    run.report.claim(
        "unfinished_save_leaves_the_last_checkpoint",
        marker["steps"],
        "==",
        run.args.steps,
        "  a save of step {killed} killed before its marker: the newest complete one is step {value}",
        killed=run.args.steps + run.args.more_steps,
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        train_set, _ = digits_split()
        run = Run(args, info, report, train_set, agreed_folder(args.save, info))
        report.record("world_size", info.world_size)
        if args.load:  # a separate launch: this whole world is the new one
            ranks, fsdp_folder, ddp_folder = (
                list(range(info.world_size)),
                args.fsdp2_folder,
                args.ddp_folder,
            )
        else:  # the first half of the world loads what the whole world saved
            ranks = list(range(info.world_size // 2))
            fsdp_folder, ddp_folder = sharded_save(run)
        logits = reshard(run, ranks, fsdp_folder, ddp_folder)
        one_process(run, fsdp_folder, logits)
        if not args.load:
            async_save(run)
            never_lost(run, fsdp_folder)
        dist.barrier()
        if info.master_process and not (args.save or args.load):
            shutil.rmtree(run.root, ignore_errors=True)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
