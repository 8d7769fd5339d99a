"""Inference: the KV cache and tensor-parallel decoding with the cache split by heads (lesson 22)."""
