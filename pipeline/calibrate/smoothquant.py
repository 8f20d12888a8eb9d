"""SmoothQuant smoothing factors (per input channel), with modelopt's formula and safeguards.

prequant_scaling_factor s_j = max|W[:, j]|^(1 - alpha) / max|X[:, j]|^alpha multiplies the input and
divides the weight columns, moving quantization difficulty from activation outliers to the weights
(alpha = 1 moves all of it: modelopt's default; alpha = 0.5 is the SmoothQuant paper's and TensorRT-LLM's).
Channels that never fire get 1; factors are clamped to [1e-4, 1e4] (modelopt's bounds). Linears that
the engine fuses (fc with gate, and q/k/v already fused as qkv) share one vector computed from the
weights of all of them. The factors are rounded to the checkpoint dtype before anything uses them, so
the weights are smoothed with exactly the vector the engine multiplies the input by.
"""

from __future__ import annotations

import torch

from typing import Callable

ZERO_CHANNEL = 1.0 / (1 << 31)
CLAMP = (1e-4, 1e4)


def smoothing_factors(activation_channel_max: dict[str, torch.Tensor], weight_column_max: dict[str, torch.Tensor],
                      alpha: float, dtype: torch.dtype,
                      fused_partner: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    """Smoothing vector per linear input, keyed like the statistics (fc stands for fc and gate);
    `fused_partner` names the linear the engine fuses a linear with."""
    factors = {}
    for module, act in activation_channel_max.items():
        if module not in weight_column_max:
            continue
        weight = weight_column_max[module]
        partner = fused_partner(module)
        if partner in weight_column_max:
            weight = torch.maximum(weight, weight_column_max[partner])
        factors[module] = smoothing_vector(act.float(), weight.float(), alpha).to(dtype)
    return factors


def smoothing_vector(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    s = weight_max.pow(1 - alpha) / act_max.pow(alpha)
    s = torch.where((act_max <= ZERO_CHANNEL) | (weight_max <= 0) | ~torch.isfinite(s), torch.ones_like(s), s)
    return s.clamp(*CLAMP)
