"""Every script in benchmarks/ imports (its main() is not run): a name moved or removed in the package fails here,
not on the day someone measures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_the_benchmark_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(script.parent))   # as `python benchmarks/X.py` runs it: its siblings import
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
