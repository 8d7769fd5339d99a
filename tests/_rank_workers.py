"""Worker functions spawned by tests._workers.run_world (importable so that `spawn` can pickle them):
lesson 02's hand-written step and ZeRO stages 1-3 against DDP + torch.optim on a model with frozen and tied
parameters (tests/unit/test_zero.py); `max_over_ranks` on ranks that disagree (tests/unit/test_collectives.py);
a sharded save into a folder that holds a finished checkpoint, stopped before its new marker (test_zero.py)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, LR, DECAY = (
    3,
    1e-2,
    0.1,
)  # weight decay: a frozen parameter that got a zero gradient would shrink


class FrozenTied(nn.Module):
    """x (B, 64) -> logits (B, 10). The stem is frozen (a pretrained layer in fine-tuning); the block's two Linear
    layers share one weight (tied) and its first bias is frozen (a unit that mixes both); the head trains."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 16)
        self.stem.requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.block[2].weight = self.block[0].weight  # tied: one parameter, used twice
        self.block[0].bias.requires_grad_(False)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.block(torch.tanh(self.stem(x)))))


def _data(world_size: int):
    g = torch.Generator().manual_seed(1)  # the same global batches on every rank
    return torch.randn(STEPS, 4 * world_size, 64, generator=g), torch.randint(
        10, (STEPS, 4 * world_size), generator=g
    )


def _fresh(init: dict, rank: int, perturb: bool) -> FrozenTied:
    """The model from `init`; with `perturb`, rank r > 0 starts elsewhere (frozen parameters too): only a
    broadcast at wrap time brings every rank to rank 0's start."""
    model = FrozenTied()
    model.load_state_dict(init)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    return model


def _train(model: nn.Module, step, rank: int, world_size: int) -> None:
    x, y = _data(world_size)
    mine = slice(4 * rank, 4 * rank + 4)  # this rank's 4 samples of each global batch of 4 N
    for i in range(STEPS):
        F.cross_entropy(model(x[i, mine]), y[i, mine]).backward()
        step()


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| over all tensors; NaN anywhere gives NaN (torch's max propagates it)."""
    return torch.stack([(p.detach() - q.detach()).abs().max() for p, q in zip(a, b)]).max().item()


def _ddp_reference(
    init: dict, rank: int, world_size: int, optimizer_cls, perturb: bool
) -> list[torch.Tensor]:
    model = _fresh(init, rank, perturb)
    ddp = DDP(model)  # broadcasts rank 0's parameters, frozen ones included
    opt = optimizer_cls(
        model.parameters(), lr=LR, weight_decay=DECAY
    )  # skips parameters whose grad is None

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    _train(ddp, step, rank, world_size)
    return [p.detach().clone() for p in model.parameters()]


def _summary(
    model: FrozenTied, params: list[torch.Tensor], ref: list[torch.Tensor], init: dict
) -> dict:
    names = [
        n for n, _ in model.named_parameters()
    ]  # tied: block.2.weight is block.0.weight, listed once
    frozen = [i for i, (_, p) in enumerate(model.named_parameters()) if not p.requires_grad]
    trainable = [i for i in range(len(names)) if i not in frozen]
    return {
        "trainable_vs_ddp": _worst([params[i] for i in trainable], [ref[i] for i in trainable]),
        "frozen_vs_ddp": _worst([params[i] for i in frozen], [ref[i] for i in frozen]),
        "frozen_vs_start": _worst([params[i] for i in frozen], [init[names[i]] for i in frozen]),
        "trainable_moved": _worst(
            [params[i] for i in trainable], [init[names[i]] for i in trainable]
        ),
        "still_tied": model.block[2].weight is model.block[0].weight,
        "frozen": [names[i] for i in frozen],
    }


def lesson02_step_vs_ddp(rank: int, world_size: int) -> dict:
    """Lesson 02's step (one all_reduce of the flat gradients, then SGD) against DDP + SGD, from one start."""
    lesson = importlib.import_module("lessons.02_collectives")
    torch.manual_seed(0)
    init = FrozenTied().state_dict()
    ref = _ddp_reference(init, rank, world_size, torch.optim.SGD, perturb=False)
    model = _fresh(
        init, rank, perturb=False
    )  # lesson 02 broadcasts nothing: every rank starts from one seed
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=DECAY)

    def step():
        lesson.average_gradients(model, world_size, True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _train(model, step, rank, world_size)
    return _summary(model, [p.detach().clone() for p in model.parameters()], ref, init)


def zero_vs_ddp(rank: int, world_size: int) -> dict:
    """ZeRO stages 1-3 with AdamW against DDP + AdamW; rank r > 0 starts elsewhere in both (the wrap broadcasts)."""
    from common.sharding.zero import ZeRO

    torch.manual_seed(0)
    init = FrozenTied().state_dict()
    ref = _ddp_reference(init, rank, world_size, torch.optim.AdamW, perturb=True)
    out = {}
    for stage in (1, 2, 3):
        model = _fresh(init, rank, perturb=True)
        zero = ZeRO(
            model,
            [model.stem, model.block, model.head],
            stage,
            group=dist.group.WORLD,
            optimizer_cls=torch.optim.AdamW,
            lr=LR,
            weight_decay=DECAY,
        )
        _train(model, zero.step, rank, world_size)
        out[stage] = {
            **_summary(model, zero.full_parameters(), ref, init),
            "units": len(zero.units),
            "padding_zero": zero.padding_is_zero(),
        }
    return out


def max_over_ranks_of_different_values(rank: int, world_size: int) -> list[float]:
    """Rank r reports 10 r - 3 (and r - 3.5): what one diverging rank looks like to a MAX reduction."""
    from common.measure.differences import max_over_ranks

    return [max_over_ranks(10.0 * rank - 3), max_over_ranks(rank - 3.5)]


def save_over_a_finished_checkpoint(rank: int, world_size: int, path: str) -> dict:
    """Save a complete checkpoint into `path`, then start a second save there and stop before its marker (as a
    crash would): what `check_complete` says about the folder after each."""
    from types import SimpleNamespace

    from common.checkpoint.sharded import check_complete, mark_complete, save_sharded
    from common.checkpoint.train_state import model_signature
    from common.harness.env import LessonError

    info = SimpleNamespace(master_process=rank == 0)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
    opt.step()
    sig = model_signature(model)
    save_sharded(model, opt, path, info)
    mark_complete(path, info, model=sig, world_size=world_size, step=1)
    first = check_complete(path, sig)["step"]
    dist.barrier()  # every rank has read the finished marker before rank 0's next save removes it
    save_sharded(model, opt, path, info)  # ... and the job dies here, before mark_complete
    dist.barrier()
    try:
        check_complete(path, sig)
        second = "loads"
    except LessonError as e:
        second = str(e)
    return {"first": first, "second": second}


def load_full_from_rank0_into_meta(rank: int, world_size: int) -> dict:
    """Lesson 13's recipe for a model too big for one rank: build it on the meta device, fully_shard it, then
    set_model_state_dict with a full state dict on rank 0 only ({} elsewhere), broadcast from rank 0. Returns
    the largest |difference| of the gathered parameters from rank 0's values, and the error when
    full_state_dict=True is left out (torch 2.13's checkpoint/state_dict.py refuses it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from common.models import ResidualMLP

    torch.manual_seed(1 + rank)  # different values on every rank: only rank 0's may end up loaded
    full = ResidualMLP(8, 2).state_dict() if rank == 0 else {}
    copy = {
        k: v.clone() for k, v in full.items()
    }  # set_model_state_dict turns `full`'s values into DTensors
    with torch.device("meta"):
        model = ResidualMLP(8, 2)
    fully_shard(model)
    model.to_empty(device="cpu")  # allocated, not initialised: the load must write every element
    try:
        set_model_state_dict(model, {}, options=StateDictOptions(broadcast_from_rank0=True))
        refused = "loads"
    except ValueError as e:
        refused = str(e)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    gathered = {k: v.full_tensor() for k, v in model.state_dict().items()}
    want = [copy] if rank == 0 else [None]
    dist.broadcast_object_list(want, src=0)
    worst = max((gathered[k] - v).abs().max().item() for k, v in want[0].items())
    nan_free = all(torch.isfinite(t).all().item() for t in gathered.values())
    return {
        "worst": worst if nan_free else float("nan"),
        "keys": sorted(gathered) == sorted(want[0]),
        "refused": refused,
    }
