"""Run calibration samples through the reference runtime and keep streaming statistics per tensor.

The runtime's observer hands over the input of every quantizable linear and the K / V values that
enter the KV cache. `mlp.fc` and `mlp.gate` read the same input, so only `fc` is recorded and `gate`
shares its statistics. For SmoothQuant a first pass records per-channel maxima and a second pass
histograms the smoothed inputs (x * prequant_scaling_factor), which is what the engine quantizes.
The same pass accumulates, for GPTQ weight rounding, x^T x of the linear inputs named in `hessians`;
`collect_hessians` runs further passes for the names that did not fit in memory the first time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .histogram import ChannelMax, StreamingHistogram
from .rounding import HessianStats

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
KV = ("attention.k", "attention.v")
SHARED_INPUT = {"mlp.gate": "mlp.fc"}


def stats_key(name: str) -> str | None:
    """The statistics a runtime tensor name feeds (None for names that share another's input)."""
    for suffix in SHARED_INPUT:
        if name.endswith("." + suffix):
            return None
    return name


def source_of(name: str) -> str:
    """The recorded tensor whose statistics `name` uses (transformer.layers.3.mlp.gate -> ...mlp.fc)."""
    for suffix, shared in SHARED_INPUT.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix)] + shared
    return name


@dataclass
class ActivationStats:
    histograms: dict[str, StreamingHistogram] = field(default_factory=dict)
    channel_max: dict[str, ChannelMax] = field(default_factory=dict)
    hessians: dict[str, HessianStats] = field(default_factory=dict)
    tokens: int = 0


def collect_channel_max(model, samples: list[list[int]], progress: bool = True) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every linear input (SmoothQuant's first pass)."""
    stats = ActivationStats()

    def observe(name: str, x: torch.Tensor) -> None:
        key = stats_key(name)
        if key is not None and not _is_kv(key):
            stats.channel_max.setdefault(key, ChannelMax()).collect(x)

    _run(model, samples, observe, stats, "calibration pass 1/2 (channel max)" if progress else None)
    return {k: v.values for k, v in stats.channel_max.items()}


def collect_histograms(model, samples: list[list[int]], prequant: dict[str, torch.Tensor] | None = None,
                       progress: bool = True, desc: str = "calibration",
                       hessians: frozenset[str] = frozenset()) -> ActivationStats:
    """Histograms and running maxima of every linear input (times its smoothing, if any) and of K / V,
    and x^T x of the linear inputs in `hessians`."""
    return _collect(model, samples, prequant or {}, True, hessians, desc if progress else None)


def collect_hessians(model, samples: list[list[int]], names: frozenset[str],
                     prequant: dict[str, torch.Tensor] | None = None, progress: bool = True,
                     desc: str = "calibration (GPTQ statistics)") -> dict[str, HessianStats]:
    """x^T x (times smoothing, if any) of the linear inputs in `names` only."""
    return _collect(model, samples, prequant or {}, False, names, desc if progress else None).hessians


def _collect(model, samples: list[list[int]], prequant: dict[str, torch.Tensor], histograms: bool,
             hessians: frozenset[str], desc: str | None) -> ActivationStats:
    stats = ActivationStats()

    def observe(name: str, x: torch.Tensor) -> None:
        key = stats_key(name)
        if key is None or not (histograms or key in hessians):
            return
        if key in prequant:
            x = x * prequant[key]
        if histograms:
            stats.histograms.setdefault(key, StreamingHistogram()).collect(x)
        if key in hessians:
            stats.hessians.setdefault(key, HessianStats()).collect(x)

    _run(model, samples, observe, stats, desc)
    return stats


def _run(model, samples: list[list[int]], observe, stats: ActivationStats, desc: str | None) -> None:
    with torch.inference_mode():
        for ids in tqdm(samples, desc=desc, unit="sample", disable=desc is None, leave=False):
            model.forward(torch.tensor([ids], dtype=torch.long), observer=observe)
            stats.tokens += len(ids)


def _is_kv(name: str) -> bool:
    return name.endswith((".attention.k", ".attention.v"))
