"""aiperf (NVIDIA's maintained load generator) as trtpipe's second load generator.

`run_aiperf` drives aiperf 0.13 against the ensemble's HTTP generate_stream through its `template` endpoint
(docs/aiperf.md: the request template, the offline tokenizer directory, the JSON export) and returns the
dict `load_test.run_level` returns, so a caller can use either load generator. Two choices are not
aiperf's defaults, both because of what docs/aiperf.md measured on a 2-core machine:

- `--request-rate` (far above what the server completes) with `--arrival-pattern constant` alongside
  `--concurrency`: with concurrency alone, aiperf's timing manager polls for a free slot without sleeping
  for as long as all slots are taken and requests remain, one CPU core taken from the server it measures.
  With a rate it wakes once per interval instead; the concurrency cap is unchanged.
- one worker and one record processor: each aiperf process is a Python interpreter; more of them only
  compete with the server for the same cores at these request rates.

The ITL is aiperf's `inter_chunk_latency` (every gap between two streamed responses, as run_level
measures it; this server streams one token per response), not its per-request average `inter_token_latency`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import UserError
from ..triton_names import EXCLUDE_INPUT_IN_OUTPUT, MAX_TOKENS, MIN_TOKENS, STREAM, TEXT_INPUT, TEXT_OUTPUT, TOP_K
from .client import ENSEMBLE, is_overload

AIPERF_REQUIREMENT = "aiperf==0.13.0"
#: Requests per second aiperf may start: far above what a cpu or one-GPU server completes, so the
#: concurrency cap alone decides when a request starts (each start waits at most 1/RATE seconds).
REQUEST_RATE = 200
#: The request body, as EnsembleClient.body sends it (greedy, the completion alone, streamed): a Jinja template
#: (`text` and `max_tokens` are aiperf's variables) whose `%s` is min_tokens when the run sets one.
TEMPLATE = ('{"' + TEXT_INPUT + '": {{ text|tojson }}, "' + MAX_TOKENS + '": {{ max_tokens }}, %s"' + TOP_K
            + '": 1, "' + STREAM + '": true, "' + EXCLUDE_INPUT_IN_OUTPUT + '": true}')
EXPORT = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"   # one line per request; all aiperf leaves when no request succeeded


@dataclass(frozen=True)
class SyntheticPrompts:
    """aiperf's own prompts from its bundled corpus: `input_tokens` long (mean, with this stddev)."""

    input_tokens: int
    stddev: int = 0


def aiperf_executable() -> str:
    """The aiperf command: beside this Python first (scripts/setup.sh links .venv/bin/aiperf), then on PATH."""
    found = shutil.which("aiperf", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                           os.environ.get("PATH", "")]))
    if found is None:
        raise UserError(f"aiperf is not installed: install it with `pip install {AIPERF_REQUIREMENT}` (in its own "
                        "virtual environment if you like: scripts/setup.sh puts it in .venv/aiperf and links "
                        ".venv/bin/aiperf), or use the builtin load generator")
    return found


def aiperf_command(url: str, tokenizer_dir: Path, prompts: Sequence[str] | SyntheticPrompts, max_tokens: int,
                   concurrency: int, request_count: int, workdir: Path, min_tokens: int | None) -> list[str]:
    """The `aiperf profile` command line; writes the request template (and the prompts) into workdir."""
    template = workdir / "triton_generate_stream.j2"   # a file: an inline --extra-inputs value stops at a comma
    template.write_text(TEMPLATE % ("" if min_tokens is None else f'"{MIN_TOKENS}": {min_tokens}, ') + "\n")
    command = [aiperf_executable(), "profile", "-m", ENSEMBLE, "--url", url.rstrip("/"),
               "--endpoint-type", "template", "--custom-endpoint", f"/v2/models/{ENSEMBLE}/generate_stream",
               "--streaming", "--extra-inputs", f"payload_template:{template}",
               "--extra-inputs", f"response_field:{TEXT_OUTPUT}", "--tokenizer", str(Path(tokenizer_dir).resolve()),
               "--request-count", str(request_count), "--concurrency", str(concurrency),
               "--request-rate", str(REQUEST_RATE), "--arrival-pattern", "constant",
               "--workers-max", "1", "--record-processors", "1", "--random-seed", "0",
               "--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(workdir / "artifacts")]
    if isinstance(prompts, SyntheticPrompts):
        return command + ["--isl", str(prompts.input_tokens), "--isl-stddev", str(prompts.stddev),
                          "--osl", str(max_tokens)]
    dataset = workdir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"text": p, "output_length": max_tokens}) + "\n" for p in prompts))
    return command + ["--input-file", str(dataset), "--custom-dataset-type", "single_turn",
                      "--dataset-sampling-strategy", "sequential"]


def run_aiperf(url: str, tokenizer_dir: Path, prompts: Sequence[str] | SyntheticPrompts, max_tokens: int,
               concurrency: int, request_count: int, workdir: Path, min_tokens: int | None = None,
               timeout_s: float = 3600.0) -> dict:
    """Run aiperf against the ensemble at `url` and return its results as `run_level` does.

    prompts: the texts to send (in order, wrapping around, as run_level does), or `SyntheticPrompts`.
    min_tokens: sent with every request when given (= max_tokens pins the output length, as aiperf advises).
    """
    if not prompts:
        raise UserError("run_aiperf needs at least one prompt")
    if min(max_tokens, concurrency, request_count) < 1:
        raise UserError(f"max_tokens, concurrency and request_count must be at least 1 (got {max_tokens}, "
                        f"{concurrency}, {request_count})")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    command = aiperf_command(url, tokenizer_dir, prompts, max_tokens, concurrency, request_count, workdir,
                             min_tokens)
    return run_aiperf_command(command, workdir, concurrency, request_count, timeout_s)


def run_aiperf_command(command: list[str], workdir: Path, concurrency: int, request_count: int,
                       timeout_s: float = 3600.0) -> dict:
    """Run an aiperf command whose artifacts go under `workdir` and read its results as `run_aiperf` returns them
    (any endpoint: benchmarks/bench_cpu_serving.py points the same command at vLLM's)."""
    # aiperf 0.13 cannot load a local tokenizer directory while HF_HUB_OFFLINE is set (docs/aiperf.md)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(workdir.absolute())  # its per-run aiperf_mmap_* dirs, not /tmp's
    artifacts = workdir / "artifacts"
    shutil.rmtree(artifacts, ignore_errors=True)   # never read an earlier run's export
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"aiperf did not finish within {timeout_s:.0f} s (its files: {workdir})") from None
    if (artifacts / EXPORT).is_file():
        return parse_export(json.loads((artifacts / EXPORT).read_text()), concurrency, request_count)
    records = read_records(artifacts / RECORDS)
    if records and all("error" in r for r in records):   # aiperf exits 1 and writes no summary then
        return parse_export(summary_of_failures(records), concurrency, request_count)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    raise UserError(f"aiperf failed (exit {done.returncode}; log {artifacts / 'logs'}):\n{tail}")


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def summary_of_failures(records: list[dict]) -> dict:
    """The part of an export that a run without one successful request would have had: its errors and
    duration."""
    counts: dict[str, int] = {}
    for record in records:
        key = json.dumps(record["error"], sort_keys=True)
        counts[key] = counts.get(key, 0) + 1
    meta = [r["metadata"] for r in records]
    wall = (max(m["request_end_ns"] for m in meta) - min(m["request_start_ns"] for m in meta)) / 1e9
    return {"error_summary": [{"error_details": json.loads(k), "count": n} for k, n in counts.items()],
            "benchmark_duration": {"unit": "sec", "avg": wall}}


def error_message(details: dict) -> str:
    """The server's message: aiperf keeps an error that came as a streamed event as the raw event text."""
    message = str(details.get("message", details))
    try:
        return str(json.loads(message.strip().removeprefix("data:"))["error"])
    except (ValueError, KeyError, TypeError):
        return message


def metric(data: dict, name: str, stat: str = "avg") -> float | None:
    value = data.get(name, {}).get(stat)
    return None if value is None else float(value)


def percentiles_of(data: dict, name: str) -> dict[str, float | None]:
    return {q: metric(data, name, q) for q in ("p50", "p90", "p99")}


def parse_export(data: dict, concurrency: int, requests: int) -> dict:
    """aiperf's profile_export_aiperf.json (schema 1.4) -> run_level's dict."""
    errors = [(entry["error_details"].get("code"), error_message(entry["error_details"]), int(entry["count"]))
              for entry in data.get("error_summary", [])]
    shed = sum(n for code, message, n in errors if is_overload(code, message))
    completed = int(metric(data, "request_count") or 0)
    wall = metric(data, "benchmark_duration") or 0.0
    tokens = int(metric(data, "total_output_tokens") or 0)
    return {
        "concurrency": concurrency, "requests": requests, "completed": completed, "shed": shed,
        "failed": requests - completed - shed,
        "errors": sorted({message for code, message, _ in errors if not is_overload(code, message)})[:5],
        "wall_s": wall, "output_tokens": tokens,
        "output_tokens_per_s": metric(data, "output_token_throughput") or (tokens / wall if wall > 0 else 0.0),
        "ttft_ms": percentiles_of(data, "time_to_first_token"),
        "itl_ms": percentiles_of(data, "inter_chunk_latency"),
        "latency_ms": percentiles_of(data, "request_latency"),
    }
