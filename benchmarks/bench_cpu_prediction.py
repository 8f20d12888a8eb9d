"""The cpu plan's predicted TTFT/TPOT/output tokens/s against measured, before and after one `--measured` correction.

The SmolLM2 cpu deployment is served by the embedded Triton server and loaded twice with validate's load generator
(streamed requests, closed-loop clients): run A (the correction is fitted to it, as `trtpipe plan --measured
load_test.json` fits it) and run B, a held-out run with other concurrencies and a longer output. Printed per level of
run B: measured, predicted by the plan as built (the reference runtime timed on this host) and predicted after the
correction, with the errors; then the median error per figure. Goal: <= 15% after. Run it on an otherwise idle
machine.

    .venv/bin/python benchmarks/bench_cpu_prediction.py [--build DIR] [--workdir DIR]

--build: a `trtpipe build ... --target cpu` output (plan.json, model_repo/); without it SmolLM2 is converted to a
float32 checkpoint, planned and deployed in --workdir.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.model_repository import read_repository
from pipeline.plan import load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan, replan
from pipeline.plan.feedback import Measurements, correct, measured_on, observed, predict_level
from pipeline.server import embedded_server
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.validate import DEFAULT_PROMPTS, EnsembleClient, run_level
from pipeline.validate.load_test import with_predictions

RUN_A = {"concurrencies": (1, 2, 4), "max_tokens": 24}
RUN_B = {"concurrencies": (1, 3, 6), "max_tokens": 40}
#: requests each client sends back to back: enough that the clients' steady grouping dominates the medians
REQUESTS_PER_CLIENT = 4


def deployment(workdir: Path) -> tuple[Path, Path]:
    """(plan.json, model_repo) of SmolLM2 float32 on the cpu target, made in `workdir` once."""
    plan_path, repo = workdir / "plan.json", workdir / "model_repo"
    if not repo.is_dir():
        hf_dir = resolve_model("smollm2-135m").hf_dir()
        checkpoint = convert_model(resolve_model(str(hf_dir)), workdir / "checkpoint", dtype="float32",
                                   progress=False).path
        plan = make_plan(resolve_model_info(str(hf_dir)), get_target("cpu"), "fp32")
        save_plan(plan, plan_path)
        deploy_repository(plan, repo, checkpoint=checkpoint, tokenizer=hf_dir)
    return plan_path, repo


def run(client, plan, tokenizer: Path, concurrencies, max_tokens: int) -> list[dict]:
    levels = [run_level(client, DEFAULT_PROMPTS, max_tokens, c, REQUESTS_PER_CLIENT) for c in concurrencies]
    return with_predictions(levels, plan, tokenizer, DEFAULT_PROMPTS)


def error(predicted: float, measured: float | None) -> float | None:
    return None if not measured else predicted / measured - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-cpu-prediction"))
    args = parser.parse_args()
    if args.build:
        plan_path, repo = args.build / "plan.json", args.build / "model_repo"
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        plan_path, repo = deployment(args.workdir)
    plan = replan(load_plan(plan_path))   # this trtpipe's figures for the plan, timed on this host
    p = plan.performance
    t = p.phases
    print(f"plan: {plan.model.name} {plan.precision} on {plan.target.name}, batch {p.batch}; {p.source}: prefill "
          + ", ".join(f"{s * 1e3:.0f} ms ({n} tokens)" for n, s in zip(t["prefill_tokens"], t["prefill_s"]))
          + f"; decode step {t['decode_fixed_s'] * 1e3:.1f} ms + {t['decode_per_sequence_s'] * 1e3:.2f} ms a sequence "
          + f"+ {t['decode_per_context_token_s'] * 1e6:.2f} us a sequence-token of context; {p.basis}")
    tokenizer = read_repository(repo).tokenizer
    with embedded_server(repo, ready_timeout=600) as server:
        client = EnsembleClient(server, timeout=600)
        client.generate(DEFAULT_PROMPTS[0], 2)   # warm-up
        fit_levels = run(client, plan, tokenizer, **RUN_A)
        held_out = run(client, plan, tokenizer, **RUN_B)
    fixed = correct(plan, Measurements(fit_levels, measured_on(plan), "run A"))
    c = fixed.performance.correction
    print(f"correction from run A (concurrency {RUN_A['concurrencies']}, {RUN_A['max_tokens']} tokens): prefill "
          f"x{c['prefill']:.3f}, decode x{c['decode']:.3f}")
    print(f"\nrun B (held out: concurrency {RUN_B['concurrencies']}, {RUN_B['max_tokens']} tokens)")
    header = ("conc", "figure", "measured", "before", "err before", "after", "err after")
    print("  ".join(f"{h:>11}" for h in header))
    errors: dict[tuple[str, str], list[float]] = {}
    for level in held_out:
        seen = observed(level, plan.workload.input_len)
        if seen is None:
            print(f"{level['concurrency']:>11}  nothing completed: {level['errors']}")
            continue
        before, after = predict_level(plan, seen.load), predict_level(fixed, seen.load)
        for figure, measured, b, a in (("TTFT ms", seen.ttft_s * 1e3, before.ttft_s * 1e3, after.ttft_s * 1e3),
                                       ("TPOT ms", (seen.itl_s or 0) * 1e3, before.tpot_s * 1e3, after.tpot_s * 1e3),
                                       ("tokens/s", seen.output_tokens_per_s, before.output_tokens_per_s,
                                        after.output_tokens_per_s)):
            eb, ea = error(b, measured), error(a, measured)
            errors.setdefault((figure, "before"), []).append(abs(eb))
            errors.setdefault((figure, "after"), []).append(abs(ea))
            print(f"{level['concurrency']:>11}  {figure:>11}  {measured:>11.1f}  {b:>11.1f}  {eb:>+10.1%}  "
                  f"{a:>11.1f}  {ea:>+10.1%}")
    print("\nmedian |error| on run B   before   after   (goal after: <= 15%)")
    for figure in ("TTFT ms", "TPOT ms", "tokens/s"):
        b, a = statistics.median(errors[(figure, "before")]), statistics.median(errors[(figure, "after")])
        print(f"{figure:>24}   {b:>6.1%}  {a:>6.1%}  {'met' if a <= 0.15 else 'NOT met'}")


if __name__ == "__main__":
    main()
