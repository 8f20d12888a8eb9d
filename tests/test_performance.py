"""The planner's performance model (pipeline/plan/performance.py, serving_choice.py): NVIDIA's AIConfigurator
figures where NVIDIA measured the chip, per-operation derivation where it did not, memory that fits, and trtpipe's
speed-of-light bound (labelled so) where AIC cannot model a plan."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import UserError
from pipeline.plan import Overrides, Workload, load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.plan.memory import weights_per_rank_by_stage, weights_read_per_step
from pipeline.plan.performance import Chip, Workpoint, estimate, scaled_ops
from pipeline.targets import get_target

aic = pytest.importorskip("aiconfigurator_core", reason="the AIC path needs aiconfigurator-core (README setup)")


def llama(name: str = "llama-3.1-8b"):
    return resolve_model_info(name)


def direct_aic(system: str, version: str, batch: int, isl: int, osl: int, tokens: int) -> dict:
    """The same configuration asked of AIC's SDK directly: what the plan must reproduce."""
    import tempfile
    from pathlib import Path

    from aiconfigurator_core.sdk import common, config
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database_view

    from pipeline.presets import PRESETS

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(PRESETS["llama-3.1-8b"].hf_config))
        model = get_model(d, config.ModelConfig(tp_size=1, pp_size=1, gemm_quant_mode=common.GEMMQuantMode.fp8,
                                                kvcache_quant_mode=common.KVCacheQuantMode.fp8,
                                                fmha_quant_mode=common.FMHAQuantMode.fp8), "trtllm")
    db = get_database_view(system, "trtllm", version)
    one = get_backend("trtllm").run_static(model, db, config.RuntimeConfig(batch_size=1, beam_width=1, isl=isl,
                                                                           osl=osl, prefix=0), mode="static")
    agg = get_backend("trtllm").run_agg(model, db, config.RuntimeConfig(batch_size=batch, isl=isl, osl=osl),
                                        ctx_tokens=min(tokens - batch, batch * isl), max_num_tokens=tokens,
                                        free_gpu_memory_fraction=0.9).get_result_dict()
    return {"prefill_s": one.get_summary_df().iloc[0]["ttft"] / 1e3, "ttft_s": agg["ttft"] / 1e3,
            "tpot_s": agg["tpot"] / 1e3, "tokens_per_s": agg["tokens/s/gpu"]}


def test_a_measured_chips_plan_states_aics_own_figures():
    """h100 fp8: the plan's figures are AIC's for the plan's batch and max_num_tokens, to the last digit."""
    plan = make_plan(llama(), get_target("h100"), "fp8", workload=Workload(input_len=1024, output_len=256),
                     overrides=Overrides(max_batch_size=32))
    p = plan.performance
    assert p.source == "measured" and "h100_sxm TensorRT-LLM 1.3.0rc20" in p.basis and p.batch == 32
    want = direct_aic("h100_sxm", "1.3.0rc20", 32, 1024, 256, p.max_num_tokens)
    assert p.prefill_s == pytest.approx(want["prefill_s"], rel=1e-9)
    assert (p.ttft_s, p.tpot_s) == pytest.approx((want["ttft_s"], want["tpot_s"]), rel=1e-9)
    assert p.output_tokens_per_s == pytest.approx(want["tokens_per_s"], rel=1e-9)
    assert p.request_latency_s == pytest.approx(p.ttft_s + 255 * p.tpot_s)
    assert p.speed_of_light["decode_step_s"] < p.decode_step_s     # measured kernels are slower than light
    assert 0 < p.percent_of_speed_of_light < 100
    assert p.energy["watts"] == 700 and p.energy["output_tokens_per_joule"] == pytest.approx(
        p.output_tokens_per_s / 700) and "upper bound" in p.energy["basis"]


def test_without_aic_the_plan_says_its_figures_are_a_speed_of_light_bound(no_aic):
    plan = make_plan(llama(), get_target("h100"), "fp8")
    p = plan.performance
    assert p.source == "speed-of-light" and "not installed" in p.notes[0]
    assert p.decode_step_s == pytest.approx(plan.roofline.decode_step_s) and p.memory is None


def test_what_aic_has_no_data_for_keeps_the_bound_with_the_reason():
    p = make_plan(llama(), get_target("l40s"), "int8-sq").performance
    assert p.source == "speed-of-light" and "int8-sq" in p.notes[0]


def test_scaling_one_operation_by_the_two_chips_speed_of_light():
    """A compute-bound op keeps its efficiency (scaled by the tensor rate that applies: 8-bit GEMMs at the 8-bit
    rate, lm_head at the 16-bit one); a memory-bound one keeps its time above the speed of light."""
    source, dest = Chip(864e9, 362e12, 733e12), Chip(1008e9, 165e12, 330e12)
    times = [("generation_gate_ffn1_gemm", 2.0), ("context_qkv_gemm", 10.0), ("context_logits_gemm", 1.0)]
    sol = {"generation_gate_ffn1_gemm": (0.1, 1.0), "context_qkv_gemm": (5.0, 1.0), "context_logits_gemm": (0.5, 0.1)}
    total, derived, derived_sol = scaled_ops(times, sol, source, dest, gemm_8bit=True)
    assert total == 13.0
    memory_bound = (2.0 - 1.0) + 1.0 * 864 / 1008
    compute_bound = 10.0 * (5.0 * 733 / 330) / 5.0
    lm_head = 1.0 * (0.5 * 362 / 165) / 0.5
    assert derived == pytest.approx(memory_bound + compute_bound + lm_head)
    assert derived_sol == pytest.approx(1.0 * 864 / 1008 + 5.0 * 733 / 330 + 0.5 * 362 / 165)


def test_rtx4090_is_derived_from_l40s_and_checked_against_its_own_memory():
    plan = make_plan(llama("llama-3-8b"), get_target("rtx4090"), "fp8")
    p = plan.performance
    assert p.source == "derived" and "l40s" in p.basis and "rtx4090/l40s" in p.basis
    assert p.memory["fits"] and p.memory["total"] <= p.memory["capacity"] == 24564 << 20
    point = Workpoint(plan.model.arch, "fp8", "fp8", True, 1, 1, p.batch + 8, 1024, 256, p.max_num_tokens)
    assert estimate(get_target("rtx4090"), point).out_of_memory   # a few more sequences and AIC says no
    assert any("aiconfigurator-core's memory estimate" in w for w in plan.warnings)
    assert plan.build_config.max_batch_size == p.batch == plan.triton.triton_max_batch_size


def test_a_batch_aic_says_does_not_fit_is_refused_with_its_memory():
    with pytest.raises(UserError, match="memory estimate does not fit rtx4090 at --max-batch-size 200"):
        make_plan(llama("llama-3-8b"), get_target("rtx4090"), "fp8", overrides=Overrides(max_batch_size=200))


def test_the_p99_budget_is_met_by_aics_serving_latency():
    free = make_plan(llama(), get_target("l40s"), "fp8").performance
    budget = 10.0
    assert free.request_latency_s > budget
    capped = make_plan(llama(), get_target("l40s"), "fp8", workload=Workload(p99_latency_s=budget)).performance
    assert capped.request_latency_s <= budget and capped.batch < free.batch
    # a budget the speed-of-light bound meets at batch 1 but AIC's measured kernels do not: refused by AIC's figure
    one = make_plan(llama(), get_target("l40s"), "fp8", overrides=Overrides(max_batch_size=1))
    between = (one.roofline.request_latency_s_batch1 + one.performance.request_latency_s) / 2
    assert one.roofline.request_latency_s_batch1 < between < one.performance.request_latency_s
    with pytest.raises(UserError, match="cannot be met on l40s: aiconfigurator-core predicts .* at batch 1"):
        make_plan(llama(), get_target("l40s"), "fp8", workload=Workload(p99_latency_s=between))


def test_the_decode_step_bound_reads_the_embedding_table_only_when_lm_head_shares_it():
    arch = llama().arch
    table = arch.vocab_size * arch.hidden_size * 2
    assert weights_read_per_step(arch, "fp16", "float16", 1, 1) == \
        weights_per_rank_by_stage(arch, "fp16", "float16", 1, 1)[0] - table
    tied = resolve_model_info("smollm2-135m").arch
    assert tied.tie_word_embeddings
    assert weights_read_per_step(tied, "fp16", "float16", 1, 1) == \
        weights_per_rank_by_stage(tied, "fp16", "float16", 1, 1)[0]


def test_plan_json_carries_the_performance_and_reads_it_back(tmp_path):
    plan = make_plan(llama(), get_target("h200"), "bf16")
    again = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert again.performance == plan.performance
    assert json.loads((tmp_path / "plan.json").read_text())["performance"]["source"] == "measured"


def test_the_aic_facts_the_planner_relies_on_hold_for_the_installed_package():
    """docs/upstream-facts.md §E, checked against aiconfigurator-core as installed."""
    from aiconfigurator_core.sdk.perf_database import get_supported_databases

    from pipeline.plan.performance import AIC_VERSION, MEASURED, database
    from pipeline.targets import MIB

    from importlib.metadata import version

    assert version("aiconfigurator-core") == AIC_VERSION
    supported = get_supported_databases()
    for system, data in MEASURED.values():
        assert data in supported[system]["trtllm"], (system, data)
    assert database("l40s", "1.3.0rc20").system_spec["gpu"]["mem_capacity"] == 46068 * MIB == \
        get_target("l40s").memory_bytes
    assert database("h200_sxm", "1.3.0rc20").system_spec["gpu"]["mem_capacity"] == get_target("h200").memory_bytes
    assert database("h100_sxm", "1.3.0rc20").system_spec["gpu"]["mem_capacity"] >= get_target("h100").memory_bytes
    # Mistral is not modelled by name; Llama's family reads its shapes from the config (and no sliding window)
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.common import ARCHITECTURE_TO_MODEL_FAMILY

    assert "MistralForCausalLM" not in ARCHITECTURE_TO_MODEL_FAMILY
    assert ARCHITECTURE_TO_MODEL_FAMILY["LlamaForCausalLM"] == "LLAMA"
    # agg's TTFT multiplies one prompt in one chunk by 1.9, as if it queued behind requests arriving with it
    assert get_backend("trtllm")._ttft_queuing_factor(1, 1) == pytest.approx(1.9)


def test_the_derivation_reproduces_a_chip_nvidia_measured():
    """h200 derived from h100's kernel data lands near AIC's own h200 data (same GH100, faster memory), where
    scaling by the bandwidth ratio alone would predict every memory-bound step 30% shorter."""
    from pipeline.plan.performance import derived_estimate

    h200 = get_target("h200")
    for batch in (1, 64):
        point = Workpoint(llama().arch, "fp8", "fp8", True, 1, 1, batch, 1024, 256, 8192)
        derived, measured = derived_estimate(h200, "h100", point), estimate(h200, point)
        assert derived.source == "derived" and measured.source == "measured"
        for figure in ("prefill_s", "decode_step_s", "ttft_s", "tpot_s", "output_tokens_per_s"):
            assert getattr(derived, figure) == pytest.approx(getattr(measured, figure), rel=0.15), (batch, figure)


# ------------------------------------------------------------------------ against NVIDIA's published L40S figures

#: TensorRT-LLM's performance overview, v0.17 table (L40S, FP8, TP 1, maximum throughput): output tokens/s per
#: ISL/OSL (docs/upstream-facts.md §E)
PUBLISHED_TOKENS_PER_S = {
    "llama-3.1-8b": {(128, 128): 9104.61, (128, 2048): 5365.81, (2048, 128): 1066.52, (2048, 2048): 2225.27},
    "mistral-7b": {(128, 128): 9664.13, (128, 2048): 5720.65, (2048, 128): 1076.74, (2048, 2048): 2286.71}}
#: the same overview at v0.9 (L40S, FP8, batch 1): TTFT in ms at 128 and 2048 prompt tokens
PUBLISHED_TTFT_MS = {"llama-2-7b": {128: 14.1, 2048: 80.1}, "mistral-7b": {128: 15.4, 2048: 87.3}}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOKENS_PER_S))
def test_the_plans_maximum_throughput_is_within_15_percent_of_nvidias_l40s_figures(name):
    """The plan free to choose its batch and max_num_tokens, at each length of NVIDIA's table: Llama-3.1-8B lands
    at 0.92-0.99 of the published figure, Mistral-7B (AIC's Llama model on Mistral's config) at 0.92-0.99."""
    for (isl, osl), published in PUBLISHED_TOKENS_PER_S[name].items():
        p = make_plan(llama(name), get_target("l40s"), "fp8", workload=Workload(input_len=isl, output_len=osl)
                      ).performance
        assert p.source == "measured", p.notes
        assert p.output_tokens_per_s / published == pytest.approx(1, abs=0.15), (isl, osl, p.output_tokens_per_s)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TTFT_MS))
def test_one_clients_ttft_is_within_25_percent_of_nvidias_batch_1_figures(name):
    """One closed-loop client waits behind no other request: its TTFT is its prefill alone, no queueing factor,
    and the plan for it holds the whole prompt in one step (a chunk buys a lone request nothing)."""
    for isl, published in PUBLISHED_TTFT_MS[name].items():
        p = make_plan(llama(name), get_target("l40s"), "fp8",
                      workload=Workload(input_len=isl, output_len=16, concurrency=1)).performance
        assert p.source == "measured" and p.batch == 1 and p.max_num_tokens >= isl
        assert p.ttft_s == p.prefill_s and p.request_latency_s == pytest.approx(p.prefill_s + 15 * p.tpot_s)
        assert p.output_tokens_per_s == pytest.approx(15 / p.request_latency_s)
        assert p.ttft_s * 1e3 / published == pytest.approx(1, abs=0.25), (isl, p.ttft_s)


def test_a_derived_chips_lone_client_also_waits_for_its_prefill_only():
    p = make_plan(llama("llama-3-8b"), get_target("rtx4090"), "fp8", workload=Workload(concurrency=1)).performance
    assert p.source == "derived" and p.batch == 1 and p.ttft_s == p.prefill_s


def test_mistral_is_planned_through_aics_llama_model_on_its_own_config():
    from pipeline.plan.performance import hf_config

    arch = llama("mistral-7b").arch
    config = hf_config(arch)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["sliding_window"], config["num_key_value_heads"]) == (32000, 4096, 8)
    short = make_plan(arch, get_target("l40s"), "fp8", workload=Workload(input_len=2048, output_len=128)).performance
    assert short.source == "measured"
    assert "MistralForCausalLM through AIC's LlamaForCausalLM model on its own config" in short.basis
    assert "sliding window" not in short.basis     # 2176 tokens: the window never cuts the attention
    long = make_plan(arch, get_target("l40s"), "fp8", workload=Workload(input_len=5000, output_len=500)).performance
    assert "ignores the 4096-token sliding window, so at this 5500-token context" in long.basis


def test_a_max_num_tokens_below_the_prompt_says_what_it_costs_a_lone_request():
    """Chunked context prefills the prompt chunk after chunk (each attending to the ones before): a lone request
    waits longer, and the plan says how much and what max_num_tokens holding the prompt gives instead."""
    workload = Workload(input_len=2048, output_len=16, concurrency=1)
    whole = make_plan(llama("llama-2-7b"), get_target("l40s"), "fp8", workload=workload).performance
    chunked = make_plan(llama("llama-2-7b"), get_target("l40s"), "fp8", workload=workload,
                        overrides=Overrides(max_num_tokens=1024)).performance
    assert (whole.max_num_tokens, chunked.max_num_tokens) == (2048, 1024)
    assert chunked.ttft_s == chunked.prefill_s > whole.prefill_s
    assert chunked.output_tokens_per_s < whole.output_tokens_per_s
    note, = [n for n in chunked.notes if "chunks" in n]
    assert (f"prefills the 2048-token prompt in 2 chunks: a request alone waits {chunked.prefill_s * 1e3:.1f} ms "
            f"for its first token, {(chunked.prefill_s - whole.prefill_s) * 1e3:.1f} ms more than in one step with "
            f"max_num_tokens 2048 ({whole.prefill_s * 1e3:.1f} ms)") in note
    assert f"at batch 1 gives TTFT {whole.ttft_s * 1e3:.0f} ms" in note
    assert not [n for n in whole.notes if "chunks" in n]


def test_a_p99_budget_at_batch_1_is_held_to_one_clients_latency():
    """At batch 1 the latency the budget is held to is the lone request's prefill plus its decode steps: a budget
    5% above it is met, one 5% below it is refused with that TTFT."""
    workload = {"input_len": 2048, "output_len": 16}
    one = make_plan(llama("llama-2-7b"), get_target("l40s"), "fp8",
                    workload=Workload(**workload, concurrency=1)).performance
    alone = one.prefill_s + 15 * one.tpot_s
    met = make_plan(llama("llama-2-7b"), get_target("l40s"), "fp8",
                    workload=Workload(**workload, p99_latency_s=1.05 * alone)).performance
    assert met.request_latency_s <= 1.05 * alone
    with pytest.raises(UserError, match=rf"predicts {alone:.3f} s at batch 1 \(TTFT {one.prefill_s * 1e3:.1f} ms \+"):
        make_plan(llama("llama-2-7b"), get_target("l40s"), "fp8",
                  workload=Workload(**workload, p99_latency_s=0.95 * alone))
