"""A GPU target's build before any work (issue: a new user's first hour): `--dry-run` answers from the architecture
alone (the plan, every stage's command, the download and each stage's estimated time here) without downloading,
converting, calibrating or writing anything; without a GPU (or TensorRT-LLM) the build stops with exit 2 before any
of that, naming what is missing, the dry run and `--checkpoints-on-cpu`.

The build runs through its Python API here (a UserError is the CLI's exit 2); the two CLI runs at the end are the
help's GPU example as a user types it, offline with an empty cache, timed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from test_compile import pretend_no_gpu
from test_sources import cache_model

import pipeline.calibrate
import pipeline.compile as compile_module
from pipeline.compile import relative_paths
import pipeline.convert
import pipeline.sources
from pipeline.build import BuildOptions, build
from pipeline.build_preview import GPTQ_LAYER_S, calibrate_step, download_step
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.model.arch_config import parameter_count
from pipeline.plan import load_plan, plan_json
from pipeline.presets import PRESETS

HELP_EXAMPLE = ["llama-3-8b", "--target", "rtx4090", "--precision", "fp8"]


@pytest.fixture(scope="module")
def tiny_model(tiny_llama, tmp_path_factory):
    from support.models import buildable_copy

    return buildable_copy(tiny_llama("gqa"), tmp_path_factory.mktemp("tiny-dry-run") / "tiny")


@pytest.fixture
def no_work(monkeypatch):
    """Converting, calibrating or downloading fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("converted, calibrated or downloaded before a GPU was known to be there")

    monkeypatch.setattr(pipeline.convert, "convert_model", forbidden)
    monkeypatch.setattr(pipeline.calibrate, "calibrate_checkpoint", forbidden)
    monkeypatch.setattr(pipeline.sources, "download_model", forbidden)


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    """Offline (conftest), with an empty trtpipe cache and Hugging Face cache; returns both."""
    caches = tmp_path / "trtpipe-cache", tmp_path / "hub"
    for cache in caches:
        cache.mkdir()
    monkeypatch.setenv("TRTPIPE_CACHE", str(caches[0]))
    monkeypatch.setenv("HF_HUB_CACHE", str(caches[1]))
    return caches


def gpu_options(model, out: Path, **settings) -> BuildOptions:
    return BuildOptions(model=str(model), target="rtx4090", precision="fp8", out=out, progress=False, **settings)


def dry_run(model, out: Path, monkeypatch, **settings):
    def asked():
        raise AssertionError("a dry run must not check for a GPU")

    monkeypatch.setattr(compile_module, "missing_build_requirements", asked)
    said = []
    summary = build(gpu_options(model, out, dry_run=True, **settings), say=said.append)
    assert not said and not out.exists()
    return summary


def test_a_gpu_dry_run_converts_nothing_and_prints_every_command(tiny_model, tmp_path, no_work, monkeypatch):
    out = tmp_path / "out"
    summary = dry_run(tiny_model, out, monkeypatch)
    text = summary.render()
    assert [s.stage for s in summary.preview.steps] == ["convert", "calibrate", "plan", "compile", "deploy",
                                                        "validate"]   # a local model: nothing to download
    for command in (f"trtpipe convert {tiny_model} -o {out / 'checkpoint'}",
                    f"trtpipe calibrate {out / 'checkpoint'} -o {out / 'checkpoint-fp8'} --precision fp8",
                    f"trtpipe plan {out / 'checkpoint-fp8'} --target rtx4090 --precision fp8 -o {out / 'plan.json'}",
                    f"trtpipe compile {out / 'checkpoint-fp8'} --plan {out / 'plan.json'} -o {out / 'engine'}",
                    f"trtpipe deploy --engine {out / 'engine'} --checkpoint {out / 'checkpoint-fp8'}"):
        assert command in text
    assert f"engine build command (run it on the GPU machine):\n  trtllm-build --checkpoint_dir {out}" in text
    assert "nothing was downloaded, converted or written" in text and "--checkpoints-on-cpu" in text
    assert summary.stages == [] and summary.passed is None
    assert summary.to_dict()["preview"]["plan"]["backend"] == "engine"


def test_the_dry_runs_commands_are_the_clis(tiny_model, tmp_path, no_work, monkeypatch):
    """Every `trtpipe ...` line parses with the command it names (an option renamed there fails here)."""
    steps = dry_run(tiny_model, tmp_path / "out", monkeypatch, sparsity="2:4", distill_tokens=64,
                    calibration_samples=4).preview.steps
    commands = [shlex.split(s.command)[1:] for s in steps if s.command.startswith("trtpipe ")]
    assert {c[0] for c in commands} == {"convert", "sparsify", "distill", "calibrate", "plan", "compile", "deploy",
                                        "validate"}
    for name, *args in commands:
        main.get_command(click.Context(main), name).make_context(name, args)


def test_the_pytorch_backends_dry_run_exports_and_compiles_nothing(tiny_model, tmp_path, no_work, monkeypatch):
    out = tmp_path / "out"
    preview = dry_run(tiny_model, out, monkeypatch, backend="pytorch").preview
    assert [s.stage for s in preview.steps] == ["convert", "calibrate", "plan", "deploy", "validate"]
    assert "--format both" in preview.steps[1].command and preview.engine_command is None
    assert f"--checkpoint {out / 'checkpoint-fp8' / 'hf'}" in preview.steps[3].command


@pytest.mark.parametrize("precision,kv", [("fp8", "fp8"), ("int8-sq", "int8"), ("fp16", "float16")])
def test_build_calibrates_the_kv_cache_plan_plans_for_the_same_flags(precision, kv, tmp_path, no_work, monkeypatch):
    """`plan llama-3-8b --target rtx4090 --precision fp8` plans an FP8 KV cache: the build of the same flags
    calibrates one (--kv-cache fp8 in its calibrate command), and its plan says the same."""
    from click.testing import CliRunner

    planned = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", precision,
                                        "--json"])
    assert planned.exit_code == 0, planned.output
    assert f'"kv_cache_dtype": "{kv}"' in planned.output
    monkeypatch.setattr(pipeline.sources, "download_model", lambda *a, **k: pytest.fail("downloaded"))
    summary = build(BuildOptions(model="llama-3-8b", target="rtx4090", precision=precision, out=tmp_path / "o",
                                 progress=False, dry_run=True), say=lambda m: None)
    assert summary.preview.plan.kv_cache_dtype == kv
    calibrate = [s.command for s in summary.preview.steps if s.stage == "calibrate"]
    assert all(f"--kv-cache {kv}" in c for c in calibrate) and (precision == "fp16") == (not calibrate)


def test_the_helps_gpu_example_dry_runs_offline_with_an_empty_cache(empty_caches, tmp_path, no_work, monkeypatch):
    out = tmp_path / "out"
    summary = dry_run(HELP_EXAMPLE[0], out, monkeypatch)
    text = summary.render()
    assert "  download   16.1 GB  hf download meta-llama/Meta-Llama-3-8B --include config.json" in text
    assert summary.preview.download_bytes == 8_030_261_248 * 2      # Llama-3-8B's parameters in bfloat16
    calibrate = next(s for s in summary.preview.steps if s.stage == "calibrate")
    assert calibrate.seconds > 32 * GPTQ_LAYER_S and "GPTQ" in calibrate.basis
    assert "download 16.1 GB, then about" in text and "not measured here" in text
    assert [list(cache.iterdir()) for cache in empty_caches] == [[], []]


def test_a_hub_id_whose_config_alone_is_here_dry_runs(tiny_model, empty_caches, tmp_path, no_work, monkeypatch):
    cache_model(empty_caches[1], "some-org/tiny", [tiny_model / "config.json"])
    preview = dry_run("some-org/tiny", tmp_path / "out", monkeypatch).preview
    download = preview.steps[0]
    assert download.command.startswith("hf download some-org/tiny --include")
    assert download.bytes == parameter_count(preview.plan.model.arch) * 4     # the tiny model's float32


def test_a_dry_run_without_the_config_says_what_to_fetch(empty_caches, tmp_path, no_work, monkeypatch):
    with pytest.raises(UserError, match=r"`hf download some-org/absent config\.json`") as err:
        dry_run("some-org/absent", tmp_path / "out", monkeypatch)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_a_gpu_build_without_a_gpu_stops_before_any_work(tiny_model, tmp_path, no_work, monkeypatch):
    pretend_no_gpu(monkeypatch, "TensorRT-LLM 1.2.1 is not importable on this machine")
    out = tmp_path / "out"
    with pytest.raises(UserError) as err:
        build(gpu_options(tiny_model, out), say=print)
    message = str(err.value)
    assert message.startswith("TensorRT-LLM 1.2.1 is not importable on this machine: ")
    assert "nothing was downloaded or written" in message and "trtpipe container" in message
    assert "--dry-run" in message and "--checkpoints-on-cpu (about " in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_build_with_a_gpu_goes_on_to_convert(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_module, "missing_build_requirements", lambda: None)

    def converting(*args, **kwargs):
        raise RuntimeError("converting")

    monkeypatch.setattr(pipeline.convert, "convert_model", converting)
    with pytest.raises(RuntimeError, match="converting"):
        build(gpu_options(tiny_model, tmp_path / "out"), say=print)


def test_the_estimates_scale_what_was_measured():
    """One layer of Llama-3-8B's widths, as benchmarks/bench_scale.py calibrated it (4 x 128 tokens, no perplexity):
    the measured 299 s plus the tokens at eval's rate; half of it on twice the cores."""
    arch = PRESETS["llama-3-8b"].arch
    layer = calibrate_step("", arch, "fp8", 512, 0, 2).seconds / arch.num_hidden_layers
    assert GPTQ_LAYER_S < layer < GPTQ_LAYER_S + 10
    assert calibrate_step("", arch, "fp8", 512, 0, 4).seconds == pytest.approx(layer * arch.num_hidden_layers / 2)
    assert download_step("meta-llama/Meta-Llama-3-8B", arch).bytes == 16_060_522_496


@pytest.mark.slow
@pytest.mark.calibration
def test_the_dry_runs_plan_and_engine_command_are_what_the_build_makes(tiny_model, tmp_path, monkeypatch):
    """The dry run, then --checkpoints-on-cpu --dry-run (convert and calibrate made here, the command written) into the
    same directory: the same plan, the same trtllm-build line."""
    out = tmp_path / "out"
    preview = dry_run(tiny_model, out, monkeypatch, calibration_samples=4).preview
    pretend_no_gpu(monkeypatch)
    build(gpu_options(tiny_model, out, dry_run=True, checkpoints_on_cpu=True, calibration_samples=4), say=print)
    assert plan_json(preview.plan, out) == plan_json(load_plan(out / "plan.json"), out)
    script = (out / "engine" / "trtllm-build.sh").read_text()   # the same command, its paths relative to engine/
    assert f"exec {shlex.join(relative_paths(shlex.split(preview.engine_command), out / 'engine'))}\n" in script


def trtpipe(*args: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([str(Path(sys.executable).parent / "trtpipe"), *args], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120)
    return result, time.monotonic() - started


def test_the_helps_gpu_example_as_typed(tmp_path):
    """`trtpipe build llama-3-8b --target rtx4090 --precision fp8 --dry-run`, offline with empty caches: under 60 s."""
    env = {"HF_HUB_OFFLINE": "1", "TRTPIPE_CACHE": str(tmp_path / "cache"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    result, seconds = trtpipe("build", *HELP_EXAMPLE, "--dry-run", "-o", str(tmp_path / "dry"), env=env)
    assert result.returncode == 0, result.stderr
    assert seconds < 60 and "hf download meta-llama/Meta-Llama-3-8B" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(compile_module.missing_build_requirements() is None, reason="this machine builds engines")
def test_the_helps_gpu_example_without_a_gpu(tmp_path):
    """The same build for real on this machine (no GPU, no TensorRT-LLM): exit 2 within 30 s, nothing written."""
    env = {"HF_HUB_OFFLINE": "1", "TRTPIPE_CACHE": str(tmp_path / "cache"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    result, seconds = trtpipe("build", *HELP_EXAMPLE, "-o", str(tmp_path / "out"), env=env)
    assert result.returncode == 2 and seconds < 30, result.stderr
    assert "--dry-run" in result.stderr and "--checkpoints-on-cpu" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
