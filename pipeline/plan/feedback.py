"""Predicted against measured: what a plan predicts for a load level, and the correction measurements make of it.

A load level (validate --load-test, a tune trial) is `concurrency` closed-loop clients sending requests of
`input_tokens` prompt tokens for `output_tokens` tokens to a server whose batch holds at most `max_batch`
sequences. The plan predicts its TTFT, TPOT and output tokens/s from two phase times, the prefill of one prompt
(linear in its tokens between the two prompt lengths timed) and the decode step (fixed + per sequence + per
sequence and token of its context: `decode_step`), and from how its backend batches (`Backend.batching`):

- static (the llmapi contract's cpu model, model_repo/llmapi_pytorch): the model's worker generates everything
  queued when it is free as one batch, to its end, its prompts prefilled one after another before the first token.
  c closed-loop clients settle into two groups that take turns, one request alone and the other c - 1 together
  (the first request of a sweep reaches the idle worker alone; the rest queue behind it and are taken together,
  and each group's clients resubmit while the other generates: measured by benchmarks/bench_cpu_prediction.py).
  The medians are the larger group's: TTFT = (c - 1) x prefill + the lone request's round (prefill + (output - 1)
  x step(1)); TPOT = step(c - 1); tokens/s = c x output / both rounds. One client: TTFT = prefill, TPOT = step(1).
- in flight (an engine; the cpu target's reference runtime): where the plan has aiconfigurator-core figures (measured
  or derived), AIC's serving estimate at that batch and those lengths (one client: its prefill alone,
  `performance.one_sequence`); else, with b = min(c, max_batch) sequences running, trtpipe's speed-of-light bound
  (TTFT = prefill + the rounds ahead when c > max_batch, TPOT = step(b), tokens/s = b / step(b)), or for the timed cpu
  plan the same with every admitted prompt's prefill charged to the batch it joins (the cpu runtimes compute a joining
  prompt within a decode step of the running rows, one prompt a step, which then lasts about a prefill longer: the
  weights read once for both save about a batch-1 step, which the model leaves out): a round of b requests is b x
  prefill + (output - 1) x step(b), TPOT = step(b) + (b - 1) x prefill / (output - 1), tokens/s = b x output / the
  round; TTFT = (b + 1) / 2 x prefill + the rounds ahead: closed-loop clients of one output length end together and
  resubmit together, and their prompts are computed one a step, each streaming its first token in the step that
  computes it (the j-th waits j prefills). The prefill charged to the running rows is the runtime's own (the timed
  phase, never the prefill correction): a request's TTFT also holds its path through the server (HTTP, the ensemble's
  tokenizer) which the rows already decoding do not wait for.

`correct` fits one correction per phase to measured levels: decode = the median of measured ITL p50 / predicted
TPOT (less the prefills it charges), then prefill = the median factor that makes the TTFT p50 of the levels whose
TTFT is mostly prefill what was measured (with the decode correction: `fit`). A corrected plan
states the factors, where they came from and the errors before and after (`Performance.correction`).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..backends import backend_for
from ..backends.names import INFLIGHT_BATCHING, STATIC_BATCHING
from ..errors import UserError
from .performance import DERIVED_SOURCE, MEASURED_SOURCE, SOL_SOURCE, TIMED_SOURCE, Workpoint, energy_of
from .schema import Plan

#: the smallest factor a fit gives (a TTFT below the waits the model predicts is not a negative prefill)
MIN_FACTOR = 1e-3


@dataclass(frozen=True)
class LevelLoad:
    """One load level as the server saw it."""

    concurrency: int
    input_tokens: float
    output_tokens: float
    max_batch: int
    max_num_tokens: int | None = None


@dataclass(frozen=True)
class Correction:
    """Measured / predicted, per phase (1.0: the model was right)."""

    prefill: float = 1.0
    decode: float = 1.0


@dataclass(frozen=True)
class Predicted:
    ttft_s: float
    tpot_s: float
    output_tokens_per_s: float
    source: str

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3,
                "output_tokens_per_s": self.output_tokens_per_s, "source": self.source}


def plan_load(plan: Plan) -> LevelLoad:
    """The load the plan's own figures are for: its batch of clients at its workload's lengths."""
    w = plan.workload
    batch = plan.triton.triton_max_batch_size
    tokens = plan.build_config.max_num_tokens if plan.build_config else None
    return LevelLoad(batch, w.input_len, w.output_len, batch, tokens)


def batching_of(plan: Plan) -> str:
    return backend_for(plan.backend).batching


def phase_tables(plan: Plan) -> dict:
    """The plan's phase model: the timed one (host_timing), else the roofline's (the prefill proportional to the
    prompt; the step the weights read once plus each sequence's KV cache, per token of its context)."""
    p, roof, w = plan.performance, plan.roofline, plan.workload
    if p is not None and p.phases:
        return p.phases
    context = w.input_len + w.output_len / 2
    per_token = (roof.decode_step_s - roof.decode_step_s_batch1) / ((roof.batch - 1) * context) if roof.batch > 1 \
        else 0.0
    return {"prefill_tokens": [w.input_len], "prefill_s": [roof.prefill_s_per_request],
            "decode_fixed_s": roof.decode_step_s_batch1 - per_token * context, "decode_per_sequence_s": 0.0,
            "decode_per_context_token_s": per_token}


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, linear through the table's two points (extrapolated beyond them); one point: proportional to x."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    if xs[0] == xs[-1]:
        return ys[0]
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    return max(ys[0] + (x - xs[0]) * slope, 0.0)


def decode_step(phases: dict, batch: float, context: float) -> float:
    """One decode step of `batch` sequences at a mean `context`: fixed + per sequence + per sequence-token."""
    return max(phases["decode_fixed_s"] + batch * (phases["decode_per_sequence_s"]
                                                   + context * phases["decode_per_context_token_s"]), 0.0)


def stored_correction(plan: Plan) -> Correction:
    """The correction `plan --measured` put in the plan (none: 1.0 for both phases)."""
    c = plan.performance.correction if plan.performance else None
    return Correction(c["prefill"], c["decode"]) if c else Correction()


def predict_level(plan: Plan, load: LevelLoad, correction: Correction | None = None) -> Predicted:
    """What `plan` predicts for `load` (module docstring), with `correction` applied to its phases (default: the
    plan's own, `stored_correction`)."""
    p, batching = plan.performance, batching_of(plan)
    correction = stored_correction(plan) if correction is None else correction
    if batching == INFLIGHT_BATCHING and p is not None and p.source in (MEASURED_SOURCE, DERIVED_SOURCE):
        return served_estimate(plan, load, correction)
    tables = phase_tables(plan)
    runtime_prefill = interpolate(tables["prefill_tokens"], tables["prefill_s"], load.input_tokens)

    def step(batch: float) -> float:
        return correction.decode * decode_step(tables, batch, load.input_tokens + load.output_tokens / 2)

    source = p.source if p is not None else SOL_SOURCE
    return Predicted(*serving_figures(batching, correction.prefill * runtime_prefill, step, load.concurrency,
                                      load.max_batch, load.output_tokens,
                                      stall_s=runtime_prefill if source == TIMED_SOURCE else None), source)


def serving_figures(batching: str, prefill_s: float, step, concurrency: float, max_batch: int,
                    output_tokens: float, stall_s: float | None = None) -> tuple[float, float, float]:
    """(TTFT, TPOT, output tokens/s) of `concurrency` closed-loop clients from one prompt's prefill as its client
    sees it and the decode step `step(batch)` (the module docstring's batching models; `stall_s`: in flight, the
    runtime's prefill of each admitted prompt, by which it stalls the running batch)."""
    out = max(output_tokens, 1.0)
    if batching == STATIC_BATCHING:
        if concurrency <= 1:
            return prefill_s, step(1.0), out / (prefill_s + (out - 1) * step(1.0))
        rest = concurrency - 1
        alone = prefill_s + (out - 1) * step(1.0)
        together = rest * prefill_s + (out - 1) * step(rest)
        return rest * prefill_s + alone, step(rest), concurrency * out / (alone + together)
    batch = max(1.0, min(concurrency, max_batch))
    ahead = max(concurrency / batch - 1, 0.0)
    if stall_s is not None:
        round_s = batch * prefill_s + (out - 1) * step(batch)
        tpot = step(batch) + ((batch - 1) * stall_s / (out - 1) if out > 1 else 0.0)
        return (batch + 1) / 2 * prefill_s + ahead * round_s, tpot, batch * out / round_s
    round_s = prefill_s + (out - 1) * step(batch)
    return prefill_s + ahead * round_s, step(batch), batch / step(batch)


def served_estimate(plan: Plan, load: LevelLoad, correction: Correction) -> Predicted:
    """aiconfigurator-core's in-flight serving figures for the level (the plan's own when it is the plan's load)."""
    p = plan.performance
    batch = max(1, min(load.concurrency, load.max_batch))
    tokens = load.max_num_tokens or p.max_num_tokens
    point = (batch, round(load.input_tokens), round(load.output_tokens), tokens)
    if point == (p.batch, plan.workload.input_len, plan.workload.output_len, p.max_num_tokens):
        stored = stored_correction(plan)     # the plan's figures carry it: AIC's own are without
        ttft, tpot, rate = p.ttft_s / stored.prefill, p.tpot_s / stored.decode, p.output_tokens_per_s * stored.decode
    else:
        from .performance import estimate

        found = estimate(plan.target, Workpoint(
            plan.model.arch, plan.precision, plan.kv_cache_dtype, bool(plan.plugin_config.use_fp8_context_fmha),
            plan.tp_size, plan.pp_size, batch, max(point[1], 1), max(point[2], 1), tokens))
        ttft, tpot, rate = found.ttft_s, found.tpot_s, found.output_tokens_per_s
    rounds_ahead = max(load.concurrency / batch - 1, 0.0)
    ttft = correction.prefill * ttft + rounds_ahead * (ttft + (load.output_tokens - 1) * tpot) * correction.decode
    return Predicted(ttft, correction.decode * tpot, rate / correction.decode, p.source)


# ---------------------------------------------------------------------------------------------- the measured side

@dataclass(frozen=True)
class Observed:
    """One measured level: its load and its median TTFT and inter-token latency, output tokens/s."""

    load: LevelLoad
    ttft_s: float
    itl_s: float | None
    output_tokens_per_s: float


def observed(level: dict, fallback_input_tokens: int) -> Observed | None:
    """A load-level record (pipeline.validate.load_test.run_level, with the served batch and the prompt tokens
    recorded beside it); None when nothing completed."""
    if not level.get("completed") or (level.get("ttft_ms") or {}).get("p50") is None:
        return None
    out = level["output_tokens"] / level["completed"]
    load = LevelLoad(int(level["concurrency"]), float(level.get("input_tokens") or fallback_input_tokens), out,
                     int(level.get("max_batch") or level["concurrency"]), level.get("max_num_tokens"))
    itl = (level.get("itl_ms") or {}).get("p50")
    return Observed(load, level["ttft_ms"]["p50"] / 1e3, itl / 1e3 if itl is not None else None,
                    float(level["output_tokens_per_s"]))


def annotate(level: dict, plan: Plan | None, input_tokens: float | None, max_batch: int | None,
             max_num_tokens: int | None = None) -> dict:
    """The level record with what the server was (batch, prompt tokens) and what `plan` predicted for it."""
    level = {**level, "input_tokens": input_tokens, "max_batch": max_batch, "max_num_tokens": max_num_tokens}
    if plan is None:
        return level
    seen = observed(level, plan.workload.input_len)
    if seen is not None:
        try:
            level["predicted"] = predict_level(plan, seen.load).to_dict()
        except Exception as exc:  # noqa: BLE001 - a prediction that cannot be made never fails a measurement
            level["predicted"] = {"error": f"{type(exc).__name__}: {exc}"}
    return level


def errors(plan: Plan, seen: list[Observed], correction: Correction) -> dict:
    """Median |predicted / measured - 1| of TTFT, TPOT and output tokens/s over the levels."""
    rows = [(predict_level(plan, s.load, correction), s) for s in seen]

    def median_error(pairs) -> float | None:
        values = [abs(p / m - 1) for p, m in pairs if m]
        return statistics.median(values) if values else None

    return {"ttft": median_error((p.ttft_s, s.ttft_s) for p, s in rows),
            "tpot": median_error((p.tpot_s, s.itl_s) for p, s in rows if s.itl_s is not None),
            "output_tokens_per_s": median_error((p.output_tokens_per_s, s.output_tokens_per_s) for p, s in rows)}


def fit(plan: Plan, seen: list[Observed]) -> Correction:
    """The decode factor: the median of measured ITL / predicted TPOT, less the prefills the predicted TPOT charges
    (in flight with timed phases: `serving_figures`). The prefill factor: the median of measured / predicted TTFT
    over the levels whose predicted TTFT is mostly their own prefills (one client on a static server; up to its
    batch in flight), with the decode factor applied to what else it holds; without such a level, over all. A level
    whose TTFT is mostly a wait for other requests' decode says little about the prefill (and on the static server
    the wait depends on how the clients happen to group)."""
    decode = decode_factor(plan, seen)
    return Correction(prefill=prefill_factor(plan, seen, decode), decode=decode)


def decode_factor(plan: Plan, seen: list[Observed]) -> float:
    factors = []
    for s in (s for s in seen if s.itl_s):
        tpot = predict_level(plan, s.load, Correction(decode=1.0)).tpot_s
        steps = predict_level(plan, s.load, Correction(decode=2.0)).tpot_s - tpot    # what the factor scales
        charged = tpot - steps                                                      # the prefills, unscaled
        factors.append(max((s.itl_s - charged) / steps, MIN_FACTOR))
    return statistics.median(factors) if factors else 1.0


def prefill_factor(plan: Plan, seen: list[Observed], decode: float) -> float:
    factors, mostly_prefill = [], []
    for s in seen:
        wait = predict_level(plan, s.load, Correction(prefill=0.0, decode=decode)).ttft_s
        prefills = predict_level(plan, s.load, Correction(prefill=1.0, decode=decode)).ttft_s - wait
        if prefills <= 0:
            continue
        factor = max((s.ttft_s - wait) / prefills, MIN_FACTOR)
        factors.append(factor)
        if prefills >= wait:
            mostly_prefill.append(factor)
    chosen = mostly_prefill or factors
    return statistics.median(chosen) if chosen else 1.0


# ----------------------------------------------------------------------------------------- plan --measured

@dataclass(frozen=True)
class Measurements:
    """The levels of one results file and the deployment they were measured on."""

    levels: list[dict]
    measured_on: dict
    origin: str


def measured_on(plan: Plan) -> dict:
    """What a results file records of the deployment it measured (`check_same_deployment` compares all but the
    model's name, which deploy records without the directory it was in)."""
    return {"model": plan.model.name, "architecture": architecture_digest(plan), "target": plan.target.name,
            "backend": plan.backend, "precision": plan.precision}


def architecture_digest(plan: Plan) -> str:
    """The model's shapes and constants, without the checkpoint's storage dtype (the precision is compared on its
    own) and with its floats as float32: the README's cpu build (SmolLM2 from its GGUF, stored float32, epsilon
    9.999999747e-06) is the architecture of `smollm2-135m` (bfloat16 on the Hub, epsilon 1e-05)."""
    arch = {key: float(np.float32(value)) if isinstance(value, float) else value
            for key, value in plan.model.arch.to_dict().items() if key != "dtype"}
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_measured(path: Path) -> Measurements:
    """The levels of validate's load_test.json or report.json, or of tune's trials.json (every trial's)."""
    origin = Path(path).name
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"--measured {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UserError(f"--measured {path} is not JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("checks"), list):   # report.json
        data = next((c.get("data") for c in data["checks"] if c.get("name") == "load_test"), None) or {}
    if isinstance(data, dict) and isinstance(data.get("trials"), list):   # tune's trials.json
        levels = [lv for trial in data["trials"] for lv in trial.get("levels") or []]
    else:
        levels = data.get("levels") if isinstance(data, dict) else None
    if not isinstance(levels, list) or not isinstance(data.get("measured_on"), dict):
        raise UserError(f"--measured {path} is not a load test trtpipe recorded against a plan: give validate "
                        "--load-test's load_test.json (or report.json) of a repository trtpipe deployed, or tune's "
                        "result/trials.json")
    return Measurements([lv for lv in levels if isinstance(lv, dict)], data["measured_on"], origin)


def check_same_deployment(plan: Plan, measured: Measurements) -> None:
    on, wanted = measured.measured_on, measured_on(plan)
    differs = [f"{key} {on.get(key)!r} (the plan's: {value!r})" for key, value in wanted.items()
               if key != "model" and on.get(key) != value]
    if differs:
        raise UserError(f"{measured.origin} was measured on another deployment ({on.get('model')}): "
                        f"{'; '.join(differs)}. A correction holds for the model architecture, precision, backend and "
                        "target it was measured with")


def correct(plan: Plan, measured: Measurements) -> Plan:
    """`plan` with its phases corrected by the measured levels (one factor per phase, stated in the plan)."""
    check_same_deployment(plan, measured)
    if plan.performance is None:
        raise UserError(f"the {plan.backend} plan has no performance model to correct")
    if plan.performance.correction:
        raise UserError("the plan is corrected already: plan again with --measured to correct it anew")
    seen = [s for s in (observed(level, plan.workload.input_len) for level in measured.levels) if s is not None]
    if not seen:
        raise UserError(f"{measured.origin} holds no load level where a request completed: nothing to correct with")
    correction = fit(plan, seen)
    before, after = errors(plan, seen, Correction()), errors(plan, seen, correction)
    own = predict_level(plan, plan_load(plan), correction)
    p = plan.performance
    corrected = replace(
        p, prefill_s=p.prefill_s * correction.prefill, decode_step_s=p.decode_step_s * correction.decode,
        ttft_s=own.ttft_s, tpot_s=own.tpot_s, output_tokens_per_s=own.output_tokens_per_s,
        request_latency_s=own.ttft_s + (plan.workload.output_len - 1) * own.tpot_s,
        energy=energy_of(plan.target, own.output_tokens_per_s, plan.tp_size * plan.pp_size),
        percent_of_speed_of_light=(p.percent_of_speed_of_light / correction.decode
                                   if p.percent_of_speed_of_light else None),
        correction={"prefill": correction.prefill, "decode": correction.decode, "levels": len(seen),
                    "measured": measured.origin, "median_error_before": before, "median_error_after": after},
        notes=[*p.notes, (f"corrected by {len(seen)} measured load levels of {measured.origin}: prefill x"
                          f"{correction.prefill:.3f}, decode x{correction.decode:.3f}")])
    return replace(plan, performance=corrected)
