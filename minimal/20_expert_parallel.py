"""Minimal 20: expert parallelism -- top-1 routing; tokens dispatched and combined by all-to-all.

    torchrun --standalone --nproc_per_node=2 minimal/20_expert_parallel.py
    python minimal/20_expert_parallel.py                  # plain python: ep = 1, every expert here

Rank r holds experts [r*E/ep, (r+1)*E/ep) and routes its own N tokens (top-1, nothing dropped): the split
sizes travel first, then each row to its expert's rank, and the results back. An all-to-all's backward
is the same call, splits swapped. The measured lesson: lessons/20_expert_parallel.py"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

H, E, N = 32, 4, 64  # features, experts, tokens per rank


def all_to_all(x, out_splits, in_splits):
    """Rows in_splits[d] of x go to rank d; out_splits[s] rows arrive from rank s."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        return all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):  # each row's gradient goes back where its row came from
        return all_to_all(grad, *reversed(ctx.splits)), None, None


def moe_one_process(router, experts, x):
    prob, idx = router(x).softmax(-1).max(-1)  # top-1: y = p(top expert) * expert(x), per token
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        tok = (idx == e).nonzero(as_tuple=True)[0]
        y = y.index_add(0, tok, prob[tok, None] * expert(x[tok]))
    return y


def moe_expert_parallel(router, my_experts, x, rank, world_size):
    prob, idx = router(x).softmax(-1).max(-1)
    order = torch.argsort(idx, stable=True)  # group my tokens by expert, hence by destination rank
    local = len(my_experts)
    send = torch.bincount(idx[order] // local, minlength=world_size)  # rows for each rank
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # 1. split sizes: how many rows each rank sends me
    send_l, recv_l = send.tolist(), recv.tolist()
    rows = AllToAll.apply(x[order], recv_l, send_l)  # 2. dispatch: (sum(recv), H)
    ids = all_to_all(idx[order] % local, recv_l, send_l)  # which of my experts each row is for
    out = rows * 0  # zeros that stay in the graph: every rank must run the backward all-to-alls
    for e, expert in enumerate(my_experts):  # 3. my experts on what arrived
        where = (ids == e).nonzero(as_tuple=True)[0]
        out = out.index_copy(0, where, expert(rows[where]))
    back = AllToAll.apply(out, send_l, recv_l)  # 4. combine: in my sorted order
    return torch.zeros_like(x).index_add(0, order, prob[order, None] * back), send


def train(args, rank, world_size, device) -> None:
    torch.manual_seed(args.seed)  # every rank: the same router, experts and tokens of every rank
    router = nn.Linear(H, E, bias=False)
    experts = nn.ModuleList(
        nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H)) for _ in range(E)
    )
    x = torch.randn(world_size, N, H).to(device)  # rank r's tokens are x[r]
    router, experts, local = router.to(device), experts.to(device), E // world_size
    mine = experts[rank * local : (rank + 1) * local]  # an EP rank would hold only these
    xf = x.clone().requires_grad_()  # one process: each rank's tokens through every expert
    yf = torch.stack([moe_one_process(router, experts, xf[r]) for r in range(world_size)])
    loss = yf.square().sum()  # its gradients: my experts', the router's and the tokens'
    *reference, dxf = torch.autograd.grad(loss, [*mine.parameters(), router.weight, xf])
    xs = x[rank].clone().requires_grad_()
    ys, send = moe_expert_parallel(router, mine, xs, rank, world_size)
    ys.square().sum().backward()
    dist.all_reduce(router.weight.grad)  # the router is replicated: sum its partial gradients
    got = [p.grad for p in mine.parameters()] + [router.weight.grad]
    gaps = [(ys - yf[rank]).abs().max(), (xs.grad - dxf[rank]).abs().max()]
    gaps += [(a - b).abs().max() for a, b in zip(got, reference)]
    diff = torch.stack(gaps).max()  # torch's max keeps a NaN (gloo's MAX over ranks would not)
    ok = diff.item() <= 1e-5  # False for NaN
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    sent = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(sent, send)
    if rank == 0:  # the loss: common.expert_parallel.moe.MoE's (top-1, no drops) at this seed
        rows = torch.stack(sent).tolist()
        print(
            json.dumps(dict(ep=world_size, rows_sent=rows, max_diff=diff.item(), loss=loss.item()))
        )
    assert ok, f"rank {rank}: EP differs from one process"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if E % world_size:
        raise SystemExit(f"{E} experts must be divisible by the {world_size} processes")
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
