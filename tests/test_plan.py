"""The plan stage: memory and KV figures against hand-computed values, profile derivation against
TensorRT-LLM 1.2.x's rules, the agreement between build and Triton parameters, and every fail-fast case."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.plan import (
    BuildConfig,
    ModelInfo,
    Overrides,
    PluginConfig,
    Workload,
    derive_profiles,
    kv_bytes_per_token,
    load_plan,
    plan_document,
    resolve_model_info,
    save_plan,
    split_num_tokens_range,
)
from pipeline.planner import make_plan
from pipeline.presets import PRESETS
from pipeline.targets import GIB, MIB, catalogue, get_target
from pipeline.model.arch_config import parameter_count
from pipeline.model.layout import check_parallelism

# Published parameter counts of the models (their Hugging Face model cards / safetensors index).
LLAMA2_7B_PARAMS = 6_738_415_616
LLAMA3_8B_PARAMS = 8_030_261_248
MISTRAL_7B_PARAMS = 7_241_732_096


def preset(name: str) -> ModelInfo:
    return ModelInfo(name=name, source="preset", path=None, arch=PRESETS[name].arch)


def plan_for(name="llama-3-8b", target="rtx4090", precision="fp16", kv="auto", tp=1, workload=None, pp=1, **over):
    return make_plan(preset(name), get_target(target), precision, kv, tp, workload or Workload(), Overrides(**over),
                     pp=pp)


# ---------------------------------------------------------------------------------------------- KV


@pytest.mark.parametrize("name, kv, tp, expected", [
    # 2 (K,V) x layers x KV heads on the GPU x head size x bytes
    ("llama-3-8b", "float16", 1, 2 * 32 * 8 * 128 * 2),      # = 131072, the figure
    ("llama-3-8b", "fp8", 1, 2 * 32 * 8 * 128 * 1),
    ("llama-3-8b", "float16", 2, 2 * 32 * 4 * 128 * 2),      # TP splits the KV heads
    ("llama-3-8b", "float16", 16, 2 * 32 * 1 * 128 * 2),     # tp > KV heads: heads duplicated, 1 per GPU
    ("llama-2-7b", "float16", 1, 2 * 32 * 32 * 128 * 2),     # MHA: 512 KiB per token
    ("llama-2-7b", "int8", 4, 2 * 32 * 8 * 128 * 1),
    ("mistral-7b", "float16", 1, 2 * 32 * 8 * 128 * 2),
])
def test_kv_bytes_per_token_by_hand(name, kv, tp, expected):
    assert kv_bytes_per_token(PRESETS[name].arch, kv, tp) == expected


def test_llama3_fp16_kv_figure_in_plan():
    assert plan_for().kv_bytes_per_token == 131072
    assert plan_for(precision="fp8").kv_bytes_per_token == 65536   # auto KV for fp8 weights is FP8


# ----------------------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name, params", [
    ("llama-2-7b", LLAMA2_7B_PARAMS), ("llama-3-8b", LLAMA3_8B_PARAMS), ("mistral-7b", MISTRAL_7B_PARAMS),
])
def test_fp16_weights_are_the_published_parameter_count_times_two(name, params):
    plan = plan_for(name, target="h100")
    assert plan.weights_bytes == plan.weights_bytes_per_rank == 2 * params


def test_llama3_fp8_weights_by_hand():
    h, i, v, layers, q, kv = 4096, 14336, 128256, 32, 4096, 1024
    linear = h * (q + 2 * kv) + q * h + 3 * h * i           # qkv, dense, fc, gate, proj weights
    scales = 5 * 2 * 4                                       # per-tensor weight + activation scale each
    norms = 2 * h * 2
    expected = layers * (linear + scales + norms) + 2 * v * h * 2 + h * 2   # embedding + lm_head (bf16) + ln_f
    plan = plan_for(precision="fp8")
    assert plan.dtype == "bfloat16"
    assert plan.weights_bytes_per_rank == expected


def test_pipeline_parallel_splits_layers_and_puts_embedding_and_lm_head_at_the_ends():
    plan = plan_for(target="h100", pp=2)
    h, i, v, q, kv = 4096, 14336, 128256, 4096, 1024
    per_layer = (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h) * 2
    assert plan.weights_bytes_per_rank == 16 * per_layer + v * h * 2 + h * 2   # last stage: lm_head + ln_f
    assert plan.weights_bytes == 2 * LLAMA3_8B_PARAMS
    assert plan.kv_bytes_per_token == 2 * 16 * 8 * 128 * 2                   # 16 layers per GPU


def test_llama3_tp2_weights_per_rank_by_hand():
    h, i, v, layers, q, kv = 4096, 14336, 128256, 32, 4096, 1024
    per_layer = (h * (q + 2 * kv) + q * h + 3 * h * i) // 2 * 2 + 2 * h * 2
    expected = layers * per_layer + v * h * 2 + v // 2 * h * 2 + h * 2   # embedding whole, lm_head split
    plan = plan_for(target="h100", tp=2)
    assert plan.weights_bytes_per_rank == expected
    assert plan.weights_bytes == 2 * expected


# ------------------------------------------------------------------------------ memory and batches


def test_memory_budget_adds_up_and_sets_the_concurrency(no_aic):
    plan = plan_for()
    mem = plan.memory
    # activations: max_num_tokens x 2 bytes x (2*hidden + 3*intermediate) + max_batch x vocab x 4
    b = plan.build_config
    assert b.max_num_tokens == 1024   # the typical 1024-token prompt, a power of two
    assert mem.activation_bytes == 1024 * 2 * (2 * 4096 + 3 * 14336) + b.max_batch_size * 128256 * 4
    usable = 24564 * MIB   # what an RTX 4090 reports
    assert mem.free_bytes == usable - plan.weights_bytes_per_rank - mem.activation_bytes - mem.runtime_reserve_bytes
    tokens = int(mem.free_bytes * 0.9) // 131072 // 32 * 32
    assert mem.kv_cache_tokens == tokens
    assert plan.max_concurrent_sequences == tokens // 1280 == b.max_batch_size
    # one more sequence would not fit: the planned batch is the largest
    bigger = plan_for(max_batch_size=b.max_batch_size + 1)
    assert bigger.memory.kv_cache_tokens // 1280 < b.max_batch_size + 1
    # about 7 GiB remain on a 24 GiB card after 15 GiB of FP16 Llama-3-8B weights
    assert 6 * GIB < mem.kv_cache_bytes < 7.5 * GIB


def test_fp8_holds_more_sequences_than_fp16():
    fp16, fp8 = plan_for(), plan_for(precision="fp8")
    assert fp8.max_concurrent_sequences > 3 * fp16.max_concurrent_sequences
    assert fp8.roofline.decode_tokens_per_s_per_seq_batch1 > 1.7 * fp16.roofline.decode_tokens_per_s_per_seq_batch1


def test_concurrency_target_sets_the_batch():
    plan = plan_for(workload=Workload(concurrency=16))
    assert plan.build_config.max_batch_size == plan.triton.triton_max_batch_size == 16
    assert plan.max_concurrent_sequences == 16


def test_concurrency_beyond_capacity_is_a_warning_not_a_bigger_batch():
    plan = plan_for(workload=Workload(concurrency=500))
    assert plan.build_config.max_batch_size < 500
    assert any("--concurrency 500" in w for w in plan.warnings)


def test_latency_budget_bounds_the_batch(no_aic):
    """Without aiconfigurator-core the roofline bounds the batch (test_performance.py: with it)."""
    free = plan_for(workload=Workload(input_len=512, output_len=512))
    budget = (free.roofline.request_latency_s_batch1 + free.roofline.request_latency_s) / 2
    capped = plan_for(workload=Workload(input_len=512, output_len=512, p99_latency_s=budget))
    assert capped.build_config.max_batch_size < free.build_config.max_batch_size
    assert capped.roofline.request_latency_s <= budget
    r = capped.roofline
    one_more = r.prefill_s_per_request + 512 * (r.decode_step_s + (r.decode_step_s - r.decode_step_s_batch1)
                                                / max(1, r.batch - 1))
    assert one_more > budget


def test_roofline_by_hand():
    plan = plan_for(workload=Workload(input_len=1024, output_len=256, concurrency=8))
    read = plan.weights_bytes_per_rank - 128256 * 4096 * 2   # a step gathers rows of the embedding table only
    step1 = (read + 1 * (1024 + 128) * 131072) / 1008e9
    assert plan.roofline.decode_step_s_batch1 == pytest.approx(step1)
    step8 = (read + 8 * (1024 + 128) * 131072) / 1008e9
    assert plan.roofline.decode_tokens_per_s_aggregate == pytest.approx(8 / step8)
    linear = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    flops = 2 * linear * 1024 + 2 * 128256 * 4096 + 2 * 32 * 1024 ** 2 * 4096
    assert plan.roofline.prefill_s_per_request == pytest.approx(flops / 165.2e12)


# -------------------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("max_num_tokens, expected", [
    (100, [[1, 64, 64], [64, 100, 100]]),
    (1000, [[1, 64, 64], [64, 128, 128], [128, 256, 256], [256, 512, 512], [512, 1000, 1000]]),
    (1024, [[1, 64, 64], [64, 128, 128], [128, 256, 256], [256, 512, 512], [512, 1024, 1024]]),
    (2048, [[1, 64, 64], [64, 128, 128], [128, 256, 256], [256, 512, 512], [512, 1024, 1024],
            [1024, 2048, 2048]]),
    (8192, [[1, 64, 64], [64, 128, 128], [128, 256, 256], [256, 512, 512], [512, 1024, 1024],
            [1024, 8192, 8192]]),
])
def test_multiple_profiles_split_as_upstream(max_num_tokens, expected):
    assert split_num_tokens_range(max_num_tokens) == expected


def test_multiple_profiles_at_64_tokens_or_fewer_is_refused():
    with pytest.raises(UserError, match="64"):
        split_num_tokens_range(64)


def _profiles(max_num_tokens, max_batch_size=64, opt=None, multiple=False, beam=1, max_seq_len=8192):
    build = BuildConfig(max_input_len=max_seq_len - 1, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                        max_beam_width=beam, max_num_tokens=max_num_tokens, opt_num_tokens=opt)
    return derive_profiles(build, PluginConfig(dtype="float16", multiple_profiles=multiple))


def test_single_profile_uses_opt_num_tokens_default():
    # opt_num_tokens unset -> min(max_batch_size * max_beam_width, max_num_tokens)
    assert [dataclasses.asdict(p) for p in _profiles(8192, max_batch_size=64)] == [
        {"num_tokens": [1, 64, 8192], "batch_size_beam_width": [1, 32, 64], "max_blocks_per_seq": [1, 128, 256]}]
    assert _profiles(2048, max_batch_size=4096)[0].num_tokens == [1, 2048, 2048]
    assert _profiles(2048, opt=512)[0].num_tokens == [1, 512, 2048]


def test_batch_and_block_ranges():
    profiles = _profiles(2048, max_batch_size=163, multiple=True, max_seq_len=4096)
    assert len(profiles) == 6
    for p in profiles:   # default_range(max) = [1, (max + 1) // 2, max] in every profile
        assert p.batch_size_beam_width == [1, 82, 163]
        assert p.max_blocks_per_seq == [1, math.ceil(2048 / 32), 4096 // 32]
    # beam search adds one block of tokens to the KV range: default_range(8192 + 32)
    beam = _profiles(2048, max_batch_size=8, beam=2)[0]
    assert beam.batch_size_beam_width == [1, 8, 16]
    assert beam.max_blocks_per_seq == [1, math.ceil(4112 / 32), 8224 // 32]


def test_plan_profiles_match_its_build_config():
    plan = plan_for()
    b = plan.build_config
    assert plan.plugin_config.multiple_profiles and b.opt_num_tokens is None
    assert [p.num_tokens for p in plan.optimization_profiles] == split_num_tokens_range(b.max_num_tokens)
    single = plan_for(multiple_profiles=False)
    assert single.optimization_profiles[0].num_tokens == [1, min(single.build_config.max_batch_size,
                                                                    single.build_config.max_num_tokens),
                                                             single.build_config.max_num_tokens]


# ------------------------------------------------------------------------------- plugins and Triton


def test_fp16_plugins():
    p = plan_for().plugin_config
    assert p.gemm_plugin == "auto" and p.gpt_attention_plugin == "auto"
    assert p.use_paged_context_fmha and not p.use_fp8_context_fmha
    assert p.context_fmha and p.remove_input_padding and p.paged_kv_cache and p.tokens_per_block == 32


def test_fp8_on_ada_with_fp8_kv_uses_fp8_context_fmha_and_no_gemm_plugin():
    plan = plan_for(precision="fp8")
    assert plan.plugin_config.gemm_plugin is None
    assert plan.plugin_config.use_fp8_context_fmha and plan.plugin_config.use_paged_context_fmha
    assert plan.quantization == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert plan.build_config.strongly_typed


def test_fp8_weights_with_unquantized_kv_have_no_fp8_context_fmha():
    plan = plan_for(precision="fp8", kv="bf16")
    assert plan.kv_cache_dtype == "bfloat16" and not plan.plugin_config.use_fp8_context_fmha


@pytest.mark.parametrize("precision, kv", [("int8-sq", "auto"), ("fp16", "int8"), ("fp16", "fp8")])
def test_kv_caches_that_disable_paged_context_fmha(precision, kv):
    plan = plan_for(precision=precision, kv=kv)
    assert not plan.plugin_config.use_paged_context_fmha
    assert plan.triton.enable_kv_cache_reuse is False and plan.triton.enable_chunked_context is False
    # without chunked context a whole prompt must fit in one step
    assert plan.build_config.max_num_tokens >= plan.build_config.max_input_len
    assert any("paged context FMHA off" in w for w in plan.warnings)


def test_int8_sq_turns_fused_mlp_off_like_trtllm_build():
    assert plan_for(precision="int8-sq").plugin_config.use_fused_mlp is False


def test_triton_parameters_agree_with_the_build():
    plan = plan_for()
    t, b = plan.triton, plan.build_config
    assert t.triton_max_batch_size == b.max_batch_size and t.preferred_batch_size == [b.max_batch_size]
    assert t.max_tokens_in_paged_kv_cache == plan.memory.kv_cache_tokens
    assert t.kv_cache_free_gpu_mem_fraction == 0.9
    assert t.enable_kv_cache_reuse and t.enable_chunked_context and plan.plugin_config.use_paged_context_fmha
    assert t.batching_strategy == "inflight_fused_batching" and t.triton_backend == "tensorrtllm"
    assert t.decoupled_mode is True and t.max_queue_size == 4 * b.max_batch_size


@pytest.mark.parametrize("model, target", [("llama-3-8b", "rtx4090"), ("smollm2-135m", "cpu")])
def test_the_queue_bound_is_stated_with_its_reason_in_the_plan_table(model, target):
    from rich.console import Console

    from pipeline.cli.plan_render import render_plan

    plan = plan_for(model, target=target)
    t = plan.triton
    assert f"({t.max_queue_size} requests)" in t.max_queue_size_reason and "shed" in t.max_queue_size_reason
    console = Console(width=400, record=True)
    for part in render_plan(plan):
        console.print(part)
    row = next(line for line in console.export_text().splitlines() if line.startswith("max_queue_size_reason"))
    assert row.split(maxsplit=1)[1].rstrip() == t.max_queue_size_reason


def test_cpu_plan_has_no_engine_and_cpu_batching():
    plan = plan_for("smollm2-135m", target="cpu")
    assert plan.engine is None and plan.build_config is None and plan.plugin_config is None
    assert plan.optimization_profiles == []
    assert plan.triton.triton_max_batch_size == 8 and plan.triton.triton_backend == "python"
    assert plan.triton.preferred_batch_size == [8] and plan.triton.max_queue_delay_microseconds > 0
    assert plan.dtype == "float32"
    # float32 weights in the reference runtime: the tied SmolLM2 embedding is counted once
    assert plan.weights_bytes == 4 * parameter_count(PRESETS["smollm2-135m"].arch)


#: SmolLM2 with a 32k context: a cpu plan is sized for 8192 tokens unless the workload asks for more.
LONG_CONTEXT = dataclasses.replace(PRESETS["smollm2-135m"].arch, max_position_embeddings=32768)


def test_every_plan_records_the_max_seq_len_it_was_sized_for():
    gpu = plan_for()
    assert gpu.max_seq_len == gpu.build_config.max_seq_len == 8192
    assert make_plan(LONG_CONTEXT, get_target("cpu"), "fp32").max_seq_len == 8192
    asked = make_plan(LONG_CONTEXT, get_target("cpu"), "fp32", workload=Workload(max_context=2048))
    assert asked.max_seq_len == 2048
    assert asked.to_dict()["max_seq_len"] == 2048


def test_a_plan_saved_without_max_seq_len_loads_with_the_context_it_was_sized_for(tmp_path):
    for workload, expected in ((Workload(), 8192), (Workload(max_context=4096), 4096)):
        data = make_plan(LONG_CONTEXT, get_target("cpu"), "fp32", workload=workload).to_dict()
        del data["max_seq_len"]
        (tmp_path / "plan.json").write_text(json.dumps(data))
        assert load_plan(tmp_path / "plan.json").max_seq_len == expected


def test_cpu_accepts_fp8_which_the_reference_runtime_simulates():
    """fp8 weights simulated in float32; the KV cache unquantized under auto (the build's), fp8-rounded when asked
    for, float32 either way."""
    plan = plan_for("smollm2-135m", target="cpu", precision="fp8")
    assert plan.quantization == {"quant_algo": "FP8", "kv_cache_quant_algo": None}
    assert plan.kv_cache_dtype == "float32"
    asked = plan_for("smollm2-135m", target="cpu", precision="fp8", kv="fp8")
    assert asked.quantization == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert asked.kv_cache_dtype == "fp8" and asked.kv_bytes_per_token == plan.kv_bytes_per_token


def test_no_p2p_tensor_parallel_warns():
    assert any("peer-to-peer" in w for w in plan_for(tp=2).warnings)
    assert not any("peer-to-peer" in w for w in plan_for(target="h100", tp=2).warnings)


# ------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp8", "target": "rtx3090"}, "FP8 weights or KV cache need compute capability 8.9"),
    ({"precision": "fp8", "target": "a100-80g"}, "sm_80"),
    ({"kv": "fp8", "target": "rtx3090"}, "FP8 weights or KV cache need compute capability"),
    ({"precision": "fp32"}, "weights per GPU"),
    ({"name": "llama-3.1-8b", "workload": Workload(max_context=131072)}, "no room for the KV cache"),
    ({"tp": 3}, "does not divide num_attention_heads"),
    ({"tp": 8}, "at most 4"),
    ({"tp": 2, "pp": 4}, "needs 8 GPUs"),
    ({"target": "h100", "pp": 3}, "--pp 3 does not divide num_hidden_layers 32"),
    ({"target": "cpu", "name": "smollm2-135m", "pp": 31}, "--pp 31 does not divide num_hidden_layers 30"),
    ({"name": "llama-3-8b", "target": "h100", "tp": 8, "kv": "fp16", "precision": "fp16",
      "workload": Workload(max_context=100000)}, "exceeds the model's context"),
    ({"precision": "int8-sq", "enable_kv_cache_reuse": True}, "paged context FMHA"),
    ({"precision": "int8-sq", "use_paged_context_fmha": True}, "contradicts"),
    ({"max_batch_size": 4, "workload": Workload(concurrency=8)}, "contradicts --concurrency"),
    ({"multiple_profiles": True, "opt_num_tokens": 256}, "contradict"),
    ({"precision": "int8-sq", "max_num_tokens": 2048}, "below max_input_len"),
    ({"max_num_tokens": 20000, "max_batch_size": 2, "workload": Workload(max_context=4096)}, "exceeds max_seq_len"),
    ({"kv_cache_free_gpu_mem_fraction": 1.0}, "cannot be set to 1.0"),
    ({"precision": "bf16", "kv": "fp16"}, "contradicts the engine dtype"),
    ({"workload": Workload(input_len=8000, output_len=500)}, "exceed the maximum context"),
    ({"workload": Workload(p99_latency_s=0.5, output_len=256)}, "cannot be met"),
    ({"target": "cpu", "name": "smollm2-135m", "opt_num_tokens": 256}, "contradict --target cpu"),
    ({"target": "cpu", "name": "llama-3-8b"}, "float32 weights"),
])
def test_fail_fast(kwargs, message):
    with pytest.raises(UserError, match=message):
        plan_for(**kwargs)


#: A model whose MLP no tp > 1 splits evenly (otherwise Llama-3-8B).
ODD_MLP = dataclasses.replace(PRESETS["llama-3-8b"].arch, intermediate_size=14337)


@pytest.mark.parametrize("arch, tp, pp", [
    (PRESETS["llama-3-8b"].arch, 1, 3),      # 32 layers do not split into 3 pipeline stages
    (ODD_MLP, 2, 1),                         # heads split over 2 GPUs, the MLP does not
])
def test_plan_refuses_the_layouts_convert_refuses_in_the_same_words(arch, tp, pp):
    """convert and plan share model.layout.check_parallelism: one set of tensor-parallel rules."""
    with pytest.raises(UserError) as by_convert:
        check_parallelism(arch, tp, pp)
    with pytest.raises(UserError) as by_plan:
        make_plan(arch, get_target("h100"), "fp16", tp=tp, pp=pp)
    assert str(by_plan.value) == str(by_convert.value)


# ------------------------------------------------------------------------------- json and models


def test_save_and_load_round_trip(tmp_path):
    for plan in (plan_for(precision="fp8"), plan_for("smollm2-135m", target="cpu")):
        path = save_plan(plan, tmp_path / "plan.json")
        again = load_plan(path)
        assert again == plan and plan_document(again) == json.loads(path.read_text())


def test_plan_json_uses_upstream_names(tmp_path):
    data = json.loads(save_plan(plan_for(), tmp_path / "plan.json").read_text())
    for key in ("weights_bytes", "kv_bytes_per_token", "max_concurrent_sequences", "build_config",
                "plugin_config", "optimization_profiles", "triton", "roofline", "target", "model",
                "precision", "kv_cache_dtype", "tp_size", "pp_size", "max_seq_len"):
        assert key in data
    assert {"max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "opt_num_tokens",
            "max_beam_width", "kv_cache_type"} <= set(data["build_config"])
    assert {"gpt_attention_plugin", "gemm_plugin", "context_fmha", "use_paged_context_fmha",
            "use_fp8_context_fmha", "remove_input_padding", "tokens_per_block", "multiple_profiles"} \
        <= set(data["plugin_config"])
    assert {"triton_max_batch_size", "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache",
            "batch_scheduler_policy", "enable_chunked_context", "enable_kv_cache_reuse",
            "max_queue_delay_microseconds", "max_queue_size", "preferred_batch_size", "decoupled_mode"} \
        <= set(data["triton"])
    assert data["target"]["sm"] == 89 and data["model"]["num_key_value_heads"] == 8


# ------------------------------------------------------------------------------------------ backends


def test_the_plan_names_its_backend_and_the_backend_decides_the_triton_backend(tmp_path):
    gpu, cpu = plan_for(), plan_for("smollm2-135m", target="cpu")
    assert (gpu.backend, gpu.triton.triton_backend) == ("engine", "tensorrtllm")
    assert (cpu.backend, cpu.triton.triton_backend) == ("reference", "python")
    assert load_plan(save_plan(cpu, tmp_path / "plan.json")).backend == "reference"
    assert json.loads((tmp_path / "plan.json").read_text())["backend"] == "reference"


@pytest.mark.parametrize("target, expected", [("cpu", "reference"), ("rtx4090", "engine")])
def test_a_plan_saved_before_the_backend_was_recorded_gets_its_targets(tmp_path, target, expected):
    data = plan_for("smollm2-135m", target=target).to_dict()
    del data["backend"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "plan.json").backend == expected


@pytest.mark.parametrize("target, backend, message", [
    ("cpu", "engine", "the engine backend does not serve cpu targets"),
    ("rtx4090", "reference", "the reference backend does not serve gpu targets"),
    ("cpu", "pytorch", r"the pytorch backend does not serve cpu targets.*\(reference-llmapi serves the same llmapi"),
    ("rtx4090", "reference-llmapi", r"does not serve gpu targets.*\(pytorch serves the same llmapi request contract"),
    ("rtx4090", "vllm", "unknown backend 'vllm'; trtpipe knows engine, reference, pytorch, reference-llmapi"),
])
def test_a_backend_is_planned_only_for_the_targets_it_serves(target, backend, message):
    with pytest.raises(UserError, match=message):
        make_plan(preset("smollm2-135m"), get_target(target), "fp16", backend=backend)


def test_a_plan_naming_an_unknown_backend_is_one_clear_message(tmp_path):
    data = plan_for().to_dict()
    data["backend"] = "vllm"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="plan.json: unknown backend 'vllm'"):
        load_plan(tmp_path / "plan.json")


def test_cli_plan_table_says_which_backend_serves_and_whose_memory_it_budgets():
    for target, backend, memory in (("cpu", "reference: no engine", "Memory budget (host)"),
                                    ("l40s", "engine: a TensorRT-LLM", "Memory budget (per GPU)")):
        result = CliRunner().invoke(main, ["plan", "smollm2-135m", "--target", target, "--precision", "fp16",
                                           "--details"], terminal_width=200)
        assert result.exit_code == 0, result.output
        assert backend in result.output and memory in result.output


def test_load_plan_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(UserError, match="not a trtpipe plan"):
        load_plan(bad)
    bad.write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        load_plan(bad)


@pytest.fixture(scope="module")
def tp2_checkpoint(tiny_llama, tmp_path_factory):
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    out = tmp_path_factory.mktemp("plan-ckpt") / "ckpt"
    return convert_model(resolve_model(str(tiny_llama("gqa"))), out, dtype="float16", tp=2, progress=False).path


def test_plan_from_a_converted_checkpoint(tp2_checkpoint):
    info = resolve_model_info(str(tp2_checkpoint))
    assert info.source == "checkpoint" and info.checkpoint_tp_size == 2
    plan = make_plan(info, get_target("rtx4090"), "fp16", "auto", 2, Workload(input_len=64, output_len=32))
    assert plan.kv_bytes_per_token == 2 * 4 * 1 * 6 * 2          # 4 layers, 2 KV heads over tp 2, head 6
    assert plan.build_config.max_seq_len == 256                  # the checkpoint's context
    with pytest.raises(UserError, match="sharded for tp=2"):
        make_plan(info, get_target("rtx4090"), "fp16", "auto", 1, Workload(input_len=64, output_len=32))
    with pytest.raises(UserError, match="quant_algo"):
        make_plan(info, get_target("rtx4090"), "fp8", "auto", 2, Workload(input_len=64, output_len=32))
    with pytest.raises(UserError, match="convert again with --precision bf16"):
        make_plan(info, get_target("rtx4090"), "bf16", "auto", 2, Workload(input_len=64, output_len=32))


# -------------------------------------------------------------------------------------- targets


def test_catalogue_figures_and_their_sources():
    targets = catalogue()
    assert {"rtx4090", "rtx3090", "l40s", "a100-40g", "a100-80g", "h100", "h200", "cpu"} <= set(targets)
    rtx = targets["rtx4090"]
    # planned against what the card reports (nvidia-smi, default ECC), not the marketing 24 GB / 48 GB
    assert (rtx.sm, rtx.memory_bytes, rtx.bandwidth_bytes_per_s, rtx.supports_fp8) == (89, 24564 * MIB, 1008e9, True)
    assert targets["l40s"].memory_bytes == 46068 * MIB < 48 * GIB
    assert not targets["rtx3090"].supports_fp8 and targets["rtx3090"].sm == 86
    assert targets["h100"].p2p and not rtx.p2p
    for t in targets.values():
        named = " ".join(t.sources)
        for figure in ("memory_gib", "bandwidth_gbps", "max_gpus"):
            assert figure in named, f"{t.name}: no source for {figure}"
        if t.is_gpu:
            for figure in ("sm", "fp16_tflops", "fp8_tflops", "int8_tops", "p2p", "usable_memory_mib", "board_power_w"):
                assert figure in named, f"{t.name}: no source for {figure}"


def test_unknown_target():
    with pytest.raises(UserError, match="known targets: rtx4090"):
        get_target("rtx9090")


# ------------------------------------------------------------------------------------------- CLI


def test_cli_plan_json_is_the_saved_plan(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--input-len", "2048", "--output-len", "512", "--concurrency", "32",
                                       "--json", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data == json.loads(out.read_text())
    assert data["workload"]["input_len"] == 2048 and data["build_config"]["max_batch_size"] == 32
    plan = load_plan(out)   # max_num_tokens: the one aiconfigurator-core gives the most throughput for the workload
    assert plan.build_config.max_num_tokens == plan.performance.max_num_tokens in (1024, 2048, 4096, 8192)
    assert plan.performance.source == "derived" and plan.performance.batch == 32


def test_cli_plan_human_table():
    result = CliRunner().invoke(main, ["plan", "mistral-7b", "--target", "l40s", "--precision", "fp16",
                                       "--details"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for text in ("Memory budget", "kv_bytes_per_token", "131072", "optimization_profiles", "triton_max_batch_size",
                 "Speed of light", "roofline", "tokens/s", "Performance", "output tokens/J"):
        assert text in result.output
    short = CliRunner().invoke(main, ["plan", "mistral-7b", "--target", "l40s", "--precision", "fp16"])
    assert short.exit_code == 0 and len(short.output.splitlines()) < 15, short.output   # the details on request
    assert "optimization_profiles" not in short.output and "max_queue_size_reason" not in short.output


@pytest.mark.parametrize("args, message", [
    (["llama-3-8b", "--target", "rtx3090", "--precision", "fp8"], "FP8 weights or KV cache need compute capability"),
    (["llama-3-8b", "--target", "rtx4090", "--precision", "fp16", "--tp", "3"], "does not divide"),
    (["llama-3-8b", "--target", "nope", "--precision", "fp16"], "unknown target"),
    (["no-such-model", "--target", "rtx4090", "--precision", "fp16"], "not a directory"),
])
def test_cli_plan_errors_exit_2_without_traceback(args, message):
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


#: config.json of a tiny TensorRT-LLM checkpoint: enough for `trtpipe plan`, which reads no weights.
TINY_CHECKPOINT_CONFIG = {"architecture": "LlamaForCausalLM", "dtype": "float16", "vocab_size": 101,
                          "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 4,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.parametrize("changes, tp, message", [
    ({"num_hidden_layers": 5, "mapping": {"world_size": 2, "tp_size": 1, "pp_size": 2}}, 1,
     "config.json: mapping.pp_size 2 does not divide num_hidden_layers 5"),
    ({"intermediate_size": 97, "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}}, 2,
     "config.json: mapping.tp_size 2 does not divide intermediate_size 97"),
])
def test_cli_plan_of_an_unevenly_sharded_checkpoint_exits_2(tmp_path, changes, tp, message):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CHECKPOINT_CONFIG, **changes}))
    result = CliRunner().invoke(main, ["plan", str(tmp_path), "--target", "h100", "--precision", "fp16",
                                       "--tp", str(tp), "--input-len", "64", "--output-len", "32"])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_cli_targets():
    result = CliRunner().invoke(main, ["targets", "--json"])
    assert result.exit_code == 0
    data = {t["name"]: t for t in json.loads(result.output)}
    assert data["rtx4090"]["compute_capability"] == "8.9" and data["rtx4090"]["sources"]
    human = CliRunner().invoke(main, ["targets"], terminal_width=200)
    assert human.exit_code == 0 and "rtx4090" in human.output and "1008" in human.output and "8.9" in human.output


def test_cli_targets_piped_keeps_every_name_whole():
    """Not a terminal (`trtpipe targets | grep a100-40g`): rich's 80 columns must not cut a name to "a100-4…"."""
    result = CliRunner().invoke(main, ["targets"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    first_cells = {line.split("│")[1].strip() for line in result.output.splitlines() if line.startswith("│")}
    assert set(catalogue()) <= first_cells
    assert "…" not in result.output   # no other cell is cut either: the table keeps its natural width


def test_make_plan_takes_a_bare_model_arch():
    plan = make_plan(PRESETS["llama-3-8b"].arch, get_target("rtx4090"), "fp16", "auto", 1, Workload())
    assert plan.kv_bytes_per_token == 131072 and plan.model.source == "arch"


def test_cli_cpu_plan_json_for_the_deploy_stage(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", "smollm2-135m", "--target", "cpu", "--precision", "fp16",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["engine"] is None and data["build_config"] is None and data["plugin_config"] is None
    assert data["triton"]["triton_max_batch_size"] == 8 and data["model"]["source"] == "gguf"


def test_cli_plan_of_a_hugging_face_directory(tiny_llama):
    result = CliRunner().invoke(main, ["plan", str(tiny_llama("mha")), "--target", "l40s", "--precision", "fp8",
                                       "--input-len", "100", "--output-len", "20", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"]["source"] == "hf-dir" and data["dtype"] == "float16"   # float32 model, fp8 engine
    assert data["kv_bytes_per_token"] == 2 * 4 * 4 * 12 * 1                   # 4 layers, 4 KV heads of 12, fp8
    assert data["build_config"]["max_seq_len"] == 256


def every_plan():
    """Every plan the planner makes for SmolLM2 (cpu backends) and Llama-3-8B (rtx4090 backends) at every precision
    and --kv-cache choice it accepts."""
    from pipeline.precisions import KV_CACHE_CHOICES, PRECISIONS

    cases = [("smollm2-135m", "cpu", b) for b in ("reference", "reference-onnx")]
    cases += [("llama-3-8b", "rtx4090", b) for b in ("engine", "pytorch")]
    for model, target, backend in cases:
        for precision in PRECISIONS:
            for kv in KV_CACHE_CHOICES:
                try:
                    plan = make_plan(resolve_model_info(model), get_target(target), precision, kv, backend=backend)
                except UserError:
                    continue
                yield pytest.param(plan, id=f"{backend}-{precision}-kv-{kv}")


@pytest.mark.parametrize("plan", list(every_plan()))
def test_every_plan_json_plans_itself_again(plan, tmp_path):
    """tune, density and every other re-planner read plan.json and ask the planner again (policy.replan): the answer
    must be the same plan, whatever the backend computes in (the cpu target records float32 for fp8/fp16)."""
    from pipeline.planner import replan

    save_plan(plan, tmp_path / "plan.json")
    again = replan(load_plan(tmp_path / "plan.json"))
    assert again.to_dict() == plan.to_dict()


def test_a_cpu_fp8_plan_records_float32_and_still_replans_as_fp8():
    from pipeline.plan.policy import kv_cache_request
    from pipeline.planner import replan

    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp16")
    assert (plan.dtype, plan.kv_cache_dtype) == ("float32", "float32")
    assert kv_cache_request(plan) == "fp16"
    smaller = replan(plan, target=dataclasses.replace(plan.target, memory_bytes=plan.target.memory_bytes // 2))
    assert smaller.precision == "fp16" and smaller.memory.memory_bytes == plan.target.memory_bytes // 2


def test_plan_json_names_no_machine_path_and_a_moved_build_reads_its_own_checkpoint(tiny_llama, tmp_path,
                                                                                    monkeypatch):
    """issue 25: plan.json held the checkpoint's absolute path; now it is relative to the plan's directory (home
    as `~`), load_plan makes it absolute again where the file now lies, and build's up-to-date check holds."""
    from pipeline.build import same_plan
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    build = tmp_path / "machine-specific" / "build"
    ckpt = convert_model(resolve_model(str(tiny_llama("gqa"))), build / "checkpoint", dtype="float32",
                         progress=False).path
    plan = make_plan(resolve_model_info(str(ckpt)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=32, output_len=16, max_context=64))
    assert plan.model.path == str(ckpt)
    save_plan(plan, build / "plan.json")
    text = (build / "plan.json").read_text()
    assert str(tmp_path) not in text
    assert (json.loads(text)["model"]["name"], json.loads(text)["model"]["path"]) == ("checkpoint", "checkpoint")
    assert load_plan(build / "plan.json").model.path == str(ckpt)
    assert same_plan(build / "plan.json", plan)
    moved = tmp_path / "moved"
    build.rename(moved)
    assert load_plan(moved / "plan.json").model.path == str(moved / "checkpoint")
    assert same_plan(moved / "plan.json", load_plan(moved / "plan.json"))
    home_model = tmp_path / "home" / "models" / "m"
    save_plan(dataclasses.replace(plan, model=dataclasses.replace(plan.model, path=str(home_model))),
              tmp_path / "plans" / "p.json")
    assert json.loads((tmp_path / "plans" / "p.json").read_text())["model"]["path"] == "~/models/m"
    assert load_plan(tmp_path / "plans" / "p.json").model.path == str(home_model)


# ------------------------------------------------------------------------- the verdict first (issue: first hour)


def plan_cli(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def first_lines(output: str, n: int = 10) -> dict[str, str]:
    """The first n lines of `trtpipe plan`, by their first word."""
    return {line.split(maxsplit=1)[0]: line for line in output.splitlines()[:n] if line.strip()}


def test_plan_leads_with_its_verdict_and_where_each_figure_comes_from():
    """Fits, batch, KV-cache tokens, TTFT, TPOT and tokens/s in the first 10 lines, each speed with its source, the
    same figures plan.json holds; the build parameters only with --details."""
    args = ["llama-3-8b", "--target", "rtx4090", "--precision", "fp8"]
    result, data = plan_cli(*args), json.loads(plan_cli(*args, "--json").output)
    assert result.exit_code == 0, result.output
    head, p = first_lines(result.output), data["performance"]
    assert "yes" in head["Fits"] and "8.46" in head["Fits"] and "23.99 GiB" in head["Fits"]
    assert f"{data['triton']['triton_max_batch_size']} sequences" in head["Batch"]
    assert f"{data['memory']['kv_cache_tokens']} tokens" in head["KV"] and "fp8, 65536 B/token" in head["KV"]
    assert f"{p['ttft_s'] * 1e3:.0f} ms" in head["TTFT"] and f"{p['tpot_s'] * 1e3:.2f} ms" in head["TPOT"]
    assert f"{p['output_tokens_per_s']:.0f}" in head["tokens/s"]
    for figure in ("TTFT", "TPOT", "tokens/s"):
        assert "derived: l40s's measured kernels scaled to rtx4090" in head[figure]
        assert "≤" not in head[figure] and "≥" not in head[figure] and "bound" not in head[figure]
    assert "plugin_config" not in result.output and "optimization_profiles" not in result.output
    details = plan_cli(*args, "--details")
    assert details.output.startswith(result.output.split("\n")[0]) and "optimization_profiles" in details.output


def test_a_speed_of_light_figure_is_shown_as_a_bound_with_a_warning_naming_what_lacks_data():
    """int8-sq on rtx4090: aiconfigurator-core has no INT8 kernel data, so the figures are speed-of-light bounds:
    TTFT and TPOT at least, tokens/s at most, and a warning in the first lines says which precision lacks data."""
    result = plan_cli("llama-3-8b", "--target", "rtx4090", "--precision", "int8-sq")
    assert result.exit_code == 0, result.output
    head = first_lines(result.output)
    assert head["TTFT"].split()[1] == "≥" and head["TPOT"].split()[1] == "≥"
    assert head["tokens/s"].split()[1] == "≤"
    assert all("bound" in head[figure] for figure in ("TTFT", "TPOT", "tokens/s"))
    assert "int8-sq" in head["Warning"] and "no measured data" in head["Warning"]
    plan = make_plan(preset("llama-3-8b"), get_target("rtx4090"), "int8-sq")
    assert any(w.startswith("no measured data") and "int8-sq" in w for w in plan.warnings)


def test_one_speed_of_light_per_quantity_and_the_second_memory_check_says_why_it_differs():
    """The prefill's speed of light was stated twice (AIC's 50.1 ms, trtpipe's roofline 44.1 ms) and AIC's runtime
    reserve (3.50 GiB) beside the budget's (1.15 GiB) without a word; now the roofline and AIC's memory check are
    labelled with why they differ, and a tp 4 plan says why AIC's weights per GPU are smaller."""
    from rich.console import Console

    from pipeline.cli.plan_render import render_plan

    def text(plan) -> str:
        console = Console(width=400, record=True)
        for part in render_plan(plan):
            console.print(part)
        return console.export_text()

    plan = make_plan(preset("llama-3-8b"), get_target("rtx4090"), "fp8")
    out = text(plan)
    sol = f"{plan.performance.speed_of_light['prefill_s'] * 1e3:.1f} ms"
    roof = f"{plan.roofline.prefill_s_per_request * 1e3:.1f} ms"
    assert sol != roof and out.count(sol) == 1 and out.count(roof) == 1
    assert "Roofline estimate" not in out and "a coarser bound" in out
    assert "safety reserve" in out and "It sizes the batch" in out
    seventy = text(make_plan(preset("llama-3.1-70b"), get_target("h100"), "fp8", tp=4))
    assert "split the input embedding table over the tp ranks" in seventy


def test_a_cpu_fp8_plan_states_the_kv_cache_its_build_serves(smollm2_hf_dir, text_file, tmp_path):
    """`plan MODEL --target cpu --precision fp8` said "KV cache fp8" with a float32 size while the build of the same
    flags serves a float32 KV cache (it calibrates no KV scales for --kv-cache auto, and the reference runtime
    stores every cache in float32): now the plan says float32, as the build's own plan.json does, at the bytes per
    token the runtime's cache takes."""
    import shutil

    from support.models import make_tiny_model

    from pipeline.build import BuildOptions, run_calibration
    from pipeline.convert import convert_model
    from pipeline.runtime.model import KVCache
    from pipeline.sources import resolve_model

    tiny_hf = make_tiny_model(tmp_path / "hf", vocab_size=49152, num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=512)   # room for the build's calibration windows
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, tiny_hf / name)
    tiny_ckpt = convert_model(resolve_model(str(tiny_hf)), tmp_path / "checkpoint", dtype="float32",
                              progress=False).path
    cpu = get_target("cpu")
    small = Workload(input_len=32, output_len=16)
    planned = make_plan(resolve_model_info(str(tiny_hf)), cpu, "fp8", workload=small)
    options = BuildOptions(model=str(tiny_hf), target="cpu", precision="fp8", out=tmp_path,
                           calibration_dataset=str(text_file), calibration_samples=4, progress=False)
    built_checkpoint = run_calibration(tiny_ckpt, tmp_path / "checkpoint-fp8", options).path
    built = make_plan(resolve_model_info(str(built_checkpoint)), cpu, "fp8", workload=small)   # as build plans it
    assert (planned.kv_cache_dtype, planned.kv_bytes_per_token) == (built.kv_cache_dtype, built.kv_bytes_per_token)
    assert planned.kv_cache_dtype == "float32" and planned.quantization == built.quantization
    a = planned.model.arch
    cache = KVCache(a.num_hidden_layers, 1, 1, a.num_key_value_heads, a.head_size)
    assert planned.kv_bytes_per_token == 2 * cache.k.element_size() * a.num_hidden_layers * \
        a.num_key_value_heads * a.head_size
    result = plan_cli("smollm2-135m", "--target", "cpu", "--precision", "fp8")
    assert result.exit_code == 0, result.output
    assert "(float32, 46080 B/token)" in first_lines(result.output)["KV"]
    asked = make_plan(preset("smollm2-135m"), cpu, "fp8", "fp8")    # an fp8 cache asked for: rounded, stored float32
    from pipeline.plan.policy import describe_kv_cache

    assert describe_kv_cache(asked) == "float32 holding fp8-rounded values, 46080 B/token"


# ------------------------------------------------------------------------------- advice that works when followed


def advised_commands(output: str) -> list[list[str]]:
    """Every `trtpipe plan ...` the message advises, as CliRunner arguments."""
    import shlex
    import re

    return [shlex.split(command)[1:] for command in re.findall(r"`(trtpipe plan [^`]+)`", output)]


@pytest.mark.parametrize("args, wrong, expected", [
    # at fp8 there is no lower precision that helps: a larger budget and a shorter output do
    (["--precision", "fp8", "--p99-latency", "0.5"], "lower precision", ("--p99-latency", "--output-len")),
    # fp16: fp8 halves the weights read each step
    (["--precision", "fp16", "--p99-latency", "3"], "an fp8 KV cache", ("--precision", "--p99-latency")),
    # the KV cache is fp8 already: not advised again; more GPUs or fewer instances
    (["--precision", "fp8", "--instances", "2"], "--kv-cache", ("--tp", "--instances")),
    # a batch too big at fp8: a smaller one, or int4-awq's weights (4 bits) leave room for it
    (["--precision", "fp8", "--max-batch-size", "200"], "--kv-cache", ("--max-batch-size", "--precision")),
])
def test_every_refusal_of_plan_names_commands_that_plan(args, wrong, expected):
    refused = plan_cli("llama-3-8b", "--target", "rtx4090", *args)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert wrong not in refused.output, refused.output
    advised = advised_commands(refused.output)
    assert advised, refused.output
    for flag in expected:
        assert any(flag in command and (flag not in args or command[command.index(flag) + 1] !=
                                        args[args.index(flag) + 1]) for command in advised), (flag, refused.output)
    for command in advised:
        followed = CliRunner().invoke(main, command)
        assert followed.exit_code == 0, (command, followed.output)


def test_a_path_that_does_not_exist_is_said_to_be_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("./does-not-exist", "../nope/model", str(tmp_path / "gone"), "~/no-such-model-dir-xyz"):
        result = plan_cli(spec, "--target", "rtx4090", "--precision", "fp8")
        assert result.exit_code == 2 and "no such file or directory" in result.output, result.output
        assert "hub id (org/name)" not in result.output.split(";")[0] and "not a valid" not in result.output


def test_an_uncached_hub_id_offline_asks_for_its_config_json_alone_which_then_plans(tmp_path, monkeypatch):
    """Offline, a hub id that is not a preset: fetch its config.json (`hf download ORG/NAME config.json`), not the
    weights; with that file in the Hugging Face cache, as hf download leaves it, the plan is made."""
    import re

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("TRTPIPE_MODEL_DIR", raising=False)
    refused = plan_cli("someorg/some-llama", "--target", "rtx4090", "--precision", "fp8")
    assert refused.exit_code == 2, refused.output
    command = re.search(r"`(hf download [^`]+)`", refused.output).group(1)
    assert command == "hf download someorg/some-llama config.json"
    snapshot = cache / "models--someorg--some-llama" / "snapshots" / "0123abcd"   # what that command leaves
    snapshot.mkdir(parents=True)
    (cache / "models--someorg--some-llama" / "refs").mkdir()
    (cache / "models--someorg--some-llama" / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps(PRESETS["llama-3-8b"].hf_config))
    followed = plan_cli("someorg/some-llama", "--target", "rtx4090", "--precision", "fp8")
    assert followed.exit_code == 0, followed.output
    assert "yes" in first_lines(followed.output)["Fits"]
