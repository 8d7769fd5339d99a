"""Lesson 22: parallel inference -- tensor-parallel decoding with a KV cache split by heads, = one process.

Run it:

    python lessons/22_parallel_inference.py                                      # tp = 1: every head here
    torchrun --standalone --nproc_per_node=2 lessons/22_parallel_inference.py    # tp = 2
    torchrun --standalone --nproc_per_node=4 lessons/22_parallel_inference.py    # tp = 4

The model: lessons 19-21's causal transformer (common/models.py), initialised from the seed
(common.planning.transformer.init_weights), continuing the first pixels of real digits greedily.

What to look for:
- The KV cache (common/inference/kv_cache.py): a decode step computes q, k, v for the new token only and reads
  every earlier token's keys and values from the cache. Same tokens as rerunning the whole prefix every step;
  the FLOPs of both, counted by torch.utils.flop_counter, equal the formula (common.planning.step_time).
- Tensor-parallel decoding (common/inference/tp_decode.py): q, k, v and fc1 column-parallel by heads, proj
  and fc2 row-parallel. Tokens equal one process; each rank's filled cache is one process's cache at its
  heads, 1/tp of the bytes; 2 all-reduces per layer per generated token.
- Prefill vs decode: the same calls, P times the bytes in prefill; FLOPs per byte read, P times decode's
  in prefill (fp32 both): decode is memory-bound. Time per token is [perf] only.
- How much cache fits: the planner's KV-cache bytes (common/planning/serving.py) = the cache measured here;
  Llama-3-70B on 8 x 80 GB at tp 8: how many sequences of 2048 and 8192 (its context) tokens fit.
- Batch composition: four prompts alone and as the rows of one left-padded batch: tokens equal, logits
  within a bound, every row.

Sources: Pope et al. 2022, Efficiently Scaling Transformer Inference (https://arxiv.org/abs/2211.05102);
Shoeybi et al. 2019, Megatron-LM (https://arxiv.org/abs/1909.08053); vLLM's tensor-parallel layers
(vllm/model_executor/layers/linear.py); Llama 3's configuration (common/planning/serving.py names it).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from common.data import load_digits
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import all_gather_objects, all_reduce_sum
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main
from common.inference.kv_cache import KVCache, left_padded, match_heads
from common.inference.tp_decode import (
    TPDecoder,
    count_flops,
    greedy_decode,
    ms_per_token,
    phase_costs,
    recompute_decode,
)
from common.measure.counters import count_collectives
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max
from common.models import CausalTransformer
from common.planning.cost_model import GPT, kv_cache_bytes
from common.planning.serving import LLAMA3_70B, largest_batch
from common.planning.step_time import forward_flops
from common.planning.transformer import init_weights
from common.tensor_parallel.layers import check_tp_degree

TOL = 1e-5  # fp32 logits; measured differences 0 to 1e-7 at the defaults
VOCAB, MAX_LEN = 17, 64  # pixel tokens 0..16; the model's learned positions
H100 = {"flops": 989e12, "bytes_per_s": 3.35e12}  # bf16 dense peak, HBM3: an H100 SXM's data sheet


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=32, help="d_model (default 32)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; tp must divide them")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--prompt-len", type=int, default=16, help="P, prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=int, default=16, help="N, tokens generated (default 16)")
    p.add_argument("--batch-size", type=int, default=2, help="prompts decoded together, 1..16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes its numbers here as JSON")
    add_distributed_args(p)
    # tiny tensors on the CPU: the split and its collectives are the point (NCCL would need cuda tensors)
    p.set_defaults(backend="gloo", device="cpu")
    args = p.parse_args(argv)
    if args.backend != "gloo" or args.device != "cpu":
        raise LessonError("lesson 22 runs on the CPU with gloo (--backend gloo --device cpu)")
    # validated before any process group: every rank fails alike, none waits
    if min(args.hidden, args.heads, args.layers, args.new_tokens) < 1 or args.prompt_len < 8:
        raise LessonError(
            "--hidden, --heads, --layers, --new-tokens must be >= 1, --prompt-len >= 8"
        )
    if args.prompt_len + args.new_tokens > MAX_LEN or not 1 <= args.batch_size <= 16:
        raise LessonError(
            f"--prompt-len + --new-tokens must be <= {MAX_LEN}, --batch-size in 1..16"
        )
    check_tp_degree(read_torchrun_env()[2], args.hidden, args.heads)  # LessonError: one line a rank
    return args


@dataclass
class Run:
    """What the sections share: options, rank, report, the tp grid, the model (from the seed), prompts."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    grid: Grid
    model: CausalTransformer
    prompt: torch.Tensor  # (B, P) pixel tokens 0..16


def build(args: argparse.Namespace) -> tuple[CausalTransformer, torch.Tensor]:
    """The shared transformer from the seed alone, and the first P pixels of the first B digits (B, P)."""
    model = CausalTransformer(VOCAB, args.hidden, args.heads, args.layers, MAX_LEN).eval()
    init_weights(model, args.seed)
    images = load_digits()[0][: args.batch_size]  # (B, 1, 8, 8) in [0, 1]
    return model, (images * 16).round().long().flatten(1)[:, : args.prompt_len]


def one_process(run: Run) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """Section 1: the cache against rerunning the whole prefix, tokens, logits and FLOPs. Returns the
    tokens, their logits and the filled cache (every head), what tp is held to."""
    P, N, B = run.args.prompt_len, run.args.new_tokens, run.args.batch_size
    (ref_tokens, ref_logits), ref_flops = count_flops(
        lambda: recompute_decode(run.model, run.prompt, N)
    )
    whole = TPDecoder(run.model, run.args.heads)
    cache = whole.new_cache(B, P + N)
    (tokens, logits), flops = count_flops(lambda: greedy_decode(whole, run.prompt, N, cache=cache))
    run.report.record("tokens", tokens.tolist())
    run.report.record("logits", logits.tolist())  # (B, N, vocab): what minimal/22 is held to
    run.report.value("prompt", run.prompt[0].tolist(), "prompt 0 (pixels 0..{P}): {value}", P=P - 1)
    run.report.value("generated", tokens[0].tolist(), "  continued greedily:  {value}")
    run.report.claim(
        "cache_tokens_equal_recompute",
        int((tokens != ref_tokens).sum()),
        "==",
        0,
        "1. KV cache: {n} generated tokens x {B} prompts, mismatches against rerunning the prefix: {value}",
        n=N,
        B=B,
    )
    run.report.claim(
        "cache_logits_within_bound",
        max_abs_diff(logits, ref_logits),
        "<=",
        TOL,
        "  max |logits with cache - without| = {value:.1e}",
    )
    c = GPT(run.args.layers, run.args.hidden, run.args.heads, VOCAB, MAX_LEN)
    cached = forward_flops(c, B, P) + sum(forward_flops(c, B, 1, P + t) for t in range(N - 1))
    full = sum(forward_flops(c, B, P + t) for t in range(N))
    run.report.claim(
        "cache_flops_equal_formula",
        flops,
        "==",
        cached,
        "  FLOPs counted with the cache {value:.4g} = prefill + {m} steps of 1 token (formula)",
        m=N - 1,
    )
    run.report.claim(
        "recompute_flops_equal_formula",
        ref_flops,
        "==",
        full,
        "  FLOPs counted without {value:.4g} = {n} forwards of the whole prefix (formula)",
        n=N,
    )
    run.report.value(
        "flops_per_token",
        {"cache": flops / (B * N), "recompute": ref_flops / (B * N)},
        "  per generated token: {value[cache]:.4g} with the cache, {value[recompute]:.4g} without "
        "({ratio:.1f}x)",
        ratio=ref_flops / flops,
    )
    return tokens, logits, cache


def tensor_parallel(run: Run, want) -> TPDecoder:
    """Section 2: heads over the tp ranks against one process; the cache's bytes; the all-reduces."""
    tp, rank, group = run.grid.size("tp"), run.grid.coords["tp"], run.grid.group("tp")
    P, N, B = run.args.prompt_len, run.args.new_tokens, run.args.batch_size
    dec = TPDecoder(run.model, run.args.heads, rank, tp, group)
    cache = dec.new_cache(B, P + N)  # (B, heads / tp, P + N, hd) per layer, keys and values
    with count_collectives() as seen:
        tokens, logits = greedy_decode(dec, run.prompt, N, cache=cache)
    # which of one process's heads this rank's filled cache holds, found from the numbers
    heads, gap = match_heads(cache, want[2])
    run.report.record("cache_heads", all_gather_objects(heads, run.info))  # rank -> its heads
    run.report.record("cache_bytes", all_gather_objects(cache.nbytes(), run.info))
    if tp == 1:
        run.report.value(
            "tp_cache_bytes", cache.nbytes(), "2. tp=1: the whole cache here, {value} bytes"
        )
        calls = seen.calls.get("all_reduce", 0)
        run.report.value("all_reduce_calls", calls, "  all-reduces: {value}")
        return dec
    run.report.claim(
        "tp_tokens_equal_one_process",
        int(all_reduce_sum([int((tokens != want[0]).sum())], run.info)[0]),
        "==",
        0,
        "2. tp={tp}: {heads}/{tp} heads a rank; token mismatches against one process: {value}",
        tp=tp,
        heads=run.args.heads,
    )
    run.report.claim(
        "tp_logits_within_bound",
        max_over_ranks(max_abs_diff(logits, want[1])),
        "<=",
        TOL,
        "  max |logits tp - one process| over ranks = {value:.1e}",
    )
    first = rank * run.args.heads // tp
    # the heads this rank's q, k, v rows are
    split = list(range(first, first + run.args.heads // tp))
    run.report.claim(
        "cache_heads_match_one_process",
        max_over_ranks(gap if heads == split else math.inf),  # other heads than its rows: inf
        "<=",
        TOL,
        "  each rank's filled cache = heads {heads} of one process's: max |diff| {value:.1e}",
        heads=run.report.recorded("cache_heads"),
    )
    run.report.claim(
        "cache_bytes_are_one_over_tp",
        max_over_ranks(abs(cache.nbytes() * tp - want[2].nbytes())),
        "==",
        0,
        "  cache bytes a rank {mine} x tp - one process's {whole}: {value} (counted from tensors)",
        mine=cache.nbytes(),
        whole=want[2].nbytes(),
    )
    all_reduces(run, seen)
    return dec


def all_reduces(run: Run, seen) -> None:
    """The all-reduces of the whole generation (1 prefill + N - 1 decode forwards), counted at the calls."""
    N, L = run.args.new_tokens, run.args.layers
    per_rank = all_gather_objects(seen.calls.get("all_reduce", 0) / (L * N), run.info)
    run.report.claim(
        "two_all_reduces_per_layer_per_token",
        per_rank[0] if len(set(per_rank)) == 1 else math.nan,  # ranks that disagree: NaN fails
        "==",
        2,
        "  all-reduces per layer per generated token: {value:g} (attention's proj, the MLP's fc2)",
    )
    # rows through the layers: prefill P, then 1 a step
    tokens = run.args.batch_size * (run.args.prompt_len + N - 1)
    predicted = 2 * L * tokens * run.args.hidden * 4  # each all-reduce: (B, T, d) fp32
    run.report.claim(
        "all_reduce_bytes_equal_prediction",
        max_over_ranks(abs(seen.bytes.get("all_reduce", 0) - predicted)),
        "==",
        0,
        "  all-reduced bytes {predicted} = 2 L x B (P + N - 1) x d x 4: |counted - predicted| = {value}",
        predicted=predicted,
    )


def phases(run: Run, dec: TPDecoder) -> None:
    """Section 3: prefill (P tokens, one forward) against one decode step, on this rank's shards."""
    P = run.args.prompt_len
    out = phase_costs(dec, run.prompt)  # {phase: FLOPs per token and per byte, all-reduces}
    run.report.record("phases", out)
    pre, dec_ = out["prefill"], out["decode"]
    run.report.value(
        "flops_per_token_by_phase",
        [pre["flops"], dec_["flops"]],
        "3. FLOPs per token on a rank: prefill {value[0]:.4g}, decode {value[1]:.4g}; all-reduce bytes "
        "per forward {c} and {d}",
        c=pre["bytes"],
        d=dec_["bytes"],
    )
    if run.grid.size("tp") > 1:
        run.report.claim(
            "prefill_sends_prompt_times_decode",
            max_over_ranks(
                abs(pre["bytes"] - P * dec_["bytes"]) + abs(pre["calls"] - dec_["calls"])
            ),
            "==",
            0,
            "  the same {calls} calls, P = {P} times the bytes in prefill: |difference| {value}",
            calls=dec_["calls"],
            P=P,
        )
    # fp32 weights and cache in both phases; a prefill forward does about P decode steps' FLOPs over
    # about the same bytes: ratio = P, off by one key and one cache row (decode's), at most ~1/P
    ratio = pre["intensity"] / dec_["intensity"]
    run.report.claim(
        "prefill_intensity_is_P_times_decode",
        max_over_ranks(abs(ratio / P - 1)),
        "<=",
        0.25,
        "  FLOPs per byte read (fp32 weights + cache rows): prefill {pre:.2f}, decode {dec:.2f}, ratio\n"
        "  {ratio:.2f} ~ P = {P}: |ratio / P - 1| = {value:.3f} (a recomputed cache: ratio ~1); an H100\n"
        "  needs {ridge:.0f} (bf16 989 TFLOP/s / 3.35 TB/s, data sheet): decode waits on memory",
        pre=pre["intensity"],
        dec=dec_["intensity"],
        ratio=ratio,
        P=P,
        ridge=H100["flops"] / H100["bytes_per_s"],
    )
    timing(run, dec)


def timing(run: Run, dec: TPDecoder) -> None:
    """Time per generated token at this tp and at tp 1, as [perf] lines (this CPU, gloo)."""
    tp, N = run.grid.size("tp"), run.args.new_tokens
    per_token = {"tp1": ms_per_token(TPDecoder(run.model, run.args.heads), run.prompt, N)}
    text = "ms per token: tp=1 {a:.2f} (CPU)"
    if tp > 1:
        per_token["tp"] = ms_per_token(dec, run.prompt, N)
        text = (
            "ms per token: tp=1 {a:.2f}, tp={tp} {b:.2f} (CPU, gloo: all-reduce latency dominates)"
        )
    run.report.perf(
        "ms_per_token", per_token, text, a=per_token["tp1"], b=per_token.get("tp"), tp=tp
    )
    run.report.value(
        "on_a_gpu",
        None,
        "  on a GPU (not measured here): a decode step reads weights/tp + cache/tp from HBM, so tp divides\n"
        "  the time per token until the 2 L all-reduces are what is left (~10 us each on NVLink:\n"
        "  a typical latency figure assumed here, not measured)",
    )


def planner(run: Run) -> None:
    """Section 4: the planner's KV-cache bytes against the cache measured on this rank; then Llama-3-70B."""
    tp, P, N, B = run.grid.size("tp"), run.args.prompt_len, run.args.new_tokens, run.args.batch_size
    hd = run.args.hidden // run.args.heads
    predicted = kv_cache_bytes(run.args.layers, run.args.heads, hd, P + N, B, 4, tp)
    measured = run.report.recorded("cache_bytes")[run.grid.coords["tp"]]
    run.report.claim(
        "planner_kv_bytes_equal_measured",
        max_over_ranks(abs(measured - predicted)),
        "==",
        0,
        "4. planner: 2 x {L} layers x {h} heads x {hd} x {S} positions x {B} x 4 B = {p} a rank\n"
        "  |measured - planner| = {value}",
        L=run.args.layers,
        h=run.args.heads // tp,
        hd=hd,
        S=P + N,
        B=B,
        p=predicted,
    )
    c = LLAMA3_70B
    run.report.value("llama_source", c.source, "  {model} ({value})", model=c.name)
    for seq in (2048, 8192):  # 8192: Llama 3's context (max_position_embeddings)
        fit = largest_batch(c, tp=8, seq=seq)
        usable, weights = fit["usable_gb"] * 1e9, fit["weights_gb"] * 1e9
        cache = [
            kv_cache_bytes(c.layers, c.kv_heads, c.head_dim, seq, fit["batch"] + i, 2, 8)
            for i in (0, 1)
        ]
        run.report.claim(
            f"llama_batch_at_{seq}",
            int(weights + cache[0] <= usable < weights + cache[1]),
            "==",
            1,
            "  tp 8, 8 x 80 GB (10% kept back): {batch} sequences of {seq} tokens fit, not one more",
            batch=fit["batch"],
            seq=seq,
        )
    run.report.value(
        "llama_fit",
        {
            "params": fit["params"],
            "weights_gb": fit["weights_gb"],
            "kv_per_token": fit["bytes_per_token"],
            "room_gb": fit["room_gb"],
        },
        "  {value[params]:.4g} parameters: {value[weights_gb]:.2f} GB of bf16 weights a GPU, "
        "{value[room_gb]:.2f} GB left for the cache;\n"
        "  {value[kv_per_token]} bytes of cache a token a GPU (1 of 8 kv heads)",
    )


def batch_composition(run: Run, dec: TPDecoder) -> None:
    """Section 5: four prompts of different lengths, each decoded alone and as its row of one left-padded
    batch; every row compared."""
    N, P = run.args.new_tokens, run.args.prompt_len
    mine = run.prompt[0, : P - 4]
    others = [
        load_digits()[0][i].mul(16).round().long().flatten()[:n] for i, n in ((20, P), (21, P - 2))
    ]
    prompts = [mine, *others, mine[:-1]]
    tokens, positions, real = left_padded(prompts)
    valid = torch.cat([real, torch.ones(len(tokens), N, dtype=torch.bool)], 1)  # generated: real
    alone = [greedy_decode(dec, p[None], N) for p in prompts]  # (1, N) tokens, (1, N, vocab) logits
    batch_tokens, batch_logits = greedy_decode(dec, tokens, N, positions, valid)
    gap = nan_max(max_abs_diff(batch_logits[i], a[1][0]) for i, a in enumerate(alone))
    lengths, width = [len(p) for p in prompts], tokens.shape[1]
    run.report.value(
        "batch_logit_difference",
        max_over_ranks(gap),
        "5. prompts of {lengths} tokens alone, then left-padded to {width} in one batch ({pads} pads):\n"
        "  max |logit diff| over every row {value:.2e}",
        lengths=lengths,
        width=width,
        pads=width * len(prompts) - sum(lengths),
    )
    mismatches = sum(int((batch_tokens[i] != a[0][0]).sum()) for i, a in enumerate(alone))
    run.report.claim(
        "batched_tokens_equal_alone",
        int(all_reduce_sum([mismatches], run.info)[0]),
        "==",
        0,
        "  token mismatches over the {B} rows x {N} tokens: {value}",
        B=len(prompts),
        N=N,
    )
    run.report.claim(
        "batched_logits_within_bound",
        max_over_ranks(gap),
        "<=",
        TOL,
        "  logits within {bound}, not bit for bit by promise: row 0's first step sums {n} keys alone,\n"
        "  {width} ({masked} masked) in the batch, in another order; RL comparing trainer and sampler\n"
        "  log-probs sees such gaps",
        n=lengths[0],
        width=width,
        masked=width - lengths[0],
    )
    top2 = torch.cat([a[1][0] for a in alone]).topk(2, -1).values  # (rows x N, 2)
    run.report.value(
        "smallest_top2_margin",
        (top2[:, 0] - top2[:, 1]).min().item(),
        "  the smallest gap between the best two logits: {value:.2e} "
        "(tokens are stable while it >> the diff)",
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        report = Report(info)
        grid = Grid(info, tp=info.world_size)
        report.value("grid", grid.describe(), "\n".join(grid.describe()))
        run = Run(args, info, report, grid, *build(args))
        want = one_process(run)  # 1. the cache
        dec = tensor_parallel(run, want)  # 2. heads over tp
        phases(run, dec)  # 3. prefill vs decode
        planner(run)  # 4. how much cache fits
        batch_composition(run, dec)  # 5. alone vs in a batch
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
