"""validate's `speculation` check: the acceptance rate a speculating deployment measures on the validation prompts.

The plan's predicted speedup rests on an acceptance rate (accepted / drafted tokens) it assumed; this check sends
each validation prompt once, greedy, with `return_perf_metrics`, sums NVIDIA's `total_draft_tokens` and
`total_accepted_draft_tokens` and says what the deployment accepted, so that `trtpipe plan --acceptance` can use it.
"""

from __future__ import annotations

import requests

from ..triton_names import RETURN_PERF_METRICS, TOTAL_ACCEPTED_DRAFT_TOKENS, TOTAL_DRAFT_TOKENS
from .client import EnsembleClient
from .report import CheckResult, ValidateOptions

NAME = "speculation"


def check_speculation(client: EnsembleClient, options: ValidateOptions, spec) -> CheckResult:
    """`spec`: the plan's SpeculativePlan. Passes when every request was answered and, unless the plan turned
    drafting off (max_rows 0), the deployment drafted."""
    drafted = accepted = 0
    for prompt in options.prompts:
        body = {**client.body(prompt, options.max_tokens), RETURN_PERF_METRICS: True}
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
    rate = accepted / drafted if drafted else 0.0
    figures = {"drafted": drafted, "accepted": accepted, "acceptance": round(rate, 4),
               "planned_acceptance": spec.acceptance, "draft_len": spec.draft_len, "prompts": len(options.prompts)}
    if not drafted:
        off = spec.max_rows == 0
        return CheckResult(NAME, off, "no drafts: the plan turned drafting off on this host (max_rows 0)" if off else
                           f"the deployment drafted nothing on {len(options.prompts)} prompts of "
                           f"{options.max_tokens} tokens (prompt lookup found no repeated n-gram)", data=figures,
                           fix="" if off else "speculation pays where outputs repeat their inputs; validate with "
                           "--max-tokens 64 or prompts that do, or deploy without --speculative")
    return CheckResult(NAME, True, f"acceptance {rate:.2f} ({accepted} of {drafted} drafts, K {spec.draft_len}, "
                       f"{len(options.prompts)} prompts); the plan assumed {spec.acceptance:g}: `trtpipe plan ... "
                       f"--speculative {spec.method} --acceptance {rate:.2f}` predicts with it", data=figures)
