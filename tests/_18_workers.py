"""Workers for tests/lessons/test_18_gradient_compression.py (spawned by tests._workers.run_world; must be
importable)."""

import importlib

import torch

LESSON = "lessons.18_gradient_compression"


def _cast_claims(rank: int, world_size: int, make_hook) -> dict:
    """Lesson 18's fp16 / bf16 section with `make_hook(dtype)` as the hand-written hook: its claims as recorded
    ({name: (value, holds)}) and the names that do not hold."""
    from common.compression.hooks import comm_hook
    from common.harness.env import DistInfo
    from common.harness.results import Report
    from common.harness.session import set_seed
    from common.models import ResidualMLP

    lesson = importlib.import_module(LESSON)
    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    set_seed(0)
    init_state = {k: v.clone() for k, v in ResidualMLP().state_dict().items()}
    torch.manual_seed(1 + rank)  # each rank its own batch
    batch = (torch.randn(8, 1, 8, 8), torch.randint(10, (8,)))
    run = lesson.Run(lesson.parse_args([]), info, Report(info), init_state, batch)
    plain, plain_bytes = lesson.hook_gradients(run, *comm_hook("allreduce"))
    lesson.cast_section(run, plain[-1], plain_bytes, make_hook=make_hook or lesson.compress_hook)
    claims = run.report.results["claims"]
    return {
        "claims": {name: (c["value"], c["holds"]) for name, c in claims.items()},
        "failing": run.report.failing(),
    }


def cast_claims_with_nan_on_rank1(rank: int, world_size: int) -> dict:
    """The hand-written hook planting a NaN in rank 1's result."""
    lesson = importlib.import_module(LESSON)

    def planting(dtype):
        hook = lesson.compress_hook(dtype)

        def nan_on_rank1(state, bucket):
            def plant(fut):
                out = fut.value()
                if rank == 1:
                    out[0] = float("nan")
                return out

            return hook(state, bucket).then(plant)

        return nan_on_rank1

    return _cast_claims(rank, world_size, planting)


def cast_claims_with_an_fp32_hook(rank: int, world_size: int) -> dict:
    """A hook that forgets the cast: it divides and all-reduces the fp32 buffer itself, whatever `dtype`."""
    import torch.distributed as dist

    def fp32(dtype):
        def hook(process_group, bucket):
            buffer = bucket.buffer().div_(dist.get_world_size())
            fut = dist.all_reduce(buffer, async_op=True).get_future()
            return fut.then(lambda fut: fut.value()[0])

        return hook

    return _cast_claims(rank, world_size, fp32)
