"""Lesson 14: fault tolerance -- crashes, restarts, exact resume, and a world that changes size.

    python lessons/14_fault_tolerance.py               # one process: no restart; the resumes are checked in-process
    torchrun --standalone --nproc_per_node=2 --max-restarts=2 lessons/14_fault_tolerance.py --crash-at-step 7 \
        --crash-rank 1               # or: --fault hang@11:1 --timeout-s 5, or: --fault mid-write@8 before-rename@12
    torchrun --standalone --nproc_per_node=4 lessons/14_fault_tolerance.py --no-random-draws --ckpt-dir /tmp/ft14 \
        --save-sharded-at 8          # then 2 ranks continue (4 -> 2), keeping the per-rank or the global batch:
    torchrun --standalone --nproc_per_node=2 lessons/14_fault_tolerance.py --no-random-draws \
        --resume-sharded /tmp/ft14/sharded_step_000008 [--keep-global-batch]

torchrun restarts EVERY rank when one fails (--max-restarts times; TORCHELASTIC_RESTART_COUNT = the attempt).
A restarted process group needs keys of its own in torch 2.13's shared store (common/session.py: rendezvous_store).
What to look for:
1. A crash at step 7 (first step of epoch 1, 6 steps per epoch): the restarted job ends EQUAL to an uninterrupted
   run (0.0): the checkpoint holds model, AdamW, LR scheduler, GradScaler, every rank's RNG streams (torch, numpy,
   random, its generator), the sampler's epoch AND position. 2. Forgetting the position, the optimizer or the RNG
   changes the result (measured; the scheduler and the GradScaler, off on CPU, are not tested that way).
3. A killed writer leaves a temp file (or a .pt without its marker), never loaded: the previous one is.
4. A hung peer: gloo raises after --timeout-s, the job exits 1, torchrun restarts it. NCCL (GPU only, untested
   here): the watchdog thread times the collective out and with TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (default) tears
   the process down; TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC kills a process whose watchdog is stuck
   (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).
5. 4 ranks -> 2 (torch.distributed.checkpoint): parameters equal at the switch (0.0); per-rank RNG streams cannot
   be resharded; the per-rank batch kept halves the global batch (another trajectory), --keep-global-batch
   accumulates 2 micro-steps (lesson 07) and follows the 4-rank run within rounding.

Sources: https://pytorch.org/docs/stable/elastic/run.html; https://pytorch.org/docs/stable/distributed.checkpoint.html;
https://pytorch.org/tutorials/beginner/ddp_series_fault_tolerance.html; lesson 13 (sharded checkpoints of FSDP2).
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from common.checkpoint import atomic_write
from common.data import digits_split
from common.ranks import print0
from common.faults import (EventLog, exit_on_peer_failure, parse_faults, read_events,
                           report_timeline)
from common.reshard import check_sharded, load_sharded, micro_steps_for, save_sharded
from common.results import Report
from common.seeding import rank_seed
from common.session import LessonError, add_distributed_args, distributed_session, read_torchrun_env, run_main, set_seed
from common.train_state import (ResumableDistributedSampler, capture_rng_all_ranks, clear_run, leftovers,
                                load_train_state, max_diff_over_ranks, model_signature, restore_rng, resume_point,
                                roundtrip, save_train_state)

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0, then 1, 2, ... after each restart


def make_model(width: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(width, width), nn.ReLU(), nn.Dropout(dropout), nn.Linear(width, 10))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=18, help="optimizer steps (default 18: 3 epochs on 2 ranks)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per micro-step (default 16)")
    p.add_argument("--train-samples", type=int, default=192, help="digits used for training (default 192)")
    p.add_argument("--width", type=int, default=64, help="hidden width of the MLP (default 64)")
    p.add_argument("--lr", type=float, default=0.01, help="AdamW learning rate, cosine schedule (default 0.01)")
    p.add_argument("--amp", action="store_true", help="fp16 autocast + GradScaler (for CUDA)")
    p.add_argument("--no-random-draws", action="store_true", help="no dropout, no augmentation")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints + events.jsonl (default: a temp dir per job)")
    p.add_argument("--ckpt-every", type=int, default=4, help="steps between full checkpoints (default 4)")
    p.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint in --ckpt-dir")
    p.add_argument("--crash-at-step", type=int, default=None, help="rank --crash-rank (default: the last) exits")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--fault", nargs="+", default=[], help="KIND@STEP[:RANK], one per attempt (common/faults.py)")
    p.add_argument("--save-sharded-at", type=int, default=None, help="all ranks save a DCP checkpoint at step S")
    p.add_argument("--resume-sharded", default=None, help="continue from a DCP checkpoint, any world size")
    p.add_argument("--keep-global-batch", action="store_true", help="with --resume-sharded: accumulate to keep it")
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="sleep per step (a slower model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank reads the same files and fails alike, with one line.
    rank, _, W, _ = read_torchrun_env()
    if min(args.steps, args.batch_size, args.train_samples, args.width, args.ckpt_every) < 1 or args.lr <= 0:
        raise LessonError("--steps, --batch-size, --train-samples, --width, --ckpt-every and --lr must be positive")
    if args.crash_at_step is not None:
        args.fault.insert(0, f"exit@{args.crash_at_step}:{W - 1 if args.crash_rank is None else args.crash_rank}")
    args.faults = parse_faults(args.fault, args.steps, W, lambda s: s % args.ckpt_every == 0 or s == args.steps,
                               int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))
    args.ckpt_dir = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / "lesson14" /
                         os.environ.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}"))
    signature = model_signature(make_model(args.width, 0.0))
    args.sharded = check_sharded(args.resume_sharded, signature) if args.resume_sharded else None
    args.k = micro_steps_for(args.sharded, W, args.batch_size, args.keep_global_batch) if args.sharded else 1
    args.global_batch = W * args.batch_size * args.k
    if not args.global_batch <= args.train_samples <= 1438:
        raise LessonError(f"--train-samples must be in [{args.global_batch}, 1438] (the global batch .. the digits)")
    resuming = args.resume or (ATTEMPT > 0 and not args.sharded)  # a restarted attempt resumes by itself
    args.found = resume_point(args.ckpt_dir, args.resume, signature, W) if resuming else None
    if rank == 0 and not resuming and not args.sharded:
        clear_run(args.ckpt_dir)  # a fresh run: forget the last run's checkpoints in this folder
    return args


def augment(x: torch.Tensor, gen: torch.Generator, on: bool) -> torch.Tensor:
    """x (B, 1, 8, 8): a shift drawn from `random` and numpy, noise from this rank's generator (per-rank streams)."""
    if not on:
        return x
    x = torch.roll(x, shifts=(int(np.random.randint(-1, 2)), random.choice((-1, 0, 1))), dims=(2, 3))
    return x + 0.05 * torch.randn(x.shape, generator=gen)


def build(args, info, train_set) -> SimpleNamespace:
    """Model, optimizer, scheduler, scaler, sampler and RNG streams, as at step 0 (the same on every call)."""
    set_seed(args.seed)  # the same initial weights on every rank
    raw_model = make_model(args.width, 0.0 if args.no_random_draws else 0.1).to(info.device)
    model = DDP(raw_model, device_ids=[info.local_rank] if info.device.type == "cuda" else None) \
        if info.distributed else raw_model
    opt = torch.optim.AdamW(raw_model.parameters(), lr=args.lr)
    sampler = ResumableDistributedSampler(train_set, info.world_size, info.rank, args.seed,
                                          args.train_samples // args.global_batch * args.global_batch)
    set_seed(rank_seed(args.seed, info.rank))  # dropout and augmentations differ by rank, reproducibly
    return SimpleNamespace(raw=raw_model, model=model, opt=opt, sampler=sampler,
                           sched=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps),
                           scaler=torch.amp.GradScaler(info.device.type, enabled=args.amp),
                           # Each iter(loader) draws a base seed from torch's GLOBAL RNG unless given a generator; a
                           # resumed run makes one more iterator: every later dropout mask shifts (measured 1.2e-2).
                           loader=DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                             generator=torch.Generator()),
                           gen=torch.Generator().manual_seed(rank_seed(args.seed + 1, info.rank)))


# ----------------------------------------------------------------- 1. the pattern to copy: save and restore ALL
def capture(T, step: int, info) -> dict:
    rngs = capture_rng_all_ranks(T.gen, info)  # rank 0 writes every rank's streams: one file, one writer
    return {"step": step, "model": T.raw.state_dict(), "optimizer": T.opt.state_dict(), "rng": rngs,
            "scheduler": T.sched.state_dict(), "scaler": T.scaler.state_dict(), "sampler": T.sampler.state_dict()}


def restore(T, state: dict, info) -> int:
    T.raw.load_state_dict(state["model"])  # the unwrapped model: every rank loads the same values
    T.opt.load_state_dict(state["optimizer"])
    T.sched.load_state_dict(state["scheduler"])
    T.scaler.load_state_dict(state["scaler"])
    T.sampler.load_state_dict(state["sampler"])  # epoch AND position: trained samples are skipped, not re-read
    if "rng" in state:
        restore_rng(state["rng"][info.rank], T.gen, info.device)
    return state["step"]


def train(T, args, info, step: int, until: int, fault=None, log=None, save=None) -> dict[int, float]:
    """Optimizer steps step+1 .. until; returns {step: this rank's loss}."""
    losses, dev, k = {}, info.device, args.k
    while step < until:
        batches = iter(T.loader)  # the sampler's epoch, from its position
        for _ in range(min(len(T.sampler) // (args.batch_size * k), until - step)):  # to the epoch's end or `until`
            step += 1
            for micro_step in range(k):  # k > 1 only to keep the global batch on fewer ranks (lesson 07)
                x, y = next(batches)  # x (b, 1, 8, 8), y (b,)
                x, y = augment(x, T.gen, not args.no_random_draws).to(dev), y.to(dev)
                with nullcontext() if micro_step == k - 1 or not info.distributed else T.model.no_sync():
                    with torch.autocast(dev.type, torch.float16, enabled=args.amp):
                        loss = F.cross_entropy(T.model(x), y)
                    if fault:
                        fault.strike(step, info.rank, log)  # exit or hang here, after the forward
                    T.scaler.scale(loss / k).backward()
            T.scaler.step(T.opt)
            T.scaler.update()
            T.opt.zero_grad(set_to_none=True)
            T.sched.step()
            T.sampler.advance(args.global_batch)
            losses[step] = loss.item()
            if log:
                time.sleep(args.step_sleep_s)  # stands for a bigger model's step (the notebook's timeline)
            if log:
                log.write("step", step=step, loss=losses[step])
            if save:
                save(step)
    return losses


# -------------------------------------------------------------- 2. wrong resumes, each measured against the right one
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




def main() -> None:
    args = parse_args()
    fault = args.faults[ATTEMPT] if ATTEMPT < len(args.faults) else None  # the i-th fault fires in attempt i
    with distributed_session(args) as info:
        lesson(args, info, fault)  # returns before the group is destroyed: its DDP reducers go first (see run_main)


def lesson(args, info, fault) -> None:  # a function: its DDP objects are freed while the group still exists
    report, W, rank0, step = Report(info), info.world_size, info.master_process, 0
    # 2 ranks sum a + b in any order: bit-identical. 4: DDP's bucket rebuild reorders gloo's ring sums (1.5e-8).
    exact = 0.0 if W <= 2 else 1e-6
    log = EventLog(args.ckpt_dir / "events.jsonl", ATTEMPT, info.rank)
    log.write("start")
    train_set = Subset(digits_split()[0], range(args.train_samples))  # (192, 1, 8, 8): 6 steps/epoch on 2
    T = build(args, info, train_set)
    report.results.update(world_size=W, attempt=ATTEMPT, global_batch=args.global_batch)  # for the tests
    report.value("steps_per_epoch", args.train_samples // args.global_batch, f"attempt {ATTEMPT}: {W} ranks x "
                 f"{args.batch_size} x {args.k} = global batch {args.global_batch}, {{value}} steps per epoch")
    if args.sharded:
        W0, step = args.sharded["world_size"], load_sharded(T.raw, T.opt, args.resume_sharded, args.sharded,
                                                             T.sched, T.sampler)
        set_seed(rank_seed(args.seed + step, info.rank))  # W0 ranks' streams cannot become W: reseeded
        T.gen.manual_seed(rank_seed(args.seed + 1 + step, info.rank))
        report.claim("params_equal_at_the_switch", max_diff_over_ranks(T.raw, args.sharded["params"], info),
                     "==", 0.0, f"{W0} ranks -> {W}: parameters loaded vs saved at step {step}: {{value}}")
    elif args.found:
        if rank0:  # what killed saves left behind: reported, never loaded, removed
            log.write("resume", step=args.found[1]["step"], ignored=leftovers(args.ckpt_dir, remove=True))
        step = restore(T, load_train_state(args.found[0], info.device), info)

    def save(s: int) -> None:
        if s == args.save_sharded_at:
            meta = {"global_batch": args.global_batch, "step": s, "sampler": T.sampler.state_dict(),
                    "scheduler": T.sched.state_dict()}
            cost = save_sharded(T.raw, T.opt, args.ckpt_dir / f"sharded_step_{s:06d}", info, meta)
            report.value("sharded_bytes", cost["bytes"], f"DCP checkpoint at step {s}: {{value}} bytes of tensors")
            report.perf("async_save_blocking_ratio", cost["async_block_s"] / cost["sync_s"], f"the loop blocked "
                        f"{cost['async_block_s']:.4f} s (async_save) vs {cost['sync_s']:.4f} s (save): {{value:.2f}}")
        if s % args.ckpt_every == 0 or s == args.steps:
            save_train_state(capture(T, s, info), args.ckpt_dir, s, info, model_signature(T.raw),
                             fault=fault.writer_hook(s, log) if fault else None)
            log.write("save", step=s)
    with exit_on_peer_failure(log):  # gloo raises when a peer died, or did not answer within --timeout-s
        train(T, args, info, step, args.steps, fault, log, save)
    if args.save_sharded_at and rank0:  # the old world's continuation: what a new world is compared with
        atomic_write(args.ckpt_dir / f"sharded_step_{args.save_sharded_at:06d}" / "continued.pt",
                     lambda f: torch.save([p.detach().cpu() for p in T.raw.parameters()], f))
    if args.sharded:
        d = max_diff_over_ranks(T.raw, load_train_state(Path(args.resume_sharded) / "continued.pt", info.device), info)
        if args.keep_global_batch and args.no_random_draws:
            report.claim("kept_global_batch_follows_old_world", d, "<=", 1e-6, f"global batch kept by "
                         f"{args.k} micro-steps: final parameters vs the {W0}-rank run {{value:.1e}} (sum order)")
        else:
            report.claim("new_world_changes_trajectory", d, ">=", 1e-3, f"final parameters vs the "
                         f"{W0}-rank run {{value:.1e}}: another global batch or other random draws")
        return report.finish(args.results)

    print0("\n1. the restarted run against an uninterrupted one (the same processes, from scratch)")
    report.value("attempts", ATTEMPT + 1, "attempts: {value}")
    tl = report_timeline(report, read_events(args.ckpt_dir / "events.jsonl")) if rank0 else None
    R = build(args, info, train_set)
    c = args.steps // 2 + 1  # an interruption mid-run, in process, for section 2
    ref_losses = train(R, args, info, 0, c)
    snapshot = roundtrip(capture(R, c, info))
    ref_losses.update(train(R, args, info, c, args.steps))
    report.claim("resumed_equals_uninterrupted", max_diff_over_ranks(T.raw, [p.detach() for p in R.raw.parameters()],
                 info), "<=", exact, "final parameters vs the uninterrupted run: max |difference| {value}")
    if rank0:
        logged = {a["steps"][i]: a["losses"][i] for a in tl["attempts"] for i in range(len(a["steps"]))}
        report.claim("loss_curve_equals_uninterrupted", max(abs(logged[s] - ref_losses[s]) for s in ref_losses),
                     "<=", exact, "rank 0's loss at every step vs the uninterrupted run: max |difference| {value}")

    print0(f"\n2. resuming at step {c} in process, each way, vs the uninterrupted run: max |difference|")
    for variant in [resume_exact, resume_at_epoch_start, resume_without_optimizer] + \
            ([] if args.no_random_draws else [resume_without_rng]):  # no random draws: no stream to forget
        V = build(args, info, train_set)
        train(V, args, info, restore(V, variant(snapshot), info), args.steps)
        d = max_diff_over_ranks(V.raw, [p.detach() for p in R.raw.parameters()], info)
        if variant is resume_exact:
            report.claim("resume_exact_equals_uninterrupted", d, "<=", exact, f"  {variant.__name__:<26} {{value}}")
        else:
            report.claim(f"{variant.__name__}_differs", d, ">=", 1e-5, f"  {variant.__name__:<26} {{value:.1e}}")
    report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
