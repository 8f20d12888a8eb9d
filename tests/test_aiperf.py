"""aiperf as the second load generator (pipeline/validate/aiperf.py): its JSON export read into run_level's
dict, its failures as user errors, and the agreement of both load generators on one served repository.

Recorded for real with aiperf 0.13.0 (tests/data/aiperf/):
- smollm2_fp8_cpu_c8_n24.json: the issue 18 reproduction of docs/aiperf.md, the SmolLM2 fp8 cpu repository
  under `trtpipe serve`, 64-token synthetic prompts, 32 output tokens, 24 requests at concurrency 8 (aiperf's
  default concurrency mode);
- shed_c48.json: run_aiperf, 48 requests at concurrency 48 on a small cpu repository whose tensorrt_llm queue
  holds 32: 8 shed ("Exceeds maximum queue size");
- refused_min_tokens.jsonl: run_aiperf's per-request records of 4 requests the server refused (min_tokens -1);
  aiperf exits 1 and writes no summary when no request succeeds.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.validate import aiperf
from pipeline.validate.aiperf import SyntheticPrompts, parse_export, run_aiperf
from support.triton_stubs import load_cpu_model

DATA = Path(__file__).parent / "data" / "aiperf"
#: run_level's dict: its keys, and the keys of its percentile entries
RUN_LEVEL_KEYS = {"concurrency", "requests", "completed", "shed", "failed", "errors", "wall_s", "output_tokens",
                  "output_tokens_per_s", "ttft_ms", "itl_ms", "latency_ms"}


def recorded(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_the_export_becomes_run_levels_dict():
    result = parse_export(recorded("smollm2_fp8_cpu_c8_n24.json"), concurrency=8, requests=24)
    assert set(result) == RUN_LEVEL_KEYS
    assert all(set(result[k]) == {"p50", "p90", "p99"} for k in ("ttft_ms", "itl_ms", "latency_ms"))
    assert (result["completed"], result["failed"], result["shed"], result["errors"]) == (24, 0, 0, [])
    assert result["output_tokens"] == 768 and result["wall_s"] == pytest.approx(209.6367045)
    assert result["output_tokens_per_s"] == pytest.approx(3.6633656)
    assert result["ttft_ms"]["p50"] == pytest.approx(31848.3871255)
    assert result["itl_ms"]["p50"] == pytest.approx(933.8458385)   # inter_chunk_latency: every gap, as run_level
    assert result["latency_ms"]["p99"] == pytest.approx(94722.6342758)


def test_shed_requests_are_counted_apart_from_failures():
    result = parse_export(recorded("shed_c48.json"), concurrency=48, requests=48)
    assert (result["completed"], result["shed"], result["failed"], result["errors"]) == (40, 8, 0, [])
    assert result["output_tokens"] == 640


def fake_aiperf(tmp_path: Path, body: str) -> Path:
    """An executable `aiperf` that records its arguments and environment, then runs `body` (bash)."""
    script = tmp_path / "bin" / "aiperf"
    script.parent.mkdir()
    script.write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/args\nenv > {tmp_path}/env\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_run_aiperf_sends_the_prompts_through_the_template_and_reads_the_export(tmp_path, monkeypatch):
    export = DATA / "smollm2_fp8_cpu_c8_n24.json"
    script = fake_aiperf(tmp_path, 'dir=$(echo "$@" | sed "s/.*--artifact-dir \\([^ ]*\\).*/\\1/")\n'
                                   f'mkdir -p "$dir" && cp {export} "$dir/profile_export_aiperf.json"')
    monkeypatch.setattr(aiperf, "aiperf_executable", lambda: str(script))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_aiperf("http://127.0.0.1:9/", tmp_path / "tok", ["one, two", "three"], 32, 8, 24, tmp_path / "w",
                        min_tokens=32)
    assert result["completed"] == 24 and result["concurrency"] == 8
    args = (tmp_path / "args").read_text()
    assert "--url http://127.0.0.1:9 " in args and "--concurrency 8 --request-count" not in args
    assert re.search(r"--request-count 24 --concurrency 8 --request-rate \d+ --arrival-pattern constant", args)
    assert "--custom-dataset-type single_turn --dataset-sampling-strategy sequential" in args
    env = (tmp_path / "env").read_text()
    assert "HF_HUB_OFFLINE" not in env   # aiperf 0.13 then fails on a tokenizer dir
    assert f"AIPERF_DATASET_MMAP_BASE_PATH={tmp_path / 'w'}" in env.splitlines()   # its mmap dirs, not /tmp's
    lines = (tmp_path / "w" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"text": "one, two", "output_length": 32},
                                                    {"text": "three", "output_length": 32}]
    from jinja2 import Template

    body = Template((tmp_path / "w" / "triton_generate_stream.j2").read_text()).render(text='say "hi", ok',
                                                                                        max_tokens=32)
    assert json.loads(body) == {"text_input": 'say "hi", ok', "max_tokens": 32, "min_tokens": 32, "top_k": 1,
                                "stream": True, "exclude_input_in_output": True}


def test_synthetic_prompts_become_aiperfs_input_and_output_lengths(tmp_path, monkeypatch):
    monkeypatch.setattr(aiperf, "aiperf_executable", lambda: "aiperf")
    command = aiperf.aiperf_command("http://h:1", tmp_path, SyntheticPrompts(64, 4), 32, 8, 24, tmp_path, None)
    assert command[-6:] == ["--isl", "64", "--isl-stddev", "4", "--osl", "32"] and "--input-file" not in command
    assert "min_tokens" not in (tmp_path / "triton_generate_stream.j2").read_text()


def test_missing_aiperf_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(aiperf.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(UserError, match=r"aiperf is not installed: install it with `pip install aiperf==0\.13\.0`"):
        run_aiperf("http://127.0.0.1:9", tmp_path, ["x"], 4, 1, 1, tmp_path / "w")


def test_a_failing_aiperf_is_a_user_error_with_its_output_tail(tmp_path, monkeypatch):
    script = fake_aiperf(tmp_path, 'for i in $(seq 40); do echo "line $i"; done\necho "Connection refused" >&2\n'
                                   "exit 3")
    monkeypatch.setattr(aiperf, "aiperf_executable", lambda: str(script))
    with pytest.raises(UserError) as error:
        run_aiperf("http://127.0.0.1:9", tmp_path, ["x"], 4, 1, 1, tmp_path / "w")
    message = str(error.value)
    assert "aiperf failed (exit 3" in message and "Connection refused" in message
    assert "line 40" in message and "line 10\n" not in message   # the tail, not the whole output


def test_a_run_without_one_success_is_a_result_of_failures_not_an_error(tmp_path, monkeypatch):
    """As run_level reports a level whose every request failed, with the server's message."""
    records = DATA / "refused_min_tokens.jsonl"
    script = fake_aiperf(tmp_path, 'dir=$(echo "$@" | sed "s/.*--artifact-dir \\([^ ]*\\).*/\\1/")\n'
                                   f'mkdir -p "$dir" && cp {records} "$dir/profile_export.jsonl"\nexit 1')
    monkeypatch.setattr(aiperf, "aiperf_executable", lambda: str(script))
    result = run_aiperf("http://127.0.0.1:9", tmp_path, ["x"], 8, 2, 4, tmp_path / "w", min_tokens=-1)
    assert (result["completed"], result["failed"], result["shed"], result["output_tokens"]) == (0, 4, 0, 0)
    assert result["errors"] == ["in ensemble 'ensemble', min_tokens must be >= 0, got -1 (tensorrt_llm input "
                                "min_tokens)"]
    assert result["ttft_ms"] == {"p50": None, "p90": None, "p99": None}
    assert result["wall_s"] == pytest.approx(2.0174, abs=1e-3)   # first start to last end of the records


def test_no_prompts_or_no_load_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="at least one prompt"):
        run_aiperf("http://127.0.0.1:9", tmp_path, [], 4, 1, 1, tmp_path / "w")
    with pytest.raises(UserError, match=r"must be at least 1 \(got 4, 0, 1\)"):
        run_aiperf("http://127.0.0.1:9", tmp_path, ["x"], 4, 0, 1, tmp_path / "w")


# ------------------------------------------------------------------------------ both generators, one server

#: The served model's words: letters only, so aiperf's re-tokenization of the streamed text counts one token
#: per generated token (support.models' " w17" is split into " w" and "17" by the byte-level pre-tokenizer).
WORDS = [f"w{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(101)]
END_ID = 1
PROMPT_WORDS, MAX_TOKENS, CONCURRENCY, PER_CLIENT = 16, 32, 8, 3
#: The tensorrt_llm model's dynamic-batcher delay in the agreement test: each wave of CONCURRENCY requests
#: becomes one batch however the load generator spaces its sends (a full batch leaves at once; see the test).
QUEUE_DELAY_US = 2_000_000


def save_letter_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of WORDS (" waa" .. " wdw"), end and padding " wab", saved as a Hugging Face one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"\u0120{w}": i for i, w in enumerate(WORDS)}, unk_token="\u0120waa"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    eos = f"\u0120{WORDS[END_ID]}"
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos}))


def never_ends(model_dir: Path) -> None:
    """Zero the lm_head row of the end id: its logit is then always 0, below the largest of 100 random logits,
    so every greedy completion runs to max_tokens and both generators stream the same number of tokens
    (run_level sends no min_tokens to pin it)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"][END_ID] = 0.0
    save_file(tensors, path, metadata={"format": "pt"})


def prompts_of(count: int) -> tuple[str, ...]:
    """`count` different prompts of PROMPT_WORDS words."""
    return tuple("".join(f" {WORDS[2 + (start * 7 + k) % (len(WORDS) - 2)]}" for k in range(PROMPT_WORDS))
                 for start in range(count))


def build_small_repository(root: Path) -> tuple[Path, tuple[str, ...]]:
    """A small random Llama's cpu repository (GPT-2 small's size: decode steps of tens of ms, so the server's
    steps and not the clients' scheduling set the timings) with the dynamic
    batcher waiting QUEUE_DELAY_US for a full batch, and the prompts both generators send."""
    from support.models import make_tiny_model

    from pipeline.convert import convert_model
    from pipeline.deploy import deploy_repository
    from pipeline.plan import resolve_model_info
    from pipeline.planner import make_plan
    from pipeline.sources import resolve_model
    from pipeline.targets import get_target

    model = make_tiny_model(root / "model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
    never_ends(model)
    save_letter_tokenizer(model)
    ckpt = convert_model(resolve_model(str(model)), root / "ckpt", dtype="float32", progress=False).path
    plan = make_plan(resolve_model_info(str(model)), get_target("cpu"), "fp32")
    repo = deploy_repository(plan, root / "repo", checkpoint=ckpt).path
    config = repo / "tensorrt_llm" / "config.pbtxt"
    text, edits = re.subn(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {QUEUE_DELAY_US}",
                          config.read_text())
    assert edits == 1 and f"preferred_batch_size: {CONCURRENCY}" in text
    config.write_text(text)
    return repo, prompts_of(CONCURRENCY)


@pytest.fixture(scope="module")
def small_served(tmp_path_factory):
    """The small repository in the embedded Triton server, its tokenizer directory and the prompts."""
    from pipeline.server import embedded_server

    repo, prompts = build_small_repository(tmp_path_factory.mktemp("aiperf-agreement"))
    with embedded_server(repo, ready_timeout=300) as server:
        yield server, repo / "preprocessing" / "1" / "tokenizer", prompts


def preprocessed(server) -> int:
    """How many requests the ensemble's preprocessing has answered: each is in tensorrt_llm's queue right after."""
    import requests

    stats = requests.get(f"{server.http_url}/v2/models/preprocessing/stats", timeout=10).json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def wait_for_first_request(server, running, before: int, timeout_s: float = 300.0) -> None:
    """Until aiperf's first request has been preprocessed (it then waits in tensorrt_llm's queue for a full
    batch), or aiperf has ended (its error then comes from the future)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not running.done() and time.monotonic() < deadline:
        if preprocessed(server) > before:
            return
        time.sleep(0.02)
    running.result(timeout=0)   # raises aiperf's error, or TimeoutError
    raise AssertionError("aiperf ended without sending a request")


def side_by_side(server, tokenizer: Path, prompts: tuple[str, ...], workdir: Path) -> tuple[dict, dict]:
    """run_level and run_aiperf at the same time, CONCURRENCY // 2 clients each: every wave of the server is
    a batch of both generators' requests, so both measure the same decode steps whatever else the machine does."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.validate.client import EnsembleClient
    from pipeline.validate.load_test import run_level

    half = CONCURRENCY // 2
    client = EnsembleClient(server)
    before = preprocessed(server)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_aiperf, server.http_url, tokenizer, prompts, MAX_TOKENS, half, half * PER_CLIENT,
                              workdir)
        wait_for_first_request(server, running, before)
        builtin = run_level(client, prompts, MAX_TOKENS, half, PER_CLIENT)
        return builtin, running.result()


def ratios(builtin: dict, other: dict) -> tuple[float, float, float]:
    """aiperf / builtin for TTFT p50, ITL p50 and output tokens/s."""
    return (other["ttft_ms"]["p50"] / builtin["ttft_ms"]["p50"], other["itl_ms"]["p50"] / builtin["itl_ms"]["p50"],
            other["output_tokens_per_s"] / builtin["output_tokens_per_s"])


def batch_sizes(server) -> dict[int, int]:
    """tensorrt_llm's executions per batch size so far."""
    import requests

    stats = requests.get(f"{server.http_url}/v2/models/tensorrt_llm/stats", timeout=10).json()["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


#: How far aiperf's TTFT p50, ITL p50 and output tokens/s may be from run_level's, as a ratio. Measured side by
#: side on this 2-core machine in 10 runs at load 1-8 (other work running): ITL and tokens/s 0.992-1.010, TTFT
#: 0.996-1.048 (widest on a quiet machine, where TTFT is ~0.6 s and the lag of some ms to tens of ms between
#: the two generators' sends of one wave, which the other's requests wait for, weighs most). 15% leaves room
#: for that and still fails a wrong reading of the export (seconds for ms, one generator's waves split from
#: the other's, throughput over another duration).
TOLERANCE = 0.15
#: TTFT cannot agree as closely: the cpu model prefills the prompts admitted together one after another, each
#: streaming its first token once its own prefill is done, so in a wave of h requests from each generator the
#: generator whose requests reached the model later has the later prefills. At worst its mean position is h + 1..2h
#: against 1..h: (3h + 1) / (h + 1) times the other's (2.6 for h = 4; measured 1.49 and 0.57 in two runs).
TTFT_BOUND = (3 * (CONCURRENCY // 2) + 1) / (CONCURRENCY // 2 + 1) * (1 + TOLERANCE)


@pytest.mark.slow
def test_aiperf_and_the_builtin_load_test_agree(small_served, tmp_path):
    server, tokenizer, prompts = small_served
    before = batch_sizes(server)
    builtin, other = side_by_side(server, tokenizer, prompts, tmp_path)
    after = batch_sizes(server)
    assert {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)} == {CONCURRENCY: PER_CLIENT}, \
        "the two generators' requests did not share every batch"
    for result in (builtin, other):
        assert (result["completed"], result["failed"], result["shed"]) == (CONCURRENCY // 2 * PER_CLIENT, 0, 0)
        assert result["output_tokens"] == CONCURRENCY // 2 * PER_CLIENT * MAX_TOKENS
    ttft, *rest = ratios(builtin, other)
    for name, ratio in zip(("ITL p50", "output tokens/s"), rest):
        assert abs(ratio - 1) <= TOLERANCE, f"{name}: aiperf / builtin = {ratio:.3f}\n{builtin}\n{other}"
    assert 1 / TTFT_BOUND <= ttft <= TTFT_BOUND, f"TTFT p50: aiperf / builtin = {ttft:.3f}\n{builtin}\n{other}"


@pytest.mark.slow
def test_a_cancelled_request_stops_generating(small_served):
    """A gRPC client that cancels its stream to tensorrt_llm (as NVIDIA's inflight_batcher_llm_client talks to
    it) frees the model: the next request does not wait for the cancelled one's max_tokens. (Triton 2.51 passes
    neither an HTTP disconnect nor a cancel sent to the ensemble on to its composing model: docs/aiperf.md.)"""
    import queue
    import time

    import numpy as np
    import requests
    import tritonclient.grpc as grpcclient

    server, _, prompts = small_served
    max_tokens, seen = 400, 6
    client = grpcclient.InferenceServerClient(server.endpoints.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((time.perf_counter(), error)))
    inputs = []
    for name, value in (("input_ids", np.arange(2, 18, dtype=np.int32)[None]), ("input_lengths", [[16]]),
                        ("request_output_len", [[max_tokens]]), ("streaming", [[True]])):
        array = np.asarray(value, np.bool_ if name == "streaming" else np.int32)
        tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if name == "streaming" else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer("tensorrt_llm", inputs)
    arrivals = []
    for _ in range(seen):
        at, error = answers.get(timeout=600)
        assert error is None, error
        arrivals.append(at)
    client.stop_stream(cancel_requests=True)
    client.close()
    rest = (max_tokens - seen) * float(np.mean(np.diff(arrivals)))   # what the cancelled request had left
    start = time.perf_counter()
    response = requests.post(f"{server.http_url}/v2/models/ensemble/generate",
                             json={"text_input": prompts[0], "max_tokens": 2}, timeout=rest / 4)
    assert response.status_code == 200 and time.perf_counter() - start < rest / 4


def test_the_cpu_model_leaves_one_core_to_the_rest_of_the_server_under_torch_and_none_under_onnx_runtime(monkeypatch):
    """docs/aiperf.md: with as many torch threads as cores, a 2-core machine serving and measuring at once
    made every decode step 3-15x slower; ONNX Runtime with every core was faster than with one (docs/cpu-serving.md:
    benchmarks/bench_cpu_threads.py)."""
    from pipeline import host as threads

    model = load_cpu_model(monkeypatch)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert model.intra_op_threads({}) == 1
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert model.intra_op_threads({}) == 15
    assert model.intra_op_threads({"parameters": {"intra_op_threads": {"string_value": "4"}}}) == 4
    assert model.intra_op_threads({"parameters": {"intra_op_threads": {"string_value": "${intra_op_threads}"}}}) == 15
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0})
    assert model.intra_op_threads({}) == 1
    onnx = {"parameters": {"runtime": {"string_value": "onnxruntime"}}}
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert model.intra_op_threads(onnx) == 2
    onnx["parameters"]["intra_op_threads"] = {"string_value": "1"}
    assert model.intra_op_threads(onnx) == 1
