"""Features chained the way a user chains them: `trtpipe build` for every precision the cpu target accepts, and a
GPU build made with `--dry-run`, each fed to `trtpipe tune`. The cpu fp8 build (the README's main job) is tuned
for real on the embedded Triton; the others with the serving and load generator stood in for (test_tune's
FakeLoad), since what failed there was the planning that comes before any trial is served."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from support.models import buildable_copy
from test_tune import fake_load  # noqa: F401  (the fixture)

from pipeline.cli import main
from pipeline.plan import load_plan
from pipeline.precisions import PRECISIONS
from pipeline.planner import replan

TUNE = ["--slo", "ttft_p99<=600s", "--trials", "2", "--concurrency", "1,2", "--prompts", "validate",
        "--requests-per-client", "1", "--max-tokens", "4"]


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    """The tiny Llama with its word tokenizer and a context for build's default workload (1024 + 256 tokens)."""
    return buildable_copy(tiny_llama("gqa"), tmp_path_factory.mktemp("chain") / "tiny")


def build(model, out, target: str, precision: str, *extra: str):
    result = CliRunner().invoke(main, ["build", str(model), "--target", target, "--precision", precision,
                                       "-o", str(out), "--samples", "4", *extra])
    assert result.exit_code == 0, result.output
    return out


def tune(out, *extra: str):
    return CliRunner().invoke(main, ["tune", str(out), "-o", str(out / "tune"), *TUNE, *extra])


@pytest.mark.slow
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "fp8"])
def test_tune_takes_every_cpu_build(model, precision, fake_load, tmp_path):  # noqa: F811
    out = build(model, tmp_path / precision, "cpu", precision)
    plan = load_plan(out / "plan.json")
    assert replan(plan).to_dict() == plan.to_dict()
    fake = fake_load()
    result = tune(out)
    assert result.exit_code == 0, result.output
    assert len(fake.repos) == 2 and (out / "tune" / "result" / "plan.json").is_file()


@pytest.mark.slow
def test_tune_serves_the_readmes_cpu_fp8_build(model, tmp_path):
    out = build(model, tmp_path / "fp8", "cpu", "fp8")
    plan = load_plan(out / "plan.json")
    assert (plan.precision, plan.dtype, plan.kv_cache_dtype) == ("fp8", "float32", "float32")
    result = tune(out)
    assert result.exit_code == 0, result.output
    trials = json.loads((out / "tune" / "result" / "trials.json").read_text())
    assert len(trials["trials"]) == 2
    best = load_plan(out / "tune" / "result" / "plan.json")
    assert best.precision == "fp8" and best.kv_cache_dtype == "float32"


@pytest.mark.slow
def test_tune_takes_a_gpu_dry_run_build(model, fake_load, tmp_path):  # noqa: F811
    out = build(model, tmp_path / "gpu", "rtx4090", "fp8", "--dry-run")
    fake = fake_load()
    result = tune(out, "--url", "http://127.0.0.1:9")
    assert result.exit_code == 0, result.output
    assert len(fake.repos) == 2
    assert load_plan(out / "tune" / "result" / "plan.json").build_config == load_plan(out / "plan.json").build_config
