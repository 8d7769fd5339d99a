"""Grader of exercises/compress_hook.py: 3 ranks, one backward of a small DDP model through the learner's hook
and through PyTorch's (default_hooks.fp16_compress_hook, bf16_compress_hook), in two cases: each rank's own
batch (compared bit for bit), and one batch on every rank whose loss is scaled so that each rank's gradient
peaks at 40,000: its mean fits float16 (65504), the sum of 3 ranks does not."""

import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.compression.hooks import comm_hook
from exercises.graders._common import functions_replaced, rank_failures

WORLD_SIZE = 3  # a division by 3 rounds: the order of divide and sum shows
FUNCTIONS = ["compress_hook"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PEAK = 40_000.0  # each rank's largest gradient in the "large" case: x 3 ranks > 65504


def batch(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + (rank if case == "own" else 0))
    return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)


def gradient(hook, state, case: str, sent: list, modules=()) -> torch.Tensor:
    """The flat gradient DDP holds after one backward through `hook`; each all-reduce's dtype into `sent`
    (however `modules`, the learner's, reach dist.all_reduce)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4)))
    model.register_comm_hook(state, hook)
    x, y = batch(case, dist.get_rank())
    scale = 1.0
    if case == "large":  # the same batch everywhere: scale the loss so the gradient peaks at PEAK
        local = torch.autograd.grad(F.cross_entropy(model.module(x), y), list(model.parameters()))
        scale = PEAK / max(g.abs().max().item() for g in local)
    original = dist.all_reduce

    def watched(tensor, *args, **kwargs):
        sent.append(str(tensor.dtype).replace("torch.", ""))
        return original(tensor, *args, **kwargs)

    with functions_replaced({original: watched}, modules):
        (scale * F.cross_entropy(model(x), y)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def on_rank(module: str) -> dict:
    learner = importlib.import_module(module)
    out = {}
    for kind, dtype in DTYPES.items():
        for case in ("large", "own"):
            sent = []
            ours = gradient(learner.compress_hook(dtype), None, case, sent, [learner])
            pytorchs = gradient(*comm_hook(kind), case, [])
            out[f"{kind} {case}"] = {
                "ours": ours.tolist(),
                "pytorchs": pytorchs.tolist(),
                "sent": sent,
            }
    return out


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    got = {}  # rank 0's gradients (every rank holds the same after the all-reduce), as tensors
    for key, a in answers[0].items():
        ours, pytorchs = torch.tensor(a["ours"]), torch.tensor(a["pytorchs"])
        got[tuple(key.split())] = {"ours": ours, "pytorchs": pytorchs, "sent": a["sent"]}
    for (kind, _), a in got.items():
        want = str(DTYPES[kind]).replace("torch.", "")
        if not a["sent"]:
            return [
                f"{kind}: your hook never called dist.all_reduce: each rank holds only its own gradient. "
                f"All-reduce the {want} tensor and return the Future of that all-reduce (.then(...))"
            ]
        if any(dtype != want for dtype in a["sent"]):
            return [
                f"{kind}: you all-reduced {sorted(set(a['sent']))} tensors, expected {want}: cast the "
                f"bucket's buffer to {want} before the all-reduce (that is what halves the bytes)"
            ]
    for kind in DTYPES:
        own, large = got[kind, "own"], got[kind, "large"]
        # the sum of the ranks' gradients, within float16's rounding relative to its largest value
        summed = WORLD_SIZE * own["pytorchs"]
        if (own["ours"] - summed).abs().max() <= 1e-2 * summed.abs().max():
            return [
                f"{kind}: your gradients are {WORLD_SIZE} x PyTorch's: that is the sum of the ranks' "
                "gradients, DDP averages them: divide by the world size (process_group.size())"
            ]
        if not torch.isfinite(large["ours"]).all():
            return [
                f"{kind}, gradients that peak at {PEAK:,.0f} on each rank: yours hold inf or NaN, "
                f"PyTorch's do not: the sum of {WORLD_SIZE} ranks overflows float16 (65504) where the "
                "mean does not. Divide by the world size before the all-reduce, not after"
            ]
    for (kind, case), a in got.items():
        if not torch.equal(a["ours"], a["pytorchs"]):
            want = str(DTYPES[kind]).replace("torch.", "")
            off = (a["ours"] - a["pytorchs"]).abs().max().item()
            return [
                f"{kind}, {case} gradients: max |yours - PyTorch's| = {off:.3g}, expected 0 (bit for bit): "
                f"cast to {want} first, divide in {want} by the world size, all-reduce, cast back "
                "(PyTorch: buffer.to(dtype).div_(world_size))"
            ]
    return []
