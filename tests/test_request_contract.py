"""The cpu target's tensorrt_llm model against NVIDIA's request contract (pipeline/triton_contract.py): every input
is honoured or refused by name, and each implemented one changes the answer the way TensorRT-LLM documents it.
First with stand-ins for Triton's Python backend (support.triton_stubs.load_cpu_model), then live on the embedded
Triton."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import requests
import torch
from support.triton_stubs import StubRequest, StubTensor, load_cpu_model

from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.triton_contract import TENSORRT_LLM_INPUTS

FINAL = 1
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]


class Request(StubRequest):
    """One Triton request of one row, whose sender records (outputs, final, error) in `log`."""

    def __init__(self, name: str, prompt: list, max_tokens: int, **inputs):
        super().__init__(name, prompt, max_tokens, **inputs)
        self.log = []
        self.done = threading.Event()

    def send(self, response=None, flags=0):
        error = response.error.message if response is not None and response.error else None
        self.log.append((response.outputs() if response is not None else {}, flags == FINAL, error))
        if flags == FINAL:
            self.done.set()

    def tokens(self) -> list:
        return [int(t) for out, _, _ in self.log if "output_ids" in out
                for t in out["output_ids"][0, 0, :out["sequence_length"][0, 0]]]


@pytest.fixture
def cpu_model(checkpoint, monkeypatch):
    def make(max_batch_size: int = 0, **parameters):
        module = load_cpu_model(monkeypatch)
        model = module.TritonPythonModel()
        params = {"checkpoint_dir": str(checkpoint("gqa")), "exclude_input_in_output": "true", **parameters}
        model.initialize({"model_config": json.dumps({"max_batch_size": max_batch_size,
                                                      "model_transaction_policy": {"decoupled": True},
                                                      "parameters": {k: {"string_value": v}
                                                                     for k, v in params.items()}})})
        model.module = module
        return model
    return make


def answer(model, *requests_) -> None:
    model.execute(list(requests_))
    model.queue.join()


def test_every_input_of_nvidias_contract_is_honoured_or_refused(cpu_model):
    module = cpu_model().module
    names = {t.name for t in TENSORRT_LLM_INPUTS}
    assert set(module.HONOURED) | set(module.REFUSED) == names
    assert not set(module.HONOURED) & set(module.REFUSED)


@pytest.mark.parametrize("name, value, says", [
    ("lora_task_id", np.array([[1]], np.uint64), "LoRA adapters are not supported"),
    ("guided_decoding_guide_type", np.array([[b"json"]], object), "guided decoding is not supported"),
    ("draft_logits", np.zeros((1, 2, 4), np.float32), "draft logits"),
    ("prompt_embedding_table", np.zeros((1, 2, 4), np.float16), "p-tuning"),
    ("beam_width", np.array([[2]], np.int32), "beam search is not supported"),
])
def test_what_the_runtime_cannot_do_is_refused_by_name(cpu_model, name, value, says):
    model = cpu_model()
    request = Request("r", PROMPT, 4, **{name: value})
    answer(model, request)
    (_, final, error), = request.log
    assert final and name in error and says in error


def test_a_stop_request_cancels_a_running_stream_the_way_nvidias_bls_sends_it(cpu_model):
    """NVIDIA's BLS stops a stream that hit a stop word with a request of the same id, `stop` true and empty
    input_ids; the stream ends at its next token with a final response (no error) and the stop request gets an
    empty final answer, while the worker is still generating. The responses go out from the outbox thread, so the
    worker may be a step ahead of the stream the client reads: the stream ends at the token after the ones the worker
    had made when the stop arrived."""
    model = cpu_model()
    stop = Request("s", [0], 0, stop=np.array([[True]]))
    stop.tensors[1] = StubTensor("input_lengths", np.zeros((1, 1), np.int32))
    made_at_stop = []

    class Stream(Request):
        def send(self, response=None, flags=0):
            super().send(response, flags)
            if len(self.log) == 3:
                stop.name = self.name
                made_at_stop.append(len(model.running[self.name][0].rows[0].tokens))
                model.execute([stop])      # while the stream is read, as the BLS calls it

    stream = Stream("a", PROMPT, 40, streaming=np.array([[True]]))
    answer(model, stream)
    assert stream.done.wait(30) and stop.done.wait(1)
    assert stop.log == [({}, True, None)]
    assert all(error is None for *_, error in stream.log) and stream.log[-1][1]
    assert 3 <= made_at_stop[0] and 3 <= len(stream.tokens()) <= made_at_stop[0] + 1 < 40


def test_a_stop_request_for_a_waiting_request_answers_it_without_generating(cpu_model):
    """With one row at a time, b waits while a streams; a `stop` for b takes it out of the queue: b gets its final
    answer (no tokens, no error) while a still streams, and b never runs."""
    model = cpu_model(max_batch_size=1)
    order = []
    stop = Request("b", [0], 0, stop=np.array([[True]]))
    stop.tensors[1] = StubTensor("input_lengths", np.zeros((1, 1), np.int32))

    class Logged(Request):
        def send(self, response=None, flags=0):
            super().send(response, flags)
            order.append(self.name)
            if self.name == "a" and len(self.log) == 3:
                model.execute([stop])

    a, b = Logged("a", PROMPT, 30, streaming=np.array([[True]])), Logged("b", PROMPT, 5)
    answer(model, a, b)
    assert b.log == [(b.log[0][0], True, None)] and b.tokens() == []
    assert order.index("b") < len(order) - 1 and order[-1] == "a"     # answered while a went on
    assert len(a.tokens()) == 30 and model.live == 0


def test_a_request_still_waiting_when_the_model_is_finalized_is_refused_and_the_running_one_finishes(cpu_model):
    model = cpu_model(max_batch_size=1)

    class Logged(Request):
        def send(self, response=None, flags=0):
            super().send(response, flags)
            if self.name == "a" and len(self.log) == 3:
                model.queue.put(None)          # what finalize sends the worker

    a, b = Logged("a", PROMPT, 10, streaming=np.array([[True]])), Logged("b", PROMPT, 5)
    answer(model, a, b)
    assert len(a.tokens()) == 10 and a.log[-1][1] and all(error is None for *_, error in a.log)
    assert [(final, error) for _, final, error in b.log] == [
        (True, "the server stopped before this request started; send it again")]
    model.worker.join(5)
    assert not model.worker.is_alive() and model.live == 0


def test_log_probs_are_the_runtimes_log_softmax_and_greedy_normalized_ones_are_zero(cpu_model, checkpoint):
    reference = ReferenceModel.load(checkpoint("gqa"))
    plain = cpu_model(normalize_log_probs="false")
    request = Request("lp", PROMPT, 5, return_log_probs=np.array([[True]]))
    answer(plain, request)
    out = request.log[-1][0]
    tokens = request.tokens()
    logits = reference.forward(torch.tensor([PROMPT + tokens]))[0]
    expected = [float(torch.log_softmax(logits[len(PROMPT) - 1 + i], -1)[t]) for i, t in enumerate(tokens)]
    assert np.allclose(out["output_log_probs"][0, 0], expected, atol=1e-4)
    assert out["cum_log_probs"][0, 0] == pytest.approx(sum(expected), abs=1e-3)
    normalized = Request("n", PROMPT, 5, return_log_probs=np.array([[True]]))
    answer(cpu_model(), normalized)     # NVIDIA's default normalize_log_probs: greedy reports 0
    assert np.allclose(normalized.log[-1][0]["output_log_probs"], 0)


def test_logits_token_counts_and_perf_metrics_come_back_when_asked(cpu_model, checkpoint):
    reference = ReferenceModel.load(checkpoint("gqa"))
    model = cpu_model()
    flags = {name: np.array([[True]]) for name in ("return_context_logits", "return_generation_logits",
                                                    "return_num_input_tokens", "return_num_output_tokens",
                                                    "return_perf_metrics")}
    request = Request("l", PROMPT, 4, **flags)
    answer(model, request)
    out = request.log[-1][0]
    tokens = request.tokens()
    logits = reference.forward(torch.tensor([PROMPT + tokens]))[0].numpy()
    assert np.allclose(out["context_logits"][0], logits[:len(PROMPT)], atol=1e-4)
    assert np.allclose(out["generation_logits"][0, 0], logits[len(PROMPT) - 1:-1], atol=1e-4)
    assert out["num_input_tokens"][0, 0] == len(PROMPT) and out["num_output_tokens"][0, 0] == len(tokens)
    times = [int(out[k][0, 0]) for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                         "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 0
    assert out["kv_cache_reused_blocks"][0, 0] == 0 and out["total_draft_tokens"][0, 0] == 0
    bare = Request("b", PROMPT, 4)
    answer(model, bare)
    assert set(bare.log[-1][0]) == {"output_ids", "sequence_length"}


def test_penalties_bad_words_and_bias_change_the_greedy_answer(cpu_model, checkpoint):
    reference = ReferenceModel.load(checkpoint("gqa"))
    model = cpu_model()
    repeating = [5, 6, 5, 6, 5, 6, 5, 6]

    def greedy(**inputs) -> list:
        request = Request("g", repeating, 6, **inputs)
        answer(model, request)
        assert request.log[-1][2] is None, request.log[-1][2]
        return request.tokens()

    free = greedy()
    assert free == reference.generate([repeating], SamplingConfig(max_new_tokens=6))[0]
    penalised = greedy(repetition_penalty=np.array([[5.0]], np.float32))
    assert penalised != free and penalised == reference.generate(
        [repeating], SamplingConfig(max_new_tokens=6, repetition_penalty=5.0))[0]
    assert greedy(presence_penalty=np.array([[3.0]], np.float32)) != free
    banned = free[0]
    words = np.array([[[banned], [1]]], np.int32)            # [1, 2, N]: ids, then end offsets
    assert banned not in greedy(bad_words_list=words)
    bias = np.zeros((1, reference.vocab_size), np.float32)
    bias[0, 42] = 100.0
    assert greedy(embedding_bias=bias) == [42] * 6


def test_num_return_sequences_samples_each_sequence_with_its_own_index(cpu_model):
    model = cpu_model()
    request = Request("n", PROMPT, 6, num_return_sequences=np.array([[3]], np.int32),
                      runtime_top_k=np.array([[50]], np.int32), temperature=np.array([[1.5]], np.float32),
                      seed=np.array([[7]], np.uint64))
    answer(model, request)
    answers = {int(out["sequence_index"][0, 0]): out["output_ids"][0, 0].tolist() for out, _, _ in request.log}
    assert sorted(answers) == [0, 1, 2] and len({tuple(a) for a in answers.values()}) > 1
    assert [final for _, final, _ in request.log] == [False, False, True]


# ------------------------------------------------------------------------------ served for real

@pytest.fixture
def served(tiny_cpu_server):
    return tiny_cpu_server


def post(server, model: str = "ensemble", path: str = "generate", **body):
    body = {"text_input": " w5 w6 w5 w6 w5 w6", "max_tokens": 6, "exclude_input_in_output": True, **body}
    return requests.post(f"{server.http_url}/v2/models/{model}/{path}", json=body, timeout=120)


def events(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


@pytest.mark.slow
def test_served_inputs_change_the_answer_as_nvidia_documents(served):
    free = post(served).json()
    penalised = post(served, repetition_penalty=5.0).json()
    assert penalised["text_output"] != free["text_output"]
    assert " w42" in post(served, embedding_bias_words=[" w42"], embedding_bias_weights=[100.0]).json()["text_output"]
    first = free["text_output"].split()[0]
    assert first not in post(served, bad_words=[" " + first]).json()["text_output"].split()
    answered = post(served, return_log_probs=True, return_num_input_tokens=True, return_num_output_tokens=True).json()
    assert len(answered["output_log_probs"]) == 6 and answered["num_input_tokens"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("field, says", [("lora_task_id", "LoRA"), ("guided_decoding_guide_type", "guided"),
                                         ("beam_width", "beam search")])
def test_served_refusals_are_one_clear_400(served, field, says):
    value = {"lora_task_id": 1, "guided_decoding_guide_type": "json", "beam_width": 2}[field]
    response = post(served, **{field: value})
    assert response.status_code == 400 and says in response.text


@pytest.mark.slow
def test_a_stream_with_stop_words_through_the_bls_ends_at_the_stop_word_without_an_error(served):
    free = post(served, max_tokens=8).json()["text_output"].split()
    stop = free[2]
    response = post(served, "tensorrt_llm_bls", "generate_stream", max_tokens=8, stream=True, stop_words=[" " + stop])
    assert response.status_code == 200 and "error" not in response.text
    streamed = "".join(e["text_output"] for e in events(response)).split()
    assert streamed == free[:free.index(stop) + 1]


@pytest.mark.slow
def test_the_bls_takes_nvidias_scalar_inputs_and_refuses_what_only_nvidias_bls_does(served):
    """The BLS config reshapes return_log_probs (and others) to a scalar, as NVIDIA's does; forwarded as it
    arrived it was refused by tensorrt_llm ("unexpected shape"). num_draft_tokens where the BLS names no draft model
    is refused by name."""
    answered = post(served, "tensorrt_llm_bls", return_log_probs=True, num_return_sequences=1)
    assert answered.status_code == 200 and len(answered.json()["output_log_probs"]) == 6
    refused = post(served, "tensorrt_llm_bls", num_draft_tokens=2)
    assert refused.status_code == 400 and "num_draft_tokens: this deployment has no draft model" in refused.text


def test_a_draining_model_refuses_new_requests_and_ends_running_ones_with_an_error(cpu_model, tmp_path,
                                                                                    monkeypatch):
    """trtpipe serve's stop (pipeline/serve.py): the drain file says DRAINING (no new requests: a 503-class error
    naming the shutdown) or CANCELLING (running streams end at their next token with an error, never cleanly)."""
    from pipeline.host import CANCELLING, DRAIN_FILE_ENV, DRAINING

    drain = tmp_path / "drain"
    monkeypatch.setenv(DRAIN_FILE_ENV, str(drain))
    model = cpu_model()
    accepted = Request("a", PROMPT, 3)
    answer(model, accepted)
    assert accepted.log[-1][1] and accepted.log[-1][2] is None and model.live == 0
    drain.write_text(DRAINING)
    refused = Request("b", PROMPT, 3)
    answer(model, refused)
    (_, final, error), = refused.log
    assert final and "the server is shutting down and accepts no new requests" in error

    class Stream(Request):
        def send(self, response=None, flags=0):
            super().send(response, flags)
            if len(self.log) == 2:
                drain.write_text(CANCELLING)
                model.shutdown_checked = 0.0      # the next token reads the file again

    drain.unlink()
    model.shutdown_state(at_once=True)
    stream = Stream("c", PROMPT, 40, streaming=np.array([[True]]))
    answer(model, stream)
    assert stream.done.wait(30)
    *_, (_, final, error) = stream.log
    assert final and "the server shut down before this request finished" in error
    assert len(stream.tokens()) < 40 and model.live == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_what_triton_does_before_any_model_sees_the_request(served, path):
    """docs/upstream-facts.md §C: a missing required input is Triton's 400 naming it; an integer beyond INT32 is
    cast by Triton's HTTP frontend before any model sees it (4294967300 arrives as 4, so no model can refuse
    it); a non-integer is Triton's 500. This test fails when Triton's behaviour changes."""
    body = {"text_input": " w5 w6", "max_tokens": 6, "min_tokens": 6}
    missing = requests.post(f"{served.http_url}/v2/models/ensemble/{path}", json={"max_tokens": 3}, timeout=60)
    assert missing.status_code == 400 and "missing" in missing.text and "text_input" in missing.text
    wrapped = requests.post(f"{served.http_url}/v2/models/ensemble/{path}",
                            json={**body, "max_tokens": 2**32 + 4, "min_tokens": 4}, timeout=60)
    assert wrapped.status_code == 200
    pieces = events(wrapped) if path == "generate_stream" else [wrapped.json()]
    assert sum(len(p["text_output"].split()) for p in pieces) == 4
    typed = requests.post(f"{served.http_url}/v2/models/ensemble/{path}", json={**body, "max_tokens": 2.5},
                          timeout=60)
    assert typed.status_code == 500 and "as signed-integer" in typed.text
    if path == "generate":   # a streamed answer asked of /generate: Triton's error body, with HTTP 200
        streamed = requests.post(f"{served.http_url}/v2/models/ensemble/generate", json={**body, "stream": True},
                                 timeout=60)
        assert streamed.status_code == 200 and "use generate stream" in streamed.json()["error"]
