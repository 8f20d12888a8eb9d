"""The checks validate runs against a served repository, each returning a `CheckResult`.

  models_ready     every model of the repository is loaded and READY
  config_matches   the configuration the server reports equals each config.pbtxt (every field it sets)
  golden           greedy generation equals a reference (`GreedyReference`)
  streaming        streamed, tokens arrive one response at a time and join to the non-streamed text (the
                   ensemble: `stream` true over gRPC)
  http_generate    /v2/models/ensemble/generate and generate_stream with the JSON NVIDIA's clients send
  bad_requests     malformed requests (and sampling values outside TensorRT-LLM's ranges) get error
                   responses, each sampling one naming its parameter, and the server stays healthy

golden, streaming and bad_requests run on any contract's client (`Completions`: the ensemble's, the llmapi
model's, an OpenAI-compatible server's). The load test, the optional last check, is in `load_test.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import requests

from ..model_repository import model_names, read_repository
from ..server import TritonServer
from .client import EnsembleClient, RequestFailed, StreamResult
from .report import CheckResult, GreedyReference, ValidateOptions
from ..triton_admin import NotServed, TritonAdmin
from ..triton_names import BAD_WORDS, MAX_TOKENS, STOP_WORDS, STREAM, TEMPERATURE, TEXT_INPUT, TOP_K, TOP_P


class Completions(Protocol):
    """What the shared checks (golden, streaming, bad_requests) need of a contract's client: `EnsembleClient`,
    `llmapi.LlmapiClient`, `openai.OpenAIClient`."""

    inputs: dict | frozenset  # the optional request fields it declares (bad requests setting others are not sent)
    streaming_fix: str        # what to fix when the streaming check fails

    def generate(self, prompt: str, max_tokens: int) -> str:
        """The greedy completion (without the prompt); RequestFailed when the server refuses or fails."""
        ...

    def stream(self, prompt: str, max_tokens: int) -> StreamResult:
        """The same request streamed, each piece timed; RequestFailed when it cannot be sent at all."""
        ...

    def post_generate(self, body: dict) -> requests.Response: ...

    def healthy(self) -> bool: ...


def check_models_ready(server: TritonServer, repo: Path | None) -> CheckResult:
    admin = TritonAdmin(server.http_url)
    try:
        states = admin.states()
    except requests.HTTPError:
        states = {}
    expected = model_names(repo) if repo else sorted(states)
    problems = []
    for name in expected:
        if not admin.ready(name):
            problems.append(f"{name}: {states.get(name, 'not in the server repository')}")
    detail = (f"{len(expected)} models ready: {', '.join(expected)}" if not problems
              else "not ready: " + "; ".join(problems))
    return CheckResult("models_ready", not problems and bool(expected), detail,
                       fix="" if not problems else "see the server log for why the model did not load",
                       data={"states": states})


def config_differences(expected, actual, path: str = "") -> list[str]:
    """Every field set in `expected` whose value in `actual` differs (fields only `actual` sets are fine:
    the server fills defaults)."""
    differences = []
    for descriptor, value in expected.ListFields():
        where = f"{path}.{descriptor.name}" if path else descriptor.name
        other = getattr(actual, descriptor.name)
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            for key in value:
                if key not in other:
                    differences.append(f"{where}[{key!r}] missing on the server")
                elif descriptor.message_type.fields_by_name["value"].message_type is not None:
                    differences += config_differences(value[key], other[key], f"{where}[{key!r}]")
                elif value[key] != other[key]:
                    differences.append(f"{where}[{key!r}]: repository {value[key]!r}, server {other[key]!r}")
        elif descriptor.is_repeated:
            if len(value) != len(other):
                differences.append(f"{where}: repository has {len(value)} entries, server {len(other)}")
            elif descriptor.message_type is not None:
                for i, (a, b) in enumerate(zip(value, other)):
                    differences += config_differences(a, b, f"{where}[{i}]")
            elif list(value) != list(other):
                differences.append(f"{where}: repository {list(value)}, server {list(other)}")
        elif descriptor.message_type is not None:
            differences += config_differences(value, other, where)
        elif value != other:
            differences.append(f"{where}: repository {value!r}, server {other!r}")
    return differences


def check_config_matches(server: TritonServer, repo: Path | None) -> CheckResult:
    if repo is None:
        return CheckResult("config_matches", False, "no repository directory to compare with",
                           fix="pass the repository directory the server was started on")
    problems, compared, admin = [], [], TritonAdmin(server.http_url)
    repository = read_repository(repo)
    for name in repository.names:
        if name not in repository.models:
            problems.append(f"{name}/config.pbtxt does not parse: {repository.unusable[name]}")
            continue
        expected = repository.config(name)
        try:
            actual = admin.model_config(name)
        except NotServed as missing:
            problems.append(f"{name}: the server has no config ({missing.status})")
            continue
        problems += [f"{name}: {d}" for d in config_differences(expected, actual)]
        compared.append(name)
    detail = (f"server configs of {', '.join(compared)} match their config.pbtxt" if not problems
              else "; ".join(problems))
    return CheckResult("config_matches", not problems, detail,
                       fix="" if not problems else "the server is not serving this repository's configs: restart "
                       "it on this repository, or fix the fields the server rewrote")


def golden_case(client: Completions, reference: GreedyReference, prompt: str, expected: str,
                max_tokens: int) -> tuple[dict, float]:
    """One prompt served and compared with the reference's completion: (its case in the report, its token
    agreement from 0 to 1)."""
    try:
        got = client.generate(prompt, max_tokens)
    except RequestFailed as exc:
        return {"prompt": prompt, "expected": expected, "error": str(exc)}, 0.0
    want, have = reference.tokenize(expected), reference.tokenize(got)
    same = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
    case = {"prompt": prompt, "expected": expected, "got": got, "identical": got == expected,
            "agreeing_prefix_tokens": same, "reference_tokens": len(want)}
    if got == expected:
        return case, 1.0
    if reference.exact:
        return case, same / max(len(want), 1)
    # One early near-tie sends a quantized model down another path; judge every step instead.
    agree, total = reference.agreement(prompt, got)
    case.update(teacher_forced_agreeing=agree, served_tokens=total)
    return case, agree / total if total else 0.0


def check_golden(client: Completions, options: ValidateOptions) -> CheckResult:
    reference = options.golden
    if reference is None:
        return CheckResult("golden", False, "skipped: no model to compare with (trtpipe records the model a "
                           "repository was converted from; this one was made elsewhere or from a checkpoint that "
                           "does not say where it came from, or only a URL was given)", skipped=True,
                           fix="pass --golden MODEL (the model the repository was built from)")
    completions = reference.complete_all(list(options.prompts), options.max_tokens)
    compared = [golden_case(client, reference, prompt, expected, options.max_tokens)
                for prompt, expected in zip(options.prompts, completions)]
    cases = [case for case, _ in compared]
    agreements = [agreement for _, agreement in compared]
    identical = sum(bool(c.get("identical")) for c in cases)
    mean_agreement = float(np.mean(agreements))
    if reference.exact:
        passed = identical == len(cases)
        detail = f"{identical}/{len(cases)} greedy completions identical to {reference.name}"
    else:
        passed = mean_agreement >= options.min_agreement and not any("error" in c for c in cases)
        detail = (f"quantized: {mean_agreement:.0%} of the served tokens are {reference.name}'s greedy choice "
                  f"given the same prefix (pass at >= {options.min_agreement:.0%}); {identical}/{len(cases)} "
                  "completions identical; "
                  "perplexity delta is not measured here (see the calibration report)")
    first_bad = next((c for c in cases if not c.get("identical")), None)
    if first_bad and not passed:
        detail += f"; e.g. {first_bad['prompt']!r}: expected {first_bad['expected']!r}, got " \
                  f"{first_bad.get('got', first_bad.get('error'))!r}"
    return CheckResult("golden", passed, detail, data={"cases": cases, "mean_token_agreement": mean_agreement},
                       fix="" if passed else "the served model generates differently from the reference: check the "
                       "checkpoint conversion, the tokenizer (add_special_tokens) and end_id/stop handling")


def check_streaming(client: Completions, options: ValidateOptions) -> CheckResult:
    problems, cases = [], []
    for prompt in options.prompts[:2]:
        try:
            streamed = client.stream(prompt, options.max_tokens)
            whole = client.generate(prompt, options.max_tokens)
        except RequestFailed as exc:
            problems.append(f"{prompt!r}: {exc}")
            continue
        case = {"prompt": prompt, "responses": len(streamed.pieces), "joined": streamed.text, "non_streamed": whole,
                "spread_s": streamed.arrival[-1] - streamed.arrival[0] if streamed.arrival else 0.0}
        cases.append(case)
        if streamed.error:
            problems.append(f"{prompt!r}: stream failed: {streamed.error}")
        elif len(streamed.pieces) < 2 or case["spread_s"] <= 0:
            problems.append(f"{prompt!r}: {len(streamed.pieces)} response(s) — tokens did not arrive incrementally")
        elif streamed.text != whole:
            problems.append(f"{prompt!r}: joined stream {streamed.text!r} != non-streamed {whole!r}")
    passed = not problems
    detail = ("; ".join(f"{c['responses']} responses over {c['spread_s'] * 1000:.0f} ms, joined == non-streamed"
                        for c in cases) if passed else "; ".join(problems))
    return CheckResult("streaming", passed, detail, data={"cases": cases},
                       fix="" if passed else client.streaming_fix)


def check_http_generate(client: EnsembleClient, options: ValidateOptions, stream: bool = True) -> CheckResult:
    """NVIDIA's generate JSON, and generate_stream's joined text the same (`stream` False: a deployment that does not
    stream, generate only)."""
    prompt = options.prompts[0]
    nvidia_body = {TEXT_INPUT: prompt, MAX_TOKENS: options.max_tokens, BAD_WORDS: "", STOP_WORDS: ""}
    problems = []
    try:
        plain = client.generate(prompt, options.max_tokens, body=nvidia_body)
        if not plain.strip():
            problems.append("generate returned an empty text_output")
    except RequestFailed as exc:
        plain = None
        problems.append(str(exc))
    streamed = client.generate_stream(prompt, options.max_tokens, body={**nvidia_body, STREAM: True}) if stream \
        else None
    if streamed is not None and streamed.error:
        problems.append(f"generate_stream: {streamed.error}")
    elif streamed is not None and plain is not None and streamed.text != plain:
        problems.append(f"generate_stream joined {streamed.text!r} != generate {plain!r}")
    passed = not problems
    detail = (f"generate -> {plain!r}; " + (f"generate_stream: {len(streamed.pieces)} events, same text" if stream
                                             else "generate_stream not tried: the deployment does not stream")
              if passed else "; ".join(problems))
    return CheckResult("http_generate", passed, detail, data={"body": nvidia_body},
                       fix="" if passed else "clients of NVIDIA's deployments send this JSON; every ensemble input "
                       "it names must exist with NVIDIA's data types")


@dataclass(frozen=True)
class BadRequest:
    name: str
    body: dict
    via: str = "generate"  # or "grpc" (the HTTP infer endpoint refuses decoupled models for any request)
    parameter: str | None = None  # an optional input it sets out of range: sent only when the client declares
    #                               it, and the error must name it


def bad_requests(prompt: str) -> list[BadRequest]:
    """The ensemble contract's (NVIDIA's inflight_batcher_llm client JSON)."""
    # An empty text_input is not among them: NVIDIA's preprocessing encodes it with the tokenizer's special tokens
    # (the BOS alone, for a tokenizer that adds one) and the model answers it.
    return [
        BadRequest("max_tokens 0", {TEXT_INPUT: prompt, MAX_TOKENS: 0}),
        BadRequest("max_tokens far beyond the context", {TEXT_INPUT: prompt, MAX_TOKENS: 10_000_000}),
        BadRequest("max_tokens of the wrong type", {TEXT_INPUT: prompt, MAX_TOKENS: "sixteen"}),
        BadRequest("text_input of the wrong type", {TEXT_INPUT: 12345, MAX_TOKENS: 8}),
        BadRequest("missing max_tokens", {TEXT_INPUT: prompt}),
        BadRequest("unknown input", {TEXT_INPUT: prompt, MAX_TOKENS: 8, "no_such_input": 1}, via="grpc"),
        # TensorRT-LLM's ranges (executor SamplingConfig checks): temperature >= 0, top_p <= 1, top_k >= 0; a top_p
        # <= 0 is not refused: NVIDIA's backend reads it as unset (utils.cc@c2e65b8:558-563)
        BadRequest("negative temperature", {TEXT_INPUT: prompt, MAX_TOKENS: 8, TEMPERATURE: -0.5},
                   parameter=TEMPERATURE),
        BadRequest("top_p above 1", {TEXT_INPUT: prompt, MAX_TOKENS: 8, TOP_P: 1.5}, parameter=TOP_P),
        BadRequest("negative top_k", {TEXT_INPUT: prompt, MAX_TOKENS: 8, TOP_K: -1}, parameter=TOP_K),
    ]


def send_bad_request(client: Completions, bad: BadRequest) -> tuple[bool, str]:
    """(rejected, what came back) for one malformed request."""
    if bad.via == "grpc":
        try:
            result = client.grpc_stream(bad.body)
        except RequestFailed as exc:
            return False, str(exc)
        if result.timed_out:
            return False, f"no answer within {client.timeout:.0f} s — the request hung"
        return (result.error is not None, result.error or f"accepted, answered {result.text!r}")
    try:
        response = client.post_generate(bad.body)
    except requests.RequestException as exc:
        return False, f"no response ({type(exc).__name__}) — the server hung or dropped the connection"
    if response.status_code >= 400:
        return True, f"{response.status_code}: {response.text.strip()[:200]}"
    return False, f"accepted with {response.status_code}: {response.text.strip()[:200]}"


def check_bad_requests(client: Completions, options: ValidateOptions,
                       cases: list[BadRequest] | None = None) -> CheckResult:
    """Send `cases` (default: the ensemble's `bad_requests`), then a good request."""
    outcomes, accepted, undeclared = [], [], []
    for bad in bad_requests(options.prompts[0]) if cases is None else cases:
        if bad.parameter and bad.parameter not in client.inputs:
            undeclared.append(bad.name)
            continue
        rejected, answer = send_bad_request(client, bad)
        if rejected and bad.parameter and bad.parameter not in answer:
            rejected, answer = False, f"refused without naming {bad.parameter}: {answer}"
        outcomes.append({"request": bad.name, "rejected": rejected, "answer": answer})
        if not rejected:
            accepted.append(f"{bad.name}: {answer}")
    healthy = client.healthy()
    try:
        still_serves = bool(client.generate(options.prompts[0], 4))
    except RequestFailed as exc:
        still_serves = False
        accepted.append(f"a good request after the bad ones failed: {exc}")
    passed = not accepted and healthy and still_serves
    detail = (f"all {len(outcomes)} bad requests rejected; server healthy and serving afterwards" if passed else
              "; ".join(accepted + ([] if healthy else ["the server is no longer healthy"])))
    if undeclared:
        detail += f" (not sent, the server declares no such input: {', '.join(undeclared)})"
    return CheckResult("bad_requests", passed, detail,
                       data={"outcomes": outcomes, "healthy_after": healthy, "not_sent": undeclared},
                       fix="" if passed else "validate every request field and answer with an error response "
                       "naming the field and its allowed range (never crash the model or hang)")

