"""Lesson 02: torch.distributed from first principles -- process groups, collectives, a hand-built ring all-reduce.

Run it:

    python lessons/02_collectives.py                                    # one process: no process group; shows
                                                                        # the backend table, the simulated ring
    torchrun --standalone --nproc_per_node=2 lessons/02_collectives.py  # 2 processes (2 GPUs, or 2 CPU processes)
    torchrun --standalone --nproc_per_node=4 lessons/02_collectives.py --sizes-kib 64 1024 4096
    torchrun --standalone --nproc_per_node=1 lessons/02_collectives.py  # a world of one: collectives are no-ops

    # two nodes, 2 processes each (a world of 4): the same command on both; $HOST0 is one node's address
    torchrun --nnodes=2 --nproc_per_node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HOST0:29500 --rdzv-id=lessons lessons/02_collectives.py

What to look for:
- The per-rank table: RANK is global (0 .. WORLD_SIZE-1), LOCAL_RANK counts processes on one node; every process
  joined ONE process group (the "world") through torchrun's rendezvous.
- The backend table (from the PyTorch docs): NCCL moves CUDA tensors only, gloo moves CPU tensors (and some CUDA
  ops), MPI exists only in builds from source. The lesson then runs every collective on the backend it got and
  compares each result with the answer computed locally: "match on every rank: True".
- reduce_scatter runs natively on gloo/CPU in torch 2.13 ("native: yes"); if a backend refuses it (MPI, per the
  docs), the lesson builds it from all_reduce and says so ("native: no").
- The ring all-reduce built from isend/irecv equals dist.all_reduce (bit for bit on integer-valued data) for
  lengths that do not divide by the world size, including lengths smaller than it. Each rank sends
  2(n-1)/n of the tensor's bytes: the factor nccl-tests uses to turn algorithm bandwidth into bus bandwidth.
- [perf] lines: time, algbw = bytes/time and busbw = algbw * 2(n-1)/n for dist.all_reduce and the ring, for a
  few message sizes. On one CPU the "bus" is shared memory and Python overhead dominates small messages.
- No parameter server: each rank takes the gradient of its own shard, ONE all_reduce averages it, every rank
  steps its own optimizer. Averaged gradient == gradient of the global batch in one process (~1e-8), and the
  parameters are identical on every rank (difference 0) although no rank ever sent weights to another.

Myths this lesson settles (see the README), with the numbers above as evidence:
- "In DDP rank 0 gathers the gradients, updates the model and broadcasts the weights" and "data parallelism keeps
  replicas in sync through a parameter server": there is no such rank and no server; an all-reduce gives every
  rank the same averaged gradient and each rank applies it itself.
- "Ring all-reduce is what DDP does": DDP hands gradient buckets to the backend's all_reduce, and NCCL chooses
  between ring and tree algorithms (and others) by message size and topology. The ring is the right model for
  the *bandwidth* cost, which is why busbw uses its 2(n-1)/n factor; it is not a promise about the algorithm.

Docs: https://pytorch.org/docs/stable/distributed.html (backends, collectives, point-to-point),
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md (algbw, busbw).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.checkpoint import write_results
from common.collectives import (BACKEND_OPS, BACKEND_SUPPORT, RingStats, bandwidths, bus_bandwidth_factor,
                                ring_all_reduce, simulate_ring_all_reduce, time_op)
from common.data import digits_split
from common.ranks import gather_to_rank0, max_param_diff_across_ranks, print0
from common.session import (LessonError, add_distributed_args, barrier, distributed_session, read_torchrun_env,
                            run_main, set_seed)
from common.models import mlp

DEMO_LEN = 4  # elements in the small tensors each collective demonstrates on (printed, so kept short)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 64, 1024],
                   help="message sizes in KiB (float32) for the bandwidth measurement (default %(default)s)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per message size (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 3, 7, 1001],
                   help="tensor lengths (elements) on which ring all-reduce is compared with dist.all_reduce")
    p.add_argument("--batch-size", type=int, default=16,
                   help="samples per process in the no-parameter-server step; the global batch is "
                        "batch-size x world_size (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of that step (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    bad = [s for s in args.sizes_kib if s < 1]
    if bad:
        raise LessonError(f"--sizes-kib must be positive integers (KiB), got {bad[0]}")
    if args.iters < 1:
        raise LessonError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup < 0:
        raise LessonError(f"--warmup must be >= 0, got {args.warmup}")
    bad = [n for n in args.lengths if n < 1]
    if bad:
        raise LessonError(f"--lengths must be positive integers (elements), got {bad[0]}")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    world_size = read_torchrun_env()[2]
    if not 1 <= args.batch_size * world_size <= 1438:  # 1438 = digits training images
        raise LessonError(f"--batch-size x world_size must be in 1..1438 (the digits training set), got "
                          f"{args.batch_size} x {world_size}")
    return args


def rank_tensor(rank: int, length: int = DEMO_LEN) -> torch.Tensor:
    """What rank `rank` contributes in the demonstrations: [100r, 100r+1, ...] (float32, integer-valued, so
    every sum below is exact and any rank can compute any other rank's input locally)."""
    return torch.arange(length, dtype=torch.float32) + 100 * rank


def fmt(t: torch.Tensor) -> str:
    return "[" + " ".join(f"{v:g}" for v in t.flatten().tolist()) + "]"


def max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.cpu().double() - expected.cpu().double()).abs().max().item() if got.numel() else 0.0


def demonstrate_collectives(info) -> dict:
    """Run point-to-point and every collective once; each rank compares its result with the local answer.

    Returns {op: {"ok": bool, "max_abs_err": float, ...}} for THIS rank (rank 0 combines them) and prints
    nothing itself.
    """
    n, r, dev = info.world_size, info.rank, info.device

    def x(k: int) -> torch.Tensor:  # rank k's input, computable on any rank
        return rank_tensor(k).to(dev)

    out: dict[str, dict] = {}

    # send/recv: blocking, rank 0 -> rank 1. Then isend/irecv: everybody shifts its tensor one step right on the
    # ring at once (blocking sends in that pattern could all wait for a receive that nobody has posted yet;
    # batch_isend_irecv posts each rank's send and receive together, which NCCL needs to avoid that cycle).
    if n >= 2:
        if r == 0:
            dist.send(x(0), dst=1)
        if r == 1:
            buf = torch.empty(DEMO_LEN, device=dev)
            dist.recv(buf, src=0)
            out["send_recv"] = {"ok": torch.equal(buf, x(0)), "max_abs_err": max_err(buf, x(0))}
        else:
            out["send_recv"] = {"ok": True, "max_abs_err": 0.0}  # nothing to check on this rank
        buf = torch.empty(DEMO_LEN, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x(r), (r + 1) % n),
                                        dist.P2POp(dist.irecv, buf, (r - 1) % n)])
        for w in works:
            w.wait()
        out["isend_irecv_ring_shift"] = {"ok": torch.equal(buf, x((r - 1) % n)),
                                         "max_abs_err": max_err(buf, x((r - 1) % n))}

    t = x(r)
    dist.broadcast(t, src=0)  # everybody ends with rank 0's tensor
    out["broadcast"] = {"ok": torch.equal(t, x(0)), "max_abs_err": max_err(t, x(0))}

    expected_sum = sum(rank_tensor(k) for k in range(n)).to(dev)
    t = x(r)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # everybody ends with the sum
    out["all_reduce"] = {"ok": torch.equal(t, expected_sum), "max_abs_err": max_err(t, expected_sum)}

    t = x(r)
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's result is defined; others' buffers are scratch
    out["reduce"] = ({"ok": torch.equal(t, expected_sum), "max_abs_err": max_err(t, expected_sum)} if r == 0
                     else {"ok": True, "max_abs_err": 0.0})

    parts = [torch.empty(DEMO_LEN, device=dev) for _ in range(n)]
    dist.all_gather(parts, x(r))  # everybody ends with every rank's tensor, in rank order
    out["all_gather"] = {"ok": all(torch.equal(parts[k], x(k)) for k in range(n)),
                         "max_abs_err": max(max_err(parts[k], x(k)) for k in range(n))}

    # reduce_scatter: rank k contributes a list whose j-th entry is x(k) + 1000 j; rank j ends with the sum over
    # k of the j-th entries. It is the first half of the ring all-reduce.
    inputs = [x(r) + 1000 * j for j in range(n)]
    expected_rs = (sum(rank_tensor(k) for k in range(n)) + 1000 * r * n).to(dev)
    got = torch.empty(DEMO_LEN, device=dev)
    native = True
    try:
        dist.reduce_scatter(got, inputs, op=dist.ReduceOp.SUM)
    except (RuntimeError, NotImplementedError):
        # A backend without reduce_scatter (MPI, per the docs table): all_reduce everything, keep my part.
        # Same result, n times the traffic of a real reduce-scatter into each rank.
        native = False
        full = torch.cat(inputs)
        dist.all_reduce(full)
        got = full[r * DEMO_LEN:(r + 1) * DEMO_LEN]
    out["reduce_scatter"] = {"ok": torch.equal(got, expected_rs), "max_abs_err": max_err(got, expected_rs),
                             "native": native}

    # barrier: nobody leaves before everybody has arrived. The last rank arrives 50 ms late on purpose; every
    # rank's leave time must come after that arrival (one clock: all ranks of a node share it).
    if r == n - 1:
        time.sleep(0.05)
    arrive = time.time()
    dist.barrier()
    leave = time.time()
    out["barrier"] = {"arrive": arrive, "leave": leave}
    return out


def combine_checks(per_rank: list[dict]) -> dict:
    """Rank 0: AND the per-rank booleans, MAX the errors; the barrier check is min(leave) >= max(arrive)."""
    combined = {}
    for op in per_rank[0]:
        if op == "barrier":
            last_arrival = max(d["barrier"]["arrive"] for d in per_rank)
            first_leave = min(d["barrier"]["leave"] for d in per_rank)
            combined[op] = {"ok": first_leave >= last_arrival}
            continue
        combined[op] = {"ok": all(d[op]["ok"] for d in per_rank),
                        "max_abs_err": max(d[op]["max_abs_err"] for d in per_rank)}
        if "native" in per_rank[0][op]:
            combined[op]["native"] = all(d[op]["native"] for d in per_rank)
    return combined


def check_ring(info, lengths: list[int], seed: int) -> dict:
    """ring_all_reduce vs dist.all_reduce on every length; returns numbers identical on every rank."""
    n, dev = info.world_size, info.device
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(seed * 1000 + 17 * info.rank + length)
        ints = torch.randint(-1000, 1000, (length,), generator=g).float().to(dev)  # exact sums in float32
        floats = torch.randn(length, generator=g).to(dev)
        ring_i, ref_i = ints.clone(), ints.clone()
        ring_all_reduce(ring_i)
        dist.all_reduce(ref_i)
        ring_f, ref_f = floats.clone(), floats.clone()
        ring_all_reduce(ring_f)
        dist.all_reduce(ref_f)
        # Floats may differ in the last bit: the ring adds in the order r+1, r+2, ... around the ring, gloo in its
        # own order. Integer-valued data has no rounding, so there the two must agree exactly.
        stats = torch.tensor([0.0 if torch.equal(ring_i, ref_i) else 1.0, max_err(ring_f, ref_f)],
                             dtype=torch.float64, device=dev)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        rows.append({"length": length, "exact_int_equal": stats[0].item() == 0.0,
                     "float_max_abs_diff": stats[1].item()})
    # Traffic: on a length n divides, each rank sends 2(n-1) chunks of length/n elements.
    length = 1024 * n
    rs = RingStats()
    ring_all_reduce(torch.ones(length, device=dev), stats=rs)
    return {"rows": rows, "traffic_length": length, "messages_sent_per_rank": rs.messages_sent,
            "bytes_sent_per_rank": rs.bytes_sent, "bytes_ratio": rs.bytes_sent / (length * 4),
            "expected_ratio": 2 * (n - 1) / n}


def simulate_ring(lengths: list[int], seed: int) -> dict:
    """In-process simulation of the same ring schedule for 1..4 simulated ranks, checked against a plain sum."""
    ok = True
    g = torch.Generator().manual_seed(seed)
    for n in range(1, 5):
        for length in lengths:
            inputs = [torch.randint(-1000, 1000, (length,), generator=g).float() for _ in range(n)]
            results, log = simulate_ring_all_reduce(inputs)
            total = torch.stack(inputs).sum(0)
            ok &= all(torch.equal(res, total) for res in results) and len(log) == 2 * (n - 1) * n
    return {"world_sizes": [1, 2, 3, 4], "lengths": lengths, "all_equal_plain_sum": bool(ok)}


def no_parameter_server_step(info, args) -> dict:
    """One data-parallel SGD step done by hand: shard gradient -> all_reduce -> divide -> own optimizer step."""
    n, r, dev = info.world_size, info.rank, info.device
    train_set, _ = digits_split()  # every rank loads the same data; no rank distributes it
    b = args.batch_size
    x_global = train_set.tensors[0][: b * n].reshape(b * n, -1).to(dev)  # (b*n, 64) flattened 8x8 images
    y_global = train_set.tensors[1][: b * n].to(dev)  # (b*n,)
    x, y = x_global[r * b:(r + 1) * b], y_global[r * b:(r + 1) * b]  # this rank's shard: (b, 64), (b,)

    set_seed(args.seed)  # same seed -> same initial weights on every rank, nothing is broadcast
    model = mlp([64, 32, 10]).to(dev)
    set_seed(args.seed)
    reference = mlp([64, 32, 10]).to(dev)  # the one-process model that sees the global batch
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    F.cross_entropy(model(x), y).backward()  # mean over this rank's b samples
    # One flat buffer of all gradients (DDP does the same per ~25 MB "bucket", and overlaps it with backward).
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # (P,) P = 64*32+32+32*10+10 = 2410
    collectives_called = {"all_reduce": 0, "broadcast": 0, "send": 0}
    if info.distributed:
        dist.all_reduce(grads, op=dist.ReduceOp.SUM)  # the only communication of the step
        collectives_called["all_reduce"] += 1
    grads /= n  # equal shard sizes: the mean of shard means is the global-batch mean
    offset = 0
    for p in model.parameters():
        p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
        offset += p.numel()

    F.cross_entropy(reference(x_global), y_global).backward()  # mean over all b*n samples, one process
    ref_grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    grad_vs_global = max_err(grads, ref_grads)

    # Is the averaged gradient the same on every rank? Compare with rank 0's copy.
    rank0_grads = grads.clone()
    if info.distributed:
        dist.broadcast(rank0_grads, src=0)  # for the CHECK only; training never needs it
    spread = torch.tensor(max_err(grads, rank0_grads), dtype=torch.float64, device=dev)
    if info.distributed:
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)

    opt.step()  # every rank steps its own optimizer with the same gradient
    ref_opt.step()
    param_diff = max_param_diff_across_ranks(model, info)
    param_vs_global = max(max_err(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    num_params = grads.numel()
    worst = torch.tensor([grad_vs_global, param_vs_global], dtype=torch.float64, device=dev)
    if info.distributed:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"global_batch": b * n, "batch_size_per_process": b, "num_params": num_params,
            "collectives_called": collectives_called,
            "grad_max_diff_across_ranks": spread.item(), "grad_max_diff_vs_global_batch": worst[0].item(),
            "param_max_diff_across_ranks": param_diff, "param_max_diff_vs_global_batch": worst[1].item(),
            # Bytes per step, float32: what a parameter server's links carry versus a ring all-reduce.
            "ring_bytes_per_rank": round(2 * (n - 1) / n * num_params * 4),
            "server_bytes_in_plus_out": 2 * (n - 1) * num_params * 4}


def mark(v) -> str:
    return {True: "yes", False: "no", None: "?"}[v]


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        n = info.world_size
        results: dict = {"world_size": n, "backend": info.backend, "device": info.device.type,
                         "distributed": info.distributed}

        # --- 1. Who am I? -------------------------------------------------------------------------------------
        print0(f"world_size {n}  backend {info.backend or 'none (plain python: no process group)'}  "
               f"device {info.device.type}")
        facts = gather_to_rank0({"rank": info.rank, "local_rank": info.local_rank, "world_size": info.world_size,
                                 "local_world_size": info.local_world_size, "device": str(info.device)}, info)
        print0(f"{'rank':>4} {'local_rank':>10} {'world_size':>10} {'local_world_size':>16} {'device':>8}")
        for f in facts or []:
            print0(f"{f['rank']:>4} {f['local_rank']:>10} {f['world_size']:>10} {f['local_world_size']:>16} "
                   f"{f['device']:>8}")
        results["ranks"] = facts

        # --- 2. Backends: the docs' table, what this build has, what we use --------------------------------------
        built = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                 "mpi": dist.is_mpi_available()}
        print0("\nbackend support (PyTorch docs; yes/no/?) -- and what this build of torch contains")
        cols = [(b, d) for b in ("gloo", "mpi", "nccl") for d in ("cpu", "cuda")]
        print0(f"{'':>15}" + "".join(f"{b + '/' + d:>10}" for b, d in cols))
        for op in BACKEND_OPS:
            print0(f"{op:>15}" + "".join(f"{mark(BACKEND_SUPPORT[c][op]):>10}" for c in cols))
        print0(f"{'built here':>15}" + "".join(f"{mark(built[b]):>10}" for b, _ in cols))
        results["backends_built"] = built

        # --- 3. Every collective, checked against the answer computed locally -------------------------------------
        if info.distributed:
            per_rank = gather_to_rank0(demonstrate_collectives(info), info)
            checks = combine_checks(per_rank) if info.master_process else {}
            print0(f"\ncollectives on {info.backend}/{info.device.type}: rank k contributes "
                   f"x_k = {fmt(rank_tensor(0))} + 100 k")
            for op, c in checks.items():
                if op == "barrier":
                    print0(f"  {op:<24} no rank left before the last one arrived: {c['ok']}")
                    continue
                extra = f"  native: {mark(c['native'])}" if "native" in c else ""
                print0(f"  {op:<24} match on every rank: {c['ok']}  max |error| {c['max_abs_err']:.1e}{extra}")
            if n == 1:
                print0("  (send/recv need a peer: skipped in a world of one)")
            results["collectives"] = checks
        else:
            print0("\n(plain python: no process group, so no collectives; torchrun --nproc_per_node=1 gives a "
                   "world of one)")
            results["collectives"] = {}

        # --- 4. Ring all-reduce from send/recv ---------------------------------------------------------------------
        sim = simulate_ring(args.lengths, args.seed)
        print0(f"\nring schedule simulated in one process for 1..4 ranks, lengths {args.lengths}: "
               f"equals the plain sum: {sim['all_equal_plain_sum']}")
        results["ring_simulation"] = sim
        if info.distributed:
            ring = check_ring(info, args.lengths, args.seed)
            print0(f"ring all-reduce (isend/irecv) vs dist.all_reduce on {n} ranks:")
            for row in ring["rows"]:
                print0(f"  length {row['length']:>6}  integer data equal: {row['exact_int_equal']}  "
                       f"float data max |diff| {row['float_max_abs_diff']:.1e}")
            print0(f"  traffic per rank for {ring['traffic_length']} float32: {ring['messages_sent_per_rank']} "
                   f"messages, {ring['bytes_sent_per_rank']} bytes = {ring['bytes_ratio']:.4f} x the tensor "
                   f"(2(n-1)/n = {ring['expected_ratio']:.4f})")
            results["ring_vs_all_reduce"] = ring

        # --- 5. Bandwidth: algbw and busbw, as nccl-tests defines them ----------------------------------------------
        bw_rows = []
        if info.distributed:
            print0(f"\nbandwidth: busbw = algbw x 2(n-1)/n = algbw x {bus_bandwidth_factor('all_reduce', n):.4f} "
                   f"(timings on [perf] lines)")
            for kib in args.sizes_kib:
                nbytes = kib * 1024
                buf = torch.zeros(nbytes // 4, device=info.device)  # zeros: repeated sums never overflow
                for name, fn in (("all_reduce", lambda: dist.all_reduce(buf)),
                                 ("ring", lambda: ring_all_reduce(buf))):
                    sec = time_op(fn, args.iters, args.warmup, info.device, info.distributed)
                    algbw, busbw = bandwidths(nbytes, sec, n, "all_reduce")
                    bw_rows.append({"op": name, "size_bytes": nbytes, "time_s": sec, "algbw_GBps": algbw,
                                    "busbw_GBps": busbw})
                    print0(f"[perf] {name:>10} {kib:>6} KiB: {sec * 1e3:8.3f} ms  algbw {algbw:7.3f} GB/s  "
                           f"busbw {busbw:7.3f} GB/s")
        results["bandwidth"] = bw_rows

        # --- 6. No parameter server --------------------------------------------------------------------------------
        ps = no_parameter_server_step(info, args)
        print0(f"\none SGD step, {n} x {args.batch_size} samples = global batch {ps['global_batch']}, "
               f"{ps['num_params']} parameters:")
        print0(f"  communication: {ps['collectives_called']['all_reduce']} all_reduce of the gradient; "
               f"weights sent between ranks: 0")
        print0(f"  averaged gradient, max |diff| across ranks:           {ps['grad_max_diff_across_ranks']:.1e}")
        print0(f"  averaged gradient vs one process on the global batch: {ps['grad_max_diff_vs_global_batch']:.1e}")
        print0(f"  parameters after the step, max |diff| across ranks:   {ps['param_max_diff_across_ranks']:.1e}")
        print0(f"  parameters vs one process on the global batch:        {ps['param_max_diff_vs_global_batch']:.1e}")
        print0(f"  bytes per step: ring all-reduce {ps['ring_bytes_per_rank']} per rank; a parameter server "
               f"would move {ps['server_bytes_in_plus_out']} through its one link")
        results["no_parameter_server"] = ps
        write_results(args.results, results, info)
        # Every rank's last message has been received before any rank tears its process group down: in about 1
        # of 30 runs with 4 gloo ranks on 2 busy cores we saw a rank abort in teardown without this.
        barrier(info)


if __name__ == "__main__":
    run_main(main)
