"""The client side of validate: requests to the `ensemble` model as NVIDIA's clients send them.

HTTP generate / generate_stream (server-sent events) and the gRPC bidirectional stream of NVIDIA's
inflight_batcher_llm_client; every streamed request is timed per response (`StreamResult`), which the
streaming check and the load test read.

Overload: a request Triton sheds because the `tensorrt_llm` model's queue is full (max_queue_size) gets
HTTP 503 when sent to that model, but through the ensemble the same rejection comes back as 400 (the
ensemble reports its step's error in the response, and Triton's HTTP frontend answers every error it
learns from a response with 400; only errors found before the request is queued keep their status).
So the client tells overload from a bad request by status 503/429 or by Triton's message
(`is_overload`), and raises `Overloaded` / sets `StreamResult.overloaded` for it.

A generate_stream answered HTTP 200 without any event is a failed request, never an empty answer
(`generate_stream_events`, `EMPTY_STREAM`): Triton 2.51 answers so when its decoupled ensemble finished without
running a model, as for a request without text_input whose other inputs make up the required count.

Every request is tallied (`Tally`) as Triton's metrics should count it, for the metrics check.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import requests

from ..errors import UserError
from ..server import TritonServer
from ..triton_admin import NotServed, TritonAdmin
from ..triton_names import (
    BAD_WORDS,
    ENSEMBLE,
    EXCLUDE_INPUT_IN_OUTPUT,
    MAX_TOKENS,
    RETURN_PERF_METRICS,
    STOP_WORDS,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TOP_K,
    TOTAL_ACCEPTED_DRAFT_TOKENS,
    TOTAL_DRAFT_TOKENS,
)

REQUEST_TIMEOUT_S = 120.0
NUMPY_DTYPES = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
                "FP16": np.float16}
#: Triton's message when a model's queue is full (core scheduler_utils.cc, Status::Code::UNAVAILABLE)
QUEUE_FULL = "Exceeds maximum queue size"
#: Triton prefixes every error that went through the ensemble scheduler with this (ensemble_scheduler.cc
#: FinishEnsemble); errors without it were refused by the frontend and never reach the ensemble's metrics.
ENSEMBLE_ERROR = f"in ensemble '{ENSEMBLE}'"
#: the error of a generate_stream answered 200 without any event: Triton's answer when no model answered (its
#: decoupled ensemble finished without running a step, which it counts as a success; docs/upstream-facts.md §C)
EMPTY_STREAM = "generate_stream answered 200 without any event: no model answered (is text_input missing?)"


def is_overload(status: int | None, message: str) -> bool:
    """Whether an error means "the server is overloaded, retry later" rather than "this request is wrong"."""
    return status in (429, 503) or QUEUE_FULL in message


@dataclass
class Tally:
    """The requests sent so far, as the ensemble's nv_inference_request_success / _failure should count them."""

    succeeded: int = 0
    failed: int = 0        # failed inside the ensemble (bad requests the models refused, shed requests)
    refused: int = 0       # refused by Triton's frontend before the ensemble ran (not counted in its metrics)
    unanswered: int = 0    # no complete answer (timeout, dropped connection): counted either way or not yet
    #: failed where the answer does not say whether the model ran (one model, no ensemble name in its errors; a
    #: stream without any event, which Triton 2.51 counts as the ensemble's success): counted or not
    unclassified: int = 0

    def add(self, error: str | None, answered: bool = True, names_ensemble: bool = True) -> None:
        if not answered:
            self.unanswered += 1
        elif error is None:
            self.succeeded += 1
        elif not names_ensemble or error == EMPTY_STREAM:
            self.unclassified += 1
        elif ENSEMBLE_ERROR in error:
            self.failed += 1
        else:
            self.refused += 1


class TallyingClient:
    """A client that tallies its requests as the served model's request counters should count them (the metrics
    check). `model` is the model whose counters those are; `names_ensemble`: its errors tell a refusal by a model
    inside the ensemble from one by Triton's frontend."""

    model = ENSEMBLE
    names_ensemble = True

    def __init__(self):
        self.tally = Tally()
        self._tally_lock = threading.Lock()

    def count(self, error: str | None, answered: bool = True) -> None:
        with self._tally_lock:
            self.tally.add(error, answered, self.names_ensemble)


@dataclass
class StreamResult:
    """One streamed request: the text pieces, when each arrived, and the error if the request failed."""

    sent_at: float
    pieces: list[str] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False
    overloaded: bool = False  # the server shed it (queue full): retry later, the request itself is fine
    finish_reason: str | None = None  # where the contract reports one (llmapi, OpenAI): the last one sent
    #: a speculating deployment's perf metrics (the last event's: NVIDIA's totals so far), when asked for
    drafted: int | None = None
    accepted: int | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float:
        return self.arrival[0] - self.sent_at

    @property
    def latency(self) -> float:
        return self.arrival[-1] - self.sent_at

    @property
    def inter_token(self) -> list[float]:
        return list(np.diff(self.arrival)) if len(self.arrival) > 1 else []


class RequestFailed(Exception):
    pass


class Overloaded(RequestFailed):
    """The server shed the request (its queue is full)."""


class EnsembleClient(TallyingClient):
    """Talks to the `ensemble` model the way NVIDIA's clients do (HTTP generate / generate_stream, gRPC stream)."""

    streaming_fix = ("streaming needs decoupled transaction policy on tensorrt_llm (and BLS) and a postprocessing "
                     "that detokenizes each response's new tokens")

    def __init__(self, server: TritonServer, timeout: float = REQUEST_TIMEOUT_S, perf_metrics: bool = False):
        super().__init__()
        self.server = server
        self.timeout = timeout
        self.perf_metrics = perf_metrics   # ask for NVIDIA's perf metrics (a speculating deployment's draft counts)
        try:
            self.config = TritonAdmin(server.http_url).config(ENSEMBLE)
        except NotServed as missing:
            raise UserError(f"the server has no `{ENSEMBLE}` model ({missing.status}: {missing.text}); validate "
                            "needs NVIDIA's inflight_batcher_llm ensemble (text_input, max_tokens -> text_output)") \
                from None
        self.inputs = {i["name"]: i for i in self.config.get("input", [])}
        missing = {TEXT_INPUT, MAX_TOKENS} - set(self.inputs)
        if missing or TEXT_OUTPUT not in {o["name"] for o in self.config.get("output", [])}:
            raise UserError(f"the `{ENSEMBLE}` model lacks NVIDIA's client contract (needs inputs text_input, "
                            f"max_tokens and output text_output; missing {sorted(missing) or [TEXT_OUTPUT]})")

    # --- what a request looks like

    def body(self, prompt: str, max_tokens: int, stream: bool = False) -> dict:
        """The JSON of NVIDIA's generate examples, plus greedy sampling and prompt exclusion where declared."""
        body = {TEXT_INPUT: prompt, MAX_TOKENS: max_tokens, BAD_WORDS: "", STOP_WORDS: ""}
        body = {k: v for k, v in body.items() if k in self.inputs}
        if stream:
            body[STREAM] = True
        if TOP_K in self.inputs:
            body[TOP_K] = 1
        if EXCLUDE_INPUT_IN_OUTPUT in self.inputs:
            body[EXCLUDE_INPUT_IN_OUTPUT] = True
        if self.perf_metrics and RETURN_PERF_METRICS in self.inputs:
            body[RETURN_PERF_METRICS] = True
        return body

    @staticmethod
    def completion(prompt: str, text: str) -> str:
        """The generated part of a non-streamed text_output (NVIDIA's backend may echo the prompt first)."""
        return text.removeprefix(prompt)

    # --- HTTP

    def post_generate(self, body: dict) -> requests.Response:
        try:
            response = requests.post(f"{self.server.http_url}/v2/models/{ENSEMBLE}/generate", json=body,
                                     timeout=self.timeout)
        except requests.RequestException:
            self.count(None, answered=False)
            raise
        self.count(None if response.status_code == 200 else response.text)
        return response

    def generate(self, prompt: str, max_tokens: int, body: dict | None = None) -> str:
        try:
            response = self.post_generate(body or self.body(prompt, max_tokens))
        except requests.RequestException as exc:
            raise RequestFailed(f"generate got no response ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            error = Overloaded if is_overload(response.status_code, response.text) else RequestFailed
            raise error(f"generate returned {response.status_code}: {response.text.strip()[:300]}")
        text = response.json().get(TEXT_OUTPUT)
        if isinstance(text, list):
            text = "".join(text)
        if not isinstance(text, str):
            raise RequestFailed(f"generate answered without a text_output string: {response.text[:300]}")
        return self.completion(prompt, text)

    def generate_stream(self, prompt: str, max_tokens: int, body: dict | None = None) -> StreamResult:
        """POST generate_stream and read its server-sent events, timing each one."""
        result, status = self._generate_stream(body or self.body(prompt, max_tokens, stream=True))
        result.overloaded = result.error is not None and is_overload(status, result.error)
        self.count(result.error, answered=status is not None)
        return result

    def _generate_stream(self, body: dict) -> tuple[StreamResult, int | None]:
        """The streamed result and the HTTP status (None when no complete answer came)."""
        result = StreamResult(sent_at=time.perf_counter())
        url = f"{self.server.http_url}/v2/models/{ENSEMBLE}/generate_stream"
        try:
            with requests.post(url, json=body, stream=True, timeout=self.timeout) as response:
                if response.status_code != 200:
                    result.error = f"generate_stream returned {response.status_code}: {response.text.strip()[:300]}"
                    return result, response.status_code
                for event in generate_stream_events(response):
                    if "error" in event:
                        result.error = str(event["error"])
                        return result, response.status_code
                    text = event.get(TEXT_OUTPUT, "")
                    result.pieces.append("".join(text) if isinstance(text, list) else text)
                    result.arrival.append(time.perf_counter())
                    if TOTAL_DRAFT_TOKENS in event:
                        result.drafted = int(event[TOTAL_DRAFT_TOKENS])
                        result.accepted = int(event.get(TOTAL_ACCEPTED_DRAFT_TOKENS, 0))
        except (requests.RequestException, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result, None
        return result, response.status_code

    def healthy(self) -> bool:
        return self.server.is_alive() and self.server.is_healthy()

    # --- gRPC (the bidirectional stream NVIDIA's inflight_batcher_llm_client uses)

    def stream(self, prompt: str, max_tokens: int) -> StreamResult:
        """The streaming check's request: greedy, `stream` true, over the gRPC stream."""
        if STREAM not in self.inputs:
            raise RequestFailed(f"the `{ENSEMBLE}` model has no `stream` input (deploy with decoupled_mode true)")
        values = {TEXT_INPUT: prompt, MAX_TOKENS: max_tokens, STREAM: True}
        values.update({k: v for k, v in ((TOP_K, 1), (EXCLUDE_INPUT_IN_OUTPUT, True)) if k in self.inputs})
        return self.grpc_stream(values)

    def grpc_inputs(self, values: dict):
        """InferInputs with the ensemble's declared data types (with the batch dimension when it batches)."""
        import tritonclient.grpc as grpcclient

        batched = self.config.get("max_batch_size", 0) > 0
        inputs = []
        for name, value in values.items():
            dtype = self.inputs.get(name, {}).get("data_type", "TYPE_INT32").removeprefix("TYPE_")
            dtype = "BYTES" if dtype == "STRING" else dtype
            array = (np.array([str(value).encode()], dtype=np.object_) if dtype == "BYTES"
                     else np.array([value], dtype=NUMPY_DTYPES[dtype]))
            array = array.reshape(1, 1) if batched else array
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def grpc_stream(self, values: dict) -> StreamResult:
        """Send one request over a gRPC stream and collect its responses until the final one."""
        import tritonclient.grpc as grpcclient

        if not self.server.endpoints.grpc_url:
            raise RequestFailed("no gRPC endpoint known (pass --grpc-url)")
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.server.endpoints.grpc_url)
        result = StreamResult(sent_at=time.perf_counter())
        answered = False
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
            client.async_stream_infer(ENSEMBLE, self.grpc_inputs(values), request_id="validate",
                                      enable_empty_final_response=True)
            deadline = time.monotonic() + self.timeout
            while True:
                res, err, at = events.get(timeout=max(0.1, deadline - time.monotonic()))
                if err is not None:
                    result.error, answered = str(err), True
                    break
                text = res.as_numpy(TEXT_OUTPUT)
                if text is not None and text.size:
                    result.pieces.append("".join(t.decode("utf-8", "replace") for t in text.reshape(-1)))
                    result.arrival.append(at)
                if res.get_response().parameters["triton_final_response"].bool_param:
                    answered = True
                    break
        except queue.Empty:
            result.error = f"no final response within {self.timeout:.0f} s"
            result.timed_out = True
        except Exception as exc:  # noqa: BLE001  (grpc raises many types; all mean "the request failed")
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()
        result.overloaded = result.error is not None and is_overload(None, result.error)
        self.count(result.error, answered)
        return result


def generate_stream_events(response) -> Iterator[dict]:
    """The JSON events of a Triton generate_stream answer: its server-sent `data:` lines. A stream without any reads
    as one error event (`EMPTY_STREAM`): a failed request, never an empty answer."""
    empty = True
    for line in response.iter_lines():
        if line.startswith(b"data:"):
            empty = False
            yield json.loads(line[5:])
    if empty:
        yield {"error": EMPTY_STREAM}
