"""What the OpenAI front costs: one server, two doors, one load generator.

SmolLM2-135M's cpu repository (float32, ONNX Runtime by default: the fastest cpu server, where the front's share of
the work is largest; --runtime torch for the other; deployed into --workdir) is served by the embedded Triton with
trtpipe's OpenAI front beside it, in one process, as `trtpipe serve --openai` runs them. NVIDIA's aiperf 0.13 loads it
through each door with one command line apart from the endpoint (`pipeline.validate.aiperf.aiperf_command`:
synthetic prompts of --input-tokens tokens, --output-tokens output tokens pinned with min_tokens, streaming,
greedy):

    triton   Triton's generate_stream on the ensemble (trtpipe's request template, top_k 1, min_tokens)
    openai   the front's /v1/completions (model `ensemble`, temperature 0, min_tokens: vLLM's extension the front
             maps onto the ensemble's input), streamed

The doors take turns for --rounds rounds at each --concurrency; printed per round and door: output tokens/s, TTFT
p50, ITL p50, then per concurrency the openai/triton ratios of tokens/s and ITL p50 with their medians over the
rounds (this VM's speed drifts between minutes: the median of alternating turns is the figure to read). Issue 50's
goal: at concurrency 8, tokens/s >= 0.95x and ITL p50 <= 1.05x the triton door's. Run it on an otherwise idle
machine: the server, the front and aiperf share its cores.

    .venv/bin/python benchmarks/bench_openai_front.py [--concurrency 1 8] [--rounds 3] [--requests 24]
        [--runtime onnxruntime|torch]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pipeline.deploy import deploy_repository
from pipeline.openai_front.app import OpenAIFront
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.server import embedded_server
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.triton_names import ENSEMBLE
from pipeline.validate.aiperf import SyntheticPrompts, aiperf_command, run_aiperf_command
from pipeline.validate.client import EnsembleClient

#: the options of aiperf_command that make it Triton's generate_stream; the openai door replaces them
TRITON_OPTIONS = ("-m", "--endpoint-type", "--custom-endpoint", "--extra-inputs")


def repository(workdir: Path, runtime: str) -> tuple[Path, Path]:
    """SmolLM2's float32 cpu repository (deployed anew) and its Hugging Face directory (the tokenizer)."""
    from pipeline.convert import convert_model

    hf_dir = resolve_model("smollm2-135m").hf_dir()
    checkpoint = workdir / "checkpoint"
    if not (checkpoint / "config.json").exists():
        convert_model(resolve_model(str(hf_dir)), checkpoint, dtype="float32", progress=False)
    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    return deploy_repository(plan, workdir / "repo", checkpoint=checkpoint, tokenizer=hf_dir, runtime=runtime,
                             force=True).path, hf_dir


def door_command(door: str, url: str, hf_dir: Path, concurrency: int, workdir: Path, args) -> list[str]:
    triton = aiperf_command(url, hf_dir, SyntheticPrompts(args.input_tokens), args.output_tokens, concurrency,
                            args.requests, workdir, min_tokens=args.output_tokens)
    if door == "triton":
        return triton
    command, tokens = [], iter(triton)
    for token in tokens:
        if token in TRITON_OPTIONS:
            next(tokens)
        else:
            command.append(token)
    return [*command, "-m", ENSEMBLE, "--endpoint-type", "completions",
            "--extra-inputs", f"min_tokens:{args.output_tokens}", "--extra-inputs", "temperature:0"]


def median_ratio(rounds: list[dict], concurrency: int, key: str) -> tuple[list[float], float]:
    ratios = [r[concurrency]["openai"][key] / r[concurrency]["triton"][key] for r in rounds]
    return ratios, statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--runtime", choices=["onnxruntime", "torch"], default="onnxruntime")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-openai-front"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    repo, hf_dir = repository(args.workdir, args.runtime)
    rounds = []
    with embedded_server(repo, log_path=args.workdir / "tritonserver.log") as server, \
            OpenAIFront(repo, server.http_url, port=0) as front:
        EnsembleClient(server, timeout=600).generate("Hello", 2)   # warm-up
        urls = {"triton": server.http_url, "openai": front.url}
        for n in range(args.rounds):
            result = {}
            for concurrency in args.concurrency:
                result[concurrency] = {}
                for door in ("triton", "openai") if n % 2 == 0 else ("openai", "triton"):
                    workdir = args.workdir / f"round{n}-c{concurrency}-{door}"
                    workdir.mkdir(parents=True, exist_ok=True)
                    level = run_aiperf_command(door_command(door, urls[door], hf_dir, concurrency, workdir, args),
                                               workdir, concurrency, args.requests)
                    if level["failed"] or level["completed"] < args.requests:
                        raise SystemExit(f"{door} c={concurrency}: {level['failed']} failed, errors {level['errors']}")
                    result[concurrency][door] = {"tokens_per_s": level["output_tokens_per_s"],
                                                 "ttft_p50_ms": level["ttft_ms"]["p50"],
                                                 "itl_p50_ms": level["itl_ms"]["p50"],
                                                 "output_tokens": level["output_tokens"]}
                    print(f"round {n + 1} c={concurrency:<2} {door:6} {level['output_tokens_per_s']:7.1f} tok/s  "
                          f"TTFT p50 {level['ttft_ms']['p50']:7.1f} ms  ITL p50 {level['itl_ms']['p50']:6.2f} ms  "
                          f"({level['output_tokens']} tokens)", flush=True)
            rounds.append(result)
    print("\nopenai / triton, per round, and the median:")
    for concurrency in args.concurrency:
        tps, tps_median = median_ratio(rounds, concurrency, "tokens_per_s")
        itl, itl_median = median_ratio(rounds, concurrency, "itl_p50_ms")
        print(f"  c={concurrency:<2} tokens/s {' '.join(f'{r:.3f}' for r in tps)}  median {tps_median:.3f}   "
              f"ITL p50 {' '.join(f'{r:.3f}' for r in itl)}  median {itl_median:.3f}")
    (args.workdir / "bench_openai_front.json").write_text(json.dumps(rounds, indent=2) + "\n")


if __name__ == "__main__":
    main()
