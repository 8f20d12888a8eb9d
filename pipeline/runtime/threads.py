"""How many threads the reference runtime computes one step with when serving."""

from __future__ import annotations

import os


def serving_threads() -> int:
    """Every core this process may use but one. That core is for Triton's frontend, the pre/postprocessing models
    and clients on the same machine: when all cores compute, one preempted thread stalls every parallel region
    (docs/aiperf.md measured a SmolLM2 decode step 3-15x slower with 2 threads than with 1 on a busy 2-core
    machine). The cpu plan times the runtime with the same number (plan/host_timing.py)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)
