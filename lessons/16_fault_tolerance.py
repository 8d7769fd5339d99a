"""Lesson 16: fault tolerance -- crashes, restarts and an exact resume.

    python lessons/16_fault_tolerance.py        # one process: no restart; the resumes are checked in-process
    torchrun --standalone --nproc_per_node=2 --max-restarts=2 lessons/16_fault_tolerance.py \
        --crash-at-step 7 --crash-rank 1   # or --fault hang@11:1 --timeout-s 5 | raise@7:1 | mid-write@8
    torchrun --nnodes=2 --nproc_per_node=1 --max-restarts=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=JOB_ID lessons/16_fault_tolerance.py --ckpt-dir SHARED --fault hang@7:1   # on each node

torchrun restarts EVERY rank on every node when one fails (--max-restarts times). TORCHELASTIC_RESTART_COUNT
is per node (a node with healthy workers restarts uncounted, pytorch/pytorch#108158):
common/harness/rendezvous.py agrees on the attempt through torchrun's store; each attempt's process group has
its own prefix. An exact resume needs the same world size; a checkpoint that another world size loads
(torch.distributed.checkpoint, 4 ranks -> 2, resharded) is lesson 15. Look for:
1. A crash at step 7 (first step of epoch 1, 6 steps per epoch): the restarted job ends EQUAL to an
   uninterrupted run: 0.0 on 1 or 2 ranks. The checkpoint holds the full training state: model, AdamW, LR
   scheduler, GradScaler, every rank's RNG streams (torch, numpy, random, its generator), the sampler's epoch
   AND position. A stateful DDP comm hook is training state too (PowerSGD: error feedback, warm start,
   iteration; lesson 18 works out its exact resume). On 3+ ranks the bound is 1e-6, not 0: without
   find_unused_parameters a restarted DDP's first step reduces the bucket built at construction, the
   uninterrupted run's the bucket DDP rebuilt after step 1 (ready order); gloo's ring sums each chunk from
   another rank, so an element in another chunk is summed in another order: (a + b) + c != a + (b + c).
2. Forgetting the position, the optimizer or the RNG changes the result (measured, each from its own copy of
   the checkpoint; the scheduler and the GradScaler, off on CPU, are not tested that way).
3. A killed writer leaves a temp file (or a .pt without its marker), never loaded, removed at the restart.
4. A hung peer: gloo raises after --timeout-s, the job exits 1, torchrun restarts it. NCCL (GPU only, untested
   here): the watchdog times the collective out; TORCH_NCCL_ASYNC_ERROR_HANDLING: torchrun sets it to 1
   (tear down) unless you set it; elsewhere the default is 3 (tear down without cleanup). A watchdog stuck for
   TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC kills its process (torch docs: torch_nccl_environment_variables.html).
5. Which rank failed: torchrun's summary names the smallest timestamp in whole seconds, on a tie the lowest
   rank: maybe rank 0, which only exited because its peer died. `@record` on main writes the raising rank's
   exception to its error file (the summary's error_file; <N/A> for the others): `--fault raise@7:1`.

Sources: https://pytorch.org/docs/stable/ elastic/run.html, elastic/errors.html;
https://pytorch.org/tutorials/beginner/ddp_series_fault_tolerance.html; lesson 15 (checkpoints that reshard).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from common.checkpoint.rng_state import capture_rng_all_ranks, restore_rng
from common.checkpoint.train_state import (
    ResumableDistributedSampler,
    clear_run,
    leftovers,
    load_train_state,
    max_diff_over_ranks,
    model_signature,
    resume_point,
    roundtrip,
    save_train_state,
)
from common.data import digits_split
from common.data_parallel.seeding import rank_seed
from common.fault_tolerance.faults import EventLog, exit_on_peer_failure, parse_faults
from common.fault_tolerance.timeline import read_events, report_timeline
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.ranks import print0
from common.harness.rendezvous import attempt
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed


def make_model(width: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, width),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(width, 10),
    )


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=18, help="optimizer steps (3 epochs on 2 ranks)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--train-samples", type=int, default=192, help="digits used for training")
    p.add_argument("--width", type=int, default=64, help="hidden width of the MLP (default 64)")
    p.add_argument("--lr", type=float, default=0.01, help="AdamW learning rate, cosine schedule")
    p.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler (for CUDA)")
    p.add_argument("--no-random-draws", action="store_true", help="no dropout, no augmentation")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints, events.jsonl (a temp dir)")
    p.add_argument("--ckpt-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint")
    p.add_argument("--crash-at-step", type=int, default=None, help="--crash-rank exits here")
    p.add_argument("--crash-rank", type=int, default=None, help="default: the last rank")
    p.add_argument("--fault", nargs="+", default=[], help="KIND@STEP[:RANK], one per attempt")
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="sleep per step: a big model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    return add_distributed_args(p)


def parse_args(argv=None) -> argparse.Namespace:
    args = make_parser().parse_args(argv)
    args.attempt = attempt()  # 0, then 1, 2, ... after each restart: the same number on every node
    # Validate before any process group exists: every rank reads the same files and fails alike, in one line.
    rank, _, W, _ = read_torchrun_env()
    sizes = (args.steps, args.batch_size, args.train_samples, args.width, args.ckpt_every)
    if min(sizes) < 1 or args.lr <= 0:
        raise LessonError(
            "--steps, --batch-size, --train-samples, --width, --ckpt-every, --lr must be > 0"
        )
    if args.crash_at_step is not None:
        crash_rank = W - 1 if args.crash_rank is None else args.crash_rank
        args.fault.insert(0, f"exit@{args.crash_at_step}:{crash_rank}")
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    is_save_step = lambda s: s % args.ckpt_every == 0 or s == args.steps  # noqa: E731
    args.faults = parse_faults(args.fault, args.steps, W, is_save_step, max_restarts)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}")
    args.ckpt_dir = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / "lesson16" / run_id)
    signature = model_signature(make_model(args.width, 0.0))
    args.global_batch = W * args.batch_size
    if not args.global_batch <= args.train_samples <= 1438:
        raise LessonError(
            f"--train-samples must be in [{args.global_batch}, 1438] (global batch .. digits)"
        )
    args.resuming = args.resume or args.attempt > 0  # a restarted attempt resumes
    args.found = resume_point(args.ckpt_dir, args.resume, signature, W) if args.resuming else None
    if rank == 0 and not args.resuming:
        clear_run(args.ckpt_dir)  # a fresh run: forget the last run's checkpoints in this folder
    return args


def augment(x: torch.Tensor, gen: torch.Generator, on: bool) -> torch.Tensor:
    """x (B, 1, 8, 8): a shift drawn from `random` and numpy, noise from this rank's generator."""
    if not on:
        return x
    x = torch.roll(
        x, shifts=(int(np.random.randint(-1, 2)), random.choice((-1, 0, 1))), dims=(2, 3)
    )
    return x + 0.05 * torch.randn(x.shape, generator=gen)


@dataclass
class Run:
    """A training run as at step 0: options, this rank, the report, then what a checkpoint saves."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    raw: nn.Module  # the unwrapped model: what is saved and loaded
    model: nn.Module  # DDP(raw) on several ranks
    opt: torch.optim.Optimizer
    sampler: ResumableDistributedSampler
    loader: DataLoader
    sched: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    gen: torch.Generator  # augmentation noise, this rank's


def build(args, info, report, train_set) -> Run:
    """Model, optimizer, scheduler, scaler, sampler and RNG streams, as at step 0 (the same on every call)."""
    set_seed(args.seed)  # the same initial weights on every rank
    raw_model = make_model(args.width, 0.0 if args.no_random_draws else 0.1).to(info.device)
    model = DDP(raw_model, device_ids=info.device_ids) if info.distributed else raw_model
    opt = torch.optim.AdamW(raw_model.parameters(), lr=args.lr)
    sampler = ResumableDistributedSampler(
        train_set,
        info.world_size,
        info.rank,
        args.seed,
        args.train_samples // args.global_batch * args.global_batch,
    )
    # dropout and augmentations differ by rank, reproducibly
    set_seed(rank_seed(args.seed, info.rank))
    # Each iter(loader) draws a base seed from torch's GLOBAL RNG unless given a generator; a resumed run
    # makes one more iterator: every later dropout mask shifts (measured 1.2e-2).
    loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator()
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    scaler = torch.amp.GradScaler(info.device.type, enabled=args.amp)
    gen = torch.Generator().manual_seed(rank_seed(args.seed + 1, info.rank))
    return Run(args, info, report, raw_model, model, opt, sampler, loader, sched, scaler, gen)


# ------------------------------------------------------------- 1. the pattern to copy: save and restore ALL
def capture(run: Run, step: int) -> dict:
    return {
        "step": step,
        "model": run.raw.state_dict(),
        "optimizer": run.opt.state_dict(),
        # rank 0 writes every rank's streams: one file, one writer
        "rng": capture_rng_all_ranks(run.gen, run.info),
        "scheduler": run.sched.state_dict(),
        "scaler": run.scaler.state_dict(),
        "sampler": run.sampler.state_dict(),
    }


def restore(run: Run, state: dict) -> int:
    run.raw.load_state_dict(state["model"])  # the unwrapped model: every rank loads the same values
    # keeps (and later updates in place) the tensors it is given
    run.opt.load_state_dict(state["optimizer"])
    run.sched.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])  # epoch AND position: trained samples are skipped
    if "rng" in state:
        restore_rng(state["rng"][run.info.rank], run.gen, run.info.device)
    return state["step"]


def train(run: Run, step: int, until: int, fault=None, log=None, save=None) -> dict[int, float]:
    """Optimizer steps step+1 .. until; returns {step: this rank's loss}."""
    args, dev = run.args, run.info.device
    losses = {}
    while step < until:
        batches = iter(run.loader)  # the sampler's epoch, from its position
        left = len(run.sampler) // args.batch_size  # optimizer steps to the epoch's end
        if left < 1:  # a sampler that never rolls over to the next epoch would loop here forever
            # (not a RuntimeError: exit_on_peer_failure reads that as a peer failure)
            raise AssertionError(
                f"step {step}: the sampler has no batch left ({run.sampler.state_dict()})"
            )
        for _ in range(min(left, until - step)):  # to the epoch's end, or to `until`
            step += 1
            x, y = next(batches)  # x (b, 1, 8, 8), y (b,)
            x, y = augment(x, run.gen, not args.no_random_draws).to(dev), y.to(dev)
            with torch.autocast(dev.type, torch.float16, enabled=args.amp):
                loss = F.cross_entropy(run.model(x), y)
            if fault:  # exit, raise or hang here, after the forward
                fault.strike(step, run.info.rank, log)
            run.scaler.scale(loss).backward()
            run.scaler.step(run.opt)
            run.scaler.update()
            run.opt.zero_grad(set_to_none=True)
            run.sched.step()
            run.sampler.advance(args.global_batch)
            losses[step] = loss.item()
            if log:  # logged, then a bigger model's step (the sleep): a peer's crash comes after it
                log.write("step", step=step, loss=losses[step])
                time.sleep(args.step_sleep_s)
            if save:
                save(step)
    return losses


# ------------------------------------------------------ 2. wrong resumes, each measured against the right one
def resume_exact(state):  # the pattern: everything
    return state


def resume_at_epoch_start(state):
    """WRONG (lesson 03's resume): the epoch restarts, so its first batches are trained twice."""
    return {**state, "sampler": {"epoch": state["sampler"]["epoch"], "seen": 0}}


def resume_without_rng(state):
    """WRONG: the streams restart from their seeds: other dropout masks and augmentations from here on."""
    return {k: v for k, v in state.items() if k != "rng"}


def resume_without_optimizer(state):
    """WRONG: AdamW's moments restart at zero (and its step count: a fresh bias correction)."""
    return {**state, "optimizer": {**state["optimizer"], "state": {}}}


def exact_bound(world_size: int) -> float:
    """0.0 on 1-2 ranks; 1e-6 above: the ring's sum order depends on DDP's bucket layout (docstring, 1)."""
    return 0.0 if world_size <= 2 else 1e-6


def differs_bound(args) -> float:
    """What a wrong resume must change at least: AdamW moves a parameter by about lr per step whatever the
    gradient's scale, so a wrong state moves the parameters by a fraction of lr (1e-5 at the default lr)."""
    return 1e-3 * args.lr


def resume_step(args, steps_per_epoch: int) -> int:
    """Where section 2 interrupts: mid-run, and mid-epoch where it can (an epoch restart must re-read)."""
    c = args.steps // 2 + 1
    if c % steps_per_epoch == 0 and c + 1 < args.steps:
        c += 1
    return c


def wrong_variants(args, snapshot: dict) -> list:
    wrong = [resume_without_optimizer] + ([] if args.no_random_draws else [resume_without_rng])
    if snapshot["sampler"]["seen"] > 0:
        return [resume_at_epoch_start] + wrong
    print0(
        f"  resume_at_epoch_start      skipped: step {snapshot['step']} ends an epoch (= the exact one)"
    )
    return wrong  # no random draws: no stream to forget


def resume_variants(run: Run, train_set, snapshot: dict, reference: list, variants: list) -> dict:
    """Each variant resumes from ITS OWN COPY of `snapshot`: AdamW's load_state_dict keeps the tensors it is
    given and updates them in place, so a shared snapshot would reach the next variant trained on."""
    diffs = {}
    for variant in variants:
        V = build(run.args, run.info, run.report, train_set)
        train(V, restore(V, variant(copy.deepcopy(snapshot))), run.args.steps)
        diffs[variant.__name__] = max_diff_over_ranks(V.raw, reference, run.info)
    return diffs


def start_point(run: Run, log) -> int:
    """The step this attempt starts from: the newest complete checkpoint, or 0."""
    # what killed saves left behind: never loaded, removed
    if run.args.resuming and run.info.master_process:
        found_step = run.args.found[1]["step"] if run.args.found else None
        log.write("resume", step=found_step, ignored=leftovers(run.args.ckpt_dir, remove=True))
    return (
        restore(run, load_train_state(run.args.found[0], run.info.device)) if run.args.found else 0
    )


def saver(run: Run, fault, log):
    """save(step): the full training state every --ckpt-every steps and at the end."""

    def save(s: int) -> None:
        if s % run.args.ckpt_every == 0 or s == run.args.steps:
            hook = fault.writer_hook(s, log) if fault else None
            signature = model_signature(run.raw)
            save_train_state(capture(run, s), run.args.ckpt_dir, s, run.info, signature, fault=hook)
            log.write("save", step=s)

    return save


def restart_section(run: Run, train_set, steps_per_epoch: int):
    """1. The restarted run against an uninterrupted one; returns the reference and the mid-run snapshot."""
    exact = exact_bound(run.info.world_size)
    print0("\n1. the restarted run against an uninterrupted one (the same processes, from scratch)")
    run.report.value("attempts", run.args.attempt + 1, "attempts: {value}")
    events = read_events(run.args.ckpt_dir / "events.jsonl") if run.info.master_process else None
    tl = report_timeline(run.report, events) if run.info.master_process else None
    R = build(run.args, run.info, run.report, train_set)
    c = resume_step(run.args, steps_per_epoch)  # an interruption mid-run, in process, for section 2
    ref_losses = train(R, 0, c)
    snapshot = roundtrip(capture(R, c))
    ref_losses.update(train(R, c, run.args.steps))
    reference = [p.detach() for p in R.raw.parameters()]
    run.report.claim(
        "resumed_equals_uninterrupted",
        max_diff_over_ranks(run.raw, reference, run.info),
        "<=",
        exact,
        "final parameters vs the uninterrupted run: max |difference| {value}",
    )
    if run.info.master_process:
        logged = {
            a["steps"][i]: a["losses"][i] for a in tl["attempts"] for i in range(len(a["steps"]))
        }
        gaps = torch.tensor(
            [abs(logged[s] - ref_losses[s]) for s in ref_losses], dtype=torch.float64
        )
        worst = gaps.max().item()  # torch's max keeps a NaN (Python's max may drop it)
        run.report.claim(
            "loss_curve_equals_uninterrupted",
            worst,
            "<=",
            exact,
            "rank 0's loss at every step vs the uninterrupted run: max |difference| {value}",
        )
    return reference, snapshot


def variants_section(run: Run, train_set, reference: list, snapshot: dict) -> None:
    """2. Resuming in process from the snapshot, each way, against the uninterrupted run."""
    c = snapshot["step"]
    if c >= run.args.steps:
        print0(f"\n2. skipped: no step after the resume point {c} (--steps 3 or more)")
        return
    print0(
        f"\n2. resuming at step {c} in process, each way, vs the uninterrupted run: max |difference|"
    )
    variants = [resume_exact] + wrong_variants(run.args, snapshot)
    diffs = resume_variants(run, train_set, snapshot, reference, variants)
    for name, d in diffs.items():
        if name == "resume_exact":
            bound = exact_bound(run.info.world_size)
            text = "  {variant:<26} {value}"
            run.report.claim(
                "resume_exact_equals_uninterrupted", d, "<=", bound, text, variant=name
            )
        else:
            bound = differs_bound(run.args)
            run.report.claim(
                f"{name}_differs", d, ">=", bound, "  {variant:<26} {value:.1e}", variant=name
            )


@record  # an exception that ends this rank goes to its error file (TORCHELASTIC_ERROR_FILE): docstring, 5
def main() -> None:
    args = parse_args()
    # fault i strikes in attempt i
    fault = args.faults[args.attempt] if args.attempt < len(args.faults) else None
    with distributed_session(args) as info:
        # returns before the group is destroyed: its DDP reducers go first
        lesson(args, info, fault)


def lesson(args, info, fault) -> None:
    """Train (restarted by torchrun where a fault strikes), then sections 1 and 2. A function: its DDP objects
    are freed while the process group still exists."""
    report, W = Report(info), info.world_size
    log = EventLog(args.ckpt_dir / "events.jsonl", args.attempt, info.rank)
    log.write("start")
    # (192, 1, 8, 8): 6 steps per epoch on 2 ranks
    train_set = Subset(digits_split()[0], range(args.train_samples))
    run = build(args, info, report, train_set)
    report.record("world_size", W)  # for the tests
    report.record("attempt", args.attempt)
    report.record("global_batch", args.global_batch)
    steps_per_epoch = args.train_samples // args.global_batch
    report.value(
        "steps_per_epoch",
        steps_per_epoch,
        "attempt {attempt}: {W} ranks x {b} = global batch {gb}, {value} steps/epoch",
        attempt=args.attempt,
        W=W,
        b=args.batch_size,
        gb=args.global_batch,
    )
    step = start_point(run, log)
    # gloo raises when a peer died, or did not answer within --timeout-s
    with exit_on_peer_failure(log):
        train(run, step, args.steps, fault, log, saver(run, fault, log))
    reference, snapshot = restart_section(run, train_set, steps_per_epoch)
    variants_section(run, train_set, reference, snapshot)
    report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
