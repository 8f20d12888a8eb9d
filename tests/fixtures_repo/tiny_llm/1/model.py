"""tiny_llm: a decoupled Python-backend stand-in for an LLM, for trtpipe's server and validate tests.

It "generates" by cycling through the prompt's words in reverse order, one word per token, and steps
every request of a batch together (one sleep of `seconds_per_step` per step), like in-flight batching.
Parameters `validate_inputs: "false"` (accept empty prompts, any max_tokens and any sampling values) and
`stream_mode: "bulk"` (one response even when streaming) make the broken variants the validate tests must
catch.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: The sampling inputs' valid ranges (TensorRT-LLM's), checked like the cpu target's tensorrt_llm model does.
SAMPLING_RANGES = {"top_k": (lambda v: v >= 0, ">= 0"), "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
                   "temperature": (lambda v: v >= 0, ">= 0")}


def reverse_echo(prompt: str, max_tokens: int) -> list[str]:
    """The tokens tiny_llm produces for a prompt: its words in reverse order, cycled, each with a leading space."""
    words = prompt.split()[::-1]
    return [" " + words[i % len(words)] for i in range(max_tokens)]


def scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def text_tensor(text: str):
    return pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))


class Job:
    """One request in flight: its sender, tokens still to send and how to send them."""

    def __init__(self, request, context_words: int, validate_inputs: bool, bulk_stream: bool):
        self.sender = request.get_response_sender()
        prompt = scalar(request, "text_input", "")
        max_tokens = int(scalar(request, "max_tokens", 0))
        if validate_inputs:
            self.validate(prompt, max_tokens, context_words)
            for name, (valid, allowed) in SAMPLING_RANGES.items():
                value = scalar(request, name)
                if value is not None and not valid(value):
                    raise ValueError(f"{name} must be {allowed}, got {value:g}")
        else:  # the broken variant silently clamps what it should reject
            max_tokens = max(1, min(max_tokens, context_words))
        self.stream = bool(scalar(request, "stream", False)) and not bulk_stream
        self.prefix = "" if scalar(request, "exclude_input_in_output", False) else prompt
        self.tokens = reverse_echo(prompt, max_tokens) if prompt.strip() else [""]
        self.sent = 0

    @staticmethod
    def validate(prompt: str, max_tokens: int, context_words: int) -> None:
        if not prompt.strip():
            raise ValueError("text_input is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt.split()) + max_tokens > context_words:
            raise ValueError(f"prompt plus max_tokens ({len(prompt.split())} + {max_tokens}) exceeds the "
                             f"context of {context_words} words")

    def step(self) -> bool:
        """Produce the next token; True when this request is finished."""
        self.sent += 1
        done = self.sent == len(self.tokens)
        if self.stream:
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if done else 0
            self.sender.send(pb_utils.InferenceResponse([text_tensor(self.tokens[self.sent - 1])]), flags=flags)
        elif done:
            self.sender.send(pb_utils.InferenceResponse([text_tensor(self.prefix + "".join(self.tokens))]),
                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return done


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.context_words = int(params["context_words"]["string_value"])
        self.seconds_per_step = float(params["seconds_per_step"]["string_value"])
        # switches for the validate tests' broken variants of this repository
        self.validate_inputs = params.get("validate_inputs", {}).get("string_value", "true") == "true"
        self.bulk_stream = params.get("stream_mode", {}).get("string_value", "incremental") == "bulk"

    def execute(self, requests):
        jobs = []
        for request in requests:
            try:
                jobs.append(Job(request, self.context_words, self.validate_inputs, self.bulk_stream))
            except ValueError as exc:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        while jobs:
            time.sleep(self.seconds_per_step)
            jobs = [job for job in jobs if not job.step()]
        return None
