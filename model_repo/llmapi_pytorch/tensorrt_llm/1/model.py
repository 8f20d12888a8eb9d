"""tensorrt_llm (llmapi flavour) for GPU targets: TensorRT-LLM's LLM API (PyTorch backend) serves the Hugging
Face model that `model.yaml` beside this file names, through the request contract trtpipe's config.pbtxt
declares (the same contract the cpu flavour, model_repo/llmapi, serves with the reference runtime).

trtpipe's own model, not NVIDIA's: NVIDIA's llmapi model (TensorRT-LLM triton_backend/all_models/llmapi/
tensorrt_llm/1/model.py with its helpers.py; in nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 under
/app/all_models/llmapi/tensorrt_llm/1/ per tensorrtllm_backend r26.07's Dockerfile; the image was not opened)
is the same idea; this one differs where a trtpipe repository needs it to (docs/pytorch-backend.md):
- `model` in model.yaml may be relative to this directory: deploy copies the Hugging Face model into 1/model/,
  so the repository is relocatable (NVIDIA's passes the path to LLM() as is, relative to the server's cwd);
- a streamed response carries the text its step added (NVIDIA's sends CompletionOutput.text, the text so
  far), which is what `trtpipe validate` and the cpu flavour expect;
- every request field is checked and a bad one is refused naming it, before the LLM API sees it.
A request is `text_input` with optional `sampling_param_max_tokens`, `_temperature`, `_top_k`, `_top_p`,
`_seed`, `_exclude_input_from_output` (default true), `streaming` and `return_finish_reason`; the answer is
`text_output` (and `finish_reason`). top_k 0 and top_p 1 mean no limit; temperature 0 is greedy (top_k 1).
The names and the sampling ranges are pipeline/triton_names.py's, which deploy copies beside this file.
Requests run concurrently on one asyncio loop (the LLM API batches them in flight); the model is decoupled
and unbatched by Triton (max_batch_size 0), one instance whose LLM() starts the tp x pp GPU workers itself.
Not handled: cancellation of a running request, multi-node launch (trtllm-llmapi-launch).

NOT RUN on the machine trtpipe was written on (no GPU, no TensorRT-LLM): tests/test_llmapi_gpu_model.py
checks its contract names against config.pbtxt, its model.yaml handling and its request handling with
stand-ins for triton_python_backend_utils and tensorrt_llm, not with the real ones.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied pipeline/triton_names.py wins over any installed trtpipe
from pipeline.triton_names import (  # noqa: E402
    FINISH_REASON, LLMAPI_INPUT_NAMES, LLMAPI_OUTPUT_NAMES, RETURN_FINISH_REASON,
    SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT, SAMPLING_PARAM_MAX_TOKENS, SAMPLING_PARAM_SEED, STREAMING, TEXT_INPUT,
    TEXT_OUTPUT, llmapi_sampling,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: The inputs this model reads and the outputs it writes: trtpipe's llmapi config.pbtxt declares exactly these.
INPUTS = LLMAPI_INPUT_NAMES
OUTPUTS = LLMAPI_OUTPUT_NAMES
#: LLM API SamplingParams' default max_tokens
DEFAULT_MAX_TOKENS = 32


class RequestError(ValueError):
    """A request this model refuses; the message goes back to the client."""


@dataclass(frozen=True)
class Request:
    """One parsed request: the prompt, SamplingParams keyword arguments and what the answer carries."""

    text: str
    sampling: dict
    streaming: bool = False
    exclude_input: bool = True
    finish_reason: bool = False


@dataclass
class Settings:
    """model.yaml: the LLM() arguments (`model` resolved) and its `triton_config` section."""

    llm_args: dict
    triton_config: dict = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int | None:
        value = self.llm_args.get("max_seq_len")
        return int(value) if value else None


def load_settings(directory: Path = HERE) -> Settings:
    """model.yaml of `directory`; a relative `model`, and a relative draft (`speculative_config`'s
    `speculative_model_dir`), that exists there is made absolute (else it is a hub id)."""
    path = Path(directory) / "model.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise pb_utils.TritonModelException(f"{path}: cannot read the LLM API settings ({exc})") from None
    if not isinstance(data, dict) or not data.get("model"):
        raise pb_utils.TritonModelException(f"{path}: needs a mapping with `model` (the LLM() arguments)")
    args = dict(data)
    triton_config = args.pop("triton_config", None) or {}
    args["model"] = local_path(directory, args["model"])
    draft = args.get("speculative_config")
    if isinstance(draft, dict) and draft.get("speculative_model_dir"):
        args["speculative_config"] = {**draft, "speculative_model_dir": local_path(directory,
                                                                                  draft["speculative_model_dir"])}
    return Settings(args, triton_config)


def local_path(directory: Path, name) -> str:
    """`name` made absolute when it is relative and exists in `directory`; else as it is (a hub id)."""
    local = Path(directory) / str(name)
    return str(local.resolve()) if not Path(str(name)).is_absolute() and local.exists() else name


def scalar(inputs: dict, name: str, default):
    value = inputs.get(name)
    return default if value is None else value.reshape(-1)[0].item()


def parse_request(inputs: dict, count_tokens, max_seq_len: int | None) -> Request:
    """A request's tensors (name -> numpy array) as a `Request`; RequestError naming the field that is wrong."""
    if TEXT_INPUT not in inputs:
        raise RequestError("text_input is missing")
    text = inputs[TEXT_INPUT].reshape(-1)[0]
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    if not text:
        raise RequestError("text_input is empty; send at least one token of text")
    max_tokens = int(scalar(inputs, SAMPLING_PARAM_MAX_TOKENS, DEFAULT_MAX_TOKENS))
    if max_tokens < 1:
        raise RequestError(f"sampling_param_max_tokens must be at least 1, got {max_tokens}")
    if max_seq_len is not None:
        prompt = count_tokens(text)
        if prompt + max_tokens > max_seq_len:
            raise RequestError(f"{prompt} input tokens + {max_tokens} output tokens (sampling_param_max_tokens) "
                               f"exceed max_seq_len {max_seq_len}")
    (temperature, top_k, top_p), error = llmapi_sampling(lambda name, default: scalar(inputs, name, default))
    if error:
        raise RequestError(error)
    sampling = {"max_tokens": max_tokens, "top_p": top_p}
    if temperature == 0:
        sampling["top_k"] = 1
    else:
        sampling["temperature"] = temperature
        if top_k:
            sampling["top_k"] = top_k
    seed = scalar(inputs, SAMPLING_PARAM_SEED, None)
    if seed is not None:
        sampling["seed"] = int(seed)
    return Request(text, sampling, bool(scalar(inputs, STREAMING, False)),
                   bool(scalar(inputs, SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT, True)),
                   bool(scalar(inputs, RETURN_FINISH_REASON, False)))


def response(text: str, reason: str | None):
    tensors = [pb_utils.Tensor(TEXT_OUTPUT, np.array([text.encode("utf-8")], dtype=np.object_))]
    if reason is not None:
        tensors.append(pb_utils.Tensor(FINISH_REASON, np.array([reason.encode("utf-8")], dtype=np.object_)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def error_response(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        from tensorrt_llm import LLM, SamplingParams   # here, not at import: it initializes CUDA

        self.settings = load_settings(HERE)
        self.sampling_params = SamplingParams
        self.llm = LLM(**self.settings.llm_args)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmapi-requests", daemon=True)
        self.thread.start()

    def count_tokens(self, text: str) -> int:
        return len(self.llm.tokenizer.encode(text))

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self.serve(request), self.loop)
        return None

    async def serve(self, request) -> None:
        sender = request.get_response_sender()
        try:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parsed = parse_request(inputs, self.count_tokens, self.settings.max_seq_len)
        except RequestError as exc:
            sender.send(error_response(str(exc)), flags=FINAL)
            return
        try:
            await self.generate(parsed, sender)
        except Exception as exc:  # the LLM API failed this request: the client gets the reason
            sender.send(error_response(f"generation failed: {type(exc).__name__}: {exc}"), flags=FINAL)

    async def generate(self, request: Request, sender) -> None:
        """Stream each step's new text (then a final response), or send the whole answer once."""
        params = self.sampling_params(**request.sampling)
        sent, last = 0, None
        async for output in self.llm.generate_async(request.text, params, streaming=request.streaming):
            last = output.outputs[0]
            if request.streaming and len(last.text) > sent:
                sender.send(response(last.text[sent:], None), flags=0)
                sent = len(last.text)
        reason = str(last.finish_reason) if request.finish_reason and last is not None else None
        if request.streaming:
            sender.send(response("", reason), flags=FINAL)
            return
        completion = last.text if last is not None else ""
        sender.send(response(completion if request.exclude_input else request.text + completion, reason), flags=FINAL)

    def finalize(self):
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
