"""The names trtpipe's Triton models and clients share: the tensors of each request contract, a model config
parameter as NVIDIA's models read it, and the sampling ranges TensorRT-LLM accepts.

A leaf that imports only the standard library: the Python models under model_repo/ import it inside Triton's
Python backend stub, where neither numpy (at import) nor the rest of trtpipe may be there. `trtpipe deploy`
copies it (with `pipeline/__init__.py`) beside each of trtpipe's model.py files as `pipeline/triton_names.py`
(`package_data.copy_model_support`; the reference backends' runtime copy holds it too), and each model.py puts
its own directory first on sys.path, so the copy is what it imports.

The tensor names are NVIDIA's (pipeline/triton_contract.py declares every tensor of the inflight_batcher_llm
models; pipeline/backends/pytorch.py the llmapi contract), one constant per name: where two contracts use the
same name (`temperature` is an input of the ensemble and of tensorrt_llm; `text_input` of the ensemble and of
the llmapi model) the constant serves both. The `*_NAMES` tuples say which contract uses which
(tests/test_triton_names.py checks each name against the contract's declaration).
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Callable, NamedTuple

#: The tensorrt_llm model's batch_scheduler_policy values (NVIDIA's parameter; guaranteed_no_evict its default,
#: model_instance_state.cc@c2e65b8:357-381); the cpu model's scheduler (pipeline/runtime/scheduler.py) honours both.
GUARANTEED_NO_EVICT, MAX_UTILIZATION = "guaranteed_no_evict", "max_utilization"
BATCH_SCHEDULER_POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION)


def words(words_list) -> list[list[int]]:
    """A stop or bad words list as TensorRT-LLM takes it, [2, N] (flat ids, cumulative end offsets padded with -1),
    as token-id sequences."""
    ids, ends = words_list
    sequences, start = [], 0
    for end in ends:
        if end < 0:
            break
        if end > start:
            sequences.append([int(t) for t in ids[start:end]])
        start = int(end)
    return sequences


def parameter(config: dict, key: str, default: str) -> str:
    """Parameter `key`'s string_value in a model config (the JSON Triton hands `initialize`), else `default`.
    An empty value and a `${...}` one count as unset: `${...}` is a placeholder of NVIDIA's fill_template.py left
    unfilled, which NVIDIA's own models read as "not set" too (pipeline/backends/nvidia_contract.py)."""
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if not value or value.startswith("${") else value


# ------------------------------------------------------------------------------------------------ the models

ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
TENSORRT_LLM_BLS = "tensorrt_llm_bls"
#: tensorrt_llm_bls's parameter naming the LLM model it calls (default TENSORRT_LLM).
TENSORRT_LLM_MODEL_NAME = "tensorrt_llm_model_name"
#: draft-target: tensorrt_llm_bls's parameter naming the draft model (a second tensorrt_llm model), and the name
#: trtpipe gives that model (NVIDIA's draft-target instructions name it so: docs/speculative.md)
TENSORRT_LLM_DRAFT_MODEL_NAME = "tensorrt_llm_draft_model_name"
TENSORRT_LLM_DRAFT = "tensorrt_llm_draft"
#: the key of tensorrt_llm_bls's wiring.json under which deploy writes what the LLM model does by default
TARGET_DEFAULTS = "target_defaults"

# ---------------------------------------------------------- the ensemble's request and response (and the BLS's)

TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
BAD_WORDS = "bad_words"
STOP_WORDS = "stop_words"
STREAM = "stream"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"   # tensorrt_llm's input of the same name too
TOP_K = "top_k"
TOP_P = "top_p"
TEMPERATURE = "temperature"                            # tensorrt_llm's too
MIN_TOKENS = "min_tokens"                              # tensorrt_llm's too
TEXT_OUTPUT = "text_output"
#: The names above of the ensemble's (and tensorrt_llm_bls's: the same contract) tensors.
ENSEMBLE_NAMES = (TEXT_INPUT, MAX_TOKENS, BAD_WORDS, STOP_WORDS, STREAM, EXCLUDE_INPUT_IN_OUTPUT, TOP_K, TOP_P,
                  TEMPERATURE, MIN_TOKENS, TEXT_OUTPUT)

# ------------------------------------------------------- tensorrt_llm_bls's own inputs (the ensemble has none)

NUM_DRAFT_TOKENS = "num_draft_tokens"      # draft-target: the draft model's tokens a step (0: none)
USE_DRAFT_LOGITS = "use_draft_logits"
BLS_NAMES = (NUM_DRAFT_TOKENS, USE_DRAFT_LOGITS)

# ------------------------------------------------------------------------------- the tensorrt_llm model's inputs

INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
REQUEST_OUTPUT_LEN = "request_output_len"
NUM_RETURN_SEQUENCES = "num_return_sequences"
END_ID = "end_id"
PAD_ID = "pad_id"
STOP_WORDS_LIST = "stop_words_list"
BAD_WORDS_LIST = "bad_words_list"
EMBEDDING_BIAS = "embedding_bias"
BEAM_WIDTH = "beam_width"
RUNTIME_TOP_K = "runtime_top_k"
RUNTIME_TOP_P = "runtime_top_p"
REPETITION_PENALTY = "repetition_penalty"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
SEED = "seed"
RETURN_LOG_PROBS = "return_log_probs"
RETURN_CONTEXT_LOGITS = "return_context_logits"
RETURN_GENERATION_LOGITS = "return_generation_logits"
RETURN_PERF_METRICS = "return_perf_metrics"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
STOP = "stop"                                          # NVIDIA's cancellation of a running request
STREAMING = "streaming"                                # the llmapi model's input of the same name too

# ------------------------------------------------------------------------------ the tensorrt_llm model's outputs

OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
CUM_LOG_PROBS = "cum_log_probs"
OUTPUT_LOG_PROBS = "output_log_probs"
CONTEXT_LOGITS = "context_logits"
GENERATION_LOGITS = "generation_logits"
BATCH_INDEX = "batch_index"
SEQUENCE_INDEX = "sequence_index"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
#: the perf metrics (return_perf_metrics)
KV_CACHE_ALLOC_NEW_BLOCKS = "kv_cache_alloc_new_blocks"
KV_CACHE_REUSED_BLOCKS = "kv_cache_reused_blocks"
KV_CACHE_ALLOC_TOTAL_BLOCKS = "kv_cache_alloc_total_blocks"
ARRIVAL_TIME_NS = "arrival_time_ns"
FIRST_SCHEDULED_TIME_NS = "first_scheduled_time_ns"
FIRST_TOKEN_TIME_NS = "first_token_time_ns"
LAST_TOKEN_TIME_NS = "last_token_time_ns"
ACCEPTANCE_RATE = "acceptance_rate"
TOTAL_ACCEPTED_DRAFT_TOKENS = "total_accepted_draft_tokens"
TOTAL_DRAFT_TOKENS = "total_draft_tokens"
#: draft tokens a request brings for the target to verify (what NVIDIA's BLS sends with a draft model's output)
DRAFT_INPUT_IDS = "draft_input_ids"
#: The names above of the tensorrt_llm model's tensors (inputs and outputs).
TENSORRT_LLM_NAMES = (
    INPUT_IDS, INPUT_LENGTHS, REQUEST_OUTPUT_LEN, NUM_RETURN_SEQUENCES, END_ID, PAD_ID, STOP_WORDS_LIST,
    BAD_WORDS_LIST, EMBEDDING_BIAS, BEAM_WIDTH, TEMPERATURE, RUNTIME_TOP_K, RUNTIME_TOP_P, REPETITION_PENALTY,
    MIN_TOKENS, PRESENCE_PENALTY, FREQUENCY_PENALTY, SEED, RETURN_LOG_PROBS, RETURN_CONTEXT_LOGITS,
    RETURN_GENERATION_LOGITS, RETURN_PERF_METRICS, RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS,
    EXCLUDE_INPUT_IN_OUTPUT, STOP, STREAMING,
    OUTPUT_IDS, SEQUENCE_LENGTH, CUM_LOG_PROBS, OUTPUT_LOG_PROBS, CONTEXT_LOGITS, GENERATION_LOGITS, BATCH_INDEX,
    SEQUENCE_INDEX, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, KV_CACHE_ALLOC_NEW_BLOCKS, KV_CACHE_REUSED_BLOCKS,
    KV_CACHE_ALLOC_TOTAL_BLOCKS, ARRIVAL_TIME_NS, FIRST_SCHEDULED_TIME_NS, FIRST_TOKEN_TIME_NS, LAST_TOKEN_TIME_NS,
    ACCEPTANCE_RATE, TOTAL_ACCEPTED_DRAFT_TOKENS, TOTAL_DRAFT_TOKENS, DRAFT_INPUT_IDS,
)

# -------------------------------------------------------------- preprocessing's and postprocessing's tensors
# NVIDIA names them in capitals, some as tensorrt_llm's lowercase ones (END_ID, SEQUENCE_LENGTH): PRE_ and POST_.

PRE_QUERY = "QUERY"
PRE_REQUEST_OUTPUT_LEN = "REQUEST_OUTPUT_LEN"           # an input, and the output of the same name
PRE_BAD_WORDS_DICT = "BAD_WORDS_DICT"
PRE_STOP_WORDS_DICT = "STOP_WORDS_DICT"
PRE_EMBEDDING_BIAS_WORDS = "EMBEDDING_BIAS_WORDS"
PRE_EMBEDDING_BIAS_WEIGHTS = "EMBEDDING_BIAS_WEIGHTS"
PRE_END_ID = "END_ID"
PRE_PAD_ID = "PAD_ID"
PRE_INPUT_ID = "INPUT_ID"
PRE_REQUEST_INPUT_LEN = "REQUEST_INPUT_LEN"
PRE_DECODER_INPUT_ID = "DECODER_INPUT_ID"
PRE_REQUEST_DECODER_INPUT_LEN = "REQUEST_DECODER_INPUT_LEN"
PRE_BAD_WORDS_IDS = "BAD_WORDS_IDS"
PRE_STOP_WORDS_IDS = "STOP_WORDS_IDS"
PRE_EMBEDDING_BIAS = "EMBEDDING_BIAS"
PRE_OUT_END_ID = "OUT_END_ID"
PRE_OUT_PAD_ID = "OUT_PAD_ID"
#: The names above of preprocessing's tensors.
PREPROCESSING_NAMES = (PRE_QUERY, PRE_REQUEST_OUTPUT_LEN, PRE_BAD_WORDS_DICT, PRE_STOP_WORDS_DICT,
                       PRE_EMBEDDING_BIAS_WORDS, PRE_EMBEDDING_BIAS_WEIGHTS, PRE_END_ID, PRE_PAD_ID, PRE_INPUT_ID,
                       PRE_REQUEST_INPUT_LEN, PRE_DECODER_INPUT_ID, PRE_REQUEST_DECODER_INPUT_LEN, PRE_BAD_WORDS_IDS,
                       PRE_STOP_WORDS_IDS, PRE_EMBEDDING_BIAS, PRE_OUT_END_ID, PRE_OUT_PAD_ID)

POST_TOKENS_BATCH = "TOKENS_BATCH"
POST_SEQUENCE_LENGTH = "SEQUENCE_LENGTH"
POST_OUTPUT = "OUTPUT"
#: The names above of postprocessing's tensors.
POSTPROCESSING_NAMES = (POST_TOKENS_BATCH, POST_SEQUENCE_LENGTH, POST_OUTPUT)

#: The ensemble's own tensors between its steps (triton_contract.ENSEMBLE_STEPS), which tensorrt_llm_bls's wiring
#: names too: tensorrt_llm's output_ids and sequence_length on their way to postprocessing.
STEP_TOKENS_BATCH = "_TOKENS_BATCH"
STEP_SEQUENCE_LENGTH = "_SEQUENCE_LENGTH"
ENSEMBLE_STEP_NAMES = (STEP_TOKENS_BATCH, STEP_SEQUENCE_LENGTH)

# ------------------------------------------------------ the llmapi contract (one tensorrt_llm model; pytorch.py)

SAMPLING_PARAM_MAX_TOKENS = "sampling_param_max_tokens"
SAMPLING_PARAM_TEMPERATURE = "sampling_param_temperature"
SAMPLING_PARAM_TOP_K = "sampling_param_top_k"
SAMPLING_PARAM_TOP_P = "sampling_param_top_p"
SAMPLING_PARAM_SEED = "sampling_param_seed"
SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT = "sampling_param_exclude_input_from_output"
RETURN_FINISH_REASON = "return_finish_reason"
FINISH_REASON = "finish_reason"
#: The llmapi model's inputs and outputs, in the order its config.pbtxt declares them.
LLMAPI_INPUT_NAMES = (TEXT_INPUT, STREAMING, SAMPLING_PARAM_MAX_TOKENS, SAMPLING_PARAM_TEMPERATURE,
                      SAMPLING_PARAM_TOP_K, SAMPLING_PARAM_TOP_P, SAMPLING_PARAM_SEED,
                      SAMPLING_PARAM_EXCLUDE_INPUT_FROM_OUTPUT, RETURN_FINISH_REASON)
LLMAPI_OUTPUT_NAMES = (TEXT_OUTPUT, FINISH_REASON)


# ------------------------------------------------------------------------------------------ sampling ranges

class SamplingRange(NamedTuple):
    """The values a sampling parameter may take: a test (false for NaN too) and the range in words."""

    valid: Callable[[float], bool]
    allowed: str


#: What TensorRT-LLM's executor accepts (executor SamplingConfig::checkTemperature, checkTopK, checkTopP,
#: checkMinTokens), by parameter: the LLM API's SamplingParams refuses the same, and trtpipe's runtime
#: (runtime/sampling.py SamplingConfig) checks top_k, top_p and min_tokens with it.
SAMPLING_RANGES = {
    "temperature": SamplingRange(lambda v: v >= 0, ">= 0 (0: greedy)"),
    "top_k": SamplingRange(lambda v: v >= 0, ">= 0 (0: no top-k limit)"),
    "top_p": SamplingRange(lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_tokens": SamplingRange(lambda v: v >= 0, ">= 0"),
}
#: The same through the tensorrt_llm model's tensors: NVIDIA's tensorrtllm backend resets a runtime_top_p <= 0
#: to unset before the executor sees it (utils.cc@c2e65b8:558-563), so only a top_p above 1 is refused there.
TENSORRT_LLM_SAMPLING_RANGES = {**SAMPLING_RANGES, "top_p": SamplingRange(lambda v: v <= 1, "<= 1 (<= 0: unset)")}
#: parameter -> the tensor that carries it, in each contract (the ensemble's is the parameter's own name).
TENSORRT_LLM_SAMPLING_INPUTS = {"top_k": RUNTIME_TOP_K, "top_p": RUNTIME_TOP_P, "temperature": TEMPERATURE,
                                "min_tokens": MIN_TOKENS}
LLMAPI_SAMPLING_INPUTS = {"temperature": SAMPLING_PARAM_TEMPERATURE, "top_k": SAMPLING_PARAM_TOP_K,
                          "top_p": SAMPLING_PARAM_TOP_P}


def llmapi_sampling(read: Callable[[str, object], object]) -> tuple[tuple[float, int, float], str | None]:
    """An llmapi request's (temperature, top_k, top_p), unset ones at the LLM API's defaults (1.0, 0: no limit,
    1.0), and the refusal of the first outside its range (None when all are in range); `read(name, default)` reads
    one scalar input of the request."""
    values = (float(read(SAMPLING_PARAM_TEMPERATURE, 1.0)), int(read(SAMPLING_PARAM_TOP_K, 0)),
              float(read(SAMPLING_PARAM_TOP_P, 1.0)))
    for parameter_name, value in zip(("temperature", "top_k", "top_p"), values):
        error = sampling_error(parameter_name, value, LLMAPI_SAMPLING_INPUTS[parameter_name])
        if error:
            return values, error
    return values, None


def sampling_error(parameter: str, value, name: str | None = None, *, ranges: dict = SAMPLING_RANGES,
                   integer: bool = False, source: str = "") -> str | None:
    """None when `value` is in `parameter`'s range (`ranges`: SAMPLING_RANGES or TENSORRT_LLM_SAMPLING_RANGES);
    else the refusal, naming the value as the request does (`name`, default `parameter`):
    "NAME must be RANGE, got VALUE", with " (SOURCE)" after it when given. `integer`: it must be an integer too
    ("NAME must be an integer RANGE")."""
    allowed = ranges[parameter]
    if (not integer or isinstance(value, Integral)) and allowed.valid(value):
        return None
    shown = format(value, "g") if isinstance(value, Real) else repr(value)
    return (f"{name or parameter} must be {'an integer ' if integer else ''}{allowed.allowed}, got {shown}"
            + (f" ({source})" if source else ""))
