"""Read a float TensorRT-LLM checkpoint and write its quantized twin in modelopt 0.37's export layout.

What `modelopt.torch.export.export_tensorrt_llm_checkpoint` 0.37 writes (checked by exporting
SmolLM2 with FP8_DEFAULT_CFG + FP8_KV_CFG and INT8_SMOOTHQUANT_CFG + INT8 KV on the CPU):

FP8 (`quant_algo: FP8`), per quantized linear:
  weight                     float8_e4m3fn [out, in]  = W / weights_scaling_factor, rounded (nearest or GPTQ)
  weights_scaling_factor     float32 [1]              = max|W| / 448 (fc and gate share the larger one)
  activation_scaling_factor  float32 [1]              = activation amax / 448
W8A8_SQ_PER_CHANNEL, per quantized linear:
  weight                     int8 [out, in]           = W' / wsf[:, None] rounded (nearest or GPTQ) into [-128, 127],
                                                        W' = W / prequant_scaling_factor (per input column)
  weights_scaling_factor     float32 [out]            = max_j |W'[o, j]| / 127
  prequant_scaling_factor    model dtype [in]         multiplies the input before it is quantized
  activation_scaling_factor  float32 [1]              = amax of (x * prequant) / 127
W4A16_AWQ and W4A8_AWQ (docs/int4.md), per quantized linear:
  weight                     int8 [out/2, in]         two int4 codes of W' = W / prequant (per input column) per byte,
                                                      from adjacent output rows (`runtime.int4.pack_int4`)
  weights_scaling_factor     float32 [out, in/group]  per row and group of inputs (`int4.group_scales`)
  prequant_scaling_factor    model dtype [in]         AWQ's smoothing (`int4.awq_smoothing`): fc and gate share one
  activation_scaling_factor  float32 [1], W4A8        amax of (x * prequant) / 448
  weights_scaling_factor_2   float32 [1], W4A8        the FP8 grid of code x scale: 8/7 max|W'| / 448 (no code x scale
                                                      can exceed it), the same on every tp rank
KV cache, per layer: attention.{k,v}_cache_scaling_factor float32 [1] and
  attention.kv_cache_scaling_factor = max of the two; FP8 factors are amax / 448 raised to at least
  1.0 (modelopt's rule), INT8 factors amax / 127.
config.json: quantization {quant_algo, kv_cache_quant_algo, exclude_modules: ["lm_head", ...]}, and for 4-bit
  group_size, has_zero_point false, pre_quant_scale true.
lm_head and the embedding stay in the model dtype; with --quantize-lm-head (int4-awq) lm_head is a 4-bit linear like
the others (what modelopt 0.37 writes when its lm_head quantizer is on, checked), written after the last layer, and
exclude_modules is TensorRT-LLM's default list less lm_head (`checkpoint.written_exclude_modules`).
GPTQ rounding of a row-parallel linear (dense, proj) sharded over tp ranks works on the full width
(each shard with its own scales), so the ranks' errors cancel in their summed output; an FP8 tp=2
checkpoint holds the same values as the tp=1 one, split.

`QuantizedCheckpointWriter` declares every output tensor up front (from the float rank files' headers)
and then takes the quantized tensors one decoder layer at a time, as calibration finishes each layer:
the rank files are written as they go and nothing holds more than one layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import (LAYER_TENSOR, LM_HEAD, LM_HEAD_WEIGHT, CheckpointConfig, RankFile, is_excluded,
                          open_rank_files, written_exclude_modules)
from ..errors import UserError
from ..model.spec import Family
from ..precisions import CALIBRATION_QUANT_ALGO, DTYPE_CODES, INT4_MAX, INT4_PRECISIONS, KV_CACHE_QUANT_ALGO
from ..runtime.int4 import pack_int4
from ..safetensors_stream import SafetensorsWriter, TensorSpec, dtype_code, torch_dtype
from .formats import E4M3_MAX
from .int4 import group_scales, int4_codes
from .rounding import DEFAULT_DAMP, fp8_codes, gptq_inverse, int8_codes, round_weight

MIN_SCALE = 1e-12


@dataclass(frozen=True)
class FloatCheckpoint:
    path: Path
    cfg: CheckpointConfig
    ranks: list[RankFile]

    @property
    def family(self) -> Family:
        return self.cfg.family

    @property
    def tp_size(self) -> int:
        return self.cfg.layout.tp

    @property
    def num_layers(self) -> int:
        return self.cfg.arch.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(DTYPE_CODES[self.cfg.dtype])

    @property
    def head_ranks(self) -> list[RankFile]:
        """The rank files of the last pipeline stage (ln_f and lm_head), in tp order."""
        return sorted((rf for rf in self.ranks if rf.pp_rank == self.cfg.layout.pp - 1), key=lambda rf: rf.tp_rank)

    def lm_head_weight(self) -> torch.Tensor:
        """The float32 lm_head [vocab padded to a multiple of tp, hidden], its tp shards joined."""
        return torch.cat([rf.file.read(LM_HEAD_WEIGHT).float() for rf in self.head_ranks])

    def linear_of(self, global_name: str) -> str | None:
        """'transformer.layers.3.mlp.fc.weight' -> 'transformer.layers.3.mlp.fc' for quantizable linears."""
        m = LAYER_TENSOR.match(global_name)
        if not m or not m.group(2).endswith(".weight"):
            return None
        inner = m.group(2)[: -len(".weight")]
        return f"transformer.layers.{m.group(1)}.{inner}" if inner in self.family.linear_names else None

    def layer_modules(self, layer: int, exclude: tuple[str, ...] = ()) -> list[str]:
        """The quantizable linears of global layer `layer` not matched by `exclude`."""
        names = (f"transformer.layers.{layer}.{lin}" for lin in self.family.linear_names)
        return [m for m in names if not is_excluded(m, exclude)]

    def is_row_parallel(self, module: str) -> bool:
        return module.endswith(self.family.row_parallel)

    def fused_partner(self, module: str) -> str | None:
        """The linear the engine fuses `module` with (fc and gate must share scales): each names the other."""
        return _relative(module, self.family.partner)

    def source_of(self, name: str) -> str:
        """The recorded tensor whose statistics an observed tensor uses: itself for K/V and for most linears,
        the linear whose input it shares otherwise (transformer.layers.3.mlp.gate -> ...mlp.fc)."""
        return name if is_kv(name) else _relative(name, self.family.input_source)

    def stats_key(self, name: str) -> str | None:
        """The statistics an observed tensor feeds (None for linears that share another's input)."""
        return name if self.source_of(name) == name else None


def is_kv(name: str) -> bool:
    """The K or V values the runtime's observer reports as they enter the cache."""
    return name.endswith((".attention.k", ".attention.v"))


def _relative(module: str, lookup) -> str | None:
    """Apply a layer-relative lookup of the family spec ('mlp.fc' -> 'mlp.gate') to a global module name."""
    m = LAYER_TENSOR.match(module)
    found = lookup(m.group(2))
    return None if found is None else f"transformer.layers.{m.group(1)}.{found}"


def open_float_checkpoint(path: Path) -> FloatCheckpoint:
    """The checkpoint's config and rank files; UserError for anything calibrate cannot start from."""
    cfg = CheckpointConfig.read(path)
    if cfg.is_quantized:
        raise UserError(f"{path} is already quantized (quant_algo={cfg.quant_algo}, "
                        f"kv_cache_quant_algo={cfg.kv_cache_quant_algo}); calibrate the float "
                        "checkpoint that `trtpipe convert` wrote")
    return FloatCheckpoint(path, cfg, open_rank_files(path, cfg))


@dataclass(frozen=True)
class WeightStats:
    """Per global linear: max |W| over all tp shards, and the per-input-column max (full width)."""

    amax: dict[str, float]
    column_max: dict[str, torch.Tensor]


def weight_statistics(ckpt: FloatCheckpoint, modules: set[str]) -> WeightStats:
    amax: dict[str, float] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for rf in ckpt.ranks:
        for name in sorted(rf.file.names()):
            module = ckpt.linear_of(rf.global_name(name))
            if module not in modules:
                continue
            w = rf.file.read(name).float().abs()
            amax[module] = max(amax.get(module, 0.0), float(w.max()))
            col = w.amax(dim=0)
            prev = shards.setdefault(module, {}).get(rf.tp_rank)
            shards[module][rf.tp_rank] = col if prev is None else torch.maximum(prev, col)
    column_max = {}
    for module, per_rank in shards.items():
        ordered = [per_rank[t] for t in sorted(per_rank)]
        if ckpt.is_row_parallel(module):
            column_max[module] = torch.cat(ordered)
        else:
            column_max[module] = torch.stack(ordered).amax(dim=0)
    return WeightStats(amax, column_max)


@dataclass(frozen=True)
class QuantPlan:
    """Everything the writer needs, keyed by global module names."""

    precision: str                                   # "fp8" | "int8-sq" | "int4-awq" | "w4a8-awq"
    kv_cache: str | None                             # "fp8" | "int8" | None
    activation_amax: dict[str, float]                # linear -> amax of its (smoothed) input
    weight_amax: dict[str, float]                    # linear -> max |W| (FP8)
    prequant: dict[str, torch.Tensor]                # linear -> full-width smoothing vector (INT8-SQ)
    kv_amax: dict[int, tuple[float, float]]          # layer -> (K amax, V amax)
    exclude: tuple[str, ...]                         # modules left in the model dtype (besides lm_head)
    alpha: float | None = None
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # linear -> E[x x^T] (GPTQ); absent: nearest
    damp: float = DEFAULT_DAMP
    fused: dict[str, str] = field(default_factory=dict)   # linear -> the partner the engine fuses it with
    group_size: int | None = None                    # 4-bit: inputs per weight scale
    input_moments: dict[str, torch.Tensor] = field(default_factory=dict)  # 4-bit: linear -> E[x^2] per (smoothed) input
    #: factors already made for a fused partner (fc and gate share their input, so theirs is made once)
    _inverses: dict = field(default_factory=dict, repr=False, compare=False)

    def take_gptq_inverse(self, module: str) -> torch.Tensor | None:
        """GPTQ's factor for `module` (None: round to nearest). Each module's is taken once: the statistics
        are released as soon as the factor exists, so only one [in, in] matrix is alive at a time."""
        if module in self._inverses:
            return self._inverses.pop(module)
        hessian = self.hessians.pop(module, None)
        if hessian is None:
            return None
        hinv = gptq_inverse(hessian, self.damp)
        partner = self.fused.get(module)
        if partner is not None and self.hessians.get(partner) is hessian:
            del self.hessians[partner]
            self._inverses[partner] = hinv
        return hinv


class QuantizedCheckpointWriter:
    """The quantized twin of `ckpt` in `out`, written a decoder layer at a time (`write_layer`, in order)."""

    def __init__(self, ckpt: FloatCheckpoint, precision: str, kv_cache: str | None, exclude: tuple[str, ...],
                 alpha: float | None, out: Path, group_size: int | None = None, quantize_lm_head: bool = False):
        self.ckpt, self.precision, self.kv_cache, self.exclude, self.alpha = ckpt, precision, kv_cache, exclude, alpha
        self.group_size, self.quantize_lm_head = group_size, quantize_lm_head
        self.out = Path(out)
        self._writers: dict[int, SafetensorsWriter] = {}
        self._layer_names: dict[int, dict[int, list[str]]] = {}     # rank -> local layer -> float tensor names
        for rf in ckpt.ranks:
            outer, layers = [], {}
            for name in sorted(rf.file.names()):
                m = LAYER_TENSOR.match(name)
                (layers.setdefault(int(m.group(1)), []) if m else outer).append(name)
            self._layer_names[rf.rank] = layers
            head = [LM_HEAD_WEIGHT] if quantize_lm_head and LM_HEAD_WEIGHT in outer else []
            outer = [name for name in outer if name not in head]
            specs = [spec for name in outer for spec in self._specs(rf, name)]
            specs += [spec for local in sorted(layers) for name in layers[local] for spec in self._specs(rf, name)]
            specs += [spec for local in sorted(layers) for spec in self._kv_specs(local)]
            specs = _in_layer_order(specs) + [spec for name in head for spec in self._int4_specs(rf, name)]
            writer = SafetensorsWriter(self.out / rf.path.name, specs, metadata={"format": "pt"})
            for name in outer:                       # embedding, ln_f (and lm_head unless quantized): copied unchanged
                writer.write([rf.file.rows(name)])
            self._writers[rf.rank] = writer

    def _specs(self, rf: RankFile, name: str) -> list[TensorSpec]:
        shape = rf.file.shape(name)
        module = self.ckpt.linear_of(rf.global_name(name))
        if module is None or is_excluded(module, self.exclude):
            return [TensorSpec(name, rf.file.dtype_code(name), shape)]
        prefix = name[: -len(".weight")]
        one = (1,)
        if self.precision == "fp8":
            return [TensorSpec(name, "F8_E4M3", shape),
                    TensorSpec(prefix + ".weights_scaling_factor", "F32", one),
                    TensorSpec(prefix + ".activation_scaling_factor", "F32", one)]
        if self.precision in INT4_PRECISIONS:
            specs = self._int4_specs(rf, name)
            if self.precision == "w4a8-awq":
                specs += [TensorSpec(prefix + ".activation_scaling_factor", "F32", one),
                          TensorSpec(prefix + ".weights_scaling_factor_2", "F32", one)]
            return specs
        return [TensorSpec(name, "I8", shape),
                TensorSpec(prefix + ".weights_scaling_factor", "F32", (shape[0],)),
                TensorSpec(prefix + ".prequant_scaling_factor", dtype_code(self.ckpt.dtype), (shape[1],)),
                TensorSpec(prefix + ".activation_scaling_factor", "F32", one)]

    def _int4_specs(self, rf: RankFile, name: str) -> list[TensorSpec]:
        """A 4-bit linear's packed codes, group scales and smoothing (the W4A16 tensors)."""
        shape, prefix = rf.file.shape(name), name[: -len(".weight")]
        return [TensorSpec(name, "I8", (shape[0] // 2, shape[1])),
                TensorSpec(prefix + ".weights_scaling_factor", "F32", (shape[0], shape[1] // self.group_size)),
                TensorSpec(prefix + ".prequant_scaling_factor", dtype_code(self.ckpt.dtype), (shape[1],))]

    def _kv_specs(self, local: int) -> list[TensorSpec]:
        if not self.kv_cache:
            return []
        p = f"transformer.layers.{local}.attention."
        return [TensorSpec(p + key + "_scaling_factor", "F32", (1,)) for key in ("k_cache", "v_cache", "kv_cache")]

    def write_layer(self, layer: int, plan: QuantPlan) -> None:
        """Quantize global layer `layer` with `plan` (which covers at least its modules) into its rank files.

        Tensor by tensor, each for every tp rank, so a GPTQ factor is made once per linear and released
        before the next one is made.
        """
        ranks = [rf for rf in self.ckpt.ranks if layer - rf.layer_offset in self._layer_names[rf.rank]]
        for name in self._layer_names[ranks[0].rank][layer - ranks[0].layer_offset]:
            module = self.ckpt.linear_of(ranks[0].global_name(name))
            hinv = None if module is None or is_excluded(module, plan.exclude) else plan.take_gptq_inverse(module)
            for rf in ranks:
                self._write(rf, _quantized_tensors(rf, name, rf.file.read(name), self.ckpt, plan, hinv))
            del hinv
        if plan.kv_cache:
            for rf in ranks:
                self._write(rf, _kv_scales(rf, layer - rf.layer_offset, plan))

    def write_lm_head(self, plan: QuantPlan) -> None:
        """Quantize lm_head (each tp shard of the last pipeline stage) with `plan`, after the last layer."""
        hinv = plan.take_gptq_inverse(LM_HEAD)
        for rf in self.ckpt.head_ranks:
            w, wsf = _rounding_input(plan, LM_HEAD, False, rf.file.read(LM_HEAD_WEIGHT), rf.tp_rank, self.ckpt.tp_size)
            codes = round_weight(w, _per_weight(wsf, plan), int4_codes, hinv)
            self._write(rf, {LM_HEAD_WEIGHT: pack_int4(codes.to(torch.int8)), LM_HEAD + ".weights_scaling_factor": wsf,
                             LM_HEAD + ".prequant_scaling_factor": plan.prequant[LM_HEAD].clone()})

    def _write(self, rf: RankFile, tensors: dict[str, torch.Tensor]) -> None:
        writer = self._writers[rf.rank]
        while writer.pending() in tensors:
            writer.write(tensors.pop(writer.pending()))
        if tensors:
            raise AssertionError(f"{rf.path.name}: tensors out of declared order: {sorted(tensors)[:3]}")

    def close(self) -> dict:
        """Finish every rank file and write config.json; returns the config."""
        for writer in self._writers.values():
            writer.close()
        config = quantized_config(self.ckpt.cfg, self.precision, self.kv_cache, self.exclude, self.alpha,
                                  self.group_size, self.quantize_lm_head)
        config.write(self.out)
        return config.to_dict()


def _in_layer_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Non-layer tensors first, then each layer's tensors (its linears' and its KV scales) together."""
    def key(spec: TensorSpec):
        m = LAYER_TENSOR.match(spec.name)
        return (-1, "") if m is None else (int(m.group(1)), "")
    return sorted(specs, key=key)      # stable: keeps each group's own order


def quantized_config(cfg: CheckpointConfig, precision: str, kv_cache: str | None, exclude: tuple[str, ...],
                     alpha: float | None, group_size: int | None = None,
                     quantize_lm_head: bool = False) -> CheckpointConfig:
    quant = dict(cfg.quantization)
    quant.update(quant_algo=CALIBRATION_QUANT_ALGO[precision],
                 kv_cache_quant_algo=KV_CACHE_QUANT_ALGO[kv_cache] if kv_cache else None,
                 exclude_modules=written_exclude_modules(quantize_lm_head, exclude))
    if precision == "int8-sq":
        quant["smoothquant_val"] = alpha
    if precision in INT4_PRECISIONS:
        quant.update(group_size=group_size, has_zero_point=False, pre_quant_scale=True)
    return cfg.with_quantization(quant)


def _quantized_tensors(rf: RankFile, name: str, tensor: torch.Tensor, ckpt: FloatCheckpoint,
                       plan: QuantPlan, hinv: torch.Tensor | None) -> dict[str, torch.Tensor]:
    module = ckpt.linear_of(rf.global_name(name))
    if module is None or is_excluded(module, plan.exclude):
        return {name: tensor}
    prefix = name[: -len(".weight")]
    row = ckpt.is_row_parallel(module)
    w, wsf = _rounding_input(plan, module, row, tensor, rf.tp_rank, ckpt.tp_size)
    codes = _weight_codes(rf, name, module, w, wsf, ckpt, plan, hinv)
    if plan.precision == "fp8":
        return {name: codes.to(torch.float8_e4m3fn), prefix + ".weights_scaling_factor": wsf,
                prefix + ".activation_scaling_factor": _act_scale(plan, module, E4M3_MAX)}
    if plan.precision in INT4_PRECISIONS:
        out = {name: pack_int4(codes.to(torch.int8)), prefix + ".weights_scaling_factor": wsf,
               prefix + ".prequant_scaling_factor": local_prequant(plan.prequant[module], row, rf.tp_rank,
                                                                   ckpt.tp_size).clone()}
        if plan.precision == "w4a8-awq":
            out[prefix + ".activation_scaling_factor"] = _act_scale(plan, module, E4M3_MAX)
            out[prefix + ".weights_scaling_factor_2"] = _fp8_weight_scale(rf, name, module, ckpt, plan)
        return out
    return {name: codes.to(torch.int8), prefix + ".weights_scaling_factor": wsf,
            prefix + ".prequant_scaling_factor": local_prequant(plan.prequant[module], row, rf.tp_rank,
                                                                ckpt.tp_size).clone(),
            prefix + ".activation_scaling_factor": _act_scale(plan, module, 127.0)}


def _rounding_input(plan: QuantPlan, module: str, row: bool, tensor: torch.Tensor, tp_rank: int,
                    tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight shard as the engine quantizes it (smoothed, for SQ) and its float32 scale: [1] FP8, [out] INT8."""
    w = tensor.float()
    if plan.precision == "fp8":
        amax = max(plan.weight_amax[module], plan.weight_amax.get(plan.fused.get(module), 0.0))
        return w, torch.tensor([max(amax / E4M3_MAX, MIN_SCALE)], dtype=torch.float32)
    smoothed = w / local_prequant(plan.prequant[module], row, tp_rank, tp_size).float()[None, :]
    if plan.precision in INT4_PRECISIONS:
        moments = local_prequant(plan.input_moments[module], row, tp_rank, tp_size)
        return smoothed, group_scales(smoothed, moments, plan.group_size)
    return smoothed, (smoothed.abs().amax(dim=1) / 127.0).clamp(min=MIN_SCALE).to(torch.float32)


def local_name(module: str) -> str:
    """'transformer.layers.3.mlp.fc' -> 'mlp.fc'."""
    return module.split(".", 3)[3]


def _fp8_weight_scale(rf: RankFile, name: str, module: str, ckpt: FloatCheckpoint, plan: QuantPlan) -> torch.Tensor:
    """W4A8's weights_scaling_factor_2: 8/7 of the largest smoothed weight of every rank's share, over 448, and of
    the fused partner's (fc and gate: TensorRT-LLM's PyTorch backend runs them as one GEMM with one such scale)."""
    row = ckpt.is_row_parallel(module)
    layer_prefix = name[: -len(local_name(module) + ".weight")]      # this rank file's transformer.layers.N.
    amax = 0.0
    for linear in filter(None, (module, plan.fused.get(module))):
        tensor = layer_prefix + local_name(linear) + ".weight"
        amax = max([amax] + [float((peer.file.read(tensor).float()
                                    / local_prequant(plan.prequant[linear], row, peer.tp_rank,
                                                     ckpt.tp_size).float()).abs().max())
                             for peer in ckpt.ranks if peer.pp_rank == rf.pp_rank])
    return torch.tensor([max(amax * (INT4_MAX + 1) / INT4_MAX / E4M3_MAX, MIN_SCALE)], dtype=torch.float32)


def _weight_codes(rf: RankFile, name: str, module: str, w: torch.Tensor, wsf: torch.Tensor,
                  ckpt: FloatCheckpoint, plan: QuantPlan, hinv: torch.Tensor | None) -> torch.Tensor:
    """This shard's quantized values. GPTQ rounds a row-parallel weight over its full width, since the
    engine sums the ranks' partial products: every rank rounds the whole weight (with each shard's own
    scales) and keeps its own columns."""
    codes = {"fp8": fp8_codes, "int8-sq": int8_codes}.get(plan.precision, int4_codes)
    row = ckpt.is_row_parallel(module)
    sparse = ckpt.cfg.sparsity is not None and ckpt.cfg.sparsity.covers(module)
    if hinv is None or not row or ckpt.tp_size == 1:
        return round_weight(w, _per_weight(wsf, plan), codes, hinv, w != 0 if sparse else None)
    shards = []
    for peer in (r for r in ckpt.ranks if r.pp_rank == rf.pp_rank):
        if peer is rf:
            shards.append((w, wsf))
        else:
            shards.append(_rounding_input(plan, module, row, peer.file.read(name), peer.tp_rank, ckpt.tp_size))
    full = torch.cat([s[0] for s in shards], dim=1)
    scale = torch.cat([_per_weight(s[1], plan) if plan.group_size else s[1].reshape(-1, 1).expand(-1, s[0].shape[1])
                       for s in shards], dim=1)
    width = w.shape[1]
    return round_weight(full, scale, codes, hinv, full != 0 if sparse else None)[:, rf.tp_rank * width:
                                                                                  (rf.tp_rank + 1) * width]


def _per_weight(scale: torch.Tensor, plan: QuantPlan) -> torch.Tensor:
    """A 4-bit scale [out, in/group] as one per weight [out, in]; other scales as they are."""
    return scale.repeat_interleave(plan.group_size, dim=1) if plan.group_size else scale


def local_prequant(full: torch.Tensor, row: bool, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tp rank's slice of a smoothing vector (row-parallel linears split their input features)."""
    if not row or tp_size == 1:
        return full
    width = full.numel() // tp_size
    return full[tp_rank * width:(tp_rank + 1) * width]


def _act_scale(plan: QuantPlan, module: str, maxbound: float) -> torch.Tensor:
    amax = plan.activation_amax[module]
    return torch.tensor([max(amax / maxbound, MIN_SCALE)], dtype=torch.float32)


def kv_scaling_factors(kv_cache: str, k_amax: float, v_amax: float) -> tuple[float, float, float]:
    if kv_cache == "fp8":
        k, v = (max(a / E4M3_MAX, 1.0) for a in (k_amax, v_amax))
    else:
        k, v = (max(a / 127.0, MIN_SCALE) for a in (k_amax, v_amax))
    return k, v, max(k, v)


def _kv_scales(rf: RankFile, local: int, plan: QuantPlan) -> dict[str, torch.Tensor]:
    """The K, V and KV cache scaling factors of local layer `local` of this rank file."""
    k, v, kv = kv_scaling_factors(plan.kv_cache, *plan.kv_amax[local + rf.layer_offset])
    p = f"transformer.layers.{local}.attention."
    return {p + key + "_scaling_factor": torch.tensor([value], dtype=torch.float32)
            for key, value in (("k_cache", k), ("v_cache", v), ("kv_cache", kv))}
