"""Grade an exercise: import the learner's module, say if it is still a stub, run its grader, collect
problems."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from exercises._ranks import RankHung, describe, run_on_ranks

__all__ = ["unsolved_functions", "grade", "grade_many", "module_for", "skipped_collective"]


def module_for(name: str, reference: bool = False) -> str:
    """The import path of exercise `name`: the learner's file, or the reference solution."""
    return f"exercises.solutions.{name}" if reference else f"exercises.{name}"


def _is_stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The body is (a docstring and) `raise NotImplementedError...` and nothing else."""
    body = list(fn.body)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
    ):
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
            names += [
                f"{node.name}.{f.name}"
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(f)
            ]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(node):
            if not any(
                node in getattr(c, "body", [])
                for c in ast.walk(tree)
                if isinstance(c, ast.ClassDef)
            ):
                names.append(node.name)
    return names


@dataclass
class Counted:
    """What a rank's `on_rank` returned, and how many collectives the rank called on the way."""

    value: object
    collectives: int


def _on_rank(grader: str, modules: list[str]):
    """Runs on every rank: yields the grader's `on_rank` for each module in turn (an exception is that
    module's answer), so that an answer reaches the grader even if a later module's mistake kills the
    process. The collectives each rank calls are counted: a rank that skipped one shows as the rank with
    fewer."""
    from exercises.graders._common import collectives_counted

    on_rank = importlib.import_module(f"exercises.graders.{grader}").on_rank
    for module in modules:
        count = [0]
        try:
            # imported before the counting starts, so that a name it binds at import is found (and counted)
            learner = importlib.import_module(module)
            with collectives_counted(count, [learner]):
                answer = on_rank(module)
            yield Counted(answer, count[0])
        except Exception as e:
            error = describe(e)
            error.collectives = count[0]
            yield error


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def skipped_collective(answers: list) -> list[str]:
    """When some ranks answered while others failed waiting in a collective, the ones that answered having
    called fewer collectives: one problem naming the rank(s) that skipped (the waiting ranks' own error,
    gloo's "Connection closed by peer" when the skipper left, says nothing about who)."""
    answered = [r for r, a in enumerate(answers) if isinstance(a, Counted)]
    failed = [r for r, a in enumerate(answers) if not isinstance(a, Counted)]
    if not answered or not failed:
        return []
    fewest = min(answers[r].collectives for r in answered)
    skippers = [r for r in answered if answers[r].collectives == fewest]
    waiting = [
        r
        for r in failed
        if isinstance(answers[r], RankHung)
        or getattr(answers[r], "collectives", None) is None
        or answers[r].collectives > fewest
    ]
    if not waiting:
        return []
    called = [
        answers[r].collectives
        for r in waiting
        if getattr(answers[r], "collectives", None) is not None
    ]
    more = f" called {max(called)} and" if called else ""
    # gloo's text: "[.../pair.cc:537] Read error [127.0.0.1]:20386: Connection reset by peer. This is ..."
    their = re.sub(
        r"^\w+: \[[^\]]*\] ", "", getattr(answers[waiting[0]], "text", str(answers[waiting[0]]))
    )
    their = their.split(". ")[0]
    return [
        f"{_ranks(skippers)} called {fewest} collective(s) and returned, while {_ranks(waiting)}{more} "
        f"waited in one that {_ranks(skippers)} never called (their error: {their}): "
        f"{_ranks(skippers)} skipped a collective. Every rank must call the same collectives in the same "
        f"order: look for a collective under an `if` that depends on the rank or on its data"
    ]


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
        per_rank = run_on_ranks(
            "exercises._grading:_on_rank",
            grader.WORLD_SIZE,
            len(to_run),
            grader=name,
            modules=to_run,
        )
        for i, module in enumerate(to_run):
            got = [answers[i] for answers in per_rank]
            values = [a.value if isinstance(a, Counted) else a for a in got]
            out[module] = skipped_collective(got) or grader.judge(values)
    return out


def grade(name: str, module: str) -> list[str]:
    """The problems of one answer to exercise `name` (empty: it passes)."""
    return grade_many(name, [module])[module]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m exercises")
