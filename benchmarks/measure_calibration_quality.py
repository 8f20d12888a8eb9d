"""Perplexity of SmolLM2-135M quantized with every amax method, side by side with modelopt 0.37's FP8.

Collects the statistics once per precision (all methods' amax come from the same histograms), writes
one quantized checkpoint per method, and scores each with the reference runtime on the held-out news
documents; NVIDIA's own flow (modelopt 0.37 FP8_DEFAULT_CFG, `max` calibration, fake-quantized with
transformers on the CPU) runs on the same calibration samples and the same held-out tokens.

    .venv/bin/python benchmarks/measure_calibration_quality.py [--samples 64] [--seq-len 256] [--eval 40]

Prints a table and writes the numbers as JSON (--json-out). Takes a while on 2 cores (many evaluations).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.calibrate.checkpoint import open_float_checkpoint, write_quantized_checkpoint
from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe, tokenize_samples
from pipeline.calibrate.stage import CalibrateOptions, calibrate_statistics, heldout_sequences
from pipeline.runtime import ReferenceModel, perplexity


def plan_for_method(plan, reports, method):
    amax = {t.name: t.amax[method] for t in reports}
    src = lambda m: m[: -len("gate")] + "fc" if m.endswith(".mlp.gate") else m  # noqa: E731
    kv = {i: (amax[f"transformer.layers.{i}.attention.k"], amax[f"transformer.layers.{i}.attention.v"])
          for i in plan.kv_amax}
    return replace(plan, activation_amax={m: amax[src(m)] for m in plan.activation_amax}, kv_amax=kv)


def score_checkpoint(ckpt, plan, heldout, workdir: Path, label: str) -> float:
    out = workdir / label
    out.mkdir()
    write_quantized_checkpoint(ckpt, plan, out)
    return perplexity(ReferenceModel.load(out), heldout, window=512, desc=label).perplexity


def modelopt_fp8_max(hf_dir: Path, samples, heldout) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)

        def loop(m):
            for ids in samples:
                m(torch.tensor([ids]))

        with torch.inference_mode():
            mtq.quantize(model, cfg, loop)

    class HF:
        def forward(self, ids):
            return model(ids).logits

    with torch.inference_mode():
        return perplexity(HF(), heldout, window=512, desc="modelopt fp8").perplexity


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval", type=int, default=40)
    ap.add_argument("--alphas", default="0.5")
    ap.add_argument("--precisions", default="fp8,int8-sq")
    ap.add_argument("--skip-float", action="store_true", help="do not score the float checkpoint")
    ap.add_argument("--json-out", type=Path, default=Path("calibration-quality.json"))
    args = ap.parse_args()

    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    results: dict = {"samples": args.samples, "seq_len": args.seq_len, "eval_docs": args.eval}

    def record(key, value):
        results[key] = value
        args.json_out.write_text(json.dumps(results, indent=2))
        print(f"{key}: {value}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf_dir = resolve_model("smollm2-135m").hf_dir()
        ck_path = convert_model(resolve_model(str(hf_dir)), work / "float", dtype="float32", progress=False).path
        ckpt = open_float_checkpoint(ck_path)
        tok = load_tokenizer(ck_path)
        recipe = resolve_recipe(None, samples=args.samples, seq_len=args.seq_len)
        samples = tokenize_samples(load_texts(recipe), tok, recipe)
        heldout = heldout_sequences(tok, args.eval)
        model = ReferenceModel.load(ck_path)
        if not args.skip_float:
            record("float", perplexity(model, heldout, window=512, desc="float").perplexity)

        wanted = args.precisions.split(",")
        jobs = ([("fp8", "fp8", None)] if "fp8" in wanted else []) + (
            [("int8-sq", "int8", float(a)) for a in args.alphas.split(",")] if "int8-sq" in wanted else [])
        order = {"fp8": ("max", "entropy", "percentile", "mse"), "int8-sq": ("percentile", "entropy", "mse", "max")}
        for precision, kv, alpha in jobs:
            start = time.monotonic()
            opts = CalibrateOptions(precision, recipe, kv_cache=None, alpha=alpha or 0.5, progress=False)
            plan, reports, _, _ = calibrate_statistics(model, ckpt, samples, opts)
            record(f"{precision}{'' if alpha is None else f'-alpha{alpha}'}_stats_seconds",
                   round(time.monotonic() - start, 1))
            for k, method in enumerate(order[precision]):
                label = f"{precision}{'' if alpha is None else f'-alpha{alpha}'}-{method}"
                record(label, score_checkpoint(ckpt, plan_for_method(plan, reports, method), heldout, work, label))
                if precision == "fp8" and k == 1 and "modelopt_fp8_max" not in results:
                    record("modelopt_fp8_max", modelopt_fp8_max(hf_dir, samples, heldout))

    base = results.get("float")
    if base is None:
        return
    print("\nperplexity vs float (held-out news, reference runtime; modelopt with transformers):")
    for key, value in results.items():
        if isinstance(value, float) and "seconds" not in key:
            print(f"  {key:32s} {value:8.3f}  {100 * (value / base - 1):+6.2f}%")


if __name__ == "__main__":
    main()
