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

MODEL = "tensorrt_llm"
OUTPUTS = ("text_output", "finish_reason")


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
        if "text_input" not in self.inputs:
            raise UserError(f"the `{model}` model lacks the llmapi contract's text_input input")

    def greedy(self, max_tokens: int) -> dict:
        """The sampling parameters of a greedy completion without the prompt, those the model declares."""
        params = {"sampling_param_max_tokens": max_tokens, "sampling_param_temperature": 0.0,
                  "sampling_param_top_k": 1, "sampling_param_exclude_input_from_output": True}
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
            response = self.post_generate({"text_input": text, **params})
        except requests.RequestException as exc:
            raise RequestFailed(f"generate got no response ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise RequestFailed(f"{self.base}/generate answered {response.status_code}: {response.text[:300]}")
        payload = response.json()
        if not isinstance(payload.get("text_output"), str):
            raise RequestFailed(f"generate answered without a text_output string: {response.text[:300]}")
        return {k: payload[k] for k in OUTPUTS if k in payload}

    def generate(self, prompt: str, max_tokens: int) -> str:
        return self.request(prompt, **self.greedy(max_tokens))["text_output"]

    def generate_stream(self, prompt: str, max_tokens: int, body: dict | None = None) -> StreamResult:
        """A streamed greedy request (or `body`, with `streaming` set): every server-sent event's text, timed, and
        the finish reason; as `EnsembleClient.generate_stream`, so the load test drives either contract."""
        result, answered = self._generate_stream({"text_input": prompt, **self.greedy(max_tokens), **(body or {}),
                                                  "streaming": True})
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
                    result.finish_reason = event.get("finish_reason", result.finish_reason)
                    if event.get("text_output"):  # the final response may carry no text
                        result.pieces.append(event["text_output"])
                        result.arrival.append(time.perf_counter())
        except (requests.RequestException, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result, False
        return result, True

    def stream(self, prompt: str, max_tokens: int) -> StreamResult:
        return self.generate_stream(prompt, max_tokens)


def llmapi_bad_requests(prompt: str) -> list[BadRequest]:
    """The llmapi contract's malformed requests; the sampling ones use the LLM API's SamplingParams ranges."""
    return [
        BadRequest("empty text_input", {"text_input": "", "sampling_param_max_tokens": 8}),
        BadRequest("sampling_param_max_tokens 0", {"text_input": prompt, "sampling_param_max_tokens": 0},
                   parameter="sampling_param_max_tokens"),
        BadRequest("sampling_param_max_tokens far beyond the context",
                   {"text_input": prompt, "sampling_param_max_tokens": 10_000_000}),
        BadRequest("sampling_param_max_tokens of the wrong type",
                   {"text_input": prompt, "sampling_param_max_tokens": "sixteen"}),
        BadRequest("text_input of the wrong type", {"text_input": 12345, "sampling_param_max_tokens": 8}),
        BadRequest("missing text_input", {"sampling_param_max_tokens": 8}),
        BadRequest("negative temperature", {"text_input": prompt, "sampling_param_temperature": -0.5},
                   parameter="sampling_param_temperature"),
        BadRequest("top_p 0", {"text_input": prompt, "sampling_param_top_p": 0.0}, parameter="sampling_param_top_p"),
        BadRequest("top_p above 1", {"text_input": prompt, "sampling_param_top_p": 1.5},
                   parameter="sampling_param_top_p"),
        BadRequest("negative top_k", {"text_input": prompt, "sampling_param_top_k": -1},
                   parameter="sampling_param_top_k"),
    ]
