"""The pytorch backend (TensorRT-LLM LLM API, no engine) and the llmapi repository, on this CPU-only machine:
the plan's figures and keys, the rendered repository and `trtpipe check`, and the cpu llmapi flavour served
live by the embedded Triton."""

from __future__ import annotations

import json

import pytest
import requests
import yaml
from click.testing import CliRunner

from pipeline import TRTLLM_VERSION
from pipeline.backends.llm_api_args import recorded_llm_api_keys
from pipeline.backends.pytorch import EXTRA_OPTIONS, LAUNCH_SCRIPT, cuda_graph_batch_sizes
from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.plan import Overrides, Workload, load_plan, resolve_model_info
from pipeline.planner import make_plan
from pipeline.targets import get_target
from pipeline.tritonconfig import dtype_name, parse_pbtxt
from support.models import deploy_tiny_llmapi, save_word_tokenizer

def llama_plans(**workload):
    model = resolve_model_info("llama-3-8b")
    target = get_target("rtx4090")
    w = Workload(**workload)
    return (make_plan(model, target, "fp8", workload=w, backend="engine"),
            make_plan(model, target, "fp8", workload=w, backend="pytorch"))


def test_pytorch_plan_has_the_engine_budget_as_llm_api_settings():
    engine, torch_plan = llama_plans(concurrency=24)
    assert torch_plan.backend == "pytorch" and torch_plan.engine is None and torch_plan.build_config is None
    assert torch_plan.memory == engine.memory      # the same budget, not a second memory model
    # Llama-3-8B FP8: 1-byte linears, 16-bit embedding and lm_head (norms and scales: under 1 MB);
    # FP8 KV cache: 32 layers x 8 KV heads x 128 x (K, V) x 1 byte per token
    linears = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert 0 <= torch_plan.weights_bytes_per_rank - (linears + 2 * 2 * 128256 * 4096) < 1 << 20
    assert torch_plan.kv_bytes_per_token == 32 * 8 * 128 * 2
    options = torch_plan.llm_api.options
    assert torch_plan.llm_api.tensorrt_llm_version == TRTLLM_VERSION
    assert options["max_batch_size"] == engine.build_config.max_batch_size == 24
    assert options["max_num_tokens"] == engine.build_config.max_num_tokens
    assert options["max_seq_len"] == engine.build_config.max_seq_len == 8192
    kv = options["kv_cache_config"]
    assert kv == {"free_gpu_memory_fraction": 0.9, "dtype": "fp8", "enable_block_reuse": True,
                  "max_tokens": engine.triton.max_tokens_in_paged_kv_cache}
    # the KV tokens: the fraction of what is left after weights, activations and reserve, in 32-token blocks
    # (tokens_per_block, 32 for both the engine and the LLM API)
    free = engine.memory.free_bytes
    assert kv["max_tokens"] == int(free * 0.9) // torch_plan.kv_bytes_per_token // 32 * 32
    assert kv["max_tokens"] * torch_plan.kv_bytes_per_token <= 0.9 * free
    assert options["cuda_graph_config"] == {"batch_sizes": [1, 2, 4, 8, 16, 24], "enable_padding": True}
    assert options["enable_chunked_prefill"] is True
    flat = set(options) | {f"{k}.{s}" for k, v in options.items() if isinstance(v, dict) for s in v}
    assert flat <= recorded_llm_api_keys()["llm_args"]   # every key the plan emits is a 1.2.x LLM API key


def test_pytorch_plan_round_trips_and_refuses_engine_options():
    _, torch_plan = llama_plans()
    assert torch_plan.to_dict()["llm_api"]["options"]["max_batch_size"] >= 1
    model, target = resolve_model_info("llama-3-8b"), get_target("rtx4090")
    with pytest.raises(UserError, match="--opt-num-tokens are engine-build options"):
        make_plan(model, target, "fp8", overrides=Overrides(opt_num_tokens=64), backend="pytorch")
    with pytest.raises(UserError, match="no INT8 SmoothQuant linear method"):
        make_plan(model, target, "int8-sq", backend="pytorch")
    with pytest.raises(UserError, match="does not serve cpu targets"):
        make_plan(model, get_target("cpu"), "fp16", backend="pytorch")


@pytest.mark.parametrize("expected,batch,sizes", [(1, 8, [1]), (5, 8, [1, 2, 4, 5]), (64, 16, [1, 2, 4, 8, 16]),
                                                  (32, 32, [1, 2, 4, 8, 16, 32])])
def test_cuda_graph_sizes_follow_the_expected_concurrency(expected, batch, sizes):
    assert cuda_graph_batch_sizes(expected, batch) == sizes


def test_llmapi_repository_renders_and_passes_check(tmp_path):
    _, torch_plan = llama_plans(concurrency=8)
    result = deploy_repository(torch_plan, tmp_path / "repo")
    repo = result.path
    assert result.models == ("tensorrt_llm",)
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["tensorrt_llm"]
    config = parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert config.backend == "python" and config.max_batch_size == 0 and config.model_transaction_policy.decoupled
    inputs = {t.name: dtype_name(t.data_type) for t in config.input}
    assert inputs["text_input"] == "TYPE_STRING" and inputs["sampling_param_max_tokens"] == "TYPE_INT32"
    assert inputs["streaming"] == "TYPE_BOOL" and "max_tokens" not in inputs and "stream" not in inputs
    assert [t.name for t in config.output] == ["text_output", "finish_reason"]
    model_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    options = yaml.safe_load((repo / EXTRA_OPTIONS).read_text())
    assert options == torch_plan.llm_api.options
    assert model_yaml["model"] == "meta-llama/Meta-Llama-3-8B" and model_yaml["backend"] == "pytorch"
    assert {k: model_yaml[k] for k in options} == options
    script = (repo / LAUNCH_SCRIPT).read_text()
    assert "trtllm-serve meta-llama/Meta-Llama-3-8B --backend pytorch" in script
    assert f"--extra_llm_api_options {EXTRA_OPTIONS}" in script
    report = check_repository(repo)
    assert report.ok, report.summary()
    cli = CliRunner().invoke(main, ["check", str(repo)])
    assert cli.exit_code == 0, cli.output


def test_check_catches_a_misspelt_llm_api_key(tmp_path):
    _, torch_plan = llama_plans()
    repo = deploy_repository(torch_plan, tmp_path / "repo").path
    options = yaml.safe_load((repo / EXTRA_OPTIONS).read_text())
    options["kv_cache_config"]["free_gpu_mem_fraction"] = options["kv_cache_config"].pop("free_gpu_memory_fraction")
    (repo / EXTRA_OPTIONS).write_text(yaml.safe_dump(options))
    model_yaml = repo / "tensorrt_llm" / "1" / "model.yaml"
    model_yaml.write_text(model_yaml.read_text().replace("max_num_tokens:", "max_num_token:"))
    report = check_repository(repo)
    found = {(f.file, f.field, f.fix) for f in report.errors}
    assert found == {(EXTRA_OPTIONS, "kv_cache_config.free_gpu_mem_fraction",
                      "did you mean kv_cache_config.free_gpu_memory_fraction?"),
                     ("tensorrt_llm/1/model.yaml", "max_num_token", "did you mean max_num_tokens?")}
    cli = CliRunner().invoke(main, ["check", str(repo)])
    assert cli.exit_code == 1 and "max_num_token" in cli.output


def test_plan_backend_option_and_deploy(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--backend", "pytorch", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["llm_api"]["options"]["kv_cache_config"]["dtype"] == "fp8"
    assert load_plan(out).backend == "pytorch"
    bad = CliRunner().invoke(main, ["deploy", "--plan", str(out), "--engine", str(tmp_path / "e"),
                                    "-o", str(tmp_path / "repo")])
    assert bad.exit_code == 2 and "drop --engine" in bad.output


# ------------------------------------------------------------------------------- the cpu flavour, live


@pytest.fixture(scope="module")
def llmapi_cpu_repo(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llmapi-cpu")
    tokenizer = tmp / "tokenizer"
    tokenizer.mkdir()
    save_word_tokenizer(tokenizer)
    return deploy_tiny_llmapi(checkpoint("gqa"), tokenizer, tmp)


def test_cpu_llmapi_repository_is_served_live(llmapi_cpu_repo):
    from pipeline.server import embedded_server
    from pipeline.validate.llmapi import LlmapiClient

    assert check_repository(llmapi_cpu_repo).ok
    with embedded_server(llmapi_cpu_repo, ready_timeout=300) as server:
        client = LlmapiClient(server.http_url)
        prompt = " w5 w6 w7"
        greedy = {"sampling_param_max_tokens": 6, "sampling_param_temperature": 0.0, "return_finish_reason": True}
        first = client.request(prompt, **greedy)
        again = client.request(prompt, **greedy)
        assert first == again and first["finish_reason"] in ("length", "stop")
        words = first["text_output"].split()
        assert 1 <= len(words) <= 6 and all(w.startswith("w") for w in words)
        with_input = client.request(prompt, sampling_param_exclude_input_from_output=False, **greedy)
        assert with_input["text_output"] == prompt + first["text_output"]
        streamed = client.generate_stream(prompt, 6, body=greedy)
        assert streamed.error is None and streamed.text == first["text_output"]
        assert len(streamed.pieces) >= 2 and streamed.finish_reason == first["finish_reason"]
        too_long = requests.post(f"{server.http_url}/v2/models/tensorrt_llm/generate", timeout=60,
                                 json={"text_input": prompt, "sampling_param_max_tokens": 500})
        assert too_long.status_code >= 400 and "exceed max_seq_len 64" in too_long.text
        seeded = {"sampling_param_top_p": 0.9, "sampling_param_seed": 3, "sampling_param_max_tokens": 4}
        assert client.request(prompt, **seeded) == client.request(prompt, **seeded)
