"""What observing the cpu target costs: its NVTX ranges with no tool attached, and `trtpipe profile`'s capture (the
stage ranges recorded + torch's profiler), side by side with the ranges off.

One SmolLM2 float32 repository (the cpu plan) served by three embedded Triton servers at once, differing only in
their environment: `TRTPIPE_NVTX=0` (no ranges: the baseline), the default (NVTX ranges through the `nvtx` package,
no-ops without a tool), and profiled (`TRTPIPE_PROFILE_DIR` with the capture file present throughout: what
`trtpipe profile` runs under). They are loaded in alternating rounds by validate's load generator, so machine noise
hits each alike. Printed per variant: output tokens/s, ITL p50 (the median of the rounds' p50s) and each one's ratio
to the baseline. The goal (issue 31): NVTX ranges cost <= 1% of ITL p50. Run it on an otherwise idle machine.

    .venv/bin/python benchmarks/bench_profile.py [--rounds 6] [--concurrency 1] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench_batching import smollm2_checkpoint

from pipeline.deploy import deploy_repository
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.runtime.profiling import STARTED_SUFFIX, TRACE_PREFIX
from pipeline.server import embedded_server
from pipeline.spans import CAPTURE_FILE, NVTX_ENV, PROFILE_DIR_ENV
from pipeline.targets import get_target
from pipeline.validate import DEFAULT_PROMPTS, EnsembleClient, run_level


def variants(workdir: Path) -> dict[str, dict[str, str]]:
    capture = workdir / "capture"
    capture.mkdir(exist_ok=True)
    return {"ranges off (TRTPIPE_NVTX=0)": {NVTX_ENV: "0"}, "NVTX ranges, no tool": {},
            "profiled (trtpipe profile)": {PROFILE_DIR_ENV: str(capture)}}


def start_capture(directory: Path, timeout: float = 120.0) -> None:
    (directory / CAPTURE_FILE).touch()
    deadline = time.monotonic() + timeout
    while not list(directory.glob(f"{TRACE_PREFIX}*{STARTED_SUFFIX}")):
        if time.monotonic() > deadline:
            raise RuntimeError("the profiled server's model did not start torch's profiler")
        time.sleep(0.1)


def range_cost_us(count: int = 200_000) -> float:
    """The cost of one NVTX range with no tool attached, timed in this process (microseconds)."""
    from pipeline import spans

    if spans._domain is None:
        raise RuntimeError("the nvtx package is not installed (or TRTPIPE_NVTX=0): no range to time")
    start = time.perf_counter()
    for _ in range(count):
        with spans.span("forward", rows=1):
            pass
    ranged = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(count):
        with spans._NO_SPAN:
            pass
    return (ranged - (time.perf_counter() - start)) / count * 1e6


#: ranges a decode step opens in the cpu model (schedule twice, forward, sample; runtime/generate.py serve_rows)
RANGES_PER_STEP = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "trtpipe-bench-profile")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = smollm2_checkpoint(args.workdir)
    repo = args.workdir / "repo"
    if not repo.exists():
        plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32")
        deploy_repository(plan, repo, checkpoint=checkpoint)
    environments = variants(args.workdir)
    measured: dict[str, list[dict]] = {name: [] for name in environments}
    with ExitStack() as stack:
        clients = {}
        for name, env in environments.items():
            server = stack.enter_context(embedded_server(repo, ready_timeout=900, environment=env))
            clients[name] = EnsembleClient(server, timeout=1800)
            clients[name].generate(DEFAULT_PROMPTS[0], 2)    # warm-up
            if PROFILE_DIR_ENV in env:
                start_capture(Path(env[PROFILE_DIR_ENV]))
        for r in range(args.rounds):
            for name in (environments if r % 2 == 0 else reversed(list(environments))):
                measured[name].append(run_level(clients[name], DEFAULT_PROMPTS, args.max_tokens, args.concurrency,
                                                args.requests_per_client))
                print(f"round {r + 1}/{args.rounds} {name}: {measured[name][-1]['output_tokens_per_s']:.2f} tok/s",
                      flush=True)
    baseline = None
    print(f"\nSmolLM2-135M float32, cpu plan, concurrency {args.concurrency}, {args.max_tokens} tokens per request, "
          f"{args.rounds} alternating rounds")
    print(f"{'variant':<30} {'tok/s':>8} {'ITL p50 ms':>11} {'tok/s ratio':>12} {'ITL p50 ratio':>14}")
    for name, rounds in measured.items():
        tokens = sum(r["output_tokens"] for r in rounds) / sum(r["wall_s"] for r in rounds)
        itl = statistics.median(r["itl_ms"]["p50"] for r in rounds)
        baseline = baseline or (tokens, itl)
        print(f"{name:<30} {tokens:>8.2f} {itl:>11.2f} {tokens / baseline[0]:>12.4f} {itl / baseline[1]:>14.4f}")
    cost = range_cost_us()
    print(f"\none NVTX range, no tool attached: {cost:.3f} us; {RANGES_PER_STEP} per decode step = "
          f"{RANGES_PER_STEP * cost / (baseline[1] * 1000):.5%} of the baseline's ITL p50")


if __name__ == "__main__":
    main()
