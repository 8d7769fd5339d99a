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
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.flop_counter import FlopCounterMode

from common.harness.env import LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import CommCounter, count_collectives
from common.measure.differences import max_abs_diff_all, nan_max
from common.measure.memory import ResidualMLP, saved_activation_bytes, storage_bytes
from common.models import CausalTransformer, DigitsCNN
from common.planning.cost_model import (
    GPT,
    fit_alpha_beta,
    gpt_flops,
    gpt_params,
    mfu,
    residual_mlp_activations,
    residual_mlp_flops,
    ring_bytes_sent,
    ring_time,
    sharded_fp32_bytes,
    tp_all_reduces,
    tp_layer_params,
    transformer_layer_activations,
)
from common.planning.planner import (
    NAMED,
    Assumptions,
    PlanError,
    add_planner_args,
    evaluate_layout,
    planner_inputs,
    report_plan,
)
from common.planning.transformer import matmul_attention, saved_bytes_from_shapes
from common.sharding.accounting import held_bytes, moved_bytes
from common.sharding.zero import ZeRO, check_world_size
from common.tensor_parallel.layers import digits_transformer, tensor_parallelize

SMALL_GPT = GPT(layers=2, hidden=32, heads=4, vocab=17, seq=16)  # runs in milliseconds
BIG_GPT = GPT(
    layers=32, hidden=4096, heads=32, vocab=32000, seq=2048
)  # 6.7e9 parameters, on meta only
ROWS = ("parameters", "gradients", "ddp_buckets", "optimizer_state", "sent")


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
            for n, u in units(ResidualMLP(args.width, args.depth))
        },
        read_torchrun_env()[2],
    )
    return args


def units(model: ResidualMLP) -> list:
    """(name, module) of lesson 13's flat units: the stem, each residual block, the head."""
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    return [("stem", model.stem), *blocks, ("head", model.head)]


def gap_over_ranks(measured: dict, predicted: dict, info) -> float:
    """Sum over ranks and rows of |measured - predicted|: 0 only if every rank's every row is equal.
    NaN or inf anywhere stays NaN or inf (an equality claim on it fails)."""
    t = torch.tensor(
        [abs(float(measured[k]) - float(predicted[k])) for k in predicted], dtype=torch.float64
    )
    if info.distributed:
        dist.all_reduce(t)
    return t.sum().item()


def table(rows: dict) -> str:
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (c not in ROWS, c))
    head = f"  {'':<22}" + "".join(f"{c[:18]:>19}" for c in cols)
    lines = [
        f"  {k:<22}" + "".join(f"{r[c]:>19.0f}" if c in r else f"{'-':>19}" for c in cols)
        for k, r in rows.items()
    ]
    return "\n".join([head, *lines])


# ---------------------------------------------------------------- 1. predicted bytes vs measured bytes
def measure_ddp(args, info, x, y) -> dict:
    """Lesson 08's instruments: one DDP + Adam step, then the storages a rank holds, DDP's bucket bytes, and
    the saved activations of one forward (plain and checkpointed)."""
    set_seed(args.seed)
    raw = ResidualMLP(args.width, args.depth).to(info.device)
    model = DDP(raw) if info.distributed else raw
    counter = CommCounter().register(model) if info.distributed else CommCounter()
    F.cross_entropy(
        model(x), y
    ).backward()  # warm-up: DDP builds its final buckets after iteration 1
    raw.zero_grad(set_to_none=True)
    opt = torch.optim.Adam(raw.parameters(), lr=1e-3)
    counter.reset()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    held = held_bytes(list(raw.parameters()), [p.grad for p in raw.parameters()], opt)
    held["sent"] = moved_bytes({"all_reduce": counter.bytes}, info.world_size)
    held["ddp_buckets"] = (
        counter.bytes
    )  # the flat buffers its hook all-reduced: a copy of the gradients
    for ck in (False, True):
        raw.checkpointing = ck
        held[f"activations{'_checkpointed' if ck else ''}"] = saved_activation_bytes(
            raw, lambda: raw(x)
        )
    raw.checkpointing = False
    return held


def measure_zero(stage: int, args, info, group, x, y) -> dict:
    """Lesson 13's instruments: one step of ZeRO by hand; gradients held at the end of backward, parameters
    (flat buffers and shards, each storage once) and Adam state after the step, collective buffers counted."""
    set_seed(args.seed)
    m = ResidualMLP(args.width, args.depth).to(info.device)
    zero = ZeRO(m, [u for _, u in units(m)], stage, group=group, lr=1e-3)
    with count_collectives() as c:
        F.cross_entropy(m(x), y).backward()
        grads = held_bytes(
            [],
            [p.grad for p in m.parameters()] + [u.shard.grad for u in zero.units],
            zero.optimizer,
        )["gradients"]
        zero.step()
    held = held_bytes([*m.parameters(), *(u.shard for u in zero.units)], [], zero.optimizer)
    return {**held, "gradients": grads, "sent": moved_bytes(c.bytes, info.world_size)}


def bytes_predicted_vs_measured(args, info, report: Report) -> None:
    N, B, w, d = info.world_size, args.micro_batch, args.width, args.depth
    g = torch.Generator().manual_seed(args.seed + info.rank)
    x = torch.randn(B, 64, generator=g).to(info.device)  # (B, 64): this rank's micro-batch
    y = torch.randint(0, 10, (B,), generator=g).to(info.device)
    plain = ResidualMLP(w, d)
    numels = [sum(p.numel() for p in u.parameters()) for _, u in units(plain)]
    tensors = len(list(plain.parameters()))
    measured, predicted = {"DDP": measure_ddp(args, info, x, y)}, {}
    predicted["DDP"] = {
        **sharded_fp32_bytes(numels, tensors, N, 0),
        "activations": residual_mlp_activations(B, w, d),
        "activations_checkpointed": residual_mlp_activations(B, w, d, checkpointing=True),
    }
    grid = Grid(info, dp=N)
    for stage in (1, 2, 3):
        measured[f"ZeRO-{stage}"] = measure_zero(stage, args, info, grid.group("dp"), x, y)
        predicted[f"ZeRO-{stage}"] = sharded_fp32_bytes(numels, tensors, N, stage)
    report.value(
        "n_params",
        sum(numels),
        f"world_size {N}, ResidualMLP width {w} depth {d}: {{value}} "
        f"parameters in units {numels}; micro-batch {B} per rank",
    )
    heading = (
        "1. bytes per rank, PREDICTED by common/planning/cost_model.py "
        "(fp32, Adam; gradients at the end of backward; sent: ring model per step)"
    )
    report.value("predicted_bytes", predicted, heading + "\n" + table(predicted))
    report.record("measured_bytes", measured)
    for name in predicted:
        report.claim(
            f"{name.lower().replace('-', '')}_bytes_predicted_exactly",
            gap_over_ranks(measured[name], predicted[name], info),
            "==",
            0,
            f"  {name}: measured by lesson {'08' if name == 'DDP' else '13'}'s instruments on every "
            "rank, sum of |measured - predicted| = {value:.0f} bytes",
        )
    tensor_parallel_bytes(args, info, grid.group("dp"), report)  # the same world group, used as tp


def tensor_parallel_bytes(args, info, group, report: Report) -> None:
    """Lesson 10's split transformer (by hand): the parameter bytes a tp rank holds, its all-reduces."""
    N, H, heads, layers, B = info.world_size, 32, 8, 2, 4  # tp = the world size
    if heads % N:
        print0(
            f"  tensor parallel: {heads} heads do not split over {N} ranks; no tp row at this world size"
        )
        return
    set_seed(args.seed)
    full = digits_transformer(H, heads, layers).to(info.device)
    split = tensor_parallelize(
        full, info.rank, N, group
    )  # this rank's shards; norms, embedding, head whole
    x = torch.randn(B, 8, 8).to(info.device)  # (B, S, 8): 8 rows of 8 pixels per digit
    with count_collectives() as c:
        split(x).square().mean().backward()
    measured = {
        "parameters": storage_bytes(split.parameters()),
        "all_reduce_calls": c.calls.get("all_reduce", 0),
        "all_reduce_bytes": c.bytes.get("all_reduce", 0),
    }
    ar = tp_all_reduces(layers, N, B * 8, H)
    # embedding Linear(8, H) and head Linear(H, 10) whole on every rank; each layer split as Megatron does
    params = 8 * H + H + layers * tp_layer_params(H, N) + 10 * H + 10
    predicted = {
        "parameters": 4 * params,
        "all_reduce_calls": ar["calls"],
        "all_reduce_bytes": ar["bytes"],
    }
    report.value(
        "tp_predicted",
        predicted,
        f"  tensor parallel, lesson 10's model (hidden {H}, {heads} "
        f"heads, {layers} layers) at tp = {N}, predicted: {{value}}",
    )
    report.claim(
        "tp_bytes_predicted_exactly",
        gap_over_ranks(measured, predicted, info),
        "==",
        0,
        "  tensor parallel: measured by lesson 10's instruments (storages, collectives counted) on "
        "every rank, sum of |measured - predicted| = {value:.0f}",
    )


# ---------------------------------------------------------------- 2. FLOPs
def matmul_rate(info, n: int = 256, reps: int = 20) -> float:
    a, b = torch.randn(n, n, device=info.device), torch.randn(n, n, device=info.device)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def gpt(c: GPT) -> CausalTransformer:
    """The shared GPT of lessons 19-21 (common/models.py) in the shape `c` describes."""
    return CausalTransformer(
        vocab=c.vocab, d_model=c.hidden, heads=c.heads, n_layers=c.layers, max_len=c.seq
    )


def counted_flops(model, tokens) -> int:
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


def flops(args, info, report: Report) -> None:
    c, batch = SMALL_GPT, 4
    set_seed(args.seed)
    model = gpt(c).to(info.device)
    tokens = torch.randint(0, c.vocab, (batch, c.seq), device=info.device)
    sdpa = counted_flops(
        model, tokens
    )  # attention by F.scaled_dot_product_attention, the model's default
    model.set_attention(matmul_attention)  # the same attention written as Q K^T, softmax, A V
    f, counted = gpt_flops(c, batch), counted_flops(model, tokens)
    report.claim(
        "gpt_flops_equal_counter",
        abs(counted - f["total"]),
        "==",
        0,
        f"\n2. FLOPs of one step of the shared GPT {c}: FlopCounterMode {counted}, "
        f"6 x {f['weights'] // (6 * batch * c.seq)} weights x {batch * c.seq} tokens + 12 b s^2 h L"
        f" = {f['total']}: |difference| {{value}}",
    )
    report.value(
        "sdpa_flops_counted",
        sdpa,
        f"  with F.scaled_dot_product_attention on {info.device.type} "
        f"the counter sees {{value}} (attention's {f['attention']} included: {sdpa == f['total']})",
    )
    mlp = ResidualMLP(args.width, args.depth).to(info.device)
    with FlopCounterMode(display=False) as counter:
        mlp(torch.randn(args.micro_batch, 64, device=info.device)).sum().backward()
    formula = residual_mlp_flops(args.micro_batch, args.width, args.depth)
    report.claim(
        "mlp_flops_equal_counter",
        abs(counter.get_total_flops() - formula),
        "==",
        0,
        "  lesson 08's ResidualMLP: 6 x weights x samples - the stem's input gradient, "
        "|difference| {value}",
    )
    peak = matmul_rate(info)
    t = time.perf_counter()
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    step = time.perf_counter() - t
    report.perf(
        "cpu_matmul_flops",
        peak,
        "this device's 256x256 matmul rate (the 'peak'): {value:.3g} FLOP/s",
    )
    report.perf(
        "small_gpt_mfu",
        mfu(f["total"], step, 1, peak),
        "small GPT step MFU = FLOPs / (step time x peak) = {value:.1%}",
    )


# ---------------------------------------------------------------- 3. the meta device
def meta_device(args, info, report: Report) -> None:
    print0("\n3. the meta device: shapes without memory")
    c, batch = SMALL_GPT, 4
    set_seed(args.seed)
    small = gpt(c)
    tokens = torch.randint(0, c.vocab, (batch, c.seq))
    measured = saved_activation_bytes(small, lambda: small(tokens))
    report.claim(
        "shape_count_equals_measured_activations",
        abs(saved_bytes_from_shapes(small, lambda: small(tokens)) - measured),
        "==",
        0,
        f"  small GPT, batch {batch}: saved activations counted from shapes vs measured storages "
        f"({measured} bytes): |difference| {{value}}",
    )
    with torch.device("meta"):
        big = gpt(BIG_GPT)
        big_tokens = torch.zeros(1, BIG_GPT.seq, dtype=torch.long)
    counted = sum(p.numel() for p in big.parameters())
    report.claim(
        "meta_params_equal_formula",
        abs(counted - gpt_params(BIG_GPT)["total"]),
        "==",
        0,
        f"  {BIG_GPT}: {counted} parameters in the module tree, 0 bytes allocated "
        f"(device {next(big.parameters()).device}); formula {gpt_params(BIG_GPT)['total']}: "
        "|difference| {value}",
    )
    per_layer = saved_bytes_from_shapes(big.blocks[0], lambda: big.blocks[0](big.tok(big_tokens)))
    korthikanti = transformer_layer_activations(BIG_GPT.seq, 1, BIG_GPT.hidden, BIG_GPT.heads)
    report.value(
        "big_layer_activation_bytes",
        per_layer,
        "  one layer's saved activations at batch 1, "
        "counted from the shapes: {value} bytes in fp32 without dropout (Korthikanti's 16-bit "
        f"layer with dropout, s b h (34 + 5 a s / h): {korthikanti:.0f} bytes)",
    )
    report.claim(
        "meta_init_equals_eager",
        meta_init_gap(materialise, info.device, args.seed),
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
def alpha_beta(info, report: Report) -> None:
    N = info.world_size
    if N == 1:
        print0("\n4. alpha-beta: one process sends nothing (torchrun, 2+ processes, measures gloo)")
        return
    sizes = [2**k for k in range(8, 21, 3)]  # fp32 elements: 1 KiB .. 4 MiB
    seconds = []
    for n in sizes:
        buf = torch.ones(n, device=info.device)
        dist.all_reduce(buf)  # warm-up
        times = []
        for _ in range(7):  # the median call: this CPU is shared, single calls stall now and then
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t)
        took = torch.tensor([sorted(times)[3]], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
        seconds.append(took.item())
    steps = [2 * (N - 1)] * len(sizes)
    sent = [ring_bytes_sent("all_reduce", 4 * n, N) for n in sizes]
    alpha, beta = fit_alpha_beta(steps, sent, seconds)
    print0(
        f"\n4. alpha-beta: all-reduce on {N} gloo ranks, time = 2 (N-1) alpha + 2 B (N-1)/N beta"
    )
    report.perf(
        "alpha_beta",
        {"alpha_s": alpha, "beta_s_per_byte": beta},
        f"fitted alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/byte "
        f"({1 / beta / 1e9 if beta > 0 else float('inf'):.2f} GB/s)",
    )
    for n, s in zip(sizes, seconds):
        report.perf(
            f"allreduce_{4 * n}_bytes",
            s,
            f"all-reduce {4 * n:>8} bytes: measured {s * 1e6:.0f} us, "
            f"predicted {ring_time('all_reduce', 4 * n, N, alpha, beta) * 1e6:.0f} us",
        )


# ---------------------------------------------------------------- 5. the planner
def planner_closed_forms(report: Report) -> None:
    """The planner's rows (common/planning/planner.py) against closed forms written out here: a 7b-shaped GPT
    on 8 GPUs, tp = pp = 1 (a rank holds all Psi parameters), micro-batch 1, flash attention (34 s b h a
    layer)."""
    c, a = NAMED["7b"], Assumptions(gpus=8, global_batch=64)
    psi, L, sbh, m = (
        gpt_params(c)["total"],
        c.layers,
        c.seq * c.hidden,
        64 // 8,
    )  # m: micro-batches per step
    # cp2: ZeRO-3 at dp 4 x cp 2
    ddp, ckpt, zero2, zero3, cp2 = (
        evaluate_layout(c, a, dp, 1, 1, cp, zero, ck)
        for dp, cp, zero, ck in (
            (8, 1, 0, 0),
            (8, 1, 0, 1),
            (8, 1, 2, 0),
            (8, 1, 3, 0),
            (4, 2, 3, 0),
        )
    )
    ring = (
        2 * psi * 7 / 8
    )  # bytes one of 8 ranks sends in an all-gather or reduce-scatter of the bf16 model
    compute = gpt_flops(c, a.global_batch)["total"] / (a.gpus * a.peak_tflops * 1e12 * a.efficiency)
    checks = {  # name: (the planner's number, the closed form, what it says)
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
            zero2["sent"]["dp"],
            (m + 1) * ring,
            "ZeRO-2 sends (m + 1) ring",
        ),
        "planner_zero3_per_micro_batch": (
            zero3["sent"]["dp"],
            3 * m * ring,
            "ZeRO-3 sends 3 m ring",
        ),
        "planner_ckpt_adds_a_forward": (
            ckpt["step_s"] - ddp["step_s"],
            compute / 3,
            "ckpt: + a forward, s",
        ),
    }
    print0(
        f"\n5. the planner's rows vs closed forms (7b-shaped, 8 GPUs, m = {m}; ring: 2 Psi (N-1)/N B)"
    )
    for name, (got, want, text) in checks.items():
        report.claim(
            name,
            abs(got / want - 1),
            "<=",
            1e-12,
            f"  {text}: {got:.6g} vs {want:.6g}, |ratio - 1| {{value:.0e}}",
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
        report = Report(info)
        report.results.update(world_size=info.world_size)
        bytes_predicted_vs_measured(args, info, report)
        flops(args, info, report)
        meta_device(args, info, report)
        alpha_beta(info, report)
        planner_closed_forms(report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
