"""`trtpipe profile REPO`: serve REPO, drive validate's load for a while and leave a trace people open.

The cpu target (a backend without a CUDA runtime): the embedded server runs with `TRTPIPE_PROFILE_DIR` set, so
trtpipe's models record their stage ranges (pipeline/spans.py) and the cpu model runs torch's profiler
(pipeline/runtime/profiling.py) while the capture file exists, which is exactly the load window. The result,
in OUT: `trace.json.gz` (Chrome trace format, gzipped: open it in https://ui.perfetto.dev or chrome://tracing) with
every process's ranges and torch's operators on one time line, `profile.json` (the load, each stage's time, the top
operators), `top_operators.md` and the server log.

A GPU backend: the repository's serve command under Nsight Systems (`nsys profile -t cuda,nvtx,osrt
--capture-range=cudaProfilerApi`) with the backend's start/stop variable (`Backend.profile_start_stop_env`)
naming the iterations captured, then `nsys stats` summaries as CSV. Not run here (no GPU, no nsys): the command
and the summaries' reading are tested with a fake nsys.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .backends import backend_for
from .errors import UserError
from .model_repository import read_deployment, read_repository
from .outputs import atomic_output_dir
from .runtime.profiling import DONE_SUFFIX, OPS_PREFIX, STARTED_SUFFIX, TRACE_PREFIX
from .spans import CAPTURE_FILE, CAPTURE_POLL_S, PROFILE_DIR_ENV, SPANS_PREFIX

#: each stage's range name and the model that opens it, in the order a request meets them
STAGES = {"tokenize": "preprocessing", "schedule": "tensorrt_llm", "forward": "tensorrt_llm",
          "sample": "tensorrt_llm", "detokenize": "postprocessing"}
#: how long the cpu model may take to write torch's trace after the capture ends
TRACE_WRITE_TIMEOUT_S = 120.0
#: the Chrome trace, gzipped: 10 s of SmolLM2 hold about 400,000 events (157 MB of JSON, 10x less gzipped)
TRACE_FILE = "trace.json.gz"
NSYS_PACKAGE = "Nsight Systems (the nsight-systems-cli package of NVIDIA's CUDA repository, or NVIDIA's installer)"
NSYS_REPORTS = ("nvtx_sum", "cuda_gpu_kern_sum", "cuda_api_sum")


@dataclass(frozen=True)
class ProfileOptions:
    duration_s: float = 10.0
    concurrency: int = 1
    max_tokens: int = 16
    prompts: tuple[str, ...] = ()
    top: int = 15
    ready_timeout: float = 600.0
    #: GPU: the runtime iterations captured (the backend's start/stop variable), from server start
    capture_iterations: str = "100-300"


@dataclass
class ProfileResult:
    out: Path
    kind: str                      # "torch" (the cpu target) or "nsys"
    load: dict
    stages: dict = field(default_factory=dict)
    top_operators: list = field(default_factory=list)
    files: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "load": self.load, "stages": self.stages, "top_operators": self.top_operators,
                "files": self.files}

    def render(self) -> str:
        load = self.load
        lines = [f"profiled {load['requests']} requests over {load['wall_s']:.1f} s at concurrency "
                 f"{load['concurrency']}: {load['output_tokens_per_s']:.1f} output tokens/s, {load['failed']} failed"
                 + (f" ({load['errors'][0]})" if load["errors"] else "")]
        for name, s in self.stages.items():
            lines.append(f"  {name:<11} {s['count']:>6} ranges  {s['total_ms']:>9.1f} ms  mean {s['mean_ms']:.3f} ms")
        if self.top_operators:
            lines.append(top_operators_markdown(self.top_operators[:10]))
        lines.append(f"trace: {self.out / self.files[0]} (open it in https://ui.perfetto.dev); "
                     f"summary: {self.out / 'profile.json'}")
        return "\n".join(lines)


def check_options(options: ProfileOptions) -> None:
    if not options.duration_s > 0:
        raise UserError(f"--duration must be a positive number of seconds, not {options.duration_s:g}")
    if options.concurrency < 1:
        raise UserError(f"--concurrency must be at least 1, not {options.concurrency}")


def check_output(out: Path) -> None:
    """The trace directory can be written (its nearest existing ancestor is a writable directory) and holds
    nothing yet."""
    parent = Path(out).absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the profile into {out}: {parent} is not a writable directory")
    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise UserError(f"{out} exists and is not an empty directory; pass another -o")


def profile_repository(repo: Path, out: Path, options: ProfileOptions, say=lambda message: None) -> ProfileResult:
    check_options(options)
    repo = Path(repo)
    repository = read_repository(repo)        # UserError for a directory that is not a repository
    served = read_deployment(repo)
    backend = backend_for(served.backend) if served else None
    check_output(out)
    if backend is not None and backend.profile_start_stop_env:
        return profile_with_nsys(repo, repository.plan(), backend, Path(out), options, say)
    if backend is not None and not backend.serves_embedded:
        raise UserError(f"{repo} is served by the {backend.name} backend, which this machine cannot serve")
    return profile_embedded(repo, Path(out), options, say)


# ------------------------------------------------------------------------------------------------- the load


def drive(client, options: ProfileOptions) -> dict:
    """validate's load (`run_level`) repeated until the duration has passed: one record for the whole window, with
    the failed requests' errors as run_level reports them."""
    from .validate.load_test import run_level

    start, levels = time.monotonic(), []
    while time.monotonic() < start + options.duration_s:
        levels.append(run_level(client, options.prompts, options.max_tokens, options.concurrency, 1))
    wall = time.monotonic() - start
    tokens = sum(lv["output_tokens"] for lv in levels)
    return {"concurrency": options.concurrency, "requests": sum(lv["requests"] for lv in levels),
            "completed": sum(lv["completed"] for lv in levels), "failed": sum(lv["failed"] for lv in levels),
            "errors": sorted({e for lv in levels for e in lv["errors"]})[:5],
            "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall if wall else 0.0}


def client_for(repo: Path, server, timeout: float):
    from .backends.pytorch import LLMAPI
    from .validate.client import EnsembleClient
    from .validate.llmapi import LlmapiClient
    from .validate.stage import repository_layout

    if repository_layout(repo, server) == LLMAPI:
        return LlmapiClient(server.http_url, timeout=timeout)
    return EnsembleClient(server, timeout)


# ------------------------------------------------------------------------------------------------- the cpu target


def profile_embedded(repo: Path, out: Path, options: ProfileOptions, say) -> ProfileResult:
    from .server import embedded_server
    from .validate.client import REQUEST_TIMEOUT_S

    with atomic_output_dir(out) as tmp:
        raw = tmp / "raw"
        raw.mkdir()
        say(f"serving {repo} with its models recording their ranges")
        with embedded_server(repo, log_path=tmp / "server.log", ready_timeout=options.ready_timeout,
                             environment={PROFILE_DIR_ENV: str(raw)}) as server:
            client = client_for(repo, server, REQUEST_TIMEOUT_S)
            client.generate_stream(options.prompts[0], 2)     # warm-up: outside the capture
            (raw / CAPTURE_FILE).touch()
            wait_for(raw, f"{TRACE_PREFIX}*{STARTED_SUFFIX}", "the cpu model did not start torch's profiler")
            time.sleep(3 * CAPTURE_POLL_S)                    # every model has seen the capture file
            start_us = time.time_ns() / 1000
            say(f"capturing {options.duration_s:g} s of load at concurrency {options.concurrency}")
            load = drive(client, options)
            end_us = time.time_ns() / 1000
            (raw / CAPTURE_FILE).unlink()
            wait_for_traces(raw)
        events, stages = merged_trace(raw, start_us, end_us)
        if not stages:
            raise RuntimeError("the served models recorded no stage range: are they trtpipe's (not NVIDIA's, "
                               "--python-models)? See the server log")
        with gzip.open(tmp / TRACE_FILE, "wt") as f:     # Perfetto and chrome://tracing open it gzipped
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"repository": repo.name, "load": load}}, f)
        top = top_operators(raw, options.top)
        (tmp / "top_operators.md").write_text(top_operators_markdown(top) + "\n")
        result = ProfileResult(out, "torch", load, stage_summary(stages), top,
                               [TRACE_FILE, "top_operators.md", "profile.json", "server.log"])
        (tmp / "profile.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        shutil.rmtree(raw)
    return result


def wait_for(raw: Path, pattern: str, failure: str, timeout: float = TRACE_WRITE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not any(raw.glob(pattern)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{failure} within {timeout:.0f} s")
        time.sleep(0.05)


def wait_for_traces(raw: Path, timeout: float = TRACE_WRITE_TIMEOUT_S) -> None:
    """Until every process that ran torch's profiler has written its trace (its .done file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = {p.name[:-len(STARTED_SUFFIX)] for p in raw.glob(f"{TRACE_PREFIX}*{STARTED_SUFFIX}")}
        done = {p.name[:-len(DONE_SUFFIX)] for p in raw.glob(f"{TRACE_PREFIX}*{DONE_SUFFIX}")}
        if started <= done:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the cpu model wrote no torch trace within {timeout:.0f} s of the capture's end")


def read_spans(raw: Path) -> list[dict]:
    events = []
    for path in sorted(raw.glob(f"{SPANS_PREFIX}*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events


def read_torch_events(raw: Path) -> list[dict]:
    """torch's operators and ranges, on the wall clock: kineto writes `ts` relative to baseTimeNanoseconds."""
    events = []
    for path in sorted(raw.glob(f"{TRACE_PREFIX}*.json")):
        trace = json.loads(path.read_text())
        base_us = trace.get("baseTimeNanoseconds", 0) / 1000
        for event in trace.get("traceEvents", []):
            if event.get("ph") == "X" and "ts" in event and event.get("name") not in STAGES:
                events.append({**event, "ts": float(event["ts"]) + base_us, "cat": "torch"})
    return events


def merged_trace(raw: Path, start_us: float, end_us: float) -> tuple[list[dict], list[dict]]:
    """(every event of the window from time 0 at its start, with process names; the stage ranges alone)."""
    stages = [e for e in read_spans(raw) if start_us <= e["ts"] <= end_us]
    operators = [e for e in read_torch_events(raw) if start_us <= e["ts"] <= end_us]
    names = {}
    for e in stages:
        names.setdefault(e["pid"], STAGES.get(e["name"], "trtpipe"))
    metadata = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
                for pid, name in sorted(names.items())]
    events = sorted(({**e, "ts": e["ts"] - start_us} for e in stages + operators), key=lambda e: e["ts"])
    return metadata + events, [{**e, "ts": e["ts"] - start_us} for e in stages]


def stage_summary(stages: list[dict]) -> dict:
    by_name = defaultdict(list)
    for e in stages:
        by_name[e["name"]].append(e["dur"] / 1000)
    return {name: {"count": len(by_name[name]), "total_ms": sum(by_name[name]),
                   "mean_ms": sum(by_name[name]) / len(by_name[name])} for name in STAGES if by_name[name]}


def top_operators(raw: Path, top: int) -> list[dict]:
    """torch's operators by self CPU time over the capture, summed over processes, with their share."""
    totals = defaultdict(lambda: {"calls": 0, "self_cpu_us": 0.0})
    for path in raw.glob(f"{OPS_PREFIX}*.json"):
        for op in json.loads(path.read_text()):
            if op["name"] in STAGES:
                continue
            totals[op["name"]]["calls"] += op["calls"]
            totals[op["name"]]["self_cpu_us"] += op["self_cpu_us"]
    whole = sum(t["self_cpu_us"] for t in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: kv[1]["self_cpu_us"], reverse=True)[:top]
    return [{"name": name, "calls": t["calls"], "self_cpu_ms": t["self_cpu_us"] / 1000,
             "self_cpu_share": t["self_cpu_us"] / whole} for name, t in ranked]


def top_operators_markdown(top: list[dict]) -> str:
    lines = ["| operator | calls | self CPU (ms) | share |", "|---|---:|---:|---:|"]
    lines += [f"| `{op['name']}` | {op['calls']} | {op['self_cpu_ms']:.1f} | {op['self_cpu_share']:.1%} |"
              for op in top]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- a GPU backend


def find_nsys() -> str:
    nsys = shutil.which("nsys")
    if nsys is None:
        raise UserError(f"profiling a GPU repository needs `nsys` on PATH: install {NSYS_PACKAGE}")
    return nsys


def parse_iterations(text: str) -> tuple[int, int]:
    try:
        first, last = (int(part) for part in text.split("-"))
    except ValueError:
        raise UserError(f"--capture-iterations must be FIRST-LAST (e.g. 100-300), not {text!r}") from None
    if not 0 <= first < last:
        raise UserError(f"--capture-iterations {text}: FIRST must be below LAST")
    return first, last


def nsys_profile_command(nsys: str, backend, plan, repo: Path, report: Path, iterations: str) -> tuple[list, dict]:
    """(argv, the environment it adds): the repository's serve command under nsys, capturing the iterations the
    backend's start/stop variable names (cudaProfilerStart/Stop around them)."""
    first, last = parse_iterations(iterations)
    argv = [nsys, "profile", "-t", "cuda,nvtx,osrt", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
            "--force-overwrite=true", "-o", str(report), *backend.serve_command(plan, model_repository=str(repo))]
    return argv, {backend.profile_start_stop_env: f"{first}-{last}"}


def nsys_stats(nsys: str, report: Path, out: Path) -> dict[str, list[dict]]:
    """`nsys stats` of REPORT as CSV files in OUT, read back: report name -> its rows."""
    import csv

    argv = [nsys, "stats", "--report", ",".join(NSYS_REPORTS), "--format", "csv", "--force-export=true",
            "--output", str(out / "stats"), str(report)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nsys stats failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    tables = {}
    for name in NSYS_REPORTS:
        path = out / f"stats_{name}.csv"
        if path.exists():
            with open(path, newline="") as f:
                tables[name] = list(csv.DictReader(f))
    return tables


def profile_with_nsys(repo: Path, plan, backend, out: Path, options: ProfileOptions, say) -> ProfileResult:
    """GPU only: not run here."""
    import signal

    from .server import connect, stop_server
    from .validate.client import REQUEST_TIMEOUT_S

    nsys = find_nsys()
    with atomic_output_dir(out) as tmp:
        argv, extra = nsys_profile_command(nsys, backend, plan, repo.resolve(), tmp / "profile",
                                           options.capture_iterations)
        say(f"starting under Nsight Systems: {' '.join(argv)} ({', '.join(f'{k}={v}' for k, v in extra.items())})")
        with open(tmp / "server.log", "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=repo,
                                       env={**os.environ, **extra}, start_new_session=True)
        try:
            with connect("http://127.0.0.1:8000", ready_timeout=options.ready_timeout) as server:
                load = drive(client_for(repo, server, REQUEST_TIMEOUT_S), options)
            os.killpg(process.pid, signal.SIGINT)     # nsys writes its report when the profiled command ends
            process.wait(timeout=600)
        finally:
            stop_server(process)
        reports = sorted(tmp.glob("profile*.nsys-rep"))
        if not reports:
            raise RuntimeError(f"nsys wrote no report; see {out / 'server.log'}")
        tables = nsys_stats(nsys, reports[0], tmp)
        kernels = [{"name": row.get("Name", ""), "calls": int(row.get("Instances", 0) or 0),
                    "self_cpu_ms": float(row.get("Total Time (ns)", 0) or 0) / 1e6,
                    "self_cpu_share": float(row.get("Time (%)", 0) or 0) / 100}
                   for row in tables.get("cuda_gpu_kern_sum", [])[:options.top]]
        result = ProfileResult(out, "nsys", load, {}, kernels, [reports[0].name, "profile.json", "server.log"] +
                               sorted(p.name for p in tmp.glob("stats_*.csv")))
        (tmp / "profile.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
