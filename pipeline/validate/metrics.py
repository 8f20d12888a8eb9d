"""The metrics check: the served model's request counters on Triton's Prometheus endpoint count what validate sent.

Dashboards, alerts and the autoscaler read `nv_inference_request_success` and `nv_inference_request_failure`
(labelled model, version and, for failures since Triton 2.51, reason). validate reads them for the `ensemble`
before its first request and after its last, and compares the growth with its own tally of the requests
(`client.Tally`):
  - success grows by the requests answered completely;
  - failure grows by the requests that failed inside the ensemble (refused by a model, shed by a full
    queue), once or twice each: Triton 2.51 counts a failed ensemble request twice (measured on the
    embedded server); requests Triton's frontend refused before the ensemble ran (an unknown input, a
    wrong JSON type) are not counted at all;
  - requests without a complete answer (timeouts) may or may not have been counted, and widen the range.
An llmapi repository has no ensemble: the counters are its `tensorrt_llm` model's, and a refused request may have
been refused by Triton's frontend (not counted), or answered with an error by the decoupled model, which Triton
2.51 counts as a success most of the time (measured: of validate's 10 llmapi bad requests, 7 counted as
successes, 1 as a failure, 2 not at all); Triton's answer does not say which, so each widens both ranges by one.
Other clients of the same server make the counts grow too: validate an idle server, or skip the check.

The exposition format is parsed here (a sample per line: name, optional {labels}, value); the venv has no
prometheus_client.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict

import requests

from .client import ENSEMBLE, TallyingClient
from .report import CheckResult

#: Triton's default metrics port (`--metrics-port`)
METRICS_PORT = 8002
SUCCESS, FAILURE = "nv_inference_request_success", "nv_inference_request_failure"
#: how long the counters may lag the last response (Triton records a request's statistics after answering it)
SETTLE_S = 3.0
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
UNREACHABLE_FIX = ("start Triton with metrics on (--allow-metrics=true, the default) and pass --metrics-url "
                   f"http://HOST:PORT (its --metrics-port, default {METRICS_PORT}), or --skip-metrics to skip "
                   "this check")


class MetricsUnavailable(Exception):
    """The metrics endpoint did not answer, or does not serve the request counters."""


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text exposition format."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line.strip())
        if line.startswith("#") or not match:
            continue
        name, labels, value = match.groups()
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in LABEL.findall(labels or "")}
        samples.append((name, labels, float(value)))
    return samples


def ensemble_counts(text: str, model: str = ENSEMBLE) -> dict[str, float]:
    """`model`'s success and failure counts (failures summed over their reasons) from a /metrics page."""
    samples = parse_samples(text)
    missing = [family for family in (SUCCESS, FAILURE) if not any(name == family for name, _, _ in samples)]
    if missing:
        raise MetricsUnavailable(f"the metrics page has no {' or '.join(missing)}")
    return {family: sum(value for name, labels, value in samples if name == family and labels.get("model") == model)
            for family in (SUCCESS, FAILURE)}


def read_counts(metrics_url: str | None, model: str = ENSEMBLE) -> dict[str, float]:
    """`model`'s counts from `metrics_url`/metrics; MetricsUnavailable saying what went wrong."""
    if not metrics_url:
        raise MetricsUnavailable("no metrics URL known")
    try:
        response = requests.get(f"{metrics_url}/metrics", timeout=10)
    except requests.RequestException as exc:
        raise MetricsUnavailable(f"{metrics_url}/metrics does not answer ({type(exc).__name__})") from None
    if response.status_code != 200:
        raise MetricsUnavailable(f"{metrics_url}/metrics answered {response.status_code}")
    return ensemble_counts(response.text, model)


def counts_before(metrics_url: str | None, model: str = ENSEMBLE) -> dict[str, float] | str:
    """The counts before validate's first request, or why they cannot be read (reported by the check)."""
    try:
        return read_counts(metrics_url, model)
    except MetricsUnavailable as exc:
        return str(exc)


def expected_ranges(client: TallyingClient) -> dict[str, tuple[int, int]]:
    """The growth of each counter that the requests sent so far explain: (least, most)."""
    tally = client.tally
    return {SUCCESS: (tally.succeeded, tally.succeeded + tally.unanswered + tally.unclassified),
            FAILURE: (tally.failed, 2 * (tally.failed + tally.unanswered) + tally.unclassified)}


def check_metrics(client: TallyingClient, metrics_url: str | None, before: dict[str, float] | str) -> CheckResult:
    if isinstance(before, str):
        return CheckResult("metrics", False, f"metrics unreadable: {before}", fix=UNREACHABLE_FIX)
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            after = read_counts(metrics_url, client.model)
        except MetricsUnavailable as exc:
            return CheckResult("metrics", False, f"metrics unreadable after the requests: {exc}", fix=UNREACHABLE_FIX)
        grown = {family: after[family] - before[family] for family in (SUCCESS, FAILURE)}
        expected = expected_ranges(client)
        wrong = [family for family, (least, most) in expected.items() if not least <= grown[family] <= most]
        if not wrong or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    tally = client.tally
    detail = (f"{client.model}: {SUCCESS} +{grown[SUCCESS]:g} for {tally.succeeded} successful requests, {FAILURE} "
              f"+{grown[FAILURE]:g} for {tally.failed} failed inside the ensemble (counted once or twice each); "
              f"{tally.refused} refused before the ensemble ran (not counted)")
    if tally.unclassified:
        detail += f"; {tally.unclassified} failed before or inside the model (counted or not)"
    if tally.unanswered:
        detail += f"; {tally.unanswered} unanswered (may or may not be counted)"
    if wrong:
        detail = "; ".join(f"{family} grew by {grown[family]:g}, expected {expected[family][0]}"
                           + (f" to {expected[family][1]}" if expected[family][1] != expected[family][0] else "")
                           for family in wrong) + f" ({detail})"
    return CheckResult("metrics", not wrong, detail, data={"before": before, "after": after, "grown": grown,
                                                            "tally": asdict(tally)},
                       fix="" if not wrong else "the metrics do not count validate's requests: if other clients "
                       "used the server meanwhile, validate an idle server (or pass --skip-metrics); otherwise "
                       "check that --metrics-url is this server's metrics port")
