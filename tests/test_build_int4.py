"""`trtpipe build --target cpu --precision int4-awq`, chained the way a user chains it: the build calibrates the 4-bit
checkpoint and validates its repository on the embedded Triton (torch, and ONNX Runtime's 4-bit MatMulNBits); its
output goes to `compare` against the fp8 build of the same model and to `tune`."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from click.testing import CliRunner
from support.models import buildable_copy, make_tiny_model
from test_tune import fake_load  # noqa: F401  (the fixture)

from pipeline.cli import main
from pipeline.plan import load_plan
from pipeline.planner import replan


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny grouped-query Llama whose widths (128, 256) take 4-bit groups of 64 and 128, with the word tokenizer
    and build's default context."""
    root = tmp_path_factory.mktemp("int4-chain")
    hf = make_tiny_model(root / "hf", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return buildable_copy(hf, root / "model")


def build(model, out, precision: str, *extra: str):
    result = CliRunner().invoke(main, ["build", str(model), "--target", "cpu", "--precision", precision, "-o",
                                       str(out), "--samples", "4", *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def builds(wide_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-builds")
    return {"int4-awq": build(wide_model, root / "int4", "int4-awq"),
            "int4-awq-onnx": build(wide_model, root / "int4-onnx", "int4-awq", "--backend", "reference-onnx"),
            "fp8": build(wide_model, root / "fp8", "fp8")}


def validation(out) -> dict:
    return json.loads((out / "validation" / "report.json").read_text())


def test_the_int4_build_validates_its_4bit_checkpoint(builds):
    out = builds["int4-awq"]
    config = json.loads((out / "checkpoint-int4-awq" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ" and config["quantization"]["group_size"] == 128
    plan = load_plan(out / "plan.json")
    assert (plan.precision, plan.quantization["quant_algo"]) == ("int4-awq", "W4A16_AWQ")
    assert replan(plan).to_dict() == plan.to_dict()
    report = validation(out)
    assert report["passed"] and [c["passed"] for c in report["checks"]] == [True] * 7, report


def test_the_onnx_int4_build_serves_4bit_matmuls(builds):
    out = builds["int4-awq-onnx"]
    model = onnx.load(next((out / "model_repo").rglob("model.onnx")))
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 2 * 5
    assert validation(out)["passed"]


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory):
    """wide_model's shape with an even vocabulary (128: 4-bit lm_head rows pack in pairs) and every linear, lm_head
    included, already on the 4-bit grid of its groups of 64 (each group's values k x amax / 7, k in -7..7): the
    4-bit checkpoint is exact, so validation's golden check of a random tiny model does not rest on near-ties."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("int4-grid")
    hf = make_tiny_model(root / "hf", vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    weights = load_file(hf / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            groups = w.reshape(w.shape[0], -1, 64)
            scale = groups.abs().amax(dim=2, keepdim=True) / 7
            weights[name] = (torch.round(groups / scale) * scale).reshape(w.shape)
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    return buildable_copy(hf, root / "model")


def test_a_4bit_lm_head_build_serves_it_as_matmulnbits(grid_model, tmp_path):
    """--quantize-lm-head: the build's checkpoint holds lm_head in 4 bits, its ONNX export computes it with
    MatMulNBits, and validation passes."""
    out = build(grid_model, tmp_path / "head", "int4-awq", "--backend", "reference-onnx", "--quantize-lm-head")
    quant = json.loads((out / "checkpoint-int4-awq" / "config.json").read_text())["quantization"]
    assert "lm_head" not in quant["exclude_modules"] and quant["exclude_modules"]
    assert load_plan(out / "plan.json").model.quantized_lm_head
    model = onnx.load(next((out / "model_repo").rglob("model.onnx")))
    assert [n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"][-1] == "lm_head.weight"
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 2 * 5 + 1
    report = validation(out)
    assert report["passed"] and [c["passed"] for c in report["checks"]] == [True] * 7, report


def test_compare_takes_the_int4_build_against_the_fp8_build(builds, tmp_path):
    result = CliRunner().invoke(main, [
        "compare", str(builds["fp8"]), str(builds["int4-awq"]), "-o", str(tmp_path / "report"), "--num-prompts", "3",
        "--max-tokens", "8", "--eval-samples", "2", "--max-ppl-increase", "1000%", "--min-bleu", "0"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    a, b = report["builds"]["A"], report["builds"]["B"]
    assert (a["checkpoint"], b["checkpoint"]) == ("checkpoint-fp8", "checkpoint-int4-awq")
    assert a["perplexity"]["perplexity"] != b["perplexity"]["perplexity"]


def test_tune_takes_the_int4_build(builds, fake_load):  # noqa: F811
    out = builds["int4-awq"]
    fake = fake_load()
    result = CliRunner().invoke(main, ["tune", str(out), "-o", str(out / "tune"), "--slo", "ttft_p99<=600s",
                                       "--trials", "2", "--concurrency", "1,2", "--prompts", "validate",
                                       "--requests-per-client", "1", "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert len(fake.repos) == 2
    assert load_plan(out / "tune" / "result" / "plan.json").precision == "int4-awq"
