"""What two or more places share (lessons, notebooks, tests, benchmarks), one job per module, by concern.

The harness (how a lesson runs, reports and ends):
    env             who this process is (torchrun's variables), backend and device
    session         options every lesson shares, the process group's life, errors, rank0_only, the exit
    ranks           rank-0 printing, exact (sum, count) reductions, gathering, replica checks
    results         Report: values, [perf] lines and claims, recorded once in the --results JSON
    launch          run a lesson as a user does (torchrun / python) with a timeout, from a notebook or test
    checkpoint      atomic checkpoints written by global rank 0
    compat          the torch-version differences the lessons bridge
    notebooks       re-execute every notebook in place (python -m common.run.notebooks)
    data, models, metrics   the bundled digits, small models, evaluation without double-counted padding

Subject matter (what the lessons teach, built by hand and checked against PyTorch's own):
    ring, backends                       collectives: the ring all-reduce, the backend table (02)
    samplers, bucketing, seeding         distributed samplers, length grouping, per-rank random streams (04, 05)
    sync_batchnorm, bn_stats, ddp_buffers   SyncBatchNorm and what DDP does with buffers (06)
    precision, memory                    mixed precision, the bytes of a training step (07, 08)
    pipeline_schedules, pipeline_executor   pipeline stages and schedules, a send/recv executor (09)
    grid                                 the parallelism grid on a DeviceMesh (06, 09, 10, 11, 13)
    tensor_parallel                      Megatron-style f / g, column and row parallel layers (10, 11)
    zero, shard_accounting, sharded_checkpoint   ZeRO stages, what a shard holds and sends, DCP checkpoints (13)
    train_state, faults, reshard         full training state, injected faults, resharding checkpoints (14)
    spawn                                mp.spawn from a notebook (03)
    exhibits, exhibits_*, hang_stacks    reproduced failures and a real hang (12)

Instruments (make the invisible countable, on CPU as on GPU):
    counters        DDP comm-hook counter, collective calls / bytes / groups, saved-activation bytes
    dtensor_counts  the same for DTensor and FSDP2
    bandwidth       timing a collective, algbw / busbw
    stage_timers    when each pipeline stage computes, the bubble, timelines

Plots: plotting (and the timeline plot in stage_timers).
"""
