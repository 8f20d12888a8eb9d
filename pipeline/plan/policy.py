"""The planner's policy: the checks every plan passes, and the choices its backend's planner starts from.

`pipeline.planner.make_plan` (above the backends) runs these checks against the precision, the target, the
checkpoint and TensorRT-LLM's rules and hands the `PlanRequest` they produce to the backend's planner
(`pipeline.backends.<name>.plan`). Anything that cannot work is a UserError.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import ModelArch
from ..errors import UserError
from ..model.layout import check_parallelism
from ..precisions import FLOAT_DTYPES, KV_CACHE_CHOICES, KV_CACHE_QUANT_ALGO, QUANT_ALGO
from ..targets import FP8_MIN_SM, Target
from .schema import ModelInfo, Overrides, Plan, Workload
from .trtllm import model_context_limit


#: Triton queue bound (0 would be unlimited): this many full batches may wait, so an overload is
#: rejected at once instead of every queued request timing out.
QUEUE_BATCHES = 4


def queue_bound(batch: int) -> dict:
    """The `tensorrt_llm` model's max_queue_size for `batch` concurrent sequences and the plan's reason for it
    (TritonParams fields)."""
    size = QUEUE_BATCHES * batch
    return {"max_queue_size": size, "max_queue_size_reason": (
        f"up to {QUEUE_BATCHES} full batches ({size} requests) wait in Triton's queue; beyond that a request is "
        "shed at once ('Exceeds maximum queue size': HTTP 503 from a model, 400 through the ensemble) instead "
        "of every queued request waiting out its client's timeout")}


@dataclass(frozen=True)
class PlanRequest:
    """A request `make_plan` has checked, for a backend's planner."""

    model: ModelInfo
    target: Target
    precision: str
    dtype: str                 # engine_dtype(precision, arch)
    kv_cache_dtype: str        # resolved: "fp8" | "int8" | the dtype
    tp: int
    pp: int
    workload: Workload
    overrides: Overrides
    max_context: int           # the longest prompt + output to plan for
    warnings: list[str]        # the checks' warnings; the planner adds its own


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


def kv_cache_request(plan: Plan) -> str:
    """The --kv-cache value that plans `plan`'s KV cache again: the one rule for re-planning from a plan.json
    (`replan`; tune's candidates are planned with it).

    A quantized cache is named by its algorithm. An unquantized one is requested by the engine dtype of the plan's
    precision (`engine_dtype`), which is not always `plan.dtype`: that is the dtype the backend computes in, and the
    reference runtime (the cpu target) computes and stores every unquantized cache in float32 whatever the
    precision (an fp8 or fp16 cpu plan records dtype and kv_cache_dtype float32).
    """
    if plan.kv_cache_dtype in KV_CACHE_QUANT_ALGO:
        return plan.kv_cache_dtype
    dtype = engine_dtype(plan.precision, plan.model.arch)
    return next(name for name, value in FLOAT_DTYPES.items() if value == dtype)


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
    check_parallelism(arch, tp, pp)
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
