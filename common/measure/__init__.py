"""Instruments that make communication, memory, differences and time countable, on CPU as on GPU."""
