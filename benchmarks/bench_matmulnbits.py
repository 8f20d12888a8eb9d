"""Which MatMulNBits accuracy_level the cpu target serves int4-awq with: ONNX Runtime's 4-bit MatMul on SmolLM2's
linear shapes at level 0 (float32 compute) and 4 (each input block quantized to int8, integer dot products) beside a
float32 MatMul of the same shape and ONNX Runtime's own 8-bit integer GEMM (DynamicQuantizeMatMul: int8 weights,
the input quantized to uint8 per call, the kernel the int8-sq export's linears fuse into), one thread, at 1, 8 and 64
tokens; then the held-out perplexity of SmolLM2's int4-awq export (group 64) at both levels, beside the reference
runtime's. The 8-bit column is what integer dot products reach on this CPU at that shape: where level 4 stays near
float32 while the 8-bit GEMM is several times faster, the 4-bit kernel, not the arithmetic, bounds the 4-bit server.

    .venv/bin/python benchmarks/bench_matmulnbits.py [--repeats 300] [--workdir DIR]

Each row: microseconds per call (the median of 5 rounds of --repeats calls, after 20 warm-up calls) and the ratios.
Run it on an otherwise idle machine. The result decides `pipeline/onnx/export.py` SERVING_INT4_ACCURACY.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bench_batching import smollm2_checkpoint
from bench_cpu_runtime import checkpoint_for

from pipeline.calibrate.data import load_tokenizer
from pipeline.calibrate.stage import EVAL_WINDOW, heldout_sequences
from pipeline.onnx.export import ExportOptions, export_onnx
from pipeline.onnx.graph import CONTRIB_DOMAIN
from pipeline.onnx.runner import OrtDecoder
from pipeline.runtime import ReferenceModel, perplexity

#: SmolLM2-135M's linears (in, out): qkv, o, gate/up, down
SHAPES = ((576, 960), (576, 576), (576, 1536), (1536, 576))
GROUP = 64


#: session()'s level for ONNX Runtime's 8-bit GEMM
INT8 = "int8"


def session(k: int, n: int, level: int | str | None) -> ort.InferenceSession:
    """One MatMulNBits node (level None: a float32 MatMul; INT8: a DynamicQuantizeMatMul) on random weights, one
    intra-op thread."""
    rng = np.random.default_rng(0)
    if level is None:
        node = helper.make_node("MatMul", ["A", "B"], ["Y"])
        weights = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "B")]
    elif level == INT8:
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "B", "S"], ["Y"], domain=CONTRIB_DOMAIN)
        weights = [numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), "B"),
                   numpy_helper.from_array((rng.random(n) * 0.01).astype(np.float32), "S")]
    else:
        codes = rng.integers(0, 16, (n, k // GROUP, GROUP)).astype(np.uint8)
        weights = [numpy_helper.from_array((codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).astype(np.uint8), "B"),
                   numpy_helper.from_array((rng.random((n, k // GROUP)) * 0.01).astype(np.float32), "S")]
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain=CONTRIB_DOMAIN, K=k, N=n, bits=4,
                                block_size=GROUP, accuracy_level=level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])], weights)
    domains = [helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=domains, ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def microseconds(s: ort.InferenceSession, a: np.ndarray, repeats: int) -> float:
    for _ in range(20):
        s.run(None, {"A": a})
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            s.run(None, {"A": a})
        rounds.append((time.perf_counter() - started) / repeats * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-matmulnbits"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"onnxruntime {ort.__version__}, one thread, group {GROUP}; microseconds per call")
    print("| in x out | tokens | float32 MatMul | level 0 | level 4 | 8-bit GEMM | level 4 / level 0 "
          "| level 4 / float32 | 8-bit / float32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        sessions = {name: session(k, n, level)
                    for name, level in (("fp32", None), ("l0", 0), ("l4", 4), ("int8", INT8))}
        for m in (1, 8, 64):
            a = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
            t = {name: microseconds(s, a, args.repeats) for name, s in sessions.items()}
            print(f"| {k} x {n} | {m} | {t['fp32']:.0f} | {t['l0']:.0f} | {t['l4']:.0f} | {t['int8']:.0f} | "
                  f"{t['l0'] / t['l4']:.2f}x faster | {t['fp32'] / t['l4']:.2f}x faster | "
                  f"{t['fp32'] / t['int8']:.2f}x faster |")

    checkpoint = checkpoint_for(smollm2_checkpoint(args.workdir), "int4-awq", args.workdir)
    sequences = heldout_sequences(load_tokenizer(checkpoint), 40)
    reference = perplexity(ReferenceModel.load(checkpoint), sequences, window=EVAL_WINDOW, progress=False)
    print(f"\nSmolLM2 int4-awq held-out perplexity ({reference.tokens} tokens): reference runtime "
          f"{reference.perplexity:.3f}")
    for level in (0, 4):
        out = export_onnx(checkpoint, args.workdir / f"onnx-l{level}", ExportOptions(int4_accuracy=level)).path
        scored = perplexity(OrtDecoder(out), sequences, window=EVAL_WINDOW, progress=False)
        print(f"  ONNX Runtime, accuracy_level {level}: {scored.perplexity:.3f} "
              f"({scored.perplexity / reference.perplexity - 1:+.2%} against the runtime)")


if __name__ == "__main__":
    main()
