"""Read a Hugging Face checkpoint — FP8, W4A16_AWQ or W4A8_AWQ in nvidia-modelopt's unified layout (what
`calibrate --format both|hf` and modelopt's `export_hf_checkpoint` write), or float — as the reference runtime's
merged pieces.

The tensor names come from the family's spec (`pipeline.model.arch_config.hf_tensor_shapes`, each LinearSpec's
Hugging Face parts); nothing here names a tensor of its own except modelopt's scale suffixes. The layout:
- per quantized linear part (q/k/v/o, gate/up/down projections): `weight` float8_e4m3fn, `weight_scale`
  and `input_scale` float32 scalars; excluded modules (`hf_quant_config.json` exclude_modules, or
  config.json `quantization_config.ignore`) keep a float `weight`;
- `self_attn.k_proj.k_scale` and `self_attn.v_proj.v_scale`: the FP8 KV-cache scales;
- quantization from `hf_quant_config.json` (quant_algo, kv_cache_quant_algo, exclude_modules), else from
  config.json's `quantization_config` (quant_method "modelopt"); both, when present, must agree.

AutoAWQ's layout (`quant_method: awq`, what `calibrate --format vllm` writes and vLLM reads; `pipeline.runtime.awq`):
W4A16 parts hold `qweight`, `qzeros` and `scales` instead of `weight`, with no smoothing vector anywhere; the modules
in `modules_to_not_convert` (substrings of module names, as vLLM matches them) keep a float `weight`.

4-bit parts hold `weight` [out/2, in] (two int4 codes per byte along the output, as in TensorRT-LLM's checkpoint),
`weight_scale` [out, in/group], a `pre_quant_scale` [in] where the smoothing was not folded into the norm before
(o_proj, down_proj), and for W4A8 `input_scale` and `weight_scale_2` scalars; the group size comes from
hf_quant_config.json (config.json's `quantization_config` does not carry it). A fused group's W4A8 input is
quantized with its largest `input_scale` and its weights rounded to FP8 with its largest `weight_scale_2`
(modelopt writes one value per group).

FP8 is executed as TensorRT-LLM's PyTorch backend loads it (tensorrt_llm/_torch/modules/linear.py,
`FP8QDQLinearMethod.rescale_fused_weights`): the parts the server runs as one GEMM (q/k/v; gate/up, the
spec's `fused_with` pair) share the largest `weight_scale` of the group, each part's FP8 weight being
dequantized in the model dtype with its own scale and quantized again with the shared one, and the
group's input is quantized with its largest `input_scale`. The engine's checkpoint holds q/k/v with one
scale already, so the two agree exactly except on the parts whose own scale was smaller than the group's
(their weights are rounded twice; docs/pytorch-backend.md). The KV cache is quantized with the larger of
k_scale and v_scale, as the engine's `kv_cache_scaling_factor`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import CheckpointConfig, is_excluded
from ..errors import UserError, read_config_json
from ..model.arch_config import arch_from_hf_config, hf_tensor_shapes
from ..model.spec import HF_LAYER, LinearSpec, Part
from ..precisions import DTYPE_CODES, INT4_QUANT_ALGOS
from ..safetensors_stream import LazyWeights, torch_dtype
from .trtllm_reader import (
    FLOATS,
    SCALAR,
    CheckpointReader,
    Expect,
    Layer,
    Linear,
    ModelWeights,
    check_tensors,
    merge_pieces,
    report,
)
from .config import check_supported
from .awq import CONFIG as AWQ_CONFIG, dequantize_awq
from .int4 import dequantize_groupwise, unpack_int4
from .quant import TensorQuant, fake_quant_fp8

#: where modelopt's HF layout keeps the KV-cache scales: K's on k_proj, V's on v_proj
KV_SCALES = {"k": "self_attn.k_proj", "v": "self_attn.v_proj"}
QUANT_CONFIG = "hf_quant_config.json"
FP8 = "FP8"
#: what the reference runtime executes from a Hugging Face checkpoint
HF_QUANT_ALGOS = (FP8, *INT4_QUANT_ALGOS)
#: the 4-bit parts' scale tensors (positive and finite, every value)
INT4_SCALES = ("weight_scale", "pre_quant_scale", "input_scale", "weight_scale_2", ".scales")
MODELOPT, AWQ = "modelopt", "awq"


@dataclass(frozen=True)
class HfQuantization:
    """What a Hugging Face checkpoint says of its quantization (nothing: a float model)."""

    quant_algo: str | None = None               # one of HF_QUANT_ALGOS or None
    kv_cache_quant_algo: str | None = None      # "FP8" or None
    exclude: tuple[str, ...] = ()               # modules left in the model dtype (modelopt's patterns)
    groupwise: dict | None = None               # 4-bit: group_size, has_zero_point, pre_quant_scale
    layout: str = MODELOPT                      # MODELOPT | AWQ

    def quantizes(self, module: str) -> bool:
        if self.layout == AWQ:      # vLLM's is_layer_skipped(match_mode="substring")
            return not any(pattern in module for pattern in self.exclude)
        return self.quant_algo in HF_QUANT_ALGOS and not is_excluded(module, self.exclude)

    def to_dict(self) -> dict:
        """The TensorRT-LLM config's `quantization` block this amounts to."""
        return {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                **(self.groupwise or {}), "exclude_modules": list(self.exclude)}

    @property
    def int4(self) -> bool:
        return self.quant_algo in INT4_QUANT_ALGOS

    @property
    def group_size(self) -> int:
        return int(self.groupwise["group_size"])


@dataclass(frozen=True)
class ReadPart:
    """One Hugging Face linear part as read: its weight as stored (4-bit: dequantized) and, when quantized, its
    scales."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_scale: float | None = None
    input_scale: float | None = None
    weight_scale_2: float | None = None         # W4A8
    prequant: torch.Tensor | None = None        # 4-bit, not folded into a norm


def is_hf_checkpoint(directory: Path) -> bool:
    """A Hugging Face model directory: config.json naming `architectures`, with safetensors weights."""
    config = Path(directory) / "config.json"
    if not config.is_file() or not any(Path(directory).glob("*.safetensors")):
        return False
    try:
        return "architectures" in json.loads(config.read_text())
    except ValueError:
        return False


def is_quantized_hf_checkpoint(directory: Path) -> bool:
    """A Hugging Face checkpoint with a quantization record (hf_quant_config.json or quantization_config)."""
    if not is_hf_checkpoint(directory):
        return False
    config = json.loads((Path(directory) / "config.json").read_text())
    return (Path(directory) / QUANT_CONFIG).is_file() or bool(config.get("quantization_config"))


def open_checkpoint(path: Path):
    """The reader for a checkpoint directory: `HfCheckpointReader` for a Hugging Face model, else TensorRT-LLM's."""
    return HfCheckpointReader(path) if is_hf_checkpoint(path) else CheckpointReader(path)


def load_checkpoint(ckpt_dir: Path) -> tuple[CheckpointConfig, ModelWeights]:
    """Read, validate and merge a checkpoint (TensorRT-LLM's or a Hugging Face model directory); UserError
    (naming every problem) if it is not runnable."""
    reader = open_checkpoint(ckpt_dir)
    return reader.cfg, reader.merge_all()


def read_hf_quantization(directory: Path, config: dict) -> HfQuantization:
    """The quantization of a Hugging Face checkpoint; UserError for one the reference runtime cannot execute."""
    where = Path(directory) / "config.json"
    qc = config.get("quantization_config")
    from_config = None
    if isinstance(qc, dict) and qc.get("quant_method") == AWQ_CONFIG["quant_method"]:
        return read_awq_quantization(qc, where)
    if qc:
        if not isinstance(qc, dict) or qc.get("quant_method") != "modelopt":
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise UserError(f"{where}: quantization_config.quant_method {method!r} is not supported by the reference "
                            "runtime (nvidia-modelopt's layout, `trtpipe calibrate --format both|hf`, or AutoAWQ's, "
                            "`--format vllm`)")
        kv = FP8 if qc.get("kv_cache_scheme") else None
        from_config = HfQuantization(qc.get("quant_algo"), kv, tuple(qc.get("ignore") or ()))
    quant = from_config or HfQuantization()
    record = Path(directory) / QUANT_CONFIG
    if record.is_file():
        try:
            q = json.loads(record.read_text())["quantization"]
            groupwise = ({key: q.get(key) for key in ("group_size", "has_zero_point", "pre_quant_scale")}
                         if q.get("quant_algo") in INT4_QUANT_ALGOS else None)
            quant = HfQuantization(q.get("quant_algo"), q.get("kv_cache_quant_algo"),
                                   tuple(q.get("exclude_modules") or ()), groupwise)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{record} is not modelopt's quantization record ({type(exc).__name__}: {exc}); "
                            "export the checkpoint again") from None
        if from_config and (from_config.quant_algo, from_config.kv_cache_quant_algo) != (
                quant.quant_algo, quant.kv_cache_quant_algo):
            raise UserError(f"{record} says {quant.quant_algo} with KV cache {quant.kv_cache_quant_algo} but "
                            f"{where} says {from_config.quant_algo} with KV cache {from_config.kv_cache_quant_algo}")
    if quant.quant_algo not in (None, *HF_QUANT_ALGOS) or quant.kv_cache_quant_algo not in (None, FP8):
        raise UserError(f"{directory}: quant_algo {quant.quant_algo!r} with KV cache {quant.kv_cache_quant_algo!r} "
                        "is not supported by the reference runtime for Hugging Face checkpoints (FP8, W4A16_AWQ or "
                        "W4A8_AWQ, FP8 or unquantized KV cache)")
    if quant.int4 and quant.groupwise is None:
        raise UserError(f"{directory}: a {quant.quant_algo} checkpoint needs its {QUANT_CONFIG} (the group size is "
                        "recorded there only); export it again")
    return quant


def read_awq_quantization(qc: dict, where: Path) -> HfQuantization:
    """The quantization of an AutoAWQ checkpoint (4-bit "gemm" weights, groups of `group_size` inputs)."""
    bits, version, group = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower(), \
        qc.get("group_size", qc.get("q_group_size"))
    if bits != AWQ_CONFIG["bits"] or version != AWQ_CONFIG["version"]:
        raise UserError(f"{where}: AWQ with bits {bits!r}, version {version!r}: the reference runtime reads "
                        f"{AWQ_CONFIG['bits']}-bit {AWQ_CONFIG['version']!r} checkpoints")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise UserError(f"{where}: quantization_config.group_size {group!r} is not a positive integer")
    groupwise = {"group_size": group, "has_zero_point": bool(qc.get("zero_point", True)), "pre_quant_scale": False}
    return HfQuantization("W4A16_AWQ", None, tuple(qc.get("modules_to_not_convert") or ()), groupwise, AWQ)


def fused_groups(linears: tuple[LinearSpec, ...]) -> list[tuple[LinearSpec, ...]]:
    """The linears the server runs as one GEMM: each alone, or with its `fused_with` partner (gate/up)."""
    by_name = {lin.name: lin for lin in linears}
    groups, seen = [], set()
    for lin in linears:
        if lin.name in seen:
            continue
        group = (lin, by_name[lin.fused_with]) if lin.fused_with else (lin,)
        seen.update(g.name for g in group)
        groups.append(group)
    return groups


class HfCheckpointReader:
    """A validated Hugging Face checkpoint whose merged float32 pieces are read on demand (as `CheckpointReader`)."""

    def __init__(self, directory: Path):
        self.path = Path(directory)
        config = read_config_json(self.path, f"{self.path} has no config.json; it is not a Hugging Face model")
        where = str(self.path / "config.json")
        arch = arch_from_hf_config(config, where)
        self.quant = read_hf_quantization(self.path, config)
        # AWQ's zero points are applied here, when a part is read: the runtime's linears see none
        self.cfg = CheckpointConfig.new(arch, arch.dtype).with_quantization(
            {**self.quant.to_dict(), **({"has_zero_point": False} if self.quant.layout == AWQ else {})})
        check_supported(self.cfg, where)
        self.weights = LazyWeights(self.path)
        self._names = self.weights.names()
        what = "Hugging Face checkpoint {} does not match its config.json / " + QUANT_CONFIG
        report(self.path, check_tensors(self.path.name, self.weights, self.expected()), what)
        report(self.path, self.bad_scales(), what)
        self.model_dtype = torch_dtype(DTYPE_CODES[self.cfg.dtype])

    @property
    def num_layers(self) -> int:
        return self.cfg.arch.num_hidden_layers

    # -------------------------------------------------------------------------------- validation

    def expected(self) -> dict[str, Expect]:
        """Every tensor the checkpoint must (or may) hold: the family's Hugging Face tensors, FP8 where quantized,
        with modelopt's scales."""
        arch, family = self.cfg.arch, self.cfg.family
        fp8 = (torch.float8_e4m3fn,)
        out = {name: Expect(shape, FLOATS) for name, shape in hf_tensor_shapes(arch).items()}
        if arch.tie_word_embeddings:   # a saved copy of the tied table is allowed
            out[family.lm_head[0]] = Expect((arch.vocab_size, arch.hidden_size), FLOATS, required=False)
        for module in self.quantized_modules():
            if self.quant.layout == AWQ:
                out.update(self.expected_awq(module, out.pop(module + ".weight").shape))
                continue
            if self.quant.int4:
                out.update(self.expected_int4(module, out[module + ".weight"].shape))
                continue
            out[module + ".weight"] = Expect(out[module + ".weight"].shape, fp8)
            out[module + ".weight_scale"] = Expect(SCALAR, FLOATS)
            out[module + ".input_scale"] = Expect(SCALAR, FLOATS)
        if self.quant.kv_cache_quant_algo == FP8:
            for i in range(self.num_layers):
                for kind, module in KV_SCALES.items():
                    out[HF_LAYER.format(i) + f"{module}.{kind}_scale"] = Expect(SCALAR, FLOATS)
        ignored = family.ignored_sources
        for name in self._names:
            if name.endswith(ignored):
                out.setdefault(name, Expect(self.weights.shape(name), FLOATS, required=False))
        return out

    def expected_int4(self, module: str, shape: tuple[int, int]) -> dict[str, Expect]:
        """The tensors of one 4-bit part of `shape` [out, in] (UserError where the shape cannot be packed)."""
        (o, i), group = shape, self.quant.group_size
        if o % 2 or i % group:
            raise UserError(f"{self.path.name}: {module} is {o} x {i}: not packable as int4 pairs of output rows in "
                            f"groups of {group} inputs")
        out = {module + ".weight": Expect((o // 2, i), (torch.uint8, torch.int8), note="two int4 codes per byte "
                                          "along the output: [out/2, in]"),
               module + ".weight_scale": Expect((o, i // group), FLOATS, note=f"[out, in/{group}]")}
        if not self.folds_smoothing(module):
            out[module + ".pre_quant_scale"] = Expect((i,), FLOATS, note="one per input: [in]")
        if INT4_QUANT_ALGOS[self.quant.quant_algo]:
            out[module + ".input_scale"] = Expect(SCALAR, FLOATS)
            out[module + ".weight_scale_2"] = Expect(SCALAR, FLOATS)
        return out

    def expected_awq(self, module: str, shape: tuple[int, int]) -> dict[str, Expect]:
        """The tensors of one AutoAWQ part of `shape` [out, in]."""
        (o, i), group = shape, self.quant.group_size
        if o % 8 or i % group:
            raise UserError(f"{self.path.name}: {module} is {o} x {i}: not packable as AWQ's eight 4-bit codes per "
                            f"int32 along the output in groups of {group} inputs")
        out = {module + ".qweight": Expect((i, o // 8), (torch.int32,), note="eight codes per int32 along the "
                                           "output: [in, out/8]"),
               module + ".scales": Expect((i // group, o), FLOATS, note=f"[in/{group}, out]")}
        if self.quant.groupwise["has_zero_point"]:
            out[module + ".qzeros"] = Expect((i // group, o // 8), (torch.int32,), note=f"[in/{group}, out/8]")
        return out

    def folds_smoothing(self, module: str) -> bool:
        """Whether this part's input smoothing is in the norm before it (modelopt's fused layernorm), not its own
        pre_quant_scale (AutoAWQ's layout has none anywhere)."""
        if self.quant.layout == AWQ:
            return True
        part = module.split(".", 3)[-1]
        return any(lin.input_norm is not None for lin in self.cfg.family.linears
                   if any(p.hf == part for p in lin.parts))

    def quantized_modules(self) -> list[str]:
        return [HF_LAYER.format(i) + part.hf for i in range(self.num_layers) for lin in self.cfg.family.linears
                for part in lin.parts if self.quant.quantizes(HF_LAYER.format(i) + part.hf)]

    def bad_scales(self) -> list[str]:
        """Scales that cannot be scales (zero, negative, not finite), and fused groups mixing FP8 with float."""
        names = [n for n in self._names if n.endswith((*INT4_SCALES, "k_scale", "v_scale"))]
        problems = []
        for name in sorted(names):
            values = self.weights.read(name).float().reshape(-1)
            bad = ~(torch.isfinite(values) & (values > 0))
            if bool(bad.any()):
                value = float(values[bad][0])
                problems.append(f"{self.path.name}: {name} is {value}, not a positive finite scale" if values.numel()
                                == 1 else f"{self.path.name}: {name} holds {int(bad.sum())} value(s) that are not "
                                f"positive finite scales (e.g. {value})")
        for i in range(self.num_layers):
            for group in fused_groups(self.cfg.family.linears):
                modules = [HF_LAYER.format(i) + part.hf for lin in group for part in lin.parts]
                if len({self.quant.quantizes(m) for m in modules}) > 1:
                    problems.append(f"{', '.join(modules)} run as one GEMM: exclude all of them from quantization "
                                    "or none")
        return problems

    # ----------------------------------------------------------------------------------- pieces

    def embedding(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.weights.read(self.cfg.family.embedding[0], rows).float()

    def final_norm(self) -> torch.Tensor:
        return self.weights.read(self.cfg.family.final_norm[0]).float()

    @property
    def tied_lm_head(self) -> bool:
        return self.cfg.arch.tie_word_embeddings

    def lm_head(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if self.tied_lm_head:
            return self.embedding(rows)
        return self.weights.read(self.cfg.family.lm_head[0], rows).float()

    def merge_all(self):
        return merge_pieces(self)

    def layer(self, index: int) -> Layer:
        arch, family = self.cfg.arch, self.cfg.family
        prefix = HF_LAYER.format(index)
        linears = {}
        for group in fused_groups(family.linears):
            linears.update(self.group_linears(prefix, group))
        norms = {n.name: self.weights.read(prefix + n.hf + ".weight").float() for n in family.layer_norms(arch)}
        kv_quant = None
        if self.quant.kv_cache_quant_algo == FP8:
            scale = max(self.scalar(f"{prefix}{module}.{kind}_scale") for kind, module in KV_SCALES.items())
            kv_quant = TensorQuant("fp8", scale)
        return Layer(linears, norms, kv_quant)

    def group_linears(self, prefix: str, group: tuple[LinearSpec, ...]) -> dict[str, Linear]:
        """The group's linears by TensorRT-LLM name, FP8 ones sharing the group's largest scales."""
        parts = {lin.name: [self.read_part(prefix, part) for part in lin.parts] for lin in group}
        read = [p for ps in parts.values() for p in ps]
        if not self.quant.quantizes(prefix + group[0].parts[0].hf):
            return {name: Linear(torch.cat([p.weight.float() for p in ps]), _bias(ps)) for name, ps in parts.items()}
        if self.quant.int4:
            return self.int4_linears(parts, read)
        weight_scale = max(p.weight_scale for p in read)
        act = TensorQuant("fp8", max(p.input_scale for p in read))
        return {name: Linear(torch.cat([self.rescaled(p, weight_scale) for p in ps]), _bias(ps), act)
                for name, ps in parts.items()}

    def int4_linears(self, parts: dict[str, list[ReadPart]], read: list[ReadPart]) -> dict[str, Linear]:
        """A group's 4-bit linears: dequantized codes, W4A8's FP8 rounding and input quantizer at the group's largest
        scales, the smoothing each part keeps (none where the norm holds it)."""
        act, fp8_weight = None, None
        if INT4_QUANT_ALGOS[self.quant.quant_algo]:
            act = TensorQuant("fp8", max(p.input_scale for p in read))
            fp8_weight = max(p.weight_scale_2 for p in read)
        linears = {}
        for name, ps in parts.items():
            weight = torch.cat([p.weight for p in ps])
            if fp8_weight is not None:
                weight = fake_quant_fp8(weight, torch.tensor(fp8_weight))
            prequant = ps[0].prequant.float() if ps[0].prequant is not None else None
            linears[name] = Linear(weight, _bias(ps), act, prequant)
        return linears

    def read_part(self, prefix: str, spec_part: Part) -> ReadPart:
        module = prefix + spec_part.hf
        bias = self.weights.read(module + ".bias") if module + ".bias" in self._names else None
        if not self.quant.quantizes(module):
            return ReadPart(self.weights.read(module + ".weight"), bias)
        if self.quant.layout == AWQ:
            qweight = self.weights.read(module + ".qweight")
            zeros = self.weights.read(module + ".qzeros") if self.quant.groupwise["has_zero_point"] else None
            return ReadPart(dequantize_awq(qweight, zeros, self.weights.read(module + ".scales")), bias)
        if self.quant.int4:
            w4a8 = INT4_QUANT_ALGOS[self.quant.quant_algo] is not None
            weight = self.weights.read(module + ".weight")
            codes = unpack_int4(weight.view(torch.int8))
            return ReadPart(dequantize_groupwise(codes, self.weights.read(module + ".weight_scale")), bias, None,
                            self.scalar(module + ".input_scale") if w4a8 else None,
                            self.scalar(module + ".weight_scale_2") if w4a8 else None,
                            None if self.folds_smoothing(module) else self.weights.read(module + ".pre_quant_scale"))
        return ReadPart(self.weights.read(module + ".weight"), bias, self.scalar(module + ".weight_scale"),
                        self.scalar(module + ".input_scale"))

    def rescaled(self, part: ReadPart, scale: float) -> torch.Tensor:
        """float32 weight of an FP8 part quantized again with the group's `scale`, as TensorRT-LLM's PyTorch
        backend does it: the FP8 values in the model dtype, times their own scale, divided by the group's."""
        own, shared = torch.tensor(part.weight_scale), torch.tensor(scale)
        requantized = part.weight.to(self.model_dtype).mul_(own).div_(shared).to(torch.float8_e4m3fn)
        return requantized.float() * scale

    def scalar(self, name: str) -> float:
        return float(self.weights.read(name).reshape(-1)[0])


def _bias(parts: list[ReadPart]) -> torch.Tensor | None:
    return torch.cat([p.bias.float() for p in parts]) if parts[0].bias is not None else None
