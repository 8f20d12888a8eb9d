"""The cpu target's two runtimes on SmolLM2: output tokens/s at concurrency 8, ONNX Runtime vs torch, side by side.

The same checkpoint and plan deployed twice — `--runtime onnxruntime` (backend reference-onnx: the ONNX
export served by ONNX Runtime) and `--runtime torch` (the reference runtime) — both served by embedded
Triton servers at once and loaded in alternating rounds by 8 concurrent streaming clients (the load
generator of `trtpipe validate --load-test`, through bench_batching's `measure_side_by_side`). Goal: >= 2x.

    .venv/bin/python benchmarks/bench_cpu_runtime.py [--checkpoint DIR] [--rounds 2] [--requests-per-client 2]

Without --checkpoint SmolLM2 is converted to a float32 checkpoint (cached in --workdir).
"""

from __future__ import annotations

import json

from bench_batching import CONCURRENCY, measure_side_by_side, print_side_by_side, side_by_side_arguments

from pipeline.deploy import deploy_repository
from pipeline.plan import make_plan, resolve_model_info
from pipeline.targets import get_target

RUNTIMES = ("onnxruntime", "torch")
GOAL = 2.0


def main() -> None:
    args, checkpoint = side_by_side_arguments(__doc__.splitlines()[0], "/tmp/trtpipe-bench-cpu-runtime")
    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32")
    repos = {runtime: deploy_repository(plan, args.workdir / f"repo-{runtime}", checkpoint=checkpoint,
                                        runtime=runtime, force=True).path for runtime in RUNTIMES}
    results = measure_side_by_side(repos, args.rounds, args.requests_per_client, args.max_tokens, label="")

    print(f"\n{checkpoint.name} on the cpu target, concurrency {CONCURRENCY}, {args.rounds} rounds x "
          f"{args.requests_per_client} requests/client, {args.max_tokens} tokens each (percentiles: worst round)")
    print_side_by_side(results, {r: r for r in RUNTIMES}, width=14)
    speedup = results["onnxruntime"]["output_tokens_per_s"] / results["torch"]["output_tokens_per_s"]
    print(f"\nonnxruntime / torch: {speedup:.2f}x (goal >= {GOAL:g}x: {'met' if speedup >= GOAL else 'NOT met'})")
    (args.workdir / "bench_cpu_runtime.json").write_text(json.dumps(results, indent=2))
    print(f"raw numbers: {args.workdir / 'bench_cpu_runtime.json'}")


if __name__ == "__main__":
    main()
