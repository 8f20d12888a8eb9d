"""EAGLE-3 heads: what `--speculative eagle:HEAD` drafts with on the PyTorch backend.

An EAGLE-3 head (a Hugging Face directory or hub id whose config.json names an Eagle3 architecture, e.g.
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) is a decoder layer or a few that draft from hidden states the target captures
from three of its own layers. TensorRT-LLM's PyTorch backend loads it as `Eagle3ForCausalLM`
(tensorrt_llm/_torch/models/modeling_speculative.py, docs/upstream-facts.md S7), which holds:
- `fc`: the three captured hidden states (3 x `target_hidden_size`, else `hidden_size`) down to `hidden_size`;
- the first layer's attention reading 2 x `hidden_size` (the token's embedding beside the hidden state), its MLP and
  norms; later layers (a head with `num_hidden_layers` > 1) are plain decoder layers;
- an lm_head over the draft vocabulary (`draft_vocab_size`, mapped to the target's ids by `d2t`, int64);
- an embedding table only when `target_hidden_size` differs from `hidden_size` (else the target's is shared).

Its KV cache (one-model EAGLE-3, the default `eagle3_one_model`) lives in the target's KV cache manager, in the
target's cache dtype: `get_num_spec_layers` counts `num_eagle_layers` layers there, which the 1.2 line sets to
max_draft_len, and the head's own `num_hidden_layers` in 1.3.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..arch import ModelArch
from ..errors import UserError, read_config_json
from ..precisions import DTYPE_CODES, FLOAT_DTYPES
from ..presets import PRESETS
from ..safetensors_stream import ITEM_SIZE
from ..sources import locate_config
from .memory import kv_bytes_per_token
from .schema import ModelInfo

@dataclass(frozen=True)
class EagleHead:
    """An EAGLE-3 head's sizes, as its config.json gives them."""

    name: str                   # as --speculative named it
    path: Path | None           # its local directory (None: a hub id, downloaded where it is served)
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    vocab_size: int             # the target's: drafts are mapped into it
    draft_vocab_size: int       # the head's own lm_head
    dtype: str
    bias: bool

    @property
    def arch(self) -> ModelArch:
        """The head as a model of its layers over its draft vocabulary: what a drafting pass runs (its step is timed
        as such a Llama)."""
        return ModelArch("LlamaForCausalLM", self.draft_vocab_size, self.hidden_size, self.intermediate_size,
                         self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads, self.head_size,
                         max_position_embeddings=1, dtype=self.dtype)

    @property
    def precision(self) -> str:
        """The precision the LLM API loads the head at: its own float dtype (it is not quantized)."""
        return next(p for p, dtype in FLOAT_DTYPES.items() if dtype == self.dtype)

    def model_info(self) -> ModelInfo:
        """The head as the plan names its draft: by its directory (deploy copies it) or its hub id."""
        return ModelInfo(name=self.name, source="hf-dir" if self.path else "config",
                         path=str(self.path) if self.path else None, arch=self.arch)

    def parameter_count(self) -> int:
        """The weights `Eagle3ForCausalLM` loads in the head's dtype (module docstring; d2t, int64, is added by
        `weights_bytes_per_rank`)."""
        h = self.hidden_size
        q, kv = self.num_attention_heads * self.head_size, self.num_key_value_heads * self.head_size
        fc = 3 * self.target_hidden_size * h + (h if self.bias else 0)
        attention = [2 * h * (q + 2 * kv) + q * h] + [h * (q + 2 * kv) + q * h] * (self.num_hidden_layers - 1)
        layers = sum(attention) + self.num_hidden_layers * (3 * h * self.intermediate_size + 3 * h)
        embedding = self.vocab_size * h if self.target_hidden_size != h else 0
        return fc + layers + self.draft_vocab_size * h + h + embedding

    def weights_bytes_per_rank(self, tp: int) -> int:
        d2t = ITEM_SIZE["I64"] * self.draft_vocab_size if self.draft_vocab_size != self.vocab_size else 0
        return self.parameter_count() * ITEM_SIZE[DTYPE_CODES[self.dtype]] // tp + d2t

    def kv_layers(self, tensorrt_llm_version: str, draft_len: int) -> int:
        """The layers the head adds to the target's KV cache (module docstring)."""
        return draft_len if tensorrt_llm_version.startswith("1.2") else self.num_hidden_layers

    def kv_bytes_per_token(self, kv_cache_dtype: str, tp: int, tensorrt_llm_version: str, draft_len: int) -> int:
        """Every draft layer sits on the last pipeline stage (get_pp_layers), so one GPU holds all of them."""
        layers = replace(self.arch, num_hidden_layers=self.kv_layers(tensorrt_llm_version, draft_len))
        return kv_bytes_per_token(layers, kv_cache_dtype, tp, 1)


def read_eagle_head(name: str) -> EagleHead:
    """The EAGLE-3 head `eagle:NAME` names (a directory or a hub id); UserError for a model that is not one."""
    if name in PRESETS:
        raise UserError(f"--speculative eagle:{name} names a model preset, not an EAGLE-3 head: name the head's "
                        "directory or hub id (e.g. eagle:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B for Llama 3.1 8B)")
    directory, hub_id = locate_config(name)
    config = read_config_json(directory, f"{directory} has no config.json; an EAGLE-3 head is a Hugging Face "
                                         "directory")
    architectures = config.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in architectures):
        raise UserError(f"--speculative eagle:{name}: its config.json names {architectures or 'no architecture'}, "
                        "not an EAGLE-3 head (e.g. LlamaForCausalLMEagle3): the PyTorch backend drafts with EAGLE-3 "
                        "heads only (EAGLE 1 and 2 checkpoints do not load there)")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
        head = EagleHead(
            name=name, path=None if hub_id else directory, hidden_size=hidden,
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config.get("num_hidden_layers") or 1), num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_size=int(config.get("head_dim") or hidden // heads), vocab_size=vocab,
            draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), bias=bool(config.get("bias")))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"--speculative eagle:{name}: its config.json lacks a size an EAGLE-3 head has ({exc})") \
            from None
    if head.dtype not in FLOAT_DTYPES.values():
        raise UserError(f"--speculative eagle:{name}: torch_dtype {head.dtype!r} is not a dtype a head ships in "
                        f"({', '.join(FLOAT_DTYPES.values())})")
    return head


def check_head_fits(head: EagleHead, target: ModelArch, target_name: str) -> None:
    """UserError unless the head drafts for `target`: it reads the target's hidden states and maps its drafts
    into the target's vocabulary."""
    if head.target_hidden_size != target.hidden_size:
        raise UserError(f"--speculative eagle:{head.name}: the head reads hidden states of width "
                        f"{head.target_hidden_size}, {target_name}'s are {target.hidden_size}: it was trained for "
                        "another model")
    if head.vocab_size != target.vocab_size:
        raise UserError(f"--speculative eagle:{head.name}: the head maps its drafts into a vocabulary of "
                        f"{head.vocab_size} tokens, {target_name}'s has {target.vocab_size}: it was trained for "
                        "another model")
