"""The comparison report: per-build figures, B's change against A, the verdict; as JSON, Markdown and a plot.

Changes are signed so that the reader knows which way is better: `*_increase_pct` is B over A minus one
in percent (lower is better), `*_speedup` is how many times faster B is (A's latency over B's, B's
tokens/s over A's, A's weights over B's: above 1 is better).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .verdict import ThresholdResult

LATENCY_METRICS = ("ttft_ms", "itl_ms", "latency_ms")
QUANTILES = ("p50", "p90", "p99")


@dataclass
class CompareReport:
    builds: dict[str, dict]            # "A" / "B" -> label, path, precision, memory, perplexity, load
    prompts: dict                      # source, count, max_tokens
    generation: dict                   # token_agreement, rouge_l, bleu, exact_match, prompts
    changes: dict[str, float | None]
    thresholds: list[ThresholdResult]
    completions: list[dict]            # prompt, a, b
    notes: list[str]

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.thresholds)

    @property
    def verdict(self) -> str:
        if not self.thresholds:
            return "no thresholds set"
        failed = [t.name for t in self.thresholds if not t.passed]
        return f"B fails {', '.join(failed)}" if failed else "B passes every threshold"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "passed": self.passed, "builds": self.builds, "prompts": self.prompts,
                "generation": self.generation, "changes": self.changes,
                "thresholds": [asdict(t) for t in self.thresholds], "notes": self.notes,
                "completions": self.completions}

    def write(self, out: Path) -> None:
        (out / "report.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        (out / "report.md").write_text(self.markdown())
        plot(self, out / "report.png")

    def markdown(self) -> str:
        a, b = self.builds["A"], self.builds["B"]
        lines = [f"# A/B comparison: {a['label']} vs {b['label']}", "", f"**Verdict: {self.verdict}**", "",
                 f"Prompts: {self.prompts['count']} ({self.prompts['source']}), greedy, "
                 f"{self.prompts['max_tokens']} new tokens.", "",
                 "| figure | A | B | change (%: B over A; x: B's speed-up or saving, above 1 is better) |",
                 "|---|---|---|---|"]
        ppl_a, ppl_b = a["perplexity"]["perplexity"], b["perplexity"]["perplexity"]
        lines.append(f"| held-out perplexity | {ppl_a:.4f} | {ppl_b:.4f} | "
                     f"{self.changes['perplexity_increase_pct']:+.2f}% |")
        for key, saving in (("weights_bytes", "weights_saving"), ("planned_bytes_per_instance",
                                                                   "planned_per_instance_saving")):
            lines.append(f"| {key.replace('_', ' ')} | {a['memory'][key] / 2**20:.1f} MiB | "
                         f"{b['memory'][key] / 2**20:.1f} MiB | x{self.changes[saving]:.3f} |")
        if a["load"] and b["load"]:
            for metric in LATENCY_METRICS:
                for q in QUANTILES:
                    va, vb = a["load"][metric][q], b["load"][metric][q]
                    change = self.changes[f"{metric[:-3]}_{q}_speedup"]
                    lines.append(f"| {metric[:-3]} {q} (ms) | {_num(va)} | {_num(vb)} | "
                                 f"{'n/a' if change is None else f'x{change:.3f}'} |")
            lines.append(f"| output tokens/s (concurrency {a['load']['concurrency']}) | "
                         f"{a['load']['output_tokens_per_s']:.2f} | {b['load']['output_tokens_per_s']:.2f} | "
                         f"x{self.changes['throughput_speedup']:.3f} |")
            lines += energy_rows(a["load"], b["load"], self.changes)
        lines += speculation_rows(a.get("speculation"), b.get("speculation"))
        g = self.generation
        lines += ["", "B's completions against A's:", "", "| token agreement | ROUGE-L | BLEU | exact match |",
                  "|---|---|---|---|", f"| {g['token_agreement']:.4f} | {g['rouge_l']:.4f} | {g['bleu']:.2f} | "
                  f"{g['exact_match']:.4f} |"]
        if self.thresholds:
            lines += ["", "| threshold | limit | value | |", "|---|---|---|---|"]
            lines += [f"| {t.name} | {t.limit:g} | {t.value:.4f} | {'pass' if t.passed else '**FAIL**'} |"
                      for t in self.thresholds]
        lines += [f"\nNote: {note}" for note in self.notes]
        lines += ["", "## Completions", ""]
        for c in self.completions:
            lines += [f"- prompt: `{_md(c['prompt'])}`", f"  - A: `{_md(c['a'])}`", f"  - B: `{_md(c['b'])}`"]
        return "\n".join(lines) + "\n"


#: (energy record key, row label, its format, the saving in `changes`: A's over B's, above 1 is better)
ENERGY_ROWS = (("joules_per_output_token", "energy per output token (J)", "{:.4g}", "energy_per_token_saving"),
               ("peak_memory_bytes", "peak memory during the load (GiB)", "{:.2f}", "peak_memory_saving"),
               ("cost_per_million_output_tokens", "cost per million output tokens", "{:.4g}", "cost_saving"))


def speculation_rows(a: dict | None, b: dict | None) -> list[str]:
    """A speculating build's acceptance rate and drafts a step (NVIDIA's draft counts on the comparison's prompts);
    its speed-up over the other build is the load test's output tokens/s row."""
    if not a and not b:
        return []

    def cell(spec: dict | None, key: str, fmt: str) -> str:
        return "no speculation" if not spec else fmt.format(spec[key])

    return [f"| speculative decoding | {cell(a, 'method', '{}')} | {cell(b, 'method', '{}')} | |",
            f"| draft length K | {cell(a, 'draft_len', '{}')} | {cell(b, 'draft_len', '{}')} | |",
            f"| acceptance rate (accepted / drafted) | {cell(a, 'acceptance', '{:.3f}')} | "
            f"{cell(b, 'acceptance', '{:.3f}')} | |",
            f"| drafts a decode step | {cell(a, 'drafts_per_step', '{:.2f}')} | "
            f"{cell(b, 'drafts_per_step', '{:.2f}')} | |"]


def energy_value(load: dict, key: str) -> float | None:
    value = (load.get("energy") or {}).get(key)
    return value / 2**30 if value is not None and key == "peak_memory_bytes" else value


def energy_rows(a: dict, b: dict, changed: dict) -> list[str]:
    """The load's energy, peak memory and cost rows; a figure not measured is n/a with its reason."""
    rows = []
    for key, label, fmt, saving in ENERGY_ROWS:
        va, vb = energy_value(a, key), energy_value(b, key)
        if key == "cost_per_million_output_tokens" and va is None and vb is None:
            continue     # no --price-per-hour
        cells = [fmt.format(v) if v is not None else "n/a" for v in (va, vb)]
        change = changed.get(saving)
        rows.append(f"| {label} | {cells[0]} | {cells[1]} | {'n/a' if change is None else f'x{change:.3f}'} |")
    reasons = sorted({load["energy"]["reason"] for load in (a, b) if (load.get("energy") or {}).get("reason")})
    if reasons:
        rows.append(f"| energy not measured | {'; '.join(reasons)} | | |")
    return rows


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _md(text: str) -> str:
    return text.replace("`", "'").replace("\n", " ")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def changes(a: dict, b: dict, generation: dict) -> dict[str, float | None]:
    """B's change against A for every figure a threshold or the plot reads."""
    out = {"perplexity_increase_pct": (b["perplexity"]["perplexity"] / a["perplexity"]["perplexity"] - 1) * 100,
           "weights_saving": a["memory"]["weights_bytes"] / b["memory"]["weights_bytes"],
           "planned_per_instance_saving": (a["memory"]["planned_bytes_per_instance"]
                                           / b["memory"]["planned_bytes_per_instance"]),
           **{k: generation[k] for k in ("token_agreement", "rouge_l", "bleu", "exact_match")}}
    if a["load"] and b["load"]:
        for metric in LATENCY_METRICS:
            for q in QUANTILES:
                out[f"{metric[:-3]}_{q}_speedup"] = ratio(a["load"][metric][q], b["load"][metric][q])
        out["throughput_speedup"] = ratio(b["load"]["output_tokens_per_s"], a["load"]["output_tokens_per_s"])
        p99_a, p99_b = a["load"]["latency_ms"]["p99"], b["load"]["latency_ms"]["p99"]
        out["latency_p99_increase_pct"] = (p99_b / p99_a - 1) * 100 if p99_a and p99_b is not None else None
        for key, _, _, saving in ENERGY_ROWS:
            out[saving] = ratio(energy_value(a["load"], key), energy_value(b["load"], key))
    return out


def plot(report: CompareReport, path: Path) -> None:
    """Quality change (left) beside speed-up and memory saving (right), one bar per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = report.changes
    quality = {"perplexity change %": c["perplexity_increase_pct"],
               "token disagreement %": (1 - c["token_agreement"]) * 100, "1 - ROUGE-L %": (1 - c["rouge_l"]) * 100,
               "100 - BLEU": 100 - c["bleu"], "not exact %": (1 - c["exact_match"]) * 100}
    quality = {k: round(v, 6) for k, v in quality.items()}   # identical builds: 0, not float noise
    speed = {"weights": c["weights_saving"], "memory / instance": c["planned_per_instance_saving"]}
    speed.update({key.removesuffix("_speedup").replace("_", " "): value for key, value in c.items()
                  if key.endswith("_speedup") and value is not None})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.barh(list(quality), list(quality.values()), color=["tab:red" if v > 0 else "tab:green"
                                                           for v in quality.values()])
    ax1.axvline(0, color="black", lw=0.8)
    ax1.set(title="quality change of B against A (lower is better)", xlabel="%")
    ax2.barh(list(speed), list(speed.values()), color=["tab:green" if v >= 1 else "tab:red" for v in speed.values()])
    ax2.axvline(1, color="black", lw=0.8)
    ax2.set(title="speed-up / saving of B over A (above 1 is better)", xlabel="x")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{report.builds['A']['label']} -> {report.builds['B']['label']}: {report.verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
