"""The study's two plots: throughput against P99 TTFT (every measured level, the SLO line, the Pareto front,
the plan's configuration and the best one) and the parameter importances Optuna reports."""

from __future__ import annotations

from pathlib import Path

from .slo import Slo
from .study import TrialRecord


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x = P99 TTFT, higher y = tokens/s),
    ordered by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((ox <= x and oy >= y) and (ox < x or oy > y) for ox, oy in points)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def level_points(records: list[TrialRecord]) -> list[tuple[TrialRecord, dict]]:
    """(trial, level) for every measured level with a P99 TTFT."""
    return [(r, lv) for r in records for lv in r.levels if lv.get("ttft_ms", {}).get("p99") is not None]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tradeoff(records: list[TrialRecord], slo: Slo, path: Path, best: TrialRecord | None,
                  default: TrialRecord | None) -> None:
    plt = _pyplot()
    points = level_points(records)
    xy = [(lv["ttft_ms"]["p99"], lv["output_tokens_per_s"]) for _, lv in points]
    fig, ax = plt.subplots(figsize=(8, 5))
    meets = [slo.meets(lv) for _, lv in points]
    for ok, colour, label in ((True, "tab:green", "meets the SLO"), (False, "tab:gray", "misses the SLO")):
        chosen = [p for p, m in zip(xy, meets) if m == ok]
        if chosen:
            ax.scatter(*zip(*chosen), c=colour, alpha=0.7, label=label)
    front = [xy[i] for i in pareto_front(xy)]
    if front:
        ax.step(*zip(*front), where="post", color="tab:blue", label="Pareto front")
    for record, marker, label in ((default, "s", "plan's configuration"), (best, "*", "best at the SLO")):
        level = record.operating(slo) if record else None
        if level and level.get("ttft_ms", {}).get("p99") is not None:
            ax.scatter([level["ttft_ms"]["p99"]], [level["output_tokens_per_s"]], marker=marker, s=180,
                       facecolors="none", edgecolors="black", label=f"{label} (trial {record.number})")
    ttft = slo.clause("ttft_p99")
    if ttft is not None:
        ax.axvline(ttft.limit, color="tab:red", linestyle="--", label=f"SLO ttft_p99 {ttft.op} {ttft.limit:g} ms")
    ax.set(xlabel="P99 time to first token (ms)", ylabel="output tokens/s",
           title=f"trtpipe tune: every trial's load levels (SLO {slo.text()})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def param_importances(study) -> tuple[dict[str, float], str]:
    """Optuna's importances of the parameters for the objective, or ({}, why not)."""
    from .study import optuna_module

    optuna = optuna_module()
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if len(complete) < 2:
        return {}, f"{len(complete)} completed trial(s): importances need at least 2"
    try:
        importances = dict(optuna.importance.get_param_importances(study))
    except (RuntimeError, ValueError) as exc:
        return {}, f"Optuna could not compute importances: {exc}"
    return importances, (f"Optuna's default evaluator (PED-ANOVA) over {len(complete)} completed trials"
                         + (": indicative only" if len(complete) < 10 else ""))


def plot_importances(importances: dict[str, float], note: str, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 * max(len(importances), 2) + 1.5))
    if importances:
        names = list(importances)[::-1]
        ax.barh(names, [importances[n] for n in names], color="tab:blue")
        ax.set(xlabel="importance (normalized)")
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", wrap=True)
        ax.set_axis_off()
    ax.set_title(f"parameter importances for output tokens/s at the SLO\n{note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
