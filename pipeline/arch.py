"""The architecture numbers of a supported causal LM, read from a Hugging Face config or a checkpoint's.

Which tensors the model has is its family's business (`pipeline.model`): the family reads its own
config fields (biases, per-head q/k norms, extras such as Mistral's sliding window) into the flags here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .errors import UserError
from .model import ARCHITECTURES, family_of
from .model.layout import check_parallelism
from .model.spec import Family, dims

_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
           "torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


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

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "ModelArch":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        family = family_of(arch)
        if family is None:
            raise UserError(f"{where}: unknown architecture {arch!r}; trtpipe supports {', '.join(ARCHITECTURES)}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            arch_obj = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_size=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
                rotary_base=float(cfg.get("rope_theta", 10000.0)),
                rotary_scaling=cfg.get("rope_scaling"),
                norm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)),
                hidden_act=cfg.get("hidden_act", "silu"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                dtype=_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), "float16"),
                **family.hf_features(arch, cfg, where),
            )
        except KeyError as exc:
            raise UserError(f"{where}: missing field {exc}") from None
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise UserError(f"{where}: invalid field value ({exc})") from None
        arch_obj.validate(where)
        return arch_obj

    @classmethod
    def from_checkpoint_config(cls, cfg: dict, where: str = "config.json") -> "ModelArch":
        """The numbers of a TensorRT-LLM checkpoint's config.json (the names convert writes)."""
        architecture = cfg.get("architecture")
        family = family_of(architecture)
        if family is None:
            raise UserError(f"{where}: unknown architecture {architecture!r}; trtpipe supports "
                            f"{', '.join(ARCHITECTURES)}")
        hf_names = {"architectures": [architecture], "head_dim": cfg.get("head_size"),
                    "rope_theta": cfg.get("rotary_base", 10000.0), "rope_scaling": cfg.get("rotary_scaling"),
                    "rms_norm_eps": cfg.get("norm_epsilon", 1e-5), "torch_dtype": cfg.get("dtype")}
        arch = cls.from_hf_config({**cfg, **hf_names, "attention_bias": False, "use_sliding_window": False}, where)
        return replace(arch, **family.checkpoint_features(architecture, cfg))

    @property
    def family(self) -> Family:
        return family_of(self.architecture)

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

    def check_parallelism(self, tp: int, pp: int) -> None:
        """The tp x pp layouts TensorRT-LLM can shard this model into (pipeline.model.layout's rules)."""
        check_parallelism(self, tp, pp)

    # Derived sizes used by convert, plan and the runtime.
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    def parameter_count(self) -> int:
        """Every weight the family's spec gives this model (biases and norms included)."""
        family, sizes = self.family, dims(self)
        per_layer = sum(lin.out_features(sizes) * (sizes[lin.inputs] + family.has_bias(lin, self))
                        for lin in family.linears)
        per_layer += sum(sizes[n.size] for n in family.layer_norms(self))
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_hidden_layers * per_layer + self.hidden_size + lm_head

    def to_hf_config(self, dtype: str) -> dict:
        """A Hugging Face config.json of these numbers (from_hf_config's inverse), weights in `dtype`."""
        return {"architectures": [self.architecture], "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_size, "max_position_embeddings": self.max_position_embeddings,
                "rope_theta": self.rotary_base, "rope_scaling": self.rotary_scaling, "rms_norm_eps": self.norm_epsilon,
                "hidden_act": self.hidden_act, "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": dtype,
                **self.family.hf_fields(self)}

    def to_dict(self) -> dict:
        return asdict(self)

