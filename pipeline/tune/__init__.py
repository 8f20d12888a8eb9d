"""`trtpipe tune`: measured load against an SLO, an Optuna search over what changes without (or, with
--rebuild, with) rebuilding the engine, and the best configuration written back as a plan overlay and a
ready repository.

Modules: `slo` (parsing `--slo`, judging a load level), `source` (the build directory or repository tuned),
`space` (the search space per backend; the planner's memory model as the constraint; the typed overlay on
the plan), `trial` (render, serve, load one candidate), `study` (the Optuna study: SQLite, TPE, pruning,
the trial records), `plots` and `report` (the result directory), `stage` (the command's whole run).
"""

from .slo import Slo, parse_slo
from .stage import TuneOptions, TuneResult, tune, tune_options

__all__ = ["Slo", "TuneOptions", "TuneResult", "parse_slo", "tune", "tune_options"]
