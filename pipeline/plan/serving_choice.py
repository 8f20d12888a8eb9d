"""The batch and max_num_tokens of an engine plan, chosen with the performance model (`performance`): the most
output tokens/s that fit aiconfigurator-core's memory estimate and the workload's P99 budget, and what a
max_num_tokens below the prompt costs a lone request (`chunking_cost`). Without AIC, or without its data for the plan,
trtpipe's own choice stands and the plan states its speed-of-light bound."""

from __future__ import annotations

from dataclasses import replace

from ..targets import Target
from .memory import format_gib
from .performance import (
    Performance,
    Workpoint,
    estimate,
    estimate_or_reason,
    memory_estimate,
    performance_of,
    speed_of_light_performance,
)
from .policy import LATENCY, MEMORY, PlanRequest, Refusal
from .schema import Workload


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


#: max_num_tokens the planner compares (powers of two: TensorRT-LLM's profiles; 8192 is its default)
TOKEN_CHOICES = (1024, 2048, 4096, 8192)


def plan_serving(request: PlanRequest, point: Workpoint, chunked: bool, max_seq_len: int, prefill_s: float,
                 sol_step_s: float) -> tuple[Workpoint, Performance, list[str]]:
    """The batch and max_num_tokens with the most output tokens/s that fit aiconfigurator-core's memory estimate
    and the P99 budget (its serving model: in-flight batching, prefills charged), and what the plan predicts for
    them. `point` holds trtpipe's own choice, which bounds the batch; an override is kept as given. Without AIC
    (or data for the plan) the choice stands and the figures are trtpipe's speed-of-light bound."""
    target, workload, overrides = request.target, request.workload, request.overrides
    found, why = estimate_or_reason(target, point)
    if found is None:
        return point, speed_of_light_performance(target, point, prefill_s, sol_step_s, why), [bound_warning(why)]
    if overrides.max_num_tokens is not None:
        token_options = [point.max_num_tokens]
    else:
        token_options = sorted({min(t, max_seq_len * point.batch) for t in TOKEN_CHOICES
                                if chunked or t >= max_seq_len - 1} or {point.max_num_tokens})
    warnings, best = [], None
    for tokens in token_options:
        for candidate in batch_options(target, replace(point, max_num_tokens=tokens), overrides.max_batch_size):
            found = estimate(target, candidate)
            latency = found.ttft_s + (candidate.osl - 1) * found.tpot_s
            if found.out_of_memory or (workload.p99_latency_s and latency > workload.p99_latency_s):
                continue
            if best is None or found.output_tokens_per_s > best[1].output_tokens_per_s:
                best = (candidate, found)
    if best is None:
        raise serving_refusal(target, point, workload, overrides.max_batch_size)
    chosen, found = best
    if chosen.batch < point.batch:
        warnings.append(f"batch {chosen.batch} instead of {point.batch}: "
                        + smaller_batch_reason(target, point, chosen, found, workload))
    performance = performance_of(target, chosen, found)
    performance.notes.append(f"max_num_tokens {chosen.max_num_tokens}: the most output tokens/s of "
                             f"{', '.join(map(str, token_options))} at this batch"
                             + (" within the P99 budget" if workload.p99_latency_s else ""))
    if chosen.max_num_tokens < chosen.isl:
        performance.notes.append(chunking_cost(target, chosen, found))
    return chosen, performance, warnings


def bound_warning(why: str) -> str:
    """What a plan without measured or derived figures says first: which data is missing, and that its figures
    bound the GPU rather than predict it."""
    return (f"no measured data: {why.split(': the figures are')[0]}. TTFT and TPOT are lower bounds (≥) and output "
            "tokens/s an upper bound (≤) at the speed of light, not predictions: real serving is slower, so do not "
            "compare them with a measured or derived plan's figures")


def chunking_cost(target: Target, chosen: Workpoint, found) -> str:
    """What a max_num_tokens below the prompt costs (or, at long prompts, saves) a lone request's TTFT, its prefill
    in chunks that each read the weights again and attend to the ones before, and what one holding the prompt
    gives."""
    whole = next((t for t in TOKEN_CHOICES if t >= chosen.isl), chosen.isl)
    other = estimate(target, replace(chosen, max_num_tokens=whole))
    chunks = -(-chosen.isl // chosen.max_num_tokens)
    cost_ms = (found.prefill_s - other.prefill_s) * 1e3
    fits = "" if not other.out_of_memory else ", but does not fit aiconfigurator-core's memory estimate"
    return (f"max_num_tokens {chosen.max_num_tokens} prefills the {chosen.isl}-token prompt in {chunks} chunks: a "
            f"request alone waits {found.prefill_s * 1e3:.1f} ms for its first token, {abs(cost_ms):.1f} ms "
            f"{'more' if cost_ms >= 0 else 'less'} than in one step with max_num_tokens {whole} "
            f"({other.prefill_s * 1e3:.1f} ms), which at batch {chosen.batch} gives TTFT {other.ttft_s * 1e3:.0f} ms "
            f"and {other.output_tokens_per_s:.0f} output tokens/s (this plan: {found.ttft_s * 1e3:.0f} ms, "
            f"{found.output_tokens_per_s:.0f}){fits}")


def smaller_batch_reason(target: Target, point: Workpoint, chosen: Workpoint, found, workload: Workload) -> str:
    memory, capacity = memory_estimate(target, replace(point, max_num_tokens=chosen.max_num_tokens))
    if memory["total"] > capacity:
        return (f"aiconfigurator-core's memory estimate at batch {point.batch} is {format_gib(memory['total'])} "
                f"(weights {format_gib(memory['weights'])}, KV cache {format_gib(memory['kv_cache'])}, "
                f"activations {format_gib(memory['activations'])}, other {format_gib(memory['others'])}) of "
                f"{format_gib(capacity)} usable")
    if workload.p99_latency_s:
        return f"the P99 budget {workload.p99_latency_s:g} s"
    full = estimate(target, replace(point, max_num_tokens=chosen.max_num_tokens))
    return (f"aiconfigurator-core predicts more output tokens/s at batch {chosen.batch} "
            f"({found.output_tokens_per_s:.0f}) than at {point.batch} ({full.output_tokens_per_s:.0f}): the "
            "prefills of a fuller batch cost more than its decode steps gain")


def batch_options(target: Target, point: Workpoint, fixed: int | None) -> list[Workpoint]:
    """The largest batch up to `point`'s that AIC's memory estimate fits, and its halvings (smaller batches, for
    a P99 budget); only `fixed` when the user set it."""
    if fixed is not None:
        return [point]

    def fits(batch: int) -> bool:
        memory, capacity = memory_estimate(target, replace(point, batch=batch))
        return memory["total"] <= capacity

    largest = largest_batch(fits, point.batch)
    batches = sorted({largest} | {largest >> k for k in range(1, largest.bit_length()) if largest >> k})
    return [replace(point, batch=b) for b in reversed(batches)]


def serving_refusal(target: Target, point: Workpoint, workload: Workload, fixed: int | None) -> Refusal:
    """Why no batch works: AIC's memory estimate or the P99 budget, at the user's batch or at batch 1."""
    batch = fixed or 1
    one = estimate(target, replace(point, batch=batch))
    where = f"--max-batch-size {batch}" if fixed else "batch 1"
    if one.out_of_memory:
        memory = one.memory_bytes
        return Refusal(f"aiconfigurator-core's memory estimate does not fit {target.name} at {where}: "
                       f"{format_gib(memory['total'])} (weights {format_gib(memory['weights'])}, KV "
                       f"{format_gib(memory['kv_cache'])}, other {format_gib(memory['others'])}) "
                       f"of {format_gib(one.capacity_bytes)} usable", MEMORY, batch)
    latency = one.ttft_s + (point.osl - 1) * one.tpot_s
    return Refusal(f"the P99 latency budget {workload.p99_latency_s:g} s cannot be met on {target.name}: "
                   f"aiconfigurator-core predicts {latency:.3f} s at {where} (TTFT {one.ttft_s * 1e3:.1f} ms + "
                   f"{point.osl - 1} x TPOT {one.tpot_s * 1e3:.2f} ms)", LATENCY, batch, latency, one.ttft_s,
                   one.tpot_s)
