"""Weight rounding: nearest, or GPTQ (error feedback through the calibration inputs' second moments).

Both produce weights in the checkpoint's own format (FP8 E4M3 with one per-tensor scale, or INT8 with
one scale per output row), so the engine runs them unchanged. Nearest rounding makes every weight's
error independent; on SmolLM2 that error alone costs about +1.7% perplexity in FP8. GPTQ (Frantar et
al., 2022) rounds the input columns one at a time and spreads each column's rounding error over the
columns not yet rounded, weighted by the inverse of H = E[x x^T] of the linear's calibration inputs, so
the errors cancel in the output x W^T instead of adding up. The scales are fixed before rounding.

`HessianStats` accumulates X^T X over calibration batches in float32: memory is in_features^2 per
linear input, whatever the number of samples.
"""

from __future__ import annotations

from typing import Callable

import torch

from .formats import E4M3_MAX

ROUNDINGS = ("gptq", "nearest")
#: Tikhonov damping, as a fraction of mean(diag H). Chosen on SmolLM2 FP8 (64 x 256 calibration), see
#: docs/calibrate.md: perplexity change 0.03 / 0.1 / 0.3 / 1.0 -> +2.07 / +2.30 / +1.71 / +2.18% on the 40
#: held-out documents and +2.10 / +1.60 / +1.41 / +0.79% on 19 other held-out ones (nearest: +3.29 / +1.47%).
DEFAULT_DAMP = 0.3
BLOCK = 128
UPDATE_COLUMNS = 1024

Codes = Callable[[torch.Tensor], torch.Tensor]
#: a damped H that still fails the Cholesky factorization is retried with 10x the damping this often
DAMP_RETRIES = 3


class HessianStats:
    """Running sum of x^T x (x: [tokens, in]) and the token count."""

    def __init__(self):
        self.sum: torch.Tensor | None = None
        self.tokens = 0

    def collect(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        xtx = x.T @ x
        self.sum = xtx if self.sum is None else self.sum.add_(xtx)
        self.tokens += x.shape[0]

    def finish(self) -> torch.Tensor:
        """The mean, computed in place: the running sum becomes it (no second [in, in] copy), and a later call
        returns it again (the mean may be changed in place in between: 4-bit smoothing re-expresses it)."""
        mean = self.sum.div_(max(self.tokens, 1))
        self.tokens = 1
        return mean


def fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of x (already divided by its scale), saturated at +-448, as float."""
    return torch.clamp(x, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def int8_codes(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x), -128.0, 127.0)


def round_weight(weight: torch.Tensor, scale: torch.Tensor, codes: Codes, hinv: torch.Tensor | None,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized codes (float tensor of grid values) of `weight` [out, in].

    `keep` (bool [out, in]) is a sparsity mask to hold: every weight outside it is the zero code, and GPTQ
    spreads that (exact) choice's error over the kept weights as it does a rounding's.

    `scale` is [1] (per tensor), [out] (per row) or [out or 1, in] (per row and input block, for a
    row-parallel weight whose tp shards have scales of their own). With `hinv` None the codes are
    nearest rounding; otherwise GPTQ with that factor of the damped inverse statistics (`gptq_inverse`).
    """
    scale = scale.reshape(-1, 1) if scale.dim() == 1 else scale
    if hinv is None:
        nearest = codes(weight.float() / scale.float())
        return nearest if keep is None else torch.where(keep, nearest, torch.zeros((), dtype=nearest.dtype))
    return gptq_codes(weight, hinv, scale.to(torch.float64).expand(weight.shape), codes, keep)


def gptq_inverse(hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 for H = E[x x^T] [in, in], the matrix GPTQ
    rounds with, raising the damping (x10) while the factorization of H fails; None when it never succeeds
    (e.g. non-finite statistics) or the inverse does not factorize: the weights are then rounded to nearest.
    Inputs that never fired get a unit diagonal: they are rounded to nearest and take no error feedback.

    One float64 [in, in] buffer is factorized, inverted and factorized again in place: for Llama-3-8B's
    mlp.proj input, 14336 wide, that is 1.6 GB instead of three or four times as much. The buffer is
    column-major (LAPACK's layout: torch would otherwise work on a column-major copy), which for the
    symmetric H is just its transpose; the results are bit for bit those of the out-of-place calls.
    """
    mean_diag = None
    info = torch.empty((), dtype=torch.int32)
    for attempt in range(DAMP_RETRIES + 1):
        h = hessian.to(torch.float64, copy=True).t()
        dead = torch.diagonal(h) <= 0
        h[dead, dead] = 1.0
        if mean_diag is None:
            mean_diag = float(torch.diagonal(h).mean())
            if mean_diag <= 0 or not all(bool(torch.isfinite(rows).all()) for rows in h.split(1024)):
                return None                # (checked in slices: isfinite of the whole would copy it)
        torch.diagonal(h).add_(damp * 10 ** attempt * mean_diag)
        torch.linalg.cholesky_ex(h, out=(h, info))
        if int(info) == 0:
            torch.cholesky_inverse(h, out=h)
            torch.linalg.cholesky_ex(h, upper=True, out=(h, info))
            return h if int(info) == 0 else None
        del h
    return None


def gptq_codes(weight: torch.Tensor, hinv: torch.Tensor, scale: torch.Tensor, codes: Codes,
               keep: torch.Tensor | None = None) -> torch.Tensor:
    """The codes (float32: every FP8 / INT8 grid value is exact in it) of `weight`, a block of columns at a
    time. The feedback into the columns not yet rounded is applied `UPDATE_COLUMNS` at a time, so no
    temporary as large as the weight is made."""
    w = weight.to(torch.float64, copy=True)
    out = torch.empty(w.shape, dtype=torch.float32)
    for start in range(0, w.shape[1], BLOCK):
        stop = min(start + BLOCK, w.shape[1])
        block, block_inv = w[:, start:stop].clone(), hinv[start:stop, start:stop]
        errors = torch.empty_like(block)
        for j in range(stop - start):
            s = scale[:, start + j:start + j + 1]
            c = codes(block[:, j:j + 1] / s)
            if keep is not None:
                c = torch.where(keep[:, start + j:start + j + 1], c, torch.zeros((), dtype=c.dtype))
            out[:, start + j] = c.squeeze(1)
            err = (block[:, j:j + 1] - c * s) / block_inv[j, j]
            block[:, j:] -= err * block_inv[j:j + 1, j:]
            errors[:, j:j + 1] = err
        for col in range(stop, w.shape[1], UPDATE_COLUMNS):
            end = min(col + UPDATE_COLUMNS, w.shape[1])
            w[:, col:end] -= errors @ hinv[start:stop, col:end]
    return out
