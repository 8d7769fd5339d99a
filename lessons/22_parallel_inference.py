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
  the FLOPs of both, counted by torch.utils.flop_counter, equal the formula (common.planning.cost_model).
- Tensor-parallel decoding (common/inference/tp_decode.py): q, k, v column-parallel by heads, the
  output projection row-parallel, the MLP column- then row-parallel; each rank caches only its heads.
  Tokens equal one process; a rank's cache is 1/tp of one process's bytes; 2 all-reduces per layer per
  generated token.
- Prefill vs decode: the same calls, P times the bytes per call in prefill; arithmetic intensity (FLOPs
  per byte read) shows decode is memory-bound. Time per token is [perf] only.
- How much cache fits: the planner's KV-cache bytes (common/planning/serving.py), equal to the cache measured
  here, applied to Llama-3-70B on 8 x 80 GB at tp 8.
- Batch composition: one prompt alone and inside a left-padded batch: tokens equal, logits within a bound.

Sources: Pope et al. 2022, Efficiently Scaling Transformer Inference (https://arxiv.org/abs/2211.05102);
Shoeybi et al. 2019, Megatron-LM (https://arxiv.org/abs/1909.08053); vLLM's tensor-parallel layers
(vllm/model_executor/layers/linear.py); Llama 3's configuration (common/planning/serving.py names it).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from common.data import load_digits
from common.harness.env import LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import all_gather_objects, all_reduce_sum
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main
from common.inference.tp_decode import TPDecoder, greedy_decode, recompute_decode
from common.measure.counters import count_collectives
from common.measure.differences import max_abs_diff, max_over_ranks
from common.models import CausalTransformer
from common.planning.cost_model import GPT, forward_flops, kv_cache_bytes
from common.planning.serving import LLAMA3_70B, longest_context
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


def build(args: argparse.Namespace) -> tuple[CausalTransformer, torch.Tensor]:
    """The shared transformer from the seed alone, and the first P pixels of the first B digits (B, P)."""
    model = CausalTransformer(VOCAB, args.hidden, args.heads, args.layers, MAX_LEN).eval()
    init_weights(model, args.seed)
    images = load_digits()[0][: args.batch_size]  # (B, 1, 8, 8) in [0, 1]
    return model, (images * 16).round().long().flatten(1)[:, : args.prompt_len]


def shape(args: argparse.Namespace) -> GPT:
    return GPT(args.layers, args.hidden, args.heads, VOCAB, MAX_LEN)


def counted(run) -> tuple[object, int]:
    """run()'s result and the FLOPs torch.utils.flop_counter counted in it."""
    with FlopCounterMode(display=False) as counter:
        out = run()
    return out, counter.get_total_flops()


def one_process(report: Report, args, model, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 1: the cache against rerunning the whole prefix, tokens, logits and FLOPs."""
    P, N, B = args.prompt_len, args.new_tokens, args.batch_size
    (ref_tokens, ref_logits), ref_flops = counted(lambda: recompute_decode(model, prompt, N))
    (tokens, logits), flops = counted(
        lambda: greedy_decode(TPDecoder(model, args.heads), prompt, N)
    )
    report.record("tokens", tokens.tolist())
    report.value("prompt", prompt[0].tolist(), "prompt 0 (pixels 0..{P}): {value}", P=P - 1)
    report.value("generated", tokens[0].tolist(), "  continued greedily:  {value}")
    report.claim(
        "cache_tokens_equal_recompute",
        int((tokens != ref_tokens).sum()),
        "==",
        0,
        "1. KV cache: {n} generated tokens x {B} prompts, mismatches against rerunning the prefix: {value}",
        n=N,
        B=B,
    )
    report.claim(
        "cache_logits_within_bound",
        max_abs_diff(logits, ref_logits),
        "<=",
        TOL,
        "  max |logits with cache - without| = {value:.1e}",
    )
    c = shape(args)
    cached = forward_flops(c, B, P) + sum(forward_flops(c, B, 1, P + t) for t in range(N - 1))
    full = sum(forward_flops(c, B, P + t) for t in range(N))
    report.claim(
        "cache_flops_equal_formula",
        flops,
        "==",
        cached,
        "  FLOPs counted with the cache {value:.4g} = prefill + {m} steps of 1 token (formula)",
        m=N - 1,
    )
    report.claim(
        "recompute_flops_equal_formula",
        ref_flops,
        "==",
        full,
        "  FLOPs counted without {value:.4g} = {n} forwards of the whole prefix (formula)",
        n=N,
    )
    report.value(
        "flops_per_token",
        {"cache": flops / (B * N), "recompute": ref_flops / (B * N)},
        "  per generated token: {cache:.4g} with the cache, {recompute:.4g} without ({ratio:.1f}x)",
        cache=flops / (B * N),
        recompute=ref_flops / (B * N),
        ratio=ref_flops / flops,
    )
    return tokens, logits


def tensor_parallel(report: Report, grid: Grid, args, model, prompt, want) -> TPDecoder:
    """Section 2: heads over the tp ranks against one process; the cache's bytes; the all-reduces."""
    tp, rank, group = grid.size("tp"), grid.coords["tp"], grid.group("tp")
    P, N, B = args.prompt_len, args.new_tokens, args.batch_size
    dec = TPDecoder(model, args.heads, rank, tp, group)
    cache = dec.new_cache(B, P + N)  # (B, heads / tp, P + N, hd) per layer, keys and values
    with count_collectives() as seen:
        tokens, logits = greedy_decode(dec, prompt, N, cache=cache)
    first = rank * args.heads // tp
    heads = list(range(first, first + args.heads // tp))
    report.record("cache_heads", all_gather_objects(heads, grid.info))  # rank -> its heads
    report.record("cache_bytes", all_gather_objects(cache.nbytes(), grid.info))
    if tp == 1:
        report.value(
            "tp_cache_bytes", cache.nbytes(), "2. tp=1: the whole cache here, {value} bytes"
        )
        report.value("all_reduce_calls", seen.calls.get("all_reduce", 0), "  all-reduces: {value}")
        return dec
    report.claim(
        "tp_tokens_equal_one_process",
        int(all_reduce_sum([int((tokens != want[0]).sum())], grid.info)[0]),
        "==",
        0,
        "2. tp={tp}: {heads}/{tp} heads a rank; token mismatches against one process: {value}",
        tp=tp,
        heads=args.heads,
    )
    report.claim(
        "tp_logits_within_bound",
        max_over_ranks(max_abs_diff(logits, want[1])),
        "<=",
        TOL,
        "  max |logits tp - one process| over ranks = {value:.1e}",
    )
    whole = TPDecoder(model, args.heads).new_cache(B, P + N)
    report.claim(
        "cache_bytes_are_one_over_tp",
        max_over_ranks(abs(cache.nbytes() * tp - whole.nbytes())),
        "==",
        0,
        "  cache bytes a rank {mine} x tp - one process's {whole}: {value} (counted from tensors)",
        mine=cache.nbytes(),
        whole=whole.nbytes(),
    )
    all_reduces(report, grid, args, seen)
    return dec


def all_reduces(report: Report, grid: Grid, args, seen) -> None:
    """The all-reduces of the whole generation (1 prefill + N - 1 decode forwards), counted at the calls."""
    N, L = args.new_tokens, args.layers
    per_rank = all_gather_objects(seen.calls.get("all_reduce", 0) / (L * N), grid.info)
    report.claim(
        "two_all_reduces_per_layer_per_token",
        per_rank[0] if len(set(per_rank)) == 1 else math.nan,  # ranks that disagree: NaN fails
        "==",
        2,
        "  all-reduces per layer per generated token: {value:g} (attention's proj, the MLP's fc2)",
    )
    # rows through the layers: prefill P, then 1 a step
    tokens = args.batch_size * (args.prompt_len + N - 1)
    predicted = 2 * L * tokens * args.hidden * 4  # each all-reduce: (B, T, d) fp32
    report.claim(
        "all_reduce_bytes_equal_prediction",
        max_over_ranks(abs(seen.bytes.get("all_reduce", 0) - predicted)),
        "==",
        0,
        "  all-reduced bytes {predicted} = 2 L x B (P + N - 1) x d x 4: |counted - predicted| = {value}",
        predicted=predicted,
    )


def phases(report: Report, grid: Grid, args, model, dec: TPDecoder, prompt) -> None:
    """Section 3: prefill (P tokens, one forward) against one decode step, on this rank's shards."""
    P, B = args.prompt_len, args.batch_size
    cache = dec.new_cache(B, P + 1)
    weights = sum(p.numel() * p.element_size() for p in dec.parameters())  # this rank's shards
    out = {}
    for phase, tokens, start in (("prefill", prompt, 0), ("decode", prompt[:, -1:], P)):
        with count_collectives() as seen, torch.no_grad():
            _, flops = counted(lambda t=tokens, s=start: dec(t, s, cache))
        T = tokens.shape[1]
        read = (
            weights + cache.nbytes() * (start + T) // cache.max_len
        )  # weights + the cache rows touched
        out[phase] = {"flops": flops / (B * T), "intensity": flops / read}
        out[phase]["bytes"] = seen.bytes.get("all_reduce", 0)
        out[phase]["calls"] = seen.calls.get("all_reduce", 0)
        out[phase]["log"] = (
            seen.log
        )  # [(op, bytes)] in call order: layer by layer, attention then MLP
    report.record("phases", out)
    pre, dec_ = out["prefill"], out["decode"]
    report.value(
        "flops_per_token_by_phase",
        [pre["flops"], dec_["flops"]],
        "3. FLOPs per token on a rank: prefill {a:.4g}, decode {b:.4g}; all-reduce bytes per forward "
        "{c} and {d}",
        a=pre["flops"],
        b=dec_["flops"],
        c=pre["bytes"],
        d=dec_["bytes"],
    )
    if grid.size("tp") > 1:
        report.claim(
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
    ridge = H100["flops"] / H100["bytes_per_s"]
    report.claim(
        "decode_is_memory_bound",
        max_over_ranks(dec_["intensity"]),
        "<=",
        ridge,
        "  FLOPs per byte read (weights + cache): prefill {pre:.2f}, decode {value:.2f}; an H100 needs\n"
        "  {ridge:.0f} (989 TFLOP/s / 3.35 TB/s) to be compute-bound: decode waits on memory",
        pre=pre["intensity"],
        ridge=ridge,
    )
    timing(report, grid, args, model, dec, prompt)


def timing(report: Report, grid: Grid, args, model, dec: TPDecoder, prompt) -> None:
    """Time per generated token at this tp and at tp 1, as [perf] lines (this CPU, gloo)."""
    tp = grid.size("tp")
    decoders = {"tp1": TPDecoder(model, args.heads)}
    if tp > 1:
        decoders["tp"] = dec
    per_token = {}
    for tag, decoder in decoders.items():
        start = time.perf_counter()
        greedy_decode(decoder, prompt, args.new_tokens)
        per_token[tag] = (time.perf_counter() - start) / args.new_tokens * 1e3
    if tp == 1:
        text = "ms per token: tp=1 {a:.2f} (CPU)"
    else:
        text = (
            "ms per token: tp=1 {a:.2f}, tp={tp} {b:.2f} (CPU, gloo: all-reduce latency dominates)"
        )
    report.perf("ms_per_token", per_token, text, a=per_token["tp1"], b=per_token.get("tp"), tp=tp)
    report.value(
        "on_a_gpu",
        None,
        "  on a GPU (not measured here): a decode step reads weights/tp + cache/tp from HBM, so tp divides\n"
        "  the time per token until the 2 L all-reduces (~10 us each on NVLink) are what is left",
    )


def planner(report: Report, grid: Grid, args) -> None:
    """Section 4: the planner's KV-cache bytes against the cache measured on this rank; then Llama-3-70B."""
    tp, P, N, B = grid.size("tp"), args.prompt_len, args.new_tokens, args.batch_size
    hd = args.hidden // args.heads
    predicted = kv_cache_bytes(args.layers, args.heads, hd, P + N, B, 4, tp)
    measured = report.recorded("cache_bytes")[grid.coords["tp"]]
    report.claim(
        "planner_kv_bytes_equal_measured",
        max_over_ranks(abs(measured - predicted)),
        "==",
        0,
        "4. planner: 2 x {L} layers x {h} heads x {hd} x {S} positions x {B} x 4 B = {p} a rank\n"
        "  |measured - planner| = {value}",
        L=args.layers,
        h=args.heads // tp,
        hd=hd,
        S=P + N,
        B=B,
        p=predicted,
    )
    c = LLAMA3_70B
    report.value("llama_source", c.source, "  {model} ({source})", model=c.name, source=c.source)
    rows = {}
    for batch in (1, 8, 32):
        fit = longest_context(c, tp=8, batch=batch)
        rows[batch] = fit["seq"]
        usable, weights = fit["usable_gb"] * 1e9, fit["weights_gb"] * 1e9
        cache = [
            kv_cache_bytes(c.layers, c.kv_heads, c.head_dim, fit["seq"] + i, batch, 2, 8)
            for i in (0, 1)
        ]
        report.claim(
            f"llama_batch{batch}_longest_context",
            int(weights + cache[0] <= usable < weights + cache[1]),
            "==",
            1,
            "  tp 8, 8 x 80 GB (10% kept back), batch {batch}: {seq} tokens a sequence fit, not one more",
            batch=batch,
            seq=fit["seq"],
        )
    report.value(
        "llama_fit",
        {
            "params": fit["params"],
            "weights_gb": fit["weights_gb"],
            "kv_per_token": fit["bytes_per_token"] // 32,
        },
        "  {p:.4g} parameters: {w:.2f} GB of bf16 weights a GPU; {kv} bytes of cache a token a GPU"
        " (1 of 8 kv heads)",
        p=fit["params"],
        w=fit["weights_gb"],
        kv=fit["bytes_per_token"] // 32,
    )


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts of different lengths left-padded to the longest: tokens (B, P), positions (B, P)
    counted from each prompt's first real token, and the real-token mask (B, P)."""
    P = max(len(p) for p in prompts)
    pads = torch.tensor([P - len(p) for p in prompts])[:, None]  # (B, 1)
    tokens = torch.stack(
        [torch.cat([torch.zeros(P - len(p), dtype=torch.long), p]) for p in prompts]
    )
    positions = (torch.arange(P) - pads).clamp(min=0)
    return tokens, positions, torch.arange(P) >= pads


def batch_composition(report: Report, grid: Grid, args, dec: TPDecoder, prompt) -> None:
    """Section 5: prompt 0, shortened by 4, decoded alone and as row 0 of a left-padded batch of four."""
    N, P = args.new_tokens, args.prompt_len
    mine = prompt[0, : P - 4]
    others = [
        load_digits()[0][i].mul(16).round().long().flatten()[:n] for i, n in ((20, P), (21, P - 2))
    ]
    tokens, positions, real = left_padded([mine, *others, mine[:-1]])
    valid = torch.cat(
        [real, torch.ones(len(tokens), N, dtype=torch.bool)], 1
    )  # generated tokens are real
    alone_tokens, alone_logits = greedy_decode(dec, mine[None], N)
    batch_tokens, batch_logits = greedy_decode(dec, tokens, N, positions, valid)
    gap = max_abs_diff(batch_logits[0], alone_logits[0])
    report.value(
        "batch_logit_difference",
        max_over_ranks(gap),
        "5. prompt 0 ({n} tokens) alone, then in a padded batch of {B} (4 pads): "
        "max |logit diff| {value:.2e}",
        n=P - 4,
        B=len(tokens),
    )
    report.claim(
        "batched_tokens_equal_alone",
        int(all_reduce_sum([int((batch_tokens[0] != alone_tokens[0]).sum())], grid.info)[0]),
        "==",
        0,
        "  token mismatches: {value}",
    )
    report.claim(
        "batched_logits_within_bound",
        max_over_ranks(gap),
        "<=",
        TOL,
        "  logits within {bound}, not bit for bit by promise: 12 keys or 16 (4 masked) are summed\n"
        "  in another order; RL comparing trainer and sampler log-probs sees such gaps",
    )
    top2 = alone_logits[0].topk(2, -1).values
    report.value(
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
        model, prompt = build(args)
        want = one_process(report, args, model, prompt)  # 1. the cache
        dec = tensor_parallel(report, grid, args, model, prompt, want)  # 2. heads over tp
        phases(report, grid, args, model, dec, prompt)  # 3. prefill vs decode
        planner(report, grid, args)  # 4. how much cache fits
        batch_composition(report, grid, args, dec, prompt)  # 5. alone vs in a batch
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
