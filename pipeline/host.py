"""The host the cpu target serves on: how many threads the reference runtime computes a step with, which processor
it is (torch-free: the cpu plan reads both without loading the runtime), and what `trtpipe serve` and the served
model say to each other when the server stops."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import NamedTuple


def serving_threads() -> int:
    """Every core this process may use but one. That core is for Triton's frontend, the pre/postprocessing models
    and clients on the same machine: when all cores compute, one preempted thread stalls every parallel region
    (docs/aiperf.md measured a SmolLM2 decode step 3-15x slower with 2 threads than with 1 on a busy 2-core
    machine). The cpu plan times the runtime with the same number (plan/host_timing.py)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def onnx_serving_threads() -> int:
    """ONNX Runtime's intra-op threads when it serves: every core this process may use. Measured on a 2-core
    machine (benchmarks/bench_cpu_threads.py, docs/cpu-serving.md): with both cores ONNX Runtime served SmolLM2 at
    1.23x the tokens/s of one core at concurrency 1 and 1.56x at 8 (TTFT p50 137 against 608 ms), while torch with
    two threads was slower than with one (0.92x, 0.89x), so torch keeps `serving_threads`."""
    return len(os.sched_getaffinity(0))


#: the served tensorrt_llm model's parameter: "false" makes ONNX Runtime's intra-op threads sleep between parallel
#: regions instead of spinning (its session config entry `session.intra_op.allow_spinning` "0"); unset, they spin
INTRA_OP_SPINNING = "intra_op_spinning"


def cpu_model() -> str:
    """The processor's name (Linux: /proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: /proc/cpuinfo flags of x86 processors whose int8 dot product accumulates in 32 bits (VPDPBUSD)
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def int8_gemm_saturates(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether ONNX Runtime's integer GEMM may saturate here: on x86-64 without VNNI it multiplies u8 by s8 with
    VPMADDUBSW, whose pairwise sums are clamped to 16 bits (onnxruntime.ai/docs/performance/model-optimizations/
    quantization.html, "When and why do I need to try U8U8?"); an INT8-SmoothQuant export's logits were measured off
    the runtime's by 11% on an AVX2-only EPYC (tests/test_onnx.py). An x86 processor whose flags cannot be read counts
    as saturating; other architectures' int8 dot products (Arm's SDOT/UDOT) accumulate in 32 bits."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386", "x86"):
        return False
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return not any(flag in flags for flag in VNNI_FLAGS)


class ProcessStat(NamedTuple):
    """One process as /proc/PID/stat shows it."""

    pid: int
    ppid: int
    group: int      # its process group
    cpu_s: float    # user + system CPU time so far, in seconds


def process_stats(proc: Path = Path("/proc")) -> list[ProcessStat]:
    """Every process /proc shows (Linux; none without /proc). One that ends between the listing and the read is left
    out."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ... utime stime ...": comm may hold spaces and ")", so split after the last
            fields = stat.read_text().rsplit(")", 1)[1].split()
            found.append(ProcessStat(int(stat.parent.name), int(fields[1]), int(fields[2]),
                                     (int(fields[11]) + int(fields[12])) / ticks))
        except (OSError, IndexError, ValueError):
            continue
    return found


# What `trtpipe serve` and the cpu target's served model share (pipeline/serve.py, model_repo/tensorrt_llm):
#: the environment variable naming the file serve writes when it stops: DRAINING (refuse new requests) or
#: CANCELLING (end the running ones with an error: the drain timeout passed)
DRAIN_FILE_ENV = "TRTPIPE_DRAIN_FILE"
DRAINING, CANCELLING = "drain", "cancel"
#: the gauge the model exports on Triton's /metrics: requests accepted and not yet answered in full
LIVE_REQUESTS_METRIC = "trtpipe_live_requests"
