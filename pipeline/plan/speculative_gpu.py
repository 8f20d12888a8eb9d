"""`plan --speculative` on a GPU target: the draft beside the target in memory, the speedup predicted from NVIDIA's
measured decode operations, and the configuration each TensorRT-LLM path takes.

What each path runs (docs/speculative.md "On a GPU", docs/upstream-facts.md S7):
- the PyTorch backend (LLM API `speculative_config`): prompt lookup (`NGram`) and draft-target (a second Hugging
  Face model, `speculative_model_dir`); `max_concurrency` turns speculation off above the planned break-even rows,
  as the cpu server's `speculative_max_rows` does;
- the engine path (TensorRT-LLM 1.2.1): draft-target, the target built with `--speculative_decoding_mode
  draft_tokens_external --max_draft_len K` and a second engine for the draft. Its prompt lookup lived in
  examples/run.py, not in trtllm-build or Triton, so `ngram` is refused there; lookahead and EAGLE are not
  written yet.

The memory: a draft model's weights, its activations for the same tokens a step and its decoder buffers come off
each GPU first, and its KV cache holds as many tokens as the target's (`policy.Companion`, planned by the
backend's planner). The speed: the same formula as the cpu target's (pipeline/plan/speculative.py), with the
plain step p, the verify step v of K + 1 tokens a row and the draft's step d taken from aiconfigurator-core's
decode operations for the target's GPU (`performance.decode_steps`: measured on NVIDIA's chip, or derived for
the RTX 4090 from the L40S), else trtpipe's speed-of-light bound. Nothing here ran on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

from ..backends import backend_for
from ..backends.names import HF_CHECKPOINT
from ..errors import UserError
from ..model.arch_config import parameter_count
from ..presets import served_model_id
from ..runtime.speculative import DRAFT, MAX_NGRAM, NGRAM
from ..targets import Target
from .memory import decode_step_seconds, kv_bytes_per_token, weights_per_rank_by_stage, weights_read_per_step
from .performance import NotModelled, Workpoint, decode_steps
from .policy import Companion
from .schema import ModelInfo, Plan, SpeculativePlan, resolve_model_info
from .speculative import (ACCEPTANCE_BASIS, DEFAULT_ACCEPTANCE, DEFAULT_DRAFT_LEN, SpeculativeRequest, concurrencies,
                          default_drafts, speedups, tokenizer_mismatch)

#: the most drafts a step the plan accepts on a GPU (TensorRT-LLM's own examples use 4 to 10)
MAX_GPU_DRAFT_LEN = 16
#: why a GPU backend does not run a method its upstream has in some other form
NOT_RUN = {NGRAM: "TensorRT-LLM's engine path has prompt lookup only as a script (examples/run.py), not as a "
                  "trtllm-build mode or a Triton model: use --backend pytorch (its NGram drafter)"}
NOT_WRITTEN = "is not written for GPU targets yet (ngram on the pytorch backend and draft:MODEL are)"


def check_gpu_request(request: SpeculativeRequest, backend: str, beam_width: int) -> int:
    """K for a GPU plan; UserError for what the backend does not run."""
    if request.method in ("lookahead", "eagle"):
        raise UserError(f"--speculative {request.to_flags()}: {request.method} {NOT_WRITTEN}")
    runs = backend_for(backend).speculative_methods
    if request.method not in runs:
        why = NOT_RUN.get(request.method, f"it runs {', '.join(runs) or 'none'}")
        raise UserError(f"--speculative {request.method} on the {backend} backend: {why}")
    if beam_width > 1:
        raise UserError("--speculative with beam search: TensorRT-LLM speculates with one beam; drop one of them")
    k = DEFAULT_DRAFT_LEN if request.draft_len is None else request.draft_len
    if not 1 <= k <= MAX_GPU_DRAFT_LEN:
        raise UserError(f"--draft-len must be between 1 and {MAX_GPU_DRAFT_LEN} (got {k})")
    return k


def gpu_companion(request: SpeculativeRequest, model: ModelInfo, target: Target, precision: str, dtype: str,
                  kv_dtype: str, tp: int, pp: int, backend: str) -> tuple[ModelInfo | None, Companion | None]:
    """The draft model `draft:NAME` names and what it takes of each GPU (None for prompt lookup); UserError unless
    it can draft for `model` there: the target's vocabulary and tokenizer, and a model the path loads."""
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
    if loads_hf and draft.path and draft.source != "preset":
        raise UserError(f"--speculative draft:{name}: name the {backend} backend's draft by preset or hub id; a "
                        "local draft directory is not copied into the deployment yet, and the configuration names "
                        "no path of this machine")
    if draft.arch.vocab_size != model.arch.vocab_size:
        raise UserError(f"--speculative draft:{name}: the draft's vocabulary has {draft.arch.vocab_size} tokens, the "
                        f"target's {model.arch.vocab_size}: a draft must share the target's tokenizer")
    if tokenizer_mismatch(draft, model):
        raise UserError(f"--speculative draft:{name}: the draft's tokenizer gives other token ids than the target's "
                        "(vocabulary, added or special tokens): a draft must share the target's tokenizer")
    weights = max(weights_per_rank_by_stage(draft.arch, precision, dtype, tp, pp))
    return draft, Companion(draft.arch, precision, dtype, weights, kv_bytes_per_token(draft.arch, kv_dtype, tp, pp))


def plan_gpu_speculation(plan: Plan, request: SpeculativeRequest, draft: ModelInfo | None) -> Plan:
    """`plan` (planned with its draft's memory) with its speculative decoding predicted and configured."""
    beam = plan.build_config.max_beam_width if plan.build_config else plan.triton.max_beam_width
    k = check_gpu_request(request, plan.backend, beam)
    default = DEFAULT_ACCEPTANCE[request.method]
    acceptance = default if request.acceptance is None else request.acceptance
    if not 0.0 <= acceptance <= 1.0:
        raise UserError(f"--acceptance is accepted / drafted tokens, between 0 and 1 (got {acceptance})")
    drafts = default_drafts(request.method, k) if request.drafts_per_step is None else request.drafts_per_step
    if not 0.0 < drafts <= k:
        raise UserError(f"--drafts-per-step is the drafts a step verifies on average, above 0 and at most --draft-len "
                        f"{k} (got {drafts})")
    batch = plan.triton.triton_max_batch_size
    rows = concurrencies(batch)
    steps, verify, drafting, basis = predicted_steps(plan, draft, rows, k)
    speedup = speedups(acceptance, drafts, k, steps, verify, drafting)
    # a step verifying K drafts for every row carries rows x (K + 1) tokens, which max_num_tokens bounds
    max_num_tokens = planned_max_num_tokens(plan)
    fit = max_num_tokens // (k + 1)
    losing = next((i for i, (r, s) in enumerate(zip(rows, speedup)) if s < 1.0 or r > fit), len(rows))
    if losing < len(rows) and rows[losing] > fit and speedup[losing] >= 1.0:
        basis += (f"; drafting stops above {fit} rows: their {k + 1} tokens a row would pass max_num_tokens "
                  f"{max_num_tokens}")
    accepted = (f"--acceptance {acceptance}" if request.acceptance is not None else
                f"the default {default} ({ACCEPTANCE_BASIS[request.method]}, measured on the cpu target); measure "
                "yours on the deployment and plan again with --acceptance")
    spec = SpeculativePlan(
        method=request.method, draft_len=k, max_ngram=MAX_NGRAM if request.method == NGRAM else None,
        acceptance=acceptance, acceptance_basis=accepted, rows=rows, step_s=[round(p, 6) for p in steps],
        verify_step_s=[round(v, 6) for v in verify], speedup=speedup, max_rows=rows[losing - 1] if losing else 0,
        basis=basis, drafts_per_step=drafts,
        **({} if draft is None else draft_fields(plan, draft, drafting)))
    warnings = list(plan.warnings)
    if not spec.max_rows:
        warnings.append(f"--speculative {request.to_flags()}: at acceptance {acceptance} and K = {k} no batch gains "
                        f"on {plan.target.name}; the deployment will not draft")
    return backend_for(plan.backend).configure_speculation(replace(plan, speculative=spec, warnings=warnings))


def draft_fields(plan: Plan, draft: ModelInfo, steps: list[float]) -> dict:
    """The SpeculativePlan fields of a GPU draft: what the path loads, its step, its weights and KV cache per GPU."""
    tp, pp = plan.tp_size, plan.pp_size
    return {"draft_model": served_model_id(draft), "draft_step_s": [round(d, 6) for d in steps],
            "draft_weights_bytes": max(weights_per_rank_by_stage(draft.arch, plan.precision, plan.dtype, tp, pp)),
            "draft_kv_bytes_per_token": kv_bytes_per_token(draft.arch, plan.kv_cache_dtype, tp, pp)}


def predicted_steps(plan: Plan, draft: ModelInfo | None, rows: list[int], k: int):
    """(plain steps, verify steps, draft steps, basis) at each number of rows: aiconfigurator-core's decode
    operations, else trtpipe's speed-of-light bound (weights and KV cache read once a step; the verify step's
    K + 1 tokens a row read their KV cache K + 1 times, as AIC counts them)."""
    point = workpoint(plan, plan.model.arch)
    try:
        both, source, basis = decode_steps(plan.target, point, rows + [r * (k + 1) for r in rows])
        drafting = [0.0] * len(rows) if draft is None else decode_steps(plan.target, workpoint(plan, draft.arch),
                                                                         rows)[0]
        how = f"{source}: {basis}"
    except (ImportError, NotModelled) as exc:
        both = [sol_step(plan, plan.model.arch, r, n) for n in (1, k + 1) for r in rows]
        drafting = [0.0] * len(rows) if draft is None else [sol_step(plan, draft.arch, r, 1) for r in rows]
        how = (f"trtpipe's speed-of-light bound, max(bytes read / bandwidth, 2 x parameters x tokens / peak rate), "
               f"each row's KV cache read once a step ({exc or 'aiconfigurator-core is not installed'})")
    d = " + K d" if draft else ""
    formula = (f"(1 + a D) x p / (p + (v - p{d}) x D / K), p a plain step, v a step of {k + 1} tokens a row"
               + (", d the draft's step" if draft else ""))
    return both[:len(rows)], both[len(rows):], drafting, f"{formula}; the steps from {how}"


def planned_max_num_tokens(plan: Plan) -> int:
    return plan.build_config.max_num_tokens if plan.build_config else plan.llm_api.options["max_num_tokens"]


def workpoint(plan: Plan, arch) -> Workpoint:
    fp8_fmha = bool(plan.plugin_config and plan.plugin_config.use_fp8_context_fmha)
    return Workpoint(arch, plan.precision, plan.kv_cache_dtype, fp8_fmha, plan.tp_size, plan.pp_size,
                     plan.triton.triton_max_batch_size, plan.workload.input_len, plan.workload.output_len,
                     planned_max_num_tokens(plan))


def sol_step(plan: Plan, arch, rows: int, tokens_per_row: int) -> float:
    """A step of `rows` rows feeding `tokens_per_row` tokens each at the speed of light: the weights and each row's
    KV cache read once (an attention kernel reads a row's cache once for all its queries), or its arithmetic."""
    read = weights_read_per_step(arch, plan.precision, plan.dtype, plan.tp_size, plan.pp_size)
    kv = kv_bytes_per_token(arch, plan.kv_cache_dtype, plan.tp_size, plan.pp_size)
    context = plan.workload.input_len + plan.workload.output_len / 2
    flops = 2 * parameter_count(arch) / (plan.tp_size * plan.pp_size) * rows * tokens_per_row
    return max(decode_step_seconds(read, rows, context, kv, plan.target),
               flops / plan.target.peak_ops_per_s(plan.precision))
