"""Data parallelism's pieces: DDP's references, samplers, per-rank seeding, SyncBatchNorm, DDP's buffers (03-06)."""
