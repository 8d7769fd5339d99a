"""Lesson 23: Accelerate and Lightning Fabric: what they run for you, against lessons 03, 07 and 13.

Run it:

    torchrun --standalone --nproc_per_node=2 lessons/23_libraries.py            # 2 CPU processes (gloo)
    torchrun --standalone --nproc_per_node=2 lessons/23_libraries.py --seed 1   # another init and order
    python lessons/23_libraries.py                                              # one process: no wrapping

(`accelerate launch --cpu --num_processes 2` starts one process on a CPU machine, so use torchrun here;
`fabric run --accelerator cpu --devices 2 lessons/23_libraries.py` starts two, as torchrun does.)

What to look for:
1. Lesson 03's epoch three ways: by hand (DistributedSampler + set_epoch + DDP), through
   `accelerator.prepare` and through `fabric.setup` / `setup_dataloaders`. Both libraries hand back lesson
   03's DistributedDataParallel and send the same bucket all-reduces. Fabric inserts lesson 03's
   DistributedSampler (seed from `fabric.seed_everything`, else 0) and calls set_epoch for you: parameters
   equal lesson 03's. Accelerate keeps your sampler and deals whole batches to ranks (BatchSamplerShard:
   rank r takes batches r, r + W, ...), broadcasting rank 0's RNG state once per epoch (the new order each
   pass that the set_epoch column measures; Accelerate calls set_epoch on a sampler that has one, and a
   RandomSampler has none): another data order, so other parameters; fed the same batches, DDP ends
   equal to it.
2. Accumulation (lesson 07): `accelerator.accumulate` is `no_sync` on all micro-steps but the last, and
   `accelerator.backward` divides the loss by gradient_accumulation_steps FOR you; Fabric's
   `no_backward_sync` is `no_sync` alone: you divide by k. Measured: which normalisation equals one step on
   the global batch under each library, and on micro-batches of [15, 1] (only the sample count is right).
3. Sharding (lesson 13): Fabric's ModelParallelStrategy builds a mesh (data_parallel, tensor_parallel) and
   calls your fully_shard; the same parameters and collectives as fully_shard by hand. Its default puts
   every rank on tensor_parallel. Accelerate's FSDP2 plugin takes its FSDP path on GPUs only: in a fresh
   CPU process Accelerator(fsdp_plugin=..., parallelism_config=...) raises ValueError (... but got
   DistributedType.MULTI_CPU), measured after clearing the library's per-process state (an earlier
   Accelerator fixes it; a later one's arguments are then ignored and prepare returns DDP). Its names
   (dp_replicate, dp_shard, tp, cp, sp) are the mesh dims it builds.
Sources: huggingface.co/docs/accelerate (accelerator, gradient accumulation, FSDP), lightning.ai/docs/fabric.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from lightning_fabric import Fabric
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.data import digits_split
from common.data_parallel.accumulation import draw_global_batch, uneven_sizes
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.ranks import print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.libraries.accumulation import (
    RIGHT,
    RIGHT_UNEVEN,
    accelerate_variant,
    fabric_variant,
    library_proofs,
    no_sync_variant,
)
from common.libraries.loaders import dealt_in_turn
from common.libraries.sharding import accelerate_fsdp2_outcome, fabric_fully_shard, shard_run
from common.measure.counters import CommCounter, count_collectives
from common.measure.differences import max_abs_diff_all, max_over_ranks
from common.models import DigitsCNN, ResidualMLP
from common.sharding.fsdp import shard_blocks_then_root

EQUAL = 1e-6  # the same float32 operations in the same order: measured 0
TRAIN_SAMPLES = 1438  # the digits' training split (a test holds it to the file)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=1, help="passes over the digits (lesson 03: 4)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate, momentum 0.9")
    p.add_argument("--grad-accum-steps", type=int, default=2, help="k of section 2 (>= 2)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per micro-step (section 2)")
    p.add_argument("--seed", type=int, default=0, help="init and data order (every rank)")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here (JSON)")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validated before any process group: every rank fails alike and none waits in a collective.
    if min(args.epochs, args.batch_size, args.micro_batch) < 1 or args.lr <= 0:
        raise LessonError("--epochs, --batch-size, --micro-batch and --lr must be positive")
    if args.grad_accum_steps < 2:  # k = 1: dividing by k or not is the same, no claim could fail
        raise LessonError(f"--grad-accum-steps must be >= 2, got {args.grad_accum_steps}")
    W = read_torchrun_env()[2]
    if args.batch_size * W >= TRAIN_SAMPLES:  # one batch a rank: the order could not matter
        raise LessonError(
            f"--batch-size x world_size must be < {TRAIN_SAMPLES} (the training digits), got "
            f"{args.batch_size} x {W}: an epoch of one batch per rank has no order to compare"
        )
    if args.grad_accum_steps * args.micro_batch * W > TRAIN_SAMPLES:
        raise LessonError(
            f"--grad-accum-steps x --micro-batch x world_size must be <= {TRAIN_SAMPLES} (the "
            f"training digits), got {args.grad_accum_steps} x {args.micro_batch} x {W}"
        )
    return args


@dataclass
class Run:
    """What the sections share: the options, this rank, the report, the digits with their indices."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    train_set: TensorDataset  # (1438, 1, 8, 8) images, (1438,) labels, (1438,) each sample's index


@dataclass
class Trained:
    """One run of lesson 03's epoch: the model inside the wrapper, the sample indices of every step this rank
    read, its bucket all-reduces (the comm hook), the loader, the wrapper, the collectives Python saw."""

    raw: torch.nn.Module
    order: list
    calls: int
    loader: object
    model: torch.nn.Module
    py_calls: dict = field(default_factory=dict)


def indexed(dataset: TensorDataset) -> TensorDataset:
    """The digits with each sample's index as a third tensor: every run records the order it read."""
    x, y = dataset.tensors  # (1438, 1, 8, 8), (1438,)
    return TensorDataset(x, y, torch.arange(len(y)))


def fit(model, optimizer, loader, backward, epochs: int, device) -> list[list[int]]:
    """Lesson 03's loop; returns the sample indices of every step this rank read."""
    order = []
    for _ in range(epochs):
        for x, y, i in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))  # mean over this rank's B
            optimizer.zero_grad(set_to_none=True)
            backward(loss)  # DDP all-reduces each bucket during it
            optimizer.step()
            order.append(i.tolist())
    return order


def by_hand(run: Run, batches=None) -> Trained:
    """Lesson 03: DistributedSampler(seed) + set_epoch + DDP; or, with `batches`, DDP fed those batches."""
    set_seed(run.args.seed)
    raw = DigitsCNN(image_size=8).to(run.info.device)
    model = DDP(raw) if run.info.distributed else raw
    opt = torch.optim.SGD(raw.parameters(), lr=run.args.lr, momentum=0.9)
    sampler = DistributedSampler(
        run.train_set, run.info.world_size, run.info.rank, shuffle=True, seed=run.args.seed
    )
    if batches is None:
        loader = EpochLoader(DataLoader(run.train_set, run.args.batch_size, sampler=sampler))
    else:
        loader = [run.train_set[torch.tensor(b)] for b in batches]  # one epoch of given batches
    counter = CommCounter().register(model) if run.info.distributed else CommCounter()
    epochs = 1 if batches else run.args.epochs
    order = fit(model, opt, loader, lambda loss: loss.backward(), epochs, run.info.device)
    return Trained(raw, order, counter.calls, loader, model)


class EpochLoader:
    """A DataLoader over a DistributedSampler that calls sampler.set_epoch(epoch) before each pass."""

    def __init__(self, loader: DataLoader):
        self.loader, self.epoch = loader, 0

    def __iter__(self):
        self.loader.sampler.set_epoch(self.epoch)  # without it every epoch repeats epoch 0's order
        self.epoch += 1
        return iter(self.loader)


def with_accelerate(run: Run) -> tuple[Accelerator, Trained]:
    """accelerator.prepare(model, optimizer, loader) on a plain shuffled DataLoader."""
    accelerator = Accelerator(cpu=run.info.device.type == "cpu")
    set_seed(run.args.seed)
    raw = DigitsCNN(image_size=8)
    opt = torch.optim.SGD(raw.parameters(), lr=run.args.lr, momentum=0.9)
    loader = DataLoader(run.train_set, batch_size=run.args.batch_size, shuffle=True)
    model, opt, loader = accelerator.prepare(raw, opt, loader)
    counter = CommCounter().register(model) if run.info.distributed else CommCounter()
    # Python-level calls: the comm hook's all-reduces and the library's own
    with count_collectives() as c:
        order = fit(model, opt, loader, accelerator.backward, run.args.epochs, run.info.device)
    return accelerator, Trained(raw, order, counter.calls, loader, model, c.calls)


def with_fabric(run: Run) -> tuple[Fabric, Trained, int | None]:
    """fabric.setup(model, optimizer) and fabric.setup_dataloaders(loader), the same plain loader; and the
    seed Fabric's sampler takes before seed_everything."""
    strategy = (
        "ddp" if run.info.distributed else "auto"
    )  # "ddp" on 1 device would make a group of 1
    fabric = Fabric(
        accelerator=run.info.device.type, devices=run.info.world_size, strategy=strategy
    )
    fabric.launch()  # under torchrun: joins the process group that is already there
    default = fabric.setup_dataloaders(DataLoader(run.train_set, shuffle=True)).sampler
    default_seed = getattr(default, "seed", None)  # before seed_everything: PL_GLOBAL_SEED unset
    fabric.seed_everything(run.args.seed, verbose=False)  # sets PL_GLOBAL_SEED: the sampler's seed
    raw = DigitsCNN(image_size=8)
    opt = torch.optim.SGD(raw.parameters(), lr=run.args.lr, momentum=0.9)
    model, opt = fabric.setup(raw, opt)
    loader = fabric.setup_dataloaders(DataLoader(run.train_set, run.args.batch_size, shuffle=True))
    ddp = model._forward_module
    counter = CommCounter().register(ddp) if run.info.distributed else CommCounter()
    with count_collectives() as c:
        order = fit(model, opt, loader, fabric.backward, run.args.epochs, run.info.device)
    return fabric, Trained(raw, order, counter.calls, loader, model, c.calls), default_seed


def first_batch(loader) -> list[int]:
    """The sample indices of the loader's next first batch (one more pass, no training)."""
    return next(iter(loader))[2].tolist()


HEAD = ("device", "backend")  # the same for every row: printed once, in the heading


def describe(run: Run, name: str, model, sampler, reshuffles: bool) -> None:
    """Section 1's table row: what prepare / setup put around the model and the loader."""
    row = {
        "wrapper": type(getattr(model, "_forward_module", model)).__name__,
        "sampler": type(sampler).__name__,
        "seed": getattr(sampler, "seed", "-"),
        "drop_last": getattr(sampler, "drop_last", "-"),
        "set_epoch": reshuffles,
        "device": str(run.info.device),
        "backend": dist.get_backend() if run.info.distributed else "none",
    }
    run.report.record(f"{name}_setup", row)
    print0(f"  {name:<11}" + "".join(f" {k} {v}" for k, v in row.items() if k not in HEAD))


def section1(run: Run) -> tuple[dict[str, Trained], Fabric]:
    """Lesson 03's epoch by hand, through Accelerate and through Fabric: what each put around the model
    and the loader. Returns the three runs by name, and the Fabric that section 2 reuses."""
    print0("1. lesson 03's training: by hand, through Accelerate, through Fabric")
    ddp = by_hand(run)
    accelerator, acc = with_accelerate(run)
    fabric, fab, seed0 = with_fabric(run)
    # the next pass's first batch against epoch 0's: a new order each epoch, or not
    acc_new = first_batch(acc.loader) != acc.order[0]
    fab_new = first_batch(fab.loader) != fab.order[0]
    sampler = ddp.loader.loader.sampler
    plain = DataLoader(run.train_set, batch_size=run.args.batch_size, sampler=sampler)
    plain_new = first_batch(plain) != first_batch(plain)  # no set_epoch between the two passes
    inner = acc.loader.batch_sampler  # BatchSamplerShard around the DataLoader's own BatchSampler
    backend = dist.get_backend() if run.info.distributed else "none"
    print0(f"  what prepare / setup returned (all on {run.info.device}, backend {backend}):")
    describe(run, "by_hand", ddp.model, sampler, True)
    describe(run, "accelerate", acc.model, inner, acc_new)
    inner_sampler = type(getattr(inner, "batch_sampler", inner).sampler).__name__
    run.report.record("accelerate_inner_sampler", inner_sampler)
    describe(run, "fabric", fab.model, fab.loader.sampler, fab_new)
    if run.info.distributed:  # one process: Fabric keeps the RandomSampler, inserts nothing
        library_samplers(run, accelerator, fabric)
        text = "  Fabric calls set_epoch for you: {value} (a bare DataLoader over the same "
        text += "sampler, no set_epoch: {plain})"
        run.report.claim(
            "fabric_calls_set_epoch", int(fab_new), "==", 1, text, plain=int(plain_new)
        )
        sentence = "  Fabric's sampler seed without seed_everything: {value}"
        run.report.claim("fabric_default_sampler_seed", seed0, "==", 0, sentence)
    return {"ddp": ddp, "accelerate": acc, "fabric": fab}, fabric


def library_samplers(run: Run, accelerator: Accelerator, fabric: Fabric) -> None:
    """How each library's loader picks a rank's samples, from loaders made for the purpose."""
    # unshuffled, so that the batch each rank reads says which of the loader's batches it was
    plain = accelerator.prepare(DataLoader(run.train_set, batch_size=run.args.batch_size))
    read = [i.tolist() for _, _, i in plain]
    off, checked = dealt_in_turn(read, run.info.rank, run.info.world_size, len(run.train_set))
    text = "  Accelerate deals whole batches in turn (rank r: r, r + W, ...): {value:g} of {n} off"
    off = max_over_ranks(off)
    run.report.claim("accelerate_deals_batches_in_turn", off, "==", 0, text, n=checked)
    # a seed other than the default 0: the sampler's seed can only come from seed_everything
    seed = run.args.seed + 1
    fabric.seed_everything(seed, verbose=False)
    probe = fabric.setup_dataloaders(DataLoader(run.train_set, shuffle=True)).sampler
    fabric.seed_everything(run.args.seed, verbose=False)
    text = "  Fabric's DistributedSampler seed after seed_everything({seed}): {value}"
    claim = "fabric_sampler_seed_from_seed_everything"
    run.report.claim(claim, getattr(probe, "seed", None), "==", seed, text, seed=seed)


def compare(run: Run, runs: dict[str, Trained]) -> None:
    """Parameters and collectives of the three runs; Accelerate's order replayed by hand."""
    ddp, acc, fab = runs["ddp"], runs["accelerate"], runs["fabric"]
    # the sum of Fabric's parameters: minimal/23_libraries.py, plain torch, ends at the same number
    fab_sum = sum(p.detach().double().sum() for p in fab.raw.parameters())
    run.report.record("fabric_param_sum", fab_sum)
    diff = lambda a, b: max_over_ranks(max_abs_diff_all(a.parameters(), b.parameters()))  # noqa: E731
    same_order = lambda a, b: max_over_ranks(float(a != b)) == 0  # noqa: E731
    print0("  max |parameter difference| from lesson 03's run, worst over ranks:")
    fab_same = same_order(fab.order, ddp.order)
    sentence = "  Fabric vs by hand: {value:.1e} (same order of samples: {same})"
    if run.info.distributed:  # seed_everything(seed) gave its DistributedSampler our seed
        apart = diff(fab.raw, ddp.raw)
        run.report.claim("fabric_equals_ddp", apart, "<=", EQUAL, sentence, same=fab_same)
    else:
        run.report.value("fabric_vs_ddp", diff(fab.raw, ddp.raw), sentence, same=fab_same)
    run.report.claim(
        "accelerate_order_differs",
        diff(acc.raw, ddp.raw),
        ">=",
        1e-4,
        "  Accelerate vs by hand: {value:.1e} (same order: {same}): its order, not its "
        "arithmetic ...",
        same=same_order(acc.order, ddp.order),
    )
    replay = by_hand(run, batches=acc.order)
    text = "  ... DDP fed Accelerate's batches ends {value:.1e} from it"
    apart = diff(acc.raw, replay.raw)
    run.report.claim("accelerate_equals_ddp_same_batches", apart, "<=", EQUAL, text)
    if run.info.distributed:
        compare_collectives(run, runs)


def compare_collectives(run: Run, runs: dict[str, Trained]) -> None:
    """The bucket all-reduces (counted by the comm hook) and the libraries' own collectives."""
    ddp, acc, fab = runs["ddp"], runs["accelerate"], runs["fabric"]
    print0(
        "  collectives per run, this rank (gradient buckets by the comm hook, then Python-level):"
    )
    text = "  bucket all-reduces: by hand {bound}, Accelerate {value}"
    run.report.claim("accelerate_allreduces_equal_ddp", acc.calls, "==", ddp.calls, text)
    text = "  bucket all-reduces: by hand {bound}, Fabric {value}"
    run.report.claim("fabric_allreduces_equal_ddp", fab.calls, "==", ddp.calls, text)
    extra = {k: v for k, v in acc.py_calls.items() if k != "all_reduce"}
    run.report.claim(
        "accelerate_rng_broadcasts",
        extra.get("broadcast", 0),
        "==",
        run.args.epochs,
        "  the libraries' own: Accelerate {acc} (rank 0's RNG state, each epoch), Fabric {fab}",
        acc=extra,
        fab={k: v for k, v in fab.py_calls.items() if k != "all_reduce"},
    )


# -------- 2. accumulation: the library's context manager against lesson 07's no_sync
def section2(run: Run, fabric: Fabric) -> None:
    W, k, m = run.info.world_size, run.args.grad_accum_steps, run.args.micro_batch
    print0(
        f"\n2. accumulation, k = {k} micro-steps of {m} on {W} ranks vs one SGD step on the "
        f"global batch of {k * m * W}: max |difference|"
    )
    set_seed(run.args.seed)
    init = copy.deepcopy(ResidualMLP().state_dict())
    gx, gy, mine = draw_global_batch(run.train_set, k, m, run.args.seed, run.info)
    micro = [(gx[i], gy[i]) for i in mine]  # rank r's micro-step j: samples (j W + r) m ... + m
    accelerator = Accelerator(cpu=run.info.device.type == "cpu", gradient_accumulation_steps=k)
    runs = library_proofs(init, accelerator, fabric, run.info, run.report)
    ref = runs["ddp"]
    ref.run(no_sync_variant("divide_by_k", k, k * m), micro)  # DDP rebuilds its buckets once
    ref.ref = ref.run(no_sync_variant("divide_by_k", 1, 1), [(gx, gy)], on=ref.raw_model)
    calls = ref.run(no_sync_variant("divide_by_k", k, k * m), micro)[2]
    make = {
        "ddp": lambda h: no_sync_variant(h, k, k * m),
        "accelerate": lambda h: accelerate_variant(accelerator, h, k, k * m),
        "fabric": lambda h: fabric_variant(fabric, h, k, k * m),
    }
    for lib, proof in runs.items():
        proof.ref = ref.ref
        proof.run(make[lib]("nothing" if lib == "accelerate" else "divide_by_k"), micro)  # warm-up
        for how, right in RIGHT[lib].items():
            proof.check(
                f"{lib}_{how}", make[lib](how), micro, right, calls=calls if right else None
            )
    # the same samples of each rank cut [km - k + 1, 1, ...]: the global step does not change
    sizes = uneven_sizes(k * m, k)
    mine = (torch.cat(t) for t in zip(*micro))
    uneven = list(zip(*(t.split(sizes) for t in mine)))
    print0(f"  ... the same samples cut into micro-batches of {sizes} on every rank:")
    for lib, proof in runs.items():
        for how, right in RIGHT_UNEVEN[lib].items():
            proof.check(f"{lib}_{how}_uneven", make[lib](how), uneven, right)
    run.report.record("accumulation_right", RIGHT)
    run.report.record("round_allreduce_calls", calls)


# -------- 3. sharding: Fabric's ModelParallelStrategy and Accelerate's config against fully_shard
def section3(run: Run) -> None:
    W = run.info.world_size
    print0("\n3. sharding through the library vs fully_shard by hand (lesson 13), 3 Adam steps")
    set_seed(run.args.seed)
    init = copy.deepcopy(ResidualMLP(33, 2).state_dict())
    x, y = run.train_set.tensors[0][: 48 * W], run.train_set.tensors[1][: 48 * W]
    starts = range(16 * run.info.rank, 48 * W, 16 * W)  # 3 batches of 16 per rank
    mine = [(x[s : s + 16], y[s : s + 16]) for s in starts]
    meshes, fab_params, fab_calls = fabric_fully_shard(run.info, init, mine)
    # by hand: the mesh Accelerate's ParallelismConfig(dp_shard_size=W) builds, fully_shard on it
    config = ParallelismConfig(dp_shard_size=W)
    mesh = config.build_device_mesh(run.info.device.type)
    hand = ResidualMLP(33, 2).to(run.info.device)
    hand.load_state_dict(init)
    hand = shard_blocks_then_root(hand, mesh["dp_shard"])
    hand_params, hand_calls = shard_run(hand, torch.optim.Adam(hand.parameters(), lr=1e-3), mine)
    run.report.record("fabric_default_mesh", meshes[0])
    run.report.record("fabric_mesh", meshes[1])
    names = run.report.record("accelerate_mesh", (mesh.mesh_dim_names, tuple(mesh.shape)))
    print0(f"  Fabric's mesh, default sizes: {meshes[0]}")
    print0(f"  Fabric's mesh, data_parallel_size={W}, tensor_parallel_size=1: {meshes[1]}")
    print0(f"  Accelerate's ParallelismConfig(dp_shard_size={W}): {names}")
    diff = max_over_ranks(max_abs_diff_all(fab_params, hand_params))
    sentence = "  Fabric's fully_shard vs by hand: {value:.1e}"
    run.report.claim("fabric_fsdp_equals_fully_shard", diff, "<=", EQUAL, sentence)
    run.report.claim(
        "fabric_fsdp_collectives_equal",
        int(fab_calls == hand_calls),
        "==",
        1,
        "  same collectives as by hand: {value} ({hand})",
        hand=", ".join(f"{k} {v}" for k, v in sorted(hand_calls.items())),
    )
    text = "  Fabric's default data_parallel size: {value} (every rank on tensor_parallel)"
    run.report.claim("fabric_default_data_parallel_size", meshes[0][1][0], "==", 1, text)
    outcome, refused = accelerate_fsdp2_outcome(run.info)
    cut = outcome.find("but got")  # the refusal's point, at the end of a long message
    short = f"{outcome.split(':')[0]}: ... {outcome[cut:]}" if cut > 0 else outcome[:80]
    text = "  Accelerate's FSDP2 plugin here: {short}"
    run.report.value("accelerate_fsdp2", outcome, text, short=short)
    # a fresh Accelerator with it, not the DDP of an earlier state
    if run.info.device.type == "cpu":
        text = "  ... refused on this CPU (ValueError, ... but got MULTI_CPU): {value}"
        run.report.claim("accelerate_fsdp2_refused_on_cpu", int(refused), "==", 1, text)


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        run = Run(args, info, Report(info), indexed(digits_split()[0]))
        run.report.record("world_size", info.world_size)
        runs, fabric = section1(run)
        compare(run, runs)
        section2(run, fabric)
        if info.distributed:
            section3(run)
        run.report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
