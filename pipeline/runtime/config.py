"""The checkpoint's config.json (`CheckpointConfig`), checked for what the reference runtime can execute."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import CheckpointConfig
from ..errors import UserError
from ..precisions import INT4_QUANT_ALGOS, KV_CACHE_QUANT_ALGO, QUANT_ALGO

QUANT_ALGOS = (None, *QUANT_ALGO.values(), *INT4_QUANT_ALGOS)
KV_CACHE_QUANT_ALGOS = (None, *KV_CACHE_QUANT_ALGO.values())
ROPE_TYPES = (None, "default", "linear", "llama3")


def read_config(ckpt_dir: Path) -> CheckpointConfig:
    cfg = CheckpointConfig.read(ckpt_dir)
    check_supported(cfg, str(Path(ckpt_dir) / "config.json"))
    return cfg


def check_supported(cfg: CheckpointConfig, where: str) -> None:
    def fail(msg: str):
        raise UserError(f"{where}: {msg}")

    raw, arch = cfg.raw, cfg.arch
    if raw.get("position_embedding_type", "rope_gpt_neox") != "rope_gpt_neox":
        fail(f"position_embedding_type {raw.get('position_embedding_type')!r} is not supported "
             "(only 'rope_gpt_neox')")
    if float(raw.get("rotary_pct", 1.0)) != 1.0:
        fail(f"rotary_pct {raw.get('rotary_pct')} is not supported (only 1.0)")
    if arch.rotary_scaling is not None and not isinstance(arch.rotary_scaling, dict):
        fail(f"rotary_scaling must be an object or null, not {arch.rotary_scaling!r}")
    if arch.rope_type not in ROPE_TYPES:
        fail(f"rotary_scaling type {arch.rope_type!r} is not supported by the reference runtime "
             "(supported: linear, llama3)")
    if cfg.quant_algo not in QUANT_ALGOS:
        fail(f"quantization.quant_algo {cfg.quant_algo!r} is not supported by the reference runtime "
             f"(supported: {', '.join(a for a in QUANT_ALGOS if a)} or none)")
    if cfg.quant_algo in INT4_QUANT_ALGOS:
        check_groupwise(cfg.quantization, fail)
    if cfg.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        fail(f"quantization.kv_cache_quant_algo {cfg.kv_cache_quant_algo!r} is not supported "
             "(supported: FP8, INT8 or none)")
    if (raw.get("moe") or {}).get("num_experts", 0):
        fail("mixture-of-experts checkpoints are not supported by the reference runtime")


def check_groupwise(quantization: dict, fail) -> None:
    """The keys of a 4-bit groupwise checkpoint's `quantization` the runtime reads (docs/int4.md)."""
    group = quantization.get("group_size")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
        fail(f"quantization.group_size {group!r} must be a positive integer for {quantization['quant_algo']}")
    if quantization.get("has_zero_point"):
        fail("quantization.has_zero_point true (an additive zero per group) is not supported by the reference "
             "runtime; only symmetric int4 groups (has_zero_point false, as nvidia-modelopt writes them)")
