"""Grade an exercise: import the learner's module, say if it is still a stub, run its grader, collect
problems."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

from exercises._ranks import describe, run_on_ranks

__all__ = ["unsolved_functions", "grade", "grade_many", "module_for"]


def module_for(name: str, reference: bool = False) -> str:
    """The import path of exercise `name`: the learner's file, or the reference solution."""
    return f"exercises.solutions.{name}" if reference else f"exercises.{name}"


def _is_stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The body is (a docstring and) `raise NotImplementedError...` and nothing else."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    target = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(target, ast.Name) and target.id == "NotImplementedError"


def unsolved_functions(module: str) -> list[str]:
    """The functions (and methods) of `module`'s file that still only raise NotImplementedError."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return []
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names += [f"{node.name}.{f.name}" for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(f)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(node):
            if not any(node in getattr(c, "body", []) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)):
                names.append(node.name)
    return names


def _on_rank(grader: str, modules: list[str]):
    """Runs on every rank: yields the grader's `on_rank` for each module in turn (an exception is that
    module's answer), so that an answer reaches the grader even if a later module's mistake kills the
    process."""
    on_rank = importlib.import_module(f"exercises.graders.{grader}").on_rank
    for module in modules:
        try:
            yield on_rank(module)
        except Exception as e:
            yield describe(e)


def grade_many(name: str, modules: list[str]) -> dict[str, list[str]]:
    """{module: problems} for several answers to exercise `name`, graded in ONE launch of its ranks (so a
    test can grade the reference and a wrong answer at the cost of one). Put answers that may hang last."""
    grader = importlib.import_module(f"exercises.graders.{name}")
    out: dict[str, list[str]] = {}
    to_run = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            out[module] = [f"{module} does not import: {describe(e)}"]
            continue
        stubs = unsolved_functions(module)
        if stubs:
            verb = "raises" if len(stubs) == 1 else "raise"
            out[module] = [f"not solved yet: {', '.join(stubs)} still {verb} NotImplementedError"]
        else:
            to_run.append(module)
    if grader.WORLD_SIZE == 0:
        for module in to_run:
            try:
                out[module] = grader.check(module)
            except Exception as e:
                out[module] = [f"the grader's run of your code raised: {describe(e)}"]
        return out
    if to_run:
        per_rank = run_on_ranks("exercises._grading:_on_rank", grader.WORLD_SIZE, len(to_run), grader=name,
                                modules=to_run)
        for i, module in enumerate(to_run):
            out[module] = grader.judge([answers[i] for answers in per_rank])
    return out


def grade(name: str, module: str) -> list[str]:
    """The problems of one answer to exercise `name` (empty: it passes)."""
    return grade_many(name, [module])[module]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m exercises")
