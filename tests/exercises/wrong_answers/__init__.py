"""Plausible wrong answers, one per exercise: each grader must fail each of them (tests/exercises)."""
