"""Minimal 19: ring attention -- causal attention over a sequence split across the ranks (forward).

    torchrun --standalone --nproc_per_node=2 minimal/19_context_parallel.py
    python minimal/19_context_parallel.py                 # plain python: cp = 1, the whole sequence

Rank r holds tokens [r*S/cp, (r+1)*S/cp) of every sequence: their queries, keys and values.
The keys and values travel around the ring (send to r + 1, receive from r - 1, posted at once)
while each rank attends its queries to the block it holds. Two partial softmaxes over disjoint
key blocks merge exactly through their log-sum-exps (lse):
out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b, with lse = log(e^lse_a + e^lse_b).
A block of later tokens is wholly masked (causal) and skipped.
The measured lesson (backward, the zig-zag split, Ulysses, training):
lessons/19_context_parallel.py.
"""

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

B, H, S, D = 2, 4, 64, 8  # lesson 19's attention check: batch, heads, tokens, features per head


def block_attention(q, k, v, causal):
    """Softmax attention of q (B, H, c, D) on one key/value block: (out, lse (B, H, c))."""
    s = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, c, c)
    if causal:  # the diagonal block: query i sees keys 0..i of it
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return (
        torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    ), lse


def ring_attention(q, k, v, rank, cp, sent):
    """This rank's causal attention output (B, H, S/cp, D) over the whole sequence."""
    out = lse = None
    for step in range(cp):
        owner = (rank - step) % cp  # whose keys and values we hold now
        if step < cp - 1:  # pass them on while we compute with them
            k_in, v_in = torch.empty_like(k), torch.empty_like(v)
            right, left = (rank + 1) % cp, (rank - 1) % cp
            ops = [
                dist.P2POp(dist.isend, k, right),
                dist.P2POp(dist.isend, v, right),
                dist.P2POp(dist.irecv, k_in, left),
                dist.P2POp(dist.irecv, v_in, left),
            ]
            works = dist.batch_isend_irecv(ops)
            sent[0] += (k.numel() + v.numel()) * k.element_size()
        if owner <= rank:  # a later block is wholly masked
            o, lse_b = block_attention(q, k, v, causal=owner == rank)
            out, lse = (o, lse_b) if out is None else merge(out, lse, o, lse_b)
        if step < cp - 1:
            for w in works:
                w.wait()
            k, v = k_in, v_in
    return out


def check(diff, tol=1e-5) -> bool:
    """Each rank votes on its own diff (a NaN votes no); the MIN of the votes is yes only if all
    are. (Reducing the diffs first would let gloo's MAX drop a NaN, or a MIN hide a wrong rank.)"""
    ok = torch.tensor(float(torch.isfinite(diff) and diff <= tol), device=diff.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok.item() == 1.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # --- setup: one process per device, started by torchrun (which sets RANK, WORLD_SIZE, ...) ---
    rank, cp = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        if S % cp:
            raise SystemExit(f"cp = {cp} must divide S = {S}")
        # --- the whole sequence on every rank (same seed); each keeps its S/cp tokens ---
        torch.manual_seed(args.seed)
        q, k, v = (torch.randn(B, H, S, D, device=device) for _ in range(3))
        mine = [t.chunk(cp, dim=2)[rank].contiguous() for t in (q, k, v)]  # (B, H, S/cp, D)
        sent = [0]
        out = ring_attention(*mine, rank, cp, sent)

        # --- the check: equal to PyTorch's attention on the whole sequence ---
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True).chunk(cp, dim=2)[rank]
        diff = (out - want).abs().max()  # this rank's; NaN stays NaN, and check() says no
        ok = check(diff)
        worst = diff.clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # reported; check() decides
        if rank == 0:  # one JSON line: lesson 19's ring_contiguous_equals_sdpa, bytes and bound
            block = 2 * mine[1].numel() * mine[1].element_size()  # k and v of one rank
            got = dict(cp=cp, max_diff=worst.item(), sent_bytes=sent[0], kv_block_bytes=block)
            print(json.dumps(got))
        if not ok:
            raise SystemExit(f"[rank {rank}] ring != SDPA on some rank (here by {diff.item():.1e})")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
