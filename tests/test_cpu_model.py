"""The cpu target's tensorrt_llm model (model_repo/tensorrt_llm/1/model.py) answering a batch,
imported with stand-ins for Triton's Python backend (support.triton_stubs.load_cpu_model) and run on a tiny checkpoint.

The requests of one `execute` call share decode steps; in decoupled mode each is answered as soon as its own
rows are done (its end id, its max_tokens), while the others go on generating."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.triton_stubs import StubRequest, load_cpu_model
from pipeline.runtime import ReferenceModel, SamplingConfig

FINAL = 1


class Request(StubRequest):
    """A Triton request of one row whose sender writes every response into `log`."""

    def __init__(self, name: str, log: list, prompt: list, max_tokens: int, parameters: dict | None = None,
                 **scalars):
        super().__init__(name, prompt, max_tokens, parameters, **scalars)
        self.log = log

    def send(self, response, flags=0):
        assert response.error is None, response.error.message
        out = response.outputs()
        self.log.append((self.name, out["output_ids"][0, 0, :out["sequence_length"][0, 0]].tolist(), flags == FINAL))


def test_each_request_is_answered_when_its_own_rows_are_done(checkpoint, monkeypatch):
    module = load_cpu_model(monkeypatch)
    ckpt = checkpoint("gqa")
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True},
                                                  "parameters": {"checkpoint_dir": {"string_value": str(ckpt)}}})})
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    free = ReferenceModel.load(ckpt).generate([prompt], SamplingConfig(max_new_tokens=24))[0]
    end = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    cut = free.index(end)            # request a draws its end id in step `cut`
    log = []
    requests = [Request("a", log, prompt, 24, end_id=end, streaming=True),
                Request("b", log, [7, 1, 8], cut + 4, streaming=True),
                Request("c", log, [2, 7, 18], 3)]              # not streamed: one response, prompt + 3 tokens
    assert model.execute(requests) is None                     # decoupled: the worker answers through the senders
    model.queue.join()

    def responses(name):
        return [(i, ids, final) for i, (n, ids, final) in enumerate(log) if n == name]

    a, b, c = responses("a"), responses("b"), responses("c")
    assert [ids for _, ids, _ in a] == [[t] for t in free[:cut]] + [[]] and [f for *_, f in a][-1]
    assert len(b) == cut + 4 and [f for *_, f in b] == [False] * (cut + 3) + [True]
    assert len(c) == 1 and c[0][2] and c[0][1][:3] == [2, 7, 18] and len(c[0][1]) == 6
    # a starts alone; b's prompt is computed in a's next step and c's in the one after (one joining prompt a step),
    # so in step k a gets its token k + 1, b its token k and c its token k - 1
    assert a[-1][0] < b[cut - 1][0]   # a's final answer came in the step it ended, before b's token of that step
    assert c[0][0] < b[4][0]          # c's whole answer in the step of its 3rd token, before b's next, not b's last
    assert log[-1][0] == "b"


def test_a_top_p_of_zero_or_below_is_unset_as_in_nvidias_backend(checkpoint, monkeypatch):
    """NVIDIA's backend resets runtime_top_p <= 0 to unset (utils.cc@c2e65b8:558-563): the answer is the one without
    top_p (greedy with top_k 0), where the cpu model used to refuse it; above 1 stays a refusal."""
    module = load_cpu_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True},
                                                  "parameters": {"checkpoint_dir": {
                                                      "string_value": str(checkpoint("gqa"))}}})})
    prompt = [3, 14, 15, 92, 65]
    answers = {}
    for name, extra in (("unset", {}), ("zero", {"runtime_top_p": np.float32(0.0)}),
                        ("negative", {"runtime_top_p": np.float32(-0.5)})):
        log = []
        model.execute([Request(name, log, prompt, 6, **extra)])
        model.queue.join()
        answers[name] = log[-1][1]
    assert answers["zero"] == answers["negative"] == answers["unset"]

    class Refused(Request):
        def send(self, response, flags=0):
            self.log.append(response.error.message if response.error else None)

    log = []
    model.execute([Refused("high", log, prompt, 6, runtime_top_p=np.float32(1.5))])
    assert log and "top_p must be <= 1" in log[-1]


def test_an_empty_prompt_is_encoded_as_nvidias_preprocessing_encodes_it(smollm2_checkpoint, monkeypatch):
    """NVIDIA's preprocessing encodes text_input with the tokenizer's special tokens, so "" becomes SmolLM2's BOS
    alone and is answered (trtpipe refused it with 400); a tokenizer adding nothing still gets the refusal."""
    module = load_cpu_model(monkeypatch, "preprocessing")
    model = module.TritonPythonModel()
    tokenizer = str(smollm2_checkpoint / "tokenizer")
    model.initialize({"model_config": json.dumps({"parameters": {"tokenizer_dir": {"string_value": tokenizer}}})})
    bos = model.tokenizer.bos_token_id
    assert model.encode("") == [bos] and model.encode("Hi")[0] == bos
    model.add_special_tokens = False
    with pytest.raises(ValueError, match="text_input is empty"):
        model.encode("")


def test_a_field_the_deployment_does_not_know_is_refused_not_dropped(checkpoint, monkeypatch):
    """Triton's generate endpoint turns a JSON field that names no input into a request parameter and the ensemble
    forwards it (checked on Triton 2.51): a misspelt `tmperature` used to get 200 with the default temperature.
    The endpoint's own fields and NVIDIA's request_type pass; another request_type is refused."""
    module = load_cpu_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True},
                                                  "parameters": {"checkpoint_dir": {
                                                      "string_value": str(checkpoint("gqa"))}}})})

    class Answer(Request):
        def send(self, response, flags=0):
            self.log.append(response.error.message if response.error else "ok")

    cases = {"typo": {"tmperature": 0.5}, "triton's": {"id": "a1", "sequence_id": 0, "priority": 0, "timeout": 0},
             "nvidia's": {"request_type": "context_and_generation"}, "disaggregated": {"request_type": "context_only"}}
    answers = {}
    for name, params in cases.items():
        log = []
        model.execute([Answer(name, log, [3, 14, 15], 2, parameters=params)])
        model.queue.join()
        answers[name] = log[-1]
    assert "unknown field(s) tmperature" in answers["typo"]
    assert answers["triton's"] == answers["nvidia's"] == "ok"
    assert "request_type 'context_only' is not supported" in answers["disaggregated"]


def test_beyond_max_batch_size_running_and_max_queue_size_waiting_a_request_is_shed(checkpoint, monkeypatch):
    """Decoupled, execute returns at once and Triton's queue stays empty: the model keeps the plan's bound itself
    (max_batch_size running + max_queue_size waiting) and refuses the rest as Triton does ("Exceeds maximum queue
    size"); the requests it took are all answered in full."""
    module = load_cpu_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({
        "max_batch_size": 2, "model_transaction_policy": {"decoupled": True},
        "dynamic_batching": {"default_queue_policy": {"max_queue_size": "1"}},
        "parameters": {"checkpoint_dir": {"string_value": str(checkpoint("gqa"))}}})})
    answers: dict[str, list] = {}

    class Answer(Request):
        def send(self, response, flags=0):
            answers.setdefault(self.name, []).append(response.error.message if response.error else flags)

    assert model.execute([Answer(f"r{i}", [], [3, 14, 15], 6) for i in range(5)]) is None
    model.queue.join()
    shed = {name for name, got in answers.items() if "Exceeds maximum queue size" in str(got[-1])}
    assert shed == {"r3", "r4"}
    assert all(answers[f"r{i}"] == [FINAL] for i in range(3))   # one final response each, no error
    assert model.live == 0


def test_a_failed_run_fails_its_requests_and_the_waiting_ones_still_run(checkpoint, monkeypatch):
    module = load_cpu_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({
        "max_batch_size": 1, "model_transaction_policy": {"decoupled": True},
        "parameters": {"checkpoint_dir": {"string_value": str(checkpoint("gqa"))}}})})
    real, calls, answers = model.model.serve_rows, [], {}

    def failing_once(scheduler, poll, on_step, on_end, speculation=None):
        calls.append(len(calls))
        if len(calls) == 1:
            poll()
            assert len(scheduler.admit()) == 1          # one row at a time: r0 starts, r1 and r2 wait
            raise RuntimeError("out of memory")
        return real(scheduler, poll, on_step, on_end, speculation)

    monkeypatch.setattr(model.model, "serve_rows", failing_once)

    class Answer(Request):
        def send(self, response, flags=0):
            answers.setdefault(self.name, []).append(response.error.message if response.error else flags)

    model.execute([Answer(f"r{i}", [], [3, 14, 15], 4) for i in range(3)])
    model.queue.join()
    assert answers["r0"] == ["generation failed: RuntimeError: out of memory"]
    assert answers["r1"] == answers["r2"] == [FINAL] and len(calls) == 2 and model.live == 0


def decoupled_model(module, ckpt):
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True},
                                                  "parameters": {"checkpoint_dir": {"string_value": str(ckpt)}}})})
    return model


def test_responses_and_cancellation_checks_leave_the_worker_thread_in_order(checkpoint, monkeypatch):
    """Each send and each is_cancelled is a round trip to Triton: the worker hands both to the outbox thread and goes
    on (a request still waiting to start is checked by the worker, every 0.1 s); a request's responses still arrive
    in order, and `queue.join()` returns once all were sent."""
    import threading

    module = load_cpu_model(monkeypatch)
    model = decoupled_model(module, checkpoint("gqa"))
    threads, log = set(), []

    class Watched(Request):
        def send(self, response, flags=0):
            threads.add(threading.current_thread().name)
            super().send(response, flags)

        def is_cancelled(self):
            if any(n == self.name for n, *_ in self.log):    # it is generating
                threads.add(threading.current_thread().name)
            return False

    model.execute([Watched("a", log, [3, 14, 15], 8, streaming=True), Watched("b", log, [9, 2], 5, streaming=True)])
    model.queue.join()
    assert threads == {model.outbox._thread.name} and model.worker.name not in threads
    for name, count in (("a", 8), ("b", 5)):
        mine = [(ids, final) for n, ids, final in log if n == name]
        assert len(mine) == count and [f for _, f in mine] == [False] * (count - 1) + [True]
    model.finalize()
    assert not model.outbox._thread.is_alive()


def test_a_request_whose_client_went_away_stops_soon_after(checkpoint, monkeypatch):
    """The outbox's cancellation check (at most every CANCEL_CHECK_S) ends a request whose client is gone: it gets
    the CANCELLED error, not its remaining tokens."""
    module = load_cpu_model(monkeypatch)
    monkeypatch.setattr(module, "CANCEL_CHECK_S", 0.0)
    model = decoupled_model(module, checkpoint("gqa"))
    log = []

    class Leaving(Request):
        def send(self, response, flags=0):
            if response.error is not None:
                self.log.append(("error", response.error.code, flags == FINAL))
            else:
                super().send(response, flags)

        def is_cancelled(self):
            return len(self.log) >= 2     # the client leaves after its second token

    model.execute([Leaving("a", log, [3, 14, 15], 200, streaming=True)])
    model.queue.join()
    assert log[-1] == ("error", "CANCELLED", True)
    assert 2 <= len(log) - 1 < 20
    model.finalize()
