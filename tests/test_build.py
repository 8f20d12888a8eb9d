"""`trtpipe build`: the main job end to end on the embedded default, the fail-fast cases before it, and what
a GPU target's build does when the engine is built, fails to build, or cannot be built on this machine with
--checkpoints-on-cpu (the requirement check monkeypatched both ways, a fake trtllm-build on PATH: see test_compile).
A GPU target's dry run and its refusal without a GPU: test_build_dry_run."""

from __future__ import annotations

import json
import shutil
from contextlib import chdir
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_compile import pretend_gpu_box, pretend_no_gpu

from pipeline.cli import main
from pipeline.model_repository import read_deployment


def build(*args):
    return CliRunner().invoke(main, ["build", *map(str, args)])


@pytest.mark.parametrize("args,message", [
    (["smollm2-135m", "--target", "rtx3090", "--precision", "fp8"],
     "FP8 weights or KV cache need compute capability 8.9"),
    (["nosuchmodel-xyz", "--target", "cpu", "--precision", "fp8"], "is not a directory, a .gguf file, a preset"),
    (["smollm2-135m", "--target", "no-such-gpu", "--precision", "fp16"], "no-such-gpu"),
    # the advice names flags build has (issue 25: it advised --input-len / --max-context, which it had not)
    (["smollm2-135m", "--target", "cpu", "--precision", "fp8", "--input-len", "9000"],
     "raise --max-context or shorten the workload"),
    (["smollm2-135m", "--target", "cpu", "--precision", "fp8", "--max-context", "1"], "--max-context"),
    (["smollm2-135m", "--target", "cpu", "--precision", "fp8", "--checkpoints-on-cpu"], "is for GPU targets"),
    (["smollm2-135m", "--target", "rtx4090", "--precision", "fp16", "--checkpoints-on-cpu", "--device", "cuda"],
     "drop --device cuda"),
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
def test_smollm2_fp8_on_cpu_builds_validates_and_rebuilds_nothing(tmp_path, monkeypatch):
    """The README's main job (with a smaller calibration, -o relative as the README has it): every stage, every
    check passed, a build folder a person can read, then a no-op re-run."""
    monkeypatch.chdir(tmp_path)
    out = Path("out") / "smollm2-cpu-fp8"
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
    record = json.loads((out / "build.json").read_text())
    assert record["passed"] is True and record["options"]["out"] == "."
    assert {s["stage"]: s["path"] for s in record["stages"]}["calibrate"] == "checkpoint-fp8"   # relative to OUT
    assert_summary_leads_somewhere(out)
    assert (report["repo"], report["server_log"]) == ("model_repo", "validation/server.log")
    # `trtpipe validate out/model_repo` compares with the model the build was made from, as the build's own validate
    assert read_deployment(out / "model_repo").model == "smollm2-135m"
    named = [p.relative_to(out) for p in out.rglob("*.json") if str(tmp_path) in p.read_text()]
    assert not named, f"files naming the build machine's paths (issue 25): {named}"

    again = build("smollm2-135m", "--target", "cpu", "--precision", "fp8", "-o", out, "--samples", "16", "--json")
    assert again.exit_code == 0, again.output
    rerun = {s["stage"]: s for s in json.loads(again.stdout[again.stdout.index("{"):])["stages"]}
    assert all(rerun[name]["skipped"] for name in ("convert", "calibrate", "plan", "deploy"))


def assert_summary_leads_somewhere(out: Path) -> None:
    """SUMMARY.md: the verdict, every stage's folder, and next commands the CLI parses from the build folder."""
    import shlex

    import click

    text = (out / "SUMMARY.md").read_text()
    assert "**Verdict:** passed" in text and "`model_repo`" in text and "`checkpoint-fp8`" in text
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]
    assert [c[1] for c in commands] == ["serve", "validate", "tune", "package", "k8s"]
    with chdir(out):
        for words in commands:
            command = main.get_command(click.Context(main), words[1])
            command.make_context(words[1], words[2:])      # parses: every flag and argument exists


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


def test_checkpoints_on_cpu_without_a_gpu_say_their_cost_then_write_the_command_and_exit_2(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """The explicit choice of making a GPU target's checkpoints here: the cost first, then the old no-GPU path."""
    pretend_no_gpu(monkeypatch, "no CUDA GPU is visible on this machine")
    out = tmp_path / "out"
    result, summary = gpu_build(tiny_model, out, "--checkpoints-on-cpu")
    assert result.exit_code == 2, result.output
    said = "--checkpoints-on-cpu: making the checkpoints here on the CPU: about "
    assert said in result.output and result.output.index(said) < result.output.index("[convert]")
    assert "command written, not built here: no CUDA GPU is visible on this machine" in result.output
    assert "with --checkpoints-on-cpu, --dry-run stops there with exit 0" in result.output
    assert "Traceback" not in result.output
    assert "trtllm-build --checkpoint_dir" in (out / "engine" / "trtllm-build.sh").read_text()
    assert not (out / "model_repo").exists()
    assert compile_stage(summary)["status"] == "not built" and summary["passed"] is None
    assert summary["options"]["device"] == "cpu"
