"""Rotary position embedding as TensorRT-LLM's `rope_gpt_neox` computes it (rotate the two halves)."""

from __future__ import annotations

import math

import torch

from ..arch import ModelArch


def inverse_frequencies(arch: ModelArch) -> torch.Tensor:
    """inv_freq[i] = base^(-2i/d), then the rotary_scaling adjustment (linear or llama3), in float64."""
    d = arch.head_size
    inv = 1.0 / (arch.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = arch.rotary_scaling or {}
    if arch.rope_type == "linear":
        return inv / float(scaling["factor"])
    if arch.rope_type == "llama3":
        return llama3_scaled(inv, scaling)
    return inv


def llama3_scaled(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low, high = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    original = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > original / low, inv / factor, blended)
    return torch.where(wavelen < original / high, inv, out)


class RotaryTable:
    """cos/sin of every position (float32), computed in float64 and grown on demand."""

    def __init__(self, arch: ModelArch):
        self.inv_freq = inverse_frequencies(arch)
        self.cos = self.sin = torch.empty(0, arch.head_size)
        self._grow(arch.max_position_embeddings)

    def _grow(self, n: int) -> None:
        angles = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, d] for positions [B, T] (broadcast over heads)."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :]
