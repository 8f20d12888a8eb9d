"""tensorrt_llm (llmapi flavour) for the cpu target: the request contract of NVIDIA's Triton llmapi model,
served by trtpipe's reference runtime.

A request is `text_input` with optional `sampling_param_max_tokens`, `_temperature`, `_top_k`, `_top_p`,
`_seed`, `_exclude_input_from_output`, `streaming` and `return_finish_reason`; the answer is `text_output`
(and `finish_reason`: "length" or "stop"). Streaming sends one response per new token with the text that
token adds, then a final response. `model.yaml` beside this file holds the LLM() arguments (`model`: the
checkpoint directory, `max_seq_len`); the tokenizer is in `tokenizer/`, the runtime in `pipeline/` (with
pipeline/triton_names.py: the contract's names and the sampling ranges).
Sampling follows the LLM API's SamplingParams: top_k 0 / top_p 1 mean no limit, temperature 0 is greedy.
The model is decoupled, unbatched by Triton (max_batch_size 0): each request is generated on its own.
"""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied runtime package (pipeline/) wins over any installed trtpipe
from pipeline.runtime import ReferenceModel  # noqa: E402
from pipeline.runtime.sampling import trtllm_sampling  # noqa: E402
from pipeline.triton_names import (  # noqa: E402
    FINISH_REASON, RETURN_FINISH_REASON, SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT, SAMPLING_PARAM_MAX_TOKENS,
    SAMPLING_PARAM_SEED, STREAMING, TEXT_INPUT, TEXT_OUTPUT, llmapi_sampling,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: LLM API SamplingParams' default max_tokens
DEFAULT_MAX_TOKENS = 32


class RequestError(ValueError):
    """A request this model refuses; the message goes back to the client."""


def scalar(inputs: dict, name: str, default):
    value = inputs.get(name)
    return default if value is None else value.reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        settings = yaml.safe_load((HERE / "model.yaml").read_text())
        self.model = ReferenceModel.load(HERE / settings["model"])
        self.max_seq_len = min(int(settings.get("max_seq_len") or self.model.max_position_embeddings),
                               self.model.max_position_embeddings)
        self.tokenizer = AutoTokenizer.from_pretrained(HERE / "tokenizer")

    def parse(self, request) -> tuple:
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        text = inputs[TEXT_INPUT].reshape(-1)[0]
        text = text.decode() if isinstance(text, bytes) else str(text)
        prompt = self.tokenizer.encode(text)
        if not prompt:
            raise RequestError("text_input is empty; send at least one token of text")
        max_tokens = int(scalar(inputs, SAMPLING_PARAM_MAX_TOKENS, DEFAULT_MAX_TOKENS))
        if max_tokens < 1:
            raise RequestError(f"sampling_param_max_tokens must be at least 1, got {max_tokens}")
        if len(prompt) + max_tokens > self.max_seq_len:
            raise RequestError(f"{len(prompt)} input tokens + {max_tokens} output tokens exceed max_seq_len "
                               f"{self.max_seq_len}")
        (temperature, top_k, top_p), error = llmapi_sampling(lambda name, default: scalar(inputs, name, default))
        if error:
            raise RequestError(error)
        sampling = trtllm_sampling(top_k, top_p, temperature, max_new_tokens=max_tokens,
                                   end_id=self.tokenizer.eos_token_id,
                                   seed=scalar(inputs, SAMPLING_PARAM_SEED, None))
        options = {"stream": bool(scalar(inputs, STREAMING, False)),
                   "exclude_input": bool(scalar(inputs, SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT, True)),
                   "finish_reason": bool(scalar(inputs, RETURN_FINISH_REASON, False))}
        return text, prompt, sampling, options

    def respond(self, sender, text: str, reason: str | None, final: bool) -> None:
        tensors = [pb_utils.Tensor(TEXT_OUTPUT, np.array([text.encode()], dtype=np.object_))]
        if reason is not None:
            tensors.append(pb_utils.Tensor(FINISH_REASON, np.array([reason.encode()], dtype=np.object_)))
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)

    def generate(self, request) -> None:
        sender = request.get_response_sender()
        try:
            text, prompt, sampling, options = self.parse(request)
        except RequestError as exc:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                        flags=FINAL)
            return
        tokens: list = []
        sent = [""]  # the decoded text already streamed

        def on_token(_row: int, token: int) -> None:
            tokens.append(token)
            if options["stream"]:
                decoded = self.tokenizer.decode(tokens, skip_special_tokens=True)
                self.respond(sender, decoded[len(sent[0]):], None, final=False)
                sent[0] = decoded

        try:
            self.model.generate([prompt], [sampling], on_token=on_token)
        except Exception as exc:  # the runtime failed: the client gets the reason
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                f"generation failed: {type(exc).__name__}: {exc}")), flags=FINAL)
            return
        reason = "length" if len(tokens) >= sampling.max_new_tokens else "stop"
        completion = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if options["stream"]:
            self.respond(sender, "", reason if options["finish_reason"] else None, final=True)
        else:
            output = completion if options["exclude_input"] else text + completion
            self.respond(sender, output, reason if options["finish_reason"] else None, final=True)

    def execute(self, requests):
        for request in requests:
            self.generate(request)
        return None
