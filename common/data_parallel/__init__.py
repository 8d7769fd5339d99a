"""Data parallelism's pieces: samplers, per-rank seeding, SyncBatchNorm, DDP's buffers (lessons 04-06)."""
