"""What 4-bit weights open on a 24 GB card: int4-awq in the planner's memory model, `--precision auto` (the
highest-quality precision that fits), and the refusals that name what would fit."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.plan.memory import weights_per_rank_by_stage
from pipeline.plan.schema import ModelInfo, Workload, load_plan
from pipeline.planner import make_plan
from pipeline.precisions import AUTO_PRECISIONS
from pipeline.presets import PRESETS
from pipeline.targets import GIB, get_target


def preset(name: str) -> ModelInfo:
    return ModelInfo(name=name, source="preset", path=None, arch=PRESETS[name].arch)


def test_int4_weights_are_half_a_byte_plus_float32_group_scales_and_the_smoother():
    """qwen2.5-32b: every linear's in x out / 2 bytes of codes, a float32 scale per row and 128 inputs, AWQ's bf16
    smoother per input; norms, embedding and the untied lm_head in bf16."""
    arch = PRESETS["qwen2.5-32b"].arch
    h, inter, layers, vocab, kv = 5120, 27648, 64, 152064, 8 * 128
    shapes = [(h, h + 2 * kv), (h, h), (h, inter), (h, inter), (inter, h)]        # (in, out): qkv, o, gate, up, down
    per_layer = sum(i * o // 2 + o * (i // 128) * 4 + i * 2 for i, o in shapes) + (h + 2 * kv) * 2 + 2 * h * 2
    expected = layers * per_layer + 2 * vocab * h * 2 + h * 2                      # qkv bias in bf16
    assert weights_per_rank_by_stage(arch, "int4-awq", "bfloat16", 1, 1) == [expected]
    assert expected / GIB == pytest.approx(18.35, abs=0.01)


def test_qwen25_32b_does_not_fit_the_4090_at_fp8_and_names_int4_awq_which_fits_with_its_kv_budget(tmp_path):
    refused = CliRunner().invoke(main, ["plan", "qwen2.5-32b", "--target", "rtx4090", "--precision", "fp8"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "needs 31.96 GiB of weights per GPU; rtx4090 has 23.99 GiB" in refused.output
    assert "a lower precision (int4-awq)" in refused.output
    fits = CliRunner().invoke(main, ["plan", "qwen2.5-32b", "--target", "rtx4090", "--precision", "int4-awq",
                                     "-o", str(tmp_path / "plan.json")])
    assert fits.exit_code == 0, fits.output
    plan = load_plan(tmp_path / "plan.json")
    assert plan.quantization["quant_algo"] == "W4A16_AWQ" and plan.kv_cache_dtype == "bfloat16"
    assert plan.memory.kv_cache_tokens >= 1280 * plan.triton.triton_max_batch_size > 0
    assert f"{plan.memory.kv_cache_tokens} tokens" in fits.output


@pytest.mark.parametrize("name, chosen, rejected", [
    ("llama-3.1-8b", "bf16", ()),
    ("qwen2.5-14b", "fp8", ("bf16",)),
    ("qwen2.5-32b", "int4-awq", ("bf16", "fp8", "int8-sq")),
])
def test_auto_plans_the_highest_quality_precision_that_fits_and_says_why_not_the_others(name, chosen, rejected):
    plan = make_plan(preset(name), get_target("rtx4090"), "auto")
    assert plan.precision == chosen and plan.precision_choice["chosen"] == chosen
    assert tuple(plan.precision_choice["rejected"]) == rejected
    for precision, why in plan.precision_choice["rejected"].items():
        assert f"at {precision} needs" in why and "GiB of weights per GPU" in why
        with pytest.raises(UserError):
            make_plan(preset(name), get_target("rtx4090"), precision)
    assert plan.warnings[0].startswith(f"--precision auto chose {chosen}")


def test_auto_weighs_the_workload_not_only_the_weights():
    """qwen2.5-14b with an fp8 KV cache: its fp8 weights fit, but leave room for fewer than 12 sequences of 8k tokens;
    int4-awq's 9.4 GiB leave room for all 12."""
    long = Workload(input_len=7168, output_len=1024, concurrency=12, max_context=8192)
    plan = make_plan(preset("qwen2.5-14b"), get_target("rtx4090"), "auto", "fp8", workload=long)
    assert plan.precision == "int4-awq" and plan.max_concurrent_sequences >= 12
    held = re.search(r"at fp8 holds (\d+) of the 12 concurrent sequences of 7168 \+ 1024 tokens asked for",
                     plan.precision_choice["rejected"]["fp8"])
    assert held and int(held.group(1)) < 12


def test_auto_where_nothing_fits_gives_every_reason_and_what_would(tmp_path):
    result = CliRunner().invoke(main, ["plan", "llama-3.1-70b", "--target", "rtx4090", "--precision", "auto",
                                       "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no precision fits rtx4090" in result.output
    for precision in AUTO_PRECISIONS:
        assert f"{precision}: llama-3.1-70b at {precision} needs" in result.output
    assert "int4-awq needs 37.79 GiB of weights per GPU" in result.output.replace("at int4-awq ", "int4-awq ")
    assert "more GPUs (--tp 2)" in result.output and not (tmp_path / "plan.json").exists()


def test_auto_for_a_checkpoint_is_its_own_precision(tmp_path):
    model = ModelInfo(name="ckpt", source="checkpoint", path=str(tmp_path), arch=PRESETS["llama-3.1-8b"].arch,
                      checkpoint_quantization={"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None,
                                               "exclude_modules": ["lm_head"]},
                      checkpoint_tp_size=1, checkpoint_pp_size=1)
    plan = make_plan(model, get_target("rtx4090"), "auto")
    assert plan.precision == "int4-awq" and plan.precision_choice is None


def test_auto_plan_json_records_the_choice(tmp_path):
    result = CliRunner().invoke(main, ["plan", "qwen2.5-32b", "--target", "rtx4090", "--precision", "auto",
                                       "-o", str(tmp_path / "plan.json"), "--json"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["precision"] == "int4-awq" and saved["precision_choice"]["chosen"] == "int4-awq"
    assert load_plan(tmp_path / "plan.json").precision_choice == saved["precision_choice"]


def test_int4_timings_come_from_measured_weight_only_gemms_where_nvidia_measured_them_and_say_so():
    """aiconfigurator-core 0.12 holds int4 weight-only GEMMs (the engine path's WeightOnlyQuantMatmul plugin) for the
    A100's TensorRT-LLM 1.0.0 data and none for the L40S's 1.3.0rc20 data the 4090 is derived from: an A100 plan's
    figures are measured, with the per-channel-for-group-wise basis stated; a 4090 plan keeps the speed of light and
    says which data lacks the rows."""
    a100 = make_plan(preset("llama-3.1-8b"), get_target("a100-80g"), "int4-awq")
    assert a100.performance.source == "measured"
    assert "standing in for the group-wise AWQ kernel" in a100.performance.basis
    rtx = make_plan(preset("llama-3.1-8b"), get_target("rtx4090"), "int4-awq")
    assert rtx.performance.source == "speed-of-light"
    assert any("l40s TensorRT-LLM 1.3.0rc20 data has no int4_wo GEMMs" in w for w in rtx.warnings), rtx.warnings


def test_build_auto_builds_the_precision_the_architectures_plan_chose(tmp_path):
    result = CliRunner().invoke(main, ["build", "qwen2.5-32b", "--target", "rtx4090", "--precision", "auto",
                                       "--dry-run", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("--precision auto chose int4-awq: bf16:")
    assert "--precision int4-awq --eval-samples" in result.output      # the calibrate step
    assert not (tmp_path / "out").exists()
