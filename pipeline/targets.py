"""The target catalogue: GPUs trtpipe can plan for, and the `cpu` target.

The figures (compute capability, memory, bandwidth, dense tensor-core rates, peer-to-peer support)
live in `pipeline/data/targets.json`, each with the document it comes from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from .errors import UserError

CATALOGUE_PATH = Path(__file__).parent / "data" / "targets.json"
GIB = 1 << 30
MIB = 1 << 20
#: FP8 tensor cores (and TensorRT-LLM's FP8 paths) need compute capability 8.9 or newer.
FP8_MIN_SM = 89


@dataclass(frozen=True)
class Target:
    name: str
    sku: str
    kind: str                     # "gpu" | "cpu"
    sm: int | None                # compute capability as major*10+minor (89 = 8.9)
    memory_bytes: int             # per GPU (host RAM for the cpu target)
    bandwidth_bytes_per_s: float  # per GPU
    fp32_tflops: float | None
    fp16_tflops: float | None     # dense tensor-core rate (FP32 accumulate)
    fp8_tflops: float | None      # None: no FP8 tensor cores
    int8_tops: float | None
    max_gpus: int
    p2p: bool
    interconnect: str
    sources: dict
    triton_max_batch_size: int | None = None   # cpu target only
    board_power_w: float | None = None         # rated maximum board power (GPUs): an upper bound of the draw

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def supports_fp8(self) -> bool:
        return self.sm is not None and self.sm >= FP8_MIN_SM

    @property
    def compute_capability(self) -> str | None:
        return None if self.sm is None else f"{self.sm // 10}.{self.sm % 10}"

    def peak_ops_per_s(self, precision: str) -> float:
        """Dense peak rate (operations/s) for the GEMMs of a model at `precision`."""
        rate = {"fp8": self.fp8_tflops, "int8-sq": self.int8_tops,
                "fp32": self.fp32_tflops}.get(precision, self.fp16_tflops)
        if rate is None:  # the cpu target computes everything in float32
            rate = self.fp32_tflops
        return rate * 1e12

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compute_capability"] = self.compute_capability
        d["supports_fp8"] = self.supports_fp8
        return d


def usable_memory_bytes(entry: dict) -> int:
    """What the card reports to the driver (nvidia-smi, default ECC), else the catalogue's capacity (the cpu
    target's RAM figure)."""
    if "usable_memory_mib" in entry:
        return entry["usable_memory_mib"] * MIB
    return round(entry["memory_gib"] * GIB)


def _target_from_entry(entry: dict) -> Target:
    return Target(
        name=entry["name"], sku=entry["sku"], kind=entry["kind"], sm=entry["sm"],
        memory_bytes=usable_memory_bytes(entry),
        bandwidth_bytes_per_s=entry["bandwidth_gbps"] * 1e9,
        fp32_tflops=entry["fp32_tflops"], fp16_tflops=entry["fp16_tflops"],
        fp8_tflops=entry["fp8_tflops"], int8_tops=entry["int8_tops"],
        max_gpus=entry["max_gpus"], p2p=entry["p2p"], interconnect=entry["interconnect"],
        sources=entry["sources"], triton_max_batch_size=entry.get("triton_max_batch_size"),
        board_power_w=entry.get("board_power_w"),
    )


@lru_cache(maxsize=1)
def catalogue() -> dict[str, Target]:
    entries = json.loads(CATALOGUE_PATH.read_text())["targets"]
    return {e["name"]: _target_from_entry(e) for e in entries}


def get_target(name: str) -> Target:
    targets = catalogue()
    if name.lower() not in targets:
        raise UserError(f"unknown target {name!r}; known targets: {', '.join(targets)} "
                        "(see `trtpipe targets`)")
    return targets[name.lower()]


def render_targets() -> object:
    """A rich table of the catalogue."""
    from rich.table import Table

    table = Table(title="trtpipe targets (figures and sources: pipeline/data/targets.json)")
    table.add_column("name", no_wrap=True)  # what users pass to --target and grep for: never split
    for col in ("sm", "memory", "bandwidth", "FP16 TFLOPS", "FP8 TFLOPS", "INT8 TOPS", "GPUs", "P2P"):
        table.add_column(col)
    for t in catalogue().values():
        table.add_row(t.name, t.compute_capability or "-", f"{t.memory_bytes / GIB:.2f} GiB",
                      f"{t.bandwidth_bytes_per_s / 1e9:g} GB/s", _fmt(t.fp16_tflops), _fmt(t.fp8_tflops),
                      _fmt(t.int8_tops), str(t.max_gpus), "yes" if t.p2p else "no")
    return table


def _fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:g}"
