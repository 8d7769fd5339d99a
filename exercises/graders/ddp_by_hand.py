"""Grader of exercises/ddp_by_hand.py: 3 ranks, a model with a frozen layer and a tied weight, different
initial weights and data per rank; against torch's DDP; the all-reduces counted and timed against backward."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.measure.differences import nan_max
from exercises.graders._common import answer_diff, functions_replaced, rank_failures

WORLD_SIZE = (
    3  # 3, not 2: an average hard-coded as x 0.5, or (sum of sums) / 2W, is right only at 2
)
FUNCTIONS = ["DataParallelByHand"]
STEPS = 3
# 20 float64 values: walking the trainable parameters in reverse (head.bias 3, head.weight 18 | out.bias 6,
# inp.bias 6, inp.weight 36, the tied weight), the rule closes 2 buckets, of 21 and 48 values.
CAP_MB = 20 * 8 / 2**20


class TiedNet(nn.Module):
    """inp (6 -> 6) -> frozen mid (6 -> 6) -> out (6 -> 6, its weight IS inp's) -> head (6 -> 3), and a
    buffer."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.out.weight = self.inp.weight  # tied: one parameter used twice
        self.mid.requires_grad_(False)  # frozen
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x):
        return self.head(
            torch.tanh(self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))) * self.scale
        )


def make_model(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # a different init on every rank: the wrapper must broadcast rank 0's
    model = TiedNet().double()
    model.scale.fill_(1.0 + rank)
    return model


def buckets(
    model: nn.Module,
    cap_mb: float | None,
    order: str = "reverse",
    rule: str = "at least",
    frozen: bool = False,
) -> list[list[str]]:
    """The names of the parameters in each bucket. The contract: trainable parameters in reverse order, a
    bucket closed as soon as it holds at least the cap. The variants a learner may build instead: the
    forward order, a bucket closed before it would pass the cap ("at most"), frozen parameters bucketed
    too."""
    named = [(n, p) for n, p in model.named_parameters() if frozen or p.requires_grad]
    named = named[::-1] if order == "reverse" else named
    if cap_mb is None:
        return [[n] for n, _ in named]
    cap, out, current, size = cap_mb * 2**20, [], [], 0
    for n, p in named:
        nbytes = p.numel() * p.element_size()
        if rule == "at most" and current and size + nbytes > cap:
            out.append(current)
            current, size = [], 0
        current.append(n)
        size += nbytes
        if rule == "at least" and size >= cap:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def sizes(model: nn.Module, layout: list[list[str]]) -> list[int]:
    """The elements of each bucket that fires: a bucket holding a frozen parameter never fills."""
    params = dict(model.named_parameters())
    fires = [b for b in layout if all(params[n].requires_grad for n in b)]
    return sorted(sum(params[n].numel() for n in b) for b in fires)


def expected_buckets(model: nn.Module, cap_mb: float | None) -> int:
    return len(buckets(model, cap_mb))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (8,), generator=g
    )


def state(model) -> list:
    return [t.detach().tolist() for t in list(model.parameters()) + list(model.buffers())]


def train(model, after_backward, log=None) -> tuple[list, list]:
    """(parameters and buffers after STEPS steps, the gradients of the first step after synchronisation)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    first_grads = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        if log is not None:
            log.append(("backward", step))
        nn.functional.cross_entropy(model(x), y).backward()
        if log is not None:
            log.append(("backward_done", step))
        after_backward()
        if step == 0:
            first_grads = [
                p.grad.detach().tolist() for p in model.parameters() if p.grad is not None
            ]
        opt.step()
        opt.zero_grad()
    return state(model), first_grads


class _Watched:
    """An all-reduce's work that logs when it is waited on (everything else goes to the real work)."""

    def __init__(self, work, index: int, log: list):
        self._work, self._index, self._log = work, index, log

    def wait(self, *args, **kwargs):
        self._log.append(("wait", self._index))
        return self._work.wait(*args, **kwargs)

    def get_future(
        self, *args, **kwargs
    ):  # torch.futures.wait_all and .then() reach the work this way
        self._log.append(("wait", self._index))
        return self._work.get_future(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def by_hand(module: str, cap_mb) -> dict:
    learner = importlib.import_module(module)
    model = make_model(dist.get_rank())
    wrapped = learner.DataParallelByHand(model, bucket_cap_mb=cap_mb)
    wrapped_state = state(model)  # right after wrapping: rank 0's on every rank
    log: list = []
    original = c10d.all_reduce

    def recording(tensor, *args, **kwargs):
        async_op = bool(kwargs.get("async_op", False) or (len(args) >= 3 and args[2]))
        index = sum(1 for e in log if e[0] == "all_reduce")
        log.append(("all_reduce", async_op, index, tensor.numel()))
        work = original(tensor, *args, **kwargs)
        return _Watched(work, index, log) if async_op and work is not None else work

    model.inp.bias.register_post_accumulate_grad_hook(lambda p: log.append(("first_layer_grad",)))
    # every way to the all-reduce is counted: dist.all_reduce, distributed_c10d's, a name bound at import
    with functions_replaced({original: recording}, [learner]):
        final, first_grads = train(wrapped, wrapped.finish_gradient_sync, log)
    return {
        "final": final,
        "first_grads": first_grads,
        "wrapped": wrapped_state,
        "log": log,
        "expected_buckets": expected_buckets(model, cap_mb),
    }


def wraps_nothing_to_train(module: str) -> str | None:
    """What wrapping a module with no trainable parameter raised (torch's DDP: RuntimeError), or None."""
    frozen = nn.Linear(2, 2).double().requires_grad_(False)
    try:
        importlib.import_module(module).DataParallelByHand(frozen)
    except Exception as e:
        return type(e).__name__
    return None


def on_rank(module: str) -> dict:
    final, first_grads = train(DDP(make_model(dist.get_rank())), lambda: None)
    return {
        "ddp": final,
        "ddp_first_grads": first_grads,
        "per_gradient": by_hand(module, None),
        "buckets": by_hand(module, CAP_MB),
        "nothing_to_train": wraps_nothing_to_train(module),
    }


def _per_backward(log: list) -> list[dict]:
    """The all-reduce entries between each ('backward', step) and the next one: whether each was async and
    its elements; whether backward was still running (the first layer's gradient not yet accumulated) when
    the first of them started; whether one started while an earlier one of the same backward was not waited
    on yet (the works overlap backward); and the async works never waited on before the next backward."""
    out, current = [], None
    for entry in log:
        if entry[0] == "backward":
            current = {
                "calls": [],
                "sizes": [],
                "overlapped": False,
                "first_done": False,
                "pending": set(),
                "concurrent": False,
            }
            out.append(current)
        elif current is None:
            continue
        elif entry[0] == "first_layer_grad":
            current["first_done"] = True
        elif entry[0] == "wait":
            current["pending"].discard(entry[1])
        elif entry[0] == "all_reduce":
            current["calls"].append(entry[1])
            current["sizes"].append(entry[3])
            current["concurrent"] |= bool(current["pending"])
            if entry[1]:
                current["pending"].add(entry[2])
            if len(current["calls"]) == 1 and not current["first_done"]:
                current["overlapped"] = True
    return out


def _bucket_problem(mode: str, rank: int, step: int, b: dict, expected: int) -> str | None:
    """The buckets' elements against the rule's (and against the rules a learner may have built instead)."""
    model = make_model(0)
    cap = CAP_MB if mode == "buckets" else None
    want, got = sizes(model, buckets(model, cap)), sorted(b["sizes"])
    if got == want:
        return None
    head = f"rank {rank}'s all-reduces in backward {step} hold {got} elements, the rule's buckets {want}"
    if cap is not None and got == sizes(model, buckets(model, cap, order="forward")):
        return (
            f"{head}: your buckets follow the forward order of module.parameters(); walk the trainable "
            f"parameters in REVERSE (backward produces the last layers' gradients first, so the first "
            f"bucket can leave while backward is still running)"
        )
    if cap is not None and got == sizes(model, buckets(model, cap, rule="at most")):
        return (
            f"{head}: the bucket rule is the difference: yours closes a bucket before it would pass the "
            f"cap (at most c bytes); the contract's closes it as soon as it holds at least c bytes (the "
            f"last bucket may hold less)"
        )
    with_frozen = buckets(model, cap, frozen=True)
    if got == sizes(model, with_frozen):
        params = dict(model.named_parameters())
        stuck = next(bk for bk in with_frozen if not all(params[n].requires_grad for n in bk))
        lost = [n for n in stuck if params[n].requires_grad]
        return (
            f"{head}: the bucket {stuck} holds a frozen parameter (requires_grad=False): no hook fires "
            f"for it, so the bucket never fills and {', '.join(lost)} is never all-reduced; bucket only "
            f"the trainable parameters"
        )
    unit = "trainable parameter" if mode == "per_gradient" else "bucket"
    return (
        f"rank {rank} made {len(b['calls'])} all-reduces in backward {step} holding {got} elements, "
        f"expected {expected} holding {want} (one per {unit}, each gradient all-reduced once; a tied "
        f"parameter counts once)"
    )


def _wrap_problem(rank: int, run: dict, rank0: dict) -> str | None:
    """Right after wrapping every rank must hold rank 0's parameters, frozen ones too, and buffers."""
    model = make_model(0)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n for n, _ in model.named_buffers()}
    differ = [
        n
        for n, a, b in zip(names, run["wrapped"], rank0["wrapped"])
        if not answer_diff(a, b) == 0.0
    ]
    if not differ:
        return None
    if all(n in buffers for n in differ):
        return (
            f"rank {rank}'s buffers ({', '.join(differ)}) differ from rank 0's right after wrapping: "
            f"broadcast module.buffers() from rank 0 too, as DDP does"
        )
    if not any(n in trainable for n in differ):
        return (
            f"rank {rank}'s frozen parameters ({', '.join(differ)}) differ from rank 0's right after "
            f"wrapping: broadcast every parameter, the requires_grad=False ones too (they still compute "
            f"the forward)"
        )
    return (
        f"rank {rank}'s parameters and buffers ({', '.join(differ)}) differ from rank 0's right after "
        f"wrapping: broadcast every parameter and buffer from rank 0 at wrap time, so all replicas start "
        f"equal"
    )


def _average_problem(rank: int, run: dict, reference: list) -> str | None:
    """The first step's synchronised gradients against DDP's: a sum, or a fixed divisor, shows as a ratio."""
    got = (
        torch.cat([torch.tensor(g, dtype=torch.float64).flatten() for g in run["first_grads"]])
        if run["first_grads"]
        else torch.zeros(0, dtype=torch.float64)
    )
    want = torch.cat([torch.tensor(g, dtype=torch.float64).flatten() for g in reference])
    if got.shape == want.shape and close_all(got, want):
        return None
    ratio = (got @ want / (want @ want)).item() if got.shape == want.shape else float("nan")
    if got.shape == want.shape and close_all(got, ratio * want):
        if abs(ratio - WORLD_SIZE) < 1e-9:
            return (
                f"rank {rank}'s gradients are {WORLD_SIZE}x DDP's: the all-reduce sums; divide the sum "
                f"by dist.get_world_size() to average"
            )
        return (
            f"rank {rank}'s gradients are {ratio:.3g}x DDP's: this run has {WORLD_SIZE} ranks: divide "
            f"the sum by dist.get_world_size(), never by a fixed number"
        )
    return (
        f"rank {rank}'s gradients after the first finish_gradient_sync differ from DDP's by "
        f"{answer_diff(got, want):.2e}: write the average (sum / world size) of each gradient into its "
        f".grad, once"
    )


def close_all(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(answer_diff(a, b) <= 1e-12)


def _sync_problem(mode: str, rank: int, run: dict) -> str | None:
    """The all-reduces of one rank's run: the buckets, async, waited on."""
    per_backward = _per_backward(run["log"])
    for step, b in enumerate(per_backward):
        problem = _bucket_problem(mode, rank, step, b, run["expected_buckets"])
        if problem:
            return problem
    for b in per_backward:
        if not all(b["calls"]):
            return (
                f"rank {rank} called dist.all_reduce without async_op=True: the work must run while "
                f"backward goes on"
            )
        if b["pending"]:
            return (
                f"rank {rank} never waited on {len(b['pending'])} of its all-reduces' work handles: "
                f"finish_gradient_sync must call work.wait() on each before reading the result (on gloo "
                f"the sum may not have arrived yet; on NCCL, wait() orders the stream)"
            )
    return None


def _result_problem(rank: int, run: dict, ddp: list) -> str | None:
    diff = nan_max(answer_diff(g, w) for g, w in zip(run["final"], ddp))
    if not diff <= 1e-12:
        return (
            f"rank {rank}'s parameters and buffers differ from DDP's by {diff:.2e} after {STEPS} steps, "
            f"though they started equal and the first step's gradients matched: every backward must "
            f"all-reduce that backward's gradients (copy them into the bucket anew, reset the counts)"
        )
    return None


def _overlap_problem(mode: str, rank: int, run: dict) -> str | None:
    unit = "trainable parameter" if mode == "per_gradient" else "bucket"
    for b in _per_backward(run["log"]):
        if not b["overlapped"]:
            return (
                f"rank {rank}'s first all-reduce started after backward had finished: launch it from the "
                f"gradient hook, as soon as the bucket's gradients are ready"
            )
        if len(b["calls"]) > 1 and not b["concurrent"]:
            return (
                f"rank {rank} waited on each all-reduce before the next gradient hook launched another: "
                f"backward stalls on every {unit}; keep the works and wait for them in "
                f"finish_gradient_sync"
            )
    return None


def _problem(mode: str, answers: list) -> str | None:
    """The first thing wrong in one mode, checked over every rank one question at a time: the all-reduces,
    the state right after wrapping, the first step's average, the end of the run, the overlap."""
    runs = [a[mode] for a in answers]
    checks = (
        lambda r: _sync_problem(mode, r, runs[r]),
        lambda r: _wrap_problem(r, runs[r], runs[0]),
        lambda r: _average_problem(r, runs[r], answers[r]["ddp_first_grads"]),
        lambda r: _result_problem(r, runs[r], answers[r]["ddp"]),
        lambda r: _overlap_problem(mode, r, runs[r]),
    )
    for check in checks:
        for rank in range(len(answers)):
            problem = check(rank)
            if problem:
                return problem
    return None


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    for rank, a in enumerate(answers):
        if a["nothing_to_train"] != "RuntimeError":
            did = (
                f"raised {a['nothing_to_train']}"
                if a["nothing_to_train"]
                else "wrapped it silently"
            )
            return [
                f"rank {rank}: a module with no trainable parameter (every requires_grad=False) {did}: "
                f"raise RuntimeError, as torch's DDP does ('DistributedDataParallel is not needed when "
                f"a module doesn't have any parameter that requires a gradient'): there is nothing to "
                f"average, and a silent wrapper hides a model frozen by mistake"
            ]
    for mode, what in (
        ("per_gradient", "bucket_cap_mb=None"),
        ("buckets", f"bucket_cap_mb={CAP_MB:.6f}"),
    ):
        problem = _problem(mode, answers)
        if problem:
            return [f"{what}: {problem}"]
    return []
