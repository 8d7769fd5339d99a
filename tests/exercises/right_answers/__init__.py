"""Right answers other than the reference solution: designs a grader must accept."""
