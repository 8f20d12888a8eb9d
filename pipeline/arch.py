"""The architecture numbers of a supported causal LM, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

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
    attn_bias: bool = False
    mlp_bias: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "ModelArch":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"{where}: unknown architecture {arch!r}; trtpipe supports "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
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
                attn_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                extra={k: cfg[k] for k in ("sliding_window",) if cfg.get(k) is not None},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{where}: missing or invalid field {exc}") from None
        arch_obj.validate(where)
        return arch_obj

    @classmethod
    def from_checkpoint_config(cls, cfg: dict, where: str = "config.json") -> "ModelArch":
        """The numbers of a TensorRT-LLM checkpoint's config.json (the names convert writes)."""
        hf_names = {"architectures": [cfg.get("architecture")], "head_dim": cfg.get("head_size"),
                    "rope_theta": cfg.get("rotary_base", 10000.0), "rope_scaling": cfg.get("rotary_scaling"),
                    "rms_norm_eps": cfg.get("norm_epsilon", 1e-5), "torch_dtype": cfg.get("dtype"),
                    "attention_bias": cfg.get("attn_bias", False)}
        return cls.from_hf_config({**cfg, **hf_names}, where)

    def validate(self, where: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple "
                            f"of num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise UserError(f"{where}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    def check_parallelism(self, tp: int, pp: int) -> None:
        """The tp x pp layouts TensorRT-LLM can shard this model into (convert and plan both ask here).

        Attention heads and the MLP are split over tp (K/V heads duplicated when tp exceeds them); each
        pipeline stage holds the same number of decoder layers.
        """
        if tp < 1 or pp < 1:
            raise UserError(f"--tp and --pp must be positive (got tp={tp}, pp={pp})")
        if self.num_attention_heads % tp:
            raise UserError(f"--tp {tp} does not divide num_attention_heads {self.num_attention_heads}")
        kv = self.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise UserError(f"--tp {tp} and num_key_value_heads {kv}: one must be a multiple of the other "
                            "(K/V heads are split, or duplicated when tp > num_key_value_heads)")
        if self.num_hidden_layers % pp:
            raise UserError(f"--pp {pp} does not divide num_hidden_layers {self.num_hidden_layers}")
        if self.intermediate_size % tp:
            raise UserError(f"--tp {tp} does not divide intermediate_size {self.intermediate_size}")

    # Derived sizes used by convert, plan and the runtime.
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    def parameter_count(self) -> int:
        h, i, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + n * per_layer + h + lm_head

    def to_dict(self) -> dict:
        return asdict(self)
