"""`trtpipe doctor`: is this machine ready to build and serve TensorRT-LLM 1.2.1 engines for a GPU target?

One check per line, PASS / FAIL / SKIP with what to do: the driver (nvidia-smi answers), the GPU's name,
compute capability and memory against the target catalogue, TensorRT-LLM 1.2.1 importable,
`trtllm-build` and a `tritonserver` with the tensorrtllm backend on PATH, torch with CUDA. SKIP means a
check could not be made because one it depends on failed. Every probe of the machine is one small
function (`query_gpus`, `probe_tensorrt_llm`, `find_tool`, `probe_torch_cuda`) so tests can stand in for
a GPU box; the nvidia-smi output is parsed by `parse_gpu_query` whatever produced it.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import TRITON_IMAGE, TRTLLM_VERSION
from .backends.capabilities import Combination, runtime_refusal
from .backends.names import ENGINE
from .errors import UserError
from .targets import Target, catalogue, get_target

GPU_QUERY = ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"]
#: The catalogue plans against what nvidia-smi reports for the SKU (usable_memory_mib); boards of one SKU
#: differ a little (ECC toggled, another memory vendor, a PCIe variant): within this fraction below the
#: catalogue's figure the memory counts as the target's.
MEMORY_TOLERANCE = 0.05
PROBE_TIMEOUT_S = 300
CONTAINER_HINT = f"run in the trtpipe container (Dockerfile, base {TRITON_IMAGE})"


class ProbeError(Exception):
    """A probe found nothing usable: what it saw, and what to do about it."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class Gpu:
    name: str
    sm: int             # compute capability as major*10+minor
    memory_mib: int


@dataclass(frozen=True)
class Check:
    name: str
    status: str         # PASS | FAIL | SKIP
    detail: str
    fix: str = ""

    def render(self) -> str:
        line = f"{self.status:<4}  {self.name:<18}  {self.detail}"
        return line + (f" -- to do: {self.fix}" if self.fix and self.status != "PASS" else "")


@dataclass(frozen=True)
class DoctorReport:
    target: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)

    def to_dict(self) -> dict:
        return {"target": self.target, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}

    def render(self) -> str:
        counts = {s: sum(c.status == s for c in self.checks) for s in ("PASS", "FAIL", "SKIP")}
        verdict = "ready" if self.ok else "NOT ready"
        last = (f"doctor: {verdict} for {self.target} ({counts['PASS']} passed, {counts['FAIL']} failed, "
                f"{counts['SKIP']} skipped)")
        return "\n".join([*(c.render() for c in self.checks), last])


# ------------------------------------------------------------------------------------------ probes


def parse_gpu_query(text: str) -> list[Gpu]:
    """The GPUs in `nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits` output."""
    gpus = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not row:
            continue
        try:
            name, capability, memory = (field.strip() for field in row)
            major, minor = capability.split(".")
            gpus.append(Gpu(name, int(major) * 10 + int(minor), int(float(memory))))
        except ValueError:
            raise ValueError(f"cannot read {','.join(row)!r} as name, compute capability, memory in MiB") from None
    return gpus


def query_gpus() -> list[Gpu]:
    """Every GPU nvidia-smi lists (it ignores CUDA_VISIBLE_DEVICES: all of the box's GPUs are checked)."""
    if shutil.which(GPU_QUERY[0]) is None:
        raise ProbeError("nvidia-smi is not on PATH: no NVIDIA driver here, or a container started without "
                         "GPUs", "install the NVIDIA driver; in Docker pass --gpus all (NVIDIA Container Toolkit)")
    try:
        proc = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProbeError(f"nvidia-smi did not answer ({exc})", "check the NVIDIA driver (run nvidia-smi)") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise ProbeError(f"nvidia-smi exited with status {proc.returncode}: {said}",
                         "check that the driver is loaded and recent enough to report compute_cap")
    try:
        gpus = parse_gpu_query(proc.stdout)
    except ValueError as exc:
        raise ProbeError(f"nvidia-smi output: {exc}", "update the NVIDIA driver") from None
    if not gpus:
        raise ProbeError("nvidia-smi lists no GPU", "in Docker pass --gpus all; otherwise check the driver")
    return gpus


def probe_tensorrt_llm() -> str:
    """TensorRT-LLM's version, imported for real in a child Python.

    A child, because a broken install only shows at import time (missing MPI or CUDA libraries), and the
    import loads CUDA libraries and prints a banner that this process should not carry.
    """
    code = "import tensorrt_llm; print(tensorrt_llm.__version__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"import tensorrt_llm took over {PROBE_TIMEOUT_S} s", CONTAINER_HINT) from None
    if proc.returncode != 0:
        said = (proc.stderr.strip() or "no output").splitlines()[-1]
        raise ProbeError(f"import tensorrt_llm failed: {said}", CONTAINER_HINT)
    return proc.stdout.strip().splitlines()[-1]


def find_tool(name: str) -> str | None:
    return shutil.which(name)


def probe_torch_cuda() -> str:
    """What torch sees: its version, its CUDA and the number of devices; ProbeError when there is no CUDA."""
    import torch

    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ProbeError(f"torch {torch.__version__} ({built}) sees no CUDA device",
                         "use the container's torch (scripts/setup.sh installs a CPU build); in Docker pass --gpus all")
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"


# ------------------------------------------------------------------------------------------ checks


def run_doctor(target_name: str) -> DoctorReport:
    """Every check for a GPU target; an unknown target or the cpu target is a usage error (exit 2)."""
    target = get_target(target_name)
    if not target.is_gpu:
        raise UserError(f"trtpipe doctor checks a GPU box for a GPU target; {target.name} needs no GPU "
                        "(scripts/setup.sh sets everything up for it). Pass --target rtx4090 or another GPU")
    return DoctorReport(target.name, [*gpu_checks(target), tensorrt_llm_check(), trtllm_build_check(),
                                      tritonserver_check(), torch_cuda_check()])


def gpu_checks(target: Target) -> list[Check]:
    try:
        gpus = query_gpus()
    except ProbeError as exc:
        skipped = [Check(name, "SKIP", "needs nvidia-smi") for name in ("gpu", "compute capability", "memory")]
        return [Check("nvidia-smi", "FAIL", str(exc), exc.fix), *skipped]
    return [Check("nvidia-smi", "PASS", f"the driver answers: {len(gpus)} GPU(s)"), name_check(gpus, target),
            compute_capability_check(gpus, target), memory_check(gpus, target)]


def _listed(gpus: list[Gpu]) -> str:
    return "; ".join(f"GPU {i}: {g.name}" for i, g in enumerate(gpus))


def name_check(gpus: list[Gpu], target: Target) -> Check:
    """Informational: SKU names differ between nvidia-smi and datasheets (H100 SXM5 vs "H100 80GB HBM3"), so
    the compute capability and memory decide; the name says whether this is the card the figures are for."""
    wanted = set(target.sku.split(" (")[0].lower().replace("-", " ").split())
    same = all(wanted <= set(g.name.lower().replace("-", " ").split()) for g in gpus)
    note = f"the {target.name} target's SKU" if same else (
        f"not named like the {target.name} target's {target.sku}; compute capability and memory decide")
    return Check("gpu", "PASS", f"{_listed(gpus)} ({note})")


def compute_capability_check(gpus: list[Gpu], target: Target) -> Check:
    wrong = [f"GPU {i} {g.name} is sm_{g.sm}" for i, g in enumerate(gpus) if g.sm != target.sm]
    if not wrong:
        return Check("compute capability", "PASS", f"sm_{target.sm}, as {target.name}")
    fits = sorted({t.name for t in catalogue().values() for g in gpus if t.sm == g.sm}) or ["none in the catalogue"]
    return Check("compute capability", "FAIL", f"{'; '.join(wrong)}, {target.name} is sm_{target.sm}",
                 f"engines only run on the compute capability they were built for: build for this GPU's target "
                 f"({', '.join(fits)}; see `trtpipe targets`) or run on a {target.sku}")


def memory_check(gpus: list[Gpu], target: Target) -> Check:
    wanted_mib = target.memory_bytes / (1 << 20)
    low = [f"GPU {i} {g.name} has {g.memory_mib} MiB" for i, g in enumerate(gpus)
           if g.memory_mib < wanted_mib * (1 - MEMORY_TOLERANCE)]
    if low:
        return Check("memory", "FAIL", f"{'; '.join(low)}, the {target.name} plan assumes "
                     f"{wanted_mib:.0f} MiB", "plan for a target with this GPU's memory, or run on a "
                     f"{target.sku}: the plan's KV cache and batch sizes would not fit")
    smallest = min(g.memory_mib for g in gpus)
    more = " (more than the plan assumes; the KV cache uses the extra)" if smallest > wanted_mib else ""
    return Check("memory", "PASS",
                 f"{smallest} MiB per GPU, {target.name} plans {wanted_mib:.0f} MiB{more}")


def tensorrt_llm_check() -> Check:
    try:
        found = probe_tensorrt_llm()
    except ProbeError as exc:
        return Check("tensorrt-llm", "FAIL", str(exc), exc.fix)
    if found != TRTLLM_VERSION:
        removed = runtime_refusal(ENGINE, found)
        why = (f"{removed.reason.format(c=Combination('fp16', trtllm=found))} ({removed.source})" if removed
               else "the version whose flags and files trtpipe checked")
        return Check("tensorrt-llm", "FAIL", f"version {found}, trtpipe targets {TRTLLM_VERSION}",
                     f"install TensorRT-LLM {TRTLLM_VERSION}: {why}; {CONTAINER_HINT}")
    return Check("tensorrt-llm", "PASS", f"version {found}")


def trtllm_build_check() -> Check:
    path = find_tool("trtllm-build")
    if path is None:
        return Check("trtllm-build", "FAIL", "not on PATH",
                     f"it comes with TensorRT-LLM {TRTLLM_VERSION}: {CONTAINER_HINT}")
    return Check("trtllm-build", "PASS", path)


def tritonserver_check() -> Check:
    """tritonserver on PATH, with the tensorrtllm backend beside it (the one trtpipe embeds has none)."""
    path = find_tool("tritonserver")
    if path is None:
        return Check("tritonserver", "FAIL", "not on PATH",
                     f"it is /opt/tritonserver/bin/tritonserver in the container: {CONTAINER_HINT}")
    backend = Path(path).resolve().parent.parent / "backends" / "tensorrtllm"
    if not backend.is_dir():
        return Check("tritonserver", "FAIL", f"{path} has no tensorrtllm backend ({backend} is missing)",
                     f"use the Triton build with the TensorRT-LLM backend: {CONTAINER_HINT}")
    return Check("tritonserver", "PASS", f"{path} (tensorrtllm backend: {backend})")


def torch_cuda_check() -> Check:
    try:
        return Check("torch.cuda", "PASS", probe_torch_cuda())
    except ProbeError as exc:
        return Check("torch.cuda", "FAIL", str(exc), exc.fix)
