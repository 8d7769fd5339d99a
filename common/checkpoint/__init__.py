"""Checkpoints: DCP saves that reshard, and the whole training state (lessons 13, 16)."""
