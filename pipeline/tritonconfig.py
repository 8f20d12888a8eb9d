"""Triton model configurations as `ModelConfig` protobuf messages (tritonclient's `model_config_pb2`).

The tensors each model declares are NVIDIA's (`triton_contract`). Configs are built here and serialized with
protobuf `text_format`; nothing is string-substituted.
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


LOGITS = "LOGITS"  # placeholder data type resolved to the deployment's logits dtype when building


@dataclass(frozen=True)
class Step:
    """One ensemble step: the model's tensor name -> the ensemble tensor name, both ways."""

    model_name: str
    input_map: dict[str, str]
    output_map: dict[str, str]


@dataclass(frozen=True)
class Batching:
    """The dynamic_batching block; None fields are not written (Triton's defaults apply)."""

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_microseconds: int | None = None
    max_queue_size: int | None = None
    priority_levels: int = 0            # 0: Triton's default (no levels)
    default_priority_level: int = 0


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
    if batching.priority_levels:
        message.priority_levels = batching.priority_levels
        message.default_priority_level = batching.default_priority_level


def to_pbtxt(config) -> str:
    return text_format.MessageToString(config)


def parse_pbtxt(text: str):
    """Parse config.pbtxt text with the real schema; raises google.protobuf.text_format.ParseError."""
    return text_format.Parse(text, _pb2().ModelConfig())


def dtype_name(value: int) -> str:
    return _pb2().DataType.Name(value)
