"""`trtpipe tune`: the study from start to result, and what the command prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..compare.serving import load_prompts
from .report import RESULT_DIR, StudyOutcome, write_result
from .slo import ENERGY_METRIC, Slo, parse_slo
from .source import TuneSource, read_source
from .space import Candidate, build_space
from .study import STUDY_FILE, TrialRecord, open_study, records, run_study, study_key
from .trial import LoadSpec, TrialRunner, check_can_serve, check_load_generator, parse_concurrencies, render_candidate


@dataclass(frozen=True)
class TuneOptions:
    slo: Slo
    load: LoadSpec
    trials: int = 8
    url: str | None = None
    rebuild: bool = False
    out: Path | None = None
    seed: int = 0
    ready_timeout: float = 600.0
    progress: bool = True


def tune_options(*, slo: str, concurrency: str | tuple[int, ...], prompts: str | None, num_prompts: int,
                 max_tokens: int, requests_per_client: int, load_generator: str, price_per_hour: float | None = None,
                 **rest) -> TuneOptions:
    """TuneOptions from the command line's strings (each checked: UserError, exit 2)."""
    parsed = parse_slo(slo)
    levels = parse_concurrencies(concurrency) if isinstance(concurrency, str) else concurrency
    check_load_generator(load_generator)
    described, texts = load_prompts(prompts, num_prompts)
    load = LoadSpec(tuple(texts), described, max_tokens, levels, requests_per_client, load_generator, price_per_hour,
                    needs_energy=parsed.clause(ENERGY_METRIC) is not None)
    return TuneOptions(slo=parsed, load=load, **rest)


@dataclass
class TuneResult:
    out: Path
    outcome: StudyOutcome
    summary: dict = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.outcome.best is not None

    def to_dict(self) -> dict:
        return {"out": str(self.out), "study": str(self.out / STUDY_FILE), "result": str(self.out / RESULT_DIR),
                **self.summary}

    def render(self) -> str:
        slo, outcome, result = self.outcome.slo, self.outcome, self.out / RESULT_DIR
        lines = [f"{len(outcome.records)} trials ({len(outcome.served)} served) in {self.out / STUDY_FILE}"]
        if outcome.default:
            lines.append(f"plan's configuration: {describe(outcome.default, slo)}")
        if outcome.best:
            lines.append(f"best at the SLO:      {describe(outcome.best, slo)}")
            speedup = self.summary.get("speedup_over_default")
            if speedup:
                lines.append(f"{speedup:.2f}x the plan's configuration's output tokens/s under the same load")
            lines.append(f"wrote {result}/plan.json, overlay.json and model_repo/ (serve it with "
                         f"`trtpipe serve {result}/model_repo`)")
        else:
            lines.append(f"no trial meets the SLO {slo.text()}; closest: {describe(outcome.closest, slo)}")
        lines.append(f"trial table {result}/trials.json, trials.csv; plots tradeoff.png, importances.png")
        return "\n".join(lines)


def describe(record: TrialRecord | None, slo: Slo) -> str:
    if record is None:
        return "none"
    level = record.operating(slo)
    if not level:
        return f"trial {record.number} ({record.kind}: {record.reason})"
    params = ", ".join(f"{k} {v}" for k, v in record.params.items())
    ttft, itl = level["ttft_ms"]["p99"], level["itl_ms"]["p99"]
    return (f"trial {record.number} ({params}): {level['output_tokens_per_s']:.1f} output tokens/s at concurrency "
            f"{level['concurrency']}, TTFT p99 {fmt(ttft)} ms, ITL p99 {fmt(itl)} ms"
            + ("" if record.meets(slo) else f", misses the SLO by {slo.violation(level):.0%}"))


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def tune(path: Path, options: TuneOptions, say: Callable[[str], None] = print) -> TuneResult:
    """Run (or resume) the study for the deployment at `path` and write its result."""
    source = read_source(path)
    space = build_space(source.plan, options.slo, options.load.concurrencies, options.rebuild)
    check_can_serve(source, options.url, options.rebuild)
    out = Path(options.out or source.default_out).resolve()
    load = options.load.identity()
    study = open_study(out / STUDY_FILE, study_key(source.plan, options.slo, load, space), options.seed)
    for note in space.notes:
        say(f"note: {note}")
    runner = TrialRunner(source, options.load, out / "trials", options.url, options.ready_timeout)
    run_with_progress(study, source, space, options, runner, say)
    outcome = StudyOutcome(options.slo, records(study))
    summary = write_result(out, study, outcome, space, source.plan, {**load, "prompts_from": options.load.prompts_from},
                           winner_renderer(source, runner))
    return TuneResult(out, outcome, summary)


def run_with_progress(study, source: TuneSource, space, options: TuneOptions, runner: TrialRunner, say) -> None:
    from rich.progress import Progress

    def report(record: TrialRecord) -> None:
        progress.advance(task)
        state = record.kind if record.kind != "measured" else ("meets the SLO" if record.meets(options.slo)
                                                               else "misses the SLO")
        say(f"trial {record.number} [{record.origin}] {state}: {describe(record, options.slo)}")

    with Progress(transient=True, disable=not options.progress) as progress:
        task = progress.add_task("tune", total=options.trials)
        run_study(study, source.plan, space, options.slo, options.trials, runner.run, report)


def winner_renderer(source: TuneSource, runner: TrialRunner):
    """How the best trial's repository is written into the result (its engine: the deployment's, or the one
    compiled for that trial)."""
    def render(plan, candidate: Candidate, trial: int, repo: Path) -> None:
        compiled = runner.work / f"trial-{trial}" / "engine"
        engine = source.engine if plan.build_config == source.plan.build_config else compiled
        render_candidate(source, plan, candidate, repo, engine)
    return render


def result_json(result: TuneResult) -> str:
    return json.dumps(result.to_dict(), indent=2, default=str)
