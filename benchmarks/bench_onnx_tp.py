"""INT8-SQ ONNX export of a tp=3 checkpoint: the two ways to express the row-parallel layers' per-rank scales,
timed side by side in one run with ONNX Runtime (CPU EP), and checked against the reference runtime.

- split (what `trtpipe export-onnx` writes): the input split into the ranks' slices, a Q/DQ pair and one integer
  GEMM per slice (ONNX Runtime fuses each into MatMulIntegerToFloat), the partial products summed;
- blocked: one MatMul whose weight is dequantized by an opset-21 blocked DequantizeLinear (block_size = the
  rank's slice of the input dimension, a [tp, out] scale).

SmolLM2-135M converted with --tp 3 (its 9 heads divide by 3) and calibrated to INT8-SQ (few samples: speed is
what is measured), a decode step at batch 8 over a 64-token context, alternating rounds, median per variant.

    .venv/bin/python benchmarks/bench_onnx_tp.py [--workdir DIR] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import pipeline.onnx.graph as graph
from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe
from pipeline.convert import convert_model
from pipeline.onnx.export import ExportOptions, export_onnx
from pipeline.onnx.quantize import weight_tensor
from pipeline.onnx.runner import OrtDecoder
from pipeline.calibrate.data import load_tokenizer
from pipeline.calibrate.stage import heldout_sequences
from pipeline.runtime import ReferenceModel, perplexity
from pipeline.sources import resolve_model


def blocked_dq_matmul(g, x, lin, qw, name):
    """The alternative: one Q/DQ of the whole input and one MatMul over a blocked DequantizeLinear."""
    x = graph.linear_input(g, x, lin, name)
    data, scale = weight_tensor(name + ".weight", qw)          # [in, out] values, [tp, out] scale
    block = qw.values.shape[1] // qw.blocks
    y = g.op("MatMul", [x, g.op("DequantizeLinear", [g.tensor(data), g.tensor(scale)], axis=0, block_size=block)])
    if lin.bias is not None:
        y = g.op("Add", [y, g.float_weight(name + ".bias", lin.bias)])
    return y


def prepare(work: Path) -> tuple[Path, dict[str, Path]]:
    float_ckpt = work / "float-tp3"
    if not (float_ckpt / "config.json").is_file():
        convert_model(resolve_model("smollm2-135m"), float_ckpt, dtype="float32", tp=3, progress=False)
    ckpt = work / "int8-sq-tp3"
    calibrate_checkpoint(float_ckpt, ckpt, CalibrateOptions("int8-sq", resolve_recipe(None, samples=8),
                                                            eval_samples=0, progress=False))
    exports = {"split": export_onnx(ckpt, work / "onnx-split", ExportOptions(force=True)).path}
    original = graph.rank_blocked_matmul
    graph.rank_blocked_matmul = blocked_dq_matmul
    try:
        exports["blocked"] = export_onnx(ckpt, work / "onnx-blocked", ExportOptions(force=True)).path
    finally:
        graph.rank_blocked_matmul = original
    return ckpt, exports


def decode_seconds(decoder: OrtDecoder, batch: int, context: int, steps: int) -> float:
    ids = np.random.default_rng(0).integers(0, 49152, (batch, context))
    _, cache = decoder.step(ids, decoder.empty_cache(batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, cache = decoder.step(ids[:, -1:], cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-onnx-tp"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt, exports = prepare(args.workdir)
    ref = ReferenceModel.load(ckpt)
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    want = ref.forward(ids)
    decoders = {}
    for name, path in exports.items():
        decoder = OrtDecoder(path)
        try:
            got = torch.as_tensor(np.asarray(decoder.step(ids.numpy(), decoder.empty_cache(2))[0]))
        except Exception as exc:   # noqa: BLE001 -- a variant ONNX Runtime cannot run is a finding, not a crash
            print(f"{name:>8}: ONNX Runtime cannot run it: {str(exc).splitlines()[0][:300]}")
            continue
        decoders[name] = decoder
        print(f"{name:>8}: max |logits - reference| / max |reference| = "
              f"{float((got - want).abs().max() / want.abs().max()):.2e}, same argmax "
              f"{float((got.argmax(-1) == want.argmax(-1)).float().mean()):.0%}")
    heldout = [s[:128] for s in heldout_sequences(load_tokenizer(ckpt), 4)]
    scored = {"reference": perplexity(ref, heldout, window=128, progress=False)}
    scored.update({name: perplexity(d, heldout, window=128, progress=False) for name, d in decoders.items()})
    print("held-out perplexity (4 documents x 128 tokens): " + ", ".join(
        f"{name} {result.perplexity:.3f}" for name, result in scored.items()))
    measured: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(args.rounds):
        for name, decoder in decoders.items():
            measured[name].append(decode_seconds(decoder, args.batch, 64, args.steps))
    medians = {name: statistics.median(times) for name, times in measured.items()}
    print(f"decode step, batch {args.batch}, 64-token context, median of {args.rounds} rounds x {args.steps} steps:")
    for name, seconds in medians.items():
        print(f"{name:>8}: {seconds * 1e3:7.2f} ms")
    if len(medians) == 2:
        print(f"blocked / split = {medians['blocked'] / medians['split']:.2f}  (> 1: the split export is faster)")


if __name__ == "__main__":
    main()
