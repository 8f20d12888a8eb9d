"""In-flight generation (pipeline/runtime/generate.py `serve_rows`): requests join a running batch between decode
steps, in both runtimes, and each comes out exactly as it does generated alone."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from pipeline.onnx.export import export_onnx
from pipeline.onnx.runner import OrtBatch, OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.model import CacheDecoder

#: (prompt, new tokens, the decode step before which the request is admitted)
SCHEDULE = [([5, 9, 13, 2, 7], 12, 0), ([3, 3, 8], 4, 0), ([11, 4], 9, 2), ([6, 1, 6, 1, 6, 1, 6], 5, 6),
            ([10], 3, 6)]


@pytest.fixture(scope="module")
def runtimes(checkpoint, tmp_path_factory) -> dict:
    ckpt = checkpoint("gqa")
    onnx = export_onnx(ckpt, tmp_path_factory.mktemp("inflight") / "onnx").path
    return {"torch": ReferenceModel.load(ckpt), "onnxruntime": OrtDecoder(onnx)}


def serve(model, schedule) -> tuple[dict, list]:
    """Serve `schedule` in flight; the tokens of each request and the order of (event, request) seen."""
    calls, tokens, events = [0], {}, []

    def admit():
        step = calls[0]
        calls[0] += 1
        due = [(i, prompt, SamplingConfig(max_new_tokens=n)) for i, (prompt, n, at) in enumerate(schedule)
               if at == step]
        events.extend(("admit", i) for i, _, _ in due)
        return due

    def on_step(key, result):
        tokens[key] = list(result.tokens)
        events.append(("token", key))

    model.serve_rows(admit, on_step, lambda key: events.append(("end", key)))
    return tokens, events


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_a_request_admitted_mid_generation_comes_out_as_it_does_alone(runtimes, runtime):
    model = runtimes[runtime]
    alone = [model.generate([prompt], SamplingConfig(max_new_tokens=n))[0] for prompt, n, _ in SCHEDULE]
    tokens, events = serve(model, SCHEDULE)
    assert [tokens[i] for i in range(len(SCHEDULE))] == alone
    # request 2 joined while request 0 ran: its first token came before request 0's last
    first_of_2 = events.index(("token", 2))
    last_of_0 = max(i for i, e in enumerate(events) if e == ("token", 0))
    assert events.index(("admit", 2)) < first_of_2 < last_of_0
    assert [e for e in events if e[0] == "end"] == [("end", 1), ("end", 4), ("end", 2), ("end", 3), ("end", 0)]


def test_the_torch_cache_hands_a_finished_row_to_the_next_request(runtimes):
    decoder = CacheDecoder(runtimes["torch"])
    decoder.add([0, 1], [[1, 2], [3]], [SamplingConfig(max_new_tokens=4)] * 2)
    assert decoder.cache.k.shape[1] == 2 and decoder.cache.k.shape[3] == 6
    decoder.release([0])
    decoder.add([2], [[4, 5, 6, 7, 8, 9]], [SamplingConfig(max_new_tokens=4)])
    assert decoder.slots == {1: 1, 2: 0} and decoder.cache.k.shape[1] == 2 and decoder.cache.k.shape[3] == 10


def test_the_onnx_cache_drops_positions_no_running_row_uses(runtimes):
    batch = OrtBatch(runtimes["onnxruntime"])
    batch.add([0], [[1, 2, 3, 4, 5, 6]], [SamplingConfig()])
    batch.prefill([0])
    batch.add([1], [[7]], [SamplingConfig()])
    batch.prefill([1])
    assert batch.cache.length == 6 and batch.cache.mask.sum(axis=1).tolist() == [6, 1]
    batch.release([0])
    batch.decode([1], [3])
    assert batch.rows == [1] and batch.cache.length == 2 and batch.next.tolist() == [[2]]


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
