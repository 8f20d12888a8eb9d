"""`trtpipe export-onnx`: a TensorRT-LLM checkpoint (any tp/pp layout, merged) -> model.onnx + genai_config.json.

The output directory holds `model.onnx` (weights inline, or in `model.onnx.data` beside it when they
exceed protobuf's 2 GB limit), `genai_config.json` (the inputs and outputs in onnxruntime-genai's
vocabulary, the dynamic axes, the precision) and the stage manifest. Every export passes
`onnx.checker.check_model(full_check=True)` (which includes strict shape inference) before it is
renamed into place; a failed check leaves nothing behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper

from ..checkpoint import CheckpointConfig
from ..errors import UserError
from ..outputs import fingerprint_inputs, stage_output
from ..runtime.trtllm_reader import CheckpointReader
from . import CONFIG_FILE, DATA_FILE, MODEL_FILE, in_place_fits
from .graph import (
    BATCH, CACHE, CONTRIB_DOMAIN, PAST, SEQ, TOTAL, GraphBuilder, decoder_layer, finish_graph, start_graph,
)
from .quantize import QuantizedHead, quantized_head, quantized_weights

PRECISIONS = ("auto", "fp32", "fp16", "int8-sq", "fp8", "int4-awq")
#: the checkpoint quantization each precision exports
QUANT_OF = {"fp32": None, "fp16": None, "int8-sq": "W8A8_SQ_PER_CHANNEL", "fp8": "FP8", "int4-awq": "W4A16_AWQ"}
#: MatMulNBits' accuracy_level values: 0 computes in float32, 4 quantizes each input block to int8 (int8 compute)
INT4_ACCURACY_LEVELS = (0, 1, 2, 3, 4)
#: the accuracy_level the cpu target serves int4-awq with: int8 compute. Measured (benchmarks/bench_matmulnbits.py,
#: 2-core EPYC, onnxruntime 1.32.0, SmolLM2's linears): 2.2-2.7x faster than level 0 at one token, 2.1-2.4x at 8;
#: 2.0-2.3x and 1.1-1.3x faster than a float32 MatMul; held-out perplexity 36.324 -> 36.400 (+0.21%; the 4 bits cost
#: +12%)
SERVING_INT4_ACCURACY = 4
DEFAULT_OPSET, MIN_OPSET = 21, 19     # float8e4m3fn Q/DQ (and the opset-18 ReduceMean axes input) need 19
PROTOBUF_LIMIT = 2 << 30


@dataclass(frozen=True)
class ExportOptions:
    precision: str = "auto"
    opset: int = DEFAULT_OPSET
    int4_accuracy: int = 0          # MatMulNBits' accuracy_level for int4-awq
    in_place_kv: bool = False       # the rows' cache a buffer GroupQueryAttention writes in place (ONNX Runtime's)
    force: bool = False
    external_data_over: int = PROTOBUF_LIMIT     # weights above this many bytes go to model.onnx.data


def serving_options(checkpoint: Path) -> ExportOptions:
    """The export the cpu target serves: int8-compute 4-bit linears, and the cache written in place wherever the
    model allows it (`in_place_fits`). Measured (benchmarks/bench_onnx_step.py --in-place, 2-core EPYC,
    SmolLM2 int4-awq-head, 87 cached tokens): a decode step at one row 1.43x faster than the concat cache's, at 8
    rows 1.13x; the in-process serving loop's token gap at concurrency 1 15.4 -> 11.6 ms."""
    return ExportOptions(int4_accuracy=SERVING_INT4_ACCURACY,
                         in_place_kv=in_place_fits(CheckpointConfig.read(Path(checkpoint)).arch))


@dataclass(frozen=True)
class ExportResult:
    path: Path
    precision: str
    opset: int
    external_data: bool
    skipped: bool = False

    def to_dict(self) -> dict:
        return {"path": str(self.path), "precision": self.precision, "opset": self.opset,
                "external_data": self.external_data, "skipped": self.skipped}


def resolve_precision(cfg: CheckpointConfig, precision: str, where: Path) -> str:
    """The export precision: `auto` follows the checkpoint; a quantized one must be what the checkpoint holds."""
    found = {None: "fp32", **{algo: name for name, algo in QUANT_OF.items() if algo}}.get(cfg.quant_algo)
    if found is None:
        raise UserError(f"{where} is quantized as {cfg.quant_algo}, which export-onnx does not write (it exports "
                        "float, FP8, INT8-SmoothQuant and W4A16_AWQ checkpoints; W4A8_AWQ's FP8 activations have no "
                        "4-bit ONNX Runtime kernel); export the float checkpoint it came from")
    if precision == "auto":
        return found
    if QUANT_OF[precision] != cfg.quant_algo:
        held = f"is quantized as {cfg.quant_algo}" if cfg.quant_algo else "is not quantized"
        fix = (f"run `trtpipe calibrate {where} -o OUT --precision {precision}` first and export OUT"
               if QUANT_OF[precision] else "export it with --precision auto")
        raise UserError(f"--precision {precision}: checkpoint {where} {held}; {fix}")
    return precision


def check_opset(opset: int) -> None:
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise UserError(f"--opset {opset} is not supported: use {MIN_OPSET}..{newest} (default {DEFAULT_OPSET})")


def build_model(reader: CheckpointReader, precision: str, opset: int, int4_accuracy: int = 0,
                in_place_kv: bool = False) -> onnx.ModelProto:
    cfg = reader.cfg
    g = GraphBuilder(weight_dtype=TensorProto.FLOAT16 if precision == "fp16" else TensorProto.FLOAT,
                     int4_accuracy=int4_accuracy, in_place=in_place_kv,
                     rotary_attention=in_place_kv and rotates_in_attention(reader))
    h, shared = start_graph(g, cfg, reader.embedding())
    for i in range(reader.num_layers):
        layer = reader.layer(i)
        quantized = quantized_weights(reader, i, layer.linears) if cfg.quant_algo else {}
        h = decoder_layer(g, cfg, i, layer, quantized, h, shared)
    graph = finish_graph(g, cfg, h, reader.final_norm(), export_head(reader), shared)
    domains = [helper.make_opsetid("", opset)]
    if any(node.domain == CONTRIB_DOMAIN for node in graph.node):
        domains.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=domains, producer_name="trtpipe", ir_version=min(onnx.IR_VERSION, 10))


def rotates_in_attention(reader: CheckpointReader) -> bool:
    """Whether GroupQueryAttention can rotate q and k itself: not where the cache's Q/DQ must follow the rope, nor
    where q and k are normalized first (Qwen3: the CPU kernel refuses its q_norm/k_norm inputs), and its CPU kernel
    rotates only head sizes that are multiples of 16 (contrib_ops/cpu/bert/group_query_attention_helper.h)."""
    cfg = reader.cfg
    return (cfg.kv_cache_quant_algo is None and cfg.arch.head_size % 16 == 0
            and "attention.q_layernorm" not in reader.layer(0).norms)


def export_head(reader: CheckpointReader) -> torch.Tensor | QuantizedHead | None:
    """lm_head as the graph computes it: None when tied to the embedding, 4 bits when the checkpoint holds it so."""
    if reader.cfg.quantized_lm_head:
        return quantized_head(reader)
    return None if reader.tied_lm_head else reader.lm_head()


def save_model(model: onnx.ModelProto, directory: Path, external_data_over: int) -> bool:
    """Write model.onnx (weights beside it in model.onnx.data when over the limit), check it; True if external."""
    external = model.ByteSize() > external_data_over
    path = directory / MODEL_FILE
    onnx.save_model(model, path, save_as_external_data=external, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)
    onnx.checker.check_model(str(path), full_check=True)
    return external


def genai_config(cfg: CheckpointConfig, precision: str, opset: int, in_place_kv: bool = False) -> dict:
    """The decoder's description in onnxruntime-genai's genai_config.json vocabulary. `trtpipe.kv_cache` says how
    the rows' cache is fed: `concat` (past [batch, kv_heads, past, head_size] left-padded, present = past + the new
    tokens) or `in-place` (past and present one buffer [batch, kv_heads, cache_length, head_size], each row's tokens
    first, attention_mask [batch, total] ones over each row's tokens after this step)."""
    arch = cfg.arch
    return {"model": {
        "type": cfg.family.name, "vocab_size": arch.vocab_size, "context_length": arch.max_position_embeddings,
        "decoder": {
            "filename": MODEL_FILE, "head_size": arch.head_size, "hidden_size": arch.hidden_size,
            "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads,
            "num_hidden_layers": arch.num_hidden_layers,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                       "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value"},
            "dynamic_axes": {"batch": BATCH, "sequence": SEQ, "total": TOTAL,
                             **({"cache": CACHE} if in_place_kv else {"past": PAST})},
        }},
        "trtpipe": {"precision": precision, "opset": opset, "kv_cache_quant": cfg.kv_cache_quant_algo,
                    "cache_dtype": "float32", "kv_layout": "[batch, kv_heads, sequence, head_size]",
                    "kv_cache": "in-place" if in_place_kv else "concat"}}


def export_onnx(checkpoint: Path, out: Path, options: ExportOptions = ExportOptions()) -> ExportResult:
    checkpoint = Path(checkpoint)
    check_opset(options.opset)
    reader = CheckpointReader(checkpoint)
    precision = resolve_precision(reader.cfg, options.precision, checkpoint)
    if options.int4_accuracy not in INT4_ACCURACY_LEVELS:
        raise UserError(f"--int4-accuracy must be one of {', '.join(map(str, INT4_ACCURACY_LEVELS))} (MatMulNBits' "
                        f"accuracy_level; got {options.int4_accuracy})")
    if options.in_place_kv and not in_place_fits(reader.cfg.arch):
        raise UserError(f"{checkpoint}: --in-place-kv needs GroupQueryAttention, which ONNX Runtime's CPU kernel runs "
                        f"for head sizes that are multiples of 8 (this model's: {reader.cfg.arch.head_size}) and which "
                        "is not written here for sliding-window attention (the meaning of its local_window_size "
                        "changed between ONNX Runtime versions); export it without --in-place-kv")
    params = {"precision": precision, "opset": options.opset,
              **({"int4_accuracy": options.int4_accuracy} if precision == "int4-awq" else {}),
              **({"in_place_kv": True} if options.in_place_kv else {})}
    with stage_output(out, "export-onnx", fingerprint_inputs([checkpoint]), params, force=options.force) as output:
        if output.up_to_date:
            return ExportResult(Path(out), precision, options.opset, (Path(out) / DATA_FILE).exists(), skipped=True)
        model = build_model(reader, precision, options.opset, options.int4_accuracy, options.in_place_kv)
        external = save_model(model, output.dir, options.external_data_over)
        (output.dir / CONFIG_FILE).write_text(json.dumps(genai_config(reader.cfg, precision, options.opset,
                                                                      options.in_place_kv), indent=2))
        output.extra["external_data"] = external
    return ExportResult(Path(out), precision, options.opset, external)
