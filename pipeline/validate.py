"""The validate stage: serve a model repository with Triton and check it the way clients will use it.

Checks (each pass/fail with detail and, when failing, what to fix):
  models_ready     every model of the repository is loaded and READY
  config_matches   the configuration the server reports equals each config.pbtxt (every field it sets)
  golden           greedy generation through `ensemble` equals a reference (Hugging Face transformers,
                   run a decoder layer at a time: `golden.py`)
  streaming        with `stream` true, tokens arrive one response at a time (gRPC stream, as NVIDIA's
                   clients do) and join to the non-streamed text
  http_generate    /v2/models/ensemble/generate and generate_stream with the JSON NVIDIA's clients send
  bad_requests     malformed requests get error responses and the server stays healthy
  load_test        (optional) a bounded concurrency sweep: TTFT, inter-token latency, request latency
                   P50/P90/P99, output tokens/s, no request lost; JSON + PNG

The checks only assume NVIDIA's inflight_batcher_llm client contract on the `ensemble` model
(`text_input`, `max_tokens`, optional `stream`, `bad_words`, `stop_words`, `top_k`,
`exclude_input_in_output` -> `text_output`), so they run on any such repository.
"""

from __future__ import annotations

import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import requests
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from .errors import UserError
from .outputs import atomic_output_dir
from .server import TritonServer, connect, embedded_server, list_repository_models

ENSEMBLE = "ensemble"
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
)
REQUEST_TIMEOUT_S = 120.0
NUMPY_DTYPES = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
                "FP16": np.float16}


# ---------------------------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class ValidationReport:
    repo: str
    server: str
    checks: list[CheckResult]
    log_path: str | None = None

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def to_dict(self) -> dict:
        return {"repo": self.repo, "server": self.server, "passed": self.passed,
                "checks": [asdict(check) for check in self.checks], "server_log": self.log_path}


@dataclass
class ValidateOptions:
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 16
    golden: "GoldenReference | None" = None
    load_test: bool = False
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    requests_per_client: int = 2
    #: quantized checkpoints: share of the served tokens that are the reference's greedy choice given the
    #: same prefix (teacher forcing), needed to pass; SmolLM2 FP8 (GPTQ) measured 89%
    min_agreement: float = 0.7
    request_timeout: float = REQUEST_TIMEOUT_S


class GoldenReference(Protocol):
    """What the golden check compares the server with: greedy completions of prompts (`golden.py`)."""

    name: str
    exact: bool  # token-identical expected (unquantized); otherwise token agreement is reported

    def complete_all(self, prompts: list[str], max_tokens: int) -> list[str]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def agreement(self, prompt: str, completion: str) -> tuple[int, int]:
        """(tokens of `completion` that are the reference's greedy choice after the prompt and the
        completion so far, tokens of `completion`)."""
        ...


# ----------------------------------------------------------------------------------------------- client


@dataclass
class StreamResult:
    """One streamed request: the text pieces, when each arrived, and the error if the request failed."""

    sent_at: float
    pieces: list[str] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float:
        return self.arrival[0] - self.sent_at

    @property
    def latency(self) -> float:
        return self.arrival[-1] - self.sent_at

    @property
    def inter_token(self) -> list[float]:
        return list(np.diff(self.arrival)) if len(self.arrival) > 1 else []


class RequestFailed(Exception):
    pass


class EnsembleClient:
    """Talks to the `ensemble` model the way NVIDIA's clients do (HTTP generate / generate_stream, gRPC stream)."""

    def __init__(self, server: TritonServer, timeout: float = REQUEST_TIMEOUT_S):
        self.server = server
        self.timeout = timeout
        response = requests.get(f"{server.http_url}/v2/models/{ENSEMBLE}/config", timeout=30)
        if response.status_code != 200:
            raise UserError(f"the server has no `{ENSEMBLE}` model ({response.status_code}: "
                            f"{response.text.strip()}); validate needs NVIDIA's inflight_batcher_llm ensemble "
                            "(text_input, max_tokens -> text_output)")
        self.config = response.json()
        self.inputs = {i["name"]: i for i in self.config.get("input", [])}
        missing = {"text_input", "max_tokens"} - set(self.inputs)
        if missing or "text_output" not in {o["name"] for o in self.config.get("output", [])}:
            raise UserError(f"the `{ENSEMBLE}` model lacks NVIDIA's client contract (needs inputs text_input, "
                            f"max_tokens and output text_output; missing {sorted(missing) or ['text_output']})")

    # --- what a request looks like

    def body(self, prompt: str, max_tokens: int, stream: bool = False) -> dict:
        """The JSON of NVIDIA's generate examples, plus greedy sampling and prompt exclusion where declared."""
        body = {"text_input": prompt, "max_tokens": max_tokens, "bad_words": "", "stop_words": ""}
        body = {k: v for k, v in body.items() if k in self.inputs}
        if stream:
            body["stream"] = True
        if "top_k" in self.inputs:
            body["top_k"] = 1
        if "exclude_input_in_output" in self.inputs:
            body["exclude_input_in_output"] = True
        return body

    @staticmethod
    def completion(prompt: str, text: str) -> str:
        """The generated part of a non-streamed text_output (NVIDIA's backend may echo the prompt first)."""
        return text[len(prompt):] if text.startswith(prompt) else text

    # --- HTTP

    def post_generate(self, body: dict) -> requests.Response:
        return requests.post(f"{self.server.http_url}/v2/models/{ENSEMBLE}/generate", json=body, timeout=self.timeout)

    def generate(self, prompt: str, max_tokens: int, body: dict | None = None) -> str:
        try:
            response = self.post_generate(body or self.body(prompt, max_tokens))
        except requests.RequestException as exc:
            raise RequestFailed(f"generate got no response ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise RequestFailed(f"generate returned {response.status_code}: {response.text.strip()[:300]}")
        text = response.json().get("text_output")
        if isinstance(text, list):
            text = "".join(text)
        if not isinstance(text, str):
            raise RequestFailed(f"generate answered without a text_output string: {response.text[:300]}")
        return self.completion(prompt, text)

    def generate_stream(self, prompt: str, max_tokens: int, body: dict | None = None) -> StreamResult:
        """POST generate_stream and read its server-sent events, timing each one."""
        result = StreamResult(sent_at=time.perf_counter())
        url = f"{self.server.http_url}/v2/models/{ENSEMBLE}/generate_stream"
        try:
            with requests.post(url, json=body or self.body(prompt, max_tokens, stream=True), stream=True,
                               timeout=self.timeout) as response:
                if response.status_code != 200:
                    result.error = f"generate_stream returned {response.status_code}: {response.text.strip()[:300]}"
                    return result
                for line in response.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        result.error = str(event["error"])
                        return result
                    text = event.get("text_output", "")
                    result.pieces.append("".join(text) if isinstance(text, list) else text)
                    result.arrival.append(time.perf_counter())
        except (requests.RequestException, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        if not result.error and not result.pieces:
            result.error = "generate_stream ended without any event"
        return result

    # --- gRPC (the bidirectional stream NVIDIA's inflight_batcher_llm_client uses)

    def grpc_inputs(self, values: dict):
        """InferInputs with the ensemble's declared data types (with the batch dimension when it batches)."""
        import tritonclient.grpc as grpcclient

        batched = self.config.get("max_batch_size", 0) > 0
        inputs = []
        for name, value in values.items():
            dtype = self.inputs.get(name, {}).get("data_type", "TYPE_INT32").removeprefix("TYPE_")
            dtype = "BYTES" if dtype == "STRING" else dtype
            array = (np.array([str(value).encode()], dtype=np.object_) if dtype == "BYTES"
                     else np.array([value], dtype=NUMPY_DTYPES[dtype]))
            array = array.reshape(1, 1) if batched else array
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def grpc_stream(self, values: dict) -> StreamResult:
        """Send one request over a gRPC stream and collect its responses until the final one."""
        import tritonclient.grpc as grpcclient

        if not self.server.endpoints.grpc_url:
            raise RequestFailed("no gRPC endpoint known (pass --grpc-url)")
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.server.endpoints.grpc_url)
        result = StreamResult(sent_at=time.perf_counter())
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
            client.async_stream_infer(ENSEMBLE, self.grpc_inputs(values), request_id="validate",
                                      enable_empty_final_response=True)
            deadline = time.monotonic() + self.timeout
            while True:
                res, err, at = events.get(timeout=max(0.1, deadline - time.monotonic()))
                if err is not None:
                    result.error = str(err)
                    break
                text = res.as_numpy("text_output")
                if text is not None and text.size:
                    result.pieces.append("".join(t.decode("utf-8", "replace") for t in text.reshape(-1)))
                    result.arrival.append(at)
                if res.get_response().parameters["triton_final_response"].bool_param:
                    break
        except queue.Empty:
            result.error = f"no final response within {self.timeout:.0f} s"
            result.timed_out = True
        except Exception as exc:  # noqa: BLE001  (grpc raises many types; all mean "the request failed")
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()
        return result


# ----------------------------------------------------------------------------------------------- checks


def check_models_ready(server: TritonServer, repo: Path | None) -> CheckResult:
    response = requests.post(f"{server.http_url}/v2/repository/index", json={}, timeout=30)
    states = {e["name"]: e.get("state", "UNKNOWN") for e in response.json()} if response.ok else {}
    expected = list_repository_models(repo) if repo else sorted(states)
    problems = []
    for name in expected:
        ready = requests.get(f"{server.http_url}/v2/models/{name}/ready", timeout=30).status_code == 200
        if not ready:
            problems.append(f"{name}: {states.get(name, 'not in the server repository')}")
    detail = (f"{len(expected)} models ready: {', '.join(expected)}" if not problems
              else "not ready: " + "; ".join(problems))
    return CheckResult("models_ready", not problems and bool(expected), detail,
                       fix="" if not problems else "see the server log for why the model did not load",
                       data={"states": states})


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    message = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), message)
    return message


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
    problems, compared = [], []
    for name in list_repository_models(repo):
        try:
            expected = parse_config(repo / name / "config.pbtxt")
        except text_format.ParseError as exc:
            problems.append(f"{name}/config.pbtxt does not parse: {exc}")
            continue
        response = requests.get(f"{server.http_url}/v2/models/{name}/config", timeout=30)
        if response.status_code != 200:
            problems.append(f"{name}: the server has no config ({response.status_code})")
            continue
        actual = json_format.ParseDict(response.json(), model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        problems += [f"{name}: {d}" for d in config_differences(expected, actual)]
        compared.append(name)
    detail = (f"server configs of {', '.join(compared)} match their config.pbtxt" if not problems
              else "; ".join(problems))
    return CheckResult("config_matches", not problems, detail,
                       fix="" if not problems else "the server is not serving this repository's configs: restart "
                       "it on this repository, or fix the fields the server rewrote")


def check_golden(client: EnsembleClient, options: ValidateOptions) -> CheckResult:
    reference = options.golden
    if reference is None:
        return CheckResult("golden", False, "no reference model to compare with",
                           fix="pass --golden MODEL (the model the repository was built from)")
    cases, agreements = [], []
    for prompt, expected in zip(options.prompts, reference.complete_all(list(options.prompts), options.max_tokens)):
        try:
            got = client.generate(prompt, options.max_tokens)
        except RequestFailed as exc:
            cases.append({"prompt": prompt, "expected": expected, "error": str(exc)})
            agreements.append(0.0)
            continue
        want, have = reference.tokenize(expected), reference.tokenize(got)
        same = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        case = {"prompt": prompt, "expected": expected, "got": got, "identical": got == expected,
                "agreeing_prefix_tokens": same, "reference_tokens": len(want)}
        if got == expected:
            agreements.append(1.0)
        elif reference.exact:
            agreements.append(same / max(len(want), 1))
        else:
            # One early near-tie sends a quantized model down another path; judge every step instead.
            agree, total = reference.agreement(prompt, got)
            case.update(teacher_forced_agreeing=agree, served_tokens=total)
            agreements.append(agree / total if total else 0.0)
        cases.append(case)
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


def check_streaming(client: EnsembleClient, options: ValidateOptions) -> CheckResult:
    if "stream" not in client.inputs:
        return CheckResult("streaming", False, f"the `{ENSEMBLE}` model has no `stream` input",
                           fix="deploy with streaming enabled (decoupled_mode true)")
    problems, cases = [], []
    for prompt in options.prompts[:2]:
        values = {"text_input": prompt, "max_tokens": options.max_tokens, "stream": True}
        values.update({k: v for k, v in (("top_k", 1), ("exclude_input_in_output", True)) if k in client.inputs})
        try:
            streamed = client.grpc_stream(values)
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
                       fix="" if passed else "streaming needs decoupled transaction policy on tensorrt_llm (and BLS) "
                       "and a postprocessing that detokenizes each response's new tokens")


def check_http_generate(client: EnsembleClient, options: ValidateOptions) -> CheckResult:
    prompt = options.prompts[0]
    nvidia_body = {"text_input": prompt, "max_tokens": options.max_tokens, "bad_words": "", "stop_words": ""}
    problems = []
    try:
        plain = client.generate(prompt, options.max_tokens, body=nvidia_body)
        if not plain.strip():
            problems.append("generate returned an empty text_output")
    except RequestFailed as exc:
        plain = None
        problems.append(str(exc))
    streamed = client.generate_stream(prompt, options.max_tokens, body={**nvidia_body, "stream": True})
    if streamed.error:
        problems.append(f"generate_stream: {streamed.error}")
    elif plain is not None and streamed.text != plain:
        problems.append(f"generate_stream joined {streamed.text!r} != generate {plain!r}")
    passed = not problems
    detail = (f"generate -> {plain!r}; generate_stream: {len(streamed.pieces)} events, same text" if passed
              else "; ".join(problems))
    return CheckResult("http_generate", passed, detail, data={"body": nvidia_body},
                       fix="" if passed else "clients of NVIDIA's deployments send this JSON; every ensemble input "
                       "it names must exist with NVIDIA's data types")


@dataclass(frozen=True)
class BadRequest:
    name: str
    body: dict
    via: str = "generate"  # or "grpc" (the HTTP infer endpoint refuses decoupled models for any request)


def bad_requests(prompt: str) -> list[BadRequest]:
    return [
        BadRequest("empty text_input", {"text_input": "", "max_tokens": 8}),
        BadRequest("max_tokens 0", {"text_input": prompt, "max_tokens": 0}),
        BadRequest("max_tokens far beyond the context", {"text_input": prompt, "max_tokens": 10_000_000}),
        BadRequest("max_tokens of the wrong type", {"text_input": prompt, "max_tokens": "sixteen"}),
        BadRequest("text_input of the wrong type", {"text_input": 12345, "max_tokens": 8}),
        BadRequest("missing max_tokens", {"text_input": prompt}),
        BadRequest("unknown input", {"text_input": prompt, "max_tokens": 8, "no_such_input": 1}, via="grpc"),
    ]


def send_bad_request(client: EnsembleClient, bad: BadRequest) -> tuple[bool, str]:
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


def check_bad_requests(client: EnsembleClient, options: ValidateOptions) -> CheckResult:
    outcomes, accepted = [], []
    for bad in bad_requests(options.prompts[0]):
        rejected, answer = send_bad_request(client, bad)
        outcomes.append({"request": bad.name, "rejected": rejected, "answer": answer})
        if not rejected:
            accepted.append(f"{bad.name}: {answer}")
    healthy = client.server.is_alive() and client.server.is_healthy()
    try:
        still_serves = bool(client.generate(options.prompts[0], 4))
    except RequestFailed as exc:
        still_serves = False
        accepted.append(f"a good request after the bad ones failed: {exc}")
    passed = not accepted and healthy and still_serves
    detail = (f"all {len(outcomes)} bad requests rejected; server healthy and serving afterwards" if passed else
              "; ".join(accepted + ([] if healthy else ["the server is no longer healthy"])))
    return CheckResult("bad_requests", passed, detail, data={"outcomes": outcomes, "healthy_after": healthy},
                       fix="" if passed else "validate inputs in preprocessing / tensorrt_llm and answer with an "
                       "error response (never crash the model or hang)")


# -------------------------------------------------------------------------------------------- load test


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def run_level(client: EnsembleClient, prompts: tuple[str, ...], max_tokens: int, concurrency: int,
              requests_per_client: int) -> dict:
    """`concurrency` clients each sending `requests_per_client` streamed requests back to back."""
    total = concurrency * requests_per_client
    jobs = [prompts[i % len(prompts)] for i in range(total)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: client.generate_stream(p, max_tokens), jobs))
    wall = time.perf_counter() - start
    done = [r for r in results if not r.error and r.arrival]
    tokens = sum(len(r.pieces) for r in done)
    return {
        "concurrency": concurrency, "requests": total, "completed": len(done), "lost": total - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5], "wall_s": wall,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "itl_ms": percentiles([d for r in done for d in r.inter_token]),
        "latency_ms": percentiles([r.latency for r in done]),
    }


def plot_load_test(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(x, [lv["output_tokens_per_s"] for lv in levels], "o-")
    ax1.set(xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    for metric in ("ttft_ms", "latency_ms"):
        for q, style in (("p50", "o-"), ("p99", "x--")):
            ax2.plot(x, [lv[metric][q] or 0 for lv in levels], style, label=f"{metric[:-3]} {q}")
    ax2.set(xlabel="concurrent clients", ylabel="ms", title="latency", yscale="log")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_load_test(client: EnsembleClient, options: ValidateOptions, out_dir: Path) -> CheckResult:
    from rich.progress import Progress

    levels = []
    with Progress(transient=True) as progress:
        task = progress.add_task("load test", total=len(options.concurrencies))
        for concurrency in options.concurrencies:
            levels.append(run_level(client, options.prompts, options.max_tokens, concurrency,
                                    options.requests_per_client))
            progress.advance(task)
    (out_dir / "load_test.json").write_text(json.dumps(levels, indent=2) + "\n")
    plot_load_test(levels, out_dir / "load_test.png")
    lost = sum(lv["lost"] for lv in levels)
    best = max(levels, key=lambda lv: lv["output_tokens_per_s"])
    detail = (f"{sum(lv['requests'] for lv in levels)} requests at concurrency {list(options.concurrencies)}, "
              f"{lost} lost; best {best['output_tokens_per_s']:.1f} output tokens/s at concurrency "
              f"{best['concurrency']} (TTFT p50 {best['ttft_ms']['p50']:.0f} ms, ITL p50 "
              f"{(best['itl_ms']['p50'] or 0):.1f} ms)" if best["completed"] else f"all {lost} requests lost")
    errors = sorted({e for lv in levels for e in lv["errors"]})
    if errors:
        detail += f"; errors: {errors[:3]}"
    return CheckResult("load_test", lost == 0, detail, data={"levels": levels},
                       fix="" if lost == 0 else "requests were dropped or failed under load: raise max_queue_size, "
                       "check the server log for errors under concurrency")


# ------------------------------------------------------------------------------------------------- stage


def run_checks(server: TritonServer, repo: Path | None, options: ValidateOptions, out_dir: Path,
               progress: Callable[[str], None] = lambda name: None) -> list[CheckResult]:
    checks = [check_models_ready(server, repo)]
    if not checks[0].passed:
        return checks
    checks.append(check_config_matches(server, repo))
    client = EnsembleClient(server, options.request_timeout)
    steps = [("golden", check_golden), ("streaming", check_streaming), ("http_generate", check_http_generate),
             ("bad_requests", check_bad_requests)]
    for name, check in steps:
        progress(name)
        checks.append(check(client, options))
    if options.load_test:
        progress("load_test")
        checks.append(check_load_test(client, options, out_dir))
    return checks


def validate_repository(repo: Path | None, out: Path, options: ValidateOptions | None = None, *,
                        url: str | None = None, grpc_url: str | None = None, ready_timeout: float = 600.0,
                        progress: Callable[[str], None] = lambda name: None) -> ValidationReport:
    """Serve `repo` (or use the server at `url`), run every check and write report.json into `out`."""
    options = options or ValidateOptions()
    repo = Path(repo).resolve() if repo is not None else None
    if repo is not None and not repo.is_dir():
        raise UserError(f"model repository {repo} does not exist or is not a directory")
    if url is None and repo is None:
        raise UserError("give a model repository to serve, or --url of a running server")
    with atomic_output_dir(Path(out)) as tmp:
        progress("starting the server" if url is None else f"connecting to {url}")
        server_context = (connect(url, grpc_url=grpc_url or default_grpc_url(url), ready_timeout=ready_timeout)
                          if url else embedded_server(repo, log_path=tmp / "server.log", ready_timeout=ready_timeout))
        with server_context as server:
            checks = run_checks(server, repo, options, tmp, progress)
        report = ValidationReport(repo=str(repo) if repo else "", server=url or server.http_url, checks=checks,
                                  log_path=str(Path(out).resolve() / "server.log") if url is None else None)
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def default_grpc_url(http_url: str) -> str:
    """Triton's convention: gRPC on the HTTP port + 1 of the same host."""
    host_port = http_url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    return f"{host}:{int(port) + 1}" if port.isdigit() else f"{host_port}:8001"


# ------------------------------------------------------------------------------------ golden reference


def golden_spec_from_repo(repo: Path) -> tuple[str | None, bool]:
    """(model spec, exact) recorded by deploy: the plan's model when it is not a bare checkpoint."""
    try:
        manifest = json.loads((repo / "manifest.json").read_text())
        plan = json.loads(Path(manifest["plan"]).read_text())
    except (OSError, KeyError, ValueError, TypeError):
        return None, True
    model = plan.get("model", {})
    exact = plan.get("precision") not in ("fp8", "int8-sq")
    if model.get("source") in (None, "checkpoint", "arch"):
        return None, exact
    return model.get("path") or model.get("name"), exact



def reference_for(repo: Path | None, golden: str | None, device: str = "auto") -> GoldenReference | None:
    """The golden reference: --golden MODEL, else the model recorded in the repository's plan, else None."""
    from .golden import GoldenReference as StreamedReference

    spec, exact = golden_spec_from_repo(Path(repo)) if repo else (None, True)
    spec = golden or spec
    dtype = served_checkpoint_dtype(Path(repo)) if repo else "float32"
    return StreamedReference.from_spec(spec, exact=exact, weights_dtype=dtype, device=device) if spec else None


def served_checkpoint_dtype(repo: Path) -> str:
    """The weight dtype of the checkpoint a cpu-target repository serves (float32 when unknown)."""
    try:
        dtype = json.loads((repo / "tensorrt_llm" / "1" / "checkpoint" / "config.json").read_text())["dtype"]
    except (OSError, KeyError, ValueError, TypeError):
        return "float32"
    return dtype if dtype in ("float16", "bfloat16", "float32") else "float32"


def render_report(report: ValidationReport, out: Path) -> str:
    """The human-readable verdict: one line per check, and what to fix for each failure."""
    lines = [f"validated {report.repo or report.server} on {report.server}"]
    for check in report.checks:
        lines.append(f"  {'PASS' if check.passed else 'FAIL'}  {check.name:<15} {check.detail}")
        if not check.passed and check.fix:
            lines.append(f"        fix: {check.fix}")
    verdict = "all checks passed" if report.passed else \
        f"{sum(not c.passed for c in report.checks)} of {len(report.checks)} checks failed"
    lines.append(f"{verdict}; report: {Path(out) / 'report.json'}")
    return "\n".join(lines)
