"""Tensor parallelism by hand, Megatron-style (lessons 10, 11)."""
