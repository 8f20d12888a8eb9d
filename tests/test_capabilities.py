"""The capability table (pipeline/backends/capabilities.py): every rule's example refused and its neighbour made by the
stage that consults it, the table's facts pinned to the data they come from, and docs/capabilities.md in step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import TRTLLM_TRITON_RELEASES, TRTLLM_VERSION
from pipeline.backends.capabilities import (FP8_BLOCK, RULES, RULES_BY_KEY, Combination, input_checkpoint_precision,
                                            refusal, require, runnable, runtime_refusal, version_tuple)
from pipeline.backends.llm_api_args import recorded_llm_api_keys
from pipeline.backends.names import ENGINE, PYTORCH, REFERENCE
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.plan import ModelInfo, Overrides, Workload
from pipeline.plan.policy import check_target_supports
from pipeline.planner import make_plan
from pipeline.presets import PRESETS
from pipeline.targets import FP8_MIN_SM, catalogue

REPO = Path(__file__).resolve().parents[1]
LLAMA = PRESETS["llama-3-8b"]
#: a GPU target of each SM the rules' examples name
TARGET_BY_SM = {86: "rtx3090", 89: "rtx4090", 90: "h100"}
#: the quantization_config of a pre-quantized Hugging Face upload, by the precision it declares
UPLOADS = {
    FP8_BLOCK: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8": {"quant_method": "modelopt", "quant_algo": "FP8"},
    "w4a8-awq": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
    "int4-awq": {"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"},
}
#: the precision a plan asks for a pre-quantized upload of each kind
PLANNED_AS = {FP8_BLOCK: "fp8", "fp8": "fp8", "w4a8-awq": "int4-awq", "int4-awq": "int4-awq"}


def plan(c: Combination):
    """make_plan of llama-3-8b for the combination: a pre-quantized upload where the precision is one."""
    upload = UPLOADS.get(c.precision) if c.precision in (FP8_BLOCK, "w4a8-awq") else None
    model = ModelInfo(name="llama-3-8b", source="preset", path=None, arch=LLAMA.arch, source_quantization=upload)
    precision = PLANNED_AS[c.precision] if upload else c.precision
    return make_plan(model, catalogue()[TARGET_BY_SM[c.sm]], precision, c.kv_cache or "auto", 1, Workload(),
                     Overrides(), backend=c.backend)


PLANNED = [rule for rule in RULES if rule.refused.trtllm is None]


def test_every_rule_forbids_its_example_and_allows_its_neighbour():
    for rule in RULES:
        assert refusal(rule.refused) is rule, rule.key
        assert refusal(rule.allowed) is None, rule.key
        assert {k: v for k, v in vars(rule.refused).items() if v != getattr(rule.allowed, k)}, rule.key


@pytest.mark.parametrize("rule", PLANNED, ids=[rule.key for rule in PLANNED])
def test_the_planner_refuses_what_a_rule_forbids_with_its_reason_way_out_and_source(rule):
    with pytest.raises(UserError) as refused:
        plan(rule.refused)
    message = str(refused.value)
    assert f"rule {rule.key}" in message and rule.source in message and rule.way_out in message
    assert plan(rule.allowed).precision


def test_the_engine_path_is_refused_on_a_tensorrt_llm_without_it():
    rule = RULES_BY_KEY["engine-removed-1.3"]
    for c in (rule.refused, rule.allowed):
        args = (catalogue()[TARGET_BY_SM[c.sm]], c.precision, c.kv_cache, 1, 1, LLAMA.arch, c.backend, c.trtllm)
        if c is rule.refused:
            with pytest.raises(UserError, match="rule engine-removed-1.3"):
                check_target_supports(*args)
        else:
            check_target_supports(*args)
    assert runtime_refusal(ENGINE, "1.3.0rc27") is rule and runtime_refusal(PYTORCH, "1.3.0rc27") is None
    assert runtime_refusal(ENGINE, TRTLLM_VERSION) is None


# ---------------------------------------------------------------------------------------------- the facts


def test_fp8_sm89_agrees_with_the_targets_fp8_tensor_cores():
    """The rule's threshold and targets.json's FP8 figures (NVIDIA's datasheets) say the same of every GPU."""
    for target in catalogue().values():
        if target.is_gpu:
            assert (target.fp8_tflops is not None) == (target.sm >= FP8_MIN_SM) == (
                "fp8" in runnable(["fp8"], backend=ENGINE, sm=target.sm)), target.name


def test_every_triton_release_trtpipe_names_runs_the_engine_path():
    """engine-removed-1.3 against the Triton releases trtpipe ships for: all carry TensorRT-LLM 1.2.x or older."""
    assert TRTLLM_VERSION in TRTLLM_TRITON_RELEASES.values()
    for release, version in TRTLLM_TRITON_RELEASES.items():
        assert runtime_refusal(ENGINE, version) is None, release


def test_the_recorded_1_3_llm_api_has_no_engine_build_config_and_1_2_1_has():
    """The engine path's BuildConfig left the LLM API with it: the recorded field lists, read from each version's
    llm_args.py, show it (engine-removed-1.3)."""
    assert "build_config" in recorded_llm_api_keys("1.2.1")["llm_args"]
    assert "build_config" not in recorded_llm_api_keys("1.3.0rc27")["llm_args"]
    assert version_tuple("1.3.0rc27") == (1, 3, 0) and version_tuple("1.2.1") == (1, 2, 1)


def test_pytorch_rules_leave_the_cpu_reference_alone():
    assert runnable(["int8-sq", "fp8", "int4-awq"], backend=REFERENCE, sm=None) == ["int8-sq", "fp8", "int4-awq"]
    require(Combination("fp16", "int8", REFERENCE, None))


@pytest.mark.parametrize("precision", sorted(UPLOADS))
def test_a_pre_quantized_upload_is_read_as_its_precision(precision):
    assert input_checkpoint_precision(UPLOADS[precision]) == precision
    assert input_checkpoint_precision(None) is None
    assert input_checkpoint_precision({"quant_method": "gptq", "bits": 4}) == "gptq"


def test_a_block_scaled_fp8_upload_planned_for_an_rtx4090_exits_2_naming_the_way_out(tmp_path):
    model = tmp_path / "qwen-fp8"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**LLAMA.hf_config, "quantization_config": UPLOADS[FP8_BLOCK]}))
    result = CliRunner().invoke(main, ["plan", str(model), "--target", "rtx4090", "--precision", "fp8",
                                       "--backend", "pytorch"])
    assert result.exit_code == 2, result.output
    assert "FP8 block-scaling GEMM" in result.output and "--precision fp8: per-tensor scales" in result.output
    assert "Traceback" not in result.output
    ok = CliRunner().invoke(main, ["plan", str(model), "--target", "h100", "--precision", "fp8", "--backend",
                                   "pytorch"])
    assert ok.exit_code == 0, ok.output


# ---------------------------------------------------------------------------------------------- the page


def test_docs_capabilities_lists_every_rule_with_its_source():
    text = (REPO / "docs" / "capabilities.md").read_text()
    rules = text.split("## Runtime images")[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9.-]+)` \|.*$", rules, re.M)}
    assert set(rows) == set(RULES_BY_KEY)
    for key, row in rows.items():
        assert RULES_BY_KEY[key].source.split(" ")[0] in row, key
