"""`trtpipe build --backend pytorch` (issue 13): the one-command job for TensorRT-LLM's LLM API on a GPU target.

No compile stage; the plan is the pytorch backend's; deploy serves the Hugging Face twin of the build's
checkpoint (calibrate --format both for fp8, the float checkpoint exported back for fp16), copied into the
repository. Nothing here needs TensorRT-LLM, so with --checkpoints-on-cpu the build deploys on this CPU-only machine;
nothing is served or validated (that needs a GPU and TensorRT-LLM), and the verdict says so."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.check import check_repository
from pipeline.cli import main


def build(*args):
    return CliRunner().invoke(main, ["build", *map(str, args)])


@pytest.fixture(scope="module")
def tiny_model(tiny_llama, tmp_path_factory):
    """The tiny random Llama with a word-level tokenizer and a context long enough for build's default workload."""
    from support.models import buildable_copy

    return buildable_copy(tiny_llama("gqa"), tmp_path_factory.mktemp("tiny-pytorch") / "tiny")


def summary_of(out):
    return json.loads((out / "build.json").read_text())


def texts_under(directory):
    """Every file under `directory` that reads as UTF-8 text."""
    for path in directory.rglob("*"):
        if path.is_file():
            try:
                yield path, path.read_text()
            except UnicodeDecodeError:
                continue


def assert_portable(repo, tmp_path):
    named = [str(p.relative_to(repo)) for p, text in texts_under(repo) if str(tmp_path) in text]
    assert not named, f"files naming the build machine: {named}"


def test_fp8_build_deploys_calibrates_hf_fp8_export_with_no_compile_stage(tiny_model, tmp_path):
    out = tmp_path / "out"
    result = build(tiny_model, "--target", "rtx4090", "--precision", "fp8", "--backend", "pytorch",
                   "--samples", "4", "--checkpoints-on-cpu", "-o", out)
    assert result.exit_code == 0, result.output
    summary = summary_of(out)
    assert [s["stage"] for s in summary["stages"]] == ["convert", "calibrate", "plan", "deploy"]
    assert summary["options"]["backend"] == "pytorch" and summary["passed"] is None
    assert not (out / "engine").exists()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["backend"] == "pytorch" and plan["llm_api"]["options"]["max_batch_size"] >= 1
    assert plan["model"]["source"] == "hf-dir"          # planned from the source model, not the TRT-LLM checkpoint

    served = out / "model_repo" / "tensorrt_llm" / "1" / "model"
    config = json.loads((served / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    assert (served / "hf_quant_config.json").is_file() and (served / "tokenizer.json").is_file()
    exported = load_file(str(out / "checkpoint-fp8" / "hf" / "model.safetensors"))
    deployed = load_file(str(served / "model.safetensors"))
    assert deployed.keys() == exported.keys()
    assert all(torch.equal(deployed[k].float(), exported[k].float()) for k in exported)
    assert deployed["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn

    model_yaml = yaml.safe_load((out / "model_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model_yaml["model"] == "model" and model_yaml["backend"] == "pytorch"
    script = (out / "model_repo" / "trtllm-serve.sh").read_text()
    assert "exec trtllm-serve tensorrt_llm/1/model --backend pytorch" in script
    assert_portable(out / "model_repo", tmp_path)
    assert check_repository(out / "model_repo").ok

    assert "nothing was served here: the pytorch backend needs a GPU" in summary["verdict"]
    assert "nothing was served here" in result.output and "Traceback" not in result.output


def test_fp16_build_exports_the_float_checkpoint_and_rebuilds_nothing(tiny_model, tmp_path):
    out = tmp_path / "out"
    args = (tiny_model, "--target", "rtx4090", "--precision", "fp16", "--backend", "pytorch", "--checkpoints-on-cpu",
            "-o", out)
    result = build(*args)
    assert result.exit_code == 0, result.output
    assert [s["stage"] for s in summary_of(out)["stages"]] == ["convert", "export", "plan", "deploy"]
    served = out / "model_repo" / "tensorrt_llm" / "1" / "model"
    config = json.loads((served / "config.json").read_text())
    assert config["torch_dtype"] == "float16" and "quantization_config" not in config
    assert not (served / "hf_quant_config.json").exists()
    source = load_file(str(tiny_model / "model.safetensors"))
    deployed = load_file(str(served / "model.safetensors"))
    assert deployed.keys() == source.keys()
    for name, tensor in source.items():   # the source's own tensors, cast to the plan's float16
        assert deployed[name].dtype == torch.float16 and torch.equal(deployed[name], tensor.half()), name
    assert_portable(out / "model_repo", tmp_path)

    again = build(*args)
    assert again.exit_code == 0, again.output
    assert all(s["skipped"] for s in summary_of(out)["stages"]), summary_of(out)["stages"]


def test_pytorch_dry_run_deploys_and_says_so(tiny_model, tmp_path):
    out = tmp_path / "out"
    result = build(tiny_model, "--target", "rtx4090", "--precision", "fp16", "--backend", "pytorch", "--dry-run",
                   "--checkpoints-on-cpu", "-o", out)
    assert result.exit_code == 0, result.output
    assert summary_of(out)["verdict"] == "not validated: dry run"
    assert (out / "model_repo" / "tensorrt_llm" / "1" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("args,message", [
    (["--target", "cpu", "--precision", "fp16", "--backend", "pytorch"],
     "reference-llmapi serves the same llmapi request contract there"),
    (["--target", "rtx4090", "--precision", "int8-sq", "--backend", "pytorch"], "no INT8 SmoothQuant linear method"),
    (["--target", "rtx4090", "--precision", "fp16", "--backend", "tensorrt"], "Invalid value for '--backend'"),
])
def test_builds_the_pytorch_backend_cannot_do_stop_before_any_work(tiny_model, tmp_path, args, message):
    out = tmp_path / "out"
    result = build(tiny_model, *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()
