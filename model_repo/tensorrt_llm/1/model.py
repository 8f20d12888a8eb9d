"""tensorrt_llm for the cpu target: NVIDIA's tensorrt_llm tensor contract, served by trtpipe's reference runtime.

The model runs the TensorRT-LLM checkpoint in `checkpoint/` (beside this file) with `pipeline.runtime`,
copied into this directory by `trtpipe deploy`, so the server's Python needs torch, safetensors and
numpy but not trtpipe. With the parameter `runtime` = onnxruntime (backend reference-onnx) it runs the
checkpoint's ONNX export in `onnx/` with ONNX Runtime (`pipeline.onnx.runner.OrtDecoder`, also copied;
onnxruntime is then needed too); the generation loop and sampling are the same (pipeline/runtime/generate.py).
In decoupled mode `execute` queues the requests and returns; one worker thread batches them in flight
(`pipeline.runtime.generate.serve_rows`): a request queued while others generate joins them at the next decode step,
its prompt prefilled between two steps, so the rows of every running request share batched decode steps and a `stop`
request (NVIDIA's cancellation) is read while a stream runs. Which requests start and which pause is the
`pipeline.runtime.scheduler.Scheduler`'s decision, under the limits this model's config gives (`scheduler_limits`):
max_batch_size rows, the parameters max_num_tokens, max_tokens_in_paged_kv_cache, tokens_per_block and
batch_scheduler_policy, and dynamic_batching's priority_levels (a request's level is its `priority` parameter).
A streaming request gets one response per new token, the last one flagged final; otherwise one
response per sequence holds the prompt and the completion (the completion alone with exclude_input_in_output),
as NVIDIA's backend answers; a request is answered as soon as its own rows are done, while the rest go on.

Every input of NVIDIA's tensorrt_llm contract (pipeline/triton_contract.py) is honoured (`HONOURED`: sampling,
min_tokens, penalties, bad/stop words, embedding bias, num_return_sequences, log probs, logits, token counts,
perf metrics, stop, draft tokens to verify) or refused by name when a request sends it (`REFUSED`: beam search > 1,
LoRA, p-tuning, draft logits, guided and lookahead decoding, encoder-decoder and multimodal inputs, KV retention);
sampling values
outside the ranges TensorRT-LLM's executor accepts are refused too (pipeline/triton_names.py
`TENSORRT_LLM_SAMPLING_RANGES`, where the tensor names and `parameter` are too), and so is a request that can never
fit the scheduler's limits (a prompt over max_num_tokens, a sequence over the KV pool, a priority outside the levels).
torch computes with one core fewer than the process may use, ONNX Runtime with every core (`intra_op_threads`).
"""

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied runtime package (pipeline/) wins over any installed trtpipe
from pipeline.host import (  # noqa: E402
    CANCELLING, DRAIN_FILE_ENV, INTRA_OP_SPINNING, LIVE_REQUESTS_METRIC, onnx_serving_threads,
)
from pipeline.runtime import ReferenceModel, SamplingConfig, serving_threads  # noqa: E402
from pipeline.errors import UserError  # noqa: E402
from pipeline.runtime.generate import check_requests  # noqa: E402
from pipeline.runtime.outbox import Outbox  # noqa: E402
from pipeline.runtime.profiling import TorchCapture  # noqa: E402
from pipeline.runtime.scheduler import (  # noqa: E402
    GUARANTEED_NO_EVICT, Scheduler, SchedulerLimits, Sequence,
)
from pipeline.runtime.sampling import trtllm_sampling  # noqa: E402
from pipeline.runtime.draft_model import ModelDrafter  # noqa: E402
from pipeline.runtime.speculative import (  # noqa: E402
    DRAFT, DRAFT_DIR, MAX_DRAFT_LEN, MAX_MATCHING_NGRAM_SIZE, MAX_NGRAM, NGRAM, SPECULATIVE_DECODING_MODE,
    SPECULATIVE_MAX_ROWS, NgramDrafter, Speculation,
)
from pipeline.triton_names import (  # noqa: E402
    ACCEPTANCE_RATE, ARRIVAL_TIME_NS, BAD_WORDS_LIST, BATCH_INDEX, BEAM_WIDTH, CONTEXT_LOGITS, CUM_LOG_PROBS,
    DRAFT_INPUT_IDS, EMBEDDING_BIAS, END_ID, EXCLUDE_INPUT_IN_OUTPUT, FIRST_SCHEDULED_TIME_NS, FIRST_TOKEN_TIME_NS,
    FREQUENCY_PENALTY, GENERATION_LOGITS, INPUT_IDS, INPUT_LENGTHS, KV_CACHE_ALLOC_NEW_BLOCKS,
    KV_CACHE_ALLOC_TOTAL_BLOCKS, KV_CACHE_REUSED_BLOCKS, LAST_TOKEN_TIME_NS, MIN_TOKENS, NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS, NUM_RETURN_SEQUENCES, OUTPUT_IDS, OUTPUT_LOG_PROBS, PAD_ID, PRESENCE_PENALTY,
    REPETITION_PENALTY, REQUEST_OUTPUT_LEN, RETURN_CONTEXT_LOGITS, RETURN_GENERATION_LOGITS, RETURN_LOG_PROBS,
    RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS, RETURN_PERF_METRICS, RUNTIME_TOP_K, RUNTIME_TOP_P, SEED,
    SEQUENCE_INDEX, SEQUENCE_LENGTH, STOP, STOP_WORDS_LIST,
    STREAMING, TEMPERATURE, TENSORRT_LLM, TENSORRT_LLM_SAMPLING_INPUTS, TENSORRT_LLM_SAMPLING_RANGES,
    TOTAL_ACCEPTED_DRAFT_TOKENS, TOTAL_DRAFT_TOKENS, parameter, sampling_error, words,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: how often a decoupled request asks whether its client went away, in seconds (Job.cancelled)
CANCEL_CHECK_S = 0.05

#: What this model does with each input of NVIDIA's tensorrt_llm contract it does not simply compute with (the
#: ones it computes with are read in Job.parse). Beam-search-only inputs have no effect at beam width 1, in
#: TensorRT-LLM as here; the decoder inputs are what NVIDIA's preprocessing sends a decoder-only model, which the
#: tensorrtllm backend reads only for encoder-decoder engines (utils.cc@c2e65b8:959-984).
UNUSED_AT_BEAM_WIDTH_1 = ("len_penalty", "early_stopping", "beam_search_diversity_rate")
DECODER_ONLY_UNUSED = ("decoder_input_ids", "decoder_input_lengths")
#: The request's return_* inputs (each defaults to false).
RETURN_FLAGS = (RETURN_LOG_PROBS, RETURN_CONTEXT_LOGITS, RETURN_GENERATION_LOGITS, RETURN_PERF_METRICS,
                RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS)
#: Every input of NVIDIA's contract this model accepts: the ones Job.parse computes with, and the two groups above.
HONOURED = (INPUT_IDS, INPUT_LENGTHS, REQUEST_OUTPUT_LEN, NUM_RETURN_SEQUENCES, END_ID, PAD_ID, STOP_WORDS_LIST,
            BAD_WORDS_LIST, EMBEDDING_BIAS, BEAM_WIDTH, TEMPERATURE, RUNTIME_TOP_K, RUNTIME_TOP_P, REPETITION_PENALTY,
            MIN_TOKENS, PRESENCE_PENALTY, FREQUENCY_PENALTY, SEED, *RETURN_FLAGS, EXCLUDE_INPUT_IN_OUTPUT, STOP,
            STREAMING, DRAFT_INPUT_IDS, *UNUSED_AT_BEAM_WIDTH_1, *DECODER_ONLY_UNUSED)
#: Inputs refused by name when a request sends them: what the reference runtime cannot do.
REFUSED = {
    **{name: "draft logits (rejection sampling against the draft's distribution) are not supported: the cpu model "
             "verifies draft_input_ids by the target's own choice, which is exact for greedy and sampled requests"
       for name in ("draft_logits", "draft_acceptance_threshold")},
    **{name: "encoder-decoder and cross-attention inputs are for encoder-decoder models; this one is decoder-only"
       for name in ("encoder_input_features", "encoder_output_lengths", "cross_attention_mask",
                    "skip_cross_attn_blocks")},
    **{name: "top-p decay is not supported" for name in ("runtime_top_p_min", "runtime_top_p_decay",
                                                          "runtime_top_p_reset_ids")},
    **{name: "p-tuning (a prompt embedding table) is not supported"
       for name in ("prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size")},
    **{name: "multimodal rotary embeddings are not supported" for name in ("mrope_rotary_cos_sin",
                                                                           "mrope_position_deltas")},
    **{name: "LoRA adapters are not supported" for name in ("lora_task_id", "lora_weights", "lora_config")},
    "context_phase_params": "disaggregated serving (context_phase_params) is not supported",
    **{name: "KV-cache retention priorities are not supported (the reference runtime keeps no cache between "
             "requests)" for name in ("retention_token_range_starts", "retention_token_range_ends",
                                      "retention_token_range_priorities", "retention_token_range_durations_ms",
                                      "retention_decode_priority", "retention_decode_duration_ms")},
    **{name: "guided decoding is not supported" for name in ("guided_decoding_guide_type", "guided_decoding_guide")},
    **{name: "lookahead decoding is not supported" for name in ("lookahead_window_size", "lookahead_ngram_size",
                                                                 "lookahead_verification_set_size")},
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
#: The answer to a request still waiting when the model is finalized (with UNAVAILABLE: send it elsewhere)
STOPPED_BEFORE_START = "the server stopped before this request started; send it again"


def check_request_parameters(request) -> dict:
    """The request's parameters; RequestError for one the deployment does not know or a request_type it does not
    serve."""
    params = json.loads(request.parameters() or "{}")
    unknown = sorted(set(params) - KNOWN_REQUEST_PARAMETERS)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}: the deployment has no input or parameter of that "
                           "name (check the spelling against the ensemble's inputs)")
    if params.get("request_type", REQUEST_TYPE) != REQUEST_TYPE:
        raise RequestError(f"request_type {params['request_type']!r} is not supported by the cpu target's reference "
                           f"runtime (only {REQUEST_TYPE}: no disaggregated context/generation)")
    return params


def scheduler_limits(config: dict) -> SchedulerLimits:
    """The in-flight scheduler's limits from the model's config; ValueError (the model does not load) for a value
    it cannot honour. NVIDIA's backend warns and falls back to guaranteed_no_evict on an unknown
    batch_scheduler_policy (model_instance_state.cc@c2e65b8:357-381); here the model refuses to load instead, and
    enable_chunked_context true is refused: the reference runtime prefills a prompt in one step."""
    if parameter(config, "enable_chunked_context", "false").lower() == "true":
        raise ValueError("enable_chunked_context true: the cpu target's reference runtime does not chunk context "
                         "(set it false or leave it unset)")

    def count(name: str) -> int | None:
        value = parameter(config, name, "")
        try:
            return int(value) if value else None
        except ValueError:
            raise ValueError(f"parameter {name} must be an integer, got {value!r}") from None

    batching = config.get("dynamic_batching", {})
    return SchedulerLimits(
        max_rows=config.get("max_batch_size") or None, max_num_tokens=count("max_num_tokens"),
        kv_tokens=count("max_tokens_in_paged_kv_cache"), tokens_per_block=count("tokens_per_block"),
        policy=parameter(config, "batch_scheduler_policy", GUARANTEED_NO_EVICT),
        priority_levels=int(batching.get("priority_levels", 0)),
        default_priority_level=int(batching.get("default_priority_level", 0)))


def speculation_of(config: dict, target) -> Speculation | None:
    """Speculative decoding as the deployment's parameters ask (trtpipe plan --speculative): prompt lookup, or the
    draft model in draft_dir (loaded as the target is, `load_runtime`), drafting max_draft_len tokens a step while
    the batch has at most speculative_max_rows rows (unset: any; 0: none); None when unset. ValueError (the model
    does not load) for a mode or value it cannot honour."""
    mode = parameter(config, SPECULATIVE_DECODING_MODE, "")
    if not mode:
        return None
    if mode not in (NGRAM, DRAFT):
        raise ValueError(f"{SPECULATIVE_DECODING_MODE} {mode!r}: the cpu target's runtimes draft with {NGRAM} or "
                         f"{DRAFT} only")
    try:
        k = int(parameter(config, MAX_DRAFT_LEN, ""))
        ngram = int(parameter(config, MAX_MATCHING_NGRAM_SIZE, str(MAX_NGRAM)))
        limit = parameter(config, SPECULATIVE_MAX_ROWS, "")
        rows = int(limit) if limit else None      # 0: the plan found no batch where drafting pays: never
    except ValueError:
        raise ValueError(f"{MAX_DRAFT_LEN}, {MAX_MATCHING_NGRAM_SIZE} and {SPECULATIVE_MAX_ROWS} must be integers "
                         "with speculative decoding") from None
    if k < 1:
        raise ValueError(f"{MAX_DRAFT_LEN} {k}: the draft length must be at least 1")
    if rows == 0:       # the plan found no batch where drafting pays: decode plainly, and hold no draft model
        return None
    try:
        drafter = NgramDrafter(k, ngram) if mode == NGRAM else draft_model(config, target, k)
    except UserError as exc:
        raise ValueError(str(exc)) from None
    return Speculation(drafter, max_rows=rows)


def draft_model(config: dict, target, k: int) -> ModelDrafter:
    """Draft-target's drafter: the model in draft_dir, which must share the target's vocabulary."""
    directory = parameter(config, DRAFT_DIR, "")
    if not directory or not (HERE / directory).is_dir():
        raise UserError(f"{SPECULATIVE_DECODING_MODE} {DRAFT} needs {DRAFT_DIR}, the draft model's directory in "
                        f"the model version (got {directory!r})")
    draft = load_runtime(config, HERE / directory, spinning=False)
    if draft.vocab_size != target.vocab_size:
        raise UserError(f"the draft model in {directory} has a vocabulary of {draft.vocab_size} tokens, the target "
                        f"{target.vocab_size}: a draft must share the target's tokenizer")
    return ModelDrafter(draft.inflight_decoder(), k)


def load_runtime(config: dict, directory: Path, spinning: bool = True):
    """The runtime the deployment names (torch: the checkpoint in `directory`; onnxruntime: the ONNX export).

    A draft model's ONNX Runtime session never spins (`spinning` False): its threads, spinning after each of its
    runs, held the cores the target's next run computes on (SmolLM2 int4 drafting for fp32, in process: 0.90x plain
    with both sessions spinning, 1.04x with the draft's threads asleep; benchmarks/bench_draft_model.py)."""
    if parameter(config, "runtime", "torch") == "onnxruntime":
        from pipeline.onnx.runner import OrtDecoder

        spins = spinning and parameter(config, INTRA_OP_SPINNING, "true").lower() != "false"
        return OrtDecoder(directory, threads=intra_op_threads(config), spinning=spins)
    return ReferenceModel.load(directory)


def request_priority(params: dict) -> int | None:
    """The `priority` a request carries as a parameter (Triton's generate endpoint passes it so, and the ensemble
    forwards it; the Python backend exposes no request priority of its own)."""
    value = params.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"priority must be a non-negative integer, got {value!r}")
    return value


def intra_op_threads(config: dict) -> int:
    """The runtime's threads for one step (torch's, or ONNX Runtime's intra-op pool): the parameter
    `intra_op_threads`, else what was measured best for the runtime (pipeline/host.py): every core for ONNX Runtime,
    every core but one for torch."""
    value = int(parameter(config, "intra_op_threads", "0"))
    if value > 0:
        return value
    return onnx_serving_threads() if parameter(config, "runtime", "torch") == "onnxruntime" else serving_threads()


def tensors_of(request) -> dict:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def word_lists(words_list) -> list:
    return words(words_list) if words_list is not None else []


class Row:
    """One sequence of a request (prompt `index` of its batch, return sequence `sequence`) and what it produced."""

    def __init__(self, job, index: int, sequence: int, prompt: list, sampling: SamplingConfig, pad_id):
        self.job, self.index, self.sequence, self.prompt, self.sampling = job, index, sequence, prompt, sampling
        # what pads this row's output_ids where a response carries rows of other lengths: pad_id, else end_id
        self.pad = next((v for v in (pad_id, sampling.end_id) if v is not None), 0)
        self.sent = 0               # output tokens already streamed
        self.seq = Sequence(self, prompt, sampling)   # what the scheduler starts, pauses and gives KV blocks

    @property
    def result(self):
        """The runtime's RowResult, once generation started (None before)."""
        return self.seq.result

    @property
    def tokens(self) -> list:
        return self.result.tokens if self.result is not None else []

    def is_done(self) -> bool:
        """What the runtime decides after a token: max_new_tokens reached or a stop sequence ends the output."""
        out = self.tokens
        return len(out) >= self.sampling.max_new_tokens or any(
            len(out) >= len(s) and out[-len(s):] == s for s in self.sampling.stop_words)


class Job:
    """One Triton request: its rows, what it asked to be returned, and how its answer goes back."""

    def __init__(self, request, decoupled: bool):
        self.request = request
        self.sender = request.get_response_sender() if decoupled else None
        self.outbox: Outbox | None = None   # decoupled, once the worker owns it: where its responses and checks go
        self.client_gone = False    # decoupled: the outbox found the request cancelled
        self.cancel_checked = 0.0
        self.response = None        # non-decoupled mode: the one response
        self.finished = False
        self.stopped = False        # a `stop` request for this request's id arrived: end at the next token
        self.rows: list = []
        self.rows_running = 0
        self.arrival_ns = time.monotonic_ns()
        self.first_token_ns = self.last_token_ns = 0

    @property
    def scheduled_ns(self) -> int:
        """When its first row started (0: not yet)."""
        return min((row.seq.started_ns for row in self.rows if row.seq.started_ns), default=0)

    def parse(self, request, model: "TritonPythonModel") -> None:
        """Read the request's rows; RequestError for anything this model refuses."""
        self.model = model
        self.priority = request_priority(check_request_parameters(request))
        inputs = tensors_of(request)
        for name in sorted(set(inputs) & set(REFUSED)):
            raise RequestError(f"{name}: {REFUSED[name]} by the cpu target's reference runtime")
        input_ids = inputs[INPUT_IDS]
        self.batch = input_ids.shape[0]

        def scalar(name: str, row: int, default):
            value = inputs.get(name)
            return default if value is None else value.reshape(self.batch, -1)[row, 0].item()

        self.stream = bool(scalar(STREAMING, 0, False))
        if self.stream and self.sender is None:
            raise RequestError("Streaming is only supported if model is deployed using decoupled mode.")
        self.exclude_input = bool(scalar(EXCLUDE_INPUT_IN_OUTPUT, 0, model.exclude_input_default))
        self.wants = {name: bool(scalar(name, 0, False)) for name in RETURN_FLAGS}
        for r in range(self.batch):
            if scalar(BEAM_WIDTH, r, 1) != 1:
                raise RequestError(f"beam_width {scalar(BEAM_WIDTH, r, 1)}: beam search is not supported by the "
                                   "cpu target's reference runtime (leave it unset or 1)")
        lengths = inputs[INPUT_LENGTHS].reshape(self.batch)
        max_new = inputs[REQUEST_OUTPUT_LEN].reshape(self.batch)
        for r in range(self.batch):
            prompt = [int(t) for t in input_ids[r, :int(lengths[r])]]
            model.check_lengths(prompt, int(max_new[r]))
            for name, tensor in TENSORRT_LLM_SAMPLING_INPUTS.items():   # NaN is refused too
                value = scalar(tensor, r, None)
                error = None if value is None else sampling_error(name, value, ranges=TENSORRT_LLM_SAMPLING_RANGES,
                                                                  source=f"{TENSORRT_LLM} input {tensor}")
                if error:
                    raise RequestError(error)
            sequences = int(scalar(NUM_RETURN_SEQUENCES, r, 1))
            if sequences < 1 or (sequences > 1 and self.sender is None):
                raise RequestError(f"num_return_sequences must be >= 1 (> 1 needs the decoupled mode: one response "
                                   f"per sequence), got {sequences}")
            seed = scalar(SEED, r, None)
            for sequence in range(sequences):
                sampling = self.sampling(inputs, scalar, r, int(max_new[r]), model,
                                         None if seed is None else int(seed) + sequence)
                self.rows.append(Row(self, r, sequence, prompt, sampling, scalar(PAD_ID, r, None)))
        self.sequences = len(self.rows) // self.batch
        self.rows_running = len(self.rows)
        try:
            check_requests([row.prompt for row in self.rows], [row.sampling for row in self.rows],
                           model.model.vocab_size, model.max_seq_len)
        except UserError as exc:
            raise RequestError(str(exc)) from None
        refusal = model.scheduler.refusal([row.seq for row in self.rows], self.priority)
        if refusal:
            raise RequestError(refusal)

    def sampling(self, inputs: dict, scalar, r: int, max_new: int, model: "TritonPythonModel",
                 seed) -> SamplingConfig:
        """Row r's SamplingConfig. A top_p <= 0 is unset (0), as NVIDIA's backend makes it; each return sequence
        draws from its own generator (the request's seed + the sequence's index)."""
        bias, drafts = inputs.get(EMBEDDING_BIAS), inputs.get(DRAFT_INPUT_IDS)
        bias = None if bias is None or bias.shape[-1] == 0 or not np.any(bias[r]) else torch.from_numpy(
            np.ascontiguousarray(bias[r].reshape(-1), np.float32))
        try:
            return trtllm_sampling(
                top_k=int(scalar(RUNTIME_TOP_K, r, 0)), top_p=max(0.0, float(scalar(RUNTIME_TOP_P, r, 0.0))),
                temperature=float(scalar(TEMPERATURE, r, 1.0)), max_new_tokens=max_new,
                end_id=scalar(END_ID, r, None), seed=seed,
                stop_words=word_lists(None if inputs.get(STOP_WORDS_LIST) is None else inputs[STOP_WORDS_LIST][r]),
                bad_words=word_lists(None if inputs.get(BAD_WORDS_LIST) is None else inputs[BAD_WORDS_LIST][r]),
                min_tokens=int(scalar(MIN_TOKENS, r, 0)),
                repetition_penalty=float(scalar(REPETITION_PENALTY, r, 1.0)),
                presence_penalty=float(scalar(PRESENCE_PENALTY, r, 0.0)),
                frequency_penalty=float(scalar(FREQUENCY_PENALTY, r, 0.0)), embedding_bias=bias,
                log_probs=self.wants[RETURN_LOG_PROBS], normalize_log_probs=model.normalize_log_probs,
                context_logits=self.wants[RETURN_CONTEXT_LOGITS],
                generation_logits=self.wants[RETURN_GENERATION_LOGITS],
                drafts=() if drafts is None else drafts.reshape(self.batch, -1)[r])
        except UserError as exc:
            raise RequestError(str(exc)) from None

    # ------------------------------------------------------------------ answering

    def on_step(self, row: Row, result) -> bool:
        """Record (and stream) a token; False ends the row: the client cancelled (an error answer) or a `stop`
        request arrived (the answer so far, as TensorRT-LLM's cancelRequest ends a request)."""
        row.seq.result = result     # serve_rows set it already; generate_rows (not decoupled) does not
        self.last_token_ns = time.monotonic_ns()
        self.first_token_ns = self.first_token_ns or self.last_token_ns
        if self.finished or self.cancelled():
            self.fail("the request was cancelled", pb_utils.TritonError.CANCELLED)
            return False
        if self.model.shutdown_state() == CANCELLING:
            self.fail(f"the server shut down before this request finished ({len(result.tokens)} tokens generated); "
                      "send it again", unavailable())
            return False
        if self.stream:   # final when this token ends the job's last running row (on_row_end sends nothing then)
            self.send([row], final=(row.is_done() or self.stopped) and self.rows_running == 1)
        return not self.stopped

    def cancelled(self) -> bool:
        """Whether the client went away. Decoupled, the check runs on the outbox (each is a round trip to Triton),
        at most every CANCEL_CHECK_S per request: a cancelled request stops within that and the steps in between."""
        if self.outbox is None:   # not decoupled: generated in execute, which may ask Triton itself
            return self.request.is_cancelled()
        now = time.monotonic()
        if now - self.cancel_checked >= CANCEL_CHECK_S:
            self.cancel_checked = now
            self.outbox.put(self.check_cancelled)
        return self.client_gone

    def check_cancelled(self) -> None:
        if self.request.is_cancelled():
            self.client_gone = True

    def on_row_end(self, row: Row) -> None:
        """One of the job's rows left the batch: once all have, the job is answered now, while the other
        requests of the batch go on generating (in decoupled mode its client has the answer at once)."""
        self.rows_running -= 1
        if self.rows_running == 0:
            self.finish()
            self.model.job_done(self)

    def finish(self) -> None:
        """When its rows are done: the whole answer (non-streaming), or the final flag a stream still owes (its
        last row ended at end_id, which is not output); nothing for a job already answered (cancelled)."""
        if self.finished:
            return
        if self.stream:
            self.send([self.rows[-1]], final=True, empty=True)
        elif self.sender is None or len(self.rows) == 1:
            self.send(self.rows, final=True)
        else:  # decoupled: one response per row, as NVIDIA's backend answers batched requests
            for i, row in enumerate(self.rows):
                self.send([row], final=i == len(self.rows) - 1)

    def fail(self, message: str, code=None) -> None:
        if self.finished:
            return
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        response = pb_utils.InferenceResponse(output_tensors=[], error=error)
        if self.sender is not None:
            self.deliver(response, FINAL)
        self.response = response
        self.finished = True

    def send(self, rows: list, final: bool, empty: bool = False) -> None:
        response = pb_utils.InferenceResponse(output_tensors=self.tensors(rows, empty))
        if self.sender is not None:
            self.deliver(response, FINAL if final else 0)
        else:
            self.response = response
        self.finished = self.finished or final

    def deliver(self, response, flags: int) -> None:
        """Decoupled: the response goes out from the outbox, after every response of this request put before it (a
        request refused before the worker took it is answered at once)."""
        if self.outbox is None:
            self.sender.send(response, flags=flags)
        else:
            self.outbox.put(lambda: self.sender.send(response, flags=flags))

    def tensors(self, rows: list, empty: bool) -> list:
        """The outputs of one response: NVIDIA's shapes ([rows, beam 1, ...]) for the tokens this response carries
        (a stream: the new ones; else the whole output, after the prompt unless excluded)."""
        pieces = [[] if empty else row.tokens[row.sent:] for row in rows]
        first = all(row.sent == 0 for row in rows)
        if self.stream:
            for row, piece in zip(rows, pieces):
                row.sent += len(piece)
        outputs = [p if self.stream or self.exclude_input else row.prompt + p for row, p in zip(rows, pieces)]
        width = max(len(o) for o in outputs)
        ids = np.array([o + [row.pad] * (width - len(o)) for o, row in zip(outputs, rows)], np.int32)
        ids = ids.reshape(len(rows), 1, width)
        tensors = [pb_utils.Tensor(OUTPUT_IDS, ids),
                   pb_utils.Tensor(SEQUENCE_LENGTH, np.array([[len(o)] for o in outputs], np.int32))]
        if self.batch > 1 and len(rows) == 1:
            tensors.append(pb_utils.Tensor(BATCH_INDEX, np.array([[rows[0].index]], np.int32)))
        if self.sequences > 1 and len(rows) == 1:
            tensors.append(pb_utils.Tensor(SEQUENCE_INDEX, np.array([[rows[0].sequence]], np.int32)))
        tensors += requested_outputs(self, rows, pieces, outputs, first)
        return tensors


def requested_outputs(job: Job, rows: list, pieces: list, outputs: list, first: bool) -> list:
    """The outputs a request asked for with its return_* inputs, as NVIDIA's backend fills them
    (model_instance_state.cc@c2e65b8 fillTritonResponse, num tokens from TensorRT-LLM 1.2.0rc8's copy):
    log probs of the tokens this response carries (cum_log_probs: all so far, the end id's included), context
    logits once (the first response of the row), generation logits of the carried tokens, the token counts
    (num_output_tokens: the ids in this response's output_ids, prompt included when it is, NVIDIA's count) and
    the perf metrics (monotonic-clock ns, as TensorRT-LLM's steady-clock TimePoint; the KV blocks the scheduler gave the
    sequence, a restart after a pause allocating anew, and nothing reused; the drafts verified and accepted)."""
    wants, tensors = job.wants, []
    results = [row.result for row in rows]

    def padded(values: list, fill: float) -> np.ndarray:
        width = max([len(v) for v in values] + [0])
        return np.array([[list(v) + [fill] * (width - len(v))] for v in values], np.float32).reshape(
            len(values), 1, width)

    if wants[RETURN_LOG_PROBS]:
        logs = [[] if r is None else r.log_probs[len(r.tokens) - len(p):len(r.tokens)] for r, p in zip(results, pieces)]
        cum = [0.0 if r is None else r.cum_log_prob for r in results]
        tensors += [pb_utils.Tensor(CUM_LOG_PROBS, np.array([[c] for c in cum], np.float32)),
                    pb_utils.Tensor(OUTPUT_LOG_PROBS, padded(logs, -1.0))]
    if wants[RETURN_CONTEXT_LOGITS] and first:
        context = [r.context_logits.numpy() for r in results if r is not None and r.context_logits is not None]
        if len(context) == len(rows):
            width = max(c.shape[0] for c in context)
            tensors.append(pb_utils.Tensor(CONTEXT_LOGITS, np.stack(
                [np.pad(c, ((0, width - c.shape[0]), (0, 0))) for c in context]).astype(np.float32)))
    if wants[RETURN_GENERATION_LOGITS]:
        steps = [np.zeros((0, 0), np.float32) if r is None or not p else
                 r.generation_logits_tensor().numpy()[len(r.tokens) - len(p):len(r.tokens)]
                 for r, p in zip(results, pieces)]
        vocab = max(s.shape[1] for s in steps)
        width = max(s.shape[0] for s in steps)
        block = np.zeros((len(rows), 1, width, vocab), np.float32)
        for i, s in enumerate(steps):
            block[i, 0, :s.shape[0], :s.shape[1]] = s
        tensors.append(pb_utils.Tensor(GENERATION_LOGITS, block))
    if wants[RETURN_NUM_INPUT_TOKENS]:
        tensors.append(pb_utils.Tensor(NUM_INPUT_TOKENS, np.array([[len(row.prompt)] for row in rows], np.int32)))
    if wants[RETURN_NUM_OUTPUT_TOKENS]:
        tensors.append(pb_utils.Tensor(NUM_OUTPUT_TOKENS, np.array([[len(o)] for o in outputs], np.int32)))
    if wants[RETURN_PERF_METRICS]:
        tensors += [pb_utils.Tensor(name, np.full((len(rows), 1), value, dtype)) for name, value, dtype in (
            (ARRIVAL_TIME_NS, job.arrival_ns, np.int64),
            (FIRST_SCHEDULED_TIME_NS, job.scheduled_ns, np.int64),
            (FIRST_TOKEN_TIME_NS, job.first_token_ns, np.int64),
            (LAST_TOKEN_TIME_NS, job.last_token_ns, np.int64))]
        drafted = [0 if r is None else r.draft_tokens for r in results]
        accepted = [0 if r is None else r.accepted_draft_tokens for r in results]
        # TensorRT-LLM's acceptance rate: accepted / drafted, 0 before any draft (llmRequest.cpp createResult)
        rate = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
        tensors += [pb_utils.Tensor(name, np.array([[v] for v in values], dtype)) for name, values, dtype in (
            (ACCEPTANCE_RATE, rate, np.float32), (TOTAL_ACCEPTED_DRAFT_TOKENS, accepted, np.int32),
            (TOTAL_DRAFT_TOKENS, drafted, np.int32))]
        blocks = np.array([[row.seq.allocated] for row in rows], np.int32)   # the scheduler's pool; none reused
        tensors += [pb_utils.Tensor(KV_CACHE_ALLOC_NEW_BLOCKS, blocks), pb_utils.Tensor(KV_CACHE_REUSED_BLOCKS,
                    np.zeros_like(blocks)), pb_utils.Tensor(KV_CACHE_ALLOC_TOTAL_BLOCKS, blocks)]
    return tensors


def unavailable():
    """The error code of a request refused or cut because the server is stopping (HTTP 503); None where the Python
    backend has no codes. Looked up when used: looking it up as this module was imported made Triton 2.51's stub
    fail to load the model."""
    return getattr(pb_utils.TritonError, "UNAVAILABLE", None)


def live_gauge(model_name: str):
    """(family, gauge) of LIVE_REQUESTS_METRIC for this model ((None, None) where the Python backend has no custom
    metrics).
    Triton 2.51 counts a decoupled Python model's request as in flight only until `execute` returns, so its own
    graceful shutdown does not wait for the streams this model is still generating (docs/upstream-facts.md)."""
    family_of = getattr(pb_utils, "MetricFamily", None)
    if family_of is None:
        return None, None
    family = family_of(name=LIVE_REQUESTS_METRIC, kind=family_of.GAUGE,
                       description="requests the cpu model has accepted and not yet answered in full")
    return family, family.Metric(labels={"model": model_name})


def is_stop_request(request) -> bool:
    """NVIDIA's cancellation: a request with `stop` true (its BLS sends one with empty input_ids when a stream
    hit a stop word; utils.cc@c2e65b8:372-384, model_instance_state.cc:871-906)."""
    tensor = pb_utils.get_input_tensor_by_name(request, STOP)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        if parameter(config, "runtime", "torch") == "onnxruntime":
            torch.set_num_threads(1)    # torch only samples here: its threads would compete with ONNX Runtime's
            self.model = load_runtime(config, HERE / parameter(config, "onnx_dir", "onnx"))
        else:
            torch.set_num_threads(intra_op_threads(config))
            self.model = load_runtime(config, HERE / parameter(config, "checkpoint_dir", "checkpoint"))
        limit = int(parameter(config, "max_seq_len", "0"))
        self.max_seq_len = min(limit, self.model.max_position_embeddings) if limit > 0 else \
            self.model.max_position_embeddings
        self.exclude_input_default = parameter(config, "exclude_input_in_output", "false").lower() == "true"
        # NVIDIA's default when the parameter is unset (model_instance_state.cc@c2e65b8:503-506)
        self.normalize_log_probs = parameter(config, "normalize_log_probs", "true").lower() == "true"
        self.running: dict = {}          # Triton request id -> the jobs generating for it (for `stop`)
        drain = os.environ.get(DRAIN_FILE_ENV)
        self.drain_file = Path(drain) if drain else None   # trtpipe serve's stop (pipeline/serve.py)
        self.shutdown_checked, self.shutdown = 0.0, None
        self.live = 0
        # the family outlives its metric, or setting the metric fails ("'MetricFamily' has been deleted")
        self.live_family, self.live_gauge = live_gauge(args.get("model_name", TENSORRT_LLM))
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.scheduler = Scheduler(scheduler_limits(config))   # the worker's: which rows start, pause, hold KV
        self.speculation = speculation_of(config, self.model)
        self.admitted: set = set()       # jobs handed to the scheduler and not yet answered in full
        self.cancel_checked = 0.0
        self.max_rows = config.get("max_batch_size") or sys.maxsize
        bound = config.get("dynamic_batching", {}).get("default_queue_policy", {}).get("max_queue_size")
        self.queue_limit = int(bound) if bound and int(bound) > 0 and self.max_rows < sys.maxsize else None
        self.closing, self.taken = False, 0
        self.capture = TorchCapture()    # torch's profiler while `trtpipe profile` captures
        # decoupled: execute returns at once; one worker generates, so a `stop` is read while it runs, and one outbox
        # thread sends the responses, so the worker does not wait on Triton for each token
        self.outbox = Outbox(f"{args.get('model_name', TENSORRT_LLM)}-responses") if self.decoupled else None
        if self.decoupled:
            self.worker = threading.Thread(target=self.serve, daemon=True)
            self.worker.start()

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
        """Decoupled: the requests are queued for the worker (a `stop` is answered here, at once); otherwise they
        are generated now and answered in order."""
        jobs, answers = [], []
        draining = self.shutdown_state(at_once=True)
        for request in requests:
            if is_stop_request(request):
                answers.append(self.stop(request))
                continue
            job = Job(request, self.decoupled)
            try:
                if draining:
                    raise RequestError("the server is shutting down and accepts no new requests; send the request "
                                       "to another replica or again once it is back")
                job.parse(request, self)
            except RequestError as exc:
                job.fail(str(exc), unavailable() if draining else None)
            jobs.append(job)
            answers.append(job)
        live = [job for job in jobs if not job.finished]
        if self.decoupled:
            live = self.within_queue_bound(live)
        self.count_live(len(live))
        if self.decoupled:
            if live:
                self.queue.put(live)
            return None
        self.generate(live)
        return [a.response if isinstance(a, Job) else a for a in answers]

    def within_queue_bound(self, jobs: list) -> list:
        """The jobs that fit, refusing the rest as Triton refuses a request beyond its queue bound. Decoupled,
        `execute` returns at once, so Triton's own queue stays empty and the bound (dynamic_batching's
        max_queue_size) is kept here: max_batch_size requests running and max_queue_size waiting, then
        "Exceeds maximum queue size" (HTTP 503 from this model, 400 through the ensemble, as Triton answers it)."""
        if self.queue_limit is None:
            return jobs
        with self.lock:
            room = self.max_rows + self.queue_limit - self.live
        for job in jobs[max(room, 0):]:
            job.fail(f"Exceeds maximum queue size: {self.max_rows} requests running and {self.queue_limit} "
                     "waiting; send it again later", unavailable())
        return jobs[:max(room, 0)]

    def stop(self, request):
        """Stop every job of the request's id (each ends at its next token with what it has, as TensorRT-LLM's
        cancelRequest ends it) and answer the stop request with an empty final response; an id with nothing
        running (it finished already) is not an error, as in NVIDIA's handleStopRequest."""
        request_id = request.request_id()
        error = None if request_id else pb_utils.TritonError("Trying to stop a request but request ID is not provided")
        with self.lock:
            for job in self.running.get(request_id, ()):
                job.stopped = True
        response = pb_utils.InferenceResponse(output_tensors=[], error=error)
        if self.decoupled:
            request.get_response_sender().send(response, flags=FINAL)
        return response

    def serve(self) -> None:
        """The worker, until finalize: in-flight batching. The queued requests are submitted to the scheduler, which
        starts them as its limits allow; a request queued while others generate joins them at the next step."""
        while True:
            if not self.scheduler.waiting:   # (after a failed run, the requests still waiting go on without a new one)
                item = self.next_queued()
                self.taken += 1
                if item is None:
                    self.queue.task_done()
                    return
                self.submit(item)
            try:
                self.model.serve_rows(self.scheduler, self.poll,
                                      on_step=lambda row, result: row.job.on_step(row, result),
                                      on_end=lambda row: row.job.on_row_end(row), speculation=self.speculation)
            except Exception as exc:  # the runtime failed: every request it was generating gets the reason
                for s in list(self.scheduler.running):
                    self.scheduler.finish(s)
                for job in [job for job in self.admitted if job.scheduled_ns]:
                    job.fail(f"generation failed: {type(exc).__name__}: {exc}")
                    self.job_done(job)
                self.scheduler.withdraw(lambda row: row.job.finished)   # the paused rows of those jobs
            if self.closing:
                self.withdraw(lambda row: True, STOPPED_BEFORE_START)
            if not self.scheduler.waiting:   # every request taken from the queue so far is answered
                self.outbox.wait()
                for _ in range(self.taken):
                    self.queue.task_done()
                self.taken = 0
            if self.closing:
                return

    def next_queued(self):
        """The next queued item, waiting as long as it takes; while profiled, the capture is polled meanwhile (its
        end writes the profile even when no request follows)."""
        if self.capture.directory is None:
            return self.queue.get()
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                self.capture.poll()

    def submit(self, jobs: list) -> None:
        """Hand queued jobs to the scheduler, each request's rows to start together at its priority."""
        for job in jobs:
            self.register(job)
            self.scheduler.submit([row.seq for row in job.rows], job.priority)

    def register(self, job: Job) -> None:
        """A job this model now owes an answer: findable by its request id (for `stop`) until `job_done`."""
        with self.lock:
            self.running.setdefault(job.request.request_id(), []).append(job)
        self.admitted.add(job)
        job.outbox = self.outbox

    def poll(self) -> None:
        """Before every step: submit what was queued meanwhile, and take out of the queue what is no longer
        wanted: a request stopped (answered with what it has: nothing yet), cancelled by its client, or waiting when
        the server cancels (both checked at most every 0.1 s: each check asks Triton)."""
        self.capture.poll()
        while not self.closing:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            self.taken += 1
            if item is None:
                self.closing = True
            else:
                self.submit(item)
        if self.closing:   # finalize: the running rows finish, nothing waiting starts
            self.withdraw(lambda row: True, STOPPED_BEFORE_START)
        if not self.scheduler.waiting:
            return
        self.withdraw(lambda row: row.job.stopped)
        now = time.monotonic()
        if now - self.cancel_checked > 0.1:
            self.cancel_checked = now
            self.withdraw(lambda row: row.job.request.is_cancelled(), "the request was cancelled",
                          pb_utils.TritonError.CANCELLED)
            if self.shutdown_state() == CANCELLING:
                self.withdraw(lambda row: True, "the server shut down before this request started; send it again")

    def withdraw(self, gone, message: str | None = None, code=None) -> None:
        """Take the waiting rows `gone` picks out of the scheduler's queue and answer their requests: with `message`
        as the error (`code`, by default UNAVAILABLE), else as stopped (with the tokens each row has)."""
        for group in self.scheduler.withdraw(gone):
            for s in group.sequences:
                job = s.key.job
                if message is not None and not job.finished:
                    job.fail(message, code if code is not None else unavailable())
                job.on_row_end(s.key)

    def job_done(self, job: Job) -> None:
        """A job answered in full (or failed after it started): no longer running or counted live."""
        if job not in self.admitted:
            return
        self.admitted.discard(job)
        with self.lock:
            jobs = self.running.get(job.request.request_id(), [])
            if job in jobs:
                jobs.remove(job)
            if not jobs:
                self.running.pop(job.request.request_id(), None)
        self.count_live(-1)

    def start(self, job: Job) -> bool:
        """Not decoupled: admit `job` now; False (answered already) when its client went away."""
        if job.request.is_cancelled():
            job.fail("the request was cancelled", pb_utils.TritonError.CANCELLED)
            self.count_live(-1)
            return False
        self.register(job)
        return True

    def generate(self, jobs: list) -> None:
        """Not decoupled: the jobs of one execute call, generated together, each answered as its rows end."""
        started = [job for job in jobs if self.start(job)]
        rows = [row for job in started for row in job.rows]
        for row in rows:
            row.seq.started_ns = time.monotonic_ns()
        if not rows:
            return
        try:
            self.model.generate_rows([row.prompt for row in rows], [row.sampling for row in rows],
                                     on_step=lambda i, result: rows[i].job.on_step(rows[i], result),
                                     on_end=lambda i: rows[i].job.on_row_end(rows[i]), speculation=self.speculation)
        except Exception as exc:  # the runtime failed for the whole batch: every request gets the reason
            for job in started:
                job.fail(f"generation failed: {type(exc).__name__}: {exc}")
                self.job_done(job)

    def shutdown_state(self, at_once: bool = False) -> str | None:
        """What trtpipe serve's drain file says (None: serving; DRAINING; CANCELLING), read at most every 0.1 s
        (each token asks) unless `at_once`."""
        now = time.monotonic()
        if self.drain_file is not None and (at_once or now - self.shutdown_checked > 0.1):
            self.shutdown_checked = now
            try:
                self.shutdown = self.drain_file.read_text().strip() or None
            except OSError:
                self.shutdown = None
        return self.shutdown

    def count_live(self, change: int) -> None:
        """Requests accepted and not yet answered in full, on Triton's /metrics (serve drains until it is 0)."""
        with self.lock:
            self.live += change
            if self.live_gauge is not None:
                self.live_gauge.set(self.live)

    def finalize(self):
        if self.decoupled:
            self.queue.put(None)
            self.worker.join(timeout=60)
            self.outbox.close(timeout=60)
