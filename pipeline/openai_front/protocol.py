"""The OpenAI request and response bodies of the front, as plain functions (no I/O).

A request is read once into a `GenerationRequest`: every field the front honours is checked against the OpenAI
API's types and ranges and mapped onto the engine-era ensemble contract the way Triton's OpenAI frontend maps it
(server `python/openai/openai_frontend/engine/utils/triton.py` `_create_trtllm_generate_request` @ e1db8a60:
text_input, max_tokens, stream, stop -> stop_words, top_p, frequency_penalty, presence_penalty, seed, temperature,
echo -> exclude_input_in_output, return_num_input_tokens / return_num_output_tokens for `usage`). A field the
front cannot honour is refused with an OpenAI error object, never dropped: `n`/`best_of` above 1 (one sequence per
request), `logprobs` (the deployment's output_log_probs are not the model's), `logit_bias`, `suffix`, tools without
a tool-call parser, a `response_format` nobody would enforce, and any field the API has that this list lacks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..triton_names import (EXCLUDE_INPUT_IN_OUTPUT, FREQUENCY_PENALTY, MAX_TOKENS, MIN_TOKENS, NUM_DRAFT_TOKENS,
                            PRESENCE_PENALTY,
                            RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS, SEED, STOP_WORDS, STREAM, TEMPERATURE,
                            TEXT_INPUT, TOP_P)

#: Triton's OpenAI frontend: max_tokens when a request sets none (main.py `--default-max-tokens`, default 16)
DEFAULT_MAX_TOKENS = 16
#: Triton's OpenAI frontend listens here unless told otherwise (main.py `--openai-port`, default 9000)
DEFAULT_OPENAI_PORT = 9000
#: the OpenAI API's limit on `stop` sequences
MAX_STOP_SEQUENCES = 4
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: roles a chat message may have here (a `tool` message needs a tool-call parser, which the front has not)
CHAT_ROLES = ("system", "developer", "user", "assistant")

#: fields honoured by both endpoints (`user` is the caller's identifier: recorded by nobody, changes nothing;
#: `min_tokens` is vLLM's extension of the API, which load generators send to pin the output length: the ensemble's
#: input of the same name)
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
                           "frequency_penalty", "presence_penalty", "user", "min_tokens"})
ENDPOINT_FIELDS = {COMPLETIONS: frozenset({"prompt", "echo"}),
                   CHAT: frozenset({"messages", "max_completion_tokens"})}
#: fields accepted only at the value that asks for nothing, and why anything else is refused
NEUTRAL_FIELDS: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "this deployment returns one choice per request (no beams, one returned sequence)"),
    "best_of": ((None, 1), "this deployment returns one choice per request (no beams, one returned sequence)"),
    "logprobs": ((None, False, 0), "this deployment returns no log probabilities"),
    "top_logprobs": ((None, 0), "this deployment returns no log probabilities"),
    "logit_bias": ((None, {}), "logit_bias is not supported by this deployment"),
    "suffix": ((None, ""), "suffix (text insertion) is not supported"),
    "tools": ((None, []), "tool calls need a tool-call parser, and this server has none"),
    "tool_choice": ((None, "none"), "tool calls need a tool-call parser, and this server has none"),
    "parallel_tool_calls": ((None,), "tool calls need a tool-call parser, and this server has none"),
    "response_format": ((None, {"type": "text"}), "it would not be enforced: this deployment has no "
                        "guided-decoding backend"),
}


class OpenAIError(Exception):
    """A refused request, answered as the OpenAI API answers errors: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    @property
    def kind(self) -> str:
        return {404: "not_found_error", 503: "service_unavailable"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServedModel:
    """A model of the repository that takes the ensemble contract (text_input, max_tokens -> text_output), with
    the inputs its config declares: a field whose input it lacks is refused."""

    name: str
    inputs: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))
    #: draft-target through the BLS: the num_draft_tokens every request to this model carries (None: none)
    drafts: int | None = None
    #: why the deployment does not stream (its models are not decoupled), else None
    unstreamed: str | None = None


@dataclass
class GenerationRequest:
    """One OpenAI request, checked, as the ensemble request it becomes."""

    endpoint: str
    model: str
    prompt: str
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    stop: tuple[str, ...] = ()
    drafts: int | None = None      # num_draft_tokens (the served model's)
    sampling: dict = field(default_factory=dict)  # ensemble input -> value, only the ones the request set
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT

    def ensemble_body(self) -> dict:
        """The JSON of Triton's generate / generate_stream for the ensemble."""
        body = {TEXT_INPUT: self.prompt, MAX_TOKENS: self.max_tokens, EXCLUDE_INPUT_IN_OUTPUT: not self.echo,
                RETURN_NUM_INPUT_TOKENS: True, RETURN_NUM_OUTPUT_TOKENS: True, **self.sampling}
        if self.stop:
            body[STOP_WORDS] = list(self.stop)
        if self.stream:
            body[STREAM] = True
        if self.drafts:
            body[NUM_DRAFT_TOKENS] = self.drafts
        return body


def parse_request(endpoint: str, body: object, models: dict[str, ServedModel],
                  render_chat: Callable[[list[dict]], str], default_max_tokens: int = DEFAULT_MAX_TOKENS
                  ) -> GenerationRequest:
    """`body` of a POST to `endpoint` read into a GenerationRequest; OpenAIError for anything refused.
    `render_chat` turns checked messages into the prompt (the tokenizer's chat template, applied once here)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    refuse_unhonoured(endpoint, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("`model` is required (a name /v1/models lists)", param="model")
    if model not in models:
        raise OpenAIError(f"the model `{model}` does not exist; this server serves {sorted(models)}", status=404,
                          param="model", code="model_not_found")
    served = models[model]
    stream = flag(body, "stream")
    if stream and served.unstreamed:
        raise OpenAIError(f"`stream` true: {served.unstreamed}; send the request without it", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise OpenAIError("`stream_options` can only be used when `stream` is true", param="stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise OpenAIError("`stream_options` takes only `include_usage` here", param="stream_options")
    if endpoint == CHAT:
        prompt = render_chat(chat_messages(body.get("messages")))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        limit_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        prompt = completion_prompt(body.get("prompt"))
        limit, limit_name = body.get("max_tokens"), "max_tokens"
    request = GenerationRequest(
        endpoint=endpoint, model=model, prompt=prompt,
        max_tokens=default_max_tokens if limit is None else positive_int(limit, limit_name), stream=stream,
        include_usage=flag(options or {}, "include_usage"), echo=flag(body, "echo"), stop=stop_sequences(body),
        sampling=sampling_inputs(body), drafts=served.drafts)
    if request.chat:
        request.id = f"chatcmpl-{uuid.uuid4().hex}"
    missing = [name for name in (*request.sampling, *([STOP_WORDS] if request.stop else [])) if
               name not in served.inputs]
    if missing:
        raise OpenAIError(f"the model `{model}` does not take {missing}: it would not honour them", param=missing[0])
    return request


def refuse_unhonoured(endpoint: str, body: dict) -> None:
    """Refuse a field at a value this server would not honour, or a field it does not know."""
    for name, (neutral, reason) in NEUTRAL_FIELDS.items():
        if name in body and body[name] not in neutral:
            raise OpenAIError(f"`{name}` = {body[name]!r} is not supported: {reason}", param=name)
    known = COMMON_FIELDS | ENDPOINT_FIELDS[endpoint] | NEUTRAL_FIELDS.keys()
    unknown = sorted(set(body) - known)
    if unknown:
        raise OpenAIError(f"unsupported field(s) {unknown} on {endpoint}: this server would not honour them",
                          param=unknown[0])


def completion_prompt(prompt: object) -> str:
    """Triton's frontend takes one non-empty string prompt (no lists, no token ids)."""
    if prompt is None:
        raise OpenAIError("`prompt` is required", param="prompt")
    if not isinstance(prompt, str):
        raise OpenAIError("`prompt` must be one string here (no lists of prompts, no token ids)", param="prompt")
    if not prompt:
        raise OpenAIError("`prompt` must be non-empty", param="prompt")
    return prompt


def chat_messages(messages: object) -> list[dict]:
    """The messages as {role, content} with text content (a list of text parts is joined)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("`messages` must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise OpenAIError(f"messages[{i}] must be an object whose role is one of {list(CHAT_ROLES)} (a tool "
                              "message needs a tool-call parser, which this server has not)", param="messages")
        if set(message) - {"role", "content", "name"}:
            raise OpenAIError(f"messages[{i}] has {sorted(set(message) - {'role', 'content', 'name'})}: only role, "
                              "content and name are supported", param="messages")
        out.append({"role": message["role"], "content": message_text(message.get("content"), i)})
    return out


def message_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(f"messages[{index}].content must be a string or a list of text parts (this model reads text "
                      "only)", param="messages")


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"`{name}` must be a boolean, got {value!r}", param=name)
    return value


def positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"`{name}` must be an integer, got {value!r}", param=name)
    if value < 1:
        raise OpenAIError(f"`{name}` must be at least 1, got {value}", param=name)
    return value


def number_in(body: dict, name: str, low: float, high: float) -> float | None:
    """The OpenAI API's range of a sampling number, inclusive."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIError(f"`{name}` must be a number, got {value!r}", param=name)
    if not low <= value <= high:
        raise OpenAIError(f"`{name}` must be between {low:g} and {high:g}, got {value}", param=name)
    return float(value)


def sampling_inputs(body: dict) -> dict:
    """The ensemble inputs of the sampling fields the request set (the API's ranges; the model checks its own)."""
    out = {}
    for name, ensemble_input, low, high in (("temperature", TEMPERATURE, 0.0, 2.0), ("top_p", TOP_P, 0.0, 1.0),
                                            ("frequency_penalty", FREQUENCY_PENALTY, -2.0, 2.0),
                                            ("presence_penalty", PRESENCE_PENALTY, -2.0, 2.0)):
        value = number_in(body, name, low, high)
        if value is not None:
            out[ensemble_input] = value
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise OpenAIError(f"`seed` must be a non-negative integer, got {seed!r}", param="seed")
        out[SEED] = seed
    least = body.get("min_tokens")
    if least is not None:
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise OpenAIError(f"`min_tokens` must be a non-negative integer, got {least!r}", param="min_tokens")
        out[MIN_TOKENS] = least
    return out


def stop_sequences(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError("`stop` must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise OpenAIError(f"`stop` takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", param="stop")
    return tuple(stops)


# ------------------------------------------------------------------------------------------- the answers


class StopScanner:
    """OpenAI's `stop`: the text ends before the first stop sequence, which is not returned. Streamed pieces are
    held back while they could be the start of one (the ensemble's own stop_words end generation only where a
    stop word's tokens match the generated tokens exactly)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, piece: str) -> str:
        """The text that can be sent now; `stopped` is set once a stop sequence appeared."""
        if not self.stops:
            return piece
        self.held += piece
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.held = self.held[:cut], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def finish_reason(stopped: bool, output_tokens: int | None, max_tokens: int) -> str:
    """"stop" for a stop sequence or the end token, "length" when max_tokens ran out."""
    return "length" if not stopped and output_tokens is not None and output_tokens >= max_tokens else "stop"


def usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict | None:
    if prompt_tokens is None or completion_tokens is None:
        return None
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(request: GenerationRequest, text: str, finish: str, used: dict | None) -> dict:
    """A non-streamed completion or chat completion."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": finish} if request.chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": request.id, "object": "chat.completion" if request.chat else "text_completion",
            "created": request.created, "model": request.model, "choices": [choice], "usage": used}


def chunk_body(request: GenerationRequest, text: str | None, finish: str | None = None, *, first: bool = False,
               used: dict | None = None) -> dict:
    """One streamed chunk; `text` None with `used` is the last chunk that carries only the usage (no choices)."""
    if request.chat:
        delta = ({"role": "assistant", "content": text or ""} if first else
                 {} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    body = {"id": request.id, "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": request.created, "model": request.model, "choices": choices}
    if used is not None:
        body["choices"], body["usage"] = [], used
    elif request.include_usage:
        body["usage"] = None
    return body
