"""Perplexity of SmolLM2-135M quantized by trtpipe (per amax method, alpha and weight rounding), side
by side with modelopt 0.37's FP8.

Collects the statistics once per precision and alpha (all methods' amax come from the same histograms),
writes one quantized checkpoint per method and weight rounding, and scores each with the reference
runtime on the held-out news documents. NVIDIA's own flow (modelopt 0.37 FP8_DEFAULT_CFG, `max`
calibration) runs on the same calibration samples and is scored twice on the same held-out tokens:
fake-quantized in transformers (what modelopt reports; q/k/v and gate/up keep separate weight scales),
and as the TensorRT-LLM checkpoint its `export_tensorrt_llm_checkpoint` writes (one scale per fused
GEMM, what an engine runs), through the reference runtime.

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
from pipeline.calibrate.collect import source_of
from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe, tokenize_samples
from pipeline.calibrate.rounding import DEFAULT_DAMP
from pipeline.calibrate.stage import DEFAULT_ALPHA, CalibrateOptions, calibrate_statistics, heldout_sequences
from pipeline.runtime import ReferenceModel, perplexity


def plan_for_method(plan, reports, method):
    amax = {t.name: t.amax[method] for t in reports}
    kv = {i: (amax[f"transformer.layers.{i}.attention.k"], amax[f"transformer.layers.{i}.attention.v"])
          for i in plan.kv_amax}
    return replace(plan, activation_amax={m: amax[source_of(m)] for m in plan.activation_amax}, kv_amax=kv)


def score_checkpoint(ckpt, plan, heldout, workdir: Path, label: str) -> float:
    out = workdir / label
    out.mkdir()
    write_quantized_checkpoint(ckpt, plan, out)
    return perplexity(ReferenceModel.load(out), heldout, window=512, desc=label).perplexity


def modelopt_fp8_max(hf_dir: Path, samples, heldout, workdir: Path) -> tuple[float, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)

        from modelopt.torch.export import export_tensorrt_llm_checkpoint

        def loop(m):
            for ids in samples:
                m(torch.tensor([ids]))

        with torch.no_grad():
            mtq.quantize(model, cfg, loop)

        class HF:
            def forward(self, ids):
                return model(ids).logits

        with torch.no_grad():
            fake = perplexity(HF(), heldout, window=512, desc="modelopt fp8 (fake-quant)").perplexity
            export_tensorrt_llm_checkpoint(model, "llama", torch.float32, workdir / "modelopt-fp8",
                                           inference_tensor_parallel=1)
    exported = perplexity(ReferenceModel.load(workdir / "modelopt-fp8"), heldout, window=512,
                          desc="modelopt fp8 (exported)").perplexity
    return fake, exported


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval", type=int, default=40)
    ap.add_argument("--alphas", default="0.8", help="SmoothQuant alphas (comma-separated)")
    ap.add_argument("--precisions", default="fp8,int8-sq")
    ap.add_argument("--fp8-methods", default="max,entropy,percentile,mse")
    ap.add_argument("--sq-methods", default="max")
    ap.add_argument("--roundings", default="gptq,nearest", help="weight roundings to score for each method")
    ap.add_argument("--damp", type=float, default=DEFAULT_DAMP)
    ap.add_argument("--skip-modelopt", action="store_true")
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

        if not args.skip_modelopt:
            fake, exported = modelopt_fp8_max(hf_dir, samples, heldout, work)
            record("modelopt_fp8_max_fakequant", fake)
            record("modelopt_fp8_max_exported", exported)

        wanted = args.precisions.split(",")
        jobs = ([("fp8", None, args.fp8_methods)] if "fp8" in wanted else []) + (
            [("int8-sq", float(a), args.sq_methods) for a in args.alphas.split(",")] if "int8-sq" in wanted else [])
        for precision, alpha, methods in jobs:
            start = time.monotonic()
            opts = CalibrateOptions(precision, recipe, alpha=DEFAULT_ALPHA if alpha is None else alpha, damp=args.damp, progress=False)
            plan, reports, _, _ = calibrate_statistics(model, ckpt, samples, opts)
            tag = precision if alpha is None else f"{precision}-alpha{alpha}"
            record(f"{tag}_stats_seconds", round(time.monotonic() - start, 1))
            for method in methods.split(","):
                for rounding in args.roundings.split(","):
                    label = f"{tag}-{method}-{rounding}"
                    chosen = plan_for_method(plan, reports, method)
                    if rounding == "nearest":
                        chosen = replace(chosen, hessians={})
                    start = time.monotonic()
                    record(label, score_checkpoint(ckpt, chosen, heldout, work, label))
                    record(f"{label}_write_and_score_seconds", round(time.monotonic() - start, 1))

    base = results.get("float")
    if base is None:
        return
    print("\nperplexity vs float (held-out news, reference runtime; modelopt with transformers):")
    for key, value in results.items():
        if isinstance(value, float) and "seconds" not in key:
            print(f"  {key:32s} {value:8.3f}  {100 * (value / base - 1):+6.2f}%")


if __name__ == "__main__":
    main()
