"""Collectives by hand: the ring all-reduce, the backend table, and every collective checked (lesson 02)."""
