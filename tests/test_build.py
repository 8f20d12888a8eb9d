"""`trtpipe build`: the main job end to end on the embedded default, the fail-fast cases before it, and what
a GPU target's build does when the engine is built, fails to build, or cannot be built on this machine
(the requirement check monkeypatched both ways, a fake trtllm-build on PATH: see test_compile)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_compile import pretend_gpu_box, pretend_no_gpu

import pipeline.compile as compile_module
from pipeline.cli import main
from pipeline.model_repository import read_deployment


def build(*args):
    return CliRunner().invoke(main, ["build", *map(str, args)])


@pytest.mark.parametrize("args,message", [
    (["smollm2-135m", "--target", "rtx3090", "--precision", "fp8"], "FP8 needs compute capability 8.9"),
    (["nosuchmodel-xyz", "--target", "cpu", "--precision", "fp8"], "is not a directory, a .gguf file, a preset"),
    (["smollm2-135m", "--target", "no-such-gpu", "--precision", "fp16"], "no-such-gpu"),
    # the advice names flags build has (issue 25: it advised --input-len / --max-context, which it had not)
    (["smollm2-135m", "--target", "cpu", "--precision", "fp8", "--input-len", "9000"],
     "raise --max-context or shorten the workload"),
    (["smollm2-135m", "--target", "cpu", "--precision", "fp8", "--max-context", "1"], "--max-context"),
])
def test_impossible_builds_stop_before_any_work(tmp_path, args, message):
    out = tmp_path / "out"
    result = build(*args, "-o", out, "--dry-run")
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_the_workload_flags_reach_the_plan(tmp_path, monkeypatch):
    from pipeline import build as build_module

    seen = {}

    def stop_at_the_plan(model, target, precision, *args, workload=None, **kwargs):
        seen["workload"] = workload
        raise build_module.UserError("stopped here")

    monkeypatch.setattr("pipeline.planner.make_plan", stop_at_the_plan)
    result = build("smollm2-135m", "--target", "cpu", "--precision", "fp8", "--input-len", "512",
                   "--output-len", "64", "--max-context", "1024", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "stopped here" in result.output
    assert (seen["workload"].input_len, seen["workload"].output_len, seen["workload"].max_context) == (512, 64, 1024)


@pytest.mark.slow
def test_smollm2_fp8_on_cpu_builds_validates_and_rebuilds_nothing(tmp_path):
    """The README's main job (with a smaller calibration): every stage, every check passed, then a no-op re-run."""
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
    assert (report["repo"], report["server_log"]) == ("model_repo", "validation/server.log")
    # `trtpipe validate out/model_repo` compares with the model the build was made from, as the build's own validate
    assert read_deployment(out / "model_repo").model == "smollm2-135m"
    named = [p.relative_to(out) for p in out.rglob("*.json") if str(tmp_path) in p.read_text()]
    assert not named, f"files naming the build machine's paths (issue 25): {named}"

    again = build("smollm2-135m", "--target", "cpu", "--precision", "fp8", "-o", out, "--samples", "16", "--json")
    assert again.exit_code == 0, again.output
    rerun = {s["stage"]: s for s in json.loads(again.stdout[again.stdout.index("{"):])["stages"]}
    assert all(rerun[name]["skipped"] for name in ("convert", "calibrate", "plan", "deploy"))


def test_the_deployment_records_the_model_the_build_serves(tmp_path, monkeypatch):
    """What `trtpipe validate BUILD/model_repo` takes as its golden reference: a preset or hub id as named, a local
    model by a path the manifest can record without naming the machine (under the build or the home directory), a
    sparse build's own float model; nothing for a path only this machine has (validate then asks for --golden)."""
    from pipeline.build import Checkpoints, served_model
    from pipeline.sources import ModelSource

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out, ckpt = tmp_path / "home" / "builds" / "b", Path("ckpt")
    made = Checkpoints(ckpt, ckpt)
    gguf = ModelSource("smollm2-135m", "gguf", None, tmp_path / "elsewhere" / "x.gguf")
    assert served_model(gguf, made, out) == "smollm2-135m"
    for where, recorded in ((tmp_path / "home" / "models" / "m", True), (out / "m", True),
                            (tmp_path / "elsewhere" / "m", False)):
        where.mkdir(parents=True)
        local = ModelSource(str(where), "hf-dir", None, where)
        assert served_model(local, made, out) == (str(where) if recorded else None)
    sparse = Checkpoints(ckpt, ckpt, golden=out / "sparse-hf")
    assert served_model(local, sparse, out) == str(out / "sparse-hf")


@pytest.fixture(scope="module")
def tiny_model(tiny_llama, tmp_path_factory):
    """The tiny random Llama with a word-level tokenizer of its vocabulary (deploy copies the tokenizer), and
    a context long enough for build's default workload (1024 + 256 tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tmp_path_factory.mktemp("tiny-with-tokenizer") / "tiny"
    shutil.copytree(tiny_llama("gqa"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(101)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return model


def gpu_build(model, out, *extra):
    result = build(model, "--target", "rtx4090", "--precision", "fp16", "-o", out, *extra)
    saved = json.loads((out / "build.json").read_text()) if (out / "build.json").is_file() else None
    return result, saved


def compile_stage(summary: dict) -> dict:
    return next(s for s in summary["stages"] if s["stage"] == "compile")


def test_gpu_build_deploys_the_engine_trtllm_build_wrote(tiny_model, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin")
    out = tmp_path / "out"
    result, summary = gpu_build(tiny_model, out)
    assert result.exit_code == 0, result.output
    assert compile_stage(summary)["detail"] == "engine built" and compile_stage(summary)["status"] == "done"
    assert (out / "engine" / "rank0.engine").is_file()
    config = (out / "model_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert str((out / "engine").resolve()) in config
    assert summary["verdict"].startswith("not validated: serve the repository on the GPU machine")
    assert "no GPU" not in result.output


def test_gpu_build_stops_loudly_when_trtllm_build_fails(tiny_model, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin", mode="fail")
    out = tmp_path / "out"
    result, summary = gpu_build(tiny_model, out)
    assert result.exit_code == 1, result.output
    assert "CUDA out of memory while building layer 3" in result.output
    assert "the engine build failed (trtllm-build exited with status 3)" in result.output
    assert "no GPU" not in result.output and "Traceback" not in result.output
    assert not (out / "model_repo").exists() and not (out / "engine").exists()
    assert summary["passed"] is False and compile_stage(summary)["status"] == "FAILED"
    assert "CUDA out of memory" in summary["tool_output"]
    assert [s["stage"] for s in summary["stages"]] == ["convert", "plan", "compile"]


def test_gpu_build_without_a_gpu_writes_the_command_and_exits_2(tiny_model, tmp_path, monkeypatch):
    pretend_no_gpu(monkeypatch, "no CUDA GPU is visible on this machine")
    out = tmp_path / "out"
    result, summary = gpu_build(tiny_model, out)
    assert result.exit_code == 2, result.output
    assert "command written, not built here: no CUDA GPU is visible on this machine" in result.output
    assert "pass --dry-run" in result.output and "Traceback" not in result.output
    assert "trtllm-build --checkpoint_dir" in (out / "engine" / "trtllm-build.sh").read_text()
    assert not (out / "model_repo").exists()
    assert compile_stage(summary)["status"] == "not built" and summary["passed"] is None


def test_gpu_dry_run_prints_the_command_and_never_asks_for_a_gpu(tiny_model, tmp_path, monkeypatch):
    def unexpected():
        raise AssertionError("a dry run must not check for a GPU")

    monkeypatch.setattr(compile_module, "missing_build_requirements", unexpected)
    out = tmp_path / "out"
    result, summary = gpu_build(tiny_model, out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "engine build command (run it on the GPU machine):\n  trtllm-build --checkpoint_dir" in result.output
    assert compile_stage(summary)["detail"] == "dry run: command written"
    assert summary["verdict"] == "not validated: dry run"
