"""`plan --speculative` on a GPU target: the draft beside the target in memory, the speedup predicted from NVIDIA's
measured decode operations, and the configuration each TensorRT-LLM path takes.

What each path runs (docs/speculative.md "On a GPU", docs/upstream-facts.md S7):
- the PyTorch backend (LLM API `speculative_config`): prompt lookup (`NGram`), draft-target (a second Hugging
  Face model, `speculative_model_dir`) and EAGLE-3 (a head drafting from the target's hidden states, one-model:
  pipeline/plan/eagle.py); `max_concurrency` turns speculation off above the planned break-even rows, as the cpu
  server's `speculative_max_rows` does;
- the engine path (TensorRT-LLM 1.2.1): lookahead (`--speculative_decoding_mode lookahead_decoding` and the
  tensorrt_llm model's lookahead parameters, deployed), and draft-target (the target built with
  `draft_tokens_external --max_draft_len K`, the draft engine beside it, deployed as NVIDIA's BLS draft path:
  `draft_build_plan`, deploy --draft-engine). Its prompt lookup lived in examples/run.py, not in trtllm-build or
  Triton, so `ngram` is refused there, and its EAGLE (built into the target's engine from a combined checkpoint)
  is not converted by trtpipe: `eagle` is refused there.

The memory: a draft model's weights, its activations for the same tokens a step and its decoder buffers come off
each GPU first, and its KV cache holds as many tokens as the target's (`policy.Companion`, planned by the
backend's planner); an EAGLE-3 head's likewise, its layers in the target's KV cache. The speed: the same formula
as the cpu target's (pipeline/plan/speculative.py), with the plain step p, the verify step v of K + 1 tokens a row
and the draft's step d taken from aiconfigurator-core's decode operations for the target's GPU
(`performance.decode_steps`: measured on NVIDIA's chip, or derived for the RTX 4090 from the L40S), else trtpipe's
speed-of-light bound. Nothing here ran on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

from .. import TRTLLM_VERSION
from ..backends import backend_for, bls_draft_len
from ..backends.capabilities import input_checkpoint_precision
from ..backends.names import HF_CHECKPOINT
from ..errors import UserError
from ..model.arch_config import parameter_count
from ..precisions import PRECISIONS
from ..presets import served_model_id
from ..runtime.speculative import DRAFT, MAX_NGRAM, NGRAM
from ..targets import Target
from .memory import decode_step_seconds, kv_bytes_per_token, weights_per_rank_by_stage, weights_read_per_step
from .performance import NotModelled, Workpoint, decode_steps
from .policy import Companion, engine_dtype
from .eagle import check_head_fits, read_eagle_head
from .schema import ModelInfo, Plan, SpeculativePlan, resolve_model_info
from .speculative import (ACCEPTANCE_BASIS, DEFAULT_ACCEPTANCE, DEFAULT_DRAFT_LEN, EAGLE, LOOKAHEAD,
                          SpeculativeRequest, concurrencies, default_drafts, speedups, tokenizer_mismatch)

#: the most drafts a step the plan accepts on a GPU (TensorRT-LLM's own examples use 4 to 10)
MAX_GPU_DRAFT_LEN = 16
#: why a GPU backend does not run a method its upstream has in some other form
NOT_RUN = {NGRAM: "TensorRT-LLM's engine path has prompt lookup only as a script (examples/run.py), not as a "
                  "trtllm-build mode or a Triton model: use --backend pytorch (its NGram drafter)",
           LOOKAHEAD: "TensorRT-LLM's PyTorch backend has no lookahead (LookaheadDecodingConfig.supports_backend "
                      "excludes it): use --backend engine (1.2.1)",
           EAGLE: "the engine path builds EAGLE 1 and 2 into the target's engine from a checkpoint combining both "
                  "(TensorRT-LLM examples/eagle), which trtpipe does not convert: use --backend pytorch (EAGLE-3)"}
#: TensorRT-LLM's default lookahead (window, n-gram, verification set): executor.h kDefaultLookaheadDecoding*
DEFAULT_LOOKAHEAD = (4, 3, 4)


def check_gpu_request(request: SpeculativeRequest, backend: str, beam_width: int) -> None:
    """UserError for what the backend does not run."""
    runs = backend_for(backend).speculative_methods
    if request.method not in runs:
        why = NOT_RUN.get(request.method, f"it runs {', '.join(runs) or 'none'}")
        raise UserError(f"--speculative {request.method} on the {backend} backend: {why}")
    if beam_width > 1:
        raise UserError("--speculative with beam search: TensorRT-LLM speculates with one beam; drop one of them")


def drafting(request: SpeculativeRequest) -> tuple[int, float, float, str, list[int] | None]:
    """(K, D, a, the acceptance's basis, lookahead's [W, N, G]) of the request; UserError for values out of range.
    Lookahead verifies K = max_draft_len(W, N, G) tokens a step and accepts at most N - 1 of them, so its D is
    N - 1 and its acceptance (accepted / (N - 1) a step) has no measured default here: --acceptance is required."""
    if request.method == LOOKAHEAD:
        if request.draft_len is not None or request.drafts_per_step is not None:
            raise UserError("--speculative lookahead: its drafts a step follow from lookahead:W,N,G (TensorRT-LLM's "
                            "max_draft_len(W, N, G)); drop --draft-len and --drafts-per-step")
        w, n, g = request.lookahead or DEFAULT_LOOKAHEAD
        if not (n >= 1 and w >= 1 and g >= 0 and (n > 1 or (w, g) == (1, 0))):
            raise UserError(f"--speculative lookahead:{w},{n},{g}: TensorRT-LLM takes N >= 1, W >= 1, G >= 0, and "
                            "W 1 and G 0 when N is 1")
        if request.acceptance is None:
            raise UserError("--speculative lookahead needs --acceptance (the accepted tokens a step / (N - 1)): "
                            "trtpipe has measured no lookahead acceptance to default to")
        check_acceptance(request.acceptance)
        return (lookahead_draft_len(w, n, g), float(n - 1), request.acceptance,
                f"--acceptance {request.acceptance} (accepted tokens a step / (N - 1))", [w, n, g])
    k = DEFAULT_DRAFT_LEN if request.draft_len is None else request.draft_len
    if not 1 <= k <= MAX_GPU_DRAFT_LEN:
        raise UserError(f"--draft-len must be between 1 and {MAX_GPU_DRAFT_LEN} (got {k})")
    if request.method == EAGLE and request.acceptance is None:
        raise UserError("--speculative eagle needs --acceptance (accepted / drafted tokens): no EAGLE-3 head runs "
                        "on the cpu target, so trtpipe has measured none to default to; take the head's published "
                        "acceptance, or measure it on the deployment")
    default = DEFAULT_ACCEPTANCE.get(request.method)
    acceptance = default if request.acceptance is None else request.acceptance
    check_acceptance(acceptance)
    drafts = default_drafts(request.method, k) if request.drafts_per_step is None else request.drafts_per_step
    if not 0.0 < drafts <= k:
        raise UserError(f"--drafts-per-step is the drafts a step verifies on average, above 0 and at most --draft-len "
                        f"{k} (got {drafts})")
    basis = (f"--acceptance {acceptance}" if request.acceptance is not None else
             f"the default {default} ({ACCEPTANCE_BASIS[request.method]}, measured on the cpu target); measure "
             "yours on the deployment and plan again with --acceptance")
    return k, drafts, acceptance, basis, None


def check_acceptance(acceptance: float) -> None:
    if not 0.0 <= acceptance <= 1.0:
        raise UserError(f"--acceptance is accepted / drafted tokens, between 0 and 1 (got {acceptance})")


def lookahead_draft_len(w: int, n: int, g: int) -> int:
    """TensorRT-LLM's maxDraftTokens of lookahead (W, N, G): (N - 2 unless N is 1) + (W - 1 + G)(N - 1)
    (executor/decodingConfig.cpp calculateSpeculativeResourceTuple); a step feeds it and one token more a row."""
    return (0 if n == 1 else n - 2) + (w - 1 + g) * (n - 1)


def gpu_companion(request: SpeculativeRequest, model: ModelInfo, target: Target, precision: str, dtype: str,
                  kv_dtype: str, tp: int, pp: int, backend: str,
                  trtllm: str | None = None) -> tuple[ModelInfo | None, Companion | None]:
    """The draft model `draft:NAME` or EAGLE-3 head `eagle:NAME` names and what it takes of each GPU (None for
    prompt lookup and lookahead); UserError unless it can draft for `model` there: the target's vocabulary and
    tokenizer (a head: the target's hidden size and vocabulary), and a model the path loads."""
    if request.method == EAGLE and EAGLE in backend_for(backend).speculative_methods:
        return eagle_companion(request, model, kv_dtype, tp, trtllm or TRTLLM_VERSION)
    if request.method != DRAFT:
        return None, None
    draft = resolve_model_info(request.draft_model)
    name = request.draft_model
    if draft.source == "arch":
        raise UserError(f"--speculative draft:{name}: a draft needs weights (a preset, a Hugging Face directory or "
                        "hub id)")
    loads_hf = backend_for(backend).checkpoint_format == HF_CHECKPOINT
    if loads_hf and draft.source == "checkpoint":
        raise UserError(f"--speculative draft:{name}: the {backend} backend's draft is a Hugging Face model "
                        "(speculative_model_dir), not a TensorRT-LLM checkpoint")
    if draft.arch.vocab_size != model.arch.vocab_size:
        raise UserError(f"--speculative draft:{name}: the draft's vocabulary has {draft.arch.vocab_size} tokens, the "
                        f"target's {model.arch.vocab_size}: a draft must share the target's tokenizer")
    if tokenizer_mismatch(draft, model):
        raise UserError(f"--speculative draft:{name}: the draft's tokenizer gives other token ids than the target's "
                        "(vocabulary, added or special tokens): a draft must share the target's tokenizer")
    if loads_hf:     # the LLM API loads the draft as it is: 16-bit, or its own pre-quantized precision
        own = input_checkpoint_precision(draft.source_quantization)
        precision = own if own in PRECISIONS else ("fp16" if draft.arch.dtype == "float16" else "bf16")
        dtype = engine_dtype(precision, draft.arch)
    weights = max(weights_per_rank_by_stage(draft.arch, precision, dtype, tp, pp))
    return draft, Companion(draft.arch, precision, dtype, weights, kv_bytes_per_token(draft.arch, kv_dtype, tp, pp))


def eagle_companion(request: SpeculativeRequest, model: ModelInfo, kv_dtype: str, tp: int,
                    trtllm: str) -> tuple[ModelInfo, Companion]:
    """The EAGLE-3 head and what it takes of each GPU: its weights as it ships (the LLM API loads it unquantized)
    and its layers in the target's KV cache (pipeline/plan/eagle.py)."""
    head = read_eagle_head(request.draft_model)
    check_head_fits(head, model.arch, model.name)
    k = DEFAULT_DRAFT_LEN if request.draft_len is None else request.draft_len
    return head.model_info(), Companion(head.arch, head.precision, head.dtype, head.weights_bytes_per_rank(tp),
                                        head.kv_bytes_per_token(kv_dtype, tp, trtllm, k))


def plan_gpu_speculation(plan: Plan, request: SpeculativeRequest, draft: ModelInfo | None,
                         companion: Companion | None) -> Plan:
    """`plan` (planned with its draft's memory, `gpu_companion`) with its speculative decoding predicted and
    configured."""
    beam = plan.build_config.max_beam_width if plan.build_config else plan.triton.max_beam_width
    check_gpu_request(request, plan.backend, beam)
    k, drafts, acceptance, accepted, lookahead = drafting(request)
    batch = plan.triton.triton_max_batch_size
    rows = concurrencies(batch)
    steps, verify, drafted, how = predicted_steps(plan, companion, rows, k)
    if lookahead:     # every step verifies all K and accepts at most N - 1
        speedup = [round((1 + acceptance * drafts) * p / v, 3) for p, v in zip(steps, verify)]
        formula = f"(1 + a (N - 1)) x p / v, p a plain step, v a step of {k + 1} tokens a row"
    else:
        speedup = speedups(acceptance, drafts, k, steps, verify, drafted)
        formula = (f"(1 + a D) x p / (p + (v - p{' + K d' if draft else ''}) x D / K), p a plain step, v a step of "
                   f"{k + 1} tokens a row" + (", d the draft's step" if draft else ""))
    basis = f"{formula}; the steps from {how}"
    # a step verifying K drafts for every row carries rows x (K + 1) tokens, which max_num_tokens bounds
    max_num_tokens = planned_max_num_tokens(plan)
    fit = max_num_tokens // (k + 1)
    losing = next((i for i, (r, s) in enumerate(zip(rows, speedup)) if s < 1.0 or r > fit), len(rows))
    if losing < len(rows) and rows[losing] > fit and speedup[losing] >= 1.0:
        basis += (f"; drafting stops above {fit} rows: their {k + 1} tokens a row would pass max_num_tokens "
                  f"{max_num_tokens}")
    spec = SpeculativePlan(
        method=request.method, draft_len=k, max_ngram=MAX_NGRAM if request.method == NGRAM else None,
        acceptance=acceptance, acceptance_basis=accepted, rows=rows, step_s=[round(p, 6) for p in steps],
        verify_step_s=[round(v, 6) for v in verify], speedup=speedup, max_rows=rows[losing - 1] if losing else 0,
        basis=basis, drafts_per_step=drafts, lookahead=lookahead,
        **({} if draft is None else draft_fields(draft, companion, drafted)))
    warnings = list(plan.warnings)
    if not spec.max_rows:
        warnings.append(f"--speculative {request.to_flags()}: at acceptance {acceptance} and K = {k} no batch gains "
                        f"on {plan.target.name}; the deployment will not draft")
    elif lookahead and spec.max_rows < batch:
        warnings.append(f"--speculative {request.to_flags()}: lookahead runs for every request on the engine path "
                        f"and loses above {spec.max_rows} rows (x{min(speedup):.2f} at {batch}); plan --concurrency "
                        f"{spec.max_rows} or --max-batch-size {spec.max_rows} to keep it winning")
    return backend_for(plan.backend).configure_speculation(replace(plan, speculative=spec, warnings=warnings))


def draft_fields(draft: ModelInfo, companion: Companion, steps: list[float]) -> dict:
    """The SpeculativePlan fields of a GPU draft: as named and as its path loads it, its step, its weights and KV
    cache per GPU."""
    return {"draft_model": draft.name, "draft_served": served_model_id(draft),
            "draft_step_s": [round(d, 6) for d in steps], "draft_weights_bytes": companion.weights_bytes_per_rank,
            "draft_kv_bytes_per_token": companion.kv_bytes_per_token}


def predicted_steps(plan: Plan, draft: Companion | None, rows: list[int], k: int):
    """(plain steps, verify steps, draft steps, where they come from) at each number of rows: aiconfigurator-core's
    decode operations (a verify step as rows x (K + 1) tokens, each token's attention reading its row's KV cache),
    else trtpipe's speed-of-light bound (each row's KV cache read once a step)."""
    try:
        both, source, basis = decode_steps(plan.target, workpoint(plan, plan.model.arch, plan.precision),
                                           rows + [r * (k + 1) for r in rows])
        drafting = [0.0] * len(rows) if draft is None else decode_steps(
            plan.target, workpoint(plan, draft.arch, draft.precision), rows)[0]
        how = f"{source}: {basis}"
    except (ImportError, NotModelled) as exc:
        both = [sol_step(plan, plan.model.arch, plan.precision, plan.dtype, r, n) for n in (1, k + 1) for r in rows]
        drafting = [0.0] * len(rows) if draft is None else [
            sol_step(plan, draft.arch, draft.precision, draft.dtype, r, 1) for r in rows]
        how = (f"trtpipe's speed-of-light bound, max(bytes read / bandwidth, 2 x parameters x tokens / peak rate), "
               f"each row's KV cache read once a step ({exc or 'aiconfigurator-core is not installed'})")
    return both[:len(rows)], both[len(rows):], drafting, how


def planned_max_num_tokens(plan: Plan) -> int:
    return plan.build_config.max_num_tokens if plan.build_config else plan.llm_api.options["max_num_tokens"]


def workpoint(plan: Plan, arch, precision: str) -> Workpoint:
    fp8_fmha = bool(plan.plugin_config and plan.plugin_config.use_fp8_context_fmha)
    return Workpoint(arch, precision, plan.kv_cache_dtype, fp8_fmha, plan.tp_size, plan.pp_size,
                     plan.triton.triton_max_batch_size, plan.workload.input_len, plan.workload.output_len,
                     planned_max_num_tokens(plan))


def sol_step(plan: Plan, arch, precision: str, dtype: str, rows: int, tokens_per_row: int) -> float:
    """A step of `rows` rows feeding `tokens_per_row` tokens each at the speed of light: the weights and each row's
    KV cache read once (an attention kernel reads a row's cache once for all its queries), or its arithmetic."""
    read = weights_read_per_step(arch, precision, dtype, plan.tp_size, plan.pp_size)
    kv = kv_bytes_per_token(arch, plan.kv_cache_dtype, plan.tp_size, plan.pp_size)
    context = plan.workload.input_len + plan.workload.output_len / 2
    flops = 2 * parameter_count(arch) / (plan.tp_size * plan.pp_size) * rows * tokens_per_row
    return max(decode_step_seconds(read, rows, context, kv, plan.target),
               flops / plan.target.peak_ops_per_s(precision))


def draft_build_plan(plan: Plan, checkpoint) -> Plan:
    """What `trtpipe compile --draft` builds the draft engine of a draft-target engine plan from: the draft
    checkpoint's model with the target plan's precision, limits and plugins (the same max_batch_size, input and
    sequence lengths and max_num_tokens its tensorrt_llm_draft model is deployed with, paged context FMHA for the
    KV-cache reuse NVIDIA's BLS needs: examples/draft_target_model/README.md), not speculating itself. UserError for
    a plan without a draft engine, or a checkpoint that cannot draft for the target."""
    if bls_draft_len(plan) is None:
        raise UserError("--draft builds the draft engine of a draft-target plan on the engine backend (`trtpipe plan "
                        "--speculative draft:MODEL`); this plan has none")
    draft = resolve_model_info(str(checkpoint))
    if draft.arch.vocab_size != plan.model.arch.vocab_size:
        raise UserError(f"--draft {checkpoint}: its vocabulary has {draft.arch.vocab_size} tokens, the target's "
                        f"{plan.model.arch.vocab_size}: a draft must share the target's tokenizer")
    return replace(plan, model=draft, speculative=None,
                   build_config=replace(plan.build_config, max_draft_len=0))
