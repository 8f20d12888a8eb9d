"""The same plan for vLLM and TGI (pipeline/plan/servers.py): each figure recomputed here from the plan's
own fields for Llama-3-8B on the RTX 4090, the conversions that must not be copies, and the refusals."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.plan import plan_document, resolve_model_info
from pipeline.planner import make_plan
from pipeline.plan.servers import server_settings
from pipeline.targets import get_target


@pytest.fixture(scope="module")
def plan():
    return make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")


def flags(settings) -> dict[str, str]:
    return {s.flag: s.value for s in settings.settings}


def test_vllm_gets_the_plans_batch_context_and_kv_bytes_as_a_share_of_total_memory(plan):
    vllm = flags(server_settings(plan, "vllm"))
    m = plan.memory
    assert vllm["--max-num-seqs"] == str(plan.build_config.max_batch_size)
    assert vllm["--max-model-len"] == str(plan.max_seq_len) == "8192"
    assert vllm["--max-num-batched-tokens"] == str(plan.build_config.max_num_tokens)
    # not TensorRT-LLM's 0.9 of the free memory: weights + activations + the KV bytes, of the 24564 MiB it reports
    share = (m.weights_bytes_per_rank + m.activation_bytes + m.kv_cache_bytes) / (24564 << 20)
    assert vllm["--gpu-memory-utilization"] == f"{share:.3f}"
    assert float(vllm["--gpu-memory-utilization"]) != m.kv_cache_free_gpu_mem_fraction
    assert vllm["--kv-cache-dtype"] == "fp8_e4m3" and vllm["--dtype"] == "bfloat16"


def test_tgi_budgets_the_kv_cache_in_tokens_and_admits_batch_plus_queue(plan):
    tgi = flags(server_settings(plan, "tgi"))
    assert tgi["--max-batch-total-tokens"] == str(plan.memory.kv_cache_tokens)
    assert tgi["--max-concurrent-requests"] == str(plan.build_config.max_batch_size + plan.triton.max_queue_size)
    assert tgi["--max-total-tokens"] == "8192" and tgi["--max-input-tokens"] == str(plan.build_config.max_input_len)
    assert tgi["--kv-cache-dtype"] == "fp8_e4m3fn"
    notes = " ".join(server_settings(plan, "tgi").notes)
    assert "calibrated" in notes and "--quantize fp8" in notes


def test_plan_json_carries_both_and_the_cli_prints_a_launch_line():
    result = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp16", "--json"])
    data = json.loads(result.output)
    assert set(data["equivalents"]) == {"vllm", "tgi"}
    assert all(s["arithmetic"] for s in data["equivalents"]["vllm"]["settings"])
    line = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp16",
                                     "--server", "vllm"])
    assert line.exit_code == 0 and line.output.startswith("vllm serve meta-llama/Meta-Llama-3-8B ")


def test_plans_the_servers_cannot_express_are_refused():
    cpu = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    for server, stated in plan_document(cpu)["equivalents"].items():
        assert stated["settings"] == [] and stated["notes"][0].startswith("no equivalent: the cpu target")
    with pytest.raises(UserError, match="from a GPU plan"):
        server_settings(cpu, "vllm")
    pp = make_plan(resolve_model_info("llama-3-8b"), get_target("h100"), "fp16", pp=2)
    with pytest.raises(UserError, match="tensor parallelism only"):
        server_settings(pp, "tgi")
    assert "--pipeline-parallel-size" in flags(server_settings(pp, "vllm"))
    # plan.json says why TGI has none for this plan, instead of leaving it out
    assert "tensor parallelism only" in plan_document(pp)["equivalents"]["tgi"]["notes"][0]


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_a_pytorch_backend_plan_has_equivalents_from_its_llm_api_settings(precision):
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), precision, backend="pytorch")
    options = plan.llm_api.options
    vllm, tgi = (flags(server_settings(plan, s)) for s in ("vllm", "tgi"))
    assert vllm["--max-num-seqs"] == str(options["max_batch_size"])
    assert vllm["--max-num-batched-tokens"] == str(max(options["max_num_tokens"], options["max_batch_size"]))
    assert vllm["--max-model-len"] == tgi["--max-total-tokens"] == str(options["max_seq_len"])
    assert tgi["--max-input-tokens"] == str(options["max_seq_len"] - 1)
    assert tgi["--max-batch-total-tokens"] == str(options["kv_cache_config"]["max_tokens"])
    m = plan.memory
    share = (m.weights_bytes_per_rank + m.activation_bytes + m.kv_cache_bytes) / m.memory_bytes
    assert vllm["--gpu-memory-utilization"] == f"{share:.3f}"
    # the same budget as the engine plan of the same request
    engine = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), precision)
    assert vllm == flags(server_settings(engine, "vllm"))
    data = json.loads(CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision",
                                                precision, "--backend", "pytorch", "--json"]).output)
    assert set(data["equivalents"]) == {"vllm", "tgi"}
    assert all(s["arithmetic"] for e in data["equivalents"].values() for s in e["settings"])
    assert ("calibrated Hugging Face checkpoint" in " ".join(data["equivalents"]["vllm"]["notes"])) == (
        precision == "fp8")


def test_an_int4_plan_names_the_4bit_checkpoint_vllm_loads_and_no_load_time_quantization():
    plan = make_plan(resolve_model_info("qwen2.5-32b"), get_target("rtx4090"), "int4-awq")
    vllm = server_settings(plan, "vllm")
    notes = " ".join(vllm.notes)
    assert "--precision int4-awq --format vllm" in notes and "--quantization" not in flags(vllm)
    assert "not checked here" in " ".join(server_settings(plan, "tgi").notes)
    assert "--quantize" not in flags(server_settings(plan, "tgi"))
