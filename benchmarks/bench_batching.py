"""Dynamic batching on the cpu-target SmolLM2 deployment: output tokens/s at concurrency 8, side by side.

The same checkpoint and plan deployed twice — Triton max_batch_size 8 (the plan's dynamic batching) and
max_batch_size 1 — both served by embedded Triton servers at once and loaded in alternating rounds by 8
concurrent streaming clients (the load generator of `trtpipe validate --load-test`), so that other load
on the machine affects both alike. Goal: >= 2x with batching.

    .venv/bin/python benchmarks/bench_batching.py [--checkpoint DIR] [--rounds 2] [--requests-per-client 2]

Without --checkpoint SmolLM2 is converted to a float32 checkpoint (cached in --workdir).
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.plan import load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.server import embedded_server
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.validate import DEFAULT_PROMPTS, EnsembleClient, run_level
from pipeline.validate.energy import meter_for

CONCURRENCY = 8


def smollm2_checkpoint(workdir: Path) -> Path:
    out = workdir / "checkpoint"
    if not (out / "config.json").exists():
        convert_model(resolve_model(str(resolve_model("smollm2-135m").hf_dir())), out, dtype="float32",
                      progress=False)
    return out


def plan_with_batch_size(plan_path: Path, batch_size: int, out: Path) -> Path:
    """The plan with its Triton batching limited to `batch_size` (everything else unchanged)."""
    data = json.loads(plan_path.read_text())
    data["triton"].update(triton_max_batch_size=batch_size,
                          preferred_batch_size=[b for b in data["triton"]["preferred_batch_size"] if b <= batch_size]
                          or [batch_size])
    out.write_text(json.dumps(data, indent=2))
    return out


def merge_rounds(rounds: list[dict]) -> dict:
    """One variant's rounds as one measurement: tokens/s over the summed wall time, worst-round percentiles."""
    merged = dict(rounds[-1])
    for key in ("requests", "completed", "shed", "failed", "output_tokens", "wall_s"):
        merged[key] = sum(r[key] for r in rounds)
    merged["output_tokens_per_s"] = merged["output_tokens"] / merged["wall_s"]
    for key in ("ttft_ms", "itl_ms", "latency_ms"):
        merged[key] = {q: max(r[key][q] or 0 for r in rounds) for q in ("p50", "p90", "p99")}
    energies = [r.get("energy") for r in rounds]
    if all(e and e["joules"] is not None for e in energies):
        joules = sum(e["joules"] for e in energies)
        merged["energy"] = {**energies[-1], "joules": joules,
                            "joules_per_output_token": joules / merged["output_tokens"] if merged["output_tokens"]
                            else None}
    merged["rounds"] = rounds
    return merged


def measure_side_by_side(repos: dict, rounds: int, requests_per_client: int, max_tokens: int,
                         label: str = "max_batch_size ") -> dict:
    """Both repositories served at once and loaded in alternation, so machine noise hits both alike
    (benchmarks/bench_cpu_runtime.py uses it too; `label` + a key of `repos` names each in the progress)."""
    with ExitStack() as stack:
        clients, meters = {}, {}
        for batch_size, repo in repos.items():
            server = stack.enter_context(embedded_server(repo, ready_timeout=900))
            clients[batch_size] = EnsembleClient(server, timeout=1800)
            meters[batch_size] = meter_for(server)   # the machine's energy while this variant's window runs
            clients[batch_size].generate(DEFAULT_PROMPTS[0], 2)  # warm-up: first-request costs are not batching
        measured: dict[int, list[dict]] = {b: [] for b in repos}
        for i in range(rounds):
            for batch_size, client in clients.items():
                measured[batch_size].append(run_level(client, DEFAULT_PROMPTS, max_tokens, CONCURRENCY,
                                                      requests_per_client, meters[batch_size]))
                print(f"round {i + 1}/{rounds} {label}{batch_size}: "
                      f"{measured[batch_size][-1]['output_tokens_per_s']:.2f} tokens/s", flush=True)
    return {b: merge_rounds(r) for b, r in measured.items()}


def print_side_by_side(results: dict, variants: dict, width: int) -> None:
    """One row per figure, the two variants (result key -> column title) side by side, tokens/s as a ratio."""
    (a, a_title), (b, b_title) = variants.items()
    print(f"{'':24}{a_title:>{width}}{b_title:>{width}}{'ratio':>8}")
    rows = [("output tokens/s", "output_tokens_per_s", "{:.2f}"),
            ("request latency p50 ms", "latency_ms.p50", "{:.0f}"),
            ("TTFT p50 ms", "ttft_ms.p50", "{:.0f}"), ("ITL p50 ms", "itl_ms.p50", "{:.0f}"),
            ("requests failed", "failed", "{}"), ("requests shed", "shed", "{}")]
    for label, key, fmt in rows:
        values = [lookup(results[v], key) for v in (a, b)]
        ratio = f"{values[0] / values[1]:.2f}x" if key == "output_tokens_per_s" and values[1] else ""
        print(f"{label:24}{fmt.format(values[0]):>{width}}{fmt.format(values[1]):>{width}}{ratio:>8}")
    energy = [(results[v].get("energy") or {}).get("joules_per_output_token") for v in (a, b)]
    cells = [f"{e:.4g}" if e is not None else "n/a" for e in energy]
    print(f"{'J per output token':24}{cells[0]:>{width}}{cells[1]:>{width}}")
    if None in energy:
        reason = (results[a].get("energy") or results[a]["rounds"][-1].get("energy") or {}).get("reason")
        print(f"  energy not measured: {reason}")


def side_by_side_arguments(description: str, workdir: str,
                           more: Callable[[argparse.ArgumentParser], None] | None = None
                           ) -> tuple[argparse.Namespace, Path]:
    """The options every side-by-side serving benchmark takes (and the ones `more` adds), parsed, and the
    checkpoint it serves (SmolLM2 converted into the work directory unless --checkpoint names one)."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path(workdir))
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurements of each variant")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    return args, args.checkpoint or smollm2_checkpoint(args.workdir)


def main() -> None:
    args, checkpoint = side_by_side_arguments(__doc__.splitlines()[0], "/tmp/trtpipe-bench-batching")
    plan = save_plan(make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32"),
                     args.workdir / "plan.json")

    repos = {}
    for batch_size in (8, 1):
        variant_plan = plan_with_batch_size(plan, batch_size, args.workdir / f"plan-mbs{batch_size}.json")
        repos[batch_size] = deploy_repository(load_plan(variant_plan), args.workdir / f"repo-mbs{batch_size}",
                                              checkpoint=checkpoint, force=True).path
    results = measure_side_by_side(repos, args.rounds, args.requests_per_client, args.max_tokens)

    print(f"\nSmolLM2 cpu target, concurrency {CONCURRENCY}, {args.rounds} rounds x {args.requests_per_client} "
          f"requests/client, {args.max_tokens} tokens each (percentiles: worst round)")
    print_side_by_side(results, {8: "max_batch_size 8", 1: "max_batch_size 1"}, width=18)
    (args.workdir / "bench_batching.json").write_text(json.dumps(results, indent=2))
    print(f"\nraw numbers: {args.workdir / 'bench_batching.json'}")


def lookup(result: dict, dotted: str):
    for part in dotted.split("."):
        result = result[part]
    return result


if __name__ == "__main__":
    main()
