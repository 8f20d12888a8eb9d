"""The llmapi request contract: a client for Triton's `llmapi` `tensorrt_llm` model (NVIDIA's
triton_backend/all_models/llmapi; trtpipe's `pytorch` and `reference-llmapi` backends), and its bad requests.

The contract differs from the engine ensemble's: the request is `text_input` plus `sampling_param_*`
(`sampling_param_max_tokens`, not `max_tokens`) sent to /v2/models/tensorrt_llm/generate, streaming is
asked with `streaming` (not `stream`) on generate_stream, and the answer is `text_output` (with
`finish_reason` when `return_finish_reason` is set). validate runs golden, streaming (HTTP server-sent
events) and bad_requests (`llmapi_bad_requests`) on it through `LlmapiClient`.
"""

from __future__ import annotations

import time

import requests

from ..errors import UserError
from .checks import BadRequest
from .client import REQUEST_TIMEOUT_S, RequestFailed, StreamResult, TallyingClient, generate_stream_events
from ..triton_admin import NotServed, TritonAdmin
from ..triton_names import (
    FINISH_REASON,
    LLMAPI_OUTPUT_NAMES,
    SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT,
    SAMPLING_PARAM_MAX_TOKENS,
    SAMPLING_PARAM_TEMPERATURE,
    SAMPLING_PARAM_TOP_K,
    SAMPLING_PARAM_TOP_P,
    STREAMING,
    TENSORRT_LLM,
    TEXT_INPUT,
    TEXT_OUTPUT,
)

MODEL = TENSORRT_LLM
OUTPUTS = LLMAPI_OUTPUT_NAMES


class LlmapiClient(TallyingClient):
    """Requests to the llmapi model over Triton's HTTP generate extension, tallied for the metrics check (the
    `tensorrt_llm` model's counters; one model, so a failure may or may not have reached it)."""

    model = MODEL
    names_ensemble = False

    streaming_fix = ("the tensorrt_llm model must be decoupled (model.yaml triton_config decoupled: true) and send "
                     "one response per new piece of text when `streaming` is true")

    def __init__(self, http_url: str, model: str = MODEL, timeout: float = REQUEST_TIMEOUT_S):
        super().__init__()
        self.model = model
        self.http_url = http_url.rstrip("/")
        self.base = f"{self.http_url}/v2/models/{model}"
        self.timeout = timeout
        try:
            config = TritonAdmin(self.http_url).config(model)
        except NotServed as missing:
            raise UserError(f"the server has no `{model}` model ({missing.status}: {missing.text}); an llmapi "
                            "repository serves one tensorrt_llm model (text_input -> text_output)") from None
        self.inputs = {i["name"]: i for i in config.get("input", [])}
        if TEXT_INPUT not in self.inputs:
            raise UserError(f"the `{model}` model lacks the llmapi contract's text_input input")

    def greedy(self, max_tokens: int) -> dict:
        """The sampling parameters of a greedy completion without the prompt, those the model declares."""
        params = {SAMPLING_PARAM_MAX_TOKENS: max_tokens, SAMPLING_PARAM_TEMPERATURE: 0.0,
                  SAMPLING_PARAM_TOP_K: 1, SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT: True}
        return {k: v for k, v in params.items() if k in self.inputs}

    def post_generate(self, body: dict) -> requests.Response:
        try:
            response = requests.post(f"{self.base}/generate", json=body, timeout=self.timeout)
        except requests.RequestException:
            self.count(None, answered=False)
            raise
        self.count(None if response.status_code == 200 else response.text)
        return response

    def healthy(self) -> bool:
        return requests.get(f"{self.http_url}/v2/health/ready", timeout=30).status_code == 200

    def request(self, text: str, **params) -> dict:
        """One response: {"text_output": ..., ["finish_reason": ...]}; RequestFailed with Triton's message."""
        try:
            response = self.post_generate({TEXT_INPUT: text, **params})
        except requests.RequestException as exc:
            raise RequestFailed(f"generate got no response ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise RequestFailed(f"{self.base}/generate answered {response.status_code}: {response.text[:300]}")
        payload = response.json()
        if not isinstance(payload.get(TEXT_OUTPUT), str):
            raise RequestFailed(f"generate answered without a text_output string: {response.text[:300]}")
        return {k: payload[k] for k in OUTPUTS if k in payload}

    def generate(self, prompt: str, max_tokens: int) -> str:
        return self.request(prompt, **self.greedy(max_tokens))[TEXT_OUTPUT]

    def generate_stream(self, prompt: str, max_tokens: int, body: dict | None = None) -> StreamResult:
        """A streamed greedy request (or `body`, with `streaming` set): every server-sent event's text, timed, and
        the finish reason; as `EnsembleClient.generate_stream`, so the load test drives either contract."""
        result, answered = self._generate_stream({TEXT_INPUT: prompt, **self.greedy(max_tokens), **(body or {}),
                                                  STREAMING: True})
        self.count(result.error, answered)
        return result

    def _generate_stream(self, body: dict) -> tuple[StreamResult, bool]:
        """The streamed result and whether a complete answer came."""
        result = StreamResult(sent_at=time.perf_counter())
        try:
            with requests.post(f"{self.base}/generate_stream", json=body, timeout=self.timeout,
                               stream=True) as response:
                if response.status_code != 200:
                    result.error = f"generate_stream answered {response.status_code}: {response.text[:300]}"
                    return result, True
                for event in generate_stream_events(response):
                    if "error" in event:
                        result.error = str(event["error"])
                        return result, True
                    result.finish_reason = event.get(FINISH_REASON, result.finish_reason)
                    if event.get(TEXT_OUTPUT):  # the final response may carry no text
                        result.pieces.append(event[TEXT_OUTPUT])
                        result.arrival.append(time.perf_counter())
        except (requests.RequestException, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result, False
        return result, True

    def stream(self, prompt: str, max_tokens: int) -> StreamResult:
        return self.generate_stream(prompt, max_tokens)


def llmapi_bad_requests(prompt: str) -> list[BadRequest]:
    """The llmapi contract's malformed requests; the sampling ones use the LLM API's SamplingParams ranges."""
    max_tokens = SAMPLING_PARAM_MAX_TOKENS
    return [
        BadRequest("empty text_input", {TEXT_INPUT: "", max_tokens: 8}),
        BadRequest("sampling_param_max_tokens 0", {TEXT_INPUT: prompt, max_tokens: 0}, parameter=max_tokens),
        BadRequest("sampling_param_max_tokens far beyond the context", {TEXT_INPUT: prompt, max_tokens: 10_000_000}),
        BadRequest("sampling_param_max_tokens of the wrong type", {TEXT_INPUT: prompt, max_tokens: "sixteen"}),
        BadRequest("text_input of the wrong type", {TEXT_INPUT: 12345, max_tokens: 8}),
        BadRequest("missing text_input", {max_tokens: 8}),
        BadRequest("negative temperature", {TEXT_INPUT: prompt, SAMPLING_PARAM_TEMPERATURE: -0.5},
                   parameter=SAMPLING_PARAM_TEMPERATURE),
        BadRequest("top_p 0", {TEXT_INPUT: prompt, SAMPLING_PARAM_TOP_P: 0.0}, parameter=SAMPLING_PARAM_TOP_P),
        BadRequest("top_p above 1", {TEXT_INPUT: prompt, SAMPLING_PARAM_TOP_P: 1.5}, parameter=SAMPLING_PARAM_TOP_P),
        BadRequest("negative top_k", {TEXT_INPUT: prompt, SAMPLING_PARAM_TOP_K: -1}, parameter=SAMPLING_PARAM_TOP_K),
    ]
