"""Lesson 12's exhibits of training-loop mistakes: a forgotten set_epoch, and checkpoints that do not load back.
The BatchNorm ones are in `common.exhibits.batchnorm`, the thread one in `common.exhibits.threads`.

Most run on any number of ranks (one process included); those that use DDP build it on a fresh gloo group
(`Ctx.group`). See `common.exhibits.frame` for the frame.
"""

from __future__ import annotations

import argparse
import io

import torch
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.exhibits.frame import Ctx, exhibit


@exhibit(
    "set_epoch_forgotten",
    "training",
    lesson="03",
    symptom="",
    cause="DistributedSampler shuffles with seed + epoch; "
    "without sampler.set_epoch(epoch) epoch stays 0",
    when=("no error: every epoch visits the samples in the same order (the loss curve repeats)"),
    fix="sampler.set_epoch(epoch) before each epoch",
)
def set_epoch_forgotten(ctx: Ctx) -> None:
    def orders(call_set_epoch: bool) -> list[list[int]]:
        s = DistributedSampler(
            range(16), num_replicas=2, rank=ctx.info.rank % 2, shuffle=True, seed=0
        )
        out = []
        for epoch in range(3):
            if call_set_epoch:
                s.set_epoch(epoch)
            out.append(list(s)[:4])  # this rank's first 4 indices of the epoch
        return out

    broken, fixed = orders(False), orders(True)
    ctx.step("symptom", f"first indices of epochs 0, 1, 2 without set_epoch: {broken}")
    ctx.claim(
        "broken_distinct_orders",
        len({tuple(o) for o in broken}),
        "==",
        1,
        "distinct orders over 3 epochs without set_epoch: {value}",
    )
    ctx.step("diagnosis", "print the first indices of each epoch on one rank: they repeat")
    ctx.step("fix", f"sampler.set_epoch(epoch) before each epoch: {fixed}")
    ctx.claim(
        "fixed_distinct_orders",
        len({tuple(o) for o in fixed}),
        "==",
        3,
        "distinct orders over 3 epochs with set_epoch: {value}",
    )


@exhibit(
    "checkpoint_module_prefix",
    "training",
    lesson="03",
    symptom="RuntimeError: Error(s) in loading state_dict for Linear: Missing key(s) in state_dict: "
    '"weight", "bias". Unexpected key(s) in state_dict: "module.weight", "module.bias".',
    cause="the checkpoint was saved from the DDP wrapper "
    "(ddp_model.state_dict()), whose keys start with module.",
    fix=(
        "strip the prefix: "
        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, 'module.')"
    ),
)
def checkpoint_module_prefix(ctx: Ctx) -> None:
    torch.manual_seed(0)
    raw_model = nn.Linear(4, 2)
    if ctx.info.distributed:
        saved = DDP(
            raw_model, process_group=ctx.group()
        ).state_dict()  # torch.save(ddp_model.state_dict())
    else:  # one process: the keys the DDP wrapper would have saved
        saved = {f"module.{k}": v for k, v in raw_model.state_dict().items()}
    o = ctx.attempt(nn.Linear(4, 2).load_state_dict, saved)
    ctx.step("symptom", "load a checkpoint saved from the DDP wrapper into the plain model:")
    ctx.say("    " + o.full.replace("\n", " ").replace("\t", "").strip())
    ctx.record("symptom", o.error)
    ctx.claim(
        "broken_raises",
        int('Unexpected key(s) in state_dict: "module.weight"' in o.full),
        "==",
        1,
        "load_state_dict rejects the module.-prefixed keys: {value}",
    )
    ctx.step("diagnosis", f"the saved keys: {sorted(saved)}")
    buf = io.BytesIO()
    torch.save(saved, buf)  # the checkpoint as written, read back as a user would
    checkpoint = torch.load(io.BytesIO(buf.getvalue()))
    consume_prefix_in_state_dict_if_present(checkpoint, "module.")
    torch.manual_seed(1)
    fixed = nn.Linear(4, 2)  # a fresh model: different weights until it loads
    before = max(
        (p - q).abs().max().item() for p, q in zip(fixed.parameters(), raw_model.parameters())
    )
    fixed.load_state_dict(checkpoint)
    ctx.step(
        "fix",
        "strip the prefix: torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "
        f"'module.'), then load (a fresh model differed by {before:.2f} before); next time save "
        "ddp_model.module.state_dict()",
    )
    diff = torch.stack(
        [(p - q).abs().max() for p, q in zip(fixed.parameters(), raw_model.parameters())]
    )
    ctx.claim(
        "fixed_equal",
        diff.max().item(),
        "==",
        0.0,
        "max |difference| of the loaded weight and bias from the saved model's: {value}",
    )


@exhibit(
    "checkpoint_weights_only",
    "training",
    lesson="01",
    symptom="_pickle.UnpicklingError: Weights only load failed ... Unsupported "
    "global: GLOBAL argparse.Namespace was not an allowed global by default",
    cause="torch.load defaults to weights_only=True since "
    "2.6; the checkpoint pickled an arbitrary object",
    fix="save plain types (vars(args), a dict) and keep weights_only=True",
)
def checkpoint_weights_only(ctx: Ctx) -> None:
    buf = io.BytesIO()
    torch.save({"model": nn.Linear(4, 2).state_dict(), "args": argparse.Namespace(lr=0.1)}, buf)
    o = ctx.attempt(torch.load, io.BytesIO(buf.getvalue()))
    unsupported = next(
        (line.strip() for line in o.full.splitlines() if "Unsupported global" in line), ""
    )
    ctx.step(
        "symptom",
        f"torch.load of a checkpoint that holds argparse.Namespace: {o.error.split('.')[0]}.",
    )
    ctx.say(f"    {unsupported}")
    ctx.record("symptom", unsupported)
    ctx.claim(
        "broken_raises",
        int("argparse.Namespace" in unsupported),
        "==",
        1,
        "torch.load names the unsupported global argparse.Namespace: {value}",
    )
    ctx.step(
        "diagnosis",
        "the message names the class; only load weights_only=False from a source you trust",
    )
    buf = io.BytesIO()
    torch.save(
        {"model": nn.Linear(4, 2).state_dict(), "args": vars(argparse.Namespace(lr=0.1))}, buf
    )
    loaded = torch.load(io.BytesIO(buf.getvalue()))  # weights_only=True, the default
    ctx.step(
        "fix",
        "save plain types (vars(args), a dict) and keep weights_only=True; or "
        "torch.serialization.add_safe_globals([argparse.Namespace])",
    )
    ctx.claim(
        "fixed_loads", loaded["args"]["lr"], "==", 0.1, "the dict checkpoint loads: lr {value}"
    )
