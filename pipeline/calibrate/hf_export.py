"""The calibrated model as a Hugging Face FP8 checkpoint for the servers that load one (TensorRT-LLM's
PyTorch backend, vLLM, SGLang): nvidia-modelopt 0.37's unified HF export layout (`export_hf_checkpoint`),
with the activation and KV-cache scales of the TensorRT-LLM checkpoint calibrate wrote.

The layout, read off modelopt's export of the same model with FP8_DEFAULT_CFG + FP8_KV_CFG
(tests/test_hf_export.py compares every tensor):
- per Hugging Face linear (q/k/v/o, gate/up/down projections; not lm_head):
  `weight` float8_e4m3fn = W / weight_scale rounded to nearest, `weight_scale` float32 scalar =
  max|W| / 448 of that projection alone (the engine fuses q/k/v and gate/up and shares one scale; this
  layout does not), `input_scale` float32 scalar = the activation scale of its input;
- `self_attn.k_proj.k_scale` and `self_attn.v_proj.v_scale` float32 scalars = the KV-cache scales;
- every other tensor unchanged in the model dtype; config.json gains `quantization_config`
  (`quant_method: modelopt`), and `hf_quant_config.json` names the algorithms and the excluded modules.
Weights are rounded to nearest even when the TensorRT-LLM checkpoint's were GPTQ-rounded: GPTQ's values
belong to the engine's fused scales.

4-bit (W4A16_AWQ, W4A8_AWQ), as modelopt 0.37 exports it after INT4_AWQ_CFG / W4A8_AWQ_BETA_CFG
(tests/test_hf_export_int4.py compares every tensor): the TensorRT-LLM checkpoint's codes and scales, split
into the Hugging Face parts (q/k/v) with the same packing, `weight` U8 [out/2, in], `weight_scale` F32 [out, in/group],
W4A8's `input_scale` and `weight_scale_2` F32 scalars; the smoothing of a linear that reads a norm's output (q/k/v after
input_layernorm, gate/up after post_attention_layernorm) is folded into that norm's weight, the others keep a
`pre_quant_scale` [in]. The codes are the TensorRT-LLM checkpoint's own (GPTQ-rounded): the scales are per part
and per group, so splitting q/k/v changes none of them.

Without a quantized checkpoint (`quantized_dir` None) the float checkpoint is written back as a plain Hugging
Face model in its own dtype (no quantization configs): what `trtpipe build --backend pytorch` serves for
fp16/bf16, whatever the source was (a Hugging Face directory, a hub id, or a GGUF file dequantized on load).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..checkpoint import is_excluded
from ..errors import UserError
from ..model.spec import HF_LAYER, ROW, dims
from ..precisions import DTYPE_CODES, E4M3_MAX, INT4_QUANT_ALGOS
from ..runtime.int4 import pack_int4, read_scale, unpack_int4
from ..runtime.trtllm_reader import CheckpointReader, merge_weights
from ..runtime.hf_checkpoint import KV_SCALES
from ..safetensors_stream import SafetensorsWriter, TensorSpec, dtype_code, torch_dtype
from ..model.arch_config import hf_config_of
from ..outputs import fingerprint_inputs, stage_output

FLOAT8 = {"dynamic": False, "num_bits": 8, "type": "float"}
WEIGHTS_FILE = "model.safetensors"
EXPORT_STAGE = "export-hf"
MIN_SCALE = 1e-12


def write_hf_checkpoint(float_dir: Path, quantized_dir: Path | None, out: Path) -> Path:
    """Write the HF FP8 twin of the calibrated checkpoint in `quantized_dir` (made from `float_dir`) to `out`;
    with no `quantized_dir`, the float checkpoint as a plain Hugging Face model."""
    fp = CheckpointReader(Path(float_dir))
    q = CheckpointReader(Path(quantized_dir)) if quantized_dir is not None else None
    if q is not None and (q.cfg.quant_algo not in ("FP8", *INT4_QUANT_ALGOS)
                          or q.cfg.kv_cache_quant_algo not in (None, "FP8")):
        raise UserError(f"the Hugging Face export writes FP8, W4A16_AWQ and W4A8_AWQ checkpoints with an FP8 or "
                        f"unquantized KV cache (modelopt's layout); {quantized_dir} is "
                        f"{q.cfg.quant_algo or 'not quantized'} with KV cache "
                        f"{q.cfg.kv_cache_quant_algo or 'unquantized'}")
    out = Path(out)
    tensors = list(_int4_tensors(fp, q) if q is not None and q.cfg.quant_algo in INT4_QUANT_ALGOS
                   else _tensors(fp, q))
    config = hf_config_of(fp.cfg.arch, fp.cfg.dtype)
    record = None
    if q is not None:
        ignore = ["lm_head", *excluded_hf_modules(q)]
        quant = {"quant_algo": q.cfg.quant_algo, "kv_cache_quant_algo": q.cfg.kv_cache_quant_algo}
        if q.cfg.quant_algo in INT4_QUANT_ALGOS:
            quant.update({key: q.cfg.quantization[key] for key in ("group_size", "has_zero_point", "pre_quant_scale")})
        quant["exclude_modules"] = ignore
        producer = {"name": "trtpipe", "version": __version__}
        record = {"producer": producer, "quantization": quant}
        config["quantization_config"] = _quantization_config(quant, producer)
    write_hf_directory(out, tensors, config, Path(quantized_dir if quantized_dir is not None else float_dir))
    if record is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(record, indent=4))
    return out


def write_hf_directory(out: Path, tensors: list, config: dict, checkpoint: Path) -> Path:
    """A Hugging Face model directory: `tensors` ((name, tensor), in order) as model.safetensors, `config` as
    config.json, and the tokenizer files of TensorRT-LLM `checkpoint` (its tokenizer/ directory) beside them."""
    out.mkdir(parents=True, exist_ok=True)
    specs = [TensorSpec(name, dtype_code(t.dtype), tuple(t.shape)) for name, t in tensors]
    with SafetensorsWriter(out / WEIGHTS_FILE, specs, {"format": "pt"}) as writer:
        for _, tensor in tensors:
            writer.write(tensor)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (checkpoint / "tokenizer").is_dir():
        shutil.copytree(checkpoint / "tokenizer", out, dirs_exist_ok=True)
    return out


@dataclass(frozen=True)
class HfExport:
    """The float checkpoint exported as a Hugging Face model directory (`export_float_checkpoint`)."""

    path: Path
    skipped: bool       # up to date: the same checkpoint was exported there before


def export_float_checkpoint(checkpoint: Path, out: Path, *, force: bool = False) -> HfExport:
    """The float TensorRT-LLM `checkpoint` as a Hugging Face model at `out`, as a stage (manifest, atomic,
    skipped when the checkpoint is unchanged)."""
    checkpoint, out = Path(checkpoint), Path(out)
    with stage_output(out, EXPORT_STAGE, fingerprint_inputs([checkpoint]), {"format": "hf"},
                      force=force) as output:
        if output.up_to_date:
            return HfExport(out, True)
        write_hf_checkpoint(checkpoint, None, output.dir)
    return HfExport(out, False)


def _tensors(fp: CheckpointReader, q: CheckpointReader | None):
    """(HF name, tensor) of every tensor, a decoder layer at a time, in the model dtype unless quantized."""
    arch, family = fp.cfg.arch, fp.cfg.family
    model_dtype = torch_dtype(DTYPE_CODES[fp.cfg.dtype])
    cast = lambda t: t.to(model_dtype)  # noqa: E731
    yield family.embedding[0], cast(fp.embedding())
    sizes = dims(arch)
    for i in range(fp.num_layers):
        float_layer = fp.layer(i)
        quant_layer = q.layer(i) if q is not None else None
        kv_scales = _kv_scales(q, i) if quant_layer is not None and quant_layer.kv_quant is not None else {}
        prefix = HF_LAYER.format(i)
        for norm in family.layer_norms(arch):
            yield prefix + norm.hf + ".weight", cast(float_layer.norms[norm.name])
        for lin in family.linears:
            weight, bias = float_layer.linears[lin.name].weight, float_layer.linears[lin.name].bias
            act = quant_layer.linears[lin.name].act_quant if quant_layer is not None else None
            rows = [sizes[p.rows] for p in lin.parts]
            for part, w, b in zip(lin.parts, weight.split(rows), bias.split(rows) if bias is not None else rows):
                name = prefix + part.hf
                if act is None:                       # excluded or a float export: model dtype
                    yield name + ".weight", cast(w)
                else:
                    scale = max(float(w.abs().max()) / E4M3_MAX, MIN_SCALE)
                    yield name + ".weight", (w / scale).to(torch.float8_e4m3fn)
                    yield name + ".weight_scale", torch.tensor(scale, dtype=torch.float32)
                    yield name + ".input_scale", torch.tensor(act.scale, dtype=torch.float32)
                if bias is not None:
                    yield name + ".bias", cast(b)
                yield from _kv_scale(name, part.hf, kv_scales)
    yield from model_tail(fp, cast)


def _kv_scale(name: str, module: str, kv_scales: dict[str, tuple[str, float]]):
    if module in kv_scales:
        key, value = kv_scales[module]
        yield f"{name}.{key}", torch.tensor(value, dtype=torch.float32)


def model_tail(fp: CheckpointReader, cast):
    """The final norm and, unless tied to the embedding, lm_head, in the model dtype."""
    yield fp.cfg.family.final_norm[0], cast(fp.final_norm())
    if not fp.cfg.arch.tie_word_embeddings:
        yield fp.cfg.family.lm_head[0], cast(fp.lm_head())


def _int4_tensors(fp: CheckpointReader, q: CheckpointReader):
    """(HF name, tensor) of a 4-bit checkpoint in modelopt's unified layout, a decoder layer at a time."""
    arch, family = fp.cfg.arch, fp.cfg.family
    model_dtype = torch_dtype(DTYPE_CODES[fp.cfg.dtype])
    cast = lambda t: t.to(model_dtype)  # noqa: E731
    w4a8 = INT4_QUANT_ALGOS[q.cfg.quant_algo] is not None
    yield family.embedding[0], cast(fp.embedding())
    sizes = dims(arch)
    for i in range(fp.num_layers):
        float_layer, packed, smoothing = int4_layer(fp, q, i)
        prefix = HF_LAYER.format(i)
        for norm in family.layer_norms(arch):
            weight = cast(float_layer.norms[norm.name])
            if norm.name in smoothing:
                weight = weight * smoothing[norm.name]
            yield prefix + norm.hf + ".weight", weight
        kv_scales = _kv_scales(q, i) if q.cfg.kv_cache_quant_algo else {}
        if w4a8:
            _share_fp8_scales(packed, family.linears)
        for lin in family.linears:
            rows = [sizes[p.rows] for p in lin.parts]
            bias = float_layer.linears[lin.name].bias
            biases = bias.split(rows) if bias is not None else [None] * len(rows)
            if lin.name not in packed:
                for part, w, b in zip(lin.parts, float_layer.linears[lin.name].weight.split(rows), biases):
                    yield prefix + part.hf + ".weight", cast(w)
                    if b is not None:
                        yield prefix + part.hf + ".bias", cast(b)
                continue
            merged = packed[lin.name]
            for part, codes, scales, b in zip(lin.parts, merged["codes"].split(rows), merged["scales"].split(rows),
                                              biases):
                name = prefix + part.hf
                yield name + ".weight", pack_int4(codes).view(torch.uint8)
                if b is not None:
                    yield name + ".bias", cast(b)
                if lin.input_norm is None:
                    yield name + ".pre_quant_scale", cast(merged["prequant"])
                if w4a8:
                    yield name + ".input_scale", merged["input_scale"].reshape(()).clone()
                    yield name + ".weight_scale_2", merged["weight_scale_2"].reshape(()).clone()
                yield name + ".weight_scale", scales.contiguous()
                yield from _kv_scale(name, part.hf, kv_scales)
    yield from model_tail(fp, cast)


def int4_layer(fp: CheckpointReader, q: CheckpointReader, i: int) -> tuple:
    """Layer `i` of a 4-bit checkpoint as the Hugging Face writers take it: the float layer (norms, biases, excluded
    linears), each quantized linear merged over the tp ranks (`_merged_int4`), and the smoothing each norm takes from
    the linears that read it (norm name -> prequant, in the checkpoint's dtype)."""
    family = fp.cfg.family
    stage = [rf for rf in q.ranks if i in rf.position.layers]
    local = f"transformer.layers.{i - stage[0].layer_offset}."
    packed = {lin.name: _merged_int4(q, lin, stage, local + lin.name, f"transformer.layers.{i}.{lin.name}")
              for lin in family.linears if q.cfg.quantizes(f"transformer.layers.{i}.{lin.name}")}
    readers = {}
    for lin in family.linears:
        if lin.name in packed and lin.input_norm is not None:
            readers.setdefault(lin.input_norm, []).append((lin.name, packed[lin.name]["prequant"]))
    return fp.layer(i), packed, {norm: _one_smoothing(linears, i) for norm, linears in readers.items()}


def _merged_int4(q: CheckpointReader, lin, stage: list, local: str, module: str) -> dict[str, torch.Tensor]:
    """One 4-bit linear's tp shares as the whole model's: int8 codes [out, in], float32 group scales [out, in/g],
    the smoothing [in] and W4A8's two scalars (one value on every rank)."""
    codes = [unpack_int4(rf.read(local + ".weight")).float() for rf in stage]
    scales = [read_scale(rf, local + ".weights_scaling_factor") for rf in stage]
    prequant = [rf.read(local + ".prequant_scaling_factor") for rf in stage]
    row = lin.parallel == ROW
    merged = {"codes": merge_weights(q.cfg, lin, codes, module).to(torch.int8),
              "scales": merge_weights(q.cfg, lin, scales, module),
              "prequant": torch.cat(prequant) if row else prequant[0]}
    if INT4_QUANT_ALGOS[q.cfg.quant_algo] is not None:
        for key, name in (("input_scale", "activation_scaling_factor"), ("weight_scale_2", "weights_scaling_factor_2")):
            merged[key] = max((read_scale(rf, f"{local}.{name}").reshape(()) for rf in stage), key=float)
    return merged


def _share_fp8_scales(packed: dict[str, dict], linears) -> None:
    """W4A8: one input_scale and weight_scale_2 per fused group (gate/up), the larger: TensorRT-LLM's PyTorch backend
    loads a fused GEMM's parts only when they agree (`load_weight_scales_w4a8`); trtpipe's calibration writes them
    equal already, modelopt's TensorRT-LLM exporter does not."""
    for lin in linears:
        if lin.fused_with and lin.name in packed and lin.fused_with in packed:
            a, b = packed[lin.name], packed[lin.fused_with]
            for key in ("input_scale", "weight_scale_2"):
                a[key] = b[key] = max(a[key], b[key], key=float)


def _one_smoothing(linears: list[tuple[str, torch.Tensor]], layer: int) -> torch.Tensor:
    """The smoothing the linears reading one norm share (trtpipe writes one per input)."""
    first = linears[0][1]
    for name, prequant in linears[1:]:
        if not torch.equal(prequant, first):
            raise UserError(f"transformer.layers.{layer}: {linears[0][0]} and {name} read one norm but have "
                            "different prequant_scaling_factor: the Hugging Face layout folds one into the norm")
    return first


def _kv_scales(q: CheckpointReader, layer: int) -> dict[str, tuple[str, float]]:
    """HF module -> (tensor name, value) of layer `layer`'s K and V cache scales: the separate factors the
    checkpoint holds (calibrate writes them), else the one it serves both with."""
    rf = next(r for r in q.ranks if layer in r.position.layers)
    prefix = f"transformer.layers.{layer - rf.layer_offset}.attention."
    shared = float(rf.read(prefix + "kv_cache_scaling_factor").reshape(-1)[0])
    scales = {}
    for kind, module in KV_SCALES.items():
        own = rf.maybe(prefix + f"{kind}_cache_scaling_factor")
        scales[module] = (f"{kind}_scale", shared if own is None else float(own.reshape(-1)[0]))
    return scales


def excluded_hf_modules(q: CheckpointReader) -> list[str]:
    """The HF modules of the linears the calibrated checkpoint left unquantized (its --exclude)."""
    family, excluded = q.cfg.family, []
    for i in range(q.num_layers):
        for lin in family.linears:
            if is_excluded(f"transformer.layers.{i}.{lin.name}", q.cfg.exclude_modules):
                excluded += [HF_LAYER.format(i) + part.hf for part in lin.parts]
    return excluded


def _quantization_config(quant: dict, producer: dict) -> dict:
    """config.json's `quantization_config`, as modelopt writes it (what vLLM's modelopt loader reads): FP8 with its
    `config_groups`, the 4-bit algorithms without (modelopt 0.37's `convert_hf_quant_config_format`)."""
    config = {"config_groups": {"group_0": {"input_activations": FLOAT8, "weights": FLOAT8, "targets": ["Linear"]}}
              } if quant["quant_algo"] == "FP8" else {}
    config.update({"ignore": quant["exclude_modules"], "quant_algo": quant["quant_algo"]})
    if quant["kv_cache_quant_algo"] == "FP8":
        config["kv_cache_scheme"] = FLOAT8
    return {**config, "producer": producer, "quant_method": "modelopt"}
