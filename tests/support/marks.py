"""Markers from what a test runs: a test whose own code, its fixtures' code, or a function of its module that
either calls, starts a Triton server, a calibration or a `trtpipe build` gets `server`, `calibration` or `build`,
and `slow` with it, so `pytest -m "not slow"` runs only what needs none of them."""

from __future__ import annotations

import ast
import inspect
from functools import cache

import pytest

#: What starts each, as it is spelt in the tests' source.
RUNS = {
    "server": ("embedded_server(", "ServerPool(", "triton_pool", "tiny_cpu_server", "validate_repository(",
               '"validate"', '"serve"', '"tune"', "tune_cli(", '"compare"', '"probe"'),
    "calibration": ('"calibrate"', "calibrate_checkpoint("),
    "build": ('"build"',),
}


@cache
def module_functions(module) -> dict[str, str]:
    """Source of each function defined at the top of MODULE (the helpers a test may call)."""
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(text)
    return {n.name: ast.get_source_segment(text, n) or "" for n in tree.body if isinstance(n, ast.FunctionDef)}


def source_of(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def code_of(item) -> str:
    """The test's source, its fixtures' and that of the module functions either names."""
    parts = [source_of(item.function)]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            parts.append(source_of(definition.func))
    helpers = module_functions(item.module) if item.module else {}
    text = "\n".join(parts)
    parts += [code for name, code in helpers.items() if f"{name}(" in text and code not in text]
    return "\n".join(parts)


def kinds_run(code: str) -> list[str]:
    return [kind for kind, spellings in RUNS.items() if any(s in code for s in spellings)]


def mark_what_runs(items) -> None:
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        kinds = kinds_run(code_of(item))
        for kind in kinds:
            item.add_marker(kind)
        if kinds:
            item.add_marker("slow")
