"""Streaming statistics of one activation tensor: histogram of |x|, running max, per-channel max.

The histogram starts with 2048 bins over [0, max of the first batch] (as NVIDIA's calibrators do)
and grows at the same bin width when a later batch reaches further. Memory is bounded however many
samples stream through: past `max_bins` the bins are merged pairwise (width doubles), which keeps
every edge a multiple of the original width.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .amax import Histogram

NUM_BINS = 2048
MAX_BINS = 16 * NUM_BINS


class StreamingHistogram:
    """Histogram of |x| over batches, with the same first-batch binning as modelopt's `torch.histc` path."""

    def __init__(self, num_bins: int = NUM_BINS, max_bins: int = MAX_BINS):
        self.num_bins = num_bins
        self.max_bins = max_bins
        self.counts: np.ndarray | None = None
        self.width = 0.0
        self.zeros_before_range = 0       # all-zero batches seen before the range was known
        self.running_max = 0.0

    def collect(self, x: torch.Tensor) -> None:
        values = x.detach().reshape(-1).abs().float()
        if values.numel() == 0:
            return
        batch_max = float(values.max())
        self.running_max = max(self.running_max, batch_max)
        if self.counts is None:
            if batch_max == 0.0:
                self.zeros_before_range += values.numel()
                return
            self.width = batch_max / self.num_bins
            self.counts = np.zeros(self.num_bins, dtype=np.float64)
            self.counts[0] += self.zeros_before_range
        elif batch_max > self.top:
            self._grow(batch_max)
        n = len(self.counts)
        self.counts += torch.histc(values, bins=n, min=0.0, max=n * self.width).double().numpy()

    @property
    def top(self) -> float:
        return len(self.counts) * self.width

    def _grow(self, new_max: float) -> None:
        needed = math.ceil(new_max / self.width)
        while needed > self.max_bins:
            if len(self.counts) % 2:
                self.counts = np.append(self.counts, 0.0)
            self.counts = self.counts.reshape(-1, 2).sum(axis=1)
            self.width *= 2
            needed = math.ceil(new_max / self.width)
        self.counts = np.concatenate([self.counts, np.zeros(needed - len(self.counts))])

    def histogram(self) -> Histogram:
        if self.counts is None:
            return Histogram(np.array([float(self.zeros_before_range)]), 0.0)
        return Histogram(self.counts.copy(), self.width)


class ChannelMax:
    """Running per-channel max of |x| over the last dimension (SmoothQuant's activation statistic)."""

    def __init__(self):
        self.values: torch.Tensor | None = None

    def collect(self, x: torch.Tensor) -> None:
        batch = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        self.values = batch if self.values is None else torch.maximum(self.values, batch)
