"""`trtpipe deploy`: repositories built from the plan as protobuf messages, self-contained, served for real."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.plan import load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.tritonconfig import dtype_name, parse_pbtxt, to_pbtxt

MODELS = ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
#: NVIDIA's ensemble client contract (tensorrtllm_backend inflight_batcher_llm/ensemble/config.pbtxt).
CLIENT_INPUTS = {"text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "bad_words": "TYPE_STRING",
                 "stop_words": "TYPE_STRING", "end_id": "TYPE_INT32", "pad_id": "TYPE_INT32", "top_k": "TYPE_INT32",
                 "top_p": "TYPE_FP32", "temperature": "TYPE_FP32", "stream": "TYPE_BOOL", "seed": "TYPE_UINT64",
                 "exclude_input_in_output": "TYPE_BOOL", "beam_width": "TYPE_INT32"}


def configs(repo: Path) -> dict:
    return {m: parse_pbtxt((repo / m / "config.pbtxt").read_text()) for m in MODELS}


def params(config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    info = resolve_model_info("smollm2-135m")
    root = tmp_path_factory.mktemp("plans")
    return {"gpu": save_plan(make_plan(info, get_target("rtx4090"), "fp16"), root / "gpu.json"),
            "cpu": save_plan(make_plan(info, get_target("cpu"), "fp32"), root / "cpu.json")}


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_llama, smollm2_hf_dir, tmp_path_factory) -> Path:
    """A tiny random checkpoint (fast to copy and load) with SmolLM2's tokenizer beside it."""
    out = tmp_path_factory.mktemp("tiny") / "checkpoint"
    convert_model(resolve_model(str(tiny_llama("gqa"))), out, progress=False)
    (out / "tokenizer").mkdir(exist_ok=True)
    for f in (smollm2_hf_dir / "tokenizer.json", smollm2_hf_dir / "tokenizer_config.json"):
        (out / "tokenizer" / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def gpu_repo(plans, smollm2_hf_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu")
    return deploy_repository(load_plan(plans["gpu"]), root / "repo", engine=root / "engine",
                             tokenizer=smollm2_hf_dir).path


@pytest.fixture(scope="module")
def cpu_repo(plans, tiny_checkpoint, tmp_path_factory) -> Path:
    return deploy_repository(load_plan(plans["cpu"]), tmp_path_factory.mktemp("cpu") / "repo",
                             checkpoint=tiny_checkpoint).path


def test_gpu_repository_renders_from_the_plan_alone(gpu_repo, plans):
    plan = load_plan(plans["gpu"]).triton
    assert not (gpu_repo.parent / "engine").exists()
    assert sorted(p.name for p in gpu_repo.iterdir() if p.is_dir()) == MODELS
    c = configs(gpu_repo)
    trt = c["tensorrt_llm"]
    assert trt.backend == "tensorrtllm"
    assert {m: c[m].max_batch_size for m in MODELS} == {m: plan.triton_max_batch_size for m in MODELS}
    assert trt.model_transaction_policy.decoupled is plan.decoupled_mode is True
    assert c["tensorrt_llm_bls"].model_transaction_policy.decoupled is True
    for name in ("tensorrt_llm", "preprocessing"):
        batching = c[name].dynamic_batching
        assert list(batching.preferred_batch_size) == plan.preferred_batch_size
        assert batching.max_queue_delay_microseconds == plan.max_queue_delay_microseconds
        assert batching.default_queue_policy.max_queue_size == plan.max_queue_size
    assert c["postprocessing"].HasField("dynamic_batching")
    assert not c["ensemble"].HasField("dynamic_batching") and not c["tensorrt_llm_bls"].HasField("dynamic_batching")
    p = params(trt)
    assert p["gpt_model_path"] == str((gpu_repo.parent / "engine").resolve())
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["kv_cache_free_gpu_mem_fraction"] == str(plan.kv_cache_free_gpu_mem_fraction)
    assert p["max_tokens_in_paged_kv_cache"] == str(plan.max_tokens_in_paged_kv_cache)
    assert p["batch_scheduler_policy"] == plan.batch_scheduler_policy
    assert p["enable_chunked_context"] == str(plan.enable_chunked_context).lower()
    assert p["enable_kv_cache_reuse"] == str(plan.enable_kv_cache_reuse).lower()
    assert p["max_beam_width"] == "1"
    assert not any("${" in v for v in p.values())


def test_configs_are_text_format_serializations_with_nvidias_client_contract(gpu_repo):
    for model, config in configs(gpu_repo).items():
        text = (gpu_repo / model / "config.pbtxt").read_text()
        assert to_pbtxt(config) == text
        assert config.name == model
    ensemble = configs(gpu_repo)["ensemble"]
    declared = {t.name: dtype_name(t.data_type) for t in ensemble.input}
    assert {k: declared.get(k) for k in CLIENT_INPUTS} == CLIENT_INPUTS
    assert [t.name for t in ensemble.output][0] == "text_output"
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["preprocessing", "tensorrt_llm",
                                                                        "postprocessing"]


def test_gpu_repository_passes_check_and_waits_for_its_engine(gpu_repo):
    report = check_repository(gpu_repo)
    assert report.ok
    assert [(f.code, f.severity) for f in report.findings] == [("engine", "info")]


def test_gpu_deploy_takes_the_tokenizer_from_the_checkpoint_and_does_not_copy_weights(plans, tiny_checkpoint,
                                                                                     tmp_path):
    repo = deploy_repository(load_plan(plans["gpu"]), tmp_path / "repo", engine=tmp_path / "engine",
                             checkpoint=tiny_checkpoint).path
    assert (repo / "preprocessing" / "1" / "tokenizer" / "tokenizer.json").read_bytes() == \
        (tiny_checkpoint / "tokenizer" / "tokenizer.json").read_bytes()
    assert not list(repo.rglob("*.safetensors")) and not (repo / "tensorrt_llm" / "1" / "model.py").exists()


def test_deploy_refuses_an_engine_that_does_not_match_the_plan(plans, smollm2_hf_dir, tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({
        "version": "1.2.1", "pretrained_config": {},
        "build_config": {"max_batch_size": 8, "max_beam_width": 1, "plugin_config": {"use_paged_context_fmha": True}}}))
    with pytest.raises(UserError, match="max_batch_size .* exceeds the engine's build_config.max_batch_size 8"):
        deploy_repository(load_plan(plans["gpu"]), tmp_path / "repo", engine=engine, tokenizer=smollm2_hf_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]   # nothing half-written


def test_plan_asking_for_kv_reuse_without_paged_context_fmha_is_refused(plans, smollm2_hf_dir, tmp_path):
    data = json.loads(plans["gpu"].read_text())
    data["plugin_config"]["use_paged_context_fmha"] = False
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match="enable_kv_cache_reuse and enable_chunked_context .* paged context FMHA"):
        deploy_repository(load_plan(bad), tmp_path / "repo", engine=tmp_path / "engine", tokenizer=smollm2_hf_dir)


def test_cpu_repository_is_self_contained(cpu_repo, plans, tiny_checkpoint):
    c = configs(cpu_repo)
    trt = c["tensorrt_llm"]
    plan = load_plan(plans["cpu"]).triton
    assert trt.backend == "python" and trt.max_batch_size == plan.triton_max_batch_size == 8
    assert list(trt.dynamic_batching.preferred_batch_size) == plan.preferred_batch_size
    assert params(trt)["checkpoint_dir"] == "checkpoint"
    assert params(trt)["exclude_input_in_output"] == "true"
    version = cpu_repo / "tensorrt_llm" / "1"
    assert (version / "checkpoint" / "config.json").read_bytes() == (tiny_checkpoint / "config.json").read_bytes()
    assert (version / "checkpoint" / "rank0.safetensors").stat().st_size == \
        (tiny_checkpoint / "rank0.safetensors").stat().st_size
    for model in ("preprocessing", "postprocessing"):
        assert params(c[model])["tokenizer_dir"] == f"{model}/1/tokenizer"   # relative to the repository's root
        assert (cpu_repo / model / "1" / "tokenizer" / "tokenizer.json").is_file()
    inputs = [str(tiny_checkpoint), str(tiny_checkpoint.parent), str(Path(__file__).parents[1])]
    for f in cpu_repo.rglob("*"):
        if f.is_file() and f.suffix in (".pbtxt", ".json", ".py") and f.name != "manifest.json":
            assert not any(i in f.read_text() for i in inputs), f"{f} points outside the repository"
    assert check_repository(cpu_repo).findings == []


def test_cpu_repository_limits_sequences_to_the_plans_max_seq_len(tiny_checkpoint, tmp_path):
    """A 32k-context model planned for the cpu target is sized for 8192 tokens: the served limit is the plan's."""
    arch = dataclasses.replace(resolve_model_info("smollm2-135m").arch, max_position_embeddings=32768)
    plan = save_plan(make_plan(arch, get_target("cpu"), "fp32"), tmp_path / "plan.json")
    repo = deploy_repository(load_plan(plan), tmp_path / "repo", checkpoint=tiny_checkpoint).path
    assert params(configs(repo)["tensorrt_llm"])["max_seq_len"] == "8192"


def test_copied_runtime_imports_and_runs_without_trtpipe(cpu_repo, tiny_checkpoint):
    """The repository's runtime copy, first on sys.path, is what the Python model imports, and it generates."""
    version = cpu_repo / "tensorrt_llm" / "1"
    script = (
        "import sys, json; sys.path.insert(0, sys.argv[1]);"
        "import pipeline, pipeline.runtime as rt;"
        "m = rt.ReferenceModel.load(sys.argv[1] + '/checkpoint');"
        "print(json.dumps([pipeline.__file__, m.generate([[1, 2, 3]], rt.SamplingConfig(max_new_tokens=5))]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script, str(version)], capture_output=True, text=True, env=env,
                         cwd=version, check=True)
    module_file, generated = json.loads(out.stdout)
    assert Path(module_file).resolve().is_relative_to(version.resolve())
    from pipeline.runtime import ReferenceModel, SamplingConfig
    expected = ReferenceModel.load(tiny_checkpoint).generate([[1, 2, 3]], SamplingConfig(max_new_tokens=5))
    assert generated == expected


def test_repository_is_relocatable(cpu_repo, tmp_path):
    from transformers import AutoTokenizer

    moved = tmp_path / "elsewhere" / "repo"
    shutil.copytree(cpu_repo, moved)
    assert check_repository(moved).ok
    tok_dir = moved / params(configs(moved)["preprocessing"])["tokenizer_dir"]
    assert AutoTokenizer.from_pretrained(tok_dir).encode("Hello world")


def test_servers_run_in_the_repository_root_where_nvidias_models_resolve_tokenizer_dir(cpu_repo, tmp_path,
                                                                                        monkeypatch):
    """NVIDIA's preprocessing hands tokenizer_dir to AutoTokenizer as it is: relative to the working directory.
    The repository-relative value resolves from the repository's root, where the embedded server starts."""
    from transformers import AutoTokenizer

    from pipeline import server

    started = {}

    class Popen:
        def __init__(self, command, **kwargs):
            started.update(kwargs)

    monkeypatch.setattr(server.subprocess, "Popen", Popen)
    server._launch(["tritonserver"], {}, (1, 2, 3), "127.0.0.1", tmp_path / "log", cpu_repo)
    monkeypatch.chdir(started["cwd"])
    for model in ("preprocessing", "postprocessing"):
        assert AutoTokenizer.from_pretrained(params(configs(cpu_repo)[model])["tokenizer_dir"]).encode("Hi")


def test_rerun_with_same_inputs_does_nothing_and_changed_inputs_need_force(plans, tiny_checkpoint, tmp_path):
    out = tmp_path / "repo"
    first = deploy_repository(load_plan(plans["cpu"]), out, checkpoint=tiny_checkpoint)
    stamp = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = deploy_repository(load_plan(plans["cpu"]), out, checkpoint=tiny_checkpoint)
    assert not first.skipped and again.skipped
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamp
    data = json.loads(plans["cpu"].read_text())
    data["triton"].update(triton_max_batch_size=4, preferred_batch_size=[4])
    changed = tmp_path / "plan4.json"
    changed.write_text(json.dumps(data))
    with pytest.raises(UserError, match="already exists"):
        deploy_repository(load_plan(changed), out, checkpoint=tiny_checkpoint)
    deploy_repository(load_plan(changed), out, checkpoint=tiny_checkpoint, force=True)
    assert configs(out)["tensorrt_llm"].max_batch_size == 4


# ------------------------------------------------------------------------------ the backend seam


def rewritten_plan(path: Path, out: Path, **changes) -> Path:
    """plan.json at `path` with top-level `changes` (None deletes the key), saved as `out`."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    out.write_text(json.dumps(data))
    return out


def test_deploy_dispatches_on_the_plans_backend_not_on_its_target(plans, tiny_checkpoint, smollm2_hf_dir, tmp_path):
    """A reference plan whose target says GPU still serves the checkpoint; an engine plan whose target says cpu
    still names the engine: the target never decides."""
    gpu_target, cpu_target = (json.loads(plans[k].read_text())["target"] for k in ("gpu", "cpu"))
    reference_on_gpu = load_plan(rewritten_plan(plans["cpu"], tmp_path / "r.json", target=gpu_target))
    engine_on_cpu = load_plan(rewritten_plan(plans["gpu"], tmp_path / "e.json", target=cpu_target))
    with pytest.raises(UserError, match="pass --checkpoint DIR"):
        deploy_repository(reference_on_gpu, tmp_path / "r", engine=tmp_path / "engine", tokenizer=smollm2_hf_dir)
    repo = deploy_repository(reference_on_gpu, tmp_path / "r", checkpoint=tiny_checkpoint).path
    assert configs(repo)["tensorrt_llm"].backend == "python" and (repo / "tensorrt_llm" / "1" / "checkpoint").is_dir()
    with pytest.raises(UserError, match="pass --engine DIR"):
        deploy_repository(engine_on_cpu, tmp_path / "e", checkpoint=tiny_checkpoint)
    repo = deploy_repository(engine_on_cpu, tmp_path / "e", engine=tmp_path / "engine", tokenizer=smollm2_hf_dir).path
    trt = configs(repo)["tensorrt_llm"]
    assert trt.backend == "tensorrtllm" and params(trt)["gpt_model_path"] == str((tmp_path / "engine").resolve())
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists()


@pytest.mark.parametrize("kind, backend", [("cpu", "python"), ("gpu", "tensorrtllm")])
def test_a_plan_written_before_the_backend_was_recorded_still_deploys(kind, backend, plans, tiny_checkpoint,
                                                                       tmp_path):
    old = rewritten_plan(plans[kind], tmp_path / "old.json", backend=None)
    artifact = (["--checkpoint", str(tiny_checkpoint)] if kind == "cpu" else
                ["--engine", str(tmp_path / "engine"), "--tokenizer", str(tiny_checkpoint / "tokenizer")])
    result = CliRunner().invoke(main, ["deploy", "--plan", str(old), *artifact, "-o", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    assert configs(tmp_path / "repo")["tensorrt_llm"].backend == backend


def test_deploy_records_what_the_repository_serves_in_its_manifest(cpu_repo, plans, tiny_checkpoint):
    from pipeline.model_repository import read_deployment

    plan = load_plan(plans["cpu"])
    served = read_deployment(cpu_repo)
    assert (served.backend, served.precision, served.target) == ("reference", "fp32", "cpu")
    assert served.model == (plan.model.path or plan.model.name) and not served.quantized
    assert served.weights_dtype == json.loads((tiny_checkpoint / "config.json").read_text())["dtype"]
    assert read_deployment(cpu_repo / "tensorrt_llm") is None   # no record: not a repository deploy wrote


@pytest.mark.parametrize("args, message", [
    (["--plan", "{cpu}"], "pass --checkpoint DIR"),
    (["--plan", "{gpu}"], "pass --engine DIR"),
    (["--plan", "{missing}", "--engine", "{tmp}/engine"], "does not exist"),
    (["--plan", "{cpu}", "--checkpoint", "{tmp}"], "is not a TensorRT-LLM checkpoint"),
    (["--plan", "{gpu}", "--engine", "{tmp}/engine"], "no tokenizer files"),
    (["--plan", "{cpu_bad_batch}", "--checkpoint", "{ckpt}"], "preferred_batch_size"),
])
def test_bad_input_is_one_clear_message_and_no_output(args, message, plans, tiny_checkpoint, tmp_path):
    data = json.loads(plans["cpu"].read_text())
    data["triton"]["preferred_batch_size"] = [64]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    values = {"cpu": plans["cpu"], "gpu": plans["gpu"], "missing": tmp_path / "nope.json", "tmp": tmp_path,
              "cpu_bad_batch": tmp_path / "bad.json", "ckpt": tiny_checkpoint}
    out = tmp_path / "repo"
    result = CliRunner().invoke(main, ["deploy", *[a.format(**values) for a in args], "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_cli_json_output(plans, tiny_checkpoint, tmp_path):
    result = CliRunner().invoke(main, ["deploy", "--plan", str(plans["cpu"]), "--checkpoint", str(tiny_checkpoint),
                                       "-o", str(tmp_path / "repo"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["target"] == "cpu" and data["models"] == ["ensemble", "preprocessing", "tensorrt_llm",
                                                         "postprocessing", "tensorrt_llm_bls"]


# ------------------------------------------------------------------------------ served for real

@pytest.fixture(scope="module")
def served(plans, smollm2_checkpoint, tmp_path_factory):
    """The SmolLM2 cpu repository running in the embedded Triton server."""
    from pipeline.server import embedded_server

    repo = deploy_repository(load_plan(plans["cpu"]), tmp_path_factory.mktemp("served") / "repo",
                             checkpoint=smollm2_checkpoint).path
    with embedded_server(repo, ready_timeout=600) as server:
        yield server


def generate(server, model: str, prompt: str, **extra) -> tuple[int, dict]:
    import requests

    r = requests.post(f"{server.http_url}/v2/models/{model}/generate",
                      json={"text_input": prompt, "max_tokens": 6, **extra}, timeout=600)
    return r.status_code, r.json()


def stream(server, model: str, prompt: str, **extra) -> list[str]:
    import requests

    r = requests.post(f"{server.http_url}/v2/models/{model}/generate_stream",
                      json={"text_input": prompt, "max_tokens": 6, "stream": True, **extra}, timeout=600)
    assert r.status_code == 200, r.text
    return [json.loads(line[len("data: "):])["text_output"] for line in r.text.splitlines()
            if line.startswith("data: ")]


@pytest.fixture(scope="module")
def reference(smollm2_checkpoint):
    """Greedy completions straight from the reference runtime and the tokenizer, for comparison."""
    from transformers import AutoTokenizer

    from pipeline.runtime import ReferenceModel, SamplingConfig

    model = ReferenceModel.load(smollm2_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint / "tokenizer")

    def complete(prompt: str, max_tokens: int = 6) -> str:
        ids = tokenizer.encode(prompt)
        out = model.generate([ids], SamplingConfig(max_new_tokens=max_tokens, end_id=tokenizer.eos_token_id))[0]
        return tokenizer.decode(out, skip_special_tokens=True)

    return complete


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_served_repository_generates_what_the_runtime_generates(served, reference, model):
    prompt = "The capital of France is"
    status, body = generate(served, model, prompt, bad_words="", stop_words="")
    assert status == 200, body
    assert body["text_output"] == reference(prompt)
    status, body = generate(served, model, prompt, exclude_input_in_output=False)
    assert body["text_output"] == prompt + reference(prompt)
    pieces = stream(served, model, prompt)
    assert len(pieces) == 6 and "".join(pieces) == reference(prompt)


@pytest.mark.slow
def test_served_repository_batches_concurrent_requests(served, reference):
    prompts = ["One, two, three,", "The sky is", "def add(a, b):", "Paris is the capital of"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: generate(served, "ensemble", p), prompts))
    assert [body["text_output"] for _, body in answers] == [reference(p) for p in prompts]


@pytest.mark.slow
def test_served_repository_ends_at_end_id_without_outputting_it(served, reference, smollm2_checkpoint):
    from transformers import AutoTokenizer

    comma = AutoTokenizer.from_pretrained(smollm2_checkpoint / "tokenizer").encode(",", add_special_tokens=False)
    assert reference("One, two, three,").startswith(" four,")
    status, body = generate(served, "ensemble", "One, two, three,", end_id=comma[0])
    assert status == 200 and body["text_output"] == " four"
    pieces = stream(served, "ensemble", "One, two, three,", end_id=comma[0])
    assert pieces == [" four", ""]   # the final response carries no token: end_id is not output


@pytest.mark.slow
def test_served_repository_honours_stop_words_and_refuses_what_it_cannot_do(served, reference):
    full = reference("One, two, three,")
    status, body = generate(served, "ensemble", "One, two, three,", stop_words=[","])
    assert status == 200 and body["text_output"] == full[:full.index(",") + 1]
    status, body = generate(served, "ensemble", "Hi", beam_width=2)
    assert status == 400 and "beam_width 2: beam search is not supported" in body["error"]
    status, body = generate(served, "ensemble", "Hi", lora_task_id=1)
    assert status == 400 and "lora_task_id: LoRA adapters are not supported" in body["error"]
    status, body = generate(served, "ensemble", "Hi " * 9000)
    assert status == 400 and "exceed the maximum sequence length" in body["error"]


@pytest.mark.slow
def test_served_repository_answers_a_batched_grpc_request_row_by_row(served, reference):
    """A request holding two prompts gets one response per row, each with its batch_index (as NVIDIA's backend)."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    prompts = ["The sky is", "One, two, three,"]
    client = grpcclient.InferenceServerClient(served.endpoints.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs = []
        for name, array, dtype in (("text_input", np.array([[p.encode()] for p in prompts], dtype=object), "BYTES"),
                                   ("max_tokens", np.array([[6], [6]], np.int32), "INT32")):
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.async_stream_infer("ensemble", inputs, outputs=[grpcclient.InferRequestedOutput("text_output"),
                                                               grpcclient.InferRequestedOutput("batch_index")])
        texts = {}
        for _ in prompts:
            result, error = answers.get(timeout=600)
            assert error is None, error
            texts[int(result.as_numpy("batch_index")[0, 0])] = result.as_numpy("text_output")[0, 0].decode()
    finally:
        client.stop_stream()
        client.close()
    assert texts == {i: reference(p) for i, p in enumerate(prompts)}


def test_the_recorded_model_path_resolves_against_the_repository_not_the_working_directory(tmp_path, monkeypatch):
    """Manifests record paths relative to the output's parent (nothing names the build machine); the golden
    reference of `trtpipe validate REPO` must still find a model that sits next to the repository."""
    from pipeline.model_repository import read_deployment

    (tmp_path / "build" / "model").mkdir(parents=True)
    repo = tmp_path / "build" / "repo"
    repo.mkdir()
    record = {"precision": "fp8", "backend": "reference", "target": "cpu", "weights_dtype": "float32"}
    for recorded, expected in (("model", str(tmp_path / "build" / "model")), ("smollm2-135m", "smollm2-135m"),
                               ("~/models/x", str(Path("~/models/x").expanduser()))):
        (repo / "manifest.json").write_text(json.dumps({"deployment": {**record, "model": recorded}}))
        monkeypatch.chdir(tmp_path)
        assert read_deployment(repo).model == expected


def test_nvidias_python_models_are_shipped_with_trtpipes_configs(plans, tiny_checkpoint, cpu_repo, tmp_path):
    """--python-models DIR ships NVIDIA's pre/postprocessing and BLS files (model.py and the BLS's lib/) from an
    inflight_batcher_llm directory instead of trtpipe's; the configs stay trtpipe's. A directory without them is
    one clear error naming where NVIDIA's container has them."""
    nvidia = tmp_path / "all_models" / "inflight_batcher_llm"
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        (nvidia / name / "1").mkdir(parents=True)
        (nvidia / name / "1" / "model.py").write_text(f"# NVIDIA's {name}\n")
    (nvidia / "tensorrt_llm_bls" / "1" / "lib").mkdir()
    (nvidia / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").write_text("# NVIDIA's decode\n")
    repo = deploy_repository(load_plan(plans["cpu"]), tmp_path / "repo", checkpoint=tiny_checkpoint,
                             python_models=nvidia).path
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (repo / name / "1" / "model.py").read_text() == f"# NVIDIA's {name}\n"
    assert (repo / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").is_file()
    assert "import" in (repo / "tensorrt_llm" / "1" / "model.py").read_text()   # the cpu model stays trtpipe's
    for name in ("ensemble", "preprocessing", "tensorrt_llm_bls"):
        assert (repo / name / "config.pbtxt").read_text() == (cpu_repo / name / "config.pbtxt").read_text()
    (nvidia / "postprocessing" / "1" / "model.py").unlink()
    result = CliRunner().invoke(main, ["deploy", "--checkpoint", str(tiny_checkpoint), "--plan", str(plans["cpu"]),
                                       "-o", str(tmp_path / "other"), "--python-models", str(nvidia)])
    assert result.exit_code == 2 and "/app/all_models/inflight_batcher_llm" in result.output
    assert not (tmp_path / "other").exists()
