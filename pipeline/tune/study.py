"""The Optuna study: seeded TPE in a SQLite file, the plan's configuration and the roofline's first, the
planner as the constraint, trials pruned when their first load level already breaks the SLO.

- Objective: the output tokens/s of the trial's best load level that meets the SLO (maximized); a constraint
  value (`violation`, <= 0 feasible: `Trial.set_constraint`) tells TPE which trials meet it.
- A candidate the planner refuses (`space.Infeasible`) is never served: it is told to the study as pruned
  with the reason, and does not count against --trials.
- A trial stops at the first level that breaks a latency bound (or loses a request); when that is its first
  (lowest) level the trial is pruned: no configuration meets the SLO by adding clients.
- The study records what it was run for (model, target, backend, SLO, load, space); opening it for anything
  else is a UserError (exit 2). A trial left running by an interrupted run is marked failed on resume.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..compare.builds import MODEL_IDENTITY_FIELDS
from ..errors import UserError
from ..plan import Plan
from .slo import Slo, best_level, closest_level
from .space import Candidate, Infeasible, SearchSpace, candidate_plan

STUDY_FILE = "study.db"
STUDY_NAME = "trtpipe-tune"
#: the constraint value of a candidate that was never served
NEVER_RUN = 1e6
#: candidates asked per trial of the budget before the space is declared infeasible
MAX_ASKS_PER_TRIAL = 20

RunTrial = Callable[[int, Candidate, Plan, Callable[[dict], bool]], list[dict]]


def optuna_module():
    try:
        import optuna
    except ImportError:
        raise UserError("trtpipe tune needs Optuna: pip install 'trtpipe[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def study_key(plan: Plan, slo: Slo, load: dict, space: SearchSpace) -> dict:
    """What a study's measurements answer; a study is only resumed for the same key."""
    model = plan.model.to_dict()
    return {"model": {k: model.get(k) for k in MODEL_IDENTITY_FIELDS}, "model_name": plan.model.name,
            "target": plan.target.name, "backend": plan.backend, "precision": plan.precision, "slo": slo.text(),
            "load": load, "space": sorted(p.name for p in space.params)}


def open_study(db: Path, key: dict, seed: int):
    """The study in `db` (created when absent); UserError when it was made for another key."""
    optuna = optuna_module()
    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        study = optuna.create_study(storage=f"sqlite:///{db}", study_name=STUDY_NAME, direction="maximize",
                                    load_if_exists=True, sampler=sampler(optuna, seed, 0))
    except Exception as exc:  # noqa: BLE001  (SQLAlchemy and Optuna raise many types for a file that is not a study)
        raise UserError(f"{db} is not a trtpipe tune study ({type(exc).__name__}: {exc}); pass another -o") from None
    recorded = study.user_attrs.get("key")
    if recorded is None:
        study.set_user_attr("key", key)
    else:
        check_key(recorded, key, db)
    study.sampler = sampler(optuna, seed, len(study.trials))
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)   # left running by a run that was killed
    return study


def sampler(optuna, seed: int, done: int):
    """Seeded TPE; the seed moves on with the trials already in the study, so a resumed run does not draw
    the first run's random candidates again."""
    return optuna.samplers.TPESampler(seed=seed + done, n_startup_trials=4)


def check_key(recorded: dict, key: dict, db: Path) -> None:
    if recorded.get("model") != key["model"] or recorded.get("target") != key["target"]:
        raise UserError(f"{db} is a study of {recorded.get('model_name')} on {recorded.get('target')}, not of "
                        f"{key['model_name']} on {key['target']}: a study from another model; pass another -o")
    for part, what in (("backend", "backend"), ("precision", "precision"), ("slo", "--slo"), ("load", "load"),
                       ("space", "search space")):
        if recorded.get(part) != key[part]:
            raise UserError(f"{db} was run with another {what} ({recorded.get(part)!r}, now {key[part]!r}); its "
                            "trials answer that question only: pass the same options or another -o")


def distributions(space: SearchSpace) -> dict:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made = {}
    for p in space.params:
        if p.kind == "int":
            made[p.name] = IntDistribution(int(p.low), int(p.high), log=p.log)
        elif p.kind == "float":
            made[p.name] = FloatDistribution(p.low, p.high, log=p.log)
        else:
            made[p.name] = CategoricalDistribution(p.choices)
    return made


def enqueue_starting_points(study, space: SearchSpace) -> None:
    """The plan's configuration, then the roofline's, unless the study has (or awaits) them already."""
    state = optuna_module().trial.TrialState
    names = {p.name for p in space.params}
    present = {t.user_attrs.get("origin") for t in study.get_trials(deepcopy=False)
               if t.state in (state.COMPLETE, state.PRUNED, state.WAITING)}
    for origin, candidate in (("plan default", space.default), *(("roofline", c) for c in space.start)):
        if origin not in present:
            params = {k: v for k, v in candidate.params().items() if k in names}
            study.enqueue_trial(params, user_attrs={"origin": origin})


# ----------------------------------------------------------------------------------------------
# The trials


@dataclass
class Outcome:
    pruned: bool
    value: float
    violation: float
    reason: str = ""


def judge(levels: list[dict], slo: Slo) -> Outcome:
    """A measured trial: pruned when its first level already breaks a latency bound, else its tokens/s at
    the SLO (or, when no level meets it, at the closest level, with a positive violation)."""
    violation = min(slo.violation(lv) for lv in levels)
    best = best_level(levels, slo) or closest_level(levels, slo)
    if slo.latency_broken(levels[0]):
        first = levels[0]
        return Outcome(True, best["output_tokens_per_s"], violation,
                       f"its first level (concurrency {first['concurrency']}) already breaks the SLO")
    return Outcome(False, best["output_tokens_per_s"], violation)


def run_study(study, base: Plan, space: SearchSpace, slo: Slo, budget: int, run_trial: RunTrial,
              on_trial: Callable[[TrialRecord], None] = lambda record: None) -> None:
    """Ask, check, serve and tell until `budget` trials were served (infeasible ones are not)."""
    optuna = optuna_module()
    state = optuna.trial.TrialState
    dists = distributions(space)
    enqueue_starting_points(study, space)
    asks = 0
    while served(study) < budget:
        if asks >= budget * MAX_ASKS_PER_TRIAL:
            raise UserError(f"the planner refused {asks} candidates in a row: the space has nothing that fits "
                            f"{base.target.name}; see the study's infeasible trials")
        asks += 1
        trial = study.ask(dists)
        candidate = Candidate.from_params({**space.default.params(), **trial.params})
        try:
            plan = candidate_plan(base, candidate)
        except Infeasible as exc:
            mark(trial, kind="infeasible", reason=str(exc), violation=NEVER_RUN)
            on_trial(to_record(study.tell(trial, state=state.PRUNED)))
            continue
        on_trial(to_record(study.tell(*serve_trial(trial, candidate, plan, slo, run_trial, state))))


def serve_trial(trial, candidate: Candidate, plan: Plan, slo: Slo, run_trial: RunTrial, state) -> tuple:
    """(trial, value, state) for study.tell after serving the candidate."""
    try:
        levels = run_trial(trial.number, candidate, plan, slo.latency_broken)
    except KeyboardInterrupt:
        mark(trial, kind="interrupted", reason="interrupted")
        trial.study.tell(trial, state=state.FAIL)
        raise
    except Exception as exc:  # noqa: BLE001  (a candidate the server cannot load fails its trial, not the study)
        if trial.user_attrs.get("origin") == "plan default":   # the baseline must serve: anything else is systemic
            trial.study.tell(trial, state=state.FAIL)
            if isinstance(exc, UserError):
                raise
            raise RuntimeError(f"the plan's own configuration did not serve: {exc}") from exc
        mark(trial, kind="failed", reason=f"{type(exc).__name__}: {exc}"[:500], served=True)
        return trial, None, state.FAIL
    outcome = judge(levels, slo)
    for step, level in enumerate(levels):
        trial.report(level["output_tokens_per_s"], step)
    mark(trial, kind="pruned" if outcome.pruned else "measured", reason=outcome.reason, levels=levels,
         violation=outcome.violation, served=True)
    return (trial, None, state.PRUNED) if outcome.pruned else (trial, outcome.value, state.COMPLETE)


def mark(trial, **attrs) -> None:
    """User attributes for the report; the violation is also the trial's constraint (TPE's feasibility)."""
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    if "violation" in attrs:
        trial.set_constraint("slo_violation", attrs["violation"])


def served(study) -> int:
    """Trials that were served to the end (measured, pruned by the SLO, or failed by the server)."""
    finished = ("COMPLETE", "PRUNED", "FAIL")
    return sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("served") and t.state.name in finished
               and (t.state.name != "FAIL" or t.user_attrs.get("kind") == "failed"))


# ----------------------------------------------------------------------------------------------
# What a trial was, for the report


@dataclass(frozen=True)
class TrialRecord:
    number: int
    origin: str                  # "plan default" | "roofline" | "tpe"
    kind: str                    # "measured" | "pruned" | "infeasible" | "failed" | "interrupted"
    params: dict
    levels: list[dict] = field(default_factory=list)
    violation: float | None = None
    reason: str = ""

    def operating(self, slo: Slo) -> dict | None:
        """The level the trial is judged at: its best level meeting the SLO, else the closest."""
        return best_level(self.levels, slo) or closest_level(self.levels, slo)

    def meets(self, slo: Slo) -> bool:
        return best_level(self.levels, slo) is not None

    def to_dict(self) -> dict:
        return asdict(self)


def to_record(trial) -> TrialRecord:
    attrs = trial.user_attrs
    violation = attrs.get("violation")
    kind = attrs.get("kind", "interrupted" if trial.state.name == "FAIL" else trial.state.name.lower())
    return TrialRecord(number=trial.number, origin=attrs.get("origin", "tpe"), kind=kind,
                       params=dict(trial.params), levels=list(attrs.get("levels", [])),
                       violation=None if violation in (None, NEVER_RUN) else violation, reason=attrs.get("reason", ""))


def records(study) -> list[TrialRecord]:
    """Every finished trial (not the ones still waiting in the queue)."""
    return [to_record(t) for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
