"""The thresholds a comparison is judged by, and the verdict: B passes when every threshold set holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError

#: name -> (the report's figure it reads, "max" | "min", what the figure is)
THRESHOLDS = {
    "max_ppl_increase": ("perplexity_increase_pct", "max", "held-out perplexity increase of B over A, %"),
    "min_token_agreement": ("token_agreement", "min", "token agreement of B with A, 0-1"),
    "min_rouge_l": ("rouge_l", "min", "ROUGE-L F of B's completions against A's, 0-1"),
    "min_bleu": ("bleu", "min", "corpus BLEU of B's completions against A's, 0-100"),
    "min_exact_match": ("exact_match", "min", "share of identical completions, 0-1"),
    "min_throughput_speedup": ("throughput_speedup", "min", "output tokens/s of B over A (needs --load-test)"),
    "max_p99_latency_increase": ("latency_p99_increase_pct", "max",
                                 "P99 request latency increase of B over A, % (needs --load-test)"),
}
LOAD_TEST_THRESHOLDS = ("min_throughput_speedup", "max_p99_latency_increase")


@dataclass(frozen=True)
class Thresholds:
    max_ppl_increase: float | None = None
    min_token_agreement: float | None = None
    min_rouge_l: float | None = None
    min_bleu: float | None = None
    min_exact_match: float | None = None
    min_throughput_speedup: float | None = None
    max_p99_latency_increase: float | None = None

    def set(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check(self, load_test: bool) -> None:
        """Refuse thresholds that cannot be judged before any work."""
        for name in LOAD_TEST_THRESHOLDS:
            if getattr(self, name) is not None and not load_test:
                raise UserError(f"--{name.replace('_', '-')} needs --load-test (it judges the load test's figures)")
        for name in ("min_token_agreement", "min_rouge_l", "min_exact_match"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise UserError(f"--{name.replace('_', '-')} is a share from 0 to 1 (got {value})")



def parse_percent(text: str, option: str) -> float:
    """'2%' or '2' -> 2.0 (percent)."""
    try:
        return float(text.strip().removesuffix("%"))
    except ValueError:
        raise UserError(f"{option} takes a percentage such as 2% (got {text!r})") from None


@dataclass(frozen=True)
class ThresholdResult:
    name: str
    figure: str
    limit: float
    value: float
    passed: bool


def judge(thresholds: Thresholds, figures: dict[str, float]) -> list[ThresholdResult]:
    results = []
    for name, limit in thresholds.set().items():
        figure, kind, _ = THRESHOLDS[name]
        value = figures[figure]
        passed = value <= limit if kind == "max" else value >= limit
        results.append(ThresholdResult(name, figure, limit, value, passed))
    return results
