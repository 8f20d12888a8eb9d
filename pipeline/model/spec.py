"""The declarative shape of a model family: which tensors a decoder layer has, how each maps from Hugging
Face names to TensorRT-LLM names, how tensor parallelism splits it, and what the engine fuses.

Every stage reads a family through this one table: convert (the source tensors it expects and the rank
files it writes), the reference runtime (the tensors a rank file must hold and how to merge them back),
calibrate (the quantizable linears, which are row-parallel, which share an input or are fused) and plan
(bytes and FLOPs per layer). Sizes are named dimensions ("hidden", "q", "kv", "intermediate", "head")
that `dims` turns into numbers for a given architecture.

Parallel kinds (TensorRT-LLM's ColumnLinear / RowLinear, `Linear.postprocess` for qkv):
- column: output rows split into tp contiguous blocks (weight and bias on dim 0);
- row: input columns split into tp blocks (weight on dim 1); the bias is whole on every rank;
- qkv: q, k and v split by heads and concatenated per rank as cat(q_r, k_r, v_r); when tp exceeds the
  K/V heads each K/V head is repeated tp / kv_heads times, so rank r holds K/V head r * kv_heads // tp.
Norms are replicated on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from ..arch import ModelArch

COLUMN, ROW, QKV = "column", "row", "qkv"
HF_LAYER = "model.layers.{}."
TRT_LAYER = "transformer.layers.{}."


@dataclass(frozen=True)
class Part:
    """A Hugging Face module (without `.weight`) and the named size of its output features."""

    hf: str
    rows: str


@dataclass(frozen=True)
class LinearSpec:
    """One TensorRT-LLM linear of a decoder layer (e.g. `attention.qkv`), made of one or more HF modules."""

    name: str
    parts: tuple[Part, ...]
    inputs: str                         # named size of the input features
    parallel: str                       # COLUMN | ROW | QKV
    bias: str                           # the ModelArch flag that gives it a bias
    shares_input_with: str | None = None    # reads the same input as that linear (statistics recorded once)
    fused_with: str | None = None           # the engine runs both as one GEMM: their scales must agree
    input_norm: str | None = None           # the NormSpec whose output it reads (modelopt's HF layout folds AWQ's
                                            # input smoothing into that norm's weight)
    input_from: str | None = None           # the HF part whose output rows are its input channels, scaled through
                                            # one for one (v_proj for o_proj, per K/V head; up_proj for down_proj):
                                            # a layout without pre_quant_scale (AWQ's) folds the smoothing there

    def out_features(self, dims: Mapping[str, int]) -> int:
        return sum(dims[p.rows] for p in self.parts)


@dataclass(frozen=True)
class NormSpec:
    """An RMSNorm weight of a decoder layer: [hidden] on the residual stream, or [head] applied per head."""

    name: str
    hf: str
    size: str
    feature: str | None = None          # the ModelArch flag that adds it (None: always there)


@dataclass(frozen=True)
class Family:
    """A model family: its decoder layer, its model-level tensors and how its configs are read and written."""

    name: str
    architectures: tuple[str, ...]
    gguf_model_types: Mapping[str, str]             # GGUF `model_type` -> architecture
    linears: tuple[LinearSpec, ...]
    norms: tuple[NormSpec, ...]
    #: (architecture, HF config, where) -> the ModelArch feature fields (biases, q/k norms, extras)
    hf_features: Callable[[str, dict, str], dict]
    #: (architecture, TensorRT-LLM checkpoint config) -> the same fields
    checkpoint_features: Callable[[str, dict], dict]
    #: the family's own TensorRT-LLM config.json keys for an architecture
    checkpoint_fields: Callable[["ModelArch"], dict]
    #: the family's own Hugging Face config.json keys (model_type, bias flags, ...), the inverse of hf_features
    hf_fields: Callable[["ModelArch"], dict]
    #: (HF name, TensorRT-LLM name) of the model-level tensors
    embedding: tuple[str, str] = ("model.embed_tokens.weight", "transformer.vocab_embedding.weight")
    final_norm: tuple[str, str] = ("model.norm.weight", "transformer.ln_f.weight")
    lm_head: tuple[str, str] = ("lm_head.weight", "lm_head.weight")
    #: source tensors that are not weights (buffers some checkpoints saved) and are ignored
    ignored_sources: tuple[str, ...] = field(default=(".rotary_emb.inv_freq",))

    def linear(self, name: str) -> LinearSpec:
        for lin in self.linears:
            if lin.name == name:
                return lin
        raise KeyError(f"{self.name} has no linear {name!r}")

    def layer_norms(self, arch: "ModelArch") -> tuple[NormSpec, ...]:
        return tuple(n for n in self.norms if n.feature is None or getattr(arch, n.feature))

    def has_bias(self, lin: LinearSpec, arch: "ModelArch") -> bool:
        return bool(getattr(arch, lin.bias))

    @property
    def linear_names(self) -> tuple[str, ...]:
        return tuple(lin.name for lin in self.linears)

    @property
    def row_parallel(self) -> tuple[str, ...]:
        return tuple(lin.name for lin in self.linears if lin.parallel == ROW)

    def partner(self, name: str) -> str | None:
        """The linear `name` (layer-relative) is fused with, if any."""
        return self.linear(name).fused_with

    def input_source(self, name: str) -> str:
        """The linear whose input statistics `name` uses (itself unless it shares another's input)."""
        return self.linear(name).shares_input_with or name


def dims(arch: "ModelArch") -> dict[str, int]:
    """The named sizes of an architecture (whole model, before any tensor-parallel split)."""
    return {"hidden": arch.hidden_size, "q": arch.q_size, "kv": arch.kv_size, "head": arch.head_size,
            "intermediate": arch.intermediate_size, "vocab": arch.vocab_size}
