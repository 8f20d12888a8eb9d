"""`trtpipe tune` on the cpu-target SmolLM2 deployment: the tuned configuration's output tokens/s at the SLO
against the plan's own configuration under the same load, side by side in one run.

1. `trtpipe build smollm2-135m --target cpu --precision fp8` (the README's main job) writes the build directory
   (--workdir/build; a build already there is reused, as build itself re-runs nothing that is up to date).
2. `trtpipe tune` runs a fixed budget of trials (--trials) against --slo with the concurrency sweep.
3. The plan's repository and the tuned one (tune/result/model_repo) are served by two embedded Triton servers
   at once and loaded in alternating rounds with the same sweep (validate's load generator), so other load on
   the machine hits both alike; each variant's figure is its best level meeting the SLO.

Goal: >= 1.3x, or a statement, backed by the trial table, that the plan's configuration was already on the
Pareto front (throughput against P99 TTFT over every measured level).

    .venv/bin/python benchmarks/bench_tune.py [--trials 6] [--slo "ttft_p99<=1s,itl_p99<=300ms"] [--rounds 2]
                                              [--precision fp8] [--samples N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from contextlib import ExitStack
from pathlib import Path

from bench_batching import merge_rounds

from pipeline.build import BuildOptions, build as run_build
from pipeline.server import embedded_server
from pipeline.tune import parse_slo, tune, tune_options
from pipeline.tune.slo import Slo, best_level
from pipeline.validate import EnsembleClient, run_level

GOAL = 1.3
VARIANTS = {"default": "plan's configuration", "tuned": "tuned"}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp8", help="the build's --precision (cpu target)")
    parser.add_argument("--samples", type=int, default=None, help="the build's calibration samples")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-tune"))
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--slo", default="ttft_p99<=1s,itl_p99<=300ms")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating side-by-side measurements")
    parser.add_argument("--resume", action="store_true", help="keep the study of an earlier run (else start afresh)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    return args


def prepare_build(args: argparse.Namespace) -> Path:
    """`trtpipe build smollm2-135m --target cpu --precision P -o WORKDIR/build`: what a user tunes."""
    out = args.workdir / "build"
    summary = run_build(BuildOptions(model="smollm2-135m", target="cpu", precision=args.precision, out=out,
                                     calibration_samples=args.samples, progress=False),
                        say=lambda message: print(message, flush=True))
    if summary.passed is False:
        raise SystemExit(f"the build did not validate: {summary.verdict}")
    if not args.resume:
        shutil.rmtree(out / "tune", ignore_errors=True)
    return out


def measure_side_by_side(repos: dict[str, Path], concurrencies: tuple[int, ...], rounds: int, load) -> dict:
    """Both repositories served at once; every round runs each level on each variant in turn."""
    with ExitStack() as stack:
        clients = {}
        for name, repo in repos.items():
            clients[name] = EnsembleClient(stack.enter_context(embedded_server(repo, ready_timeout=900)), timeout=1800)
            clients[name].generate(load.prompts[0], 2)
        measured = {name: {c: [] for c in concurrencies} for name in repos}
        for i in range(rounds):
            for concurrency in concurrencies:
                for name, client in clients.items():
                    result = run_level(client, load.prompts, load.max_tokens, concurrency, load.requests_per_client)
                    measured[name][concurrency].append(result)
                    print(f"round {i + 1}/{rounds} concurrency {concurrency} {name}: "
                          f"{result['output_tokens_per_s']:.2f} tokens/s, TTFT p99 {result['ttft_ms']['p99']:.0f} ms",
                          flush=True)
    return {name: [merge_rounds(r) for r in levels.values()] for name, levels in measured.items()}


def print_levels(results: dict, slo: Slo) -> None:
    print(f"\n{'concurrency':>11} {'variant':>22} {'tokens/s':>9} {'TTFT p99':>9} {'ITL p99':>8} {'failed':>6}  SLO")
    for i, concurrency in enumerate(results["default"]):
        for name, title in VARIANTS.items():
            lv = results[name][i]
            print(f"{lv['concurrency']:>11} {title:>22} {lv['output_tokens_per_s']:>9.2f} {lv['ttft_ms']['p99']:>9.0f}"
                  f" {lv['itl_ms']['p99']:>8.0f} {lv['failed'] + lv['shed']:>6}  {'meets' if slo.meets(lv) else '-'}")


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    args = arguments()
    print(f"load before: {load_average()}", flush=True)
    build = prepare_build(args)
    options = tune_options(slo=args.slo, concurrency=args.concurrency, prompts=None, num_prompts=16,
                           max_tokens=args.max_tokens, requests_per_client=args.requests_per_client,
                           load_generator="builtin", trials=args.trials, out=build / "tune", progress=False)
    result = tune(build, options, say=lambda message: print(message, flush=True))
    print(result.render(), flush=True)
    print(f"load after the study: {load_average()}", flush=True)
    summary = json.loads((build / "tune" / "result" / "summary.json").read_text())
    if not result.met:
        print(f"\nno trial met the SLO {args.slo}: nothing to compare (closest: trial {summary['closest']['trial']})")
        raise SystemExit(1)

    slo = parse_slo(args.slo)
    repos = {"default": build / "model_repo", "tuned": build / "tune" / "result" / "model_repo"}
    results = measure_side_by_side(repos, options.load.concurrencies, args.rounds, options.load)
    print(f"\nSmolLM2 cpu target, SLO {slo.text()}, {args.trials} trials, sweep {list(options.load.concurrencies)} x "
          f"{args.requests_per_client} requests/client x {args.max_tokens} tokens, {args.rounds} alternating rounds "
          f"(percentiles: worst round); tuned = trial {summary['best']['trial']}: {summary['best']['params']}")
    print_levels(results, slo)
    at_slo = {name: best_level(levels, slo) for name, levels in results.items()}
    figures = {name: lv["output_tokens_per_s"] if lv else 0.0 for name, lv in at_slo.items()}
    ratio = figures["tuned"] / figures["default"] if figures["default"] else float("inf")
    print(f"\noutput tokens/s at the SLO: tuned {figures['tuned']:.2f} vs plan's {figures['default']:.2f} = "
          f"{ratio:.2f}x (goal >= {GOAL:g}x: {'met' if ratio >= GOAL else 'NOT met'})")
    if ratio < GOAL:
        on_front = summary["default_on_pareto_front"]
        print(f"the plan's configuration (trial {summary['plan_default']['trial']}) is "
              f"{'ON' if on_front else 'NOT on'} the Pareto front of the trial table "
              f"({build / 'tune' / 'result' / 'trials.csv'}; plot tradeoff.png)")
    print(f"load after: {load_average()}")
    (args.workdir / "bench_tune.json").write_text(json.dumps({"slo": slo.text(), "ratio": ratio,
                                                             "build": str(build), "precision": args.precision,
                                                             "figures": figures,
                                                             "side_by_side": results, "study": summary}, indent=2,
                                                            default=str))
    print(f"raw numbers: {args.workdir / 'bench_tune.json'}")


if __name__ == "__main__":
    main()
