"""Explicit quantization of the ONNX decoder: QuantizeLinear/DequantizeLinear pairs from the checkpoint's scales.

The graph computes what the reference runtime computes for a quantized checkpoint (pipeline/runtime):
- weights are stored quantized (INT8 with the per-output-channel `weights_scaling_factor` of
  W8A8_SQ_PER_CHANNEL, FP8 E4M3 with the per-tensor factor of FP8) and dequantized by a DequantizeLinear,
  so `q * scale` is exactly the merged float32 weight the runtime multiplies by (checked, tensor by tensor);
- a linear's input is multiplied by the SmoothQuant `prequant_scaling_factor` first (as the checkpoint
  has it: the weights already carry 1 / prequant), then quantized and dequantized per tensor with the
  `activation_scaling_factor` (QuantizeLinear: x / scale, round half to even, saturate; for FP8 the
  saturating E4M3 conversion), which is the runtime's `TensorQuant`;
- K and V entering the cache get the same per-tensor Q/DQ with `kv_cache_scaling_factor`.
The FP8 fc/gate pair is requantized with the larger of the two weight scales, as the engine fuses it
(`runtime.checkpoint.fuse_fp8_pair`).

A row-parallel INT8 linear (attention.dense, mlp.proj) of a tp > 1 checkpoint has one per-output-channel scale
vector per rank, each for that rank's slice of the input dimension: stored as `blocks` = tp slices with a [tp, out]
scale, which the graph computes as the ranks do, one integer GEMM per slice summed (graph.rank_blocked_matmul).
Where every rank has the same scales it stays one weight with one scale vector.

W4A16_AWQ is stored as 4 bits: ONNX Runtime's `com.microsoft` MatMulNBits (the CPU's blockwise 4-bit GEMM) takes the
checkpoint's own codes and group scales (`int4_weight`: the merged weight divided by its group scales, checked to be
the codes exactly); the input's AWQ smoothing is the `prequant_scaling_factor` Mul as for SmoothQuant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onnx import TensorProto

from ..checkpoint import LM_HEAD, LM_HEAD_WEIGHT, CheckpointConfig, RankFile
from ..errors import UserError
from ..model.spec import QKV, ROW
from ..precisions import INT4_MAX, INT4_MIN, INT4_QUANT_ALGOS
from ..runtime.int4 import has_prequant, read_scale, unpack_int4
from ..runtime.trtllm_reader import CheckpointReader, Linear, merge_qkv, merge_weights
from ..runtime.quant import TensorQuant

#: ONNX element type of each quantized format and the torch dtype that holds its values
FORMATS = {"int8": (TensorProto.INT8, torch.int8), "fp8": (TensorProto.FLOAT8E4M3FN, torch.float8_e4m3fn)}


@dataclass
class QuantizedWeight:
    """A weight as the graph stores it: quantized values [out, in] and the scale(s) that restore it."""

    values: torch.Tensor        # int8 or float8_e4m3fn [out, in]; int4: int8 codes -8..7 [out, in]
    scale: torch.Tensor         # float32 [] (per tensor), [out] (per output channel) or [blocks, out];
                                # int4: [out, in / group]
    kind: str                   # "int8" | "fp8" | "int4"

    @property
    def blocks(self) -> int:
        """Equal slices of the input dimension with scales of their own (the tp ranks of a row-parallel linear)."""
        return self.scale.shape[0] if self.scale.dim() == 2 and self.kind != "int4" else 1

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scale.shape[1]

    def block(self, index: int) -> QuantizedWeight:
        """Input slice `index` of a blocked weight, with its per-output-channel scale."""
        width = self.values.shape[1] // self.blocks
        return QuantizedWeight(self.values[:, index * width:(index + 1) * width], self.scale[index], self.kind)


def quantized_weights(reader: CheckpointReader, index: int, linears: dict[str, Linear]) -> dict[str, QuantizedWeight]:
    """The quantized linears of merged layer `index`, each checked to dequantize to exactly its float32 weight."""
    cfg = reader.cfg
    stage = [rf for rf in reader.ranks if rf.pp_rank == index // cfg.layout.layers_per_stage]
    local = f"transformer.layers.{index - stage[0].layer_offset}."
    if cfg.quant_algo in INT4_QUANT_ALGOS:
        return {spec.name: int4_weight(cfg, spec, stage, local, index, linears[spec.name].weight)
                for spec in cfg.family.linears if cfg.quantizes(f"transformer.layers.{index}.{spec.name}")}
    kind = "fp8" if cfg.quant_algo == "FP8" else "int8"
    out = {}
    for spec in cfg.family.linears:
        module = f"transformer.layers.{index}.{spec.name}"
        if not cfg.quantizes(module):
            continue
        per_rank = [rank_weight_scale(cfg, rf, local, spec.name) for rf in stage]
        if kind == "int8" and spec.parallel == QKV:
            scale = merge_qkv(cfg, [s[:, None] for s in per_rank], module)[:, 0]
        elif kind == "int8" and spec.parallel != ROW:
            scale = torch.cat(per_rank)
        elif kind == "int8" and any(not torch.equal(s, per_rank[0]) for s in per_rank[1:]):
            scale = torch.stack(per_rank)    # [tp, out]: each rank's scales for its slice of the input
        else:
            scale = one_scale(per_rank, module)
        out[spec.name] = quantize_exactly(linears[spec.name].weight, scale, kind, module)
    return out


def int4_weight(cfg: CheckpointConfig, spec, stage: list[RankFile], local: str, index: int,
                weight: torch.Tensor) -> QuantizedWeight:
    """A W4A16 linear's codes [out, in] and merged group scales [out, in / group], checked to be its weight."""
    module = f"transformer.layers.{index}.{spec.name}"
    scales = merge_weights(cfg, spec, [read_scale(rf, local + spec.name + ".weights_scaling_factor")
                                       for rf in stage], module)
    group = weight.shape[1] // scales.shape[1]
    expanded = scales.repeat_interleave(group, dim=1)
    codes = torch.round(weight / expanded).clamp(INT4_MIN, INT4_MAX)
    if not torch.equal(codes * expanded, weight):
        raise UserError(f"{module}: the merged weight is not int4 codes times its group scales; the checkpoint's "
                        "shards disagree")
    return QuantizedWeight(codes.to(torch.int8), scales, "int4")


@dataclass
class QuantizedHead:
    """A 4-bit lm_head (`calibrate --quantize-lm-head`): its codes and group scales, and the AWQ smoothing of its
    input."""

    weight: QuantizedWeight           # int4 codes [vocab, hidden], scales [vocab, hidden / group]
    prequant: torch.Tensor | None     # [hidden]


def quantized_head(reader: CheckpointReader) -> QuantizedHead:
    """The checkpoint's own lm_head codes and scales, its tp shards joined and the vocabulary padding cut."""
    cfg = reader.cfg
    stage, vocab = reader.head_stage, cfg.arch.vocab_size
    codes = torch.cat([unpack_int4(rf.read(LM_HEAD_WEIGHT)) for rf in stage])[:vocab]
    scales = torch.cat([read_scale(rf, LM_HEAD + ".weights_scaling_factor") for rf in stage])[:vocab]
    prequant = None
    if has_prequant(cfg):
        per_rank = [read_scale(rf, LM_HEAD + ".prequant_scaling_factor") for rf in stage]
        if any(not torch.equal(p, per_rank[0]) for p in per_rank[1:]):
            raise UserError("lm_head: the tp ranks smooth its input differently; the checkpoint's shards disagree")
        prequant = per_rank[0]
    return QuantizedHead(QuantizedWeight(codes, scales, "int4"), prequant)


def int4_tensors(name: str, qw: QuantizedWeight) -> tuple[TensorProto, TensorProto]:
    """MatMulNBits' B, uint8 [out, in / group, group / 2] (code + 8, the default zero point, two per byte along the
    input, the first in the low nibble), and its scales float32 [out, in / group]."""
    out, width = qw.values.shape
    unsigned = (qw.values.to(torch.int16) + 8).to(torch.uint8).reshape(out, width // qw.group_size, qw.group_size)
    packed = unsigned[:, :, 0::2] | (unsigned[:, :, 1::2] << 4)
    data = TensorProto(name=name, data_type=TensorProto.UINT8, dims=list(packed.shape),
                       raw_data=packed.contiguous().numpy().tobytes())
    scale = TensorProto(name=name + "_scale", data_type=TensorProto.FLOAT, dims=list(qw.scale.shape),
                        raw_data=qw.scale.float().contiguous().numpy().tobytes())
    return data, scale


def rank_weight_scale(cfg: CheckpointConfig, rf: RankFile, local: str, name: str) -> torch.Tensor:
    """The weight scale one rank applies to linear `name`; for the FP8 fused pair the larger of the two."""
    names = [name]
    partner = cfg.family.partner(name)
    if cfg.quant_algo == "FP8" and partner and cfg.quantizes(rf.global_name(local + partner)):
        names.append(partner)
    scales = [rf.read(local + n + ".weights_scaling_factor").float().reshape(-1) for n in names]
    return torch.stack(scales).amax(dim=0) if len(scales) > 1 else scales[0]


def one_scale(per_rank: list[torch.Tensor], module: str) -> torch.Tensor:
    """The FP8 per-tensor scale every rank applies (the engine's ranks share it: calibrate writes one amax)."""
    for s in per_rank[1:]:
        if not torch.equal(s, per_rank[0]):
            raise UserError(f"{module}: the tp ranks quantize this FP8 weight with different per-tensor scales; "
                            "the checkpoint's shards disagree (calibrate again)")
    return per_rank[0].reshape(-1) if per_rank[0].numel() > 1 else per_rank[0].reshape(())


def quantize_exactly(weight: torch.Tensor, scale: torch.Tensor, kind: str, module: str) -> QuantizedWeight:
    if scale.dim() == 2:   # [blocks, out]: each slice of the input dimension quantized with its own scales
        slices = weight.chunk(scale.shape[0], dim=1)
        parts = [quantize_exactly(w, s, kind, module) for w, s in zip(slices, scale)]
        return QuantizedWeight(torch.cat([p.values for p in parts], dim=1), scale.float(), kind)
    s = scale if scale.dim() == 0 else scale[:, None]
    if kind == "int8":
        values = torch.round(weight / s).clamp(-128, 127).to(torch.int8)
    else:
        values = (weight / s).to(torch.float8_e4m3fn)
    if not torch.equal(values.float() * s, weight):
        raise UserError(f"{module}: the merged weight is not its quantized values times one scale per "
                        f"{'tensor' if scale.dim() == 0 else 'output channel'}; the checkpoint's shards disagree")
    return QuantizedWeight(values, scale.float(), kind)


def weight_tensor(name: str, qw: QuantizedWeight) -> tuple[TensorProto, TensorProto]:
    """The transposed [in, out] quantized values and the scale, as initializers for a DequantizeLinear."""
    elem, _ = FORMATS[qw.kind]
    values = qw.values.t().contiguous()
    raw = values.view(torch.uint8).numpy().tobytes() if qw.kind == "fp8" else values.numpy().tobytes()
    data = TensorProto(name=name, data_type=elem, dims=list(values.shape), raw_data=raw)
    scale = TensorProto(name=name + "_scale", data_type=TensorProto.FLOAT, dims=list(qw.scale.shape),
                        raw_data=qw.scale.contiguous().numpy().tobytes())
    return data, scale


def zero_point(name: str, kind: str) -> TensorProto:
    elem, dtype = FORMATS[kind]
    raw = torch.zeros((), dtype=dtype).view(torch.uint8).numpy().tobytes() if kind == "fp8" else b"\x00"
    return TensorProto(name=name, data_type=elem, dims=[], raw_data=raw)


def activation_scale(name: str, quant: TensorQuant) -> TensorProto:
    return TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[],
                       raw_data=torch.tensor(quant.scale, dtype=torch.float32).numpy().tobytes())
