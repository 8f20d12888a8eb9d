"""Making a plan: a request checked by the plan's rules (`plan.policy`), planned by its backend.

`make_plan` checks the request against the precision, the target, the checkpoint and TensorRT-LLM's rules,
picks the backend (the `backend` argument, else the target's default: the engine on a GPU, the reference runtime
on the cpu target) and hands a `PlanRequest` to that backend's planner. It sits above `pipeline.backends`, whose
planners build on the plan's schema and rules below them. `replan` plans a plan.json's request again (tune);
`densities` and `plan_instances` plan N instances of one build side by side on one GPU.

Instance density (multi-tenant, or A and B of a comparison on one RTX 4090): each instance is its own server
process with its own CUDA context, engine and KV cache, so each is planned as if the GPU had memory / N: the
planner's budget (weights, activations, the runtime reserve with its CUDA context, then the KV-cache fraction of
what is left) applies per instance, and an instance fits when its weights, activations and reserve leave room for
at least one sequence of the workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .arch import ModelArch
from .backends import DEFAULT_BACKEND, backend_serving
from .backends.runtime_images import runtime_image
from .backends.capabilities import Combination, input_checkpoint_precision, require, runnable, runs
from .errors import UserError
from .plan.policy import (LATENCY, MEMORY, PlanRequest, Refusal, check_checkpoint_agrees, check_target_supports,
                          choose_max_context, engine_dtype, kv_cache_request, resolve_kv_cache_dtype)
from .plan.schema import ModelInfo, Overrides, Plan, Workload
from .plan.speculative import SpeculativeRequest, host_companion, plan_speculation, request_of
from .plan.speculative_gpu import gpu_companion, plan_gpu_speculation
from .precisions import AUTO, AUTO_PRECISIONS, FLOAT_DTYPES, PRECISIONS, QUANT_ALGO, WEIGHT_BITS
from .targets import GIB, Target
from .triton_names import BATCH_SCHEDULER_POLICIES


def make_plan(model: ModelInfo | ModelArch, target: Target, precision: str, kv_cache: str = "auto",
              tp: int = 1, workload: Workload | None = None, overrides: Overrides | None = None,
              pp: int = 1, backend: str | None = None, image: str | None = None,
              speculative: SpeculativeRequest | None = None) -> Plan:
    """Plan MODEL on TARGET with BACKEND (default: the target's) in the GPU runtime IMAGE (default: the backend's,
    `runtime_images.DEFAULT_IMAGE`); raises UserError for anything that cannot work. `precision` auto: the first of
    AUTO_PRECISIONS that plans (`plan_auto`)."""
    if precision == AUTO:
        return plan_auto(model, target, kv_cache, tp, workload, overrides, pp, backend, image, speculative)
    if isinstance(model, ModelArch):
        model = ModelInfo(name=model.architecture, source="arch", path=None, arch=model)
    workload = workload or Workload()
    overrides = overrides or Overrides()
    workload.validate()
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    server = backend_serving(backend, target)
    runtime = runtime_image(image, server.name) if target.is_gpu else refuse_image(image, target)
    trtllm = runtime.trtllm if runtime else None
    check_priorities(overrides, server)
    if overrides.batch_scheduler_policy not in (None, *BATCH_SCHEDULER_POLICIES):
        raise UserError(f"batch_scheduler_policy must be one of {', '.join(BATCH_SCHEDULER_POLICIES)}, not "
                        f"{overrides.batch_scheduler_policy!r}")
    arch = model.arch
    is_checkpoint = model.source == "checkpoint"
    if is_checkpoint:
        pp = model.checkpoint_pp_size or 1
    dtype = engine_dtype(precision, arch)
    kv_dtype = resolve_kv_cache_dtype(kv_cache, precision, dtype,
                                      (model.checkpoint_quantization or {}).get("kv_cache_quant_algo"),
                                      is_checkpoint, target)
    warnings = check_target_supports(target, precision, kv_dtype, tp, pp, arch, server.name, trtllm)
    prequantized = input_checkpoint_precision(model.source_quantization)
    if prequantized:
        require(Combination(prequantized, None, server.name, target.sm if target.is_gpu else None, trtllm))
    if model.checkpoint_sparsity and not server.sparse_kernels:
        warnings.append(f"{model.checkpoint_sparsity} sparse checkpoint on the {server.name} backend, which has no "
                        "sparse kernels: it runs as dense weights half of them zero (the quality is the sparse "
                        "model's; speed and memory are the dense model's)")
    # An engine keeps the checkpoint's dtype; the reference runtime runs any checkpoint dtype in float32.
    check_checkpoint_agrees(model, precision, kv_dtype, dtype, tp, check_dtype=server.exact_checkpoint_dtype)
    max_context = choose_max_context(workload, arch)
    draft, companion = (None, None) if speculative is None else (
        gpu_companion(speculative, model, target, precision, dtype, kv_dtype, tp, pp, server.name, trtllm)
        if target.is_gpu else host_companion(speculative, model))
    plan = server.plan(PlanRequest(model, target, precision, dtype, kv_dtype, tp, pp, workload, overrides,
                                   max_context, warnings, trtllm, companion))
    if speculative is not None:
        plan = (plan_gpu_speculation(plan, speculative, draft, companion) if target.is_gpu else
                plan_speculation(plan, speculative, (draft, companion)))
    return replace(plan, runtime_image=runtime.name) if runtime else plan


def refuse_image(image: str | None, target: Target) -> None:
    if image is not None:
        raise UserError(f"--runtime-image names a GPU runtime image; the {target.name} target serves in trtpipe's "
                        "own Triton (drop --runtime-image)")


def plan_auto(model, target: Target, kv_cache: str, tp: int, workload: Workload | None, overrides: Overrides | None,
              pp: int, backend: str | None, image: str | None = None,
              speculative: SpeculativeRequest | None = None) -> Plan:
    """--precision auto: the highest-quality precision whose plan fits the workload (context, concurrency, latency
    budget) on the target, trying AUTO_PRECISIONS in order; the plan records the choice and why each one before it
    was not planned. A checkpoint's precision is its own: auto takes it. Nothing fits: one UserError with every
    reason and what would help."""
    if isinstance(model, ModelInfo) and model.source == "checkpoint":
        algo = (model.checkpoint_quantization or {}).get("quant_algo")
        own = next((p for p, a in QUANT_ALGO.items() if a == algo), None) if algo else \
            next(p for p, d in FLOAT_DTYPES.items() if d == model.arch.dtype)
        if own is None:
            raise UserError(f"--precision auto: checkpoint {model.name} is {algo}, which plan does not take")
        return make_plan(model, target, own, kv_cache, tp, workload, overrides, pp, backend, image, speculative)
    rejected = {}
    for precision in AUTO_PRECISIONS:
        try:
            plan = make_plan(model, target, precision, kv_cache, tp, workload, overrides, pp, backend, image,
                             speculative)
        except UserError as exc:
            rejected[precision] = str(exc).split("; instead:")[0]
            continue
        short = too_few_sequences(plan)
        if short:
            rejected[precision] = short
            continue
        choice = {"chosen": precision, "rejected": rejected}
        note = f"--precision auto chose {precision}" + (": " + "; ".join(f"{p}: {why}" for p, why in rejected.items())
                                                       if rejected else f", the first of {', '.join(AUTO_PRECISIONS)}")
        return replace(plan, precision_choice=choice, warnings=[note, *plan.warnings])
    reasons = "; ".join(f"{p}: {why}" for p, why in rejected.items())
    raise UserError(f"--precision auto: no precision fits {target.name} ({reasons}). A shorter --max-context, a lower "
                    "--concurrency or more GPUs (--tp) would")


def too_few_sequences(plan: Plan) -> str | None:
    """Why `plan` does not serve its workload's --concurrency at once (None when it does): its KV cache holds fewer
    sequences of the workload's length (a plan made anyway runs a smaller batch, with a warning)."""
    wanted, w = plan.workload.concurrency, plan.workload
    if not wanted or plan.max_concurrent_sequences >= wanted:
        return None
    return (f"{plan.model.name} at {plan.precision} holds {plan.max_concurrent_sequences} of the {wanted} concurrent "
            f"sequences of {w.input_len} + {w.output_len} tokens asked for ({plan.memory.kv_cache_tokens} tokens of "
            f"KV cache in {plan.memory.kv_cache_bytes / GIB:.2f} GiB next to {plan.weights_bytes_per_rank / GIB:.2f} "
            "GiB of weights per GPU)")


def check_priorities(overrides: Overrides, server) -> None:
    """Priority levels only where the backend's scheduler starts requests by them (else Triton's levels would
    reorder a queue the decoupled model empties at once: accepted and ignored)."""
    levels, default = overrides.priority_levels, overrides.default_priority_level
    if not levels and not default:
        return
    if not server.request_priorities:
        raise UserError(f"--priority-levels: the {server.name} backend does not schedule requests by priority "
                        "(NVIDIA's tensorrtllm backend builds its executor requests without one); only the cpu "
                        "target's reference backends do")
    if not levels or levels < 1 or not 1 <= (default or 1) <= levels:
        raise UserError(f"--default-priority-level {default} needs --priority-levels N with 1 <= it <= N "
                        f"(got --priority-levels {levels})")


def replan(plan: Plan, overrides: Overrides | None = None, target: Target | None = None) -> Plan:
    """`make_plan` for the request that made `plan` (its model, precision, KV cache, tp/pp, workload, backend), with
    other `overrides` or another `target` (an instance's share of it); UserError as make_plan."""
    overrides = overrides or Overrides()
    kept = {name: getattr(plan.triton, name) or None for name in SCHEDULING_CHOICES if getattr(overrides, name) is None}
    return make_plan(plan.model, target or plan.target, plan.precision, kv_cache_request(plan), plan.tp_size,
                     plan.workload, replace(overrides, **kept), plan.pp_size, backend=plan.backend,
                     speculative=request_of(plan.speculative))


#: What a plan records of its request's scheduling overrides, kept by `replan` unless overridden
SCHEDULING_CHOICES = ("batch_scheduler_policy", "priority_levels", "default_priority_level")


# ----------------------------------------------------------------------------------------------
# Instance density

#: Densities tried at most (a GPU running more servers than this is not a deployment anyone plans)
MAX_INSTANCES = 64


def instance_share(target: Target, instances: int) -> Target:
    """The target as one of `instances` equal tenants sees it: memory / N (rounded down), the rest unchanged."""
    if instances < 1:
        raise UserError(f"--instances must be at least 1 (got {instances})")
    return replace(target, memory_bytes=target.memory_bytes // instances)


def plan_instances(model, target: Target, precision: str, instances: int, advise: bool = False,
                   **plan_options) -> Plan:
    """The plan of one of `instances` instances of MODEL at PRECISION on TARGET; UserError when it does not fit.
    With `advise`, a Refusal comes with the changes to the request that do plan (`answer`)."""
    try:
        return make_plan(model, instance_share(target, instances), precision, **plan_options)
    except UserError as exc:
        refusal = exc if isinstance(exc, Refusal) else None
        if instances > 1:
            message = (f"{instances} instances do not fit on one {target.name} (each gets "
                       f"{target.memory_bytes // instances / 2**30:.2f} GiB): {refusal.message if refusal else exc}")
            refusal = refusal.reworded(message) if refusal else Refusal(message, MEMORY)
        if refusal is None:
            raise
        if advise:
            answer(refusal, model, target, precision, instances, plan_options)
        raise refusal from None


# ----------------------------------------------------------------------------------------------
# Advice that plans: the changes tried for a Refusal


#: tries of a budget or an output length, each from the figures of the try before
RETRIES = 3


def answer(refusal: Refusal, model, target: Target, precision: str, instances: int, options: dict) -> None:
    """Fill `refusal.alternatives` with the changes to the request (as `trtpipe plan` flags) that plan: a larger P99
    budget or a shorter output (latency), a smaller --max-batch-size, a lower precision or an 8-bit KV cache (memory,
    and latency for the precision), more GPUs (--tp) or fewer --instances. Each is planned before it is named."""
    workload = options.get("workload") or Workload()
    overrides = options.get("overrides") or Overrides()
    info = model if isinstance(model, ModelInfo) else None
    fixed_model = info is not None and info.source == "checkpoint"   # precision, KV cache and tp are the checkpoint's

    def attempt(flags: dict):
        changed, p, n = dict(options), precision, instances
        for flag, value in flags.items():
            if flag == "--p99-latency":
                changed["workload"] = replace(workload, p99_latency_s=value)
            elif flag == "--output-len":
                changed["workload"] = replace(workload, output_len=value)
            elif flag == "--max-batch-size":
                changed["overrides"] = replace(overrides, max_batch_size=value)
            elif flag == "--tp":
                changed["tp"] = value
            elif flag == "--kv-cache":
                changed["kv_cache"] = value
            elif flag == "--precision":
                p = value
            elif flag == "--instances":
                n = value
        try:
            return plan_instances(model, target, p, n, **changed)
        except UserError as exc:
            return exc

    found: list[tuple[dict, str]] = []

    def first(why: str, candidates) -> None:
        for flags in candidates:
            if not isinstance(attempt(flags), UserError):
                found.append((flags, why))
                return

    fixed = overrides.max_batch_size
    if fixed and fixed > 1:
        first("a smaller batch", ({"--max-batch-size": fixed >> k} for k in range(1, fixed.bit_length())))
    if refusal.kind == LATENCY and workload.p99_latency_s:
        budget = larger_budget(refusal, attempt)
        if budget:
            found.append(({"--p99-latency": budget}, "a larger budget"))
        output = shorter_output(refusal, workload, attempt)
        if output:
            found.append(({"--output-len": output}, "a shorter output"))
    if target.is_gpu and not fixed_model:
        backend = options.get("backend") or DEFAULT_BACKEND[target.kind]
        lower = runnable([p for p in PRECISIONS if WEIGHT_BITS[p] < WEIGHT_BITS[precision]], backend=backend,
                         sm=target.sm)
        first("a lower precision", ({"--precision": p} for p in lower))
        kv = resolve_kv_cache_dtype(options.get("kv_cache", "auto"), precision,
                                    engine_dtype(precision, model_arch(model)), target=target)
        if refusal.kind == MEMORY and kv not in ("fp8", "int8"):
            eight_bit = [k for k in ("fp8", "int8") if runs(Combination(precision, k, backend, target.sm))]
            first("an 8-bit KV cache", ({"--kv-cache": k} for k in eight_bit))
        tp, pp = options.get("tp", 1), options.get("pp", 1)
        more = [tp << k for k in range(1, 4) if (tp << k) * pp <= target.max_gpus]
        first("more GPUs", ({"--tp": n} for n in more))
    if instances > 1:
        first("fewer instances", ({"--instances": n} for n in range(instances - 1, 0, -1)))
    refusal.alternatives = found


def model_arch(model) -> ModelArch:
    return model if isinstance(model, ModelArch) else model.arch


def round_up(seconds: float) -> float:
    """A budget a little above `seconds`, in two significant figures."""
    step = 10 ** (math.floor(math.log10(seconds * 1.05)) - 1)
    return round(math.ceil(seconds * 1.05 / step) * step, 6)


def larger_budget(refusal: Refusal, attempt) -> float | None:
    """The smallest round budget above what the planner predicts at batch 1, tried (again from the figures of a
    refusal that predicts more: a speed-of-light bound is below what measured kernels give)."""
    latency = refusal.latency_s
    for _ in range(RETRIES):
        if latency <= 0:
            return None
        budget = round_up(latency)
        outcome = attempt({"--p99-latency": budget})
        if not isinstance(outcome, UserError):
            return budget
        if not (isinstance(outcome, Refusal) and outcome.kind == LATENCY and outcome.latency_s > latency):
            return None
        latency = outcome.latency_s
    return None


def shorter_output(refusal: Refusal, workload: Workload, attempt) -> int | None:
    """The longest output whose predicted latency (TTFT + output x TPOT) meets the budget, tried."""
    ttft, tpot = refusal.ttft_s, refusal.tpot_s
    for _ in range(RETRIES):
        if tpot <= 0 or workload.p99_latency_s <= ttft:
            return None
        tokens = min(int((workload.p99_latency_s - ttft) / tpot), workload.output_len - 1)
        if tokens < 1:
            return None
        outcome = attempt({"--output-len": tokens})
        if not isinstance(outcome, UserError):
            return tokens
        if not (isinstance(outcome, Refusal) and outcome.kind == LATENCY):
            return None
        ttft, tpot = outcome.ttft_s, outcome.tpot_s
    return None


@dataclass(frozen=True)
class Density:
    precision: str
    max_instances: int                   # 0: not even one fits
    memory_per_instance_bytes: int       # at max_instances (0 when none fits)
    max_batch_size: int                  # of one instance at max_instances
    reason: str                          # why max_instances + 1 does not fit


def largest_density(model, target: Target, precision: str, **plan_options) -> Density:
    """The largest N whose per-instance plan fits (plans fit monotonically less as N grows)."""
    best, reason = None, ""
    for n in range(1, MAX_INSTANCES + 1):
        try:
            best = (n, make_plan(model, instance_share(target, n), precision, **plan_options))
        except UserError as exc:
            reason = str(exc)
            break
    if best is None:
        return Density(precision, 0, 0, 0, reason)
    n, plan = best
    return Density(precision, n, plan.memory.memory_bytes, plan.triton.triton_max_batch_size,
                   reason or f"capped at {MAX_INSTANCES}")


def densities(model, target: Target, **plan_options) -> list[Density]:
    """`largest_density` for every precision the capability table lets the target's backend run."""
    backend = plan_options.get("backend") or DEFAULT_BACKEND[target.kind]
    return [largest_density(model, target, p, **plan_options) for p in
            runnable(PRECISIONS, backend=backend, sm=target.sm if target.is_gpu else None)]
