"""The calibrate stage: float checkpoint + calibration data -> FP8 / INT8-SQ / 4-bit (AWQ) checkpoint + report.

Everything that can be wrong with the input (checkpoint, dataset, field, lengths, options) is checked
before any output exists; the output directory appears only when complete (atomic rename).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path


from .. import __version__
from ..errors import UserError
from ..precisions import (CALIBRATION_FORMATS, CALIBRATION_QUANT_ALGO, INT4_GROUP_SIZES, INT4_PRECISIONS,
                          W4A8_ENGINE_GROUP_SIZE, VLLM_FORMAT_PRECISIONS)
from ..outputs import fingerprint_inputs, stage_output
from ..runtime.hf_checkpoint import read_hf_quantization
from .amax import DEFAULT_PERCENTILE, METHODS
from ..checkpoint import LM_HEAD, LM_HEAD_WEIGHT, is_excluded, source_model
from .quantized_checkpoint import FloatCheckpoint, QuantizedCheckpointWriter, open_float_checkpoint
from .collect import LayerCalibrator
from .int4 import default_group_size, group_size_problem
from .hf_export import write_hf_checkpoint
from .vllm_export import split_fused_group, write_vllm_checkpoint
from .data import OFFLINE_CORPUS, CalibrationRecipe, load_texts, load_tokenizer, tokenize_samples
from .rounding import DEFAULT_DAMP, ROUNDINGS
from .report import TensorReport, most_sensitive, plot_histograms, write_report_json
from .trtcache import write_calibration_cache

STAGE = "calibrate"
PRECISIONS = tuple(CALIBRATION_QUANT_ALGO)
#: Chosen by measurement on SmolLM2-135M (docs/calibrate.md, "Defaults (measured)"); 4-bit: W4A8's FP8 inputs as FP8's
DEFAULT_METHOD = {"fp8": "max", "int8-sq": "max", "int4-awq": "max", "w4a8-awq": "max"}
#: SmoothQuant alpha, measured on SmolLM2 (docs/calibrate.md; nearest rounding, 32 x 256 calibration):
#: perplexity 0.5 +32.9%, 0.7 +6.0%, 0.8 +4.3%, 0.9 +4.5%
DEFAULT_ALPHA = 0.8
DEFAULT_ROUNDING = "gptq"
#: the one precision whose lm_head calibrate quantizes (--quantize-lm-head)
LM_HEAD_PRECISION = "int4-awq"
EVAL_WINDOW = 512
REPORT_DIR = "calibration"
#: where --format both puts the Hugging Face checkpoint inside the calibrated checkpoint's directory
HF_DIR = "hf"
#: with --format hf, where the TensorRT-LLM checkpoint the export is made from lives until the export is written
TRTLLM_SCRATCH = ".trtllm-checkpoint"


@dataclass(frozen=True)
class CalibrateOptions:
    precision: str
    recipe: CalibrationRecipe
    kv_cache: str | None = None
    method: str | None = None
    alpha: float = DEFAULT_ALPHA
    percentile: float = DEFAULT_PERCENTILE
    exclude: tuple[str, ...] = ()
    weight_rounding: str = DEFAULT_ROUNDING
    damp: float = DEFAULT_DAMP
    eval_samples: int = 40
    device: str = "auto"
    format: str = "trtllm"        # CALIBRATION_FORMATS: both adds OUT/hf; hf and vllm write that checkpoint alone
    group_size: int | None = None  # 4-bit: inputs per weight scale (None: the first of INT4_GROUP_SIZES that fits)
    quantize_lm_head: bool = False  # int4-awq: lm_head in 4 bits too (modelopt and TensorRT-LLM keep it 16-bit)
    force: bool = False
    progress: bool = True

    @property
    def hf_export(self) -> bool:
        """A Hugging Face FP8 checkpoint (modelopt's layout) is written: OUT/hf (both) or OUT itself (hf)."""
        return self.format in ("both", "hf")

    @property
    def folds_all_smoothing(self) -> bool:
        """The output layout has no pre_quant_scale (vLLM's AWQ): every smoothing goes into the tensors before."""
        return self.format == "vllm"

    @property
    def scratch_checkpoint(self) -> bool:
        """The TensorRT-LLM checkpoint is only the source of the checkpoint written as OUT."""
        return self.format in ("hf", "vllm")

    @property
    def chosen_method(self) -> str:
        return self.method or DEFAULT_METHOD[self.precision]

    def params(self) -> dict:
        return {"precision": self.precision, "kv_cache": self.kv_cache, "method": self.chosen_method,
                "alpha": self.alpha if self.precision == "int8-sq" else None, "percentile": self.percentile,
                "exclude": list(self.exclude), "weight_rounding": self.weight_rounding,
                "damp": self.damp if self.weight_rounding == "gptq" else None, "eval_samples": self.eval_samples,
                "recipe": self.recipe.to_dict(), "format": self.format,
                **({"group_size": self.group_size} if self.precision in INT4_PRECISIONS else {}),
                **({"quantize_lm_head": True} if self.quantize_lm_head else {})}


@dataclass(frozen=True)
class CalibrationResult:
    path: Path
    config: dict
    method: str
    tensors: list[TensorReport]
    perplexity: dict | None          # {"float": .., "quantized": .., "ratio": .., "tokens": ..}
    samples: int
    tokens: int
    seconds: float
    skipped: bool = False
    warnings: tuple[str, ...] = ()
    sparsity: dict | None = None     # the input's 2:4 claim, carried to the output and held by every code
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"checkpoint": str(self.path), "skipped": self.skipped, "method": self.method,
                "warnings": list(self.warnings), "notes": list(self.notes), "sparsity": self.sparsity,
                "quantization": self.config.get("quantization"), "samples": self.samples,
                "tokens": self.tokens, "seconds": round(self.seconds, 2), "perplexity": self.perplexity,
                "report": str(self.path / REPORT_DIR / "report.json")}

    def summary(self) -> str:
        if self.skipped:
            return f"calibrated checkpoint {self.path} is up to date (inputs unchanged); nothing to do"
        from rich.console import Console
        from rich.table import Table

        q = self.config["quantization"]
        table = Table(title=f"{q['quant_algo']} (KV {q.get('kv_cache_quant_algo') or 'model dtype'}), "
                            f"method {self.method}: {self.samples} samples, {self.tokens} tokens, {self.seconds:.0f} s")
        for col in ("tensor", "amax", "max", "saturated", "SNR dB"):
            table.add_column(col, justify="left" if col == "tensor" else "right")
        for t in most_sensitive(self.tensors):
            table.add_row(t.name, f"{t.chosen_amax:.4g}", f"{t.running_max:.4g}", f"{t.saturation:.1e}",
                          f"{t.snr_db:.1f}")
        console = Console(record=True, width=110, file=io.StringIO())
        if self.tensors:
            console.print(table)
        else:
            console.print(f"{q['quant_algo']} (group size {q.get('group_size')}, KV model dtype): {self.samples} "
                          f"samples, {self.tokens} tokens, {self.seconds:.0f} s; no activation is quantized")
        if self.perplexity:
            p = self.perplexity
            console.print(f"held-out perplexity: float {p['float']:.3f}, quantized {p['quantized']:.3f} "
                          f"({(p['ratio'] - 1) * 100:+.2f}%) over {p['tokens']} tokens")
        if self.sparsity:
            s = self.sparsity
            console.print(f"{s['pattern']} sparsity ({s['method']}) kept: every pruned weight of the "
                          f"{len(s['modules'])} claimed linears is a zero code (checked when the output was read back)")
        for note in self.notes:
            console.print(f"note: {note}")
        for warning in self.warnings:
            console.print(f"warning: {warning}")
        console.print(f"wrote {self.path} (report: {self.path / REPORT_DIR})")
        return console.export_text().rstrip()


def calibrate_checkpoint(checkpoint: Path, out: Path, options: CalibrateOptions) -> CalibrationResult:
    started = time.monotonic()
    checkpoint, out = Path(checkpoint), Path(out)
    ckpt = open_float_checkpoint(checkpoint)
    check_options(ckpt, options)
    options, notes = resolve_group_size(ckpt, options)
    claim = ckpt.cfg.sparsity
    sparsity = None if claim is None else claim.to_dict()
    inputs = fingerprint_inputs([checkpoint] + dataset_inputs(options.recipe))
    with stage_output(out, STAGE, inputs, options.params(), force=options.force,
                      extra={"source_checkpoint": str(checkpoint.resolve()),
                             "source_model": source_model(checkpoint)}) as output:
        if output.up_to_date:
            config = written_config(out)
            return CalibrationResult(out, config, options.chosen_method, [], None, 0, 0, 0.0, skipped=True)

        from ..runtime import LayerStream, perplexity, resolve_device
        from ..runtime.trtllm_reader import CheckpointReader

        device = resolve_device(options.device)
        tokenizer = load_tokenizer(checkpoint)
        samples = tokenize_samples(load_texts(options.recipe), tokenizer, options.recipe)
        heldout = heldout_sequences(tokenizer, options.eval_samples)
        stream = LayerStream(checkpoint, device)
        float_ppl = perplexity(stream, heldout, window=EVAL_WINDOW, progress=options.progress,
                               desc="perplexity (float)") if heldout else None

        tmp = output.dir
        # --format hf|vllm: the TensorRT-LLM checkpoint is only the export's source, written beside it and removed
        trtllm = tmp / TRTLLM_SCRATCH if options.scratch_checkpoint else tmp
        trtllm.mkdir(exist_ok=True)
        writer = QuantizedCheckpointWriter(ckpt, options.precision, options.kv_cache, options.exclude,
                                           options.alpha if options.precision == "int8-sq" else None, trtllm,
                                           options.group_size, options.quantize_lm_head)
        calibrator = LayerCalibrator(ckpt, options, writer, quantized_modules(ckpt, options.exclude))
        hidden = stream.run_layers(samples, passes=calibrator.passes, after_layer=calibrator.finish,
                                   desc="calibration" if options.progress else None)
        if options.quantize_lm_head:
            calibrator.finish_lm_head(hidden, stream.reader.final_norm())
        del hidden
        config = calibrator.close()
        shutil.copytree(checkpoint / "tokenizer", trtllm / "tokenizer")
        if options.format == "both":
            write_hf_checkpoint(checkpoint, tmp, tmp / HF_DIR)
        elif options.format == "hf":
            write_hf_checkpoint(checkpoint, trtllm, tmp)
        elif options.format == "vllm":
            write_vllm_checkpoint(checkpoint, trtllm, tmp)
        if options.scratch_checkpoint:
            shutil.rmtree(trtllm)
        ppl = None
        if float_ppl is not None:
            quant_ppl = perplexity(LayerStream(tmp, device), heldout, window=EVAL_WINDOW,
                                   progress=options.progress, desc="perplexity (quantized)")
            ppl = {"float": float_ppl.perplexity, "quantized": quant_ppl.perplexity,
                   "ratio": quant_ppl.perplexity / float_ppl.perplexity, "tokens": quant_ppl.tokens}
        elif claim is not None and not options.scratch_checkpoint:
            CheckpointReader(tmp).check_every_layer()
        tokens = sum(len(s) for s in samples)
        write_reports(tmp / REPORT_DIR, options, calibrator.reports, calibrator.histograms, ppl, len(samples), tokens,
                      sparsity, calibrator.awq_alphas)
        seconds = time.monotonic() - started
        output.extra["seconds"] = round(seconds, 2)
    return CalibrationResult(out, config, options.chosen_method, calibrator.reports, ppl, len(samples), tokens,
                             seconds, warnings=few_tokens_warning(len(samples), tokens), sparsity=sparsity,
                             notes=notes)


def resolve_group_size(ckpt: FloatCheckpoint, options: CalibrateOptions) -> tuple[CalibrateOptions, tuple[str, ...]]:
    """A 4-bit calibration's group size, checked against every quantized input width (per tp rank): the one asked
    for, or the default with a note when it is not INT4_GROUP_SIZES' first. Other precisions take none."""
    if options.precision not in INT4_PRECISIONS:
        if options.group_size is not None:
            raise UserError(f"--group-size is for the 4-bit precisions ({', '.join(INT4_PRECISIONS)}); "
                            f"{options.precision} has no weight groups")
        return options, ()
    widths = quantized_input_widths(ckpt, options.exclude)
    if options.quantize_lm_head:
        widths[LM_HEAD] = ckpt.cfg.arch.hidden_size
    if options.group_size is None:
        size, note = default_group_size(widths)
        options, notes = replace(options, group_size=size), (note,) if note else ()
    else:
        if options.group_size not in INT4_GROUP_SIZES:
            raise UserError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, the group sizes "
                            f"TensorRT-LLM's groupwise int4 kernels take (got {options.group_size})")
        problem = group_size_problem(widths, options.group_size)
        if problem:
            raise UserError(f"--group-size {options.group_size}: {problem}")
        notes = ()
    if options.precision == "w4a8-awq" and options.group_size != W4A8_ENGINE_GROUP_SIZE:
        notes += (f"w4a8-awq at group {options.group_size}: TensorRT-LLM's W4A8 GEMM takes group "
                  f"{W4A8_ENGINE_GROUP_SIZE} only, so this checkpoint runs in trtpipe's runtime (eval, compare) "
                  f"but not in a TensorRT-LLM engine (docs/int4.md)",)
    return options, notes


def _layer_order(name: str) -> tuple:
    """transformer.layers.2.* before transformer.layers.10.*"""
    parts = name.split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts[:3]), name


def quantized_input_widths(ckpt: FloatCheckpoint, exclude: tuple[str, ...]) -> dict[str, int]:
    """Each quantized linear's input width as one tp rank holds it (a row-parallel linear's share), by global name."""
    widths = {}
    for rf in ckpt.ranks:
        for name in sorted(rf.file.names(), key=_layer_order):
            module = ckpt.linear_of(rf.global_name(name))
            if module is not None and not is_excluded(module, exclude):
                widths[module] = rf.file.shape(name)[1]
    return widths


#: fewer calibration tokens than this and the activation ranges rest on a handful of values
MIN_CALIBRATION_TOKENS = 256


def few_tokens_warning(samples: int, tokens: int) -> tuple[str, ...]:
    """Issue 25: a dataset of 1-2-token lines calibrated on 4 tokens without a word."""
    if tokens >= MIN_CALIBRATION_TOKENS:
        return ()
    return (f"calibrated on {tokens} tokens ({samples} samples): the activation ranges rest on too few values to "
            f"be trusted (at least {MIN_CALIBRATION_TOKENS} recommended); use longer texts or more --samples",)


def check_options(ckpt: FloatCheckpoint, options: CalibrateOptions) -> None:
    if options.precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)} (got {options.precision!r})")
    if options.method is not None and options.method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)} (got {options.method!r})")
    if not 0.0 <= options.alpha <= 1.0:
        raise UserError(f"--alpha must be between 0 and 1 (got {options.alpha})")
    if options.weight_rounding not in ROUNDINGS:
        raise UserError(f"--weight-rounding must be one of {', '.join(ROUNDINGS)} (got {options.weight_rounding!r})")
    if not options.damp > 0.0:
        raise UserError(f"--damp must be positive (got {options.damp})")
    if not 0.0 < options.percentile <= 100.0:
        raise UserError(f"--percentile must be in (0, 100] (got {options.percentile})")
    context = ckpt.cfg.arch.max_position_embeddings
    if context and options.recipe.seq_len > context:
        raise UserError(f"--seq-len {options.recipe.seq_len} is longer than the model's context "
                        f"(max_position_embeddings={context}); use at most {context}")
    if options.kv_cache:
        plain = [f"transformer.layers.{i}.attention.qkv" for i in range(ckpt.num_layers)
                 if is_excluded(f"transformer.layers.{i}.attention.qkv", options.exclude)]
        if plain:
            raise UserError(f"--kv-cache {options.kv_cache} needs a quantized attention path, but --exclude "
                            f"leaves {len(plain)} attention layer(s) unquantized (e.g. {plain[0]}); "
                            "drop --kv-cache or the exclusion")
    if options.quantize_lm_head:
        check_lm_head_option(ckpt, options)
    if options.format not in CALIBRATION_FORMATS:
        raise UserError(f"--format must be one of {', '.join(CALIBRATION_FORMATS)} (got {options.format!r})")
    hf_precisions = ("fp8", *INT4_PRECISIONS)
    if options.hf_export and (options.precision not in hf_precisions or options.kv_cache not in (None, "fp8")):
        raise UserError(f"--format {options.format} writes modelopt's Hugging Face layout, which trtpipe writes for "
                        f"--precision {', '.join(hf_precisions)} with an fp8 or no --kv-cache (got "
                        f"{options.precision}, KV {options.kv_cache or 'none'})")
    if options.format == "vllm" and (options.precision not in VLLM_FORMAT_PRECISIONS or options.kv_cache):
        raise UserError(f"--format vllm writes AutoAWQ's checkpoint, which vLLM reads for "
                        f"--precision {', '.join(VLLM_FORMAT_PRECISIONS)} (4-bit weights, 16-bit activations) with "
                        f"no --kv-cache (it holds no activation or KV-cache scales); got {options.precision}, KV "
                        f"{options.kv_cache or 'none'}")
    if options.format == "vllm":
        split = split_fused_group(ckpt.family, ckpt.num_layers, lambda module: is_excluded(module, options.exclude))
        if split:
            raise UserError(split)


def check_lm_head_precision(precision: str) -> None:
    """--quantize-lm-head's precision (calibrate's check, and build's before any work)."""
    if precision != LM_HEAD_PRECISION:
        raise UserError(f"--quantize-lm-head is for --precision {LM_HEAD_PRECISION} (4-bit weights, 16-bit "
                        f"activations); got {precision}")


def check_lm_head_option(ckpt: FloatCheckpoint, options: CalibrateOptions) -> None:
    """--quantize-lm-head: W4A16 only, into TensorRT-LLM's checkpoint layout, from a checkpoint with an lm_head."""
    check_lm_head_precision(options.precision)
    if is_excluded(LM_HEAD, options.exclude):
        raise UserError(f"--quantize-lm-head contradicts --exclude {' '.join(options.exclude)}, which matches "
                        f"{LM_HEAD}: drop one of them")
    if options.format != "trtllm":
        raise UserError(f"--quantize-lm-head writes TensorRT-LLM's checkpoint only: --format {options.format} "
                        "writes a Hugging Face checkpoint, whose servers (vLLM's AWQ, TensorRT-LLM's PyTorch backend) "
                        "read lm_head in 16 bits; drop --format or --quantize-lm-head")
    if any(LM_HEAD_WEIGHT not in rf.file.names() for rf in ckpt.head_ranks):
        raise UserError(f"{ckpt.path} has no {LM_HEAD_WEIGHT} (its embedding table is shared): --quantize-lm-head "
                        "needs an lm_head of its own, which `trtpipe convert` writes")
    rows = ckpt.head_ranks[0].file.shape(LM_HEAD_WEIGHT)[0]
    if rows % 2:
        raise UserError(f"--quantize-lm-head: lm_head has {rows} rows per tp rank (vocabulary "
                        f"{ckpt.cfg.arch.vocab_size}, padded to a multiple of tp {ckpt.tp_size}), an odd count, and "
                        "4-bit codes are packed two rows to a byte; this model's lm_head stays 16-bit")


def written_config(out: Path) -> dict:
    """The calibrated checkpoint's config as `calibrate` returns it: the TensorRT-LLM config.json, or for a
    Hugging Face checkpoint (--format hf|vllm) its config with its quantization as the runtime reads it."""
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        config["quantization"] = read_hf_quantization(out, config).to_dict()
    return config


def dataset_inputs(recipe: CalibrationRecipe) -> list[Path]:
    if recipe.dataset == OFFLINE_CORPUS:
        from ..assets import calibration_corpus_path
        return [calibration_corpus_path()]
    path = Path(recipe.dataset)
    return [path] if path.is_file() else []


def heldout_sequences(tokenizer, count: int) -> list[list[int]]:
    """The first `count` held-out documents of the offline corpus, each cut to 512 tokens."""
    if count <= 0:
        return []
    from ..evaluate import corpus_split

    texts = [t for t in corpus_split(seed=0)[1] if t.strip()][:count]
    seqs = [tokenizer(t)["input_ids"][:EVAL_WINDOW] for t in texts]   # as `trtpipe eval` tokenizes
    return [s for s in seqs if len(s) >= 2]


def quantized_modules(ckpt: FloatCheckpoint, exclude: tuple[str, ...]) -> dict[int, list[str]]:
    """The quantized linears of each layer (global names)."""
    return {i: ckpt.layer_modules(i, exclude) for i in range(ckpt.num_layers)}


def write_reports(directory: Path, options: CalibrateOptions, tensors: list[TensorReport],
                  histograms: dict, ppl: dict | None, samples: int, tokens: int, sparsity: dict | None,
                  awq_alphas: dict[str, float]) -> None:
    directory.mkdir()
    header = {"tool_version": __version__, "precision": options.precision, "kv_cache": options.kv_cache,
              "method": options.chosen_method, "default_method": DEFAULT_METHOD[options.precision],
              "alpha": options.alpha if options.precision == "int8-sq" else None, "percentile": options.percentile,
              "weight_rounding": options.weight_rounding,
              "damp": options.damp if options.weight_rounding == "gptq" else None, "recipe": options.recipe.to_dict(),
              "samples": samples, "tokens": tokens, "perplexity": ppl,
              "sparsity": None if sparsity is None else {**sparsity, "kept": "every pruned weight is a zero code"},
              **({"group_size": options.group_size, "awq_alpha": awq_alphas}
                 if options.precision in INT4_PRECISIONS else {})}
    write_report_json(directory / "report.json", header, tensors)
    write_calibration_cache(directory / "calibration.cache",
                            {t.name: t.chosen_amax for t in tensors if t.kind == "activation"})
    sensitive = most_sensitive([t for t in tensors if t.kind == "activation"])
    plot_histograms(directory / "report.png", sensitive, histograms,
                    f"{options.precision}: the {len(sensitive)} activations with the lowest quantization SNR")
