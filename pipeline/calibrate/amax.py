"""amax methods over a histogram of |x|: max, percentile, mse and entropy (KL divergence).

The semantics are NVIDIA's (`HistogramCalibrator` in nvidia-modelopt / pytorch-quantization, see
docs/upstream-facts.md §D): candidates start at bin 128, the entropy search compares the clipped reference
distribution (tail folded into the last kept bin) with its quantized version (each bucket's mass
spread evenly over the bucket's non-empty bins), `bins[0]` is replaced by `bins[1]`, and the last
minimum wins; amax is the right edge of the last kept bin.

NVIDIA's search rebuilds both distributions in Python for every candidate, O(bins^2) interpreted
steps per tensor. Here the KL divergence of every candidate is computed at once from prefix sums:

    KL(i) = (sum P log P - sum P log Q) / N - log N + log(sum Q)

where, per bucket b with mass S_b spread over c_b non-empty bins, sum P log Q is
sum_b S_b log(S_b / c_b) plus the folded tail T times log Q of the last kept bin. That costs
O(candidates x levels) array operations. The floating-point sums differ from scipy's in the last
digits, so every candidate within a tiny tolerance of the minimum is re-evaluated with the direct
formula (the same arrays NVIDIA builds, through `scipy.stats.entropy`), which keeps the chosen bin
identical to the reference, ties included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import entropy as scipy_entropy

from .formats import QuantFormat

METHODS = ("max", "percentile", "mse", "entropy")
START_BIN = 128
DEFAULT_PERCENTILE = 99.99
#: candidates whose fast KL lies this close to the minimum are re-checked with the direct formula
TIE_TOLERANCE = 1e-9
#: candidates scored per block (bounds the [candidates, levels] work arrays to a few MB)
CHUNK = 4096


@dataclass(frozen=True)
class Histogram:
    """Counts of |x| in equal-width bins starting at 0: `counts[k]` covers [k*width, (k+1)*width)."""

    counts: np.ndarray   # float64 (integral values)
    width: float

    @property
    def edges(self) -> np.ndarray:
        return np.arange(len(self.counts) + 1, dtype=np.float64) * self.width

    @property
    def centers(self) -> np.ndarray:
        return (np.arange(len(self.counts), dtype=np.float64) + 0.5) * self.width


def compute_amax(method: str, hist: Histogram, running_max: float, fmt: QuantFormat,
                 percentile: float = DEFAULT_PERCENTILE) -> float:
    """amax of one tensor. Histogram methods never return more than the largest |x| seen: a grown
    histogram's last edge lies up to one bin above it, and clipping there can only help."""
    if running_max <= 0.0:
        return 0.0
    if method == "max":
        return float(running_max)
    if method == "percentile":
        value = percentile_amax(hist, percentile)
    elif method == "mse":
        value = mse_amax(hist, fmt)
    elif method == "entropy":
        value = float(hist.edges[entropy_threshold_bin(hist.counts, fmt)])
    else:
        raise ValueError(f"unknown amax method {method!r}; expected one of {', '.join(METHODS)}")
    return min(value, float(running_max))


def percentile_amax(hist: Histogram, percentile: float) -> float:
    """Smallest bin edge below which `percentile` % of the values lie (NVIDIA's CDF search)."""
    cdf = np.cumsum(hist.counts / hist.counts.sum())
    return float(hist.edges[np.searchsorted(cdf, percentile / 100.0)])


def mse_amax(hist: Histogram, fmt: QuantFormat, start_bin: int = START_BIN, chunk: int = 512) -> float:
    """Bin centre (from `start_bin`) whose fake-quantization of the bin centres has the least weighted MSE.

    Computed in float32 (as NVIDIA's calibrator does), one [chunk, bins] block of candidates at a time.
    """
    centers = torch.from_numpy(hist.centers).float()
    counts = torch.from_numpy(hist.counts).float()
    candidates = centers[start_bin:]
    if candidates.numel() == 0:
        return float(hist.centers[-1])
    errors = []
    for part in torch.split(candidates, chunk):
        diff = fmt.fake_quant(centers[None, :], part[:, None]) - centers[None, :]
        errors.append((diff * diff) @ counts)
    return float(hist.centers[start_bin + int(torch.argmin(torch.cat(errors)))])


def entropy_threshold_bin(counts: np.ndarray, fmt: QuantFormat, start_bin: int = START_BIN) -> int:
    """Index i of the edge NVIDIA's entropy calibrator picks: keep bins [0, i), amax = edges[i]."""
    bins = np.asarray(counts, dtype=np.float64).copy()
    if len(bins) > 1:
        bins[0] = bins[1]
    candidates = np.arange(start_bin, len(bins) + 1)
    if len(candidates) == 0:
        raise ValueError(f"a histogram needs at least {start_bin} bins for the entropy search, got {len(bins)}")
    divergences = np.concatenate([kl_divergences(bins, part, fmt)
                                  for part in np.array_split(candidates, -(-len(candidates) // CHUNK))])
    best = np.nanmin(divergences) if np.isfinite(divergences).any() else np.inf
    if np.isfinite(best):
        close = np.flatnonzero(~(divergences > best + TIE_TOLERANCE * max(1.0, abs(best))))
    else:
        close = np.arange(len(candidates))          # every candidate diverges: the last one wins
    exact = np.array([direct_kl(bins, int(candidates[k]), fmt) for k in close])
    winners = close[exact == exact.min()] if np.isfinite(exact).any() else close
    return int(candidates[winners[-1]])


def kl_divergences(bins: np.ndarray, candidates: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """KL(reference || quantized) for every candidate bin count at once (see the module docstring)."""
    n = len(bins)
    mass = np.concatenate([[0.0], np.cumsum(bins)])
    nonempty = np.concatenate([[0], np.cumsum(bins > 0)])
    plogp = np.concatenate([[0.0], np.cumsum(_xlogx(bins))])
    total = mass[n]
    i = candidates
    tail = total - mass[i]
    last = bins[i - 1]

    starts = fmt.entropy_bucket_starts(candidates)                     # [C, levels + 1]
    bucket_mass = mass[starts[:, 1:]] - mass[starts[:, :-1]]
    bucket_bins = nonempty[starts[:, 1:]] - nonempty[starts[:, :-1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_bucket = np.where(bucket_bins > 0, bucket_mass * np.log(bucket_mass / bucket_bins), 0.0)
        # Q of the last kept bin: its bucket is the last one that starts at or before i - 1
        last_bucket = (starts[:, :-1] <= (i - 1)[:, None]).sum(axis=1) - 1
        rows = np.arange(len(i))
        q_last = bucket_mass[rows, last_bucket] / bucket_bins[rows, last_bucket]
        sum_plogq = per_bucket.sum(axis=1) + np.where(tail > 0, tail * np.log(q_last), 0.0)
        sum_plogp = plogp[i - 1] + _xlogx(last + tail)
        kl = (sum_plogp - sum_plogq) / total - np.log(total) + np.log(mass[i])
    kl = np.where((last == 0) & (tail > 0), np.inf, kl)                 # P > 0 where Q = 0
    return kl


def direct_kl(bins: np.ndarray, i: int, fmt: QuantFormat) -> float:
    """KL for one candidate, built exactly as NVIDIA's loop builds it, through scipy.stats.entropy."""
    starts = fmt.entropy_bucket_starts(np.array([i]))[0]
    bucket = np.searchsorted(starts[1:], np.arange(i), side="right")   # bucket index of each kept bin
    kept = bins[:i]
    filled = kept != 0
    bucket_mass = np.bincount(bucket[filled], weights=kept[filled], minlength=len(starts) - 1)
    bucket_bins = np.bincount(bucket[filled], minlength=len(starts) - 1)
    quantized = np.zeros(i, dtype=np.float64)
    quantized[filled] = bucket_mass[bucket[filled]] / bucket_bins[bucket[filled]]
    reference = kept.copy()
    reference[-1] += bins[i:].sum()
    return float(scipy_entropy(reference, quantized))


def _xlogx(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)
