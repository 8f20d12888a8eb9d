"""Perplexity of SmolLM2-135M quantized by trtpipe (per amax method, alpha and weight rounding), side
by side with modelopt 0.37's FP8.

Runs `calibrate_checkpoint` once per precision, alpha, amax method and weight rounding (with or without
a quantized KV cache, --kv-cache) and reads the float and quantized perplexity on the held-out news
documents from its report. NVIDIA's own flow (modelopt 0.37 FP8_DEFAULT_CFG, `max`
calibration) runs on the same calibration samples and is scored twice on the same held-out tokens:
fake-quantized in transformers (what modelopt reports; q/k/v and gate/up keep separate weight scales),
and as the TensorRT-LLM checkpoint its `export_tensorrt_llm_checkpoint` writes (one scale per fused
GEMM, what an engine runs), through the reference runtime.

    .venv/bin/python benchmarks/measure_calibration_quality.py [--samples 64] [--eval 40] [--kv-cache fp8]

Prints a table and writes the numbers as JSON (--json-out). Takes a while on 2 cores (many evaluations).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import warnings
from pathlib import Path

import torch

from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe, tokenize_samples
from pipeline.calibrate.rounding import DEFAULT_DAMP
from pipeline.calibrate.stage import DEFAULT_ALPHA, CalibrateOptions, calibrate_checkpoint, heldout_sequences
from pipeline.runtime import LayerStream, perplexity


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
    exported = perplexity(LayerStream(workdir / "modelopt-fp8"), heldout, window=512,
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
    ap.add_argument("--kv-cache", choices=["fp8", "int8"], default=None,
                    help="Also quantize the KV cache (fp8 with fp8, int8 with int8-sq)")
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
        tok = load_tokenizer(ck_path)
        recipe = resolve_recipe(None, samples=args.samples, seq_len=args.seq_len)
        heldout = heldout_sequences(tok, args.eval)
        if not args.skip_float:
            record("float", perplexity(LayerStream(ck_path), heldout, window=512, desc="float").perplexity)

        if not args.skip_modelopt:
            samples = tokenize_samples(load_texts(recipe), tok, recipe)
            fake, exported = modelopt_fp8_max(hf_dir, samples, heldout, work)
            record("modelopt_fp8_max_fakequant", fake)
            record("modelopt_fp8_max_exported", exported)

        wanted = args.precisions.split(",")
        jobs = ([("fp8", None, args.fp8_methods)] if "fp8" in wanted else []) + (
            [("int8-sq", float(a), args.sq_methods) for a in args.alphas.split(",")] if "int8-sq" in wanted else [])
        for precision, alpha, methods in jobs:
            tag = precision if alpha is None else f"{precision}-alpha{alpha}"
            kv = {"fp8": "fp8", "int8-sq": "int8"}[precision] if args.kv_cache else None
            for method in methods.split(","):
                for rounding in args.roundings.split(","):
                    label = f"{tag}-{method}-{rounding}" + (f"-kv{kv}" if kv else "")
                    opts = CalibrateOptions(precision, recipe, kv_cache=kv, method=method,
                                            alpha=DEFAULT_ALPHA if alpha is None else alpha, weight_rounding=rounding,
                                            damp=args.damp, eval_samples=args.eval, progress=False)
                    result = calibrate_checkpoint(ck_path, work / label, opts)
                    record(label, result.perplexity["quantized"])
                    record(f"{label}_seconds", round(result.seconds, 1))

    base = results.get("float")
    if base is None:
        return
    print("\nperplexity vs float (held-out news, reference runtime; modelopt with transformers):")
    for key, value in results.items():
        if isinstance(value, float) and "seconds" not in key:
            print(f"  {key:32s} {value:8.3f}  {100 * (value / base - 1):+6.2f}%")


if __name__ == "__main__":
    main()
