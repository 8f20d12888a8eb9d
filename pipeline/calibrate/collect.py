"""Statistics, scales and weight rounding of one decoder layer at a time, driven by the layer stream.

`LayerStream` pushes every calibration sample through layer i with the observers `passes(i)` yields,
then releases the layer and calls `finish(i)`. The observer hands over the input of every quantizable
linear and the K / V values that enter the KV cache. `mlp.fc` and `mlp.gate` read the same input, so
only `fc` is recorded and `gate` shares its statistics. For SmoothQuant a first pass records
per-channel maxima and a second pass histograms the smoothed inputs (x * prequant_scaling_factor),
which is what the engine quantizes; the same pass accumulates, for GPTQ, x^T x of the linear inputs.
`finish(i)` picks every amax of the layer, rounds its weights and hands them to the checkpoint writer,
so statistics are only ever held for one layer (x^T x is in^2 floats per input: 0.8 GB for
Llama-3-8B's mlp.proj).

For 4-bit weights (int4-awq, w4a8-awq) the first pass records x^T x of every linear input, from which AWQ's
smoothing search picks each input's prequant_scaling_factor (`int4.awq_smoothing`, with the layer's own weights);
the statistics are then re-expressed for the smoothed input in place (GPTQ rounds against them), and a second pass,
only where an activation or the KV cache is quantized (W4A8, --kv-cache), histograms the smoothed inputs.
With --quantize-lm-head, lm_head is calibrated the same way from the final norm of the last layer's outputs
(`finish_lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..checkpoint import LM_HEAD
from ..runtime.model import rms_norm
from ..runtime.stream import LoadedLayer
from .quantized_checkpoint import (FloatCheckpoint, QuantizedCheckpointWriter, QuantPlan, is_kv, local_name,
                                  weight_statistics)
from ..precisions import INT4_PRECISIONS
from .formats import FP8, INT8
from .histogram import ChannelMax, StreamingHistogram
from .int4 import awq_smoothing, smoothed_hessian
from .report import TensorReport, tensor_report
from .rounding import HessianStats
from .smoothquant import smoothing_factors

@dataclass
class LayerStatistics:
    """What the observers of one layer collected."""

    channel_max: dict[str, ChannelMax] = field(default_factory=dict)
    histograms: dict[str, StreamingHistogram] = field(default_factory=dict)
    hessians: dict[str, HessianStats] = field(default_factory=dict)
    prequant: dict[str, torch.Tensor] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)        # AWQ's chosen exponent per input (4-bit)
    moments: dict[str, torch.Tensor] = field(default_factory=dict)  # E[x^2] per smoothed input channel (4-bit)


class LayerCalibrator:
    """Calibrates `ckpt` layer by layer into `writer`; `reports` and `histograms` collect every tensor's."""

    def __init__(self, ckpt: FloatCheckpoint, options, writer: QuantizedCheckpointWriter,
                 modules: dict[int, list[str]]):
        self.ckpt, self.options, self.writer, self.modules = ckpt, options, writer, modules
        self.reports: list[TensorReport] = []
        self.histograms: dict[str, StreamingHistogram] = {}
        self._layer: LayerStatistics | None = None
        self._weights = None
        self.awq_alphas: dict[str, float] = {}

    def passes(self, loaded: LoadedLayer) -> Iterator:
        """The observers of the layer: channel maxima first for SmoothQuant, then histograms and x^T x."""
        modules = self.modules[loaded.index]
        stats = self._layer = LayerStatistics()
        self._weights = weight_statistics(self.ckpt, set(modules))
        if self.options.precision == "int8-sq":
            yield lambda name, x: self._observe_channel_max(stats, name, x)
            recorded = {k: v.values for k, v in stats.channel_max.items()
                        if self.ckpt.source_of(k) in modules or k in modules}
            stats.prequant = smoothing_factors(recorded, self._weights.column_max, self.options.alpha,
                                               self.ckpt.dtype, self.ckpt.fused_partner)
        if self.options.precision in INT4_PRECISIONS:
            yield from self._int4_passes(loaded, stats, modules)
            return
        gptq = {self.ckpt.source_of(m) for m in modules} if self.options.weight_rounding == "gptq" else set()
        yield lambda name, x: self._observe(stats, gptq, name, x)

    def _int4_passes(self, loaded: LoadedLayer, stats: LayerStatistics, modules: list[str]) -> Iterator:
        """x^T x of every linear input; AWQ's smoothing per input; then histograms of the smoothed inputs if any
        activation or the KV cache is quantized."""
        sources = {self.ckpt.source_of(m) for m in modules}
        yield lambda name, x: self._observe_second_moments(stats, sources, name, x)
        for source, stats_of in stats.hessians.items():
            hessian = stats_of.finish()
            sharing = [m for m in modules if self.ckpt.source_of(m) == source]
            weight = torch.cat([loaded.linear(local_name(m)).weight for m in sharing])
            prequant, alpha = awq_smoothing(weight, hessian, self.options.group_size, self._smoothing_tie(source))
            stats.prequant[source] = prequant.to(self.ckpt.dtype)      # what the checkpoint holds and the engine uses
            stats.alphas[source] = alpha
            stats.moments[source] = torch.diagonal(smoothed_hessian(hessian, stats.prequant[source].float())).clone()
        if self.options.weight_rounding != "gptq":
            stats.hessians.clear()
        if self.options.precision != "int4-awq" or self.options.kv_cache:
            yield lambda name, x: self._observe(stats, set(), name, x)

    def _smoothing_tie(self, source: str) -> tuple[int, int, int] | None:
        """For a layout that folds a linear's smoothing into the rows of the part before it (--format vllm), the
        heads its p must be equal across: o_proj's input under grouped-query attention (`awq_smoothing`)."""
        arch = self.ckpt.cfg.arch
        spec = self.ckpt.family.linear(local_name(source))
        if not (self.options.folds_all_smoothing and spec.input_from and spec.inputs == "q"):
            return None
        kv = arch.num_key_value_heads
        return kv, arch.num_attention_heads // kv, arch.head_size

    def _observe_second_moments(self, stats: LayerStatistics, sources: set[str], name: str, x: torch.Tensor) -> None:
        key = self.ckpt.stats_key(name)
        if key in sources:
            stats.hessians.setdefault(key, HessianStats()).collect(x)

    def _observe_channel_max(self, stats: LayerStatistics, name: str, x: torch.Tensor) -> None:
        key = self.ckpt.stats_key(name)
        if key is not None and not is_kv(key):
            stats.channel_max.setdefault(key, ChannelMax()).collect(x)

    def _observe(self, stats: LayerStatistics, gptq: set[str], name: str, x: torch.Tensor) -> None:
        key = self.ckpt.stats_key(name)
        if key is None:
            return
        if key in stats.prequant:
            x = x * stats.prequant[key]
        stats.histograms.setdefault(key, StreamingHistogram()).collect(x)
        if key in gptq:
            stats.hessians.setdefault(key, HessianStats()).collect(x)

    def finish(self, layer: int) -> None:
        """Pick the layer's amaxes, round its weights and write them; keep only reports and histograms."""
        stats, options, modules = self._layer, self.options, self.modules[layer]
        act_fmt = FP8 if options.precision in ("fp8", "w4a8-awq") else INT8
        kv_fmt = FP8 if options.kv_cache == "fp8" else INT8
        reports = []
        for name, hist in stats.histograms.items():
            if (is_kv(name) and not options.kv_cache) or (not is_kv(name) and options.precision == "int4-awq"):
                continue
            reports.append(tensor_report(name, "kv" if is_kv(name) else "activation", hist,
                                         kv_fmt if is_kv(name) else act_fmt, options.chosen_method,
                                         options.percentile))
        chosen = {t.name: t.chosen_amax for t in reports}
        hessians = {name: h.finish() for name, h in stats.hessians.items()}
        prefix = f"transformer.layers.{layer}.attention."
        source = {m: self.ckpt.source_of(m) for m in modules}
        plan = QuantPlan(
            precision=options.precision, kv_cache=options.kv_cache,
            activation_amax={m: chosen[source[m]] for m in modules if source[m] in chosen},
            weight_amax=self._weights.amax,
            prequant={m: stats.prequant[source[m]] for m in modules if source[m] in stats.prequant},
            kv_amax={layer: (chosen[prefix + "k"], chosen[prefix + "v"])} if options.kv_cache else {},
            exclude=options.exclude, alpha=options.alpha if options.precision == "int8-sq" else None,
            hessians={m: hessians[source[m]] for m in modules if source[m] in hessians},
            damp=options.damp, fused={m: p for m in modules if (p := self.ckpt.fused_partner(m))},
            group_size=options.group_size if options.precision in INT4_PRECISIONS else None,
            input_moments={m: stats.moments[source[m]] for m in modules if source[m] in stats.moments})
        self.awq_alphas.update(stats.alphas)
        stats.hessians.clear()           # the plan holds the only reference: the writer releases each in turn
        del hessians
        self.writer.write_layer(layer, plan)
        self.reports += reports
        self.histograms.update(stats.histograms)
        self._layer = self._weights = None

    def finish_lm_head(self, hidden: list[torch.Tensor], final_norm: torch.Tensor) -> None:
        """Quantize lm_head as the decoder's linears (`calibrate --quantize-lm-head`): x^T x of its input, the final
        norm of every sample's last hidden states, then AWQ's smoothing, the group scales and GPTQ."""
        stats = HessianStats()
        for h in hidden:
            stats.collect(rms_norm(h, final_norm.to(h.device), self.ckpt.cfg.arch.norm_epsilon))
        hessian = stats.finish()
        prequant, alpha = awq_smoothing(self.ckpt.lm_head_weight(), hessian, self.options.group_size)
        prequant = prequant.to(self.ckpt.dtype)
        moments = torch.diagonal(smoothed_hessian(hessian, prequant.float())).clone()
        gptq = self.options.weight_rounding == "gptq"
        self.writer.write_lm_head(QuantPlan(
            precision=self.options.precision, kv_cache=None, activation_amax={}, weight_amax={},
            prequant={LM_HEAD: prequant}, kv_amax={}, exclude=(), hessians={LM_HEAD: hessian} if gptq else {},
            damp=self.options.damp, group_size=self.options.group_size, input_moments={LM_HEAD: moments}))
        self.awq_alphas[LM_HEAD] = alpha

    def close(self) -> dict:
        """Finish the checkpoint (config.json); returns its config."""
        return self.writer.close()
