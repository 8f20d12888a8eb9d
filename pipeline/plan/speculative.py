"""`plan --speculative`: what drafting K tokens a step and verifying them in one forward pass is predicted to give.

A speculative step feeds each running row its last token and K drafts and outputs the accepted drafts and one token
of its own. With TensorRT-LLM's acceptance rate a = accepted / drafted tokens (llmRequest.cpp createResult), a step
that drafts K tokens outputs 1 + a K tokens on average, so against plain decoding at the same number of rows

    speedup(rows) = (1 + a K) x step(rows, 1 token a row) / step(rows, K + 1 tokens a row).

A step reading the weights once for a few tokens costs little more than for one (small steps are bound by reading
the weights), so at one row the speedup is about 1 + a K; as rows grow, the step becomes bound by compute and the
K extra tokens a row cost their share: above some number of rows speculation loses. The plan times both steps on
this host with the reference runtime (pipeline/plan/host_timing.py, cached like the cpu plan's other phases) at
1, 2, 4, ... rows up to the plan's batch, and records the most rows up to which every prediction gains: the server
drafts only while its batch has at most that many rows (and, within them, only while the steps it observes say that
drafting pays: pipeline/runtime/speculative.py `Speculation`). Steps where prompt lookup finds nothing to draft decode
plainly, so the prediction is for the steps that draft; `trtpipe validate` measures the acceptance rate of a
deployment, which `--acceptance` feeds back.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace

from ..errors import UserError
from ..backends.names import REFERENCE, REFERENCE_ONNX
from ..host import serving_threads
from ..outputs import write_atomic
from ..runtime.speculative import MAX_NGRAM, NGRAM
from .host_timing import LAYERS_TIMED, timing_cache_file, timing_model
from .schema import Plan, SpeculativePlan

#: what `--speculative` names (draft:MODEL and eagle:MODEL carry a model)
METHODS = (NGRAM, "draft", "lookahead", "eagle")
#: the drafts a step verifies when --draft-len is not given: the best of 3, 5, 8 on the input-grounded workload of
#: benchmarks/bench_speculative.py (SmolLM2-135M, ONNX Runtime, this repository's 2-core machine)
DEFAULT_DRAFT_LEN = 3
#: the most drafts a step of the cpu runtimes verifies: past it a step costs more than any acceptance returns
MAX_DRAFT_LEN = 16
#: the acceptance rate assumed without --acceptance: prompt lookup on benchmarks/bench_speculative.py's
#: input-grounded workload (SmolLM2-135M, K = 3) accepted 0.38 of its drafts
DEFAULT_ACCEPTANCE = 0.35
TIMING_VERSION = 1
#: runs of each step timed (the median): a ratio of two steps needs steadier figures than the plan's other phases
REPEATS = 9


@dataclass(frozen=True)
class SpeculativeRequest:
    """`--speculative METHOD[:MODEL] [--draft-len K] [--acceptance A]` as given."""

    method: str
    draft_model: str | None = None
    draft_len: int | None = None
    acceptance: float | None = None

    @classmethod
    def parse(cls, text: str, draft_len: int | None = None, acceptance: float | None = None) -> "SpeculativeRequest":
        method, _, model = text.partition(":")
        if method not in METHODS:
            raise UserError(f"--speculative must be one of ngram, draft:MODEL, lookahead, eagle:MODEL (got {text!r})")
        if method in ("draft", "eagle") and not model:
            raise UserError(f"--speculative {method} needs the model that drafts: {method}:MODEL")
        if method in (NGRAM, "lookahead") and model:
            raise UserError(f"--speculative {method} drafts without a model (got {text!r})")
        return cls(method, model or None, draft_len, acceptance)

    def to_flags(self) -> str:
        return self.method + (f":{self.draft_model}" if self.draft_model else "")


def request_of(spec: SpeculativePlan | None) -> SpeculativeRequest | None:
    """The request that planned `spec` (what `replan` plans again)."""
    if spec is None:
        return None
    explicit = spec.acceptance_basis.startswith("--acceptance")
    return SpeculativeRequest(spec.method, None, spec.draft_len, spec.acceptance if explicit else None)


def plan_speculation(plan: Plan, request: SpeculativeRequest) -> Plan:
    """`plan` with its speculative decoding planned; UserError for what cannot run."""
    if plan.target.is_gpu:
        raise UserError(f"--speculative is planned for the cpu target only in this version; the {plan.target.name} "
                        "engine and PyTorch configurations (draft-target through BLS, lookahead, speculative_config) "
                        "are not written yet")
    if request.method != NGRAM:
        raise UserError(f"--speculative {request.to_flags()}: the cpu runtimes draft with prompt lookup (ngram) "
                        "only in this version; draft models, lookahead and EAGLE are not implemented")
    if plan.backend not in (REFERENCE, REFERENCE_ONNX):
        raise UserError(f"--speculative: the {plan.backend} backend does not speculate (the reference and "
                        "reference-onnx backends do)")
    if plan.triton.max_beam_width > 1:
        raise UserError("--speculative with beam search: TensorRT-LLM speculates with one beam; drop one of them")
    k = DEFAULT_DRAFT_LEN if request.draft_len is None else request.draft_len
    if not 1 <= k <= MAX_DRAFT_LEN:
        raise UserError(f"--draft-len must be between 1 and {MAX_DRAFT_LEN} on the cpu target (got {k})")
    acceptance = DEFAULT_ACCEPTANCE if request.acceptance is None else request.acceptance
    if not 0.0 <= acceptance <= 1.0:
        raise UserError(f"--acceptance is accepted / drafted tokens, between 0 and 1 (got {acceptance})")
    basis = (f"--acceptance {acceptance}" if request.acceptance is not None else
             f"the default {DEFAULT_ACCEPTANCE} (prompt lookup on an input-grounded workload); measure yours with "
             "`trtpipe validate` and plan again with --acceptance")
    rows = concurrencies(plan.triton.triton_max_batch_size)
    context = plan.workload.input_len + plan.workload.output_len // 2
    steps = step_timings(plan, rows, k, context)
    speedup = [round((1 + acceptance * k) * plain / verify, 3) for plain, verify in steps]
    losing = next((i for i, s in enumerate(speedup) if s < 1.0), len(rows))
    spec = SpeculativePlan(
        method=NGRAM, draft_len=k, max_ngram=MAX_NGRAM, acceptance=acceptance, acceptance_basis=basis, rows=rows,
        step_s=[round(p, 6) for p, _ in steps], verify_step_s=[round(v, 6) for _, v in steps], speedup=speedup,
        max_rows=rows[losing - 1] if losing else 0,
        basis=(f"(1 + a K) x step(1 token a row) / step({k + 1} tokens a row), the steps of the reference runtime "
               f"timed on this host at {context} tokens of context ({LAYERS_TIMED} layers timed and scaled)"))
    warnings = list(plan.warnings)
    if not spec.max_rows:
        warnings.append(f"--speculative {NGRAM}: at acceptance {acceptance} and K = {k} no batch gains on this host; "
                        "the server will not draft")
    return replace(plan, speculative=spec, warnings=warnings)


def concurrencies(batch: int) -> list[int]:
    """1, 2, 4, ... up to the batch, and the batch."""
    rows, r = [], 1
    while r < batch:
        rows.append(r)
        r *= 2
    return rows + [batch]


def step_timings(plan: Plan, rows: list[int], k: int, context: int) -> list[tuple[float, float]]:
    """(plain step, K + 1 token step) seconds per entry of `rows`: from the host's timing cache, else timed now."""
    threads = serving_threads()
    path = timing_cache_file({"arch": plan.model.arch.to_dict(), "rows": rows, "k": k, "context": context,
                              "threads": threads, "version": TIMING_VERSION}, prefix="speculative-")
    if path.is_file():
        try:
            return [tuple(pair) for pair in json.loads(path.read_text())]
        except ValueError:
            pass
    timings = time_steps(plan, rows, k, context, threads)
    write_atomic(path, json.dumps(timings) + "\n")
    return timings


def time_steps(plan: Plan, rows: list[int], k: int, context: int, threads: int) -> list[tuple[float, float]]:
    import torch

    arch = plan.model.arch
    layers = min(LAYERS_TIMED, arch.num_hidden_layers)
    model, scale = timing_model(arch, layers), arch.num_hidden_layers / layers
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            return [time_pair(model, r, k, context, scale) for r in rows]
    finally:
        torch.set_num_threads(before)


def time_pair(model, rows: int, k: int, context: int, scale: float) -> tuple[float, float]:
    """(plain step, K + 1 token step) seconds of `rows` rows after `context` tokens: REPEATS runs of each, one after
    the other so that both see the host alike, the median of each (after a warm-up); the final norm and lm_head of
    every verified token are timed with the step."""
    import torch

    cache = model._cache(rows, context + k + 1)

    def run(tokens: int) -> float:
        ids = torch.zeros(rows, tokens, dtype=torch.long)
        positions = torch.arange(context, context + tokens).expand(rows, tokens)
        start = time.perf_counter()
        hidden = model._hidden(ids, positions, cache, None, None)
        middle = time.perf_counter()
        model._logits(hidden)
        return (middle - start) * scale + time.perf_counter() - middle

    run(1), run(k + 1)
    pairs = [(run(1), run(k + 1)) for _ in range(REPEATS)]
    return statistics.median(p for p, _ in pairs), statistics.median(v for _, v in pairs)
