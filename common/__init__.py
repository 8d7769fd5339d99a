"""What two or more places share (lessons, notebooks, tests, benchmarks), by concern: one package a concern, one
implementation per concept, one import path per name. The map below lists exactly the tree (a test holds it).

harness: how a lesson runs, reports and ends (imports no topic, no plot, no run tool)
    harness.env              who this process is (torchrun's variables), backend and device
    harness.session          options every lesson shares, the process group's life, errors, rank0_only, the exit
    harness.rendezvous       the restart attempt every node agrees on, for jobs torchrun may restart
    harness.ranks            rank-0 printing, exact (sum, count) reductions, gathering, replica checks
    harness.results          Report: values, [perf] lines and claims, recorded once in the --results JSON
    harness.atomic           atomic checkpoints written by global rank 0
    harness.grid             the parallelism grid: each rank's coordinates and groups by name, on a DeviceMesh
    harness.metrics          evaluation on every rank without counting padded samples twice
    harness.compat           the torch-version differences the lessons bridge

measure: instruments that make the invisible countable, on CPU as on GPU
    measure.counters         DDP comm-hook counter, collective calls / bytes / groups, saved-activation bytes
    measure.dtensor_counts   the same for DTensor and FSDP2
    measure.memory           the memory of a training step, measured from tensors
    measure.differences      how far apart two results are, NaN-safe, within a rank and over ranks
    measure.bandwidth        timing a collective, algbw / busbw
    measure.profiling        where a DDP step's time goes, read from a torch.profiler trace
    measure.precision        mixed precision by name, and how far two training steps end apart

topics: a lesson's namesake algorithm, built by hand and checked against PyTorch's own
    collectives.ring                 the ring all-reduce from send/recv, its schedule and traffic (02)
    collectives.backends             which backend runs which operation on which device (02)
    data_parallel.samplers           distributed samplers by hand, with their contracts (04, 05)
    data_parallel.bucketing          length-grouped batches for variable-length sequences (04)
    data_parallel.seeding            random streams that differ by rank and reproduce on a rerun (05)
    data_parallel.sync_batchnorm     SyncBatchNorm from two all-reduces (06)
    data_parallel.bn_stats           BatchNorm running statistics across ranks; rank 0's run replayed (06)
    data_parallel.ddp_buffers        when DDP sends module buffers (06)
    data_parallel.accumulation       gradient accumulation: the batch arithmetic, each variant's step (07)
    pipeline.schedules               stages, micro-batches, GPipe / 1F1B / interleaved orders, the bubble (09)
    pipeline.executor                a send/recv pipeline executor in a schedule's order (09)
    pipeline.stage_timers            when each stage computes, the bubble, the activations held, timelines (09)
    tensor_parallel.layers           Megatron-style f / g, column and row parallel layers and blocks (10, 11)
    sharding.zero                    ZeRO-1/2/3 by hand on flat padded buffers (13)
    sharding.accounting              what a sharded rank holds and sends, ZeRO and FSDP2 (13)
    checkpoint.sharded               DCP checkpoints of FSDP2 state with a completion marker (13)
    checkpoint.reshard               DCP checkpoints of a DDP run that another world size loads (16)
    checkpoint.train_state           the whole training state in one checkpoint (16)
    fault_tolerance.faults           injected faults and the timeline of a run that survives them (16)
    performance.comm_hooks           DDP's communication hooks, counted (17)
    performance.compile_graphs       torch.compile of a DDP model: the graphs DDPOptimizer cuts (17)
    context_parallel.ring_attention  ring attention by hand (19)
    context_parallel.ulysses         Ulysses attention: the split moves from the sequence to the heads (19)
    expert_parallel.moe              a mixture-of-experts layer, in one process and over ranks (20)
    expert_parallel.model            lesson 20's transformer with experts in its MLP slot (20)
    planning.cost_model              the bytes a rank holds, the FLOPs it computes, the bytes it sends (21)
    planning.planner                 which layout fits a model on G GPUs, and its estimated step time (21)
    planning.transformer             the shared transformer at any size, counted from shapes (21)

shared by every topic
    models                   the small models the lessons share (CNN, MLP stack, causal transformer)
    data                     the bundled digits and the synthetic sets

exhibits: lesson 12's reproduced failures
    exhibits.frame           the registry, and a context that runs a broken version bounded
    exhibits.collectives     collectives that ranks do not all join
    exhibits.uneven          ranks with different amounts of work (and lesson 05's failure demos)
    exhibits.training        training-loop mistakes that need no hang to show
    exhibits.gradients       gradient mistakes: accumulation under DDP, GradScaler, a NaN on one rank
    exhibits.nan             one rank's NaN reaches every rank
    exhibits.launchers       launch mistakes, with real launchers as bounded subprocesses
    exhibits.jobs            two jobs on one rendezvous endpoint
    exhibits.worker          the scripts the exhibits launch as processes
    exhibits.hang_stacks     a real, bounded hang and the stack of every rank

plots: the notebooks' pictures, drawn from the runs' own tensors
    plots.style              small matplotlib helpers
    plots.collectives        each collective before and after, one box per rank (02)
    plots.buckets            DDP's gradient buckets as a timeline (03)
    plots.data_movement      data movement in notebooks 06-08
    plots.parallel           who holds what in model parallelism (10, 11)
    plots.hang               every rank's Python stack side by side (12)
    plots.zero               ZeRO-1/2/3 and FSDP2: who holds what, and when (13)
    plots.profile            one step per rank, the bucket all-reduces against backward (17)

run: used by notebooks, tests and benchmarks, never by a lesson
    run.launch               run a lesson as a user does (torchrun / python) with a timeout
    run.launch_cache         one launch per lesson configuration in a test session
    run.notebooks            re-execute every notebook in place (python -m common.run.notebooks)
    run.spawn                mp.spawn from a notebook, bounded
"""
