"""Per-tensor calibration results: amax of every method, saturation, quantization SNR; JSON and plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .amax import METHODS, Histogram, compute_amax
from .formats import QuantFormat
from .histogram import StreamingHistogram

PLOTTED_TENSORS = 6


@dataclass(frozen=True)
class TensorReport:
    name: str
    kind: str                      # "activation" | "kv"
    amax: dict[str, float]         # every method
    method: str                    # the one used
    chosen_amax: float
    saturation: float              # fraction of |x| above the chosen amax
    snr_db: float                  # 10 log10(E[x^2] / E[(q(x) - x)^2]) with the chosen amax
    running_max: float


def tensor_report(name: str, kind: str, stats: StreamingHistogram, fmt: QuantFormat, method: str,
                  percentile: float) -> TensorReport:
    hist = stats.histogram()
    amax = {m: compute_amax(m, hist, stats.running_max, fmt, percentile) for m in METHODS}
    chosen = amax[method]
    return TensorReport(name, kind, amax, method, chosen, saturation_rate(hist, chosen),
                        quantization_snr_db(hist, chosen, fmt), stats.running_max)


def saturation_rate(hist: Histogram, amax: float) -> float:
    total = hist.counts.sum()
    return float(hist.counts[hist.centers > amax].sum() / total) if total else 0.0


def quantization_snr_db(hist: Histogram, amax: float, fmt: QuantFormat) -> float:
    """SNR of fake-quantizing the histogram's values (bin centres weighted by counts)."""
    if amax <= 0 or hist.width == 0:
        return math.inf
    centers = torch.from_numpy(hist.centers)
    counts = torch.from_numpy(hist.counts)
    noise = float(((fmt.fake_quant(centers, amax) - centers) ** 2 * counts).sum())
    signal = float((centers ** 2 * counts).sum())
    return math.inf if noise == 0 else 10.0 * math.log10(signal / noise)


def write_report_json(path: Path, header: dict, tensors: list[TensorReport]) -> None:
    body = {**header, "tensors": [_finite(asdict(t)) for t in tensors]}
    path.write_text(json.dumps(body, indent=2) + "\n")


def _finite(d: dict) -> dict:
    """JSON has no infinity: a perfect SNR is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def most_sensitive(tensors: list[TensorReport], n: int = PLOTTED_TENSORS) -> list[TensorReport]:
    return sorted(tensors, key=lambda t: t.snr_db)[:n]


def plot_histograms(path: Path, tensors: list[TensorReport], histograms: dict[str, StreamingHistogram],
                    title: str) -> None:
    """One panel per tensor: log-count histogram of |x| with every method's amax, the chosen one bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = max(1, math.ceil(len(tensors) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.2 * rows), squeeze=False)
    colors = {"max": "tab:gray", "percentile": "tab:green", "mse": "tab:orange", "entropy": "tab:red"}
    for ax, t in zip(axes.flat, tensors):
        hist = histograms[t.name].histogram()
        ax.stairs(np.maximum(hist.counts, 0.5), hist.edges, fill=True, color="tab:blue")
        ax.set_yscale("log")
        for method, value in t.amax.items():
            ax.axvline(value, color=colors[method], linewidth=2.5 if method == t.method else 1,
                       linestyle="-" if method == t.method else "--", label=f"{method} {value:.3g}")
        ax.set_title(f"{t.name}  SNR {t.snr_db:.1f} dB, saturated {t.saturation:.2e}", fontsize=8)
        ax.set_xlabel("|x|", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tensors):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
