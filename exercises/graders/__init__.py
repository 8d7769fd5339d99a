"""One grader per exercise, named like it.

A grader module sets `WORLD_SIZE` (0: it grades in one process, no process group) and `FUNCTIONS` (the names
the learner implements), and defines either `check(module) -> list[str]` (in one process) or `on_rank(module)`
(run on every rank of a gloo group, returns what that rank saw) and `judge(answers) -> list[str]`. A list of
problems is empty when the answer is right; each problem is a sentence that says what was expected and what to
look at.
"""
