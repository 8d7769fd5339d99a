"""What two or more places share (lessons, notebooks, tests, benchmarks), by concern: one package a concern, one
implementation per concept, one import path per name. The map below lists exactly the tree (a test holds it).

harness: how a lesson runs, reports and ends (imports no topic, no plot, no run tool)
    harness.env              who this process is (torchrun's variables), backend and device
    harness.session          options every lesson shares, the process group's life, errors, rank0_only, run_main
    harness.options          the launchers' legacy --local-rank, its note, comma-separated integer options
    harness.process_exit     the exit status, one thread per process unless told, exiting without finalization
    harness.spawn            mp.spawn instead of torchrun: the parent picks the port, each child its rank
    harness.rendezvous       the restart attempt every node agrees on, for jobs torchrun may restart
    harness.ranks            rank-0 printing, exact (sum, count) reductions, gathering, replica checks
    harness.results          Report: values, [perf] lines and claims, recorded once in the --results JSON
    harness.atomic           atomic checkpoints written by global rank 0
    harness.grid             the parallelism grid: each rank's coordinates and groups by name, on a DeviceMesh
    harness.metrics          evaluation on every rank without counting padded samples twice
    harness.compat           the torch-version differences the lessons bridge

measure: instruments that make the invisible countable, on CPU as on GPU
    measure.counters         DDP comm-hook counter, collective calls / bytes / groups
    measure.dtensor_counts   the same for DTensor and FSDP2
    measure.memory           the memory of a training step, measured from tensors: held and saved bytes
    measure.differences      how far apart two results are, NaN-safe, within a rank and over ranks
    measure.bandwidth        the ring's bytes per rank (2 B (n-1)/n), timing a collective, algbw / busbw
    measure.group_traffic    which collective travelled in which grid group, and the bytes each rank sent
    measure.profiling        where a DDP step's time goes, read from a torch.profiler trace
    measure.precision        mixed precision by name, and how far two training steps end apart
    measure.allocations      bytes allocated in a block, at named points and at the peak (the profiler)

topics: a lesson's namesake algorithm, built by hand and checked against PyTorch's own
    collectives.ring                 the ring all-reduce from send/recv, its schedule and traffic (02)
    collectives.backends             which backend runs which operation on which device (02)
    collectives.checks               every collective checked against the local answer, the ring against it (02)
    data_parallel.samplers           distributed samplers by hand, their contracts, checked against torch (04, 05)
    data_parallel.weighted_sampler   weighted sampling over ranks: one global draw, dealt out; against torch (04)
    data_parallel.sampler_len        a sampler's __len__ and each rank's steps: the blog-post counter-example (04)
    data_parallel.references         what DDP is checked against: its one-process replay, nn.DataParallel (03)
    data_parallel.bucketing          length-grouped batches for variable-length sequences (04)
    data_parallel.seeding            random streams that differ by rank and reproduce on a rerun (05)
    data_parallel.sync_batchnorm     SyncBatchNorm from two all-reduces (06)
    data_parallel.bn_stats           BatchNorm running statistics across ranks; rank 0's run replayed (06)
    data_parallel.ddp_buffers        when DDP sends module buffers (06)
    data_parallel.accumulation       gradient accumulation: the batch arithmetic, each variant's step (07)
    data_parallel.micro_batches      a rank's micro-batches, no_sync but on the last, a counting scaler (07)
    pipeline.naive                   the naive split in one process, and the unsplit step checked against (09)
    pipeline.schedules               stages, micro-batches, GPipe / 1F1B / interleaved orders, the bubble (09)
    pipeline.executor                a send/recv pipeline executor in a schedule's order (09)
    pipeline.stage_timers            when each stage computes, and the bubble that leaves (09)
    pipeline.torch_schedules         torch.distributed.pipelining's schedules, and how step() accumulates (09)
    pipeline.step                    one recorded training step of a rank's stages under any schedule (09)
    tensor_parallel.layers           Megatron-style f / g, column and row parallel layers and blocks (10, 11)
    tensor_parallel.compare          a split module held to its unsplit one: differences, collectives (10)
    tensor_parallel.training         the split model trained beside the unsplit one on the same batches (10)
    sharding.zero                    ZeRO-1/2/3 by hand on flat padded buffers (13)
    sharding.accounting              what a sharded rank holds and sends, ZeRO and FSDP2 (13)
    sharding.fsdp                   FSDP2 in practice: wrapping, predicted bytes, init equal to eager (14)
    sharding.fsdp_steps             one FSDP2 step measured; SGD on sharded slices against one process (14)
    sharding.prefetch               FSDP2's prefetching: the all-gathers' order, the gathered bytes held (14)
    checkpoint.sharded               DCP checkpoints any world size loads, one completion marker (15)
    checkpoint.train_state           the whole training state in one checkpoint (16)
    checkpoint.rng_state             every random stream a step draws from, captured and restored (16)
    fault_tolerance.faults           injected faults, and the events every rank logs meanwhile (16)
    fault_tolerance.timeline         a surviving run's timeline: steps trained twice, restart, work lost (16)
    performance.buckets              DDP's buckets: its rule predicted, all-reduce calls and storage counted (07, 17)
    performance.compile_graphs       torch.compile of a DDP model: the graphs DDPOptimizer cuts (17)
    compression.hooks                PyTorch's compression hooks by name, a plain pass-through, gradients through one (18)
    compression.powersgd             PowerSGD counted from shapes: the numbers it sends, the best rank-r error (18)
    context_parallel.ring_attention  ring attention by hand (19)
    context_parallel.ulysses         Ulysses attention: the split moves from the sequence to the heads (19)
    context_parallel.training        training with cp: the token loss and the gradients summed over cp (19)
    context_parallel.torch_cp        PyTorch's own context_parallel, tried: what happened (19)
    expert_parallel.moe              a mixture-of-experts layer, in one process and over ranks (20)
    expert_parallel.model            lesson 20's transformer with experts in its MLP slot (20)
    expert_parallel.training         its gradients summed where copies live, held to one process (20)
    planning.cost_model              the bytes a rank holds and the bytes it sends (21)
    planning.step_time               a step's FLOPs, a ring collective's time, the alpha-beta fit, MFU (21)
    planning.measured                the bytes a DDP, ZeRO or tensor-parallel rank holds and sends, measured (21)
    planning.planner                 which layout fits a model on G GPUs, and its estimated step time (21)
    planning.assumptions             what the planner assumes: the machine, the model's shape, printed (21)
    planning.cli                     the planner's flags and its printed plan (21)
    planning.closed_forms            the planner's rows written out as closed forms (21)
    planning.transformer             the shared transformer at any size, counted from shapes (21)
    planning.serving                 how much KV cache fits beside the weights: the longest context (22)
    inference.kv_cache               the KV cache, and causal attention of new tokens over it (22)
    inference.tp_decode              tensor-parallel greedy decoding, the cache split by heads (22)
    libraries.accumulation           Accelerate's and Fabric's accumulation idioms, each loss normalisation (23)
    libraries.loaders                how Accelerate's prepared loader deals whole batches to ranks, counted (23)
    libraries.sharding               fully_shard through Fabric's ModelParallelStrategy, Accelerate's FSDP2 here (23)

shared by every topic
    models                   the lessons' small models (CNN, MLP stack, residual MLP, causal transformer)
    data                     the bundled digits and the synthetic sets

exhibits: lesson 12's reproduced failures
    exhibits.frame           the registry, and a context that runs a broken version bounded
    exhibits.collectives     collectives that ranks do not all join
    exhibits.unused_parameters  a parameter that gets no gradient under DDP
    exhibits.uneven          ranks with different amounts of work (and lesson 05's failure demos)
    exhibits.training        training-loop mistakes: a forgotten set_epoch, checkpoints that do not load
    exhibits.batchnorm       BatchNorm mistakes: a batch of one, SyncBatchNorm on CPU
    exhibits.threads         processes launched without OMP_NUM_THREADS, and their threads
    exhibits.loading         loading mistakes: a sampler beside shuffle=True, torch.load without map_location, no NCCL
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
    plots.pipeline           pipeline timelines: F/B boxes per rank, the bubble as white space (09)
    plots.parallel           who holds what in model parallelism (10, 11)
    plots.hang               every rank's Python stack side by side (12)
    plots.zero               ZeRO-1/2/3 and FSDP2: who holds what, and when (13)
    plots.fsdp              FSDP2's knobs as the bytes a rank holds (14)
    plots.checkpoint         who wrote which bytes of a sharded checkpoint, who read them back (15)
    plots.profile            one step per rank, the bucket all-reduces against backward (17)
    plots.compression        bytes against gradient error, one point per comm hook (18)
    plots.inference          which rank caches which heads, the all-reduces of one generated token (22)
    plots.libraries          each library's loss normalisations against the global step (23)

run: used by notebooks, tests and benchmarks, never by a lesson
    run.launch               run a lesson as a user does (torchrun / python) with a timeout
    run.processes            a command with a timeout, its whole process tree killed when it passes
    run.launch_cache         one launch per lesson configuration in a test session
    run.minimal_chain        each minimal script as a diff from its nearest earlier sibling, or whole
    run.notebooks            re-execute every notebook in place (python -m common.run.notebooks)
    run.spawn                mp.spawn from a notebook, bounded
"""
