"""Launching lessons from notebooks, tests and benchmarks; never imported by a lesson."""
