"""NVIDIA's 4-bit groupwise checkpoints (W4A16_AWQ, W4A8_AWQ) as nvidia-modelopt's TensorRT-LLM exporter writes them.

Per quantized linear of `out` x `in` (docs/int4.md):

- `weight` I8 [out/2, in]: two signed int4 codes per byte from adjacent *output* rows, row 2j in the low nibble
  and row 2j+1 in the high one;
- `weights_scaling_factor` [out, in/group_size]: one scale per group of `group_size` inputs (group amax / 7);
- `prequant_scaling_factor` [in] (when `pre_quant_scale`): AWQ's per-input smoothing, y = (x * pqs) @ W^T;
- W4A8_AWQ also `activation_scaling_factor` [1] (the FP8 input's per-tensor scale) and
  `weights_scaling_factor_2` [1] (the FP8 weight's per-tensor scale).

The weight the GEMM sees is code * scale; W4A8 rounds it to FP8 E4M3 on the `weights_scaling_factor_2` grid
(TensorRT-LLM divides the group scales by it and multiplies the output by `alpha` = activation scale x
`weights_scaling_factor_2`, which is the same product) and quantizes the input to FP8 with the activation scale.
The runtime dequantizes once on load; `expected_linear` describes the tensors for the header check and
`read_weight` refuses, by tensor name, scales that are not positive and finite.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..precisions import INT4_QUANT_ALGOS
from .quant import fake_quant_fp8

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SCALAR = (1,)


def group_size(cfg) -> int:
    return int(cfg.quantization["group_size"])


def has_prequant(cfg) -> bool:
    return bool(cfg.quantization.get("pre_quant_scale", True))


def expected_linear(cfg, local: str, module: str, o: int, i: int, expect) -> dict:
    """The tensors of one quantized linear's rank share (`o` x `i`), as `expect(shape, dtypes, required, note)`."""
    group = group_size(cfg)
    if o % 2:
        raise UserError(f"{module}.weight: {o} output rows cannot be packed two int4 codes to a byte (an odd count)")
    if i % group:
        raise UserError(f"{module}.weight: {i} inputs are not a multiple of quantization.group_size {group}")
    out = {local + ".weight": expect((o // 2, i), (torch.int8,), True,
                                     "two int4 codes per byte along the output: [out/2, in]"),
           local + ".weights_scaling_factor": expect((o, i // group), FLOATS, True,
                                                     f"one scale per group of {group} inputs: [out, in/{group}]")}
    if has_prequant(cfg):
        out[local + ".prequant_scaling_factor"] = expect((i,), FLOATS, True, "one per input: [in]")
    if INT4_QUANT_ALGOS[cfg.quant_algo]:
        out[local + ".activation_scaling_factor"] = expect(SCALAR, FLOATS, True, "")
        out[local + ".weights_scaling_factor_2"] = expect(SCALAR, FLOATS, True, "")
    return out


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] from bytes [out/2, in]: row 2j is the low nibble of row j, row 2j+1 the high one."""
    b = packed.view(torch.uint8).to(torch.int16)
    low, high = b & 0x0F, b >> 4
    codes = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])
    return torch.where(codes > 7, codes - 16, codes).to(torch.int8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Bytes [out/2, in] (int8) from int4 codes [out, in] in -8..7: row 2j in the low nibble, row 2j+1 in the high."""
    pairs = codes.to(torch.int16).reshape(-1, 2, codes.shape[1]) & 0x0F
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8).view(torch.int8)


def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: each code times the scale of its group of inputs."""
    group = codes.shape[1] // scales.shape[1]
    return codes.to(torch.float32) * scales.to(torch.float32).repeat_interleave(group, dim=1)


def read_scale(rf, name: str) -> torch.Tensor:
    """A scale tensor of a rank file, refused by name unless every value is positive and finite."""
    return read_scale_rows(rf, name, None)


def read_scale_rows(rf, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
    """`read_scale` of only the given rows."""
    scale = rf.read(name, rows).float()
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        raise UserError(f"{rf.path.name}: {rf.global_name(name)} holds {int(bad.sum())} value(s) that are not "
                        "positive and finite (NaN, infinite, zero or negative): the checkpoint is corrupt")
    return scale


def read_weight(cfg, rf, local: str) -> torch.Tensor:
    """The float32 weight [out, in] of one rank's share, as the engine's GEMM sees it."""
    weight = dequantize_groupwise(unpack_int4(rf.read(local + ".weight")),
                                  read_scale(rf, local + ".weights_scaling_factor"))
    if INT4_QUANT_ALGOS[cfg.quant_algo] == "fp8":
        weight = fake_quant_fp8(weight, read_scale(rf, local + ".weights_scaling_factor_2").reshape(()))
    return weight


def check_input_scales(cfg, stage, local: str) -> None:
    """The smoothing and (W4A8) activation scales of one linear, positive and finite on every rank."""
    names = [".prequant_scaling_factor"] if has_prequant(cfg) else []
    names += [".activation_scaling_factor"] if INT4_QUANT_ALGOS[cfg.quant_algo] else []
    for rf in stage:
        for name in names:
            read_scale(rf, local + name)
