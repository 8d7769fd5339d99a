"""Minimal 22: tensor-parallel greedy decoding with the KV cache split by heads.

    torchrun --standalone --nproc_per_node=2 minimal/22_parallel_inference.py
    python minimal/22_parallel_inference.py                  # plain python: tp = 1, every head here

Rank r holds heads [r*nh/tp, (r+1)*nh/tp): their q, k, v rows, those proj columns, and ONLY their keys and
values in its cache; the MLP is cut the same way (fc1 rows, fc2 columns). A step computes q, k, v for the
new token only; two all-reduces per layer make x whole. Measured: lessons/22_parallel_inference.py"""

import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

D, HEADS, LAYERS, VOCAB, MAX_LEN = 32, 4, 2, 17, 64
B, P, N = 2, 16, 16  # prompts, prompt tokens, tokens generated
HD = D // HEADS  # head_dim


def weights(seed):
    """common.planning.transformer.init_weights's values: N(0, 0.02) in parameter order, biases 0."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.02

    tok, pos = r(VOCAB, D), r(MAX_LEN, D)
    layers = [
        dict(qkv=r(3 * D, D), proj=r(D, D), fc1=r(4 * D, D), fc2=r(D, 4 * D)) for _ in range(LAYERS)
    ]
    return tok, pos, layers, r(VOCAB, D)


def shard(w, rank, tp):
    """This rank's heads: q, k, v rows and proj columns; fc1 rows and fc2 columns."""
    heads = slice(rank * D // tp, (rank + 1) * D // tp)  # rows of q (and of k, v): whole heads
    hidden = slice(rank * 4 * D // tp, (rank + 1) * 4 * D // tp)
    q, k, v = w["qkv"].split(D)
    return dict(
        q=q[heads],
        k=k[heads],
        v=v[heads],
        proj=w["proj"][:, heads],
        fc1=w["fc1"][hidden],
        fc2=w["fc2"][:, hidden],
    )


def forward(model, mine, cache, tokens, start):
    """tokens (B, T) at positions [start, start + T) -> logits (B, T, V); writes their k, v."""
    tok, pos, _, head = model
    B, T = tokens.shape
    x = tok[tokens] + pos[start : start + T]  # (B, T, D), the same on every rank
    for w, (kc, vc) in zip(mine, cache):
        h = F.layer_norm(x, (D,))
        q, k, v = (
            (h @ w[n].T).view(B, T, -1, HD).transpose(1, 2) for n in "qkv"
        )  # (B, nh/tp, T, hd)
        kc[:, :, start : start + T], vc[:, :, start : start + T] = k, v  # only the new tokens
        keys, values = kc[:, :, : start + T], vc[:, :, : start + T]
        scores = q @ keys.transpose(-2, -1) / math.sqrt(HD)  # (B, nh/tp, T, start + T)
        causal = torch.arange(start + T)[None] <= torch.arange(start, start + T)[:, None]
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ values
        part = y.transpose(1, 2).reshape(B, T, -1) @ w["proj"].T  # my heads' share of the output
        dist.all_reduce(part)  # all-reduce 1: attention
        x = x + part
        part = F.gelu(F.layer_norm(x, (D,)) @ w["fc1"].T) @ w["fc2"].T
        dist.all_reduce(part)  # all-reduce 2: MLP
        x = x + part
    return F.layer_norm(x, (D,)) @ head.T


def decode(args, rank, tp):
    if HEADS % tp:
        raise SystemExit(f"{HEADS} heads must be divisible by the {tp} processes")
    model = weights(args.seed)
    mine = [shard(w, rank, tp) for w in model[2]]
    images = np.load(os.path.join(os.path.dirname(__file__), "..", "data", "digits.npz"))["images"]
    prompt = torch.from_numpy(images[:B].reshape(B, 64)[:, :P].astype(np.int64))  # first P pixels
    cache = [
        (torch.zeros(B, HEADS // tp, P + N, HD), torch.zeros(B, HEADS // tp, P + N, HD))
        for _ in range(LAYERS)
    ]  # this rank's heads only: 1/tp of the bytes
    with torch.no_grad():
        logits = forward(model, mine, cache, prompt, 0)[:, -1]  # prefill: the prompt in one forward
        out, chosen = [], []
        for step in range(N):
            chosen.append(logits)  # (B, V): what the token was picked from
            out.append(logits.argmax(-1))  # every rank has the whole logits: the same token
            if step < N - 1:
                logits = forward(model, mine, cache, out[-1][:, None], P + step)[:, -1]
    nbytes = sum(t.numel() * t.element_size() for pair in cache for t in pair)
    if rank == 0:
        tokens, logits = torch.stack(out, 1).tolist(), torch.stack(chosen, 1).tolist()
        print(json.dumps(dict(tp=tp, tokens=tokens, logits=logits, cache_bytes=nbytes)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # LOCAL_RANK picks a GPU on its node (RANK is global); these tiny shards stay on the CPU (gloo)
    assert 0 <= int(os.environ.get("LOCAL_RANK", 0)) <= rank
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("gloo")  # CPU tensors: tiny shards, the collectives are the point
    try:
        decode(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
