"""EAGLE-3 on TensorRT-LLM's PyTorch backend (pipeline/plan/eagle.py, pipeline/plan/speculative_gpu.py): the head's
weights and KV cache beside the target's, the speculative_config each TensorRT-LLM line parses, a local head copied
into the deployment, and what cannot run refused in one line. Nothing here runs on a GPU."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from pipeline.backends.llm_api_args import unknown_llm_api_keys
from pipeline.backends.pytorch import EXTRA_OPTIONS, SERVE_CONFIG
from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.deploy import deploy_repository
from pipeline.plan import resolve_model_info
from pipeline.plan.eagle import read_eagle_head
from pipeline.plan.speculative import SpeculativeRequest
from pipeline.planner import make_plan
from pipeline.targets import get_target

NEW = "trtllm-1.3.0rc27"
#: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config.json (the head TensorRT-LLM's speculative decoding docs use)
LLAMA31_8B_HEAD = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "num_hidden_layers": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
                   "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 128256,
                   "draft_vocab_size": 32000}


def write_head(directory, weights: bytes = b"", **overrides):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA31_8B_HEAD, **overrides}))
    if weights:
        (directory / "pytorch_model.bin").write_bytes(weights)
    return directory


def plan_json(*args) -> dict:
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("image, decoding_type, kv_layers", [(None, "Eagle", 4), (NEW, "Eagle3", 1)])
def test_eagle3_plan_takes_the_heads_memory_and_writes_the_config_each_line_parses(tmp_path, image, decoding_type,
                                                                                  kv_layers):
    """1.2.x's DecodingBaseConfig.from_dict maps "Eagle"; 1.3's union takes "Eagle3" (and "Eagle" as an alias).
    The head's layers sit in the target's KV cache: 1.2 counts max_draft_len of them, 1.3 the head's own."""
    head = write_head(tmp_path / "eagle3-head")
    args = ["llama-3.1-8b", "--target", "rtx4090", "--precision", "fp8", "--backend", "pytorch",
            *(["--runtime-image", image] if image else [])]
    plain = plan_json(*args)
    plan = plan_json(*args, "--speculative", f"eagle:{head}", "--draft-len", "4", "--acceptance", "0.6")
    spec = plan["speculative"]
    config = plan["llm_api"]["options"]["speculative_config"]
    assert config == {"decoding_type": decoding_type, "max_draft_len": 4, "max_concurrency": spec["max_rows"],
                      "speculative_model_dir": str(head), "eagle3_one_model": True}
    assert spec["max_rows"] >= 1 and spec["decoding_mode"] == decoding_type and spec["acceptance"] == 0.6
    assert not unknown_llm_api_keys(plan["llm_api"]["options"], False, plan["llm_api"]["tensorrt_llm_version"])
    # fc 3h x h, the first layer's attention on 2h inputs, its MLP and three norms, the draft lm_head, the final
    # norm, all float16, and d2t (int64 per draft token); the embedding is the target's
    h, q, kv, inter, draft_vocab = 4096, 4096, 1024, 14336, 32000
    params = 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * inter + 3 * h + draft_vocab * h + h
    assert spec["draft_weights_bytes"] == 2 * params + 8 * draft_vocab
    assert spec["draft_kv_bytes_per_token"] == kv_layers * 2 * 8 * 128 * 1      # fp8 KV cache
    assert plan["memory"]["kv_cache_tokens"] < plain["memory"]["kv_cache_tokens"]
    assert spec["draft_step_s"] and all(d < p for d, p in zip(spec["draft_step_s"], spec["step_s"]))
    assert "d the draft's step" in spec["basis"]


def test_a_head_with_its_own_embedding_counts_it(tmp_path):
    """target_hidden_size unlike hidden_size: the head embeds tokens itself (Eagle3DraftModel) and its fc reads
    three hidden states of the target's width."""
    head = read_eagle_head(str(write_head(tmp_path / "h", hidden_size=2048, target_hidden_size=4096,
                                          num_attention_heads=16, head_dim=128, intermediate_size=8192)))
    same = read_eagle_head(str(write_head(tmp_path / "s", hidden_size=2048, target_hidden_size=2048,
                                          num_attention_heads=16, head_dim=128, intermediate_size=8192)))
    assert head.parameter_count() - same.parameter_count() == 128256 * 2048 + 3 * (4096 - 2048) * 2048


def test_a_local_head_is_copied_into_the_deployment_and_named_relative_to_it(tiny_model_dir, tmp_path):
    """eagle:DIR: deploy copies the head (a pytorch_model.bin, as EAGLE-3 heads ship) beside the served model and
    the LLM API options name the copy, so no file a server reads names this machine."""
    target = json.loads((tiny_model_dir / "config.json").read_text())
    head = write_head(tmp_path / "my-head", weights=b"\0" * 64, hidden_size=target["hidden_size"],
                      vocab_size=target["vocab_size"], num_attention_heads=target["num_attention_heads"],
                      num_key_value_heads=target["num_key_value_heads"], intermediate_size=96, draft_vocab_size=32)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "--target", "rtx4090", "--precision", "fp16",
                                       "--backend", "pytorch", "--checkpoints-on-cpu", "--speculative",
                                       f"eagle:{head}", "--acceptance", "0.8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    repo = out / "model_repo"
    copied = repo / "tensorrt_llm" / "1" / "draft"
    assert (copied / "config.json").is_file() and (copied / "pytorch_model.bin").read_bytes() == b"\0" * 64
    served = yaml.safe_load((repo / EXTRA_OPTIONS).read_text())["speculative_config"]
    assert served["speculative_model_dir"] == "tensorrt_llm/1/draft" and served["decoding_type"] == "Eagle"
    model_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model_yaml["speculative_config"]["speculative_model_dir"] == "draft"
    files = [p for p in repo.rglob("*") if p.suffix in (".yaml", ".sh", ".pbtxt")]
    assert not [p for p in files if str(tmp_path) in p.read_text()]


@pytest.mark.parametrize("model, extra, head, message", [
    ("llama-3.1-8b", ["--backend", "pytorch"], {}, "needs --acceptance"),
    ("qwen2.5-14b", ["--backend", "pytorch", "--acceptance", "0.6"], {}, "it was trained for another model"),
    ("llama-3.1-8b", ["--backend", "pytorch", "--acceptance", "0.6"], {"architectures": ["LlamaForCausalLM"]},
     "not an EAGLE-3 head"),
    ("llama-3.1-8b", ["--backend", "pytorch", "--acceptance", "0.6"], {"vocab_size": 32000},
     "it was trained for another model"),
    ("llama-3.1-8b", ["--backend", "engine", "--acceptance", "0.6"], {}, "use --backend pytorch (EAGLE-3)"),
    ("llama-3.1-8b", ["--backend", "pytorch", "--acceptance", "0.6", "--draft-len", "0"], {}, "between 1 and 16"),
])
def test_what_eagle_cannot_run_is_one_line_and_exit_2(tmp_path, model, extra, head, message):
    directory = write_head(tmp_path / "head", **head)
    result = CliRunner().invoke(main, ["plan", model, "--target", "rtx4090", "--precision", "fp8",
                                       "--speculative", f"eagle:{directory}", *extra])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_hub_head_is_read_from_the_hub_cache_offline_and_named_by_its_id(tmp_path, monkeypatch):
    """eagle:ORG/NAME offline: its config.json from the hub cache (`hf download ID config.json`), named by the id in
    the plan (the LLM API downloads it where it serves); without it, one line saying how to fetch it."""
    from pipeline import sources

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "cached_config", lambda hub_id: None)
    result = CliRunner().invoke(main, ["plan", "llama-3.1-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--backend", "pytorch", "--speculative", "eagle:yuhuili/EAGLE3-LLaMA3.1-"
                                       "Instruct-8B", "--acceptance", "0.6"])
    assert result.exit_code == 2 and "hf download yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json" in result.output
    cached = write_head(tmp_path / "snapshot")
    monkeypatch.setattr(sources, "cached_config", lambda hub_id: cached)
    plan = plan_json("llama-3.1-8b", "--target", "rtx4090", "--precision", "fp8", "--backend", "pytorch",
                     "--speculative", "eagle:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "--acceptance", "0.6")
    config = plan["llm_api"]["options"]["speculative_config"]
    assert config["speculative_model_dir"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert plan["speculative"]["draft_model"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


@pytest.mark.parametrize("image, written, version", [(None, EXTRA_OPTIONS, "1.2.1"), (NEW, SERVE_CONFIG, "1.3.0rc27")])
def test_check_knows_the_keys_of_each_decoding_type(tmp_path, image, written, version):
    """speculative_config is one class per decoding_type, each refusing keys it lacks: `trtpipe check` reads the
    deployed YAML's speculative_config against the recorded keys of that type in the plan's TensorRT-LLM, and a
    decoding_type the version does not parse (Eagle3 on 1.2.x) is named with the one it does."""
    head = write_head(tmp_path / "head")
    plan = make_plan(resolve_model_info("llama-3.1-8b"), get_target("rtx4090"), "fp8", backend="pytorch",
                     image=image, speculative=SpeculativeRequest("eagle", str(head), 3, 0.6))
    out = deploy_repository(plan, tmp_path / "deploy").path
    assert check_repository(out).ok, check_repository(out).errors
    path = out / written
    options = yaml.safe_load(path.read_text())
    options["speculative_config"]["eagle_choice"] = [[0], [1]]
    path.write_text(yaml.safe_dump(options))
    errors = check_repository(out).errors
    assert [(e.field, e.fix) for e in errors] == [("speculative_config.eagle_choice (%s)" % (
        "Eagle" if image is None else "Eagle3"), "did you mean eagle_choices?")], errors
    assert version in errors[0].problem
    if image is None:
        del options["speculative_config"]["eagle_choice"]
        options["speculative_config"]["decoding_type"] = "Eagle3"
        path.write_text(yaml.safe_dump(options))
        assert [(e.field, e.fix) for e in check_repository(out).errors] == [
            ("speculative_config.decoding_type: Eagle3", "did you mean Eagle?")]
