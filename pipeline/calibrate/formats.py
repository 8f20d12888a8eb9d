"""The two quantized number formats calibration targets: signed INT8 and FP8 E4M3.

Each format knows its largest magnitude (`maxbound`, what amax maps to: 127 for INT8, 448 for E4M3,
as in modelopt's `TensorQuantizer.maxbound`), how to fake-quantize a tensor for a given amax, and the
bucket layout the entropy search uses to build the quantized distribution of a histogram.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..precisions import E4M3_MAX



def e4m3_magnitudes() -> np.ndarray:
    """All non-negative finite float8_e4m3fn values, ascending (0, 7 subnormals, 119 normals; max 448)."""
    every_byte = torch.arange(0, 0x80, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = every_byte[torch.isfinite(every_byte)].numpy().astype(np.float64)
    return np.unique(values)


@dataclass(frozen=True)
class QuantFormat:
    name: str            # "int8" | "fp8"
    maxbound: float      # the quantized value amax maps to

    @cached_property
    def entropy_levels(self) -> int:
        """Number of non-negative quantization levels (128 for signed INT8: 127 + 1, as NVIDIA counts)."""
        return 128 if self.name == "int8" else len(e4m3_magnitudes())

    def fake_quant(self, x: torch.Tensor, amax: float | torch.Tensor) -> torch.Tensor:
        """Quantize then dequantize `x` with the per-tensor (or broadcastable) `amax`."""
        scale = self.maxbound / torch.as_tensor(amax, dtype=x.dtype)
        if self.name == "int8":
            return torch.clamp(torch.round(x * scale), -self.maxbound, self.maxbound) / scale
        return torch.clamp(x * scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) / scale

    def entropy_bucket_starts(self, candidates: np.ndarray) -> np.ndarray:
        """First histogram bin of every quantization bucket, for each candidate threshold bin count.

        Returns an int64 array [len(candidates), levels + 1]; row r lists, for a threshold of
        `i = candidates[r]` bins, where each bucket starts, and ends with `i`. INT8 follows NVIDIA's
        calibrators: `levels` equal buckets over the first i bins (bin j goes to floor(j * levels / i)).
        FP8 maps every bin centre, scaled so that the threshold lands on 448, to its nearest E4M3 value.
        """
        i = candidates.astype(np.int64)[:, None]
        if self.name == "int8":
            b = np.arange(self.entropy_levels + 1, dtype=np.int64)[None, :]
            return -((-b * i) // self.entropy_levels)          # ceil(b * i / levels), exact integers
        mags = e4m3_magnitudes()
        midpoints = (mags[:-1] + mags[1:]) / 2 / E4M3_MAX     # bucket borders as a fraction of amax
        inner = np.ceil(midpoints[None, :] * i - 0.5).astype(np.int64)
        starts = np.concatenate([np.zeros_like(i), np.clip(inner, 0, i), i], axis=1)
        return starts


INT8 = QuantFormat("int8", 127.0)
FP8 = QuantFormat("fp8", E4M3_MAX)
FORMATS = {"int8": INT8, "fp8": FP8}
