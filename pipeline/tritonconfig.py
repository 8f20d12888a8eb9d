"""Triton model configurations as `ModelConfig` protobuf messages (tritonclient's `model_config_pb2`).

The tensor contract is that of NVIDIA's `inflight_batcher_llm` templates (tensorrtllm_backend
`all_models/inflight_batcher_llm@c2e65b8`, docs/upstream-facts.md §B), restricted to decoder-only text models:
the multimodal, encoder-decoder, prompt-tuning, LoRA, speculative-decoding and guided-decoding tensors
are not declared. Every name, data type and shape that is declared is NVIDIA's, so clients written for
NVIDIA's deployments work unchanged. Configs are built here and serialized with protobuf `text_format`;
nothing is string-substituted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import text_format

from .errors import UserError


def _pb2():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:  # tritonclient without the grpc extra, or not installed
        raise UserError(f"the Triton config schema needs tritonclient[grpc] ({exc}); "
                        "install trtpipe's serve extra: pip install 'trtpipe[serve]'") from None
    return model_config_pb2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                      # Triton data type name, e.g. "TYPE_INT32"
    dims: tuple[int, ...]           # without the batch dimension
    optional: bool = False
    scalar: bool = False            # reshape: { shape: [ ] }
    ragged: bool = False            # allow_ragged_batch


def _t(name: str, dtype: str, dims=(1,), *, opt: bool = False, scalar: bool = False,
       ragged: bool = False) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(dims), opt, scalar, ragged)


LOGITS = "LOGITS"  # placeholder data type resolved to the deployment's logits dtype when building

ENSEMBLE_INPUTS = (
    _t("text_input", "TYPE_STRING"),
    _t("max_tokens", "TYPE_INT32"),
    _t("num_return_sequences", "TYPE_INT32", opt=True),
    _t("bad_words", "TYPE_STRING", (-1,), opt=True),
    _t("stop_words", "TYPE_STRING", (-1,), opt=True),
    _t("exclude_input_in_output", "TYPE_BOOL", opt=True),
    _t("end_id", "TYPE_INT32", opt=True),
    _t("pad_id", "TYPE_INT32", opt=True),
    _t("top_k", "TYPE_INT32", opt=True),
    _t("top_p", "TYPE_FP32", opt=True),
    _t("temperature", "TYPE_FP32", opt=True),
    _t("length_penalty", "TYPE_FP32", opt=True),
    _t("repetition_penalty", "TYPE_FP32", opt=True),
    _t("min_tokens", "TYPE_INT32", opt=True),
    _t("presence_penalty", "TYPE_FP32", opt=True),
    _t("frequency_penalty", "TYPE_FP32", opt=True),
    _t("seed", "TYPE_UINT64", opt=True),
    _t("return_log_probs", "TYPE_BOOL", opt=True),
    _t("return_context_logits", "TYPE_BOOL", opt=True),
    _t("return_generation_logits", "TYPE_BOOL", opt=True),
    _t("beam_width", "TYPE_INT32", opt=True),
    _t("stream", "TYPE_BOOL", opt=True),
    _t("embedding_bias_words", "TYPE_STRING", (-1,), opt=True),
    _t("embedding_bias_weights", "TYPE_FP32", (-1,), opt=True),
)

ENSEMBLE_OUTPUTS = (
    _t("text_output", "TYPE_STRING", (-1,)),
    _t("cum_log_probs", "TYPE_FP32", (-1,)),
    _t("output_log_probs", "TYPE_FP32", (-1, -1)),
    _t("context_logits", LOGITS, (-1, -1)),
    _t("generation_logits", LOGITS, (-1, -1, -1)),
    _t("batch_index", "TYPE_INT32"),
    _t("sequence_index", "TYPE_INT32"),
)

PREPROCESSING_INPUTS = (
    _t("QUERY", "TYPE_STRING"),
    _t("REQUEST_OUTPUT_LEN", "TYPE_INT32"),
    _t("BAD_WORDS_DICT", "TYPE_STRING", (-1,), opt=True),
    _t("STOP_WORDS_DICT", "TYPE_STRING", (-1,), opt=True),
    _t("EMBEDDING_BIAS_WORDS", "TYPE_STRING", (-1,), opt=True),
    _t("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", (-1,), opt=True),
    _t("END_ID", "TYPE_INT32", opt=True),
    _t("PAD_ID", "TYPE_INT32", opt=True),
)

PREPROCESSING_OUTPUTS = (
    _t("INPUT_ID", "TYPE_INT32", (-1,)),
    _t("REQUEST_INPUT_LEN", "TYPE_INT32"),
    _t("BAD_WORDS_IDS", "TYPE_INT32", (2, -1)),
    _t("STOP_WORDS_IDS", "TYPE_INT32", (2, -1)),
    _t("EMBEDDING_BIAS", "TYPE_FP32", (-1,)),
    _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", (-1,)),
    _t("OUT_END_ID", "TYPE_INT32"),
    _t("OUT_PAD_ID", "TYPE_INT32"),
)

_SCALAR_OPTIONS = dict(opt=True, scalar=True)
TENSORRT_LLM_INPUTS = (
    _t("input_ids", "TYPE_INT32", (-1,), ragged=True),
    _t("input_lengths", "TYPE_INT32", scalar=True),
    _t("request_output_len", "TYPE_INT32", scalar=True),
    _t("num_return_sequences", "TYPE_INT32", **_SCALAR_OPTIONS),
    _t("end_id", "TYPE_INT32", **_SCALAR_OPTIONS),
    _t("pad_id", "TYPE_INT32", **_SCALAR_OPTIONS),
    _t("stop_words_list", "TYPE_INT32", (2, -1), opt=True, ragged=True),
    _t("bad_words_list", "TYPE_INT32", (2, -1), opt=True, ragged=True),
    _t("embedding_bias", "TYPE_FP32", (-1,), opt=True, ragged=True),
    _t("beam_width", "TYPE_INT32", **_SCALAR_OPTIONS),
    _t("temperature", "TYPE_FP32", **_SCALAR_OPTIONS),
    _t("runtime_top_k", "TYPE_INT32", **_SCALAR_OPTIONS),
    _t("runtime_top_p", "TYPE_FP32", **_SCALAR_OPTIONS),
    _t("len_penalty", "TYPE_FP32", **_SCALAR_OPTIONS),
    _t("repetition_penalty", "TYPE_FP32", **_SCALAR_OPTIONS),
    _t("min_tokens", "TYPE_INT32", **_SCALAR_OPTIONS),
    _t("presence_penalty", "TYPE_FP32", **_SCALAR_OPTIONS),
    _t("frequency_penalty", "TYPE_FP32", **_SCALAR_OPTIONS),
    _t("seed", "TYPE_UINT64", **_SCALAR_OPTIONS),
    _t("return_log_probs", "TYPE_BOOL", **_SCALAR_OPTIONS),
    _t("return_context_logits", "TYPE_BOOL", **_SCALAR_OPTIONS),
    _t("return_generation_logits", "TYPE_BOOL", **_SCALAR_OPTIONS),
    _t("exclude_input_in_output", "TYPE_BOOL", **_SCALAR_OPTIONS),
    _t("streaming", "TYPE_BOOL", **_SCALAR_OPTIONS),
)

TENSORRT_LLM_OUTPUTS = (
    _t("output_ids", "TYPE_INT32", (-1, -1)),
    _t("sequence_length", "TYPE_INT32", (-1,)),
    _t("cum_log_probs", "TYPE_FP32", (-1,)),
    _t("output_log_probs", "TYPE_FP32", (-1, -1)),
    _t("context_logits", LOGITS, (-1, -1)),
    _t("generation_logits", LOGITS, (-1, -1, -1)),
    _t("batch_index", "TYPE_INT32"),
    _t("sequence_index", "TYPE_INT32"),
)

POSTPROCESSING_INPUTS = (
    _t("TOKENS_BATCH", "TYPE_INT32", (-1, -1)),
    _t("SEQUENCE_LENGTH", "TYPE_INT32", (-1,)),
)
POSTPROCESSING_OUTPUTS = (_t("OUTPUT", "TYPE_STRING", (-1,)),)


@dataclass(frozen=True)
class Step:
    """One ensemble step: the model's tensor name -> the ensemble tensor name, both ways."""

    model_name: str
    input_map: dict[str, str]
    output_map: dict[str, str]


def _same(*names: str) -> dict[str, str]:
    return {n: n for n in names}


ENSEMBLE_STEPS = (
    Step("preprocessing",
         {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
          "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
          "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id"},
         {"REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "INPUT_ID": "_INPUT_ID",
          "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
          "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
          "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"}),
    Step("tensorrt_llm",
         {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
          "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
          "pad_id": "_PREPROCESSOR_PAD_ID", "embedding_bias": "_EMBEDDING_BIAS",
          "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
          "runtime_top_k": "top_k", "runtime_top_p": "top_p", "len_penalty": "length_penalty",
          "streaming": "stream",
          **_same("exclude_input_in_output", "temperature", "repetition_penalty", "min_tokens",
                  "presence_penalty", "frequency_penalty", "seed", "return_log_probs",
                  "return_context_logits", "return_generation_logits", "num_return_sequences",
                  "beam_width")},
         {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
          **_same("cum_log_probs", "output_log_probs", "context_logits", "generation_logits",
                  "batch_index", "sequence_index")}),
    Step("postprocessing",
         {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
         {"OUTPUT": "text_output"}),
)


@dataclass(frozen=True)
class Batching:
    """The dynamic_batching block; None fields are not written (Triton's defaults apply)."""

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_microseconds: int | None = None
    max_queue_size: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything one model's config.pbtxt says."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    backend: str | None = None
    platform: str | None = None
    batching: Batching | None = None
    decoupled: bool | None = None
    instance_count: int | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()


def build_model_config(spec: ModelSpec, logits_dtype: str = "TYPE_FP32"):
    """The `ModelConfig` protobuf message for `spec`."""
    pb2 = _pb2()
    config = pb2.ModelConfig(name=spec.name, max_batch_size=spec.max_batch_size)
    if spec.backend:
        config.backend = spec.backend
    if spec.platform:
        config.platform = spec.platform
    for tensor in spec.inputs:
        _fill_tensor(config.input.add(), tensor, pb2, logits_dtype, is_input=True)
    for tensor in spec.outputs:
        _fill_tensor(config.output.add(), tensor, pb2, logits_dtype, is_input=False)
    if spec.decoupled is not None:
        config.model_transaction_policy.decoupled = spec.decoupled
    if spec.batching is not None:
        _fill_batching(config.dynamic_batching, spec.batching)
    if spec.instance_count is not None:
        config.instance_group.add(count=spec.instance_count, kind=pb2.ModelInstanceGroup.KIND_CPU)
    for key, value in spec.parameters.items():
        if not isinstance(value, str):
            raise TypeError(f"parameter {key} of {spec.name} must be a string, got {value!r}")
        config.parameters[key].string_value = value
    for step in spec.steps:
        pb_step = config.ensemble_scheduling.step.add(model_name=step.model_name, model_version=-1)
        for key, value in step.input_map.items():
            pb_step.input_map[key] = value
        for key, value in step.output_map.items():
            pb_step.output_map[key] = value
    return config


def _fill_tensor(message, tensor: TensorSpec, pb2, logits_dtype: str, is_input: bool) -> None:
    message.name = tensor.name
    message.data_type = pb2.DataType.Value(logits_dtype if tensor.dtype == LOGITS else tensor.dtype)
    message.dims.extend(tensor.dims)
    if tensor.scalar:
        message.reshape.SetInParent()  # reshape: { shape: [ ] }
    if is_input:
        message.optional = tensor.optional
        message.allow_ragged_batch = tensor.ragged


def _fill_batching(message, batching: Batching) -> None:
    message.SetInParent()  # `dynamic_batching { }` turns the dynamic batcher on with Triton's defaults
    message.preferred_batch_size.extend(batching.preferred_batch_sizes)
    if batching.max_queue_delay_microseconds is not None:
        message.max_queue_delay_microseconds = batching.max_queue_delay_microseconds
    if batching.max_queue_size is not None:
        message.default_queue_policy.max_queue_size = batching.max_queue_size


def to_pbtxt(config) -> str:
    return text_format.MessageToString(config)


def parse_pbtxt(text: str):
    """Parse config.pbtxt text with the real schema; raises google.protobuf.text_format.ParseError."""
    return text_format.Parse(text, _pb2().ModelConfig())


def dtype_name(value: int) -> str:
    return _pb2().DataType.Name(value)
