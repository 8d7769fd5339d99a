"""Load imbalance costs time under expert parallelism: a skewed router against a balanced one.

    torchrun --standalone --nproc_per_node=2 benchmarks/moe_imbalance.py
    torchrun --standalone --nproc_per_node=4 benchmarks/moe_imbalance.py --hidden 512 --tokens 8192

The MoE layer of lesson 20 (common.expert_parallel.moe.ExpertParallelMoE), top-1, with a capacity factor of E
(C = N: no token is ever dropped, so both routers do the same total expert work). Its router is replaced by a fixed one: the
balanced router sends token t to expert t % E (every rank's experts get N/ep rows from every rank); the skewed
one sends every token to an expert of rank 0 (t % (E/ep)). Skewed, rank 0 computes ep x the balanced rows and
every other rank waits for it in the combine all-to-all, so the step takes about as long as the busiest rank's
work: up to ep x the balanced step when expert compute dominates. Timings: [perf] lines, medians over --steps.
Lesson 20 reports the busiest rank's rows over the mean; this is the benchmark that is not its point.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from common.expert_parallel.moe import ExpertParallelMoE, MoE
from common.harness.env import LessonError
from common.harness.grid import Grid
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed


class FixedRouter(nn.Module):
    """Logits that pick expert `pick[t]` for token t (and are differentiable in nothing: a fixed routing)."""

    def __init__(self, pick: torch.Tensor, experts: int):
        super().__init__()
        self.register_buffer("logits", 10.0 * nn.functional.one_hot(pick, experts).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits + 0 * x[:, :1]  # (N, E)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=4, help="E, divisible by the number of processes")
    p.add_argument(
        "--hidden", type=int, default=256, help="H; each expert is H -> 4H -> H (default 256)"
    )
    p.add_argument("--tokens", type=int, default=4096, help="N, tokens per rank (default 4096)")
    p.add_argument("--steps", type=int, default=5, help="timed forward + backward steps per router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None)
    add_distributed_args(p)
    args = p.parse_args(argv)
    if min(args.experts, args.hidden, args.tokens, args.steps) < 1:
        raise LessonError("--experts, --hidden, --tokens and --steps must be >= 1")
    return args


def step_time(layer: ExpertParallelMoE, x: torch.Tensor, steps: int) -> float:
    """Median seconds of one forward + backward, every rank finished (the all-to-alls make them wait)."""
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        layer(x.requires_grad_()).square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        report = Report(info)
        grid = Grid(info, ep=info.world_size)
        ep = grid.size("ep")
        if args.experts % ep:
            raise LessonError(f"--experts {args.experts} must be divisible by the {ep} processes")
        set_seed(args.seed)
        full = MoE(
            args.hidden, args.experts, k=1, capacity_factor=float(args.experts), ffn=4 * args.hidden
        )
        layer = ExpertParallelMoE(full, grid.coords["ep"], ep, grid.group("ep") if ep > 1 else None)
        x = torch.randn(args.tokens, args.hidden)
        t = torch.arange(args.tokens)
        times = {}
        for name, pick in (("balanced", t % args.experts), ("skewed", t % (args.experts // ep))):
            layer.router = FixedRouter(pick, args.experts)
            times[name] = step_time(layer, x, args.steps)
            rows = layer.stats["recv"].sum().item()
            report.perf(
                f"{name}_s",
                times[name],
                "{router} router: rank 0's experts got {rows} rows; "
                "forward + backward {value:.4f} s (median of {steps})",
                router=name,
                rows=rows,
                steps=args.steps,
            )
        report.perf(
            "skewed_over_balanced",
            times["skewed"] / times["balanced"],
            "skewed / balanced step time: {value:.2f} (ep = {ep}: at most about {ep} when expert "
            "compute dominates)",
            ep=ep,
        )
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
