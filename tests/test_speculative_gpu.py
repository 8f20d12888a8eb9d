"""Speculative decoding planned and configured for a GPU target (pipeline/plan/speculative_gpu.py): the draft's
memory beside the target's, the speedup from aiconfigurator-core's decode operations, the PyTorch backend's
`speculative_config` per TensorRT-LLM version and the engine path's trtllm-build flags. Nothing here runs on a GPU."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from click.testing import CliRunner

from pipeline.backends.llm_api_args import unknown_llm_api_keys
from pipeline.backends.pytorch import EXTRA_OPTIONS, SERVE_CONFIG
from pipeline.cli import main
from pipeline.compile import trtllm_build_command
from pipeline.plan import speculative_gpu
from pipeline.plan.speculative import SpeculativeRequest
from pipeline.backends.pytorch import speculative_config
from pipeline.planner import make_plan
from pipeline.plan import Overrides, resolve_model_info
from pipeline.targets import get_target

NEW = "trtllm-1.3.0rc27"


def plan_json(*args) -> dict:
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("image, decoding_type", [(None, "DraftTarget"), (NEW, "Draft_Target")])
def test_pytorch_draft_target_config_names_the_type_each_version_parses(image, decoding_type):
    """1.2.x parses speculative_config through DecodingBaseConfig.from_dict's class map ("DraftTarget"); 1.3's
    pydantic union discriminates on each class's Literal ("Draft_Target"); both read speculative_model_dir (1.3 as
    an alias of speculative_model) and max_concurrency (1.3: PositiveInt)."""
    plan = plan_json("llama-3.1-8b", "--target", "rtx4090", "--precision", "fp8", "--backend", "pytorch",
                     "--speculative", "draft:llama-3.2-1b", "--draft-len", "4",
                     *(["--runtime-image", image] if image else []))
    config = plan["llm_api"]["options"]["speculative_config"]
    spec = plan["speculative"]
    assert config == {"decoding_type": decoding_type, "max_draft_len": 4, "max_concurrency": spec["max_rows"],
                      "speculative_model_dir": "meta-llama/Llama-3.2-1B"}
    assert spec["max_rows"] >= 1 and spec["decoding_mode"] == decoding_type
    assert not unknown_llm_api_keys(plan["llm_api"]["options"], False, plan["llm_api"]["tensorrt_llm_version"])
    assert "max_concurrency" in plan["llm_api"]["reasons"]["speculative_config"]


def test_ngram_config_sets_the_matching_size_1_2_would_default_to_0():
    config = speculative_config(
        make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8", backend="pytorch",
                  speculative=SpeculativeRequest("ngram")).speculative, "1.2.1")
    assert config["decoding_type"] == "NGram" and config["max_matching_ngram_size"] == 3
    assert "speculative_model_dir" not in config


def test_a_draft_takes_its_weights_and_kv_cache_off_the_target_s_budget():
    target, model = get_target("rtx4090"), resolve_model_info("qwen2.5-14b")
    plain = make_plan(model, target, "int4-awq")
    spec = make_plan(model, target, "int4-awq", speculative=SpeculativeRequest("draft", "qwen2.5-7b"))
    draft = spec.speculative
    mem, before = spec.memory, plain.memory
    assert mem.draft_bytes == draft.draft_weights_bytes + mem.kv_cache_tokens * draft.draft_kv_bytes_per_token
    # the same tokens in both caches: the memory left after both models is split by their bytes per token
    left = mem.free_bytes * mem.kv_cache_free_gpu_mem_fraction
    per_token = spec.kv_bytes_per_token + draft.draft_kv_bytes_per_token
    assert left - per_token * 32 < mem.kv_cache_tokens * per_token <= left
    assert mem.kv_cache_tokens < before.kv_cache_tokens
    assert mem.free_bytes < before.free_bytes - draft.draft_weights_bytes
    assert spec.build_config.max_draft_len == 3 and draft.decoding_mode == "draft_tokens_external"
    assert (draft.draft_model, draft.draft_served) == ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct")


def test_the_pytorch_backend_s_draft_is_planned_as_it_loads_16_bit():
    """The LLM API loads the draft checkpoint as it is: a Hugging Face model in bfloat16 beside an fp8 target."""
    from pipeline.plan.memory import weights_per_rank_by_stage

    plan = make_plan(resolve_model_info("llama-3.1-8b"), get_target("rtx4090"), "fp8", backend="pytorch",
                     speculative=SpeculativeRequest("draft", "llama-3.2-1b"))
    draft = resolve_model_info("llama-3.2-1b").arch
    assert plan.speculative.draft_weights_bytes == max(weights_per_rank_by_stage(draft, "bf16", "bfloat16", 1, 1))
    assert plan.speculative.draft_kv_bytes_per_token == 16 * 2 * 8 * 64      # fp8 KV: layers x (K, V) x heads x dim
    engine = make_plan(resolve_model_info("llama-3.1-8b"), get_target("rtx4090"), "fp8",
                       speculative=SpeculativeRequest("draft", "llama-3.2-1b"))
    assert engine.speculative.draft_weights_bytes < plan.speculative.draft_weights_bytes   # built at fp8 here


def test_the_engine_build_command_carries_the_speculative_mode(tmp_path):
    plan = make_plan(resolve_model_info("qwen2.5-14b"), get_target("rtx4090"), "int4-awq",
                     speculative=SpeculativeRequest("draft", "qwen2.5-7b", draft_len=5))
    argv = trtllm_build_command(plan, tmp_path / "ckpt", tmp_path / "engine", tmp_path / "b.json")
    assert argv[argv.index("--speculative_decoding_mode") + 1] == "draft_tokens_external"
    assert argv[argv.index("--max_draft_len") + 1] == "5"
    plain = make_plan(resolve_model_info("qwen2.5-14b"), get_target("rtx4090"), "int4-awq")
    assert "--speculative_decoding_mode" not in trtllm_build_command(plain, tmp_path, tmp_path, tmp_path / "b.json")


def test_the_speedup_is_the_formula_over_the_decode_steps_it_is_given(monkeypatch):
    """p, v and d come from performance.decode_steps (the verify step as rows x (K + 1) tokens); without it the
    plan falls back to the speed-of-light bound and says so."""
    asked = []

    def steps(target, point, batches):
        asked.append((point.arch.hidden_size, list(batches)))
        return [0.010 + 0.0001 * n for n in batches], "measured", "fake"

    monkeypatch.setattr(speculative_gpu, "decode_steps", steps)
    plan = make_plan(resolve_model_info("llama-3.1-8b"), get_target("rtx4090"), "fp8", backend="pytorch",
                     speculative=SpeculativeRequest("draft", "llama-3.2-1b", draft_len=3, acceptance=0.6))
    spec = plan.speculative
    rows = spec.rows
    assert asked[0] == (4096, rows + [4 * r for r in rows]) and asked[1] == (2048, rows)
    for r, s in zip(rows, spec.speedup):
        p, v, d = 0.010 + 0.0001 * r, 0.010 + 0.0004 * r, 0.010 + 0.0001 * r
        assert s == pytest.approx((1 + 0.6 * 3) * p / (v + 3 * d), abs=1e-3)
    assert "from measured: fake" in spec.basis

    def missing(*args):
        raise ImportError("no aiconfigurator-core")

    monkeypatch.setattr(speculative_gpu, "decode_steps", missing)
    bound = make_plan(resolve_model_info("qwen2.5-14b"), get_target("rtx4090"), "fp8", backend="pytorch",
                      speculative=SpeculativeRequest("ngram"))
    assert "speed-of-light bound" in bound.speculative.basis
    assert bound.speculative.speedup[0] > 1.0      # one row is bound by reading the weights: drafts are nearly free


def test_drafting_stops_where_the_verify_step_would_pass_max_num_tokens(monkeypatch):
    monkeypatch.setattr(speculative_gpu, "decode_steps", lambda target, point, batches: ([0.01] * len(batches),
                                                                                          "measured", "flat"))
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8",
                     overrides=Overrides(max_num_tokens=64, max_batch_size=32),
                     speculative=SpeculativeRequest("ngram", draft_len=3), backend="pytorch")
    spec = plan.speculative
    assert min(spec.speedup) > 1.0 and spec.max_rows == 16      # 32 rows x 4 tokens would pass 64
    assert "drafting stops above 16 rows" in spec.basis


def test_no_gain_writes_no_speculative_config_and_says_so():
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8", backend="pytorch",
                     speculative=SpeculativeRequest("ngram", acceptance=0.0))
    assert plan.speculative.max_rows == 0 and "speculative_config" not in plan.llm_api.options
    assert any("will not draft" in w for w in plan.warnings)


def test_the_pytorch_deployment_carries_speculative_config(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "--target", "rtx4090", "--precision", "fp16",
                                       "--backend", "pytorch", "--runtime-image", NEW, "--checkpoints-on-cpu",
                                       "--speculative", "ngram", "--draft-len", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    served = yaml.safe_load((out / "model_repo" / SERVE_CONFIG).read_text())
    assert served["speculative_config"]["decoding_type"] == "NGram"
    assert served["speculative_config"]["max_draft_len"] == 2
    assert json.loads((out / "plan.json").read_text())["speculative"]["method"] == "ngram"


@pytest.mark.parametrize("args, message", [
    (["llama-3-8b", "--precision", "fp8", "--speculative", "ngram"], "use --backend pytorch"),
    (["llama-3-8b", "--precision", "fp8", "--backend", "pytorch", "--speculative", "eagle:llama-3-8b"],
     "names a model preset, not an EAGLE-3 head"),
    (["qwen2.5-14b", "--precision", "fp8", "--speculative", "draft:llama-3-8b"], "a draft must share"),
    (["llama-3-8b", "--precision", "fp8", "--backend", "pytorch", "--speculative", "ngram", "--draft-len", "17"],
     "between 1 and 16"),
])
def test_what_a_gpu_path_cannot_run_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["plan", *args[:1], "--target", "rtx4090", *args[1:]])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_pytorch_draft_checkpoint_is_refused(tiny_model_dir, tiny_ckpt):
    result = CliRunner().invoke(main, ["plan", str(tiny_model_dir), "--target", "rtx4090", "--precision", "fp16",
                                       "--backend", "pytorch", "--speculative", f"draft:{tiny_ckpt}"])
    assert result.exit_code == 2 and "not a TensorRT-LLM checkpoint" in result.output, result.output


@pytest.mark.parametrize("image", [None, NEW], ids=["triton", "trtllm-serve"])
def test_a_local_pytorch_draft_is_copied_into_the_deployment_and_named_relative_to_it(tiny_model_dir, tmp_path,
                                                                                     image):
    """draft:DIR (a Hugging Face directory) on the pytorch backend: deploy copies its files beside the served model
    and the LLM API options name the copy relative to where they are read (model.yaml: the version directory, which
    trtpipe's llmapi model resolves; the trtllm-serve YAML: the deployment's root, where its launch script runs), so
    no file a server reads names a path of this machine."""
    from support.models import buildable_copy, make_tiny_model

    draft = buildable_copy(make_tiny_model(tmp_path / "small", num_hidden_layers=1), tmp_path / "my-draft")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "--target", "rtx4090", "--precision", "fp16",
                                       "--backend", "pytorch", *(["--runtime-image", image] if image else []),
                                       "--checkpoints-on-cpu", "--speculative", f"draft:{draft}", "-o", str(out)])
    assert result.exit_code == 0, result.output
    repo = out / "model_repo"
    copied = repo / ("tensorrt_llm/1/draft" if image is None else "draft")
    assert (copied / "config.json").is_file() and list(copied.glob("*.safetensors"))
    served = yaml.safe_load((repo / (EXTRA_OPTIONS if image is None else SERVE_CONFIG)).read_text())
    assert served["speculative_config"]["speculative_model_dir"] == ("tensorrt_llm/1/draft" if image is None
                                                                     else "draft")
    if image is None:
        model_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
        assert model_yaml["speculative_config"]["speculative_model_dir"] == "draft"
    served = [p for p in repo.rglob("*") if p.suffix in (".yaml", ".sh", ".pbtxt")]   # what the servers read
    assert not [p for p in served if str(tmp_path) in p.read_text()]


def test_engine_draft_target_deploys_nvidias_draft_path(tmp_path, smollm2_hf_dir):
    """The engine path's draft-target as NVIDIA's instructions deploy it: deploy --draft-engine writes the draft's
    tensorrt_llm model (tensorrt_llm_draft, the draft engine's path, the target plan's limits) beside the target's,
    the BLS naming it and nothing decoupled, and check passes it; check finds a decoupled model or a missing draft.
    Deploy without the draft engine, and a draft engine for a plan without a draft, are one line and exit 2, before
    anything is written."""
    from pipeline.check import check_repository
    from pipeline.tritonconfig import parse_pbtxt, to_pbtxt

    plan_path = tmp_path / "plan.json"
    planned = CliRunner().invoke(main, ["plan", "qwen2.5-14b", "--target", "rtx4090", "--precision", "int4-awq",
                                        "--speculative", "draft:qwen2.5-7b", "-o", str(plan_path)])
    assert planned.exit_code == 0 and "clients send num_draft_tokens 3" in planned.output, planned.output
    deploy = ["deploy", "--plan", str(plan_path), "--engine", str(tmp_path / "engine"), "--tokenizer",
              str(smollm2_hf_dir), "-o", str(tmp_path / "repo")]
    missing = CliRunner().invoke(main, deploy)
    assert missing.exit_code == 2 and "pass --draft-engine DIR" in missing.output, missing.output
    plain_plan = tmp_path / "plain.json"
    assert CliRunner().invoke(main, ["plan", "qwen2.5-14b", "--target", "rtx4090", "--precision", "int4-awq", "-o",
                                     str(plain_plan)]).exit_code == 0
    stray = CliRunner().invoke(main, [*deploy[:2], str(plain_plan), *deploy[3:], "--draft-engine", "d"])
    assert stray.exit_code == 2 and "has no draft model there" in stray.output, stray.output
    assert not (tmp_path / "repo").exists()

    result = CliRunner().invoke(main, [*deploy, "--draft-engine", str(tmp_path / "draft-engine")])
    assert result.exit_code == 0, result.output
    repo = tmp_path / "repo"
    configs = {name: parse_pbtxt((repo / name / "config.pbtxt").read_text()) for name in
               ("tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls", "ensemble")}
    target, draft, bls = (configs[n] for n in ("tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"))
    assert draft.name == "tensorrt_llm_draft" and draft.backend == "tensorrtllm"
    assert draft.parameters["gpt_model_path"].string_value == str(tmp_path / "draft-engine")
    assert target.parameters["gpt_model_path"].string_value == str(tmp_path / "engine")
    for key in ("max_tokens_in_paged_kv_cache", "enable_kv_cache_reuse", "batch_scheduler_policy"):
        assert draft.parameters[key].string_value == target.parameters[key].string_value
    assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == "tensorrt_llm_draft"
    assert not any(c.model_transaction_policy.decoupled for c in configs.values())
    assert [(f.severity, f.code) for f in check_repository(repo).findings if f.severity == "error"] == []

    bls_text = (repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    bls.model_transaction_policy.decoupled = True
    (repo / "tensorrt_llm_bls" / "config.pbtxt").write_text(to_pbtxt(bls))
    errors = [f for f in check_repository(repo).findings if f.code == "draft"]
    assert len(errors) == 1 and "tensorrt_llm_bls is decoupled" in errors[0].problem
    (repo / "tensorrt_llm_bls" / "config.pbtxt").write_text(bls_text)
    shutil.rmtree(repo / "tensorrt_llm_draft")
    errors = [f for f in check_repository(repo).findings if f.code == "draft"]
    assert len(errors) == 1 and "which the repository lacks" in errors[0].problem


def test_the_dry_run_s_build_line_keeps_the_flags_that_shape_the_build():
    result = CliRunner().invoke(main, ["build", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--backend", "pytorch", "--speculative", "ngram", "--draft-len", "4",
                                       "--dry-run"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("to build:"))
    assert "--backend pytorch --speculative ngram --draft-len 4`" in line


def test_lookahead_builds_its_mode_and_deploys_nvidias_parameters(tmp_path, smollm2_hf_dir):
    """lookahead:W,N,G on the engine path: max_draft_len = (N - 2) + (W - 1 + G)(N - 1) (decodingConfig.cpp), the
    trtllm-build flags, and the tensorrt_llm model's decoding_mode and lookahead_* parameters, which the backend
    requires once decoding_mode is lookahead: the repository passes check."""
    from pipeline.check import check_repository
    from pipeline.deploy import deploy_repository
    from pipeline.tritonconfig import parse_pbtxt

    plan = make_plan(resolve_model_info("llama-3.1-8b"), get_target("rtx4090"), "fp8",
                     speculative=SpeculativeRequest.parse("lookahead:7,4,7", acceptance=0.4))
    spec = plan.speculative
    assert spec.lookahead == [7, 4, 7] and spec.draft_len == 2 + (7 - 1 + 7) * 3 == plan.build_config.max_draft_len
    assert spec.decoding_mode == "lookahead_decoding" and spec.drafts_per_step == 3
    for p, v, s in zip(spec.step_s, spec.verify_step_s, spec.speedup):
        assert s == pytest.approx((1 + 0.4 * 3) * p / v, abs=2e-3)
    argv = trtllm_build_command(plan, tmp_path / "c", tmp_path / "e", tmp_path / "b.json")
    assert argv[argv.index("--speculative_decoding_mode") + 1] == "lookahead_decoding"
    assert argv[argv.index("--max_draft_len") + 1] == str(spec.draft_len)
    repo = deploy_repository(plan, tmp_path / "repo", engine=tmp_path / "engine", tokenizer=smollm2_hf_dir).path
    params = {k: v.string_value for k, v in parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())
              .parameters.items()}
    assert (params["decoding_mode"], params["lookahead_window_size"], params["lookahead_ngram_size"],
            params["lookahead_verification_set_size"]) == ("lookahead", "7", "4", "7")
    assert not check_repository(repo).errors


@pytest.mark.parametrize("spec, extra, message", [
    ("lookahead", [], "needs --acceptance"),
    ("lookahead:4,3", ["--acceptance", "0.3"], "three integers"),
    ("lookahead:2,1,3", ["--acceptance", "0.3"], "W 1 and G 0 when N is 1"),
    ("lookahead", ["--acceptance", "0.3", "--draft-len", "4"], "drop --draft-len"),
    ("lookahead", ["--acceptance", "0.3", "--backend", "pytorch"], "PyTorch backend has no lookahead"),
])
def test_lookahead_requests_that_cannot_run_are_one_line(spec, extra, message):
    result = CliRunner().invoke(main, ["plan", "llama-3.1-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--speculative", spec, *extra])
    assert result.exit_code == 2 and message in result.output, result.output


def test_compile_draft_builds_the_draft_engine_with_the_target_plans_limits(tiny_hf, tiny_ckpt, checkpoint,
                                                                            tmp_path):
    """Stage by stage: plan the target with draft:CHECKPOINT, compile the draft with --draft (the target plan's
    precision, batch, lengths and plugins, no speculative mode) and the target (draft_tokens_external), deploy both
    engines: check passes. --draft with a plan without a draft, a draft of another vocabulary or one not at the
    plan's precision: one line, exit 2."""
    from pipeline.check import check_repository
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model
    from support.models import make_tiny_model

    hf = make_tiny_model(tmp_path / "draft-hf", seed=1, vocab_size=49152, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)
    draft = convert_model(resolve_model(str(hf)), tmp_path / "draft-ckpt", dtype="float16", progress=False).path
    target = convert_model(resolve_model(str(tiny_hf)), tmp_path / "ckpt", dtype="float16", progress=False).path
    plan = tmp_path / "plan.json"
    planned = CliRunner().invoke(main, ["plan", str(target), "--target", "rtx4090", "--precision", "fp16",
                                        "--max-batch-size", "8", "--input-len", "64", "--output-len", "32",
                                        "--speculative", f"draft:{draft}", "-o", str(plan)])
    assert planned.exit_code == 0, planned.output
    built = {}
    for name, ckpt, extra in (("draft-engine", draft, ["--draft"]), ("engine", target, [])):
        result = CliRunner().invoke(main, ["compile", str(ckpt), "--plan", str(plan), "-o", str(tmp_path / name),
                                           "--dry-run", *extra])
        assert result.exit_code == 0, result.output
        built[name] = (json.loads((tmp_path / name / "build_config.json").read_text()),
                       (tmp_path / name / "trtllm-build.sh").read_text())
    (draft_config, draft_command), (target_config, target_command) = built["draft-engine"], built["engine"]
    assert "--speculative_decoding_mode draft_tokens_external" in target_command
    assert "--speculative_decoding_mode" not in draft_command and "--use_paged_context_fmha enable" in draft_command
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        assert draft_config[key] == target_config[key], key
    assert target_config["max_draft_len"] == 3 and draft_config["max_draft_len"] == 0
    result = CliRunner().invoke(main, ["deploy", "--plan", str(plan), "--engine", str(tmp_path / "engine"),
                                       "--draft-engine", str(tmp_path / "draft-engine"), "--checkpoint", str(target),
                                       "-o", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    assert not check_repository(tmp_path / "repo").errors

    plain = tmp_path / "plain.json"
    assert CliRunner().invoke(main, ["plan", str(target), "--target", "rtx4090", "--precision", "fp16",
                                     "--input-len", "64", "--output-len", "32", "-o", str(plain)]).exit_code == 0
    for plan_path, ckpt, says in ((plain, draft, "this plan has none"), (plan, tiny_ckpt, "does not match the plan"),
                                  (plan, checkpoint("gqa"), "a draft must share the target's tokenizer")):
        result = CliRunner().invoke(main, ["compile", str(ckpt), "--plan", str(plan_path), "--draft", "--dry-run",
                                           "-o", str(tmp_path / "other")])
        assert result.exit_code == 2 and says in result.output, result.output


def test_build_makes_the_drafts_checkpoint_and_engine_beside_the_targets(tiny_hf, tmp_path):
    """build --speculative draft:MODEL on the engine path: the dry run lists the draft's own stages (download,
    convert, calibrate at the build's precision, compile --draft) and deploy --draft-engine; with
    --checkpoints-on-cpu the chain runs here up to the engine builds (written, not run) and deploys the six models,
    which check passes."""
    from pipeline.check import check_repository
    from pipeline.tritonconfig import parse_pbtxt
    from support.models import make_tiny_model

    preview = CliRunner().invoke(main, ["build", "qwen2.5-14b", "--target", "rtx4090", "--precision", "int4-awq",
                                        "--speculative", "draft:qwen2.5-7b", "--dry-run", "-o", str(tmp_path / "q")])
    assert preview.exit_code == 0, preview.output
    table = [line.split() for line in preview.output.splitlines()
             if line.startswith("  ") and (" trtpipe " in line or " hf download " in line)]
    stages = [" ".join(words[:2]) if words[0] == "draft" else words[0] for words in table]
    order = ["download", "convert", "calibrate", "draft download", "draft convert", "draft calibrate", "plan",
             "compile", "draft compile", "deploy", "validate"]
    assert stages == order, preview.output
    assert f"--draft -o {tmp_path / 'q' / 'draft-engine'}" in preview.output
    assert f"--draft-engine {tmp_path / 'q' / 'draft-engine'}" in preview.output
    assert not (tmp_path / "q").exists()

    draft = make_tiny_model(tmp_path / "draft-hf", seed=1, vocab_size=49152, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_hf / name, draft / name)
    out = tmp_path / "out"
    built = CliRunner().invoke(main, ["build", str(tiny_hf), "--target", "rtx4090", "--precision", "fp16",
                                      "--input-len", "64", "--output-len", "32", "--speculative", f"draft:{draft}",
                                      "--checkpoints-on-cpu", "--dry-run", "-o", str(out)])
    assert built.exit_code == 0, built.output
    assert "[draft convert]" in built.output and "[draft compile]" in built.output
    assert (out / "draft" / "checkpoint" / "config.json").is_file()
    assert "--speculative_decoding_mode" not in (out / "draft-engine" / "trtllm-build.sh").read_text()
    config = parse_pbtxt((out / "model_repo" / "tensorrt_llm_draft" / "config.pbtxt").read_text())
    assert config.parameters["gpt_model_path"].string_value == str((out / "draft-engine").resolve())
    assert not check_repository(out / "model_repo").errors
