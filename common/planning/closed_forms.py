"""The planner's rows written out as closed forms, apart from its code (lesson 21 claims they agree).

A 7b-shaped GPT on 8 GPUs, tp = pp = 1 (a rank holds all Psi parameters), micro-batch 1, flash attention: DDP
holds 18 Psi (2 + 2 + 12 bytes of mixed-precision Adam, + 2 for DDP's bucket copy of bf16 gradients) + L x 34 s b h
of activations (Korthikanti et al. 2022 with sequence parallelism at tp = 1); full checkpointing keeps (2 L + 34)
s b h; ZeRO-3 over dp x cp = 8 ranks 16 Psi / 8; per step of m micro-batches DDP sends 2 ring, ZeRO-2 (m + 1)
ring, ZeRO-3 3 m ring, with ring = 2 Psi (N-1)/N the bytes an all-gather or reduce-scatter of the bf16 model
sends per rank; checkpointing adds a forward, a third of a step's compute.
"""

from __future__ import annotations

from common.planning.assumptions import Assumptions
from common.planning.cost_model import GPT, gpt_params
from common.planning.planner import evaluate_layout
from common.planning.step_time import gpt_flops

__all__ = ["closed_forms"]


def closed_forms(c: GPT, a: Assumptions) -> dict:
    """{claim name: (the planner's number, the closed form written out here, what it says)} for `c` on
    `a.gpus` = 8 GPUs, tp = pp = 1 (a rank holds all Psi parameters), micro-batch 1, flash attention (34 s b h
    a layer); ring = the bytes one of 8 ranks sends in an all-gather or reduce-scatter of the bf16 model."""
    psi, L, sbh = gpt_params(c)["total"], c.layers, c.seq * c.hidden
    m = a.global_batch // a.gpus  # micro-batches per step
    layouts = {  # (dp, cp, ZeRO stage, checkpointing); cp2: ZeRO-3 at dp 4 x cp 2
        "ddp": (8, 1, 0, False),
        "ckpt": (8, 1, 0, True),
        "zero2": (8, 1, 2, False),
        "zero3": (8, 1, 3, False),
        "cp2": (4, 2, 3, False),
    }
    row = {k: evaluate_layout(c, a, dp, 1, 1, cp, z, ck) for k, (dp, cp, z, ck) in layouts.items()}
    ring = 2 * psi * 7 / 8
    compute = gpt_flops(c, a.global_batch)["total"] / (a.gpus * a.peak_tflops * 1e12 * a.efficiency)
    ddp, ckpt, cp2 = row["ddp"], row["ckpt"], row["cp2"]
    return {
        "planner_ddp_memory": (
            ddp["memory"]["total"],
            18 * psi + 34 * L * sbh,
            "DDP: 18 Psi + L x 34 s b h",
        ),
        "planner_ckpt_activations": (
            ckpt["memory"]["activations"],
            (2 * L + 34) * sbh,
            "(2 L + 34) s b h",
        ),
        "planner_zero3_over_dp_x_cp": (
            cp2["memory"]["total"] - cp2["memory"]["activations"],
            16 * psi / 8,
            "ZeRO-3 at dp 4 x cp 2: 16 Psi / 8",
        ),
        "planner_ddp_sends_bf16": (ddp["sent"]["dp"], 2 * ring, "DDP sends 2 ring"),
        "planner_zero2_per_micro_batch": (
            row["zero2"]["sent"]["dp"],
            (m + 1) * ring,
            "ZeRO-2 sends (m + 1) ring",
        ),
        "planner_zero3_per_micro_batch": (
            row["zero3"]["sent"]["dp"],
            3 * m * ring,
            "ZeRO-3 sends 3 m ring",
        ),
        "planner_ckpt_adds_a_forward": (
            ckpt["step_s"] - ddp["step_s"],
            compute / 3,
            "ckpt: + a forward, s",
        ),
    }
