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
from ..backends.capabilities import Combination, require
from ..targets import Target
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


#: what a Refusal is about: the P99 budget, or the memory of the card (or of an instance's share of it)
LATENCY, MEMORY = "latency", "memory"


class Refusal(UserError):
    """A request no plan meets as asked, which a change to the request may: `kind` (LATENCY, MEMORY) and what the
    planner found at `batch`, the smallest batch it tried (`latency_s`, `ttft_s`, `tpot_s` for LATENCY).

    `pipeline.planner.plan_instances(advise=True)` (the `plan` command) tries the changes that answer it and keeps
    those it plans (`alternatives`: the flags of `trtpipe plan` and why), so every "instead" it names works;
    `explained` words them, as whole commands where the caller can spell them."""

    def __init__(self, message: str, kind: str, batch: int = 1, latency_s: float = 0.0, ttft_s: float = 0.0,
                 tpot_s: float = 0.0):
        super().__init__(message)
        self.message, self.kind, self.batch = message, kind, batch
        self.latency_s, self.ttft_s, self.tpot_s = latency_s, ttft_s, tpot_s
        self.alternatives: list[tuple[dict, str]] | None = None   # None: not tried

    def reworded(self, message: str) -> "Refusal":
        return Refusal(message, self.kind, self.batch, self.latency_s, self.ttft_s, self.tpot_s)

    def explained(self, command=None) -> str:
        """The message with the alternatives found, each as `command(flags)` (default: the flags alone)."""
        if self.alternatives is None:
            return self.message
        if not self.alternatives:
            return (f"{self.message}; no larger budget, shorter output, smaller batch, lower precision, 8-bit KV "
                    "cache, more GPUs or fewer instances that trtpipe tried plans it")
        spell = command or (lambda flags: " ".join(f"{flag} {value}" for flag, value in flags.items()))
        return f"{self.message}; instead: " + " or ".join(f"`{spell(flags)}` ({why})"
                                                       for flags, why in self.alternatives)

    def __str__(self) -> str:
        return self.explained()


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
    trtllm: str | None = None  # the TensorRT-LLM version of the runtime image (None: the cpu target)
    companion: Companion | None = None   # a draft model served beside this one on the same GPUs


@dataclass(frozen=True)
class Companion:
    """A second model on the planned GPUs (speculative decoding's draft model, pipeline/plan/speculative_gpu.py):
    its weights and its activations for the same tokens a step come off each GPU's memory first, and its KV cache
    holds as many tokens as the target's (every sequence runs in both), so the KV memory left is split in
    proportion to the two models' bytes per token."""

    arch: ModelArch
    precision: str
    dtype: str
    weights_bytes_per_rank: int
    kv_bytes_per_token: int


# ----------------------------------------------------------------------------------------------
# Precision decisions


def engine_dtype(precision: str, arch: ModelArch) -> str:
    """The engine's activation dtype: the precision itself, or for FP8/INT8-SQ the model's 16-bit dtype."""
    if precision in FLOAT_DTYPES:
        return FLOAT_DTYPES[precision]
    return arch.dtype if arch.dtype in ("float16", "bfloat16") else "float16"


def resolve_kv_cache_dtype(kv_cache: str, precision: str, dtype: str,
                           checkpoint_kv_algo: str | None = None, is_checkpoint: bool = False,
                           target: Target | None = None) -> str:
    """'fp8' | 'int8' | the engine dtype (an unquantized cache is stored in the engine dtype): the one decision of
    the KV cache a plan, and the build of the same flags, make.

    'auto' follows a checkpoint's kv_cache_quant_algo; without a checkpoint it is FP8 for FP8 weights, INT8 for
    SmoothQuant, and unquantized otherwise. On the cpu target 'auto' is unquantized: its reference runtime stores
    every KV cache in float32 (`stored_kv_cache_dtype`), so an 8-bit one would save no memory, and `trtpipe build`
    calibrates no KV scales for 'auto' (its cpu fp8 build serves a float32 KV cache).
    """
    if kv_cache == "auto":
        if is_checkpoint:
            return {"FP8": "fp8", "INT8": "int8"}.get(checkpoint_kv_algo, dtype)
        if target is not None and not target.is_gpu:
            return dtype
        return {"fp8": "fp8", "int8-sq": "int8"}.get(precision, dtype)
    if kv_cache in FLOAT_DTYPES:
        if FLOAT_DTYPES[kv_cache] != dtype:
            raise UserError(f"--kv-cache {kv_cache} contradicts the engine dtype {dtype}: an unquantized "
                            f"KV cache is stored in the engine dtype; use --kv-cache auto, fp8 or int8")
        return dtype
    if kv_cache not in KV_CACHE_QUANT_ALGO:
        raise UserError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")
    return kv_cache


#: the dtype the cpu target's reference runtime computes and stores everything in
CPU_DTYPE = "float32"


def stored_kv_cache_dtype(target: Target, kv_cache_dtype: str) -> str:
    """What the KV cache is stored as: its own dtype on a GPU; float32 on the cpu target, whose reference runtime
    rounds a quantized cache's values to fp8/int8 with the checkpoint's scales and keeps them in float32
    (`runtime.model.KVCache`). kv_bytes_per_token is of this dtype."""
    return kv_cache_dtype if target.is_gpu else CPU_DTYPE


def describe_kv_cache(plan: Plan) -> str:
    """The KV cache as plan and build have it: '65536 B/token fp8', or on the cpu target '46080 B/token float32
    (values rounded to fp8)'."""
    stored = stored_kv_cache_dtype(plan.target, plan.kv_cache_dtype)
    rounded = f" holding {plan.kv_cache_dtype}-rounded values" if plan.kv_cache_dtype in KV_CACHE_QUANT_ALGO \
        and stored != plan.kv_cache_dtype else ""
    return f"{stored}{rounded}, {plan.kv_bytes_per_token} B/token"


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


def checkpoint_precision(quant_algo: str | None, dtype: str | None) -> str | None:
    """The --precision that plans a checkpoint as it is: its quant_algo's, else its dtype's (None: neither known)."""
    if quant_algo:
        return next((p for p, name in QUANT_ALGO.items() if name == quant_algo), None)
    return next((p for p, name in FLOAT_DTYPES.items() if name == dtype), None)


def check_checkpoint_agrees(model: ModelInfo, precision: str, kv_cache_dtype: str, dtype: str,
                            tp: int, check_dtype: bool = True) -> None:
    """A checkpoint fixes its precision, KV quantization, dtype and tp: the request must match."""
    if model.source != "checkpoint":
        return
    q = model.checkpoint_quantization or {}
    have_algo, want_algo = q.get("quant_algo"), QUANT_ALGO.get(precision)
    where = model.path
    own = checkpoint_precision(have_algo, model.arch.dtype)
    if have_algo != want_algo:
        raise UserError(f"checkpoint {where} has quant_algo {have_algo}, but --precision {precision} "
                        f"needs {want_algo}; pass "
                        + (f"its own --precision {own}" if own else "the matching --precision")
                        + " or calibrate a new checkpoint")
    have_kv, want_kv = q.get("kv_cache_quant_algo"), KV_CACHE_QUANT_ALGO.get(kv_cache_dtype)
    if have_kv != want_kv:
        raise UserError(f"checkpoint {where} has kv_cache_quant_algo {have_kv}, but the requested KV "
                        f"cache {kv_cache_dtype} needs {want_kv}; pass a matching --kv-cache")
    if check_dtype and precision in FLOAT_DTYPES and model.arch.dtype != dtype:
        raise UserError(f"checkpoint {where} is {model.arch.dtype}, --precision {precision} needs {dtype}; "
                        + (f"plan it at its own --precision {own}, or " if own else "")
                        + f"convert again with --precision {precision}")
    if model.checkpoint_tp_size != tp:
        raise UserError(f"checkpoint {where} is sharded for tp={model.checkpoint_tp_size}, not --tp {tp}; "
                        f"convert again with --tp {tp}")


def check_target_supports(target: Target, precision: str, kv_cache_dtype: str, tp: int, pp: int,
                          arch: ModelArch, backend: str, trtllm: str | None = None) -> list[str]:
    """The capability table's verdict on the combination (`pipeline.backends.capabilities`), then the GPU count and the
    parallelism the architecture allows."""
    warnings = []
    require(Combination(precision, kv_cache_dtype, backend, target.sm if target.is_gpu else None, trtllm))
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
        latency = prefill_s + workload.output_len * base
        raise Refusal(f"the P99 latency budget {budget_s:g} s cannot be met on {target.name} even at batch 1: "
                      f"at least {latency:.3f} s, the speed-of-light bound (prefill {prefill_s:.3f} s + "
                      f"{workload.output_len} decode steps of {base * 1e3:.2f} ms)", LATENCY, 1, latency,
                      prefill_s, base)
    return max(1, int((per_step - base) * target.bandwidth_bytes_per_s / (context * kv_per_token)))
