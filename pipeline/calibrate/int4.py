"""4-bit groupwise weights (W4A16_AWQ, W4A8_AWQ): AWQ's smoothing search, the group scales, the int4 codes.

A linear's input x is multiplied by a per-input smoothing vector p (`prequant_scaling_factor`) and the weight is
stored as W / p (columns divided), so x W^T is unchanged in float and the columns that meet large inputs get a finer
share of the int4 grid (AWQ, Lin et al., 2023). The search here is AWQ's: p = 1 / s with s = m^alpha / norm, m the
root mean square of each input channel (the square root of the diagonal of H = E[x x^T], which calibration holds for
GPTQ anyway), alpha on a grid, scored by the output error trace(E H E^T) of the round-to-nearest weight, E = W - Q(W s)
/ s. Linears that read the same input (q/k/v fused as qkv; gate_proj and up_proj) are searched together and share p.

The group scales are then searched per row and group of inputs: scale = f x amax / 7 for f on a grid from 1 down to
0.6 (f = 7/8 puts the group's largest magnitude on code -8, which TensorRT-LLM's signed int4 kernels take), keeping
the f with the least input-weighted error sum_j H_jj (w_j - scale q_j)^2. GPTQ (`rounding.gptq_codes`) then rounds
with those scales fixed, against H of the smoothed input (diag(p) H diag(p)).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..precisions import INT4_GROUP_SIZES, INT4_MAX, INT4_MIN

#: AWQ's exponent grid (alpha = 0 is no smoothing)
ALPHAS = tuple(i / 20 for i in range(20))
#: clipping factors of a group's amax / 7 (7/8 = 0.875 is on the grid)
CLIP_FACTORS = tuple(1.0 - 0.025 * i for i in range(17))
#: output rows the smoothing search scores (a fixed sample of them for wider linears: the loss is a sum over rows)
SEARCH_ROWS = 1024
MIN_SCALE = 1e-12


def int4_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest signed int4 code of x (already divided by its scale), as float."""
    return torch.clamp(torch.round(x), INT4_MIN, INT4_MAX)


def default_group_size(widths: dict[str, int]) -> tuple[int, str | None]:
    """The first of INT4_GROUP_SIZES that divides every quantized input width, and a note when it is not the first."""
    for size in INT4_GROUP_SIZES:
        if all(w % size == 0 for w in widths.values()):
            if size == INT4_GROUP_SIZES[0]:
                return size, None
            odd = next(name for name, w in widths.items() if w % INT4_GROUP_SIZES[0])
            sizes = " and ".join(map(str, sorted(INT4_GROUP_SIZES)))
            return size, (f"--group-size {size}: {odd}'s {widths[odd]} inputs are not a multiple of "
                          f"{INT4_GROUP_SIZES[0]} (TensorRT-LLM's groupwise kernels take {sizes})")
    raise UserError("no 4-bit group size fits this model: " + group_size_problem(widths, INT4_GROUP_SIZES[-1]))


def group_size_problem(widths: dict[str, int], size: int) -> str:
    """What is wrong with `size` for these input widths, naming a layer and the sizes that would work ('' if none)."""
    odd = {name: w for name, w in widths.items() if w % size}
    if not odd:
        return ""
    name, width = next(iter(odd.items()))
    fits = [g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths.values())]
    return (f"group size {size} does not divide {name}'s {width} inputs ({len(odd)} linear(s) like it); "
            + (f"use --group-size {fits[0]}" if fits else f"no group size of {', '.join(map(str, INT4_GROUP_SIZES))} "
               "divides every width: --exclude those linears"))


def groupwise_nearest(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Round-to-nearest int4 of `weight` [out, in] with scale group amax / 7, dequantized (float32)."""
    w = weight.reshape(weight.shape[0], -1, group)
    scale = (w.abs().amax(dim=2, keepdim=True) / INT4_MAX).clamp(min=MIN_SCALE)
    return (int4_codes(w / scale) * scale).reshape(weight.shape)


def awq_smoothing(weight: torch.Tensor, hessian: torch.Tensor, group: int,
                  tie: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, float]:
    """AWQ's smoothing vector p [in] (float32; x * p meets W / p) for `weight` [out, in] whose input has second
    moments `hessian` [in, in], and the alpha chosen.

    `tie` (kv_heads, heads per K/V head, head size) makes p equal across the query heads that share a K/V head: the
    input of o_proj under grouped-query attention, where AWQ's layout has p in v_proj's output rows (one per K/V
    channel). Their root mean square is taken together."""
    w = weight.float()
    if w.shape[0] > SEARCH_ROWS:
        rows = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))[:SEARCH_ROWS]
        w = w[rows.sort().values]
    h = hessian.float()
    moments = torch.diagonal(h).clamp(min=0)
    if tie is not None:
        moments = moments.reshape(tie).mean(dim=1, keepdim=True).expand(tie).reshape(-1)
    rms = moments.sqrt()
    live = rms > 0
    if not bool(live.any()):
        return torch.ones(w.shape[1]), 0.0
    rms = torch.where(live, rms, rms[live].min())
    best, best_alpha, best_s = None, 0.0, torch.ones_like(rms)
    for alpha in ALPHAS:
        s = rms.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = w - groupwise_nearest(w * s, group) / s
        loss = float(((err @ h) * err).sum())
        if best is None or loss < best:
            best, best_alpha, best_s = loss, alpha, s
    return 1.0 / best_s, best_alpha


def group_scales(weight: torch.Tensor, importance: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [out, in/group]: per row and group, the scale f x amax / 7 (f in CLIP_FACTORS) with the least error
    sum_j importance_j (w_j - scale code_j)^2, `importance` [in] the input's second moments."""
    w = weight.float().reshape(weight.shape[0], -1, group)
    d = importance.float().clamp(min=0).reshape(1, -1, group)
    amax = w.abs().amax(dim=2, keepdim=True).clamp(min=MIN_SCALE)
    best_err, best_scale = None, None
    for f in CLIP_FACTORS:
        scale = amax * (f / INT4_MAX)
        err = ((w - int4_codes(w / scale) * scale).square() * d).sum(dim=2, keepdim=True)
        if best_err is None:
            best_err, best_scale = err, scale.clone()
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
    return best_scale.squeeze(2)


def smoothed_hessian(hessian: torch.Tensor, prequant: torch.Tensor) -> torch.Tensor:
    """E[(x p)(x p)^T] from E[x x^T], in place."""
    p = prequant.to(hessian.dtype)
    return hessian.mul_(p[:, None]).mul_(p[None, :])
