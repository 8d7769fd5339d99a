"""Lesson 21: planning -- will it fit, and how fast? A cost model of memory, compute and communication,
checked against measurement, then used for models too big to build.

    python lessons/21_planning.py                                     # one process: bytes, FLOPs, meta
    torchrun --standalone --nproc_per_node=4 lessons/21_planning.py   # 4 ranks: + bytes sent, alpha-beta
    python lessons/21_planning.py --params 70e9 --gpus 64 --gpu-memory-gb 80     # the planner: no model built
    python lessons/21_planning.py --model 7b --gpus 8 --gpu-memory-gb 80 --network-gbps 400 --peak-tflops 989

What to look for:
1. Bytes a rank holds and sends, PREDICTED by common/planning/cost_model.py and MEASURED from tensors by
   lessons 08, 10 and 13's instruments, equal to the byte on 1, 2 and 4 ranks: DDP + Adam (parameters P,
   gradients P, DDP's buckets P: a flat copy of the gradients, Adam 2P + a 4-byte step per tensor, activations
   with and without checkpointing), ZeRO 1-3 by hand (padded) and Megatron tensor parallelism. These claims
   test a system; the ZeRO paper's numbers are its own closed form (notebook 21 evaluates them: arithmetic, no
   claim). DeepSpeed's estimator keeps an fp32 gradient partition (ZeRO-2 +2.8% at 7.5B on 64) and the largest
   layer (ZeRO-3 +56%); accelerate's `estimate-memory` prints 8 bytes per parameter for Adam in fp16, not 16.
2. FLOPs: FlopCounterMode counts exactly 6 x weights x tokens + 12 b s^2 h L (attention as matmuls).
3. The meta device: a 6.7B GPT counted from shapes, no byte allocated. `to_empty` leaves parameters AND
   buffers uninitialised; every module's `reset_parameters()` equals eager init, buffers included, for models
   whose every tensor its module's `reset_parameters()` sets (Linear, Embedding, LayerNorm, BatchNorm, Conv).
   nn.MultiheadAttention (`_reset_parameters`) and a buffer computed in `__init__` (a causal mask, RoPE
   frequencies) are not: such a model needs its own `init_weights()` that sets them all (torchtitan's way).
4. Alpha-beta fitted to this machine's gloo all-reduce ([perf] lines: a benchmark, not a claim).
5. The planner (--params or --model; common/planning/planner.py): every (dp, tp, pp, cp, ZeRO, checkpointing)
   that fits, memory, bytes sent, step time and MFU under printed assumptions; its rows held to closed forms.
   Llama 3 405B's 128K stage, tp 8 x cp 16 (across nodes), pp 16: `--params 405e9 --seq 131072 --gpus
   16384 --tp 8 --cp 16 --pp 16 --global-batch 128 --grad-bytes 4`.

Sources: ZeRO (Rajbhandari et al. 2020, arxiv.org/abs/1910.02054); Korthikanti et al. 2022 (arxiv.org/abs/
2205.05198); Narayanan et al. 2021 (arxiv.org/abs/2104.04473); DeepSpeed's deepspeed/runtime/zero/
stage_1_and_2.py and stage3.py estimators; accelerate/commands/estimate.py; pytorch.org meta tensors.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.bandwidth import ring_bytes_sent, time_calls
from common.measure.differences import max_abs_diff_all, nan_max
from common.measure.memory import saved_activation_bytes
from common.models import DigitsCNN, ResidualMLP
from common.planning.assumptions import NAMED, Assumptions, PlanError
from common.planning.cli import add_planner_args, bytes_table, planner_inputs, report_plan
from common.planning.closed_forms import closed_forms
from common.planning.cost_model import (
    GPT,
    digits_transformer_tp_bytes,
    gpt_params,
    residual_mlp_layout_bytes,
    transformer_layer_activations,
)
from common.planning.measured import gap_over_ranks, measure_layouts, measure_tensor_parallel
from common.planning.step_time import fit_alpha_beta, gpt_flops, mfu, residual_mlp_flops, ring_time
from common.planning.transformer import (
    counted_flops,
    gpt,
    matmul_attention,
    saved_bytes_from_shapes,
)
from common.sharding.zero import check_world_size, flat_units
from common.tensor_parallel.layers import digits_transformer, tensor_parallelize

SMALL_GPT = GPT(layers=2, hidden=32, heads=4, vocab=17, seq=16)  # runs in milliseconds
BIG_GPT = GPT(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048)  # 6.7e9 params, meta only
HEADING = (
    "1. bytes per rank, PREDICTED by common/planning/cost_model.py (fp32, Adam;\n"
    "   gradients at the end of backward; sent: ring model per step; act_ckpt: with checkpointing)"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--width", type=int, default=33, help="ResidualMLP width (33: units N does not divide)"
    )
    p.add_argument("--depth", type=int, default=2, help="residual blocks (default 2)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="samples per rank per step (default 16); with the planner, sequences (default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    add_distributed_args(p)
    add_planner_args(p)
    args = p.parse_args(argv)
    if args.micro_batch is not None and args.micro_batch < 1:
        raise LessonError("--micro-batch must be positive")
    if args.params is not None or args.model is not None:
        try:
            args.plan = planner_inputs(args)
        except PlanError as e:
            raise LessonError(str(e)) from None
        return args
    args.plan, args.micro_batch = None, args.micro_batch or 16
    if min(args.width, args.depth) < 1:
        raise LessonError("--width and --depth must be positive")
    check_world_size(
        {
            n: sum(p.numel() for p in u.parameters())
            for n, u in flat_units(ResidualMLP(args.width, args.depth))
        },
        read_torchrun_env()[2],
    )
    return args


@dataclass
class Run:
    """What the sections share: the options, the world, the report, and the world's process group (dp for
    section 1's layouts, tp for lesson 10's split transformer; None in one process)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    group: object


# ---------------------------------------------------------------- 1. predicted bytes vs measured bytes
def bytes_predicted_vs_measured(run: Run) -> None:
    """Section 1: lessons 08 and 13's instruments (common/planning/measured.py) against the cost model."""
    N, B, w, d = run.info.world_size, run.args.micro_batch, run.args.width, run.args.depth
    g = torch.Generator().manual_seed(run.args.seed + run.info.rank)
    x = torch.randn(B, 64, generator=g).to(run.info.device)  # (B, 64): this rank's micro-batch
    y = torch.randint(0, 10, (B,), generator=g).to(run.info.device)
    # DDP, then ZeRO-1, 2, 3
    measured = measure_layouts(w, d, run.args.seed, x, y, run.group, run.info)
    predicted = residual_mlp_layout_bytes(w, d, B, N)  # the same rows, from the cost model
    numels = [sum(p.numel() for p in u.parameters()) for _, u in flat_units(ResidualMLP(w, d))]
    run.report.value(
        "n_params",
        sum(numels),
        "world_size {n}, ResidualMLP width {w} depth {d}: {value} parameters in units {numels}; "
        "micro-batch {b} per rank",
        n=N,
        w=w,
        d=d,
        numels=numels,
        b=B,
    )
    run.report.value(
        "predicted_bytes",
        predicted,
        "{heading}\n{table}",
        heading=HEADING,
        table=bytes_table(predicted),
    )
    run.report.record("measured_bytes", measured)
    for name in predicted:
        run.report.claim(
            f"{name.lower().replace('-', '')}_bytes_predicted_exactly",
            gap_over_ranks(measured[name], predicted[name], run.info.distributed),
            "==",
            0,
            "  {layout}: lesson {lesson}'s instruments on every rank, "
            "sum of |measured - predicted| = {value:.0f} bytes",
            layout=name,
            lesson="08" if name == "DDP" else "13",
        )
    tensor_parallel_bytes(run)  # the same world group, used as tp


def tensor_parallel_bytes(run: Run) -> None:
    """Lesson 10's split transformer (by hand): the parameter bytes a tp rank holds, its all-reduces."""
    N, H, heads, layers, B = run.info.world_size, 32, 8, 2, 4  # tp = the world size
    if heads % N:
        print0(f"  tensor parallel: {heads} heads do not split over {N} ranks; no tp row here")
        return
    set_seed(run.args.seed)
    full = digits_transformer(H, heads, layers).to(run.info.device)
    # this rank's shards; the rest whole
    split = tensor_parallelize(full, run.info.rank, N, run.group)
    x = torch.randn(B, 8, 8).to(run.info.device)  # (B, S, 8): 8 rows of 8 pixels per digit
    measured = measure_tensor_parallel(split, x)
    predicted = digits_transformer_tp_bytes(H, layers, N, tokens=B * 8)
    run.report.value(
        "tp_predicted",
        predicted,
        "  tensor parallel, lesson 10's model (hidden {h}, {heads} heads, {layers} layers) at tp = {tp}:"
        "\n    predicted {value[parameters]} parameter bytes, {value[all_reduce_calls]} all-reduces "
        "of {value[all_reduce_bytes]} bytes in all",
        h=H,
        heads=heads,
        layers=layers,
        tp=N,
    )
    run.report.claim(
        "tp_bytes_predicted_exactly",
        gap_over_ranks(measured, predicted, run.info.distributed),
        "==",
        0,
        "  tensor parallel: lesson 10's instruments on every rank, "
        "sum of |measured - predicted| = {value:.0f}",
    )


# ---------------------------------------------------------------- 2. FLOPs
def matmul_rate(info, n: int = 256, reps: int = 20) -> float:
    a, b = torch.randn(n, n, device=info.device), torch.randn(n, n, device=info.device)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def flops(run: Run) -> None:
    """Section 2: FlopCounterMode against 6 x weights x tokens + 12 b s^2 h L, and lesson 08's ResidualMLP."""
    c, batch = SMALL_GPT, 4
    set_seed(run.args.seed)
    model = gpt(c).to(run.info.device)
    tokens = torch.randint(0, c.vocab, (batch, c.seq), device=run.info.device)
    sdpa = counted_flops(model, tokens)  # attention by F.scaled_dot_product_attention, the default
    model.set_attention(matmul_attention)  # the same attention written as Q K^T, softmax, A V
    f, counted = gpt_flops(c, batch), counted_flops(model, tokens)
    print0(f"\n2. FLOPs of one step of the shared GPT {c}, batch {batch}")
    run.report.claim(
        "gpt_flops_equal_counter",
        abs(counted - f["total"]),
        "==",
        0,
        "  FlopCounterMode {counted}, 6 x {weights} weights x {tokens} tokens + 12 b s^2 h L "
        "= {total}: |difference| {value}",
        counted=counted,
        weights=f["weights"] // (6 * batch * c.seq),
        tokens=batch * c.seq,
        total=f["total"],
    )
    run.report.value(
        "sdpa_flops_counted",
        sdpa,
        "  with F.scaled_dot_product_attention on {device} the counter sees {value} "
        "(attention's {attention} included: {included})",
        device=run.info.device.type,
        attention=f["attention"],
        included=sdpa == f["total"],
    )
    mlp = ResidualMLP(run.args.width, run.args.depth).to(run.info.device)
    with FlopCounterMode(display=False) as counter:
        mlp(torch.randn(run.args.micro_batch, 64, device=run.info.device)).sum().backward()
    formula = residual_mlp_flops(run.args.micro_batch, run.args.width, run.args.depth)
    run.report.claim(
        "mlp_flops_equal_counter",
        abs(counter.get_total_flops() - formula),
        "==",
        0,
        "  lesson 08's ResidualMLP: 6 x weights x samples - the stem's input gradient, "
        "|difference| {value}",
    )
    peak = matmul_rate(run.info)
    t = time.perf_counter()
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    step = time.perf_counter() - t
    run.report.perf(
        "cpu_matmul_flops",
        peak,
        "this device's 256x256 matmul rate (the 'peak'): {value:.3g} FLOP/s",
    )
    mfu_small = mfu(f["total"], step, 1, peak)
    run.report.perf(
        "small_gpt_mfu", mfu_small, "small GPT step MFU = FLOPs / (step time x peak) = {value:.1%}"
    )


# ---------------------------------------------------------------- 3. the meta device
def meta_device(run: Run) -> None:
    """Section 3: a model counted from shapes alone, built on `meta`, and materialised like eager init."""
    print0("\n3. the meta device: shapes without memory")
    c, batch = SMALL_GPT, 4
    set_seed(run.args.seed)
    small = gpt(c)
    tokens = torch.randint(0, c.vocab, (batch, c.seq))
    measured = saved_activation_bytes(small, lambda: small(tokens))
    run.report.claim(
        "shape_count_equals_measured_activations",
        abs(saved_bytes_from_shapes(small, lambda: small(tokens)) - measured),
        "==",
        0,
        "  small GPT, batch {batch}: saved activations from shapes vs measured ({measured} bytes): "
        "|difference| {value}",
        batch=batch,
        measured=measured,
    )
    with torch.device("meta"):
        big = gpt(BIG_GPT)
        big_tokens = torch.zeros(1, BIG_GPT.seq, dtype=torch.long)
    counted = sum(p.numel() for p in big.parameters())
    print0(f"  {BIG_GPT} on {next(big.parameters()).device}: 0 bytes allocated")
    run.report.claim(
        "meta_params_equal_formula",
        abs(counted - gpt_params(BIG_GPT)["total"]),
        "==",
        0,
        "  {counted} parameters in the module tree, formula {formula}: |difference| {value}",
        counted=counted,
        formula=gpt_params(BIG_GPT)["total"],
    )
    per_layer = saved_bytes_from_shapes(big.blocks[0], lambda: big.blocks[0](big.tok(big_tokens)))
    korthikanti = transformer_layer_activations(BIG_GPT.seq, 1, BIG_GPT.hidden, BIG_GPT.heads)
    run.report.value(
        "big_layer_activation_bytes",
        per_layer,
        "  one layer's saved activations at batch 1, from the shapes: {value} bytes (fp32, no dropout)"
        "\n  Korthikanti's 16-bit layer with dropout, s b h (34 + 5 a s / h): {k:.0f} bytes",
        k=korthikanti,
    )
    run.report.claim(
        "meta_init_equals_eager",
        meta_init_gap(materialise, run.info.device, run.args.seed),
        "==",
        0.0,
        "  meta -> to_empty -> reset_parameters() vs eager, parameters and buffers: "
        "max |difference| {value}",
    )


def materialise(model: torch.nn.Module, device, seed: int) -> torch.nn.Module:
    """The recipe to copy for a model built on `meta`: `to_empty` (parameters AND buffers, uninitialised),
    then every module's own `reset_parameters()` in module order (BatchNorm's resets its statistics)."""
    model.to_empty(device=device)
    torch.manual_seed(seed)  # the draws of eager init at this seed, replayed in the same order
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def every_tensor(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and ALL buffers by name, the non-persistent ones too (a state_dict leaves those out)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def meta_init_gap(recipe, device, seed: int) -> float:
    """max |difference| of every parameter and buffer, meta + `recipe` vs eager at `seed`, for the small GPT
    and lesson 01's CNN (whose BatchNorm buffers a parameters-only init leaves garbage)."""
    gaps = []
    for make in (lambda: gpt(SMALL_GPT), DigitsCNN):
        torch.manual_seed(seed)
        eager = every_tensor(make().to(device))
        with torch.device("meta"):
            model = make()
        lazy = every_tensor(recipe(model, device, seed))
        gaps.append(max_abs_diff_all(eager.values(), [lazy[k] for k in eager]))
    return nan_max(gaps)


# ---------------------------------------------------------------- 4. alpha-beta on this machine's gloo
def alpha_beta(run: Run) -> None:
    """Section 4: the ring's alpha-beta model fitted to this machine's all-reduce (a benchmark: [perf])."""
    N = run.info.world_size
    if N == 1:
        print0("\n4. alpha-beta: one process sends nothing (torchrun, 2+ processes, measures gloo)")
        return
    sizes = [2**k for k in range(8, 21, 3)]  # fp32 elements: 1 KiB .. 4 MiB
    seconds = []
    for n in sizes:
        buf = torch.ones(n, device=run.info.device)
        # the median call, each the slowest rank's: this CPU is shared, single calls stall now and then
        times = time_calls(lambda: dist.all_reduce(buf), 7, 1, run.info.device, distributed=True)
        seconds.append(statistics.median(times))
    steps = [2 * (N - 1)] * len(sizes)
    sent = [ring_bytes_sent("all_reduce", 4 * n, N) for n in sizes]  # 2 B (N-1)/N
    alpha, beta = fit_alpha_beta(steps, sent, seconds)
    print0(
        f"\n4. alpha-beta: all-reduce on {N} gloo ranks, time = 2 (N-1) alpha + 2 B (N-1)/N beta"
    )
    run.report.perf(
        "alpha_beta",
        {"alpha_s": alpha, "beta_s_per_byte": beta},
        "fitted alpha {us:.1f} us, beta {ns:.3f} ns/byte ({gbs:.2f} GB/s)",
        us=alpha * 1e6,
        ns=beta * 1e9,
        gbs=1 / beta / 1e9 if beta > 0 else float("inf"),
    )
    for n, s in zip(sizes, seconds):
        run.report.perf(
            f"allreduce_{4 * n}_bytes",
            s,
            "all-reduce {nbytes:>8} bytes: measured {us:.0f} us, predicted {predicted:.0f} us",
            nbytes=4 * n,
            us=s * 1e6,
            predicted=ring_time("all_reduce", 4 * n, N, alpha, beta) * 1e6,
        )


# ---------------------------------------------------------------- 5. the planner
def planner_closed_forms(report: Report) -> None:
    """Section 5: the planner's rows (common/planning/planner.py) against closed forms, a 7b-shaped GPT."""
    c, a = NAMED["7b"], Assumptions(gpus=8, global_batch=64)
    m = a.global_batch // a.gpus
    print0(
        f"\n5. the planner's rows vs closed forms (7b-shaped, 8 GPUs, m = {m}; ring: 2 Psi (N-1)/N B)"
    )
    for name, (got, want, says) in closed_forms(c, a).items():
        report.claim(
            name,
            abs(got / want - 1),
            "<=",
            1e-12,
            "  {says}: {got:.6g} vs {want:.6g}, |ratio - 1| {value:.0e}",
            says=says,
            got=got,
            want=want,
        )


def planner(args) -> None:
    """Formulas only: every configuration for the model on the GPUs, the fastest that fit first."""
    try:
        report_plan(*args.plan, args.top, args.results, master=read_torchrun_env()[0] == 0)
    except PlanError as e:
        raise LessonError(str(e)) from None


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plan is not None:
        planner(args)
        return
    with distributed_session(args) as info:
        group = Grid(info, dp=info.world_size).group("dp")  # one process: no group
        run = Run(args, info, Report(info), group)
        run.report.record("world_size", info.world_size)
        bytes_predicted_vs_measured(run)  # 1. bytes held and sent
        flops(run)  # 2. FLOPs
        meta_device(run)  # 3. the meta device
        alpha_beta(run)  # 4. alpha-beta on this machine
        planner_closed_forms(run.report)  # 5. the planner's rows
        run.report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
