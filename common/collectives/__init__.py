"""Collectives by hand: the ring all-reduce and the backend table (lesson 02)."""
