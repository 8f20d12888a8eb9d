"""validate's `speculation` check: the acceptance rate and drafts per step a speculating deployment measures on the
validation prompts.

The plan's predicted speedup rests on an acceptance rate (accepted / drafted tokens) and a number of drafts a step it
assumed; this check sends each validation prompt once, greedy, exactly max_tokens tokens (min_tokens = max_tokens),
with `return_perf_metrics`, sums NVIDIA's `total_draft_tokens` and `total_accepted_draft_tokens` and says what the
deployment accepted and drafted per decode step, so that `trtpipe plan --acceptance --drafts-per-step` can use
them. A request of N tokens ran N - 1 - accepted decode steps (its first token comes from the prompt's pass, and each
step outputs its accepted drafts and one token of its own).

Draft-target through the BLS (the engine path: `check_bls_drafting`) drafts only for requests to tensorrt_llm_bls
that carry num_draft_tokens: each prompt goes there with the plan's K and through the ensemble plainly, and the check
passes when the texts are the same (exact) and the deployment drafted.
"""

from __future__ import annotations

import requests

from ..triton_names import (NUM_DRAFT_TOKENS, RETURN_PERF_METRICS, TENSORRT_LLM_BLS, TEXT_OUTPUT,
                            TOTAL_ACCEPTED_DRAFT_TOKENS, TOTAL_DRAFT_TOKENS)
from .client import EnsembleClient, RequestFailed
from .report import CheckResult, ValidateOptions

NAME = "speculation"


def check_speculation(client: EnsembleClient, options: ValidateOptions, spec) -> CheckResult:
    """`spec`: the plan's SpeculativePlan. Passes when every request was answered and, unless the plan turned
    drafting off (max_rows 0), the deployment drafted."""
    drafted = accepted = steps = 0
    for prompt in options.prompts:
        body = {**client.body(prompt, options.max_tokens), "min_tokens": options.max_tokens, RETURN_PERF_METRICS: True}
        try:
            response = client.post_generate(body)
        except requests.RequestException as exc:
            return CheckResult(NAME, False, f"{type(exc).__name__}: {exc}", fix="the server must answer "
                               "return_perf_metrics requests")
        if response.status_code != 200:
            return CheckResult(NAME, False, f"HTTP {response.status_code}: {response.text[:200]}",
                               fix="the ensemble must pass return_perf_metrics and its outputs")
        data = response.json()
        drafted += int(data.get(TOTAL_DRAFT_TOKENS, 0))
        accepted += int(data.get(TOTAL_ACCEPTED_DRAFT_TOKENS, 0))
        steps += options.max_tokens - 1 - int(data.get(TOTAL_ACCEPTED_DRAFT_TOKENS, 0))
    rate = accepted / drafted if drafted else 0.0
    per_step = drafted / steps if steps > 0 else 0.0
    figures = {"drafted": drafted, "accepted": accepted, "acceptance": round(rate, 4),
               "drafts_per_step": round(per_step, 3), "planned_acceptance": spec.acceptance,
               "planned_drafts_per_step": spec.drafts_per_step, "draft_len": spec.draft_len,
               "prompts": len(options.prompts)}
    if not drafted:
        off = spec.max_rows == 0
        return CheckResult(NAME, off, "no drafts: the plan turned drafting off on this host (max_rows 0)" if off else
                           f"the deployment drafted nothing on {len(options.prompts)} prompts of "
                           f"{options.max_tokens} tokens (prompt lookup found no repeated n-gram, or the server "
                           "measured that drafting does not pay on this host)", data=figures,
                           fix="" if off else "speculation pays where outputs repeat their inputs; validate with "
                           "--max-tokens 64 or prompts that do, or deploy without --speculative")
    drafts = min(round(per_step, 2), spec.draft_len) or 0.01
    return CheckResult(NAME, True, f"acceptance {rate:.2f} ({accepted} of {drafted} drafts, K {spec.draft_len}), "
                       f"{per_step:.2f} drafts a step ({len(options.prompts)} prompts of {options.max_tokens} tokens); "
                       f"the plan assumed {spec.acceptance:g} and {spec.drafts_per_step or spec.draft_len:g}: `trtpipe "
                       f"plan ... --speculative {method_flag(spec)} --acceptance {rate:.2f} --drafts-per-step "
                       f"{drafts:g}` predicts with them", data=figures)


def method_flag(spec) -> str:
    """--speculative's value for the plan's method (draft:CHECKPOINT names its draft)."""
    draft = spec.draft_checkpoint or spec.draft_model
    return spec.method + (f":{draft}" if draft else "")


def check_bls_drafting(client: EnsembleClient, options: ValidateOptions, spec) -> CheckResult:
    """Each validation prompt through tensorrt_llm_bls with num_draft_tokens K (greedy, perf metrics) and through the
    ensemble plainly: the same text, and the drafted and accepted tokens of the drafting requests. The BLS requests
    go past the client's tally (the metrics check counts the ensemble's)."""
    drafted = accepted = 0
    differ = []
    for prompt in options.prompts:
        body = {**client.body(prompt, options.max_tokens), NUM_DRAFT_TOKENS: spec.draft_len, RETURN_PERF_METRICS: True}
        try:
            plain = client.generate(prompt, options.max_tokens)
            response = requests.post(f"{client.server.http_url}/v2/models/{TENSORRT_LLM_BLS}/generate", json=body,
                                     timeout=client.timeout)
        except (RequestFailed, requests.RequestException) as exc:
            return CheckResult(NAME, False, f"{type(exc).__name__}: {exc}", fix="the ensemble and tensorrt_llm_bls "
                               "must answer")
        if response.status_code != 200:
            return CheckResult(NAME, False, f"{TENSORRT_LLM_BLS} with {NUM_DRAFT_TOKENS} {spec.draft_len}: HTTP "
                               f"{response.status_code}: {response.text[:200]}", fix="tensorrt_llm_bls must name "
                               "the draft model (tensorrt_llm_draft_model_name) and nothing may be decoupled: "
                               "`trtpipe check` says what is not")
        data = response.json()
        drafted += int(data.get(TOTAL_DRAFT_TOKENS, 0))
        accepted += int(data.get(TOTAL_ACCEPTED_DRAFT_TOKENS, 0))
        if client.completion(prompt, data.get(TEXT_OUTPUT, "")) != plain:
            differ.append(prompt)
    rate = accepted / drafted if drafted else 0.0
    figures = {"drafted": drafted, "accepted": accepted, "acceptance": round(rate, 4), "draft_len": spec.draft_len,
               "planned_acceptance": spec.acceptance, "prompts": len(options.prompts), "differ": differ,
               "via": TENSORRT_LLM_BLS}
    if differ:
        return CheckResult(NAME, False, f"{len(differ)} of {len(options.prompts)} prompts answered otherwise with "
                           f"drafts than without (first: {differ[0]!r})", data=figures,
                           fix="greedy drafting must not change the text: the target must verify draft_input_ids")
    if not drafted:
        return CheckResult(NAME, False, f"{TENSORRT_LLM_BLS} drafted nothing on {len(options.prompts)} prompts",
                           data=figures, fix="the draft model must answer the BLS's draft requests")
    return CheckResult(NAME, True, f"through {TENSORRT_LLM_BLS} with {NUM_DRAFT_TOKENS} {spec.draft_len}: the "
                       f"same text as without on {len(options.prompts)} prompts, acceptance {rate:.2f} ({accepted} of "
                       f"{drafted} drafts); the plan assumed {spec.acceptance:g}: `trtpipe plan ... --speculative "
                       f"{method_flag(spec)} --acceptance {rate:.2f}` predicts with it", data=figures)
