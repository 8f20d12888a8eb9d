"""The cpu target's scheduling choices, from the plan to the served model: batch_scheduler_policy, the KV block pool,
max_num_tokens and priority levels are planned, written into the tensorrt_llm config by deploy and read back by the
model as its scheduler's limits; a backend that would ignore priorities refuses them."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import MessageToDict

from pipeline.deploy import model_specs, settings_from_plan
from pipeline.errors import UserError
from pipeline.plan import Overrides, Workload
from pipeline.planner import make_plan, replan
from pipeline.presets import PRESETS
from pipeline.runtime.scheduler import MAX_UTILIZATION
from pipeline.targets import get_target
from pipeline.triton_names import TENSORRT_LLM
from pipeline.tritonconfig import build_model_config

from support.triton_stubs import load_cpu_model


def cpu_plan(**overrides):
    return make_plan(PRESETS["smollm2-135m"].arch, get_target("cpu"), "fp32", workload=Workload(input_len=64,
                     output_len=32), overrides=Overrides(**overrides))


def served_config(plan) -> dict:
    """The tensorrt_llm config as deploy writes it, in the JSON form Triton hands the model's initialize."""
    spec = next(s for s in model_specs(settings_from_plan(plan, None)) if s.name == TENSORRT_LLM)
    return MessageToDict(build_model_config(spec), preserving_proto_field_name=True)


def test_the_planned_limits_reach_the_models_scheduler(monkeypatch):
    plan = cpu_plan(batch_scheduler_policy=MAX_UTILIZATION, max_num_tokens=256, priority_levels=3,
                    default_priority_level=2)
    module = load_cpu_model(monkeypatch)
    config = served_config(plan)
    limits = module.scheduler_limits(config)
    assert (limits.policy, limits.max_num_tokens, limits.priority_levels, limits.default_priority_level) == (
        MAX_UTILIZATION, 256, 3, 2)
    assert limits.kv_tokens == plan.memory.kv_cache_tokens and limits.kv_tokens % limits.tokens_per_block == 0
    assert limits.max_rows == plan.triton.triton_max_batch_size
    assert config["dynamic_batching"]["priority_levels"] == "3"


def test_by_default_the_cpu_plan_guarantees_no_eviction_and_has_no_levels(monkeypatch):
    plan = cpu_plan()
    limits = load_cpu_model(monkeypatch).scheduler_limits(served_config(plan))
    assert limits.policy == "guaranteed_no_evict" and limits.priority_levels == 0
    assert limits.max_num_tokens == plan.max_seq_len       # any prompt the context allows fits one step
    assert "priority_levels" not in served_config(plan)["dynamic_batching"]


def test_replanning_keeps_the_plans_own_scheduling_choices():
    plan = cpu_plan(batch_scheduler_policy=MAX_UTILIZATION, priority_levels=2, default_priority_level=2)
    again = replan(plan, Overrides(max_batch_size=2))
    assert (again.triton.batch_scheduler_policy, again.triton.priority_levels, again.triton.triton_max_batch_size) == (
        MAX_UTILIZATION, 2, 2)


@pytest.mark.parametrize("target, overrides, message", [
    ("rtx4090", {"priority_levels": 2}, "the engine backend does not schedule requests by priority"),
    ("cpu", {"default_priority_level": 2}, "needs --priority-levels N"),
    ("cpu", {"priority_levels": 2, "default_priority_level": 3}, "1 <= it <= N"),
    ("cpu", {"batch_scheduler_policy": "fcfs"}, "batch_scheduler_policy must be one of"),
])
def test_scheduling_a_backend_cannot_honour_is_refused(target, overrides, message):
    with pytest.raises(UserError, match=message):
        make_plan(PRESETS["smollm2-135m"].arch, get_target(target), "fp16" if target != "cpu" else "fp32",
                  overrides=Overrides(**overrides))


@pytest.mark.parametrize("parameters, message", [
    ({"batch_scheduler_policy": "fcfs"}, "batch_scheduler_policy 'fcfs' is not one of"),
    ({"enable_chunked_context": "true"}, "does not chunk context"),
    ({"max_tokens_in_paged_kv_cache": "4096"}, "needs tokens_per_block"),
    ({"max_num_tokens": "many"}, "max_num_tokens must be an integer"),
])
def test_a_scheduling_parameter_the_model_cannot_honour_stops_its_load(monkeypatch, parameters, message):
    module = load_cpu_model(monkeypatch)
    config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}
    with pytest.raises(ValueError, match=message):
        module.scheduler_limits(json.loads(json.dumps(config)))


def test_the_plan_command_takes_the_scheduling_options_and_refuses_them_where_they_would_be_ignored():
    from click.testing import CliRunner

    from pipeline.cli import main

    ok = CliRunner().invoke(main, ["plan", "smollm2-135m", "--target", "cpu", "--precision", "fp32", "--json",
                                   "--priority-levels", "2", "--batch-scheduler-policy", "max_utilization"])
    assert ok.exit_code == 0, ok.output
    triton = json.loads(ok.output)["triton"]
    assert (triton["priority_levels"], triton["default_priority_level"], triton["batch_scheduler_policy"]) == (
        2, 2, MAX_UTILIZATION)
    refused = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8",
                                        "--priority-levels", "2"])
    assert refused.exit_code == 2 and "does not schedule requests by priority" in refused.output
    assert "Traceback" not in refused.output
