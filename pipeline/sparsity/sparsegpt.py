"""2:4 pruning of one weight: magnitude, or SparseGPT (mask and weight update from the inputs' second moments).

SparseGPT (Frantar & Alistarh, 2023) is GPTQ's error feedback with pruning in place of rounding. The input
columns of W [out, in] are visited in order, in blocks of `BLOCK` (a multiple of 4); at the first column of each
group of 4 the group's mask is chosen per row from the weights as updated so far, dropping the 2 with the least
saliency w^2 / [H^-1]_jj^2 (the loss of removing each alone); each pruned weight's error is then spread over the
columns not yet visited through the upper Cholesky factor of H^-1, H = E[x x^T] of the linear's calibration inputs,
so the kept weights compensate for the removed ones in x W^T. nvidia-modelopt 0.47's `sparsegpt` computes that
update and throws it away (it keeps only the mask: the kept weights stay the dense ones); here the updated weights
are the result.

Rows are independent, so a column-parallel linear's rows could be pruned shard by shard; trtpipe prunes the merged
whole-model weight, row-parallel ones over their full width (the ranks' partial sums cancel each other's error).
"""

from __future__ import annotations

import torch

from .pattern import GROUP, KEPT, magnitude_keep

METHODS = ("sparsegpt", "magnitude")
DEFAULT_METHOD = "sparsegpt"
#: Tikhonov damping of H as a fraction of mean(diag H): SparseGPT's own default (docs/sparsity.md: measured)
DEFAULT_DAMP = 0.01
BLOCK = 128
UPDATE_COLUMNS = 1024


def prune_magnitude(weight: torch.Tensor) -> torch.Tensor:
    """`weight` with the KEPT largest-magnitude weights of each group of GROUP inputs kept, the rest zero."""
    return torch.where(magnitude_keep(weight), weight, torch.zeros((), dtype=weight.dtype))


def prune_sparsegpt(weight: torch.Tensor, hinv: torch.Tensor) -> torch.Tensor:
    """float32 2:4 weight [out, in] from `weight` and `hinv`, the upper Cholesky factor of the damped H^-1
    (`calibrate.rounding.gptq_inverse`), float64 [in, in]."""
    w = weight.to(torch.float64, copy=True)
    out = torch.empty(w.shape, dtype=torch.float32)
    cols = w.shape[1]
    for start in range(0, cols, BLOCK):
        stop = min(start + BLOCK, cols)
        block, block_inv = w[:, start:stop].clone(), hinv[start:stop, start:stop]
        diag = torch.diagonal(block_inv)
        errors = torch.empty_like(block)
        pruned = torch.zeros_like(block, dtype=torch.bool)
        for j in range(stop - start):
            if j % GROUP == 0:
                group = slice(j, j + GROUP)
                saliency = block[:, group] ** 2 / diag[group][None, :] ** 2
                drop = saliency.topk(GROUP - KEPT, dim=1, largest=False).indices
                pruned[:, group].scatter_(1, drop, True)
            column = block[:, j:j + 1]
            kept = torch.where(pruned[:, j:j + 1], torch.zeros((), dtype=column.dtype), column)
            out[:, start + j] = kept.squeeze(1).float()
            err = (column - kept) / block_inv[j, j]
            block[:, j:] -= err * block_inv[j:j + 1, j:]
            errors[:, j:j + 1] = err
        for col in range(stop, cols, UPDATE_COLUMNS):
            end = min(col + UPDATE_COLUMNS, cols)
            w[:, col:end] -= errors @ hinv[start:stop, col:end]
    return out
