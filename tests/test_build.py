"""`trtpipe build`: the main job end to end on the embedded default, and the fail-fast cases before it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.cli import main


def build(*args):
    return CliRunner().invoke(main, ["build", *map(str, args)])


@pytest.mark.parametrize("args,message", [
    (["smollm2-135m", "--target", "rtx3090", "--precision", "fp8"], "FP8 needs compute capability 8.9"),
    (["nosuchmodel-xyz", "--target", "cpu", "--precision", "fp8"], "is not a directory, a .gguf file, a preset"),
    (["smollm2-135m", "--target", "no-such-gpu", "--precision", "fp16"], "no-such-gpu"),
])
def test_impossible_builds_stop_before_any_work(tmp_path, args, message):
    out = tmp_path / "out"
    result = build(*args, "-o", out, "--dry-run")
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.slow
def test_smollm2_fp8_on_cpu_builds_validates_and_rebuilds_nothing(tmp_path):
    """The README's main job (with a smaller calibration): every stage, 6/6 checks, then a no-op re-run."""
    out = tmp_path / "smollm2-cpu-fp8"
    result = build("smollm2-135m", "--target", "cpu", "--precision", "fp8", "-o", out, "--samples", "16", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["passed"] is True
    stages = {s["stage"]: s for s in summary["stages"]}
    assert {"convert", "calibrate", "plan", "deploy", "validate"} <= set(stages)
    assert not any(s["skipped"] for s in stages.values())
    report = json.loads((out / "validation" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert all(c["passed"] for c in checks.values()), [c["detail"] for c in checks.values() if not c["passed"]]
    assert checks["golden"]["data"]["mean_token_agreement"] >= 0.7
    quant = json.loads((out / "checkpoint-fp8" / "config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8"
    assert json.loads((out / "build.json").read_text())["passed"] is True

    again = build("smollm2-135m", "--target", "cpu", "--precision", "fp8", "-o", out, "--samples", "16", "--json")
    assert again.exit_code == 0, again.output
    rerun = {s["stage"]: s for s in json.loads(again.stdout[again.stdout.index("{"):])["stages"]}
    assert all(rerun[name]["skipped"] for name in ("convert", "calibrate", "plan", "deploy"))
