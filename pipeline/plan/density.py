"""Instance density: N instances of one build side by side on one GPU (multi-tenant, or A and B of a
comparison on one RTX 4090).

Each instance is its own server process with its own CUDA context, engine and KV cache, so each is
planned as if the GPU had memory / N: the planner's budget (weights, activations, the runtime reserve
with its CUDA context, then the KV-cache fraction of what is left) applies per instance, and an instance
fits when its weights, activations and reserve leave room for at least one sequence of the workload.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UserError
from ..precisions import PRECISIONS
from ..targets import Target
from .policy import make_plan
from .schema import Plan

#: Densities tried at most (a GPU running more servers than this is not a deployment anyone plans)
MAX_INSTANCES = 64


def instance_share(target: Target, instances: int) -> Target:
    """The target as one of `instances` equal tenants sees it: memory / N (rounded down), the rest unchanged."""
    if instances < 1:
        raise UserError(f"--instances must be at least 1 (got {instances})")
    return replace(target, memory_bytes=target.memory_bytes // instances)


def plan_instances(model, target: Target, precision: str, instances: int, **plan_options) -> Plan:
    """The plan of one of `instances` instances of MODEL at PRECISION on TARGET; UserError when it does not fit."""
    try:
        return make_plan(model, instance_share(target, instances), precision, **plan_options)
    except UserError as exc:
        if instances == 1:
            raise
        raise UserError(f"{instances} instances do not fit on one {target.name} (each gets "
                        f"{target.memory_bytes // instances / 2**30:.2f} GiB): {exc}") from None


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
    """`largest_density` for every precision the target can run (fp8 only where it supports FP8)."""
    return [largest_density(model, target, p, **plan_options) for p in PRECISIONS
            if p != "fp8" or target.supports_fp8 or target.kind == "cpu"]
