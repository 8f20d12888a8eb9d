"""trtpipe plan's predictions beside NVIDIA's AIConfigurator (aiconfigurator-core 0.12.0), side by side in one run.

1. Integration: Llama-3.1-8B and Qwen3-8B, fp8 (+fp8 KV) and bf16, tp 1, ISL/OSL 1024/256 and 2048/128, batch
   1/8/32/64 and the plan's own largest, on l40s, h100, h200. trtpipe's plan (`--max-batch-size B`, or free for
   "max") is compared with AIC's SDK asked directly for the same configuration (the plan's max_num_tokens):
   prefill, decode step, serving TTFT/TPOT, output tokens/s. Goal: within 5% (the integration is faithful); and
   no plan AIC's own memory check calls out of memory. "before" is the speed-of-light roofline the planner used
   to state (its decode step, prefill and batch/step tokens/s against AIC's measured figures).
2. Derivation: h200 derived from h100's data (same GH100 chip, other memory) against AIC's own h200 data, per
   figure over the same grid. Goal: median error <= 10%, worst <= 20%. The same method gives rtx4090 from l40s.

    .venv/bin/python benchmarks/bench_planner.py [--quick]

The cpu target's measured-feedback loop (issue 24 item 8) is not implemented; this script does not measure it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from pipeline.errors import UserError
from pipeline.plan import Overrides, Workload, resolve_model_info
from pipeline.planner import make_plan
from pipeline.plan.performance import MEASURED, Workpoint, derived_estimate, estimate
from pipeline.presets import PRESETS
from pipeline.targets import get_target

MODELS = ("llama-3.1-8b", "qwen3-8b")
PRECISIONS = (("fp8", "fp8"), ("bf16", "auto"))
WORKLOADS = ((1024, 256), (2048, 128))
BATCHES = (1, 8, 32, 64, None)          # None: the plan's own largest batch
TARGETS = ("l40s", "h100", "h200")
FIGURES = ("prefill_s", "decode_step_s", "ttft_s", "tpot_s", "output_tokens_per_s")


def direct(system: str, version: str, model_name: str, precision: str, fp8_fmha: bool, batch: int, isl: int,
           osl: int, tokens: int) -> dict:
    """AIC's SDK asked directly (not through trtpipe's adapter): the oracle of part 1."""
    import logging

    from aiconfigurator_core.sdk import common, config
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database_view

    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    gemm, kv = (common.GEMMQuantMode.fp8, common.KVCacheQuantMode.fp8) if precision == "fp8" else (
        common.GEMMQuantMode.bfloat16, common.KVCacheQuantMode.bfloat16)
    fmha = common.FMHAQuantMode.fp8 if fp8_fmha else common.FMHAQuantMode.bfloat16
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(PRESETS[model_name].hf_config))
        model = get_model(d, config.ModelConfig(tp_size=1, pp_size=1, gemm_quant_mode=gemm, kvcache_quant_mode=kv,
                                                fmha_quant_mode=fmha), "trtllm")
    db = get_database_view(system, "trtllm", version)

    def static(b: int):
        rc = config.RuntimeConfig(batch_size=b, beam_width=1, isl=isl, osl=osl, prefix=0)
        return get_backend("trtllm").run_static(model, db, rc, mode="static").get_summary_df().iloc[0]

    agg = get_backend("trtllm").run_agg(model, db, config.RuntimeConfig(batch_size=batch, isl=isl, osl=osl),
                                        ctx_tokens=max(1, min(tokens - batch, batch * isl)), max_num_tokens=tokens,
                                        free_gpu_memory_fraction=0.9)
    served = agg.get_result_dict()
    return {"prefill_s": static(1)["ttft"] / 1e3, "decode_step_s": static(batch)["tpot"] / 1e3,
            "ttft_s": served["ttft"] / 1e3, "tpot_s": served["tpot"] / 1e3,
            "output_tokens_per_s": served["tokens/s/gpu"], "oom": bool(agg.check_oom())}


def own_batch(info, target: str, precision: str, kv: str, isl: int, osl: int) -> int:
    """The batch trtpipe's own memory model plans (the planner as it was, without AIC)."""
    from pipeline.plan import performance

    real = performance.aic

    def missing():
        raise ImportError("aiconfigurator-core left out")

    performance.aic = missing
    try:
        return make_plan(info, get_target(target), precision, kv,
                         workload=Workload(input_len=isl, output_len=osl)).build_config.max_batch_size
    finally:
        performance.aic = real


def grid(quick: bool):
    for target in TARGETS[:1] if quick else TARGETS:
        for model in MODELS[:1] if quick else MODELS:
            for precision, kv in PRECISIONS:
                for isl, osl in WORKLOADS[:1] if quick else WORKLOADS:
                    for batch in BATCHES:
                        yield target, model, precision, kv, isl, osl, batch


def part1(quick: bool) -> tuple[list, list]:
    rows, points = [], []
    print("1. trtpipe plan vs aiconfigurator-core (the same configuration asked directly); ratio trtpipe/AIC")
    print(f"{'target':8} {'model':13} {'prec':5} {'isl/osl':9} {'batch':>5} | {'prefill':>7} {'step':>6} "
          f"{'TTFT':>6} {'TPOT':>6} {'tok/s':>6} | AIC OOM | before: {'step':>5} {'prefill':>7} {'tok/s':>6}")
    for target, model, precision, kv, isl, osl, batch in grid(quick):
        info = resolve_model_info(model)
        try:
            plan = make_plan(info, get_target(target), precision, kv, workload=Workload(input_len=isl, output_len=osl),
                             overrides=Overrides(max_batch_size=batch))
        except UserError as exc:
            print(f"{target:8} {model:13} {precision:5} {isl}/{osl:<5} {batch or 'max':>5} | refused: {exc}"[:160])
            continue
        p = plan.performance
        system, version = MEASURED[target]
        fp8_fmha = bool(plan.plugin_config.use_fp8_context_fmha)
        want = direct(system, version, model, precision, fp8_fmha, p.batch, isl, osl, p.max_num_tokens)
        ratios = [getattr(p, f) / want[f] for f in FIGURES]
        before = (plan.roofline.decode_step_s / want["decode_step_s"], plan.roofline.prefill_s_per_request /
                  want["prefill_s"], plan.roofline.decode_tokens_per_s_aggregate / want["output_tokens_per_s"])
        if batch is None:   # the largest batch: what the planner without AIC planned, and AIC's memory verdict on it
            old = own_batch(info, target, precision, kv, isl, osl)
            old_oom = direct(system, version, model, precision, fp8_fmha, old, isl, osl, p.max_num_tokens)["oom"]
            before = (*before, f"own max batch {old}{' (AIC: out of memory)' if old_oom else ''}")
        rows.append((ratios, want["oom"], before))
        points.append((target, Workpoint(info.arch, precision, plan.kv_cache_dtype, fp8_fmha, 1, 1, p.batch, isl,
                                         osl, p.max_num_tokens)))
        print(f"{target:8} {model:13} {precision:5} {isl}/{osl:<5} {p.batch:>5} | "
              + " ".join(f"{r:6.3f}" for r in ratios) + f" | {'yes' if want['oom'] else 'no':>7} | "
              + f"{before[0]:13.2f} {before[1]:7.2f} {before[2]:6.2f} {before[3] if len(before) > 3 else ''}")
    flat = [r for ratios, _, _ in rows for r in ratios]
    print(f"   {len(rows)} plans: trtpipe/AIC {min(flat):.4f}..{max(flat):.4f} (goal: within 5%); "
          f"AIC calls {sum(oom for _, oom, _ in rows)} of them out of memory (goal: 0)")
    steps = [b[0] for _, _, b in rows]
    prefills = [b[1] for _, _, b in rows]
    print(f"   before (the roofline): decode step {min(steps):.2f}..{max(steps):.2f}x AIC's measured, prefill "
          f"{min(prefills):.2f}..{max(prefills):.2f}x")
    return rows, points


def part2(points: list) -> None:
    print("\n2. h200 derived from h100's data vs aiconfigurator-core's own h200 data (relative error per figure)")
    errors = {f: [] for f in FIGURES}
    h200 = get_target("h200")
    for target, point in points:
        if target != "h200":
            continue
        derived, measured = derived_estimate(h200, "h100", point), estimate(h200, point)
        for f in FIGURES:
            errors[f].append(abs(getattr(derived, f) / getattr(measured, f) - 1))
    for f, values in errors.items():
        if values:
            print(f"   {f:20} median {statistics.median(values):6.1%}  worst {max(values):6.1%}  ({len(values)} plans)")
    every = [v for values in errors.values() for v in values]
    if every:
        print(f"   all figures: median {statistics.median(every):.1%}, worst {max(every):.1%} (goal: <= 10%, <= 20%)")
    print("\n   rtx4090 derived from l40s (same method), Llama-3.1-8B 1024/256:")
    rtx = get_target("rtx4090")
    for precision, kv in (("fp8", "fp8"), ("bf16", "bfloat16")):
        for batch in (1, 32):
            point = Workpoint(resolve_model_info("llama-3.1-8b").arch, precision, kv, precision == "fp8", 1, 1,
                              batch, 1024, 256, 8192)
            e = estimate(rtx, point)
            l40s = estimate(get_target("l40s"), replace(point))
            print(f"   {precision:5} batch {batch:>3}: prefill {e.prefill_s * 1e3:7.1f} ms "
                  f"(l40s {l40s.prefill_s * 1e3:6.1f}), "
                  f"step {e.decode_step_s * 1e3:6.2f} ms (l40s {l40s.decode_step_s * 1e3:6.2f}), "
                  f"{e.output_tokens_per_s:6.0f} tok/s, memory {e.memory_bytes['total'] / 2**30:5.1f} of "
                  f"{e.capacity_bytes / 2**30:.1f} GiB{' (does not fit)' if e.out_of_memory else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one target, one model, one workload")
    args = parser.parse_args()
    _, points = part1(args.quick)
    if not args.quick:
        part2(points)


if __name__ == "__main__":
    main()
