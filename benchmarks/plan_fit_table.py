"""What fits one RTX 4090 at each precision: the longest context one sequence can have, and how many sequences of 4k
tokens fit at once, for llama-3.1-8b, qwen2.5-14b and qwen2.5-32b, every cell from the planner `trtpipe plan` runs
(`make_plan`, tp 1, the default KV cache of each precision), every refusal with its reason. No GPU, no weights.

    .venv/bin/python benchmarks/plan_fit_table.py [--target rtx4090] [--models ...]

Longest context at concurrency 1: the largest max_context (a multiple of 1024, up to the model's context) whose plan
for one sequence of max_context - 256 prompt and 256 output tokens fits, KV cache included. Sequences at 4k: the
plan's max_concurrent_sequences for 3072 + 1024 tokens each with --max-context 4096 (the KV cache's count; the
planner's max_batch_size, capped by its kernel tables and latency model, can be lower).
"""

from __future__ import annotations

import argparse

from pipeline.errors import UserError
from pipeline.plan.schema import ModelInfo, Workload
from pipeline.plan.trtllm import model_context_limit
from pipeline.planner import make_plan
from pipeline.precisions import AUTO_PRECISIONS
from pipeline.presets import PRESETS
from pipeline.targets import get_target

MODELS = ("llama-3.1-8b", "qwen2.5-14b", "qwen2.5-32b")
STEP, OUTPUT = 1024, 256


#: (precision, --kv-cache) rows: each precision's default KV cache, and int4-awq with an FP8 one (paged context FMHA
#: off, as TensorRT-LLM needs it there)
ROWS = tuple((p, "auto") for p in AUTO_PRECISIONS) + (("int4-awq", "fp8"),)


def plan(model: ModelInfo, target, precision: str, workload: Workload, kv_cache: str = "auto"):
    """The plan, or the refusal's message."""
    try:
        return make_plan(model, target, precision, kv_cache, workload=workload)
    except UserError as exc:
        return str(exc).split("; instead:")[0]


def longest_context(model: ModelInfo, target, precision: str, kv: str) -> tuple[int | None, str]:
    """The largest multiple of STEP that one sequence can use, and the refusal just above it."""
    limit = model_context_limit(model.arch)
    fits, why = None, ""
    low, high = 1, limit // STEP
    while low <= high:
        mid = (low + high) // 2
        context = mid * STEP
        result = plan(model, target, precision, Workload(input_len=context - OUTPUT, output_len=OUTPUT,
                                                         max_context=context, concurrency=1), kv)
        if isinstance(result, str) or result.max_concurrent_sequences < 1:
            why = result if isinstance(result, str) else "no room for one sequence"
            high = mid - 1
        else:
            fits, low = context, mid + 1
    return fits, ("" if fits == limit else why)


def sequences_at_4k(model: ModelInfo, target, precision: str, kv: str) -> tuple[int | None, str]:
    result = plan(model, target, precision, Workload(input_len=3072, output_len=1024, max_context=4096), kv)
    if isinstance(result, str):
        return None, result
    return result.max_concurrent_sequences, f"{result.memory.kv_cache_tokens} KV tokens ({result.kv_cache_dtype})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="rtx4090")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    target = get_target(args.target)
    refusals = []
    print(f"`trtpipe plan MODEL --target {target.name} --precision P [--kv-cache K]`, tp 1:\n")
    print("| model | precision | KV cache | weights GiB | longest context, 1 sequence | sequences of 4k at once |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        model = ModelInfo(name=name, source="preset", path=None, arch=PRESETS[name].arch)
        for precision, kv in ROWS:
            context, why_context = longest_context(model, target, precision, kv)
            count, why_count = sequences_at_4k(model, target, precision, kv)
            base = plan(model, target, precision, Workload(), kv)
            weights = f"{base.weights_bytes_per_rank / 2**30:.2f}" if not isinstance(base, str) else "—"
            limit = model_context_limit(model.arch)
            context_cell = ("does not fit" if context is None else
                            f"{context}" + (" (the model's limit)" if context == limit else ""))
            count_cell = "does not fit" if count is None else f"{count} ({why_count.split(' (')[0]})"
            kv_cell = base.kv_cache_dtype if not isinstance(base, str) else kv
            print(f"| {name} | {precision} | {kv_cell} | {weights} | {context_cell} | {count_cell} |")
            for why in {why_context, why_count if count is None else ""} - {""}:
                refusals.append(f"{name} {precision} (KV {kv}): {why}")
    if refusals:
        print("\nWhy not:")
        for line in refusals:
            print(f"- {line}")


if __name__ == "__main__":
    main()
