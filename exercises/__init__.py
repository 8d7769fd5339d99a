"""Exercises with graded answers: a stub file per exercise that you edit, and a grader that runs your code on
a few gloo processes and compares it with PyTorch's own (or with the lesson's reference).

    python -m exercises                  # grade every exercise (your edited files in exercises/)
    python -m exercises ring_allreduce   # grade one
    python -m exercises --reference      # grade the reference solutions (exercises/solutions/) the same way
    python -m exercises --list           # the exercises, with the lesson each belongs to

Work on one exercise at a time: open its file (exercises/NAME.py), read the docstring (the contract, the
shapes, a hint), replace `raise NotImplementedError` with your code, and grade it. A grader's message says
what it expected and what it saw ("rank 1 holds [3, 5], expected [4, 4]: ..."). The solutions are in
exercises/solutions/: look only after your own attempt passes, or after you are truly stuck.
"""

from __future__ import annotations

# name -> (lesson, what you build). The order is the course's order.
EXERCISES: dict[str, tuple[str, str]] = {
    "ring_allreduce": (
        "02",
        "the ring reduce-scatter (rank r keeps chunk r), all-reduce from isend/irecv",
    ),
    "ddp_by_hand": (
        "03",
        "data parallelism by hand: broadcast at wrap, async all-reduce per gradient, buckets",
    ),
    "distributed_sampler": (
        "04",
        "a DistributedSampler: shuffle, padding, set_epoch, the rank's slice",
    ),
    "exact_evaluation": (
        "05",
        "exact accuracy, overall and per class, over unpadded, uneven shards",
    ),
    "sync_bn_stats": (
        "06",
        "SyncBatchNorm's global mean and variance over every rank's batch, float32 too",
    ),
    "accumulation": (
        "07",
        "gradient accumulation with no_sync over micro-batches of different sizes",
    ),
    "one_f_one_b": ("09", "the order of a 1F1B pipeline stage's forwards and backwards"),
    "tensor_parallel_mlp": (
        "10",
        "a column- then row-parallel MLP with its two autograd functions",
    ),
    "zero1_optimizer": (
        "13",
        "a sharded optimizer (ZeRO-1) around any torch.optim optimizer and its groups",
    ),
    "hsdp_wrapping": ("14", "HSDP: a 2-D mesh and the fully_shard calls, each block then the root"),
    "reshard_plan": (
        "15",
        "the reading plan of a resharding load: which rows of which saved file a rank reads",
    ),
    "training_state": ("16", "capture and restore the full training state, bit for bit"),
    "compress_hook": (
        "18",
        "a DDP comm hook that sends each bucket in float16 / bfloat16, bit for bit PyTorch's",
    ),
    "ring_attention_merge": (
        "19",
        "the log-sum-exp merge of two partial attentions (ring attention's core)",
    ),
    "moe_dispatch": (
        "20",
        "expert parallelism's dispatch plan: rows per destination rank, their send order",
    ),
    "predict_memory": ("21", "predict the bytes a rank holds under DDP and ZeRO 1-3"),
    "tp_decode_step": (
        "22",
        "one decode step of head-sharded attention: the cache update and the all-reduce",
    ),
    "library_lines": (
        "23",
        "the plain-torch lines fabric.setup, setup_dataloaders and no_backward_sync run for you",
    ),
}
