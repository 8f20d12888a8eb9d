"""The llmapi request contract: a client for Triton's `llmapi` `tensorrt_llm` model (NVIDIA's
triton_backend/all_models/llmapi; trtpipe's `pytorch` and `reference-llmapi` backends).

The contract differs from the engine ensemble's: the request is `text_input` plus `sampling_param_*`
(`sampling_param_max_tokens`, not `max_tokens`) sent to /v2/models/tensorrt_llm/generate, streaming is
asked with `streaming` (not `stream`) on generate_stream, and the answer is `text_output` (with
`finish_reason` when `return_finish_reason` is set).
"""

from __future__ import annotations

import json

import requests

from ..errors import UserError

MODEL = "tensorrt_llm"
REQUEST_TIMEOUT_S = 120.0


class LlmapiClient:
    """Requests to the llmapi model over Triton's HTTP generate extension."""

    def __init__(self, http_url: str, model: str = MODEL, timeout: float = REQUEST_TIMEOUT_S):
        self.base = f"{http_url.rstrip('/')}/v2/models/{model}"
        self.timeout = timeout

    def generate(self, text: str, **params) -> dict:
        """One response: {"text_output": ..., ["finish_reason": ...]}; UserError with Triton's message."""
        response = requests.post(f"{self.base}/generate", json={"text_input": text, **params}, timeout=self.timeout)
        if response.status_code != 200:
            raise UserError(f"{self.base}/generate answered {response.status_code}: {response.text}")
        return _outputs(response.json())

    def generate_stream(self, text: str, **params) -> list[dict]:
        """Every server-sent event of a streamed request (`streaming` true), in order."""
        body = {"text_input": text, "streaming": True, **params}
        with requests.post(f"{self.base}/generate_stream", json=body, timeout=self.timeout, stream=True) as response:
            if response.status_code != 200:
                raise UserError(f"{self.base}/generate_stream answered {response.status_code}: {response.text}")
            events = []
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise UserError(f"{self.base}/generate_stream: {event['error']}")
                events.append(_outputs(event))
        return events


def _outputs(payload: dict) -> dict:
    """The contract's outputs of one response (Triton adds model_name, model_version, ...)."""
    return {k: payload[k] for k in ("text_output", "finish_reason") if k in payload}
