"""What a study leaves: OUT/result/, written atomically (a temporary sibling, renamed when complete).

- trials.json: the SLO, the load, the space and every trial (parameters, each load level's TTFT / ITL /
  request latency P50/P90/P99, output tokens/s, failed and shed requests, why it was pruned or never run);
- trials.csv: one row per trial at its operating level (its best level meeting the SLO, else the closest);
- tradeoff.png (throughput vs P99 TTFT, SLO line, Pareto front) and importances.png;
- summary.json: the best trial and the plan's own configuration under the same load, side by side;
- when a trial met the SLO: overlay.json (the plan fields the best trial changes, and the instance counts),
  plan.json (the plan with them) and model_repo/ (ready to serve). When none did, these are not written:
  nothing in the result looks like a deployment that meets the SLO.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..outputs import atomic_output_dir
from ..plan import Plan, save_plan
from ..plan.feedback import measured_on
from .plots import level_points, param_importances, pareto_front, plot_importances, plot_tradeoff
from .slo import METRICS, Slo
from .space import Candidate, SearchSpace, candidate_plan
from .study import TrialRecord

RESULT_DIR = "result"
PLAN_SECTIONS = ("triton", "build_config", "plugin_config", "memory")


@dataclass(frozen=True)
class StudyOutcome:
    """The trials of a study judged against its SLO."""

    slo: Slo
    records: list[TrialRecord]

    @property
    def served(self) -> list[TrialRecord]:
        return [r for r in self.records if r.levels]

    @property
    def best(self) -> TrialRecord | None:
        meeting = [r for r in self.served if r.meets(self.slo)]
        return max(meeting, key=lambda r: r.operating(self.slo)["output_tokens_per_s"]) if meeting else None

    @property
    def closest(self) -> TrialRecord | None:
        served = self.served
        return min(served, key=lambda r: self.slo.violation(r.operating(self.slo))) if served else None

    @property
    def default(self) -> TrialRecord | None:
        return next((r for r in self.served if r.origin == "plan default"), None)

    def default_on_pareto_front(self) -> bool:
        points = level_points(self.served)
        front = pareto_front([(lv["ttft_ms"]["p99"], lv["output_tokens_per_s"]) for _, lv in points])
        return any(points[i][0].origin == "plan default" for i in front)


def operating_row(record: TrialRecord, slo: Slo) -> dict:
    """One CSV row: the trial and its operating level's figures."""
    level = record.operating(slo) or {}
    row = {"trial": record.number, "origin": record.origin, "kind": record.kind, **record.params,
           "meets_slo": record.meets(slo), "violation": record.violation, "concurrency": level.get("concurrency"),
           "output_tokens_per_s": level.get("output_tokens_per_s")}
    for metric in ("ttft_ms", "itl_ms", "latency_ms"):
        for q in ("p50", "p90", "p99"):
            row[f"{metric[:-3]}_{q}_ms"] = (level.get(metric) or {}).get(q)
    predicted = level.get("predicted") or {}
    row.update(predicted_ttft_ms=predicted.get("ttft_ms"), predicted_tpot_ms=predicted.get("tpot_ms"),
               predicted_output_tokens_per_s=predicted.get("output_tokens_per_s"))
    row.update(requests=level.get("requests"), failed=level.get("failed"), shed=level.get("shed"),
               errors="; ".join(level.get("errors") or []), reason=record.reason)
    return row


def write_table(outcome: StudyOutcome, space: SearchSpace, load: dict, out: Path, deployment: dict) -> None:
    data = {"slo": outcome.slo.text(), "metrics": list(METRICS), "load": load, "measured_on": deployment,
            "space": [asdict(p) for p in space.params], "space_notes": list(space.notes),
            "trials": [r.to_dict() for r in outcome.records]}
    (out / "trials.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    rows = [operating_row(r, outcome.slo) for r in outcome.records]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(out / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plan_overlay(base: Plan, best: Plan, candidate: Candidate, trial: int) -> dict:
    """The plan fields the best trial changes (section -> field -> value) and the instance counts."""
    before, after = base.to_dict(), best.to_dict()
    changed = {section: {k: v for k, v in (after[section] or {}).items() if (before[section] or {}).get(k) != v}
               for section in PLAN_SECTIONS}
    return {"trial": trial, "candidate": candidate.params(), "plan": {k: v for k, v in changed.items() if v},
            "instances": asdict(candidate.instances),
            "applies_to": {"model": base.model.name, "target": base.target.name, "backend": base.backend}}


def side_by_side(outcome: StudyOutcome) -> dict:
    slo, best, default = outcome.slo, outcome.best, outcome.default
    figures = {name: None if r is None else {"trial": r.number, "params": r.params, "meets_slo": r.meets(slo),
                                             "level": r.operating(slo)}
               for name, r in (("best", best), ("plan_default", default), ("closest", outcome.closest))}
    speedup = None
    if best and default and default.meets(slo):
        speedup = best.operating(slo)["output_tokens_per_s"] / default.operating(slo)["output_tokens_per_s"]
    return {**figures, "speedup_over_default": speedup, "default_on_pareto_front": outcome.default_on_pareto_front()}


def write_result(out: Path, study, outcome: StudyOutcome, space: SearchSpace, base: Plan, load: dict,
                 render) -> dict:
    """OUT/result/ (atomically); `render(plan, candidate, trial, repo_dir)` writes the winner's repository.
    Returns summary.json's content."""
    importances, note = param_importances(study)
    summary = {"slo": outcome.slo.text(), "load": load, "trials": len(outcome.records),
               "served": len(outcome.served), "met": outcome.best is not None, **side_by_side(outcome),
               "importances": importances, "importances_note": note}
    with atomic_output_dir(Path(out) / RESULT_DIR) as tmp:
        write_table(outcome, space, load, tmp, measured_on(base))
        plot_tradeoff(outcome.records, outcome.slo, tmp / "tradeoff.png", outcome.best, outcome.default)
        plot_importances(importances, note, tmp / "importances.png")
        if outcome.best is not None:
            write_winner(tmp, base, outcome.best, space, render)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def write_winner(tmp: Path, base: Plan, best: TrialRecord, space: SearchSpace, render) -> None:
    candidate = Candidate.from_params({**space.default.params(), **best.params})
    plan = candidate_plan(base, candidate)
    save_plan(plan, tmp / "plan.json")
    (tmp / "overlay.json").write_text(json.dumps(plan_overlay(base, plan, candidate, best.number), indent=2) + "\n")
    render(plan, candidate, best.number, tmp / "model_repo")
