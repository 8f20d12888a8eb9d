"""`plan --speculative`: what drafting K tokens a step and verifying them in one forward pass is predicted to give.

A speculative step feeds each running row its last token and up to K drafts and outputs the accepted drafts and one
token of its own. With TensorRT-LLM's acceptance rate a = accepted / drafted tokens (llmRequest.cpp createResult)
and D drafts a step on average (a draft model drafts K every step; prompt lookup fewer: many steps find no match), a
step outputs 1 + a D tokens a row. Its cost grows with the tokens it feeds, from a plain step's p (no drafts) to a
K + 1 token step's v (K drafts): p + (v - p) D / K. So against plain decoding at the same number of rows

    speedup(rows) = (1 + a D) x p(rows) / (p(rows) + (v(rows) - p(rows)) x D / K).

A step reading the weights once for a few tokens costs little more than for one (small steps are bound by reading
the weights), so at one row the speedup is about 1 + a K; as rows grow, the step becomes bound by compute and the
K extra tokens a row cost their share: above some number of rows speculation loses. The plan times both steps on
this host with the reference runtime (pipeline/plan/host_timing.py, cached like the cpu plan's other phases) at
1, 2, 4, ... rows up to the plan's batch, and records the most rows up to which every prediction gains: the server
drafts only while its batch has at most that many rows (and, within them, only while the steps it observes say that
drafting pays: pipeline/runtime/speculative.py `Speculation`). Steps where prompt lookup finds nothing to draft decode
plainly; `trtpipe validate` measures a deployment's acceptance rate and drafts per step, which `--acceptance` and
`--drafts-per-step` feed back.

Draft-target (`draft:CHECKPOINT`, a second checkpoint with the target's tokenizer) also runs the draft model K times
a drafting step (pipeline/runtime/draft_model.py: one pass catching up with the target's tokens, then one a draft
but the last), so with its step d and D = K

    speedup(rows) = (1 + a K) x p(rows) / (v(rows) + K x d(rows)).

The draft's step is timed like the target's, from its architecture in float32: a 4-bit draft served by ONNX
Runtime's MatMulNBits costs less than that (docs/speculative.md has the measured figures). Its memory comes off the
host's before the KV cache is sized, as a GPU plan's draft does (`host_companion`): its weights counted as the
target's are, in float32 (the torch runtime dequantizes a quantized checkpoint on load), and its float32 KV cache
for as many tokens as the target's.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UserError
from ..backends import backend_for
from ..backends.names import REFERENCE, REFERENCE_ONNX
from ..host import serving_threads
from ..outputs import write_atomic
from ..runtime.speculative import DRAFT, MAX_NGRAM, NGRAM
from .host_timing import LAYERS_TIMED, timing_cache_file, timing_model
from .memory import kv_bytes_per_token, weights_per_rank_by_stage
from .policy import Companion
from .schema import ModelArch, ModelInfo, Plan, SpeculativePlan, resolve_model_info

#: what `--speculative` names (draft:MODEL and eagle:MODEL carry a model)
LOOKAHEAD = "lookahead"
EAGLE = "eagle"
METHODS = (NGRAM, DRAFT, LOOKAHEAD, EAGLE)
#: the drafts a step verifies when --draft-len is not given: a draft model's (and any method's on a GPU), the best
#: of 3, 5, 8 on the input-grounded workload of benchmarks/bench_speculative.py (SmolLM2-135M, ONNX Runtime, this
#: repository's 2-core machine) when prompt lookup drafted that many after every match
DEFAULT_DRAFT_LEN = 3
#: the cpu target's prompt lookup drafts K after a match of its longest n-gram and fewer after shorter ones
#: (pipeline/runtime/speculative.py NgramDrafter): 8 / 4 / 2 measured best there (docs/speculative.md)
NGRAM_DRAFT_LEN = 8
#: the most drafts a step of the cpu runtimes verifies: past it a step costs more than any acceptance returns
MAX_DRAFT_LEN = 16
#: the acceptance rate assumed without --acceptance, per method: prompt lookup on benchmarks/bench_speculative.py's
#: input-grounded workload (SmolLM2-135M) accepted 0.38-0.46 of its drafts at K = 3, 0.35 drafting 8 / 4 / 2 by the
#: match; SmolLM2-135M at int4-awq drafting for itself at float32 0.69-0.84 (both workloads, K = 3;
#: docs/speculative.md)
DEFAULT_ACCEPTANCE = {NGRAM: 0.35, DRAFT: 0.7}
ACCEPTANCE_BASIS = {NGRAM: "prompt lookup on an input-grounded workload",
                    DRAFT: "a 4-bit draft of the target's own model"}
#: prompt lookup's drafts a step assumed without --drafts-per-step (at most K): benchmarks/bench_speculative.py measured
#: 2.2 and 2.3 at concurrency 1 drafting 8 / 4 / 2 by the match (1.0-1.4 at K = 3 after every match); a draft model
#: drafts K
NGRAM_DRAFTS_PER_STEP = 2.2
TIMING_VERSION = 1
#: runs of each step timed (the median): a ratio of two steps needs steadier figures than the plan's other phases
REPEATS = 9


@dataclass(frozen=True)
class SpeculativeRequest:
    """`--speculative METHOD[:MODEL] [--draft-len K] [--acceptance A] [--drafts-per-step D]` as given."""

    method: str
    draft_model: str | None = None
    draft_len: int | None = None
    acceptance: float | None = None
    drafts_per_step: float | None = None
    lookahead: tuple[int, int, int] | None = None   # lookahead:W,N,G (window, n-gram, verification set sizes)

    @classmethod
    def parse(cls, text: str, draft_len: int | None = None, acceptance: float | None = None,
              drafts_per_step: float | None = None) -> "SpeculativeRequest":
        method, _, model = text.partition(":")
        if method not in METHODS:
            raise UserError(f"--speculative must be one of ngram, draft:MODEL, lookahead[:W,N,G], eagle:MODEL (got "
                            f"{text!r})")
        if method in (DRAFT, EAGLE) and not model:
            raise UserError(f"--speculative {method} needs the model that drafts: {method}:MODEL")
        if method == NGRAM and model:
            raise UserError(f"--speculative {method} drafts without a model (got {text!r})")
        if method == LOOKAHEAD:
            return cls(method, None, draft_len, acceptance, drafts_per_step, lookahead_sizes(model) if model else None)
        return cls(method, model or None, draft_len, acceptance, drafts_per_step)

    def to_flags(self) -> str:
        if self.lookahead:
            return f"{self.method}:{','.join(map(str, self.lookahead))}"
        return self.method + (f":{self.draft_model}" if self.draft_model else "")


def lookahead_sizes(text: str) -> tuple[int, int, int]:
    """`W,N,G` of --speculative lookahead:W,N,G as three integers; UserError otherwise."""
    try:
        w, n, g = (int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--speculative lookahead:W,N,G takes three integers, the window, n-gram and verification "
                        f"set sizes (got {text!r})") from None
    return w, n, g


def request_of(spec: SpeculativePlan | None) -> SpeculativeRequest | None:
    """The request that planned `spec` (what `replan` plans again)."""
    if spec is None:
        return None
    explicit = spec.acceptance_basis.startswith("--acceptance")
    drafts = spec.drafts_per_step if spec.drafts_per_step != default_drafts(spec.method, spec.draft_len) else None
    if spec.lookahead:
        return SpeculativeRequest(spec.method, acceptance=spec.acceptance, lookahead=tuple(spec.lookahead))
    return SpeculativeRequest(spec.method, spec.draft_checkpoint or spec.draft_model, spec.draft_len,
                              spec.acceptance if explicit else None, drafts)


def default_drafts(method: str, k: int) -> float:
    """The drafts a step the plan assumes without --drafts-per-step."""
    return min(float(k), NGRAM_DRAFTS_PER_STEP) if method == NGRAM else float(k)


def host_companion(request: SpeculativeRequest, model: ModelInfo) -> tuple[ModelInfo | None, Companion | None]:
    """The draft checkpoint `draft:NAME` names and what it takes of the host's memory (None for prompt lookup and
    for methods the cpu runtimes do not run, which `plan_speculation` refuses)."""
    if request.method != DRAFT:
        return None, None
    draft = draft_model(model, request.draft_model)
    weights = weights_per_rank_by_stage(draft.arch, "fp32", "float32", 1, 1)[0]
    return draft, Companion(draft.arch, "fp32", "float32", weights, kv_bytes_per_token(draft.arch, "float32", 1))


def plan_speculation(plan: Plan, request: SpeculativeRequest,
                     companion_of: tuple[ModelInfo | None, Companion | None] | None = None) -> Plan:
    """`plan` (planned with its draft's memory, `host_companion`, which `companion_of` is when the caller has it)
    with its speculative decoding planned; UserError for what cannot run."""
    if plan.target.is_gpu:
        raise ValueError("a GPU plan's speculation is planned by plan/speculative_gpu.py")
    if request.method not in (NGRAM, DRAFT):
        raise UserError(f"--speculative {request.to_flags()}: the cpu runtimes draft with prompt lookup (ngram) or a "
                        "draft model (draft:CHECKPOINT) in this version; lookahead and EAGLE are not implemented")
    if plan.backend not in (REFERENCE, REFERENCE_ONNX):
        raise UserError(f"--speculative: the {plan.backend} backend does not speculate (the reference and "
                        "reference-onnx backends do)")
    if plan.triton.max_beam_width > 1:
        raise UserError("--speculative with beam search: TensorRT-LLM speculates with one beam; drop one of them")
    k = (NGRAM_DRAFT_LEN if request.method == NGRAM else DEFAULT_DRAFT_LEN) if request.draft_len is None else \
        request.draft_len
    if not 1 <= k <= MAX_DRAFT_LEN:
        raise UserError(f"--draft-len must be between 1 and {MAX_DRAFT_LEN} on the cpu target (got {k})")
    default = DEFAULT_ACCEPTANCE[request.method]
    acceptance = default if request.acceptance is None else request.acceptance
    if not 0.0 <= acceptance <= 1.0:
        raise UserError(f"--acceptance is accepted / drafted tokens, between 0 and 1 (got {acceptance})")
    drafts = default_drafts(request.method, k) if request.drafts_per_step is None else request.drafts_per_step
    if not 0.0 < drafts <= k:
        raise UserError(f"--drafts-per-step is the drafts a step verifies on average, above 0 and at most --draft-len "
                        f"{k} (got {drafts})")
    draft, companion = host_companion(request, plan.model) if companion_of is None else companion_of
    basis = (f"--acceptance {acceptance}" if request.acceptance is not None else
             f"the default {default} ({ACCEPTANCE_BASIS[request.method]}); measure yours with `trtpipe validate` "
             "and plan again with --acceptance")
    rows = concurrencies(plan.triton.triton_max_batch_size)
    context = plan.workload.input_len + plan.workload.output_len // 2
    steps = step_timings(plan.model.arch, rows, k, context)
    drafting = [0.0] * len(rows) if draft is None else [p for p, _ in step_timings(draft.arch, rows, k, context)]
    speedup = speedups(acceptance, drafts, k, [p for p, _ in steps], [v for _, v in steps], drafting)
    losing = next((i for i, s in enumerate(speedup) if s < 1.0), len(rows))
    formula = (f"(1 + a D) x p / (p + (v - p{' + K d' if draft else ''}) x D / K), D = {drafts:g} drafts a step, p "
               f"a plain step, v a step of {k + 1} tokens a row" + (", d the draft's step" if draft else ""))
    spec = SpeculativePlan(
        method=request.method, draft_len=k, max_ngram=MAX_NGRAM if draft is None else None, acceptance=acceptance,
        acceptance_basis=basis, rows=rows, step_s=[round(p, 6) for p, _ in steps],
        verify_step_s=[round(v, 6) for _, v in steps], speedup=speedup, max_rows=rows[losing - 1] if losing else 0,
        basis=(f"{formula}; the steps of the reference runtime timed on this host at {context} tokens of context "
               f"({LAYERS_TIMED} layers timed and scaled" + (", the draft's in float32 too)" if draft else ")")),
        drafts_per_step=drafts,
        **({} if draft is None else draft_fields(draft, companion, drafting)))
    spec = served_by(spec, plan.backend, plan.model.arch)
    warnings = list(plan.warnings)
    if not spec.max_rows:
        warnings.append(f"--speculative {request.to_flags()}: at acceptance {acceptance} and K = {k} no batch gains "
                        "on this host; the server will not draft")
    return replace(plan, speculative=spec, warnings=warnings)


def served_by(spec: SpeculativePlan, backend: str, arch: ModelArch) -> SpeculativePlan:
    """`spec` as the cpu `backend` serves it: where it drafts at fewer rows than the timings allow (its
    `drafting_rows`: reference-onnx, where the export writes its cache in place, ONNX Runtime verifies several tokens
    after a cache one row per run), at those."""
    rows = backend_for(backend).drafting_rows(arch)
    if rows is None or spec.max_rows <= rows:
        return spec
    return replace(spec, max_rows=rows, basis=spec.basis + "; ONNX Runtime's in-place cache verifies several tokens "
                   "after a cache one row per run, so the server drafts at one row only (docs/speculative.md)")


def speedups(acceptance: float, drafts: float, k: int, plain: list[float], verify: list[float],
             drafting: list[float]) -> list[float]:
    """(1 + a D) p / (p + (v - p + K d) D / K) at each number of rows (module docstring)."""
    return [round((1 + acceptance * drafts) * p / (p + (v - p + k * d) * drafts / k), 3)
            for p, v, d in zip(plain, verify, drafting)]


def describe(spec: SpeculativePlan) -> str:
    """One line of what the server will do: where it drafts and the speedup predicted at one row, or that it never
    drafts."""
    head = f"--speculative {spec.method} K {spec.draft_len}"
    if not spec.max_rows:
        return f"{head}: no batch gains on this host (x{spec.speedup[0]:.2f} at 1 row); the server will not draft"
    return f"{head}: x{spec.speedup[0]:.2f} predicted at 1 row; drafts while at most {spec.max_rows} rows run"


def draft_model(target: ModelInfo, name: str) -> ModelInfo:
    """The draft checkpoint `draft:NAME` names; UserError unless the cpu runtimes can draft with it for this target:
    a single-rank TensorRT-LLM checkpoint of the target's vocabulary and tokenizer."""
    draft = resolve_model_info(name)
    if draft.source != "checkpoint":
        raise UserError(f"--speculative draft:{name}: the cpu target drafts with a TensorRT-LLM checkpoint (make one "
                        f"with `trtpipe convert {name}`, or `trtpipe calibrate` it to int4-awq for a cheaper draft)")
    if (draft.checkpoint_tp_size or 1) * (draft.checkpoint_pp_size or 1) != 1:
        raise UserError(f"--speculative draft:{name}: the draft checkpoint has {draft.checkpoint_tp_size} x "
                        f"{draft.checkpoint_pp_size} ranks; the cpu target runs one (convert it with --tp 1 --pp 1)")
    target_vocab, draft_vocab = target.arch.vocab_size, draft.arch.vocab_size
    if draft_vocab != target_vocab:
        raise UserError(f"--speculative draft:{name}: the draft's vocabulary has {draft_vocab} tokens, the "
                        f"target's {target_vocab}: a draft must share the target's tokenizer")
    if tokenizer_mismatch(draft, target):
        raise UserError(f"--speculative draft:{name}: the draft's tokenizer gives other token ids than the target's "
                        "(vocabulary, added or special tokens): a draft must share the target's tokenizer")
    return draft


def tokenizer_mismatch(draft: ModelInfo, target: ModelInfo) -> bool:
    """Whether the draft's tokenizer gives other ids than the target's (False when either carries none: the
    vocabulary's size is then all there is to compare)."""
    from ..tokenizer import has_tokenizer_files, same_tokenizer, tokenizer_dir_of

    if not (draft.path and target.path):
        return False
    a = tokenizer_dir_of(Path(draft.path), checkpoint=True)
    b = tokenizer_dir_of(Path(target.path), checkpoint=target.source == "checkpoint")
    return has_tokenizer_files(a) and has_tokenizer_files(b) and not same_tokenizer(a, b)


def draft_fields(draft: ModelInfo, companion: Companion, steps: list[float]) -> dict:
    """The SpeculativePlan fields of a draft model: its checkpoint, step, weights and KV cache per token (the cpu
    runtimes keep K/V in float32)."""
    return {"draft_checkpoint": draft.path, "draft_step_s": [round(d, 6) for d in steps],
            "draft_weights_bytes": companion.weights_bytes_per_rank,
            "draft_kv_bytes_per_token": companion.kv_bytes_per_token}


def concurrencies(batch: int) -> list[int]:
    """1, 2, 4, ... up to the batch, and the batch."""
    rows, r = [], 1
    while r < batch:
        rows.append(r)
        r *= 2
    return rows + [batch]


def step_timings(arch: ModelArch, rows: list[int], k: int, context: int) -> list[tuple[float, float]]:
    """(plain step, K + 1 token step) seconds per entry of `rows`: from the host's timing cache, else timed now."""
    threads = serving_threads()
    path = timing_cache_file({"arch": arch.to_dict(), "rows": rows, "k": k, "context": context,
                              "threads": threads, "version": TIMING_VERSION}, prefix="speculative-")
    if path.is_file():
        try:
            return [tuple(pair) for pair in json.loads(path.read_text())]
        except ValueError:
            pass
    timings = time_steps(arch, rows, k, context, threads)
    write_atomic(path, json.dumps(timings) + "\n")
    return timings


def time_steps(arch: ModelArch, rows: list[int], k: int, context: int, threads: int) -> list[tuple[float, float]]:
    import torch

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
