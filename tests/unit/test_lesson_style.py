"""The measured lessons stay unpacked: lines <= 110 characters, no assignment expression inside a call's
arguments, no lambda that fills a container as a side effect, no function over 60 lines, no lesson over 450
lines; and their claims carry their fields: no `{{value}}` template inside an f-string, no write into
`report.results` that bypasses the report's methods."""

from __future__ import annotations

import ast

import pytest

from common.run.launch import lesson_path

UNPACKED = sorted(p.stem for p in (lesson_path("03_ddp").parent).glob("[0-9][0-9]_*.py"))
SIDE_EFFECTS = {"append", "extend", "update", "setdefault", "add", "__setitem__"}


def packing(source: str) -> list[str]:
    """Every place where `source` packs code, as 'line N: what'."""
    lines = source.splitlines()
    found = [f"file: {len(lines)} lines > 450"] if len(lines) > 450 else []
    found += [
        f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 110
    ]
    found += [
        f"line {i}: {{{{value}}}} in an f-string"
        for i, line in enumerate(lines, 1)
        if "{{value" in line
    ]
    found += [
        f"line {i}: a write into report.results"
        for i, line in enumerate(lines, 1)
        if "report.results[" in line or "report.results.setdefault" in line
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            args = [*node.args, *(k.value for k in node.keywords)]
            found += [
                f"line {n.lineno}: := inside a call"
                for a in args
                for n in ast.walk(a)
                if isinstance(n, ast.NamedExpr)
            ]
        elif isinstance(node, ast.Lambda):
            found += [
                f"line {node.lineno}: a lambda that calls .{n.func.attr}"
                for n in ast.walk(node.body)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in SIDE_EFFECTS
            ]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > 60:
                found.append(f"line {node.lineno}: {node.name} is {length} lines")
    return found


@pytest.mark.parametrize("lesson", UNPACKED)
def test_the_lesson_is_not_packed(lesson):
    assert packing(lesson_path(lesson).read_text()) == []


def test_the_check_finds_each_kind_of_packing():
    packed = (
        'report.results["x"] = 1\n'
        + 'print(f"{{value:.1f}}")\n'
        + "def f(d):\n    g = lambda k: d.update(k=1)\n    print(y := 2)\n"
        + "    x = 1\n" * 60
        + "z = '"
        + "a" * 110
        + "'\n"
    )
    found = packing(packed)
    assert sorted(f.split(": ", 1)[1] for f in found) == sorted(
        [
            "a write into report.results",
            "{{value}} in an f-string",
            "116 characters",
            ":= inside a call",
            "a lambda that calls .update",
            "f is 63 lines",
        ]
    ), found
