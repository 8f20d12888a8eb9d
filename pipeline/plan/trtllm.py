"""TensorRT-LLM 1.2.1 build rules the planner must obey: names, defaults, layouts, profiles.

Upstream rules used here (docs/upstream-facts.md §A2-§A4; TensorRT-LLM 1.2-era sources):
- tensorrt_llm/builder.py `build()`: FP8 context FMHA only with an FP8 quant_algo and sm >= 89;
  with paged context FMHA it needs an FP8 KV cache; paged context FMHA is switched off with an INT8
  KV cache and with an FP8 KV cache when the weights are not FP8; FP8 forces strongly_typed.
- tensorrt_llm/_common.py `check_max_num_tokens`: opt_num_tokens defaults to
  min(max_batch_size * max_beam_width, max_num_tokens) unless multiple_profiles; max_num_tokens is
  clamped to max_seq_len * max_batch_size.
- tensorrt_llm/models/generation_mixin.py `get_profiles_ranges`, `split_num_tokens_range`,
  `default_range`, `prepare_attention_inputs` (the profile derivation, see `derive_profiles`).
- tensorrtllm_backend: KV reuse needs an engine built with paged context FMHA (tensorrtllm_backend#271);
  triton max_batch_size must equal the engine's (tensorrtllm_backend#130).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..arch import ModelArch
from ..errors import UserError
from ..precisions import KV_CACHE_QUANT_ALGO, QUANT_ALGO


TOKENS_PER_BLOCK = 32            # PluginConfig.tokens_per_block default (1.2.x)
MAX_BATCH_SIZE_CAP = 2048        # BuildConfig.max_batch_size default: the largest we ever plan
MAX_NUM_TOKENS_WARN = 16384      # check_max_num_tokens warns above this


def quantization(precision: str, kv_dtype: str) -> dict:
    """The checkpoint/engine `quantization` section for a precision and a KV-cache dtype."""
    return {"quant_algo": QUANT_ALGO.get(precision), "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO.get(kv_dtype)}


def model_context_limit(arch: ModelArch) -> int:
    """max_position_embeddings x rotary factor, as builder._init_max_seq_len deduces max_seq_len."""
    scaling = arch.rotary_scaling or {}
    rope_type = scaling.get("type", scaling.get("rope_type"))
    factor = 1.0 if not scaling or rope_type in ("su", "longrope", "llama3") else float(scaling.get("factor", 1.0))
    return math.ceil(arch.max_position_embeddings * factor)


def paged_context_fmha_possible(precision: str, kv_cache_dtype: str) -> tuple[bool, str]:
    """builder.build(): paged context FMHA is switched off with an INT8 KV cache, and with an FP8 KV
    cache unless the weights are FP8 (FP8 paged context FMHA needs FP8 context FMHA)."""
    if kv_cache_dtype == "int8":
        return False, "TensorRT-LLM disables paged context FMHA with an INT8 KV cache"
    if kv_cache_dtype == "fp8" and precision != "fp8":
        return False, "TensorRT-LLM disables paged context FMHA with an FP8 KV cache unless the weights are FP8"
    return True, ""


# ----------------------------------------------------------------------------------------------
# Optimization profiles (TensorRT-LLM 1.2.x generation_mixin.py)


def default_range(max_range: int) -> list[int]:
    """GenerationMixin.default_range with its defaults (min 1, no offset): [1, (max + 1) // 2, max]."""
    return [1, (max_range + 1) // 2, max_range]


def split_num_tokens_range(max_num_tokens: int) -> list[list[int]]:
    """GenerationMixin.split_num_tokens_range for multiple_profiles, with split points 64..1024.

    Upstream returns the flat list [1, max, max] (not a list of ranges) when max_num_tokens <= 64;
    the planner never enables multiple_profiles there (see `pipeline.backends.engine.choose_multiple_profiles`).
    """
    points = [64, 128, 256, 512, 1024]
    if max_num_tokens <= points[0]:
        raise UserError(f"multiple_profiles with max_num_tokens {max_num_tokens} <= 64 makes TensorRT-LLM "
                        "1.2.1 derive a malformed profile list; raise --max-num-tokens or disable it")
    ranges = [[1, 64, 64]]
    for prev, point in itertools.pairwise(points):
        if max_num_tokens <= point:
            ranges.append([prev, max_num_tokens, max_num_tokens])
            return ranges
        ranges.append([prev, point, point])
    ranges.append([points[-1], max_num_tokens, max_num_tokens])
    return ranges


@dataclass
class OptimizationProfile:
    """One TensorRT optimization profile trtllm-build creates: [min, opt, max] of each dynamic input."""

    num_tokens: list[int]
    batch_size_beam_width: list[int]
    max_blocks_per_seq: list[int]


def derive_profiles(build, plugin) -> list[OptimizationProfile]:
    """The optimization profiles trtllm-build 1.2.1 creates for an in-flight-batching decoder.

    With gpt_attention_plugin, remove_input_padding and a paged KV cache the engine supports in-flight
    batching, so `has_ctx_gen_opt_profiles` is False and there is no context/generation split:
    - num_tokens: one profile [1, opt_num_tokens, max_num_tokens], or with multiple_profiles the
      ranges of `split_num_tokens_range(max_num_tokens)`;
    - batch_size_beam_width: default_range(max_batch_size * max_beam_width) in every profile
      (`build()` does not pass BuildConfig.opt_batch_size to prepare_inputs, whose default is 0);
    - max_blocks_per_seq: ceil(default_range(kv_max_seq_len) / tokens_per_block) with kv_max_seq_len =
      max_seq_len (+ tokens_per_block when max_beam_width > 1).
    """
    if not (plugin.gpt_attention_plugin and plugin.remove_input_padding and plugin.paged_kv_cache):
        raise UserError("trtpipe only plans in-flight-batching engines (gpt_attention_plugin, "
                        "remove_input_padding and a paged KV cache)")
    if plugin.multiple_profiles:
        num_tokens = split_num_tokens_range(build.max_num_tokens)
    else:
        opt = build.opt_num_tokens
        if opt is None:
            opt = min(build.max_num_tokens, build.max_batch_size * build.max_beam_width)
        num_tokens = [[1, opt, build.max_num_tokens]]
    batch = default_range(build.max_batch_size * build.max_beam_width)
    kv_max_seq_len = build.max_seq_len + (plugin.tokens_per_block if build.max_beam_width > 1 else 0)
    blocks = [math.ceil(x / plugin.tokens_per_block) for x in default_range(kv_max_seq_len)]
    return [OptimizationProfile(list(r), list(batch), list(blocks)) for r in num_tokens]
