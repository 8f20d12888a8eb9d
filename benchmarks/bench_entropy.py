"""Entropy threshold search: trtpipe's vectorized search vs nvidia-modelopt 0.37, same histograms.

Collects SmolLM2-135M's activation histograms (inputs of every qkv / dense / fc / proj and the K / V
values, 2048 bins growing with the range) with the reference runtime on the offline calibration text,
then, for every histogram, runs modelopt's `HistogramCalibrator.compute_amax("entropy")` and
`pipeline.calibrate.amax.entropy_threshold_bin` (INT8, 128 levels: the levels modelopt supports), checks
that both choose the same threshold bin, and prints the time of each and the speed-up, measured in
this one run.

    .venv/bin/python benchmarks/bench_entropy.py [--samples 8] [--seq-len 256] [--tensors N]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

from pipeline.calibrate.amax import entropy_threshold_bin
from pipeline.calibrate.formats import INT8


def smollm2_histograms(samples: int, seq_len: int) -> dict:
    import tempfile
    from pathlib import Path

    from pipeline.calibrate.quantized_checkpoint import open_float_checkpoint
    from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe, tokenize_samples
    from pipeline.calibrate.histogram import StreamingHistogram
    from pipeline.convert import convert_model
    from pipeline.runtime import LayerStream
    from pipeline.sources import resolve_model

    histograms: dict[str, StreamingHistogram] = {}

    with tempfile.TemporaryDirectory() as tmp:
        ck = convert_model(resolve_model("smollm2-135m"), Path(tmp) / "ck", dtype="float32", progress=False).path
        stats_key = open_float_checkpoint(ck).stats_key

        def observe(name: str, x: torch.Tensor) -> None:
            if stats_key(name) is not None:
                histograms.setdefault(name, StreamingHistogram()).collect(x)

        recipe = resolve_recipe(None, samples=samples, seq_len=seq_len)
        ids = tokenize_samples(load_texts(recipe), load_tokenizer(ck), recipe)
        LayerStream(ck).run_layers(ids, passes=lambda loaded: [observe], desc="collecting histograms")
    return {name: h.histogram() for name, h in histograms.items()}


def modelopt_amax(counts: np.ndarray, edges: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.calib.histogram import HistogramCalibrator

        calib = HistogramCalibrator(num_bits=8)
        calib._calib_hist = torch.from_numpy(counts.copy())
        calib._calib_bin_edges = torch.from_numpy(edges)
        return float(calib.compute_amax("entropy"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=0, help="only the first N histograms (0: all)")
    args = ap.parse_args()

    hists = smollm2_histograms(args.samples, args.seq_len)
    names = sorted(hists)[: args.tensors or None]
    ours_s = ref_s = 0.0
    mismatches = []
    for k, name in enumerate(names, 1):
        h = hists[name]
        edges = h.edges
        start = time.perf_counter()
        ref = modelopt_amax(h.counts, edges)
        ref_s += time.perf_counter() - start
        start = time.perf_counter()
        ours = float(edges[entropy_threshold_bin(h.counts, INT8)])
        ours_s += time.perf_counter() - start
        if np.float32(ours) != np.float32(ref):
            mismatches.append((name, ours, ref))
        print(f"\r{k}/{len(names)} histograms ({len(h.counts)} bins)  modelopt {ref_s:7.1f} s   ours {ours_s:6.2f} s",
              end="", flush=True)
    print()
    print(f"histograms: {len(names)} (bins per histogram: {min(len(hists[n].counts) for n in names)}"
          f"-{max(len(hists[n].counts) for n in names)})")
    print(f"same threshold bin: {len(names) - len(mismatches)}/{len(names)}")
    for name, ours, ref in mismatches:
        print(f"  MISMATCH {name}: ours {ours!r} modelopt {ref!r}")
    print(f"modelopt 0.37 HistogramCalibrator.compute_amax('entropy'): {ref_s:.2f} s "
          f"({1000 * ref_s / len(names):.0f} ms per histogram)")
    print(f"trtpipe entropy_threshold_bin:                            {ours_s:.2f} s "
          f"({1000 * ours_s / len(names):.1f} ms per histogram)")
    print(f"speed-up: {ref_s / ours_s:.1f}x")


if __name__ == "__main__":
    main()
