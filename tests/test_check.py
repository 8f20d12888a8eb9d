"""`trtpipe check`: a clean repository passes; each kind of breakage is caught with file, field and fix."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import TRTLLM_VERSION
from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.deploy import deploy_repository
from pipeline.plan import load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.targets import get_target
from pipeline.tritonconfig import parse_pbtxt, to_pbtxt


def engine_config_for(plan_path: Path, **build_overrides) -> dict:
    """The config.json trtllm-build writes (EngineConfig.to_dict: version, pretrained_config, build_config)."""
    plan = load_plan(plan_path)
    build = {**asdict(plan.build_config), "plugin_config": asdict(plan.plugin_config)}
    for key, value in build_overrides.items():
        if key in build["plugin_config"]:
            build["plugin_config"][key] = value
        else:
            build[key] = value
    return {"version": TRTLLM_VERSION, "pretrained_config": {"architecture": plan.model.arch.architecture},
            "build_config": build}


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory) -> Path:
    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("rtx4090"), "fp16")
    return save_plan(plan, tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.fixture(scope="module")
def clean_repo(gpu_plan, smollm2_hf_dir, tmp_path_factory) -> Path:
    """A GPU repository deployed from the plan, with a matching engine config.json beside it."""
    root = tmp_path_factory.mktemp("clean")
    engine = root / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps(engine_config_for(gpu_plan)))
    return deploy_repository(load_plan(gpu_plan), root / "repo", engine=engine, tokenizer=smollm2_hf_dir).path


@pytest.fixture
def repo(clean_repo, tmp_path) -> Path:
    """A private copy of the clean repository; its engine is a private copy too."""
    engine = tmp_path / "engine"
    shutil.copytree(clean_repo.parent / "engine", engine)
    copy = tmp_path / "repo"
    shutil.copytree(clean_repo, copy)
    edit(copy, "tensorrt_llm", lambda c: set_parameter(c, "gpt_model_path", str(engine)))
    return copy


def edit(repo: Path, model: str, change) -> None:
    path = repo / model / "config.pbtxt"
    config = parse_pbtxt(path.read_text())
    change(config)
    path.write_text(to_pbtxt(config))


def set_parameter(config, key: str, value: str) -> None:
    config.parameters[key].string_value = value


def edit_engine(repo: Path, **build_overrides) -> None:
    path = Path(parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())
                .parameters["gpt_model_path"].string_value) / "config.json"
    config = json.loads(path.read_text())
    for key, value in build_overrides.items():
        target = config["build_config"]["plugin_config"] if key in config["build_config"]["plugin_config"] \
            else config["build_config"]
        target[key] = value
    path.write_text(json.dumps(config))


def run_check(repo: Path, *args) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["check", str(repo), "--json", *args])
    return result.exit_code, json.loads(result.output)


def errors(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["severity"] == "error"]


def only_error(report: dict, code: str) -> dict:
    """The one error of `code`; a tensor declared otherwise than NVIDIA's also differs from NVIDIA's contract,
    which check_tensor_contract reports besides (tested on its own)."""
    found = [f for f in errors(report) if f["code"] != "tensor" or code == "tensor"]
    assert [f["code"] for f in found] == [code], found
    assert found[0]["fix"]
    return found[0]


def test_clean_repository_passes(repo):
    code, report = run_check(repo)
    assert code == 0 and report["ok"]
    assert report["findings"] == []
    assert report["models"] == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]


def test_text_output_names_each_finding(repo):
    (repo / "preprocessing" / "config.pbtxt").write_text(
        (repo / "preprocessing" / "config.pbtxt").read_text() + "max_batch_sizee: 4\n")
    result = CliRunner().invoke(main, ["check", str(repo)])
    assert result.exit_code == 1
    assert "preprocessing/config.pbtxt" in result.output and "Fix:" in result.output
    assert "WRONG" in result.output.splitlines()[-1]


def test_schema_error_is_caught_with_its_line(repo):
    path = repo / "postprocessing" / "config.pbtxt"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + ["max_batch_sizee: 4"]) + "\n")
    code, report = run_check(repo)
    finding = only_error(report, "schema")
    assert code == 1
    assert finding["file"] == "postprocessing/config.pbtxt"
    assert finding["field"].startswith(f"line {len(lines) + 1}")
    assert "max_batch_sizee" in finding["problem"]


def test_placeholder_in_a_number_field_breaks_the_schema_and_is_named(repo):
    path = repo / "tensorrt_llm" / "config.pbtxt"
    text = path.read_text()
    batch_line = next(line for line in text.splitlines() if line.startswith("max_batch_size:"))
    path.write_text(text.replace(batch_line, "max_batch_size: ${triton_max_batch_size}"))
    code, report = run_check(repo)
    assert code == 1
    codes = {f["code"] for f in errors(report)}
    assert codes == {"schema", "placeholder"}
    placeholder = next(f for f in errors(report) if f["code"] == "placeholder")
    assert placeholder["file"] == "tensorrt_llm/config.pbtxt" and "triton_max_batch_size" in placeholder["fix"]


def test_placeholder_left_in_a_string_parameter_is_caught(repo):
    edit(repo, "preprocessing", lambda c: set_parameter(c, "tokenizer_dir", "${tokenizer_dir}"))
    code, report = run_check(repo)
    finding = only_error(report, "placeholder")
    assert code == 1
    assert (finding["file"], finding["field"]) == ("preprocessing/config.pbtxt",
                                                   "parameters[tokenizer_dir].string_value")


def test_placeholder_in_another_config_file_is_caught(repo):
    (repo / "tensorrt_llm_bls" / "1" / "settings.yaml").write_text("engine: ok\nmodel: ${model_name}\n")
    code, report = run_check(repo)
    finding = only_error(report, "placeholder")
    assert (finding["file"], finding["field"]) == ("tensorrt_llm_bls/1/settings.yaml", "line 2")


def _rename_step_input(config, old: str, new: str) -> None:
    step = next(s for s in config.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    step.input_map[new] = step.input_map.pop(old)


def test_ensemble_step_input_that_the_model_lacks_is_caught(repo):
    edit(repo, "ensemble", lambda c: _rename_step_input(c, "runtime_top_k", "top_k"))
    code, report = run_check(repo)
    finding = only_error(report, "wiring")
    assert finding["field"] == "ensemble_scheduling.step[1].input_map[top_k]"
    assert "no input 'top_k'" in finding["problem"]


def test_required_input_left_unmapped_is_caught(repo):
    edit(repo, "ensemble", lambda c: next(s for s in c.ensemble_scheduling.step
                                          if s.model_name == "tensorrt_llm").input_map.pop("input_lengths"))
    finding = only_error(run_check(repo)[1], "wiring")
    assert "required input 'input_lengths'" in finding["problem"]


def test_dtype_mismatch_across_a_step_is_caught(repo):
    def make_top_p_int(config):
        next(t for t in config.input if t.name == "runtime_top_p").data_type = 8  # TYPE_INT32
    edit(repo, "tensorrt_llm", make_top_p_int)
    finding = only_error(run_check(repo)[1], "wiring")
    assert finding["file"] == "ensemble/config.pbtxt"
    assert finding["field"] == "ensemble_scheduling.step[1].input_map[runtime_top_p]"
    assert "TYPE_FP32" in finding["problem"] and "TYPE_INT32" in finding["problem"]


def test_tensors_are_checked_against_nvidias_contract(repo):
    """A tensor declared otherwise than in NVIDIA's config.pbtxt is an error; one left out is a warning that names it
    (NVIDIA's BLS requests it, and Triton refuses a request for an undeclared tensor)."""
    def drop_and_change(config):
        keep = [t for t in config.output if t.name != "acceptance_rate"]
        del config.output[:]
        config.output.extend(keep)
        next(t for t in config.input if t.name == "stop").optional = False
    edit(repo, "tensorrt_llm", drop_and_change)
    findings = [f for f in run_check(repo)[1]["findings"] if f["code"] == "tensor"]
    assert [(f["severity"], f["field"]) for f in findings] == [("error", "input[stop]"), ("warning", "outputs")]
    assert "optional false" in findings[0]["problem"] and "acceptance_rate" in findings[1]["problem"]


def test_shape_mismatch_across_a_step_is_caught(repo):
    def two_dim_input_ids(config):
        tensor = next(t for t in config.output if t.name == "INPUT_ID")
        del tensor.dims[:]
        tensor.dims.extend([-1, -1])
    edit(repo, "preprocessing", two_dim_input_ids)
    finding = only_error(run_check(repo)[1], "wiring")
    assert finding["field"] == "ensemble_scheduling.step[1].input_map[input_ids]"
    assert "shape [-1, -1]" in finding["problem"]


def test_ensemble_output_produced_by_no_step_is_caught(repo):
    edit(repo, "ensemble", lambda c: c.ensemble_scheduling.step[2].output_map.pop("OUTPUT"))
    finding = only_error(run_check(repo)[1], "wiring")
    assert finding["field"] == "output[text_output]"


def test_step_naming_a_missing_model_is_caught(repo):
    shutil.rmtree(repo / "postprocessing")
    finding = only_error(run_check(repo)[1], "wiring")
    assert finding["field"] == "ensemble_scheduling.step[2].model_name"


def test_max_batch_size_above_the_engine_is_caught(repo):
    edit_engine(repo, max_batch_size=16)
    code, report = run_check(repo)
    finding = only_error(report, "batch-size")
    assert code == 1
    assert (finding["file"], finding["field"]) == ("tensorrt_llm/config.pbtxt", "max_batch_size")
    assert "16" in finding["fix"]


def test_ensemble_batch_above_a_step_model_is_caught(repo):
    edit(repo, "postprocessing", lambda c: setattr(c, "max_batch_size", 4))
    finding = only_error(run_check(repo)[1], "batch-size")
    assert (finding["file"], finding["field"]) == ("ensemble/config.pbtxt", "ensemble_scheduling.step[2].model_name")


def test_streaming_bls_over_a_non_decoupled_model_is_caught(repo):
    edit(repo, "tensorrt_llm", lambda c: setattr(c.model_transaction_policy, "decoupled", False))
    finding = only_error(run_check(repo)[1], "streaming")
    assert (finding["file"], finding["field"]) == ("tensorrt_llm/config.pbtxt", "model_transaction_policy.decoupled")


def test_non_decoupled_repository_warns_that_streaming_requests_fail(repo):
    for model in ("tensorrt_llm", "tensorrt_llm_bls"):
        edit(repo, model, lambda c: setattr(c.model_transaction_policy, "decoupled", False))
    code, report = run_check(repo)
    assert code == 0
    assert [(f["code"], f["severity"]) for f in report["findings"]] == [("streaming", "warning")]


def test_kv_reuse_and_chunked_context_without_paged_context_fmha_are_caught(repo):
    edit_engine(repo, use_paged_context_fmha=False)
    code, report = run_check(repo)
    assert code == 1
    fields = sorted(f["field"] for f in errors(report) if f["code"] == "paged-context-fmha")
    assert fields == ["parameters[enable_chunked_context]", "parameters[enable_kv_cache_reuse]"]
    assert len(errors(report)) == 2


def test_preferred_batch_size_above_max_batch_size_is_caught(repo):
    def too_big(config):
        config.dynamic_batching.preferred_batch_size.append(config.max_batch_size + 1)
    edit(repo, "preprocessing", too_big)
    finding = only_error(run_check(repo)[1], "preferred-batch-size")
    assert (finding["file"], finding["field"]) == ("preprocessing/config.pbtxt",
                                                   "dynamic_batching.preferred_batch_size")


def test_engine_from_another_tensorrt_llm_version_is_caught(repo):
    path = repo.parent / "engine" / "config.json"
    config = json.loads(path.read_text())
    config["version"] = "1.1.0"
    path.write_text(json.dumps(config))
    finding = only_error(run_check(repo)[1], "engine-version")
    assert "1.1.0" in finding["problem"] and TRTLLM_VERSION in finding["problem"]


def test_engine_in_the_old_format_is_caught(repo):
    path = repo.parent / "engine" / "config.json"
    config = json.loads(path.read_text())
    config["builder_config"] = config.pop("build_config")
    config["version"] = "0.7.1"
    path.write_text(json.dumps(config))
    finding = only_error(run_check(repo)[1], "engine-version")
    assert "no build_config" in finding["problem"]


def test_missing_engine_is_information_not_an_error(repo):
    shutil.rmtree(repo.parent / "engine")
    code, report = run_check(repo)
    assert code == 0
    assert [(f["code"], f["severity"]) for f in report["findings"]] == [("engine", "info")]


def test_engine_option_overrides_the_path_in_the_config(repo, tmp_path):
    elsewhere = tmp_path / "moved-engine"
    (repo.parent / "engine").rename(elsewhere)
    assert run_check(repo)[1]["findings"][0]["code"] == "engine"
    config = json.loads((elsewhere / "config.json").read_text())
    config["build_config"]["max_batch_size"] = 2
    (elsewhere / "config.json").write_text(json.dumps(config))
    code, report = run_check(repo, "--engine", str(elsewhere))
    assert code == 1 and only_error(report, "batch-size")


def test_not_a_repository_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["check", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "does not exist" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(main, ["check", str(empty)])
    assert result.exit_code == 2 and "holds no model" in result.output


def test_check_repository_api_reports_the_engine_it_used(repo):
    report = check_repository(repo)
    assert report.ok and report.engine == repo.parent / "engine"


def test_model_directory_without_config_and_misnamed_config_are_caught(repo):
    (repo / "tensorrt_llm_bls" / "config.pbtxt").unlink()
    edit(repo, "postprocessing", lambda c: setattr(c, "name", "postprocess"))
    code, report = run_check(repo)
    assert code == 1
    found = sorted((f["code"], f["file"], f["field"]) for f in errors(report))
    assert found == [("schema", "postprocessing/config.pbtxt", "name"),
                     ("schema", "tensorrt_llm_bls/config.pbtxt", "(file)")]


def test_python_runtime_llm_model_is_checked_against_its_engine_too(repo):
    """NVIDIA's Python-runtime tensorrt_llm (triton_backend:python) reads the same engine; preprocessing's
    multimodal gpt_model_path does not make it an engine model."""
    edit(repo, "tensorrt_llm", lambda c: setattr(c, "backend", "python"))
    edit(repo, "preprocessing", lambda c: set_parameter(c, "gpt_model_path", str(repo.parent / "engine")))
    edit_engine(repo, max_batch_size=16)
    finding = only_error(run_check(repo)[1], "batch-size")
    assert finding["file"] == "tensorrt_llm/config.pbtxt"


# ----------------------------------------------------------------------------------------------
# NVIDIA's contract (pipeline/backends/nvidia_contract.py, docs/upstream-facts.md §B2)


@pytest.mark.parametrize("key", ["gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path",
                                 "guided_decoding_backend"])
def test_a_key_the_tensorrtllm_backend_cannot_load_without_is_an_error(repo, key):
    edit(repo, "tensorrt_llm", lambda c: c.parameters.pop(key))
    code, report = run_check(repo)
    finding = only_error(report, "parameter")
    assert code == 1 and finding["field"] == f"parameters[{key}]"
    assert f"Cannot find parameter with name: {key}" in finding["problem"]
    assert "remove" not in finding["fix"]


def test_nvidias_own_placeholders_for_unset_keys_are_warnings_not_errors(repo):
    """NVIDIA's documented fill leaves `${...}` in keys the backend treats as not set: a warning naming the default,
    never advice to remove a key whose absence fails the load."""
    placeholders = {"guided_decoding_backend": None, "xgrammar_tokenizer_info_path": None, "tokenizer_dir": None,
                    "kv_cache_free_gpu_mem_fraction": "executor's 0.9", "enable_kv_cache_reuse": "true",
                    "lookahead_window_size": None}
    for key in placeholders:
        edit(repo, "tensorrt_llm", lambda c, key=key: set_parameter(c, key, "${" + key + "}"))
    code, report = run_check(repo)
    assert code == 0, errors(report)
    found = {f["field"]: f for f in report["findings"] if f["code"] == "placeholder"}
    for key, default in placeholders.items():
        finding = found[f"parameters[{key}].string_value"]
        assert finding["severity"] == ("info" if key.startswith("lookahead") else "warning"), finding
        assert "remove" not in finding["fix"]
        if default:
            assert default in finding["problem"]


@pytest.mark.parametrize("model, key", [("tensorrt_llm", "gpt_model_type"), ("postprocessing", "tokenizer_dir")])
def test_a_placeholder_nvidias_code_cannot_load_with_is_an_error_that_keeps_the_entry(repo, model, key):
    edit(repo, model, lambda c: set_parameter(c, key, "${" + key + "}"))
    code, report = run_check(repo)
    finding = only_error(report, "placeholder")
    assert code == 1 and "fails to load" in finding["problem"] and "the entry must stay" in finding["fix"]


def test_lookahead_keys_are_required_once_decoding_mode_is_lookahead(repo):
    edit(repo, "tensorrt_llm", lambda c: (set_parameter(c, "decoding_mode", "lookahead"),
                                          set_parameter(c, "lookahead_window_size", "${lookahead_window_size}")))
    code, report = run_check(repo)
    assert code == 1 and only_error(report, "placeholder")["field"] == "parameters[lookahead_window_size].string_value"


# ----------------------------------------------------------------------------------------------
# A value followed to where NVIDIA's code finally uses it (docs/upstream-facts.md §B2)

#: The string parameters NVIDIA's 1.2.0rc8 templates still hold as `${...}` after the fill NVIDIA documents
#: (triton_backend/docs/llama.md: tokenizer_dir, engine_dir, batch sizes, data types and a few values only);
#: `key:name` where the placeholder is named otherwise than the key.
NVIDIA_FILL_LEAVES = {
    "tensorrt_llm": """encoder_model_path:encoder_engine_dir sink_token_length batch_scheduler_policy
        cross_kv_cache_fraction kv_cache_host_memory_bytes kv_cache_onboard_blocks enable_trt_overlap
        cancellation_check_period_ms stats_check_period_ms iter_stats_max_iterations request_stats_max_iterations
        normalize_log_probs enable_chunked_context gpu_device_ids participant_ids num_nodes
        lora_cache_optimal_adapter_size lora_cache_max_adapter_size lora_cache_gpu_memory_fraction
        lora_cache_host_memory_bytes lora_prefetch_dir decoding_mode lookahead_window_size lookahead_ngram_size
        lookahead_verification_set_size medusa_choices eagle_choices gpu_weights_percent enable_context_fmha_fp32_acc
        multi_block_mode cuda_graph_mode cuda_graph_cache_size speculative_decoding_fast_logits tokenizer_dir
        guided_decoding_backend xgrammar_tokenizer_info_path""",
    "preprocessing": "add_special_tokens multimodal_model_path gpt_model_path:engine_dir max_num_images hf_model_path",
    "postprocessing": "skip_special_tokens",
    "tensorrt_llm_bls": "tensorrt_llm_model_name tensorrt_llm_draft_model_name multimodal_encoders_name",
}


def leave_placeholders(config, keys: str) -> None:
    for item in keys.split():
        key, _, name = item.partition(":")
        set_parameter(config, key, "${" + (name or key) + "}")


def multimodal_engine(root: Path, model_type: str) -> Path:
    """A multimodal engine directory as NVIDIA's preprocessing reads it: config.json's builder_config.model_type."""
    engine = root / "vision"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"builder_config": {"model_type": model_type}}))
    return engine


def test_nvidias_templates_filled_as_nvidia_documents_have_no_error(repo):
    """NVIDIA's code runs on its own documented fill: the tensorrtllm backend passes `${lora_prefetch_dir}` on and
    TensorRT-LLM skips a prefetch directory that does not exist (peftCacheManager.cpp); a text model's preprocessing
    never reads gpt_model_path or hf_model_path (model.py reads them only for a multimodal engine)."""
    for model, keys in NVIDIA_FILL_LEAVES.items():
        edit(repo, model, lambda c, keys=keys: leave_placeholders(c, keys))
    code, report = run_check(repo)
    assert code == 0, errors(report)
    found = {(f["file"], f["field"]): f for f in report["findings"]}
    lora = found[("tensorrt_llm/config.pbtxt", "parameters[lora_prefetch_dir].string_value")]
    assert lora["severity"] == "warning"
    assert "TensorRT-LLM skips a prefetch directory that does not exist: peftCacheManager.cpp" in lora["problem"]
    for key in ("gpt_model_path", "hf_model_path"):
        finding = found[("preprocessing/config.pbtxt", f"parameters[{key}].string_value")]
        assert finding["severity"] == "info" and "multimodal engine" in finding["problem"]


@pytest.mark.parametrize("model_type, loads_a_processor", [
    ("mllama", True), ("llava_onevision", True), ("qwen2_vl", True), ("pixtral", True),
    ("llava", False), ("blip2-opt", False), ("vila", False)])
def test_hf_model_path_is_read_only_by_the_multimodal_types_that_load_a_processor(repo, tmp_path, model_type,
                                                                                  loads_a_processor):
    """NVIDIA's preprocessing (1.2.0rc8) loads AutoProcessor from hf_model_path for mllama, llava_onevision,
    qwen2_vl and pixtral; the other multimodal types it accepts never read the key."""
    vision = multimodal_engine(tmp_path, model_type)
    engine = str(repo.parent / "engine")
    edit(repo, "preprocessing", lambda c: (set_parameter(c, "multimodal_model_path", str(vision)),
                                           set_parameter(c, "gpt_model_path", engine),
                                           set_parameter(c, "hf_model_path", "${hf_model_path}")))
    code, report = run_check(repo)
    finding = next(f for f in report["findings"] if f["field"] == "parameters[hf_model_path].string_value")
    if loads_a_processor:
        assert code == 1 and finding["severity"] == "error"
        assert "fails to load" in finding["problem"] and "the entry must stay" in finding["fix"]
    else:
        assert code == 0 and finding["severity"] == "info"


def test_preprocessing_reads_the_engine_path_only_with_a_multimodal_engine(repo, tmp_path):
    edit(repo, "preprocessing", lambda c: set_parameter(c, "gpt_model_path", "${engine_dir}"))
    code, report = run_check(repo)
    assert code == 0 and [f["severity"] for f in report["findings"]] == ["info"]
    vision = multimodal_engine(tmp_path, "llava")
    edit(repo, "preprocessing", lambda c: set_parameter(c, "multimodal_model_path", str(vision)))
    finding = only_error(run_check(repo)[1], "placeholder")
    assert finding["field"] == "parameters[gpt_model_path].string_value" and "fails to load" in finding["problem"]
