"""The validate stage: serve a model repository with Triton and check it the way clients will use it.

Checks (each pass/fail with detail and, when failing, what to fix):
  models_ready     every model of the repository is loaded and READY
  config_matches   the configuration the server reports equals each config.pbtxt (every field it sets)
  golden           greedy generation through `ensemble` equals a reference (Hugging Face transformers,
                   run a decoder layer at a time: `pipeline/golden.py`)
  streaming        with `stream` true, tokens arrive one response at a time (gRPC stream, as NVIDIA's
                   clients do) and join to the non-streamed text
  http_generate    /v2/models/ensemble/generate and generate_stream with the JSON NVIDIA's clients send
  bad_requests     malformed requests and out-of-range sampling values get error responses (the latter
                   naming the parameter) and the server stays healthy
  load_test        (optional) a bounded concurrency sweep: TTFT, inter-token latency, request latency
                   P50/P90/P99, output tokens/s, requests shed (server queue full) apart from requests
                   failed, none failed; JSON + PNG
  metrics          (unless skipped) the ensemble's request counters on Triton's /metrics grew by the
                   requests validate sent

The checks only assume NVIDIA's inflight_batcher_llm client contract on the `ensemble` model
(`text_input`, `max_tokens`, optional `stream`, `bad_words`, `stop_words`, `top_k`,
`exclude_input_in_output` -> `text_output`), so they run on any such repository.

Modules: `client` (requests to the ensemble over HTTP and gRPC; overload told from bad requests),
`checks` (every check but the load test and the metrics), `load_test`, `metrics`, `report` (options,
results, the rendered verdict) and `stage` (serving, running the checks, report.json, choosing the golden
reference).
"""

from .checks import config_differences
from .client import EnsembleClient
from .load_test import run_level
from .report import DEFAULT_PROMPTS, CheckResult, GreedyReference, ValidateOptions, ValidationReport, render_report
from .stage import golden_reference, reference_for, validate_repository

__all__ = [
    "DEFAULT_PROMPTS", "CheckResult", "EnsembleClient", "GreedyReference", "ValidateOptions", "ValidationReport",
    "config_differences", "golden_reference", "reference_for", "render_report", "run_level",
    "validate_repository",
]
