"""In-flight generation (pipeline/runtime/generate.py `serve_rows`): requests join a running batch between decode
steps, in both runtimes, and each comes out exactly as it does generated alone."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import requests

from pipeline.onnx.export import export_onnx
from pipeline.onnx.runner import FREE_ROW_STEPS, OrtBatch, OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.model import CacheDecoder
from pipeline.runtime.scheduler import MAX_UTILIZATION, Scheduler, SchedulerLimits, Sequence

#: (prompt, new tokens, the decode step before which the request is admitted)
SCHEDULE = [([5, 9, 13, 2, 7], 12, 0), ([3, 3, 8], 4, 0), ([11, 4], 9, 2), ([6, 1, 6, 1, 6, 1, 6], 5, 6),
            ([10], 3, 6)]


@pytest.fixture(scope="module")
def runtimes(checkpoint, tmp_path_factory) -> dict:
    ckpt = checkpoint("gqa")
    onnx = export_onnx(ckpt, tmp_path_factory.mktemp("inflight") / "onnx").path
    return {"torch": ReferenceModel.load(ckpt), "onnxruntime": OrtDecoder(onnx)}


def serve(model, schedule, limits: SchedulerLimits = SchedulerLimits(), priorities=None) -> tuple[dict, list, list]:
    """Serve `schedule` in flight; the tokens of each request, the order of (event, request) seen and the
    sequences (their block counts, pauses)."""
    calls, tokens, events, submitted = [0], {}, [], []
    scheduler = Scheduler(limits)

    def poll():
        step = calls[0]
        calls[0] += 1
        for i, (prompt, n, at) in enumerate(schedule):
            if at == step:
                sequence = Sequence(i, prompt, SamplingConfig(max_new_tokens=n))
                assert scheduler.refusal([sequence]) is None
                scheduler.submit([sequence], None if priorities is None else priorities[i])
                submitted.append(sequence)
                events.append(("admit", i))

    def on_step(key, result):
        tokens[key] = list(result.tokens)
        events.append(("token", key))

    model.serve_rows(scheduler, poll, on_step, lambda key: events.append(("end", key)))
    assert scheduler.running == [] and scheduler.waiting == []
    assert len(scheduler.free_blocks) == (limits.blocks or 0)    # every block back in the pool
    return tokens, events, submitted


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_a_request_admitted_mid_generation_comes_out_as_it_does_alone(runtimes, runtime):
    model = runtimes[runtime]
    alone = [model.generate([prompt], SamplingConfig(max_new_tokens=n))[0] for prompt, n, _ in SCHEDULE]
    tokens, events, _ = serve(model, SCHEDULE)
    assert [tokens[i] for i in range(len(SCHEDULE))] == alone
    # request 2 joined while request 0 ran: its first token came before request 0's last
    first_of_2 = events.index(("token", 2))
    last_of_0 = max(i for i, e in enumerate(events) if e == ("token", 0))
    assert events.index(("admit", 2)) < first_of_2 < last_of_0
    # a joining prompt is computed in the running rows' decode step, one a step: 3 and 4 start together, 4 joins
    # a step after 3 and ends with it, after 0
    assert [e for e in events if e[0] == "end"] == [("end", 1), ("end", 4), ("end", 0), ("end", 2), ("end", 3)]


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_a_joining_prompt_is_computed_in_the_decode_step_of_the_running_rows(runtimes, runtime, monkeypatch):
    """The same schedule served mixing prompts into decode steps and apart (each prompt alone first, as an ONNX export
    without the prompt group is served): the same tokens, in fewer passes through the model: each prompt that joins
    running rows costs no pass of its own."""
    model = runtimes[runtime]
    passes = {"mixed": 0, "apart": 0}
    # the one call each pass makes: ONNX Runtime's run, the torch runtime's layers
    owner, name = (model.session, "run") if runtime == "onnxruntime" else (model, "_hidden_groups")
    real = getattr(owner, name)
    kind = ["mixed"]

    def counted(*args, **kwargs):
        passes[kind[0]] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    mixed, _, _ = serve(model, SCHEDULE)
    kind[0] = "apart"
    monkeypatch.setattr(model if runtime == "onnxruntime" else CacheDecoder, "mixes_prompts", False)
    apart, _, _ = serve(model, SCHEDULE)
    assert mixed == apart
    # five prompts: the first starts on an empty batch, so four join running rows
    assert passes["apart"] - passes["mixed"] == 4


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_sequences_paused_when_the_block_pool_runs_out_resume_with_the_same_tokens(runtimes, runtime):
    """max_utilization with a pool of 9 blocks of 2 tokens: the five requests cannot all hold their KV, so the
    latest started pause and are recomputed later; each still comes out exactly as it does alone."""
    model = runtimes[runtime]
    alone = [model.generate([prompt], SamplingConfig(max_new_tokens=n))[0] for prompt, n, _ in SCHEDULE]
    limits = SchedulerLimits(kv_tokens=18, tokens_per_block=2, policy=MAX_UTILIZATION)
    tokens, events, sequences = serve(model, SCHEDULE, limits)
    assert [tokens[i] for i in range(len(SCHEDULE))] == alone
    assert sum(s.paused for s in sequences) > 0
    assert sorted(key for event, key in events if event == "end") == list(range(len(SCHEDULE)))   # each ends once


def test_guaranteed_no_evict_starts_a_request_only_when_its_whole_kv_fits(runtimes):
    """Pool of 10 blocks of 2 tokens: request 0 reserves 9 (5 + 12 tokens), so request 1 (3 + 4: 4 blocks) waits
    for it to end: its first token comes after request 0's last, and nothing is ever paused."""
    schedule = SCHEDULE[:2]
    tokens, events, sequences = serve(runtimes["torch"], schedule, SchedulerLimits(kv_tokens=20, tokens_per_block=2))
    assert events.index(("token", 1)) > max(i for i, e in enumerate(events) if e == ("token", 0))
    assert [s.paused for s in sequences] == [0, 0] and [s.allocated for s in sequences] == [9, 4]


def test_the_torch_cache_hands_a_finished_row_to_the_next_request(runtimes):
    decoder = CacheDecoder(runtimes["torch"])
    decoder.add([0, 1], [[1, 2], [3]], [SamplingConfig(max_new_tokens=4)] * 2)
    assert decoder.cache.k.shape[1] == 2 and decoder.cache.k.shape[3] == 6
    decoder.release([0])
    decoder.add([2], [[4, 5, 6, 7, 8, 9]], [SamplingConfig(max_new_tokens=4)])
    assert decoder.slots == {1: 1, 2: 0} and decoder.cache.k.shape[1] == 2 and decoder.cache.k.shape[3] == 10


def test_the_onnx_cache_gives_a_left_row_to_the_next_prompt_in_place_and_seldom_copies_it_whole(runtimes,
                                                                                                  monkeypatch):
    """Two prefills join the cache in one copy; a request that leaves frees its cache row and the next prompt that
    fits is written into it in place; a row left free FREE_ROW_STEPS steps is dropped, with the leading positions
    no running row uses, by one rebuild; a prompt longer than the cache rebuilds it. Each row's logits stay those
    of its tokens computed alone."""
    model = runtimes["onnxruntime"]
    batch, rebuilds, real = OrtBatch(model), [0], OrtBatch._rebuild

    def counted(self, fresh):
        rebuilds[0] += 1
        real(self, fresh)

    def alone(tokens: list[int]) -> np.ndarray:
        return model.step(np.array([tokens]), model.empty_cache(1))[0][0, -1]

    monkeypatch.setattr(OrtBatch, "_rebuild", counted)
    batch.add([0], [[1, 2, 3, 4, 5, 6]], [SamplingConfig()])
    batch.prefill([0])
    batch.add([1], [[7]], [SamplingConfig()])
    batch.prefill([1])
    assert batch.slots == [] and len(batch.fresh) == 2        # placed by the next decode, both at once
    batch.decode([0, 1], [3, 3])
    assert batch.slots == [0, 1] and batch.cache.length == 7 and batch.cache.mask.sum(axis=1).tolist() == [7, 2]
    assert rebuilds == [1]
    batch.release([0])
    batch.add([2], [[8, 9, 10]], [SamplingConfig()])
    batch.decode_with_prompt([1], [3], 2)
    assert batch.slots == [None, 1] and batch.cache.mask[0, :-1].sum() == 0      # row 0's row free, masked
    logits = batch.decode([1, 2], [3, 4]).numpy()
    assert batch.slots == [2, 1] and rebuilds == [1] and batch.cache.mask.sum(axis=1).tolist() == [4, 4]
    np.testing.assert_allclose(logits, [alone([7, 3, 3, 3]), alone([8, 9, 10, 4])], atol=1e-4)

    batch.release([2])
    for _ in range(FREE_ROW_STEPS):
        batch.decode([1], [3])
    assert batch.slots == [None, 1] and rebuilds == [1]
    logits = batch.decode([1], [3]).numpy()
    assert batch.slots == [1] and rebuilds == [2]
    assert batch.cache.length == batch.cache.mask.sum() == 5 + FREE_ROW_STEPS and batch.next.tolist() == [[9]]
    np.testing.assert_allclose(logits[0], alone([7] + [3] * (4 + FREE_ROW_STEPS)), atol=1e-4)

    long_prompt = list(range(1, 21))
    batch.add([3], [long_prompt], [SamplingConfig()])
    batch.decode_with_prompt([1], [3], 3)
    logits = batch.decode([3, 1], [5, 3]).numpy()
    assert batch.slots == [1, 3] and rebuilds == [3] and batch.cache.length == 21
    np.testing.assert_allclose(logits, [alone(long_prompt + [5]), alone([7] + [3] * (6 + FREE_ROW_STEPS))],
                               atol=1e-4)


def test_a_request_sent_while_another_streams_joins_it_on_the_served_model(tiny_cpu_server):
    """Through Triton (ensemble, HTTP streaming): B, sent once A's stream has begun, gets its first token before A
    gets its last. A server that ran each batch to completion answered B only after A's last token."""
    url = f"{tiny_cpu_server.http_url}/v2/models/ensemble/generate_stream"
    long = {"text_input": " w5 w6", "max_tokens": 300, "min_tokens": 300, "stream": True}
    short = {"text_input": " w7 w8", "max_tokens": 4, "min_tokens": 4, "stream": True}
    arrivals: dict[str, list[float]] = {"A": [], "B": []}

    def stream(name: str, body: dict, started: threading.Event | None = None) -> None:
        with requests.post(url, json=body, stream=True, timeout=300) as response:
            assert response.status_code == 200, response.text
            for line in response.iter_lines():
                if line.startswith(b"data:") and json.loads(line[5:]).get("text_output"):
                    arrivals[name].append(time.perf_counter())
                    if started is not None and len(arrivals[name]) == 3:
                        started.set()

    begun = threading.Event()
    a = threading.Thread(target=stream, args=("A", long, begun))
    a.start()
    assert begun.wait(120)
    stream("B", short)
    a.join(300)
    assert len(arrivals["A"]) == 300 and len(arrivals["B"]) == 4
    assert arrivals["B"][0] < arrivals["A"][-1]
    assert arrivals["B"][-1] < arrivals["A"][-1]   # and was answered in full while A went on


@pytest.fixture(scope="module")
def prioritised_server(tiny_llama, tmp_path_factory, triton_pool):
    """The tiny cpu repository planned with one running request at a time and two priority levels (requests without
    a priority at the lower), deployed by the CLI."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.plan import Overrides, load_plan
    from pipeline.planner import replan
    from support.models import tiny_cpu_checkpoint

    root = tmp_path_factory.mktemp("prioritised")
    ckpt, plan_path = tiny_cpu_checkpoint(tiny_llama("gqa"), root)
    plan = replan(load_plan(plan_path), Overrides(max_batch_size=1, priority_levels=2))
    plan_path.write_text(json.dumps(plan.to_dict()))
    result = CliRunner().invoke(main, ["deploy", "--checkpoint", str(ckpt), "--plan", str(plan_path),
                                       "-o", str(root / "repo")])
    assert result.exit_code == 0, result.output
    return triton_pool.get(root / "repo")


def test_a_high_priority_request_overtakes_the_queue_of_low_ones(prioritised_server):
    """Through the ensemble's generate_stream: while A runs alone (max_batch_size 1), three requests without a
    priority queue up, then one with priority 1. It starts next, ahead of the three, which keep their order.

    Each of the four streams SHORT tokens: the order is read from the client's threads, and a tiny model's few
    tokens come out within a millisecond, which those threads do not keep; SHORT steps put tens of ms between
    one request's first token and the next one's."""
    short = 64
    url = f"{prioritised_server.http_url}/v2/models/ensemble/generate_stream"
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    begun = threading.Event()

    def stream(name: str, tokens: int, **extra) -> None:
        body = {"text_input": " w5 w6", "max_tokens": tokens, "min_tokens": tokens, "stream": True, **extra}
        with requests.post(url, json=body, stream=True, timeout=300) as response:
            assert response.status_code == 200, response.text
            for line in response.iter_lines():
                if line.startswith(b"data:") and json.loads(line[5:]).get("text_output"):
                    first.setdefault(name, time.perf_counter())
                    last[name] = time.perf_counter()
                    begun.set()

    threads = [threading.Thread(target=stream, args=("A", 1500))]
    threads[0].start()
    assert begun.wait(120)
    for name in ("low-1", "low-2", "low-3"):
        threads.append(threading.Thread(target=stream, args=(name, short)))
        threads[-1].start()
        time.sleep(0.15)
    sent_high = time.perf_counter()
    threads.append(threading.Thread(target=stream, args=("high", short), kwargs={"priority": 1}))
    threads[-1].start()
    for thread in threads:
        thread.join(300)
    assert sent_high < last["A"]           # the three were still waiting for A when the high one came
    assert sorted(first, key=first.get) == ["A", "high", "low-1", "low-2", "low-3"]


def test_a_priority_outside_the_levels_is_refused(prioritised_server):
    response = requests.post(f"{prioritised_server.http_url}/v2/models/ensemble/generate",
                             json={"text_input": " w5", "max_tokens": 2, "priority": 3}, timeout=60)
    assert response.status_code == 400 and "priority 3 is outside the model's priority levels 1..2" in response.text
