"""The checkpoint's config.json, read and checked for what the reference runtime can execute."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, read_config_json
from ..precisions import KV_CACHE_QUANT_ALGO, QUANT_ALGO

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
DTYPES = ("float16", "bfloat16", "float32")
QUANT_ALGOS = (None, *QUANT_ALGO.values())
KV_CACHE_QUANT_ALGOS = (None, *KV_CACHE_QUANT_ALGO.values())
ROPE_TYPES = (None, "default", "linear", "llama3")


@dataclass(frozen=True)
class RuntimeConfig:
    """The fields of a TensorRT-LLM Llama checkpoint config.json the runtime depends on."""

    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float
    rotary_base: float
    rotary_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    share_embedding_table: bool
    use_parallel_embedding: bool
    embedding_sharding_dim: int
    attn_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    tp_size: int
    pp_size: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    exclude_modules: tuple[str, ...]

    @property
    def q_heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        """K/V heads a tp rank holds: a share of them, or one duplicated head when tp > num_kv_heads."""
        return max(self.num_kv_heads // self.tp_size, 1)

    @property
    def rope_type(self) -> str | None:
        s = self.rotary_scaling or {}
        return s.get("rope_type") or s.get("type")


def read_config(ckpt_dir: Path) -> tuple[dict, RuntimeConfig]:
    raw = read_config_json(ckpt_dir, f"{ckpt_dir} has no config.json; it is not a TensorRT-LLM checkpoint directory")
    return raw, parse_config(raw, str(Path(ckpt_dir) / "config.json"))


def parse_config(raw: dict, where: str) -> RuntimeConfig:
    def need(key: str, kind=int):
        if raw.get(key) is None:
            raise UserError(f"{where}: missing field {key!r}")
        try:
            return kind(raw[key])
        except (TypeError, ValueError):
            raise UserError(f"{where}: field {key!r} has invalid value {raw[key]!r}") from None

    mapping = raw.get("mapping") or {}
    quant = raw.get("quantization") or {}
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    tie = bool(raw.get("tie_word_embeddings", False))
    cfg = RuntimeConfig(
        architecture=need("architecture", str),
        dtype=need("dtype", str),
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_size=int(raw.get("head_size") or hidden // heads),
        intermediate_size=need("intermediate_size"),
        norm_epsilon=float(raw.get("norm_epsilon", 1e-5)),
        rotary_base=float(raw.get("rotary_base", 10000.0)),
        rotary_scaling=raw.get("rotary_scaling"),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        tie_word_embeddings=tie,
        share_embedding_table=bool(raw.get("share_embedding_table", False)),
        use_parallel_embedding=bool(raw.get("use_parallel_embedding", False)),
        embedding_sharding_dim=int(raw.get("embedding_sharding_dim", 0)),
        attn_bias=bool(raw.get("attn_bias", raw.get("bias", False))),
        mlp_bias=bool(raw.get("mlp_bias", raw.get("bias", False))),
        sliding_window=raw.get("sliding_window"),
        tp_size=int(mapping.get("tp_size", 1)),
        pp_size=int(mapping.get("pp_size", 1)),
        quant_algo=quant.get("quant_algo"),
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        exclude_modules=tuple(quant.get("exclude_modules") or ()),
    )
    check_supported(cfg, raw, where)
    return cfg


def check_supported(cfg: RuntimeConfig, raw: dict, where: str) -> None:
    def fail(msg: str):
        raise UserError(f"{where}: {msg}")

    if cfg.architecture not in ARCHITECTURES:
        fail(f"architecture {cfg.architecture!r} is not supported by the reference runtime "
             f"(supported: {', '.join(ARCHITECTURES)})")
    if cfg.dtype not in DTYPES:
        fail(f"dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if raw.get("hidden_act", "silu") != "silu":
        fail(f"hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
    if raw.get("position_embedding_type", "rope_gpt_neox") != "rope_gpt_neox":
        fail(f"position_embedding_type {raw.get('position_embedding_type')!r} is not supported "
             "(only 'rope_gpt_neox')")
    if float(raw.get("rotary_pct", 1.0)) != 1.0:
        fail(f"rotary_pct {raw.get('rotary_pct')} is not supported (only 1.0)")
    if cfg.rotary_scaling is not None and not isinstance(cfg.rotary_scaling, dict):
        fail(f"rotary_scaling must be an object or null, not {cfg.rotary_scaling!r}")
    if cfg.rope_type not in ROPE_TYPES:
        fail(f"rotary_scaling type {cfg.rope_type!r} is not supported by the reference runtime "
             "(supported: linear, llama3)")
    if cfg.quant_algo not in QUANT_ALGOS:
        fail(f"quantization.quant_algo {cfg.quant_algo!r} is not supported by the reference runtime "
             "(supported: FP8, W8A8_SQ_PER_CHANNEL or none)")
    if cfg.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        fail(f"quantization.kv_cache_quant_algo {cfg.kv_cache_quant_algo!r} is not supported "
             "(supported: FP8, INT8 or none)")
    if (raw.get("moe") or {}).get("num_experts", 0):
        fail("mixture-of-experts checkpoints are not supported by the reference runtime")
    positive = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                "head_size": cfg.head_size, "intermediate_size": cfg.intermediate_size,
                "mapping.tp_size": cfg.tp_size, "mapping.pp_size": cfg.pp_size}
    for key, value in positive.items():
        if value < 1:
            fail(f"{key} must be positive (got {value})")
    if cfg.num_heads % cfg.num_kv_heads:
        fail(f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    tp, kv = cfg.tp_size, cfg.num_kv_heads
    if cfg.num_heads % tp or cfg.intermediate_size % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        fail(f"mapping.tp_size {tp} does not split num_attention_heads {cfg.num_heads}, "
             f"num_key_value_heads {kv} and intermediate_size {cfg.intermediate_size} evenly")
    if cfg.pp_size > cfg.num_layers:
        fail(f"mapping.pp_size {cfg.pp_size} exceeds num_hidden_layers {cfg.num_layers}")
    world = int((raw.get("mapping") or {}).get("world_size", tp * cfg.pp_size))
    if world != tp * cfg.pp_size:
        fail(f"mapping.world_size {world} is not tp_size x pp_size = {tp * cfg.pp_size}")
