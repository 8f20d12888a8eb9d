"""What a validation run is given (`ValidateOptions`) and what it produces: one `CheckResult` per check,
gathered in a `ValidationReport` (report.json) and rendered as the human-readable verdict.

Kept apart from the stage (`stage.py`) because every check builds `CheckResult`s and reads the options,
while the stage imports the checks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from .. import __version__
from .client import REQUEST_TIMEOUT_S

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
)


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)
    skipped: bool = False   # not run, for a reason the detail gives (and `fix` says how to run it): no failure

    @property
    def failed(self) -> bool:
        return not self.passed and not self.skipped


@dataclass
class ValidationReport:
    repo: str
    server: str
    checks: list[CheckResult]
    log_path: str | None = None
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def passed(self) -> bool:
        return not any(check.failed for check in self.checks)

    def to_dict(self) -> dict:
        return {"repo": self.repo, "server": self.server, "passed": self.passed,
                "checks": [asdict(check) for check in self.checks], "server_log": self.log_path,
                "trtpipe_version": __version__, "created": self.created}


class GreedyReference(Protocol):
    """What the golden check compares the server with: greedy completions of prompts (`pipeline/golden.py`)."""

    name: str
    exact: bool  # token-identical expected (unquantized); otherwise token agreement is reported

    def complete_all(self, prompts: list[str], max_tokens: int) -> list[str]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def agreement(self, prompt: str, completion: str) -> tuple[int, int]:
        """(tokens of `completion` that are the reference's greedy choice after the prompt and the
        completion so far, tokens of `completion`)."""
        ...


@dataclass
class ValidateOptions:
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 16
    golden: GreedyReference | None = None
    load_test: bool = False
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    requests_per_client: int = 2
    #: quantized checkpoints: share of the served tokens that are the reference's greedy choice given the
    #: same prefix (teacher forcing), needed to pass; SmolLM2 FP8 (GPTQ) measured 89%
    min_agreement: float = 0.7
    request_timeout: float = REQUEST_TIMEOUT_S
    #: compare the server's request counters (Prometheus /metrics) with the requests validate sent
    metrics: bool = True
    #: the deployment's price per hour (any currency): the load test reports its cost per million output tokens
    price_per_hour: float | None = None


def render_report(report: ValidationReport, out: Path) -> str:
    """The human-readable verdict: one line per check, and what to fix for each failure."""
    lines = [f"validated {report.repo or report.server} on {report.server}"]
    for check in report.checks:
        status = "PASS" if check.passed else "SKIP" if check.skipped else "FAIL"
        lines.append(f"  {status}  {check.name:<15} {check.detail}")
        if not check.passed and check.fix:
            lines.append(f"        {'to run it' if check.skipped else 'fix'}: {check.fix}")
    skipped = [c.name for c in report.checks if c.skipped]
    verdict = "all checks passed" if report.passed else \
        f"{sum(c.failed for c in report.checks)} of {len(report.checks)} checks failed"
    if skipped:
        verdict += f" ({len(skipped)} skipped: {', '.join(skipped)})"
    lines.append(f"{verdict}; report: {Path(out) / 'report.json'}")
    return "\n".join(lines)
