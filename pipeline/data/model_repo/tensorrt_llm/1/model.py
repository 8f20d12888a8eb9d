"""tensorrt_llm for the cpu target: NVIDIA's tensorrt_llm tensor contract, served by trtpipe's reference runtime.

The model runs the TensorRT-LLM checkpoint in `checkpoint/` (beside this file) with `pipeline.runtime`,
copied into this directory by `trtpipe deploy`, so the server's Python needs torch, safetensors and
numpy but not trtpipe. With the parameter `runtime` = onnxruntime (backend reference-onnx) it runs the
checkpoint's ONNX export in `onnx/` with ONNX Runtime (`pipeline.onnx.runner.OrtDecoder`, also copied;
onnxruntime is then needed too); the generation loop and sampling are the same (pipeline/runtime/generate.py).
Every request Triton's dynamic batcher hands to one `execute` call is generated
together (the rows of all requests share batched decode steps). In decoupled mode a streaming request
gets one response per new token, the last one flagged final; otherwise one response holds the prompt
and the completion (the completion alone with exclude_input_in_output), as NVIDIA's backend does. In
decoupled mode a request is answered as soon as its own rows are done, while the rest of the batch goes on.
min_tokens is honoured as TensorRT-LLM does it (the end id is masked until the output is that long).
Features the reference runtime cannot honour (beam search, penalties, bad words, embedding bias, log
probs, logits) are refused per request with a clear error instead of being ignored, and so are sampling
values outside the ranges TensorRT-LLM's executor accepts (`SAMPLING_RANGES`). torch computes with one core
fewer than the process may use (`intra_op_threads`).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied runtime package (pipeline/) wins over any installed trtpipe
from pipeline.runtime import ReferenceModel, SamplingConfig  # noqa: E402
from pipeline.runtime.sampling import trtllm_sampling  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: Per-request inputs the reference runtime cannot honour, with the value that means "not used".
UNSUPPORTED_UNLESS = {"beam_width": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0, "return_log_probs": False,
                      "return_context_logits": False, "return_generation_logits": False}


#: Sampling inputs and their valid ranges, as TensorRT-LLM's executor checks them (SamplingConfig::checkTopK,
#: checkTopP, checkTemperature): tensor name -> (the ensemble's name for it, test, the range in words).
SAMPLING_RANGES = {
    "runtime_top_k": ("top_k", lambda v: v >= 0, ">= 0 (0: no top-k limit)"),
    # NVIDIA's backend resets a top_p <= 0 to unset before the executor sees it (utils.cc@c2e65b8:558-563)
    "runtime_top_p": ("top_p", lambda v: v <= 1, "<= 1 (<= 0: unset)"),
    "temperature": ("temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    "min_tokens": ("min_tokens", lambda v: v >= 0, ">= 0"),   # checkMinTokens
}


class RequestError(ValueError):
    """A request this model refuses; the message goes back to the client."""


#: Request parameters a request may carry. Triton's generate endpoint turns every JSON field that names no input
#: into a request parameter and the ensemble forwards them to this model (checked on Triton 2.51): the
#: endpoint's own (`id`, the sequence fields, `priority`, `timeout`) and NVIDIA's `request_type`
#: (utils.cc@c2e65b8:331-351). Any other is a field the deployment does not know (a misspelt `tmperature`), and is
#: refused instead of being dropped with a 200.
KNOWN_REQUEST_PARAMETERS = {"id", "sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                            "request_type"}
#: The only request_type the reference runtime serves: context and generation in one request (NVIDIA's default).
REQUEST_TYPE = "context_and_generation"


def check_request_parameters(request) -> None:
    params = json.loads(request.parameters() or "{}")
    unknown = sorted(set(params) - KNOWN_REQUEST_PARAMETERS)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}: the deployment has no input or parameter of that "
                           "name (check the spelling against the ensemble's inputs)")
    if params.get("request_type", REQUEST_TYPE) != REQUEST_TYPE:
        raise RequestError(f"request_type {params['request_type']!r} is not supported by the cpu target's reference "
                           f"runtime (only {REQUEST_TYPE}: no disaggregated context/generation)")


def intra_op_threads(config: dict) -> int:
    """The runtime's threads for one step (torch's, or ONNX Runtime's intra-op pool: both runtimes alike): the
    parameter `intra_op_threads`, else every core this process may use but one. That core is for Triton's
    frontend, the pre/postprocessing models and clients on the same machine: when all cores compute, one
    preempted thread stalls every parallel region (docs/aiperf.md measured a SmolLM2 decode step 3-15x slower
    with 2 threads than with 1 on a busy 2-core machine)."""
    value = int(parameter(config, "intra_op_threads", "0"))
    return value if value > 0 else max(1, len(os.sched_getaffinity(0)) - 1)


def parameter(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if not value or value.startswith("${") else value


def tensors_of(request) -> dict:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def stop_sequences(words_list) -> list:
    """[2, N] (flat ids, cumulative end offsets padded with -1) -> token-id sequences."""
    ids, ends = words_list
    sequences, start = [], 0
    for end in ends:
        if end < 0:
            break
        if end > start:
            sequences.append([int(t) for t in ids[start:end]])
        start = int(end)
    return sequences


class Row:
    """One prompt of a request and the tokens generated for it."""

    def __init__(self, job, index: int, prompt: list, sampling: SamplingConfig):
        self.job, self.index, self.prompt, self.sampling = job, index, prompt, sampling
        self.tokens: list = []

    def is_done(self) -> bool:
        """What the runtime decides after a token: max_new_tokens reached or a stop sequence ends the output."""
        out = self.tokens
        return len(out) >= self.sampling.max_new_tokens or any(
            len(out) >= len(s) and out[-len(s):] == s for s in self.sampling.stop_words)


class Job:
    """One Triton request: its rows, and how its answer goes back."""

    def __init__(self, request, decoupled: bool):
        self.request = request
        self.sender = request.get_response_sender() if decoupled else None
        self.response = None        # non-decoupled mode: the one response
        self.finished = False
        self.rows: list = []
        self.rows_running = 0

    def parse(self, request, model: "TritonPythonModel") -> None:
        """Read the request's rows; RequestError for anything this model refuses."""
        check_request_parameters(request)
        inputs = tensors_of(request)
        input_ids = inputs["input_ids"]
        self.batch = input_ids.shape[0]

        def scalar(name: str, row: int, default):
            value = inputs.get(name)
            return default if value is None else value.reshape(self.batch, -1)[row, 0].item()

        self.stream = bool(scalar("streaming", 0, False))
        if self.stream and self.sender is None:
            raise RequestError("Streaming is only supported if model is deployed using decoupled mode.")
        self.exclude_input = bool(scalar("exclude_input_in_output", 0, model.exclude_input_default))
        for name, unused in UNSUPPORTED_UNLESS.items():
            if any(scalar(name, r, unused) != unused for r in range(self.batch)):
                raise RequestError(f"{name} is not supported by the cpu target's reference runtime "
                                   f"(leave it unset or {unused})")
        bad_words = inputs.get("bad_words_list")
        if bad_words is not None and (bad_words[:, 1] >= 0).any():
            raise RequestError("bad_words is not supported by the cpu target's reference runtime")
        bias = inputs.get("embedding_bias")
        if bias is not None and np.any(bias):
            raise RequestError("embedding_bias is not supported by the cpu target's reference runtime")
        lengths = inputs["input_lengths"].reshape(self.batch)
        max_new = inputs["request_output_len"].reshape(self.batch)
        stops = inputs.get("stop_words_list")
        for r in range(self.batch):
            prompt = [int(t) for t in input_ids[r, :int(lengths[r])]]
            model.check_lengths(prompt, int(max_new[r]))
            for tensor, (name, valid, allowed) in SAMPLING_RANGES.items():
                value = scalar(tensor, r, None)
                if value is not None and not valid(value):  # `not valid`: NaN is refused too
                    raise RequestError(f"{name} must be {allowed}, got {value:g} (tensorrt_llm input {tensor})")
            sampling = trtllm_sampling(   # values in SAMPLING_RANGES; a top_p <= 0 is unset (0), as NVIDIA's
                top_k=int(scalar("runtime_top_k", r, 0)), top_p=max(0.0, float(scalar("runtime_top_p", r, 0.0))),
                temperature=float(scalar("temperature", r, 1.0)), max_new_tokens=int(max_new[r]),
                end_id=scalar("end_id", r, None), seed=scalar("seed", r, None),
                stop_words=stop_sequences(stops[r]) if stops is not None else [],
                min_tokens=int(scalar("min_tokens", r, 0)))
            self.rows.append(Row(self, r, prompt, sampling))
        self.rows_running = self.batch

    # ------------------------------------------------------------------ answering

    def on_token(self, row: Row, token: int) -> bool:
        """Record (and stream) a token; False once the client cancelled the request, so its rows stop
        generating instead of running to max_tokens for nobody."""
        if self.finished or self.request.is_cancelled():
            self.fail("the request was cancelled", pb_utils.TritonError.CANCELLED)
            return False
        row.tokens.append(token)
        if not self.stream:
            return True
        # final when this token ends the job's last running row (on_row_end follows, with nothing left to send)
        self.send(self.tensors([row], [[token]]), final=row.is_done() and self.rows_running == 1)
        return True

    def on_row_end(self) -> None:
        """One of the job's rows left the batch: once all have, the job is answered now, while the other
        requests of the batch go on generating (in decoupled mode its client has the answer at once)."""
        self.rows_running -= 1
        if self.rows_running == 0:
            self.finish()

    def finish(self) -> None:
        """When its rows are done: the whole answer (non-streaming), or the final flag a stream still owes (its
        last row ended at end_id, which is not output); nothing for a job already answered (cancelled)."""
        if self.finished:
            return
        if self.stream:
            self.send(self.tensors([self.rows[-1]], [[]]), final=True)
            return
        outputs = [(row.prompt if not self.exclude_input else []) + row.tokens for row in self.rows]
        if self.sender is None or self.batch == 1:
            self.send(self.tensors(self.rows, outputs), final=True)
        else:  # decoupled: one response per row, as NVIDIA's backend answers batched requests
            for i, (row, out) in enumerate(zip(self.rows, outputs)):
                self.send(self.tensors([row], [out]), final=i == self.batch - 1)

    def fail(self, message: str, code=None) -> None:
        if self.finished:
            return
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        response = pb_utils.InferenceResponse(output_tensors=[], error=error)
        if self.sender is not None:
            self.sender.send(response, flags=FINAL)
        self.response = response
        self.finished = True

    def tensors(self, rows: list, outputs: list) -> list:
        width = max(len(o) for o in outputs)
        pad = [row.sampling.end_id if row.sampling.end_id is not None else 0 for row in rows]
        ids = np.array([[o + [p] * (width - len(o))] for o, p in zip(outputs, pad)], np.int32).reshape(
            len(rows), 1, width)
        tensors = [pb_utils.Tensor("output_ids", ids),
                   pb_utils.Tensor("sequence_length", np.array([[len(o)] for o in outputs], np.int32))]
        if self.batch > 1 and len(rows) == 1:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[rows[0].index]], np.int32)))
        return tensors

    def send(self, tensors: list, final: bool) -> None:
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        if self.sender is not None:
            self.sender.send(response, flags=FINAL if final else 0)
        else:
            self.response = response
        self.finished = self.finished or final


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        torch.set_num_threads(intra_op_threads(config))
        if parameter(config, "runtime", "torch") == "onnxruntime":
            from pipeline.onnx.runner import OrtDecoder

            self.model = OrtDecoder(HERE / parameter(config, "onnx_dir", "onnx"), threads=intra_op_threads(config))
        else:
            self.model = ReferenceModel.load(HERE / parameter(config, "checkpoint_dir", "checkpoint"))
        limit = int(parameter(config, "max_seq_len", "0"))
        self.max_seq_len = min(limit, self.model.max_position_embeddings) if limit > 0 else \
            self.model.max_position_embeddings
        self.exclude_input_default = parameter(config, "exclude_input_in_output", "false").lower() == "true"

    def check_lengths(self, prompt: list, max_new: int) -> None:
        if not prompt:
            raise RequestError("input_ids is empty; every request needs at least one input token")
        if max_new < 1:
            raise RequestError(f"request_output_len must be at least 1, got {max_new}")
        if len(prompt) + max_new > self.max_seq_len:
            raise RequestError(f"{len(prompt)} input tokens + {max_new} output tokens exceed the maximum "
                               f"sequence length {self.max_seq_len}")
        if max(prompt) >= self.model.vocab_size or min(prompt) < 0:
            raise RequestError(f"input_ids holds ids outside the vocabulary (0..{self.model.vocab_size - 1})")

    def execute(self, requests):
        jobs = []
        for request in requests:
            job = Job(request, self.decoupled)
            try:
                job.parse(request, self)
            except RequestError as exc:
                job.fail(str(exc))
            jobs.append(job)
        live = [job for job in jobs if not job.finished]
        rows = [row for job in live for row in job.rows]
        try:
            self.model.generate([row.prompt for row in rows], [row.sampling for row in rows],
                                on_token=lambda i, token: rows[i].job.on_token(rows[i], token),
                                on_end=lambda i: rows[i].job.on_row_end())
        except Exception as exc:  # the runtime failed for the whole batch: every request gets the reason
            for job in live:
                job.fail(f"generation failed: {type(exc).__name__}: {exc}")
        return None if self.decoupled else [job.response for job in jobs]
