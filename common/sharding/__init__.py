"""Sharded data parallelism: ZeRO by hand and what a shard holds and sends (lesson 13)."""
