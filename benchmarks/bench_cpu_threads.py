"""How many compute threads the cpu target's model should use: SmolLM2 served with one core fewer than the machine
has, with all of them, and with all of them sleeping between parallel regions, side by side.

Per runtime (torch, ONNX Runtime) the same float32 checkpoint and plan are deployed three times, differing only in
the tensorrt_llm model's `intra_op_threads` (cores - 1, or every core) and, for the third, passive waiting (ONNX
Runtime: the parameter `intra_op_spinning` false; torch: OMP_WAIT_POLICY=PASSIVE in that server's environment).
All three are served by embedded Triton servers at once and loaded in alternating rounds at concurrency 1 and 8 by
validate's load generator (streamed requests), so machine noise hits each alike. Printed per variant and level:
output tokens/s, TTFT p50, ITL p50 and the cores the whole machine was busy on meanwhile (/proc/stat; the load
generator included). Run it on an otherwise idle machine.

    .venv/bin/python benchmarks/bench_cpu_threads.py [--runtime onnxruntime torch] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import ExitStack
from pathlib import Path

from bench_batching import merge_rounds, smollm2_checkpoint
from bench_cpu_serving import set_model_parameters

from pipeline.deploy import deploy_repository
from pipeline.host import INTRA_OP_SPINNING
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.server import embedded_server
from pipeline.targets import get_target
from pipeline.validate import DEFAULT_PROMPTS, EnsembleClient, run_level

CORES = len(os.sched_getaffinity(0))
#: variant -> (intra_op_threads, passive waiting)
VARIANTS = {f"{max(1, CORES - 1)} thread(s)": (max(1, CORES - 1), False), f"{CORES} threads": (CORES, False),
            f"{CORES} threads, passive": (CORES, True)}


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def variant_repo(plan, checkpoint: Path, runtime: str, threads: int, passive: bool, out: Path) -> Path:
    """The plan deployed with the runtime, its tensorrt_llm model computing with `threads` threads."""
    repo = deploy_repository(plan, out, checkpoint=checkpoint, runtime=runtime, force=True).path
    parameters = {"intra_op_threads": str(threads)}
    if passive and runtime == "onnxruntime":
        parameters[INTRA_OP_SPINNING] = "false"
    set_model_parameters(repo, parameters)
    return repo


def measure(runtime: str, checkpoint: Path, args: argparse.Namespace) -> dict:
    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32")
    results: dict[str, dict[int, list]] = {v: {c: [] for c in args.concurrency} for v in VARIANTS}
    with ExitStack() as stack:
        clients = {}
        for i, (variant, (threads, passive)) in enumerate(VARIANTS.items()):
            repo = variant_repo(plan, checkpoint, runtime, threads, passive, args.workdir / f"repo-{runtime}-{i}")
            saved = os.environ.get("OMP_WAIT_POLICY")
            if passive and runtime == "torch":
                os.environ["OMP_WAIT_POLICY"] = "PASSIVE"   # the server's environment is this process's, at start
            try:
                server = stack.enter_context(embedded_server(repo, ready_timeout=900))
            finally:
                os.environ.pop("OMP_WAIT_POLICY", None) if saved is None else os.environ.update(OMP_WAIT_POLICY=saved)
            clients[variant] = EnsembleClient(server, timeout=1800)
            clients[variant].generate(DEFAULT_PROMPTS[0], 2)    # warm-up
        for r in range(args.rounds):
            for concurrency in args.concurrency:
                for variant, client in clients.items():
                    before = busy_jiffies()
                    level = run_level(client, DEFAULT_PROMPTS, args.max_tokens, concurrency, args.requests_per_client)
                    after = busy_jiffies()
                    level["cores_busy"] = CORES * (after[0] - before[0]) / max(1, after[1] - before[1])
                    results[variant][concurrency].append(level)
                    print(f"round {r + 1}/{args.rounds} {runtime} {variant} c={concurrency}: "
                          f"{level['output_tokens_per_s']:.2f} tokens/s, {level['cores_busy']:.2f} cores busy",
                          flush=True)
    return {v: {c: {**merge_rounds(rounds), "cores_busy": sum(x["cores_busy"] for x in rounds) / len(rounds)}
                for c, rounds in levels.items()} for v, levels in results.items()}


def print_table(runtime: str, results: dict, concurrencies) -> None:
    print(f"\n{runtime}: SmolLM2 float32 on the cpu target ({CORES} cores); tokens/s over all rounds, percentiles: "
          "the worst round, cores busy: the mean")
    print(f"{'variant':28}{'c':>3}{'tokens/s':>10}{'TTFT p50':>10}{'ITL p50':>9}{'cores':>7}{'vs first':>10}")
    first = next(iter(results))
    for variant, levels in results.items():
        for c in concurrencies:
            m = levels[c]
            ratio = m["output_tokens_per_s"] / results[first][c]["output_tokens_per_s"]
            print(f"{variant:28}{c:>3}{m['output_tokens_per_s']:>10.2f}{m['ttft_ms']['p50']:>10.0f}"
                  f"{m['itl_ms']['p50']:>9.1f}{m['cores_busy']:>7.2f}{ratio:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", nargs="+", choices=("onnxruntime", "torch"), default=["onnxruntime", "torch"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-cpu-threads"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = smollm2_checkpoint(args.workdir)
    everything = {}
    for runtime in args.runtime:
        everything[runtime] = measure(runtime, checkpoint, args)
        print_table(runtime, everything[runtime], args.concurrency)
    (args.workdir / "bench_cpu_threads.json").write_text(json.dumps(everything, indent=2, default=str))
    print(f"\nraw numbers: {args.workdir / 'bench_cpu_threads.json'}")


if __name__ == "__main__":
    main()
