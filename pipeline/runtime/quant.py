"""Numerical simulation of TensorRT-LLM's FP8 and INT8 quantization (quantize, then dequantize).

Scales follow the checkpoint convention: a scaling factor maps quantized values back to real ones
(`real = q * scale`), so quantizing divides by it. INT8 rounds half to even and saturates to
[-128, 127] (CUDA `__float2int_rn` + clamp); FP8 E4M3 saturates to +-448 before the round-to-nearest-
even conversion (`__nv_fp8_e4m3` with satfinite), so large values never become NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..precisions import E4M3_MAX

INT8_MIN, INT8_MAX = -128.0, 127.0


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    q = torch.clamp(x / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale


def fake_quant_int8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale), INT8_MIN, INT8_MAX) * scale


FAKE_QUANT = {"fp8": fake_quant_fp8, "int8": fake_quant_int8}


@dataclass(frozen=True)
class TensorQuant:
    """A static per-tensor quantizer: the number format and its scaling factor."""

    kind: str       # "fp8" | "int8"
    scale: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return FAKE_QUANT[self.kind](x, self.scale)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 weight [out, in] from a float, FP8 or INT8 tensor and its per-tensor or per-row scale."""
    w = weight.to(torch.float32)
    if scale is None:
        return w
    s = scale.to(torch.float32).reshape(-1)
    return w * (s if s.numel() == 1 else s[:, None])
