"""Service-level objectives: what `--slo` says and whether one measured load level meets it.

`--slo "ttft_p99<=500ms,itl_p99<=50ms"` is a comma-separated list of clauses METRIC OP VALUE[UNIT]:

- latency metrics (`ttft`, `itl`, `latency`, each at `p50`, `p90` or `p99`), bounded from above (`<=`, `<`),
  with a unit (`us`, `ms` or `s`);
- `output_tokens_per_s`, bounded from below (`>=`, `>`), without a unit (or `tok/s`);
- `joules_per_token` (the level's energy per output token, `pipeline/validate/energy.py`), bounded from above,
  in `j` or `mj` (or `j/token`); a level whose energy was not measured does not meet it.

A load level (validate's `run_level` record) meets the SLO when every clause holds and every request of the
level completed: a failed or shed request has no latency to judge, so a level with one does not meet it.
`violation` says by how much a level misses: the largest relative excess over the clauses (0.2 = 20 % over
a bound; <= 0 when met), which orders the trials that meet no SLO by how close they came.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UserError

#: latency metric -> (run_level key, percentile)
LATENCY_METRICS = {f"{name}_{q}": (f"{name}_ms", q) for name in ("ttft", "itl", "latency")
                   for q in ("p50", "p90", "p99")}
RATE_METRICS = {"output_tokens_per_s": ("output_tokens_per_s", None)}
#: energy per output token, in joules (run_level's `energy` record)
ENERGY_METRIC = "joules_per_token"
ENERGY_METRICS = {ENERGY_METRIC: ("energy", "joules_per_output_token")}
METRICS = {**LATENCY_METRICS, **RATE_METRICS, **ENERGY_METRICS}
#: energy units -> joules
UNITS_J = {"j": 1.0, "mj": 1e-3, "j/token": 1.0}
#: latency units -> milliseconds (run_level reports milliseconds)
UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
#: metrics bounded from above -> (what it is, what its unit measures, its units, an example)
BOUNDED_ABOVE = {**{metric: ("a latency", "latency", UNITS_MS, "500ms") for metric in LATENCY_METRICS},
                 ENERGY_METRIC: ("a cost", "energy", UNITS_J, "0.5j")}
CLAUSE = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>|=)\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*$")
EXAMPLE = '"ttft_p99<=500ms,itl_p99<=50ms"'


@dataclass(frozen=True)
class Clause:
    metric: str        # a key of METRICS
    op: str            # "<=", "<" (latencies, energy) or ">=", ">" (output_tokens_per_s)
    limit: float       # milliseconds for latencies, tokens/s for the rate, joules for energy

    @property
    def upper(self) -> bool:
        return self.op in ("<=", "<")

    def text(self) -> str:
        unit = "ms" if self.metric in LATENCY_METRICS else "j" if self.metric in ENERGY_METRICS else ""
        return f"{self.metric}{self.op}{self.limit:g}{unit}"

    def value(self, level: dict) -> float | None:
        key, q = METRICS[self.metric]
        value = level.get(key)
        return value.get(q) if isinstance(value, dict) else None if q else value

    def holds(self, level: dict) -> bool:
        value = self.value(level)
        if value is None:
            return False
        return {"<=": value <= self.limit, "<": value < self.limit,
                ">=": value >= self.limit, ">": value > self.limit}[self.op]

    def excess(self, level: dict) -> float:
        """Relative distance past the bound: > 0 misses it, <= 0 holds (inf when nothing was measured)."""
        value = self.value(level)
        if value is None:
            return math.inf
        if self.upper:
            return value / self.limit - 1.0
        return 1.0 - value / self.limit


@dataclass(frozen=True)
class Slo:
    clauses: tuple[Clause, ...]

    def text(self) -> str:
        return ",".join(c.text() for c in self.clauses)

    def clause(self, metric: str) -> Clause | None:
        return next((c for c in self.clauses if c.metric == metric), None)

    def meets(self, level: dict) -> bool:
        return incomplete_share(level) == 0 and all(c.holds(level) for c in self.clauses)

    def latency_broken(self, level: dict) -> bool:
        """A latency bound fails or a request did not complete: more clients only make both worse."""
        return incomplete_share(level) > 0 or any(c.upper and not c.holds(level) for c in self.clauses)

    def violation(self, level: dict) -> float:
        """The largest relative excess over the clauses, at least the share of requests that did not complete
        when one did not; <= 0 when the level meets the SLO."""
        worst = max(c.excess(level) for c in self.clauses)
        missing = incomplete_share(level)
        return max(worst, missing) if missing else worst


def incomplete_share(level: dict) -> float:
    requests = level.get("requests") or 0
    return (requests - (level.get("completed") or 0)) / requests if requests else 1.0


def parse_slo(text: str) -> Slo:
    """The clauses of `--slo`; UserError (exit 2) naming the first clause that cannot be read."""
    if not text or not text.strip():
        raise UserError(f"--slo is empty; give clauses such as {EXAMPLE}")
    clauses, seen = [], set()
    for part in text.split(","):
        clause = parse_clause(part)
        if clause.metric in seen:
            raise UserError(f"--slo names {clause.metric} twice; give each metric one bound")
        seen.add(clause.metric)
        clauses.append(clause)
    return Slo(tuple(clauses))


def parse_clause(part: str) -> Clause:
    match = CLAUSE.match(part.lower())
    if not match:
        raise UserError(f"--slo clause {part.strip()!r} is not METRIC<=VALUE (e.g. {EXAMPLE}); metrics: "
                        f"{', '.join(METRICS)}")
    metric, op, number, unit = match.groups()
    if metric not in METRICS:
        raise UserError(f"--slo: unknown metric {metric!r}; known: {', '.join(METRICS)}")
    limit = float(number)
    if metric in BOUNDED_ABOVE:
        kind, quantity, units, example = BOUNDED_ABOVE[metric]
        if op not in ("<=", "<"):
            raise UserError(f"--slo {part.strip()!r}: {metric} is {kind}, bound it from above (<= or <)")
        if unit not in units:
            raise UserError(f"--slo {part.strip()!r}: give the {quantity} a unit ({', '.join(units)}), e.g. {example}")
        limit *= units[unit]
    else:
        if op not in (">=", ">"):
            raise UserError(f"--slo {part.strip()!r}: {metric} is a rate, bound it from below (>= or >)")
        if unit not in ("", "tok/s"):
            raise UserError(f"--slo {part.strip()!r}: {metric} takes no unit but tok/s, got {unit!r}")
    if limit <= 0:
        raise UserError(f"--slo {part.strip()!r}: the bound must be positive")
    return Clause(metric, op, limit)


def best_level(levels: list[dict], slo: Slo) -> dict | None:
    """The level meeting the SLO with the most output tokens/s (None when no level meets it)."""
    meeting = [lv for lv in levels if slo.meets(lv)]
    return max(meeting, key=lambda lv: lv["output_tokens_per_s"]) if meeting else None


def closest_level(levels: list[dict], slo: Slo) -> dict | None:
    """The level that misses the SLO by the least (None without levels)."""
    return min(levels, key=slo.violation) if levels else None
