"""The classic TensorRT build of an exported decoder: the `trtexec` command line from the plan (unverified here).

trtexec flags (NVIDIA/TensorRT samples/common/sampleOptions.cpp, v10.x; docs/onnx.md): `--onnx`,
`--saveEngine`, `--minShapes/--optShapes/--maxShapes=name:AxB,...` (all three or only opt), `--fp16`,
`--int8`, `--fp8`. Every export is built with `--fp16` (TensorRT may pick half-precision kernels where the
graph does not say otherwise); the Q/DQ exports add `--int8` or `--fp8` so the quantized regions their
QuantizeLinear/DequantizeLinear pairs mark can run in that precision (explicit quantization, no cache).

Shapes: the padded ONNX decoder has no remove-input-padding token axis, so the plan's profiles give the
batch range (`batch_size_beam_width`); the new tokens of one step range over 1..max_input_len (opt 1,
a decode step) and the cache over 0..max_seq_len - 1 past tokens (opt half of it).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..plan.schema import Plan

#: what `trtpipe compile --onnx` writes next to trtllm-build.sh
TRTEXEC_FILE = "trtexec.sh"


def dims(*values: int) -> str:
    return "x".join(str(v) for v in values)


def shape_specs(plan: Plan, layers: int, kv_heads: int, head_size: int) -> dict[str, str]:
    """--minShapes / --optShapes / --maxShapes values for every input of the graph."""
    batch = plan.optimization_profiles[0].batch_size_beam_width
    build = plan.build_config
    new = (1, 1, build.max_input_len)
    past = (0, build.max_seq_len // 2, build.max_seq_len - 1)
    specs = {}
    for k, flag in enumerate(("min", "opt", "max")):
        b, t, p = batch[k], new[k], past[k]
        parts = [f"input_ids:{dims(b, t)}", f"attention_mask:{dims(b, p + t)}", f"position_ids:{dims(b, t)}"]
        parts += [f"past_key_values.{i}.{kind}:{dims(b, kv_heads, p, head_size)}"
                  for i in range(layers) for kind in ("key", "value")]
        specs[flag] = ",".join(parts)
    return specs


def trtexec_command(plan: Plan, onnx_model: str, engine: str, precision: str, layers: int, kv_heads: int,
                    head_size: int) -> list[str]:
    specs = shape_specs(plan, layers, kv_heads, head_size)
    argv = ["trtexec", f"--onnx={onnx_model}", f"--saveEngine={engine}",
            f"--minShapes={specs['min']}", f"--optShapes={specs['opt']}", f"--maxShapes={specs['max']}"]
    return argv + ["--fp16"] + {"int8-sq": ["--int8"], "fp8": ["--fp8"]}.get(precision, [])


def trtexec_for_export(plan: Plan, export_dir: Path, engine: str) -> list[str]:
    """The trtexec command for an `export-onnx` directory, its shapes from the plan and the export's own
    description (genai_config.json: layers, KV heads, head size, precision)."""
    from .export import CONFIG_FILE, MODEL_FILE

    config_path = Path(export_dir) / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
        decoder, precision = config["model"]["decoder"], config["trtpipe"]["precision"]
        shape = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--onnx {export_dir}: no readable {CONFIG_FILE}; pass a directory `trtpipe export-onnx` "
                        "wrote") from None
    if plan.build_config is None or not plan.optimization_profiles:
        raise UserError("--onnx needs an engine plan (its optimization profiles give trtexec's shapes)")
    return trtexec_command(plan, str(Path(export_dir).absolute() / MODEL_FILE), engine, precision, *shape)
