"""The architecture numbers of a supported causal LM: plain numbers, which every stage reads.

Reading them from a Hugging Face config or a checkpoint's, and everything that needs the model's family (its
tensors, its parameter count), is `pipeline.model.arch_config`'s: the family reads its own config fields
(biases, per-head q/k norms, extras such as Mistral's sliding window) into the flags here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import UserError


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    rotary_scaling: dict | None = None
    norm_epsilon: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    dtype: str = "float16"
    qkv_bias: bool = False       # q/k/v projections have a bias
    dense_bias: bool = False     # the output projection has a bias
    mlp_bias: bool = False
    qk_norm: bool = False        # per-head RMSNorm of q and k before rope (Qwen3)
    extra: dict = field(default_factory=dict)

    @property
    def rope_type(self) -> str | None:
        s = self.rotary_scaling if isinstance(self.rotary_scaling, dict) else {}
        return s.get("rope_type") or s.get("type")

    @property
    def sliding_window(self) -> int | None:
        return self.extra.get("sliding_window")

    def validate(self, where: str) -> None:
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                 "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                 "num_key_value_heads": self.num_key_value_heads, "head_size": self.head_size,
                 "intermediate_size": self.intermediate_size}
        for key, value in sizes.items():
            if value < 1:
                raise UserError(f"{where}: {key} must be positive (got {value})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple "
                            f"of num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise UserError(f"{where}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    # Derived sizes used by convert, plan and the runtime.
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    def to_dict(self) -> dict:
        return asdict(self)

