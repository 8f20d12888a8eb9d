"""The cpu target's two runtimes on SmolLM2: output tokens/s at concurrency 8, ONNX Runtime vs torch, side by side.

For each precision the same checkpoint and plan deployed twice — `--runtime onnxruntime` (backend
reference-onnx: the ONNX export served by ONNX Runtime) and `--runtime torch` (the reference runtime) —
both served by embedded Triton servers at once and loaded in alternating rounds by 8 concurrent streaming
clients (the load generator of `trtpipe validate --load-test`, through bench_batching's
`measure_side_by_side`). Goal: >= 2x.

    .venv/bin/python benchmarks/bench_cpu_runtime.py [--precision fp32 int8-sq fp8] [--rounds 2]

fp32 serves the float32 conversion of SmolLM2; int8-sq and fp8 serve it calibrated (default recipe; the
checkpoints are cached in --workdir). Where the runtimes differ: for int8-sq ONNX Runtime runs each W8A8
linear as an integer GEMM (MatMulIntegerToFloat) while the torch runtime multiplies the dequantized float32
weights by fake-quantized activations; for fp32 both read the same float32 weights every decode step; for
fp8 ONNX Runtime's CPU provider has no FP8 GEMM and dequantizes the weights on every step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_batching import CONCURRENCY, measure_side_by_side, print_side_by_side, side_by_side_arguments

from pipeline.calibrate.data import resolve_recipe
from pipeline.calibrate.stage import CalibrateOptions, calibrate_checkpoint
from pipeline.deploy import deploy_repository
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.targets import get_target

RUNTIMES = ("onnxruntime", "torch")
PRECISIONS = ("fp32", "int8-sq", "fp8")
GOAL = 2.0


def precision_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["fp32", "int8-sq"],
                        help="the precisions to measure, one side-by-side table each")


def checkpoint_for(float_checkpoint: Path, precision: str, workdir: Path, quantize_lm_head: bool = False) -> Path:
    """The checkpoint a precision serves: the float one, or it calibrated into the work directory (reused)."""
    if precision == "fp32":
        return float_checkpoint
    options = CalibrateOptions(precision, resolve_recipe(None), eval_samples=0, progress=False,
                               quantize_lm_head=quantize_lm_head)
    name = f"checkpoint-{precision}" + ("-head" if quantize_lm_head else "")
    return calibrate_checkpoint(float_checkpoint, workdir / name, options).path


def measure(precision: str, checkpoint: Path, args: argparse.Namespace) -> float:
    """Print one precision's side-by-side table; the onnxruntime / torch ratio of output tokens/s."""
    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), precision)
    repos = {runtime: deploy_repository(plan, args.workdir / f"repo-{precision}-{runtime}", checkpoint=checkpoint,
                                        runtime=runtime, force=True).path for runtime in RUNTIMES}
    results = measure_side_by_side(repos, args.rounds, args.requests_per_client, args.max_tokens,
                                   label=f"{precision} ")
    print(f"\n{precision}: {checkpoint.name} on the cpu target, concurrency {CONCURRENCY}, {args.rounds} rounds x "
          f"{args.requests_per_client} requests/client, {args.max_tokens} tokens each (percentiles: worst round)")
    print_side_by_side(results, {r: r for r in RUNTIMES}, width=14)
    speedup = results["onnxruntime"]["output_tokens_per_s"] / results["torch"]["output_tokens_per_s"]
    verdict = "met" if speedup >= GOAL else "NOT met"
    print(f"{precision} onnxruntime / torch: {speedup:.2f}x (goal >= {GOAL:g}x: {verdict})")
    (args.workdir / f"bench_cpu_runtime-{precision}.json").write_text(json.dumps(results, indent=2))
    return speedup


def main() -> None:
    args, checkpoint = side_by_side_arguments(__doc__.splitlines()[0], "/tmp/trtpipe-bench-cpu-runtime",
                                              precision_option)
    speedups = {p: measure(p, checkpoint_for(checkpoint, p, args.workdir), args) for p in args.precision}
    print("\nonnxruntime / torch, output tokens/s: "
          + ", ".join(f"{p} {s:.2f}x" for p, s in speedups.items()) + f" (goal >= {GOAL:g}x)")
    print(f"raw numbers: {args.workdir}/bench_cpu_runtime-<precision>.json")


if __name__ == "__main__":
    main()
