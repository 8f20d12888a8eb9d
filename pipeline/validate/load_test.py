"""The optional load test: a bounded concurrency sweep of streamed requests (through `ensemble`, or the llmapi
`tensorrt_llm` model).

Per concurrency level: TTFT, inter-token latency and request latency P50/P90/P99, output tokens/s, the
requests the server shed (its queue was full: overload, "retry later") and the requests that failed;
written as load_test.json and load_test.png beside report.json. Shed requests do not fail the check (the
queue bound is the plan's decision, `max_queue_size_reason`); failed ones do.
`benchmarks/bench_batching.py` reuses `run_level` as its load generator.
"""

from __future__ import annotations

import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import numpy as np

from .client import StreamResult
from .energy import LoadMeter
from .report import CheckResult, ValidateOptions
from ..plan.feedback import annotate, measured_on


class StreamingClient(Protocol):
    """What the load test needs of a contract's client (`EnsembleClient`, `llmapi.LlmapiClient`)."""

    def generate_stream(self, prompt: str, max_tokens: int) -> StreamResult: ...


def percentiles(values: list[float]) -> dict[str, float | None]:
    """P50/P90/P99 of durations in seconds, in milliseconds (None for each when there are none)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def run_level(client: StreamingClient, prompts: tuple[str, ...], max_tokens: int, concurrency: int,
              requests_per_client: int, meter: LoadMeter | None = None) -> dict:
    """`concurrency` clients each sending `requests_per_client` streamed requests back to back; with a `meter`, the
    level's energy, peak memory and cost over exactly its window (`energy`)."""
    total = concurrency * requests_per_client
    jobs = [prompts[i % len(prompts)] for i in range(total)]
    with meter.window() if meter else nullcontext() as reading:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(lambda p: client.generate_stream(p, max_tokens), jobs))
        wall = time.perf_counter() - start
    done = [r for r in results if not r.error and r.arrival]
    shed = sum(r.overloaded for r in results)
    tokens = sum(len(r.pieces) for r in done)
    record = {
        "concurrency": concurrency, "requests": total, "completed": len(done), "shed": shed,
        "failed": total - len(done) - shed,
        "errors": sorted({r.error for r in results if r.error and not r.overloaded})[:5], "wall_s": wall,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "itl_ms": percentiles([d for r in done for d in r.inter_token]),
        "latency_ms": percentiles([r.latency for r in done]),
    }
    if meter:
        record["energy"] = meter.kpis(reading, tokens)
    speculation = speculation_of(done)
    if speculation:
        record["speculation"] = speculation
    return record


def speculation_of(results: list) -> dict | None:
    """A level's drafts as a speculating deployment reported them (None: it reported none): accepted / drafted, and
    the drafts a decode step verified (a request of N tokens ran N - 1 - accepted decode steps)."""
    counted = [r for r in results if r.drafted is not None]
    if not counted:
        return None
    drafted, accepted = sum(r.drafted for r in counted), sum(r.accepted for r in counted)
    steps = sum(len(r.pieces) - 1 - r.accepted for r in counted)
    return {"requests": len(counted), "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "drafts_per_step": round(drafted / steps, 3) if steps > 0 else 0.0}


def energy_summary(level: dict) -> str:
    """One clause for a level's energy and memory: the figures, or why there are none."""
    energy = level.get("energy")
    if not energy:
        return ""
    if energy["joules_per_output_token"] is not None:
        text = (f"{energy['joules_per_output_token']:.3g} J per output token at {energy['mean_power_w']:.0f} W "
                f"({energy['source']}"
                + (f"; idle {energy['idle_power_w']:.0f} W" if energy["idle_power_w"] is not None else "") + ")")
    else:
        text = f"energy not measured: {energy['reason']}"
    if energy["peak_memory_bytes"]:
        text += f"; peak memory {energy['peak_memory_bytes'] / 2**30:.2f} GiB"
    if energy.get("cost_per_million_output_tokens") is not None:
        text += f"; {energy['cost_per_million_output_tokens']:.3g} per million output tokens"
    return text


@functools.lru_cache(maxsize=8)
def prompt_token_counts(tokenizer_dir: str, prompts: tuple[str, ...]) -> tuple[int, ...]:
    """Each prompt's tokens under the served tokenizer, counted once per tokenizer and prompts (tune asks for every
    trial with the same ones)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tuple(len(tokenizer(p)["input_ids"]) for p in prompts)


def mean_prompt_tokens(tokenizer_dir: Path | None, prompts: tuple[str, ...], requests: int) -> float | None:
    """The mean prompt tokens of `requests` requests cycling through `prompts` (as run_level sends them), counted
    with the served tokenizer; None without one."""
    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return None
    counts = prompt_token_counts(str(Path(tokenizer_dir).resolve()), tuple(prompts))
    return sum(counts[i % len(counts)] for i in range(requests)) / requests


def with_predictions(levels: list[dict], plan, tokenizer_dir: Path | None, prompts: tuple[str, ...]) -> list[dict]:
    """Each level with the served batch, its prompt tokens (over its own requests) and what `plan` predicted for it
    (plan/feedback.py); `plan` None (a server trtpipe did not deploy): the levels as measured."""
    batch = plan.triton.triton_max_batch_size if plan else None
    max_num_tokens = plan.build_config.max_num_tokens if plan and plan.build_config else None
    return [annotate(lv, plan, mean_prompt_tokens(tokenizer_dir, prompts, lv["requests"]), batch, max_num_tokens)
            for lv in levels]


def plot_load_test(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(x, [lv["output_tokens_per_s"] for lv in levels], "o-")
    ax1.set(xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    for metric in ("ttft_ms", "latency_ms"):
        for q, style in (("p50", "o-"), ("p99", "x--")):
            ax2.plot(x, [lv[metric][q] or 0 for lv in levels], style, label=f"{metric[:-3]} {q}")
    ax2.set(xlabel="concurrent clients", ylabel="ms", title="latency", yscale="log")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_load_test(client: StreamingClient, options: ValidateOptions, out_dir: Path, plan=None,
                    tokenizer_dir: Path | None = None, meter: LoadMeter | None = None) -> CheckResult:
    """The sweep; with the deployment's `plan` (and its tokenizer) each level also records what the plan predicted
    for it, so that `trtpipe plan --measured load_test.json` can correct the model for this machine."""
    from rich.progress import Progress

    levels = []
    with Progress(transient=True) as progress:
        task = progress.add_task("load test", total=len(options.concurrencies))
        for concurrency in options.concurrencies:
            levels.append(run_level(client, options.prompts, options.max_tokens, concurrency,
                                    options.requests_per_client, meter))
            progress.advance(task)
    levels = with_predictions(levels, plan, tokenizer_dir, options.prompts)
    record = {"measured_on": measured_on(plan) if plan else None, "levels": levels}
    (out_dir / "load_test.json").write_text(json.dumps(record, indent=2) + "\n")
    plot_load_test(levels, out_dir / "load_test.png")
    failed, shed = sum(lv["failed"] for lv in levels), sum(lv["shed"] for lv in levels)
    best = max(levels, key=lambda lv: lv["output_tokens_per_s"])
    detail = (f"{sum(lv['requests'] for lv in levels)} requests at concurrency {list(options.concurrencies)}, "
              f"{failed} failed, {shed} shed (server queue full); best {best['output_tokens_per_s']:.1f} output "
              f"tokens/s at concurrency {best['concurrency']} (TTFT p50 {best['ttft_ms']['p50']:.0f} ms, ITL p50 "
              f"{(best['itl_ms']['p50'] or 0):.1f} ms)" if best["completed"]
              else f"no request completed: {failed} failed, {shed} shed (server queue full)")
    predicted = best.get("predicted") or {}
    if best["completed"] and "ttft_ms" in predicted:
        detail += (f"; the plan predicted {predicted['output_tokens_per_s']:.1f} tokens/s, TTFT "
                   f"{predicted['ttft_ms']:.0f} ms, TPOT {predicted['tpot_ms']:.1f} ms there ({predicted['source']})")
    if best["completed"] and best.get("energy"):
        detail += f"; {energy_summary(best)}"
    drafting = [lv for lv in levels if lv.get("speculation")]
    if drafting:
        detail += "; speculation per level: " + ", ".join(
            f"c={lv['concurrency']} acceptance {lv['speculation']['acceptance']:.2f}, "
            f"{lv['speculation']['drafts_per_step']:.2f} drafts a step" for lv in drafting)
    if shed:
        detail += (" — shedding is the queue bound at work (see the plan's max_queue_size_reason); clients should "
                   "retry later")
    errors = sorted({e for lv in levels for e in lv["errors"]})
    if errors:
        detail += f"; errors: {errors[:3]}"
    return CheckResult("load_test", failed == 0, detail, data=record,
                       fix="" if failed == 0 else "requests failed under load: check the server log for errors "
                       "under concurrency")
