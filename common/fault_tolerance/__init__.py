"""Injected faults and a run that survives them (lesson 16)."""
