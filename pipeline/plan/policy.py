"""The planner's policy: what to choose for a model, a target, a precision and a workload.

`make_plan` checks the request against the target, the checkpoint and TensorRT-LLM's rules, then hands
it to the GPU planner (an engine, in-flight batching, the largest batch whose sequences fit the KV cache
left after weights, activations and runtime buffers) or the cpu planner (the reference runtime serving the
checkpoint in float32, small dynamic batches). Anything that cannot work is a UserError.
"""

from __future__ import annotations

import math

from .. import TRTLLM_VERSION
from ..arch import ModelArch
from ..errors import UserError
from ..precisions import FLOAT_DTYPES, KV_CACHE_QUANT_ALGO, PRECISIONS, QUANT_ALGO
from ..targets import FP8_MIN_SM, Target
from .memory import (
    ACTIVATION_BASIS,
    ACTIVATION_FORMULA,
    CUDA_CONTEXT_RESERVE,
    RESERVE_FORMULA,
    activation_bytes,
    format_gib,
    kv_bytes_per_token,
    prefill_seconds,
    roofline,
    runtime_reserve_bytes,
    weights_per_rank_by_stage,
)
from .schema import BuildConfig, MemoryBudget, ModelInfo, Overrides, Plan, PluginConfig, TritonParams, Workload
from .trtllm import (
    MAX_BATCH_SIZE_CAP,
    MAX_NUM_TOKENS_WARN,
    derive_profiles,
    model_context_limit,
    paged_context_fmha_possible,
    quantization,
)

KV_CACHE_CHOICES = ("auto", "fp16", "bf16", "fp32", "fp8", "int8")

#: Triton's default and NVIDIA's advice: "cannot be set to 1.0" (perf-best-practices.md).
DEFAULT_KV_FRACTION = 0.9
#: Triton queue bound (0 would be unlimited): this many full batches may wait, so an overload is
#: rejected at once instead of every queued request timing out.
QUEUE_BATCHES = 4
#: In-flight batching schedules per iteration, so the GPU plans no queue delay (as triton_cli does);
#: the cpu target's Python model only batches what the dynamic batcher hands it, so it waits 1 ms.
CPU_QUEUE_DELAY_US = 1000


# ----------------------------------------------------------------------------------------------
# Precision decisions


def engine_dtype(precision: str, arch: ModelArch) -> str:
    """The engine's activation dtype: the precision itself, or for FP8/INT8-SQ the model's 16-bit dtype."""
    if precision in FLOAT_DTYPES:
        return FLOAT_DTYPES[precision]
    return arch.dtype if arch.dtype in ("float16", "bfloat16") else "float16"


def resolve_kv_cache_dtype(kv_cache: str, precision: str, dtype: str,
                           checkpoint_kv_algo: str | None = None, is_checkpoint: bool = False) -> str:
    """'fp8' | 'int8' | the engine dtype (an unquantized cache is stored in the engine dtype).

    'auto' follows a checkpoint's kv_cache_quant_algo; without a checkpoint it is FP8 for FP8
    weights, INT8 for SmoothQuant, and unquantized otherwise.
    """
    if kv_cache == "auto":
        if is_checkpoint:
            return {"FP8": "fp8", "INT8": "int8"}.get(checkpoint_kv_algo, dtype)
        return {"fp8": "fp8", "int8-sq": "int8"}.get(precision, dtype)
    if kv_cache in FLOAT_DTYPES:
        if FLOAT_DTYPES[kv_cache] != dtype:
            raise UserError(f"--kv-cache {kv_cache} contradicts the engine dtype {dtype}: an unquantized "
                            f"KV cache is stored in the engine dtype; use --kv-cache auto, fp8 or int8")
        return dtype
    if kv_cache not in KV_CACHE_QUANT_ALGO:
        raise UserError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")
    return kv_cache


def check_checkpoint_agrees(model: ModelInfo, precision: str, kv_cache_dtype: str, dtype: str,
                            tp: int, check_dtype: bool = True) -> None:
    """A checkpoint fixes its precision, KV quantization, dtype and tp: the request must match."""
    if model.source != "checkpoint":
        return
    q = model.checkpoint_quantization or {}
    have_algo, want_algo = q.get("quant_algo"), QUANT_ALGO.get(precision)
    where = model.path
    if have_algo != want_algo:
        raise UserError(f"checkpoint {where} has quant_algo {have_algo}, but --precision {precision} "
                        f"needs {want_algo}; pass the matching --precision or calibrate a new checkpoint")
    have_kv, want_kv = q.get("kv_cache_quant_algo"), KV_CACHE_QUANT_ALGO.get(kv_cache_dtype)
    if have_kv != want_kv:
        raise UserError(f"checkpoint {where} has kv_cache_quant_algo {have_kv}, but the requested KV "
                        f"cache {kv_cache_dtype} needs {want_kv}; pass a matching --kv-cache")
    if check_dtype and precision in FLOAT_DTYPES and model.arch.dtype != dtype:
        raise UserError(f"checkpoint {where} is {model.arch.dtype}, --precision {precision} needs {dtype}; "
                        f"convert again with --dtype {dtype}")
    if model.checkpoint_tp_size != tp:
        raise UserError(f"checkpoint {where} is sharded for tp={model.checkpoint_tp_size}, not --tp {tp}; "
                        f"convert again with --tp {tp}")


def check_target_supports(target: Target, precision: str, kv_cache_dtype: str, tp: int, pp: int,
                          arch: ModelArch) -> list[str]:
    warnings = []
    if target.is_gpu and not target.supports_fp8 and "fp8" in (precision, kv_cache_dtype):
        raise UserError(f"FP8 needs compute capability {FP8_MIN_SM // 10}.{FP8_MIN_SM % 10} or newer (Ada, "
                        f"Hopper); {target.name} is sm_{target.sm}. Use --precision fp16/bf16 or int8-sq "
                        "and --kv-cache fp16/int8")
    if target.is_gpu and tp * pp > target.max_gpus:
        raise UserError(f"tp {tp} x pp {pp} needs {tp * pp} GPUs; the {target.name} target has at most "
                        f"{target.max_gpus}")
    arch.check_parallelism(tp, pp)
    if target.is_gpu and tp > 1 and not target.p2p:
        warnings.append(f"{target.name} has no GPU peer-to-peer access ({target.interconnect}): tensor-"
                        "parallel all-reduce goes through host memory and will be slow "
                        "(NVIDIA/TensorRT-LLM#1625)")
    return warnings


# ----------------------------------------------------------------------------------------------
# Choices


def choose_max_context(workload: Workload, arch: ModelArch) -> int:
    limit = model_context_limit(arch)
    max_context = workload.context_for(arch)
    if max_context > limit:
        raise UserError(f"--max-context {max_context} exceeds the model's context of {limit} tokens "
                        "(max_position_embeddings x rotary scaling)")
    if workload.input_len + workload.output_len > max_context:
        raise UserError(f"--input-len {workload.input_len} + --output-len {workload.output_len} exceed "
                        f"the maximum context {max_context}; raise --max-context or shorten the workload")
    return max_context


def choose_max_num_tokens(workload: Workload, max_input_len: int, chunked: bool, override: int | None) -> int:
    if override is not None:
        if override < 1:
            raise UserError("--max-num-tokens must be at least 1")
        if not chunked and override < max_input_len:
            raise UserError(f"--max-num-tokens {override} is below max_input_len {max_input_len}, which "
                            "needs chunked context, and chunked context needs paged context FMHA (off here)")
        return override
    tokens = min(max(1024, 1 << (workload.input_len - 1).bit_length()), 8192)
    return tokens if chunked else max(tokens, max_input_len)


def choose_multiple_profiles(override: bool | None, max_num_tokens: int, opt_override: int | None) -> bool:
    if override and opt_override is not None:
        raise UserError("--multiple-profiles and --opt-num-tokens contradict each other: trtllm-build "
                        "refuses both (\"They are not supposed to be working in the same time\")")
    if override is not None:
        return override
    # NVIDIA: "Multiple profiles: Always enable" (useful-build-time-flags.md); upstream breaks <= 64.
    return opt_override is None and max_num_tokens > 64


def choose_plugins(precision: str, kv_cache_dtype: str, dtype: str, target: Target, tp: int,
                   overrides: Overrides, multiple_profiles: bool) -> tuple[PluginConfig, list[str]]:
    warnings = []
    possible, why = paged_context_fmha_possible(precision, kv_cache_dtype)
    paged_ctx = possible if overrides.use_paged_context_fmha is None else overrides.use_paged_context_fmha
    if paged_ctx and not possible:
        raise UserError(f"--paged-context-fmha contradicts --precision {precision} with a "
                        f"{kv_cache_dtype} KV cache: {why}")
    if not paged_ctx and why:
        warnings.append(f"paged context FMHA off: {why}; so no KV-cache reuse and no chunked context")
    fp8_ctx = precision == "fp8" and kv_cache_dtype == "fp8" and (target.sm or 0) >= FP8_MIN_SM and paged_ctx
    plugin = PluginConfig(
        dtype=dtype,
        gpt_attention_plugin="auto",
        # GEMM plugin for FP16/BF16, disabled for FP8 (useful-build-time-flags.md); with SmoothQuant
        # the quantized GEMMs use the smooth_quant plugins and the rest (lm_head) the GEMM plugin.
        gemm_plugin=None if precision == "fp8" else "auto",
        nccl_plugin="auto" if tp > 1 else None,
        use_paged_context_fmha=paged_ctx,
        use_fp8_context_fmha=fp8_ctx,
        multiple_profiles=multiple_profiles,
        # trtllm-build turns use_fused_mlp off for quant algos other than FP8 (commands/build.py).
        use_fused_mlp=precision != "int8-sq",
    )
    return plugin, warnings


def latency_batch_cap(budget_s: float, prefill_s: float, workload: Workload, weights_per_rank: int,
                      context: float, kv_per_token: int, target: Target) -> int:
    """Largest batch whose estimated request latency (prefill + output_len decode steps) fits the budget."""
    per_step = (budget_s - prefill_s) / workload.output_len
    base = weights_per_rank / target.bandwidth_bytes_per_s
    if per_step <= base:
        raise UserError(f"the P99 latency budget {budget_s:g} s cannot be met on {target.name} even at batch 1: "
                        f"estimated {prefill_s + workload.output_len * base:.3f} s (prefill {prefill_s:.3f} s + "
                        f"{workload.output_len} decode steps of {base * 1e3:.2f} ms); shorten the output, "
                        "use a lower precision or more GPUs")
    return max(1, int((per_step - base) * target.bandwidth_bytes_per_s / (context * kv_per_token)))


def largest_batch(fits, upper: int) -> int:
    """The largest b in [1, upper] with fits(b), for a fits() that only turns false as b grows (1 if none)."""
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _round_down_to_blocks(tokens: int, tokens_per_block: int) -> int:
    return tokens // tokens_per_block * tokens_per_block


def _blocks_tokens(tokens: int, tokens_per_block: int) -> int:
    return math.ceil(tokens / tokens_per_block) * tokens_per_block


# ----------------------------------------------------------------------------------------------
# The plan


def make_plan(model: ModelInfo | ModelArch, target: Target, precision: str, kv_cache: str = "auto",
              tp: int = 1, workload: Workload | None = None, overrides: Overrides | None = None,
              pp: int = 1) -> Plan:
    """Plan MODEL on TARGET; raises UserError for anything that cannot work."""
    if isinstance(model, ModelArch):
        model = ModelInfo(name=model.architecture, source="arch", path=None, arch=model)
    workload = workload or Workload()
    overrides = overrides or Overrides()
    workload.validate()
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    arch = model.arch
    is_checkpoint = model.source == "checkpoint"
    if is_checkpoint:
        pp = model.checkpoint_pp_size or 1
    dtype = engine_dtype(precision, arch)
    kv_dtype = resolve_kv_cache_dtype(kv_cache, precision, dtype,
                                      (model.checkpoint_quantization or {}).get("kv_cache_quant_algo"),
                                      is_checkpoint)
    warnings = check_target_supports(target, precision, kv_dtype, tp, pp, arch)
    # The cpu target runs any checkpoint dtype in float32; an engine keeps the checkpoint's dtype.
    check_checkpoint_agrees(model, precision, kv_dtype, dtype, tp, check_dtype=target.is_gpu)
    max_context = choose_max_context(workload, arch)
    if target.is_gpu:
        return _gpu_plan(model, target, precision, dtype, kv_dtype, tp, pp, workload, overrides,
                         max_context, warnings)
    return _cpu_plan(model, target, precision, kv_dtype, tp, pp, workload, overrides, max_context, warnings)


def _gpu_plan(model, target, precision, dtype, kv_dtype, tp, pp, workload, overrides, max_context, warnings):
    arch = model.arch
    fraction = overrides.kv_cache_free_gpu_mem_fraction
    fraction = DEFAULT_KV_FRACTION if fraction is None else fraction
    if not 0 < fraction < 1:
        raise UserError(f"--kv-cache-free-gpu-mem-fraction {fraction} must be in (0, 1); NVIDIA: it "
                        "\"cannot be set to 1.0\" (try 0.95 on an unshared GPU)")
    max_seq_len = max_context
    max_input_len = max_seq_len - 1
    possible, _ = paged_context_fmha_possible(precision, kv_dtype)
    chunked = possible if overrides.use_paged_context_fmha is None else overrides.use_paged_context_fmha
    max_num_tokens = choose_max_num_tokens(workload, max_input_len, chunked, overrides.max_num_tokens)
    multiple_profiles = choose_multiple_profiles(overrides.multiple_profiles, max_num_tokens,
                                                 overrides.opt_num_tokens)
    plugin, plugin_warnings = choose_plugins(precision, kv_dtype, dtype, target, tp, overrides, multiple_profiles)
    warnings += plugin_warnings
    if overrides.enable_kv_cache_reuse and not plugin.use_paged_context_fmha:
        raise UserError("--kv-cache-reuse needs an engine built with paged context FMHA, which this plan "
                        "does not have (tensorrtllm_backend#271: \"When KV cache block reuse is set, model "
                        "has to be built with paged context FMHA support\")")
    if max_num_tokens > MAX_NUM_TOKENS_WARN:
        warnings.append(f"max_num_tokens {max_num_tokens} > 16384: TensorRT-LLM warns it may exceed the "
                        "TensorRT tensor volume, and it takes memory from the KV cache")

    stages = weights_per_rank_by_stage(arch, precision, dtype, tp, pp)
    weights_per_rank = max(stages)
    weights_total = tp * sum(stages)
    kv_per_token = kv_bytes_per_token(arch, kv_dtype, tp, pp)
    tpb = plugin.tokens_per_block
    seq_tokens = _blocks_tokens(workload.input_len + workload.output_len, tpb)
    memory = target.memory_bytes
    if weights_per_rank >= memory:
        hint = (f"use a lower precision (fp8, int8-sq) or --tp {min(2 * tp, target.max_gpus)}"
                if tp < target.max_gpus else f"{target.name} has at most {target.max_gpus} GPUs")
        raise UserError(f"{model.name} at {precision} needs {format_gib(weights_per_rank)} of weights per "
                        f"GPU; {target.name} has {format_gib(memory)}: {hint}")

    def kv_tokens_for(batch: int) -> tuple[int, int, int, int]:
        act = activation_bytes(arch, precision, dtype, tp, min(max_num_tokens, max_seq_len * batch), batch)
        reserve = runtime_reserve_bytes(arch, tp, batch, max_seq_len)
        free = memory - weights_per_rank - act - reserve
        kv_bytes = int(max(free, 0) * fraction)
        return act, reserve, free, _round_down_to_blocks(kv_bytes // kv_per_token, tpb)

    if overrides.max_batch_size is not None:
        if overrides.max_batch_size < 1:
            raise UserError("--max-batch-size must be at least 1")
        if workload.concurrency and overrides.max_batch_size < workload.concurrency:
            raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --concurrency "
                            f"{workload.concurrency}: the engine could never run that many requests at once")
        batch = overrides.max_batch_size
    else:
        # The largest batch whose sequences of typical length all fit in the KV cache that is left
        # once that batch's own activations and runtime buffers are allocated.
        wanted = min(workload.concurrency or MAX_BATCH_SIZE_CAP, MAX_BATCH_SIZE_CAP)
        batch = largest_batch(lambda b: kv_tokens_for(b)[3] // seq_tokens >= b, wanted)
    act, reserve, free, kv_tokens = kv_tokens_for(batch)
    if kv_tokens < max_seq_len:
        raise UserError(
            f"no room for the KV cache: after {format_gib(weights_per_rank)} of weights, {format_gib(act)} "
            f"of activations (max_num_tokens {max_num_tokens}) and {format_gib(reserve)} of runtime reserve, "
            f"{target.name} keeps {kv_tokens} tokens of KV cache, fewer than one sequence of "
            f"max context {max_seq_len}. Lower --max-context, use --kv-cache fp8/int8, a lower "
            "precision or more GPUs (--tp)")
    fit = kv_tokens // seq_tokens
    context = workload.input_len + workload.output_len / 2
    prefill_s = prefill_seconds(arch, workload.input_len, precision, tp, target)
    if workload.p99_latency_s is not None:
        cap = latency_batch_cap(workload.p99_latency_s, prefill_s, workload, weights_per_rank, context,
                                kv_per_token, target)
        if overrides.max_batch_size is not None and overrides.max_batch_size > cap:
            raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --p99-latency "
                            f"{workload.p99_latency_s:g}: at most {cap} sequences per step meet it")
        if batch > cap:
            batch = cap
            act, reserve, free, kv_tokens = kv_tokens_for(batch)
            fit = kv_tokens // seq_tokens
    if overrides.max_batch_size is not None and overrides.max_batch_size > fit:
        warnings.append(f"--max-batch-size {overrides.max_batch_size} is more than the {fit} sequences of "
                        f"{seq_tokens} tokens the KV cache holds; the scheduler will queue the rest")
    if workload.concurrency and workload.concurrency > batch:
        limit = "the KV cache" + (" and the P99 latency budget" if workload.p99_latency_s else "")
        warnings.append(f"--concurrency {workload.concurrency} is more than the planned batch of {batch} "
                        f"({limit} at {workload.input_len}+{workload.output_len} tokens); the rest queue in Triton")
    concurrent = min(batch, fit)

    if max_num_tokens > max_seq_len * batch:
        if overrides.max_num_tokens is not None:
            raise UserError(f"--max-num-tokens {max_num_tokens} exceeds max_seq_len x max_batch_size "
                            f"({max_seq_len} x {batch}); trtllm-build would clamp it")
        max_num_tokens = max_seq_len * batch
    opt_num_tokens = overrides.opt_num_tokens
    if opt_num_tokens is not None and not 1 <= opt_num_tokens <= max_num_tokens:
        raise UserError(f"--opt-num-tokens {opt_num_tokens} must be between 1 and max_num_tokens {max_num_tokens}")
    if opt_num_tokens is None and not multiple_profiles:
        opt_num_tokens = min(batch, max_num_tokens)   # check_max_num_tokens' own default, made explicit

    build = BuildConfig(max_input_len=max_input_len, max_seq_len=max_seq_len, max_batch_size=batch,
                        max_beam_width=1, max_num_tokens=max_num_tokens, opt_num_tokens=opt_num_tokens)
    reuse = overrides.enable_kv_cache_reuse
    reuse = plugin.use_paged_context_fmha if reuse is None else reuse
    triton = TritonParams(
        triton_backend="tensorrtllm", triton_max_batch_size=batch, decoupled_mode=True,
        max_queue_delay_microseconds=0, max_queue_size=QUEUE_BATCHES * batch,
        preferred_batch_size=[batch], max_beam_width=1, batching_strategy="inflight_fused_batching",
        batch_scheduler_policy="guaranteed_no_evict", kv_cache_free_gpu_mem_fraction=fraction,
        # The runtime takes min(this, fraction x free memory it measures): the cache never exceeds the
        # plan, and a smaller real free memory still bounds it (tensorrtllm_backend docs/model_config.md).
        max_tokens_in_paged_kv_cache=kv_tokens, enable_chunked_context=plugin.use_paged_context_fmha,
        enable_kv_cache_reuse=reuse)
    budget = MemoryBudget(
        memory_bytes=memory, weights_bytes_per_rank=weights_per_rank, activation_bytes=act,
        activation_formula=ACTIVATION_FORMULA, activation_basis=ACTIVATION_BASIS, runtime_reserve_bytes=reserve,
        runtime_reserve_formula=RESERVE_FORMULA, free_bytes=free, kv_cache_free_gpu_mem_fraction=fraction,
        kv_cache_bytes=kv_tokens * kv_per_token, kv_cache_tokens=kv_tokens)
    return Plan(
        model=model, target=target, precision=precision, dtype=dtype, kv_cache_dtype=kv_dtype,
        quantization=quantization(precision, kv_dtype), tp_size=tp, pp_size=pp, workload=workload,
        max_seq_len=max_seq_len,
        weights_bytes=weights_total, weights_bytes_per_rank=weights_per_rank, kv_bytes_per_token=kv_per_token,
        max_concurrent_sequences=concurrent, memory=budget,
        engine={"builder": "trtllm-build", "tensorrt_llm_version": TRTLLM_VERSION,
                "world_size": tp * pp, "sm": target.sm},
        build_config=build, plugin_config=plugin, optimization_profiles=derive_profiles(build, plugin),
        triton=triton, roofline=roofline(target, workload, weights_per_rank, kv_per_token, concurrent, prefill_s),
        warnings=warnings)


def _cpu_plan(model, target, precision, kv_dtype, tp, pp, workload, overrides, max_context, warnings):
    """The reference runtime serves the checkpoint in float32 on the host: no engine, small batches."""
    arch = model.arch
    if overrides.max_num_tokens or overrides.opt_num_tokens or overrides.multiple_profiles is not None \
            or overrides.use_paged_context_fmha is not None or overrides.enable_kv_cache_reuse \
            or overrides.kv_cache_free_gpu_mem_fraction is not None:
        raise UserError("engine options (--max-num-tokens, --opt-num-tokens, --multiple-profiles, "
                        "--paged-context-fmha, --kv-cache-reuse, --kv-cache-free-gpu-mem-fraction) "
                        "contradict --target cpu, which builds no engine")
    stages = weights_per_rank_by_stage(arch, "fp32", "float32", 1, 1)
    weights = stages[0]
    kv_per_token = kv_bytes_per_token(arch, "float32", 1, 1)
    memory = target.memory_bytes
    reserve = CUDA_CONTEXT_RESERVE   # Python, PyTorch and Triton processes
    if weights + reserve >= memory:
        raise UserError(f"{model.name} needs {format_gib(weights)} of float32 weights in the reference "
                        f"runtime; the cpu target assumes {format_gib(memory)} of host memory. Use a GPU target")
    batch = overrides.max_batch_size or min(workload.concurrency or target.triton_max_batch_size,
                                            target.triton_max_batch_size)
    if workload.concurrency and overrides.max_batch_size and overrides.max_batch_size < workload.concurrency:
        raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --concurrency {workload.concurrency}")
    free = memory - weights - reserve
    kv_tokens = free // kv_per_token
    if kv_tokens < max_context:
        raise UserError(f"no room for one sequence of {max_context} tokens of float32 KV cache in "
                        f"{format_gib(free)} of host memory left; lower --max-context")
    fit = kv_tokens // (workload.input_len + workload.output_len)
    concurrent = max(1, min(batch, fit))
    prefill_s = prefill_seconds(arch, workload.input_len, "fp32", 1, target)
    if workload.p99_latency_s is not None:
        cap = latency_batch_cap(workload.p99_latency_s, prefill_s, workload, weights,
                                workload.input_len + workload.output_len / 2, kv_per_token, target)
        batch = min(batch, cap)
        concurrent = min(concurrent, batch)
    if precision in QUANT_ALGO:
        warnings.append(f"cpu target: the reference runtime computes in float32 and simulates {precision} "
                        "from the checkpoint's scales")
    triton = TritonParams(
        triton_backend="python", triton_max_batch_size=batch, decoupled_mode=True,
        max_queue_delay_microseconds=CPU_QUEUE_DELAY_US, max_queue_size=QUEUE_BATCHES * batch,
        preferred_batch_size=[batch])
    budget = MemoryBudget(
        memory_bytes=memory, weights_bytes_per_rank=weights, activation_bytes=0,
        activation_formula="not planned: PyTorch allocates the reference runtime's activations per call",
        activation_basis="the cpu target builds no engine, so nothing is reserved ahead of time",
        runtime_reserve_bytes=reserve, runtime_reserve_formula="1 GiB for the Python/PyTorch/Triton processes",
        free_bytes=free, kv_cache_free_gpu_mem_fraction=1.0, kv_cache_bytes=kv_tokens * kv_per_token,
        kv_cache_tokens=kv_tokens)
    return Plan(
        model=model, target=target, precision=precision, dtype="float32",
        kv_cache_dtype=kv_dtype if kv_dtype in KV_CACHE_QUANT_ALGO else "float32",
        quantization=quantization(precision, kv_dtype),
        tp_size=tp, pp_size=pp, workload=workload, max_seq_len=max_context, weights_bytes=weights,
        weights_bytes_per_rank=weights,
        kv_bytes_per_token=kv_per_token, max_concurrent_sequences=concurrent, memory=budget, engine=None,
        build_config=None, plugin_config=None, optimization_profiles=[], triton=triton,
        roofline=roofline(target, workload, weights, kv_per_token, batch, prefill_s),
        warnings=warnings)
