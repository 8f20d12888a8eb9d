"""Features chained the way a user chains them: `trtpipe build` for every precision the cpu target accepts, and a
GPU build made with `--checkpoints-on-cpu --dry-run`, each fed to `trtpipe tune`. The cpu fp8 build (the README's main
job) is tuned for real on the embedded Triton; the others with the serving and load generator stood in for (test_tune's
FakeLoad), since what failed there was the planning that comes before any trial is served."""

from __future__ import annotations

import json
from pathlib import Path

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
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p not in ("fp8", "int4-awq")])   # test_build_int4
def test_tune_takes_every_cpu_build(model, precision, fake_load, tmp_path):  # noqa: F811
    out = build(model, tmp_path / precision, "cpu", precision)
    plan = load_plan(out / "plan.json")
    assert replan(plan).to_dict() == plan.to_dict()
    fake = fake_load()
    result = tune(out)
    assert result.exit_code == 0, result.output
    assert len(fake.repos) == 2 and (out / "tune" / "result" / "plan.json").is_file()


@pytest.fixture(scope="module")
def cpu_fp8_build(model, tmp_path_factory):
    """The README's main job (cpu, fp8) on the tiny model, built once for the tests that take its output."""
    return build(model, tmp_path_factory.mktemp("readme") / "fp8", "cpu", "fp8")


def validate_cli(repo: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["validate", str(repo), "-o", str(out), "--max-tokens", "4", "--json", *extra])


def golden_check(report_dir: Path) -> dict:
    report = json.loads((report_dir / "report.json").read_text())
    return next(c for c in report["checks"] if c["name"] == "golden")


@pytest.mark.slow
def test_validate_passes_on_builds_own_repository_without_golden(cpu_fp8_build, tmp_path):
    """`trtpipe validate BUILD/model_repo` with no --golden finds the model the build converted."""
    result = validate_cli(cpu_fp8_build / "model_repo", tmp_path / "v")
    assert result.exit_code == 0, result.output
    golden = golden_check(tmp_path / "v")
    assert golden["passed"] and not golden["skipped"] and golden["data"]["cases"]


@pytest.mark.slow
def test_a_repository_made_stage_by_stage_validates_against_the_model_it_was_converted_from(model, tmp_path):
    """convert -> calibrate -> plan -> deploy -> validate, as docs/usage.md chains them: convert records the model,
    calibrate carries it, plan and deploy pass it on, and validate's golden check runs with no --golden."""
    def run(*args: str):
        result = CliRunner().invoke(main, list(args))
        assert result.exit_code == 0, result.output
        return result

    ckpt, fp8, plan = tmp_path / "ckpt", tmp_path / "ckpt-fp8", tmp_path / "plan.json"
    run("convert", str(model), "-o", str(ckpt))
    run("calibrate", str(ckpt), "-o", str(fp8), "--precision", "fp8", "--samples", "4", "--seq-len", "32")
    run("plan", str(fp8), "--target", "cpu", "--precision", "fp8", "-o", str(plan))
    assert load_plan(plan).model.reference == str(model.resolve())
    run("deploy", "--checkpoint", str(fp8), "--plan", str(plan), "-o", str(tmp_path / "repo"))
    result = validate_cli(tmp_path / "repo", tmp_path / "v")
    assert result.exit_code == 0, result.output
    golden = golden_check(tmp_path / "v")
    assert golden["passed"] and not golden["skipped"]


@pytest.mark.slow
def test_tune_serves_the_readmes_cpu_fp8_build(cpu_fp8_build):
    out = cpu_fp8_build
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
    out = build(model, tmp_path / "gpu", "rtx4090", "fp8", "--checkpoints-on-cpu", "--dry-run")
    fake = fake_load()
    result = tune(out, "--url", "http://127.0.0.1:9")
    assert result.exit_code == 0, result.output
    assert len(fake.repos) == 2
    assert load_plan(out / "tune" / "result" / "plan.json").build_config == load_plan(out / "plan.json").build_config


@pytest.mark.slow
def test_a_sparse_distilled_cpu_build_validates_against_its_own_sparse_model(model, fake_load, tmp_path):  # noqa: F811
    """convert -> sparsify -> distill -> calibrate -> plan -> deploy -> validate, then tune: the golden reference
    is the sparse model (a dense one would fail every sparse build), and the zeros reach the served checkpoint."""
    from safetensors.torch import load_file

    from pipeline.sparsity.pattern import dense_groups

    out = build(model, tmp_path / "sparse", "cpu", "fp8", "--sparsity", "2:4", "--distill-tokens", "2048", "--json")
    summary = json.loads((out / "build.json").read_text())
    stages = [s["stage"] for s in summary["stages"]]
    assert stages[:5] == ["convert", "sparsify", "distill", "export", "calibrate"] and summary["passed"] is True
    assert load_plan(out / "plan.json").model.checkpoint_sparsity == "2:4"
    assert any("no sparse kernels" in w for w in load_plan(out / "plan.json").warnings)
    served = load_file(out / "checkpoint-fp8" / "rank0.safetensors")
    assert all(dense_groups(v.float()) == 0 for k, v in served.items()
               if k.startswith("transformer.layers.") and k.endswith(".weight") and v.dim() == 2)
    fake = fake_load()
    assert tune(out).exit_code == 0 and len(fake.repos) == 2


@pytest.mark.slow
def test_a_sparse_gpu_dry_run_writes_the_weight_sparsity_build(model, tmp_path):
    out = build(model, tmp_path / "gpu-sparse", "rtx4090", "fp16", "--sparsity", "2:4", "--checkpoints-on-cpu",
                "--dry-run")
    assert "--weight_sparsity" in (out / "engine" / "trtllm-build.sh").read_text()
    plan = load_plan(out / "plan.json")
    assert plan.build_config.weight_sparsity and plan.plugin_config.gemm_plugin is None


@pytest.mark.parametrize("args, says", [
    (["--distill-tokens", "100"], "give both"),
    (["--sparsity", "2:4", "--distill-tokens", "0"], "--distill-tokens must be positive"),
])
def test_compression_flags_are_checked_before_any_work(model, args, says, tmp_path):
    result = CliRunner().invoke(main, ["build", str(model), "--target", "cpu", "--precision", "fp8", "-o",
                                       str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "out").exists()
