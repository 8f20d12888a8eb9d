"""validate over the OpenAI-compatible API of trtllm-serve or vLLM (`trtpipe validate --url URL --api openai`).

Only the documented wire format is used: POST /v1/completions and /v1/chat/completions (JSON bodies with
`model`, `prompt` or `messages`, `max_tokens`, `temperature`, `stream`), answers with `choices[0].text` /
`choices[0].message.content` and `finish_reason`; with `stream` true, server-sent events, one `data: {json}`
line per chunk (`choices[0].text` / `choices[0].delta.content`) and a last `data: [DONE]`; GET /v1/models
(`data[].id`) and GET /health (200 when ready). Greedy is `temperature` 0.

Checks:
  health         /health answers 200 and /v1/models lists the model (--model, default the first listed)
  golden         greedy /v1/completions equal the reference's completions (the shared check)
  streaming      streamed /v1/completions arrive in several chunks, end with [DONE] and join to the
                 non-streamed text (the shared check)
  chat           /v1/chat/completions answers non-empty content with a finish_reason, and streamed, the
                 deltas end with [DONE] and join to the non-streamed content
  bad_requests   malformed bodies and out-of-range sampling values get 4xx answers (the sampling ones naming
                 the field), and the server is healthy and serving afterwards (the shared check)
No metrics check: trtllm-serve's /metrics is JSON iteration statistics and vLLM's Prometheus names differ.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import requests

from ..errors import UserError
from ..outputs import atomic_output_dir
from .checks import BadRequest, check_bad_requests, check_golden, check_streaming
from .client import RequestFailed, StreamResult
from .report import CheckResult, ValidateOptions, ValidationReport

DONE = "[DONE]"


class OpenAIClient:
    """Requests to an OpenAI-compatible server, greedy, as the shared checks ask them (`checks.Completions`)."""

    streaming_fix = ("the server must send one `data: {json}` server-sent event per chunk and end the stream with "
                     "`data: [DONE]`")
    #: the request fields the bad requests set out of range (all part of the OpenAI completions API)
    inputs = frozenset({"max_tokens", "temperature", "top_p"})

    def __init__(self, url: str, model: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/").removesuffix("/v1")
        if not self.url.startswith(("http://", "https://")):
            self.url = f"http://{self.url}"
        self.timeout = timeout
        try:
            response = requests.get(f"{self.url}/v1/models", timeout=30)
            self.listed = [m["id"] for m in response.json()["data"]] if response.status_code == 200 else []
        except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{self.url}/v1/models does not answer an OpenAI model list ({type(exc).__name__}); "
                            "is --url an OpenAI-compatible server (trtllm-serve, vllm serve)?") from None
        if response.status_code != 200 or not (model or self.listed):
            raise UserError(f"{self.url}/v1/models answered {response.status_code} with no model: "
                            f"{response.text[:200]}")
        self.model = model or self.listed[0]

    def post(self, path: str, body: dict, stream: bool = False) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, timeout=self.timeout, stream=stream)

    def post_generate(self, body: dict) -> requests.Response:
        return self.post("/v1/completions", body)

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False

    def body(self, max_tokens: int, **fields) -> dict:
        return {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, **fields}

    def answer(self, path: str, body: dict) -> dict:
        """choices[0] of a non-streamed answer; RequestFailed with the server's message."""
        try:
            response = self.post(path, body)
        except requests.RequestException as exc:
            raise RequestFailed(f"{path} got no response ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise RequestFailed(f"{path} answered {response.status_code}: {response.text.strip()[:300]}")
        try:
            return response.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RequestFailed(f"{path} answered without choices[0]: {response.text[:300]}") from None

    def generate(self, prompt: str, max_tokens: int) -> str:
        text = self.answer("/v1/completions", self.body(max_tokens, prompt=prompt)).get("text")
        if not isinstance(text, str):
            raise RequestFailed("/v1/completions answered without a choices[0].text string")
        return text

    def chat(self, content: str, max_tokens: int) -> dict:
        """choices[0] of a one-message chat: {"message": {"content": ...}, "finish_reason": ...}."""
        return self.answer("/v1/chat/completions",
                           self.body(max_tokens, messages=[{"role": "user", "content": content}]))

    def stream_events(self, path: str, body: dict, piece: Callable[[dict], str | None]) -> StreamResult:
        """POST with `stream` true and read the server-sent events until `data: [DONE]`, timing each piece."""
        result = StreamResult(sent_at=time.perf_counter())
        done = False
        try:
            with self.post(path, {**body, "stream": True}, stream=True) as response:
                if response.status_code != 200:
                    result.error = f"{path} answered {response.status_code}: {response.text.strip()[:300]}"
                    return result
                for line in response.iter_lines(decode_unicode=True):
                    if not line or not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == DONE:
                        done = True
                        break
                    choice = (json.loads(data).get("choices") or [{}])[0]
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    text = piece(choice)
                    if text:
                        result.pieces.append(text)
                        result.arrival.append(time.perf_counter())
        except (requests.RequestException, ValueError, AttributeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        if not done:
            result.error = f"the stream ended without `data: {DONE}`"
        return result

    def stream(self, prompt: str, max_tokens: int) -> StreamResult:
        return self.stream_events("/v1/completions", self.body(max_tokens, prompt=prompt), lambda c: c.get("text"))

    generate_stream = stream    # the load generator's name (`load_test.StreamingClient`)

    def chat_stream(self, content: str, max_tokens: int) -> StreamResult:
        body = self.body(max_tokens, messages=[{"role": "user", "content": content}])
        return self.stream_events("/v1/chat/completions", body, lambda c: (c.get("delta") or {}).get("content"))


def openai_bad_requests(prompt: str, model: str) -> list[BadRequest]:
    """Bodies every OpenAI-compatible server must refuse on /v1/completions (the OpenAI API's ranges)."""
    good = {"model": model, "prompt": prompt, "max_tokens": 8}
    return [
        BadRequest("missing prompt", {"model": model, "max_tokens": 8}),
        BadRequest("max_tokens 0", {**good, "max_tokens": 0}, parameter="max_tokens"),
        BadRequest("max_tokens of the wrong type", {**good, "max_tokens": "sixteen"}),
        BadRequest("negative temperature", {**good, "temperature": -0.5}, parameter="temperature"),
        BadRequest("top_p above 1", {**good, "top_p": 1.5}, parameter="top_p"),
    ]


def check_health(client: OpenAIClient) -> CheckResult:
    problems = [] if client.healthy() else [f"{client.url}/health does not answer 200"]
    if client.model not in client.listed:
        problems.append(f"/v1/models lists {client.listed}, not {client.model!r}")
    return CheckResult("health", not problems, "; ".join(problems) or
                       f"/health 200; /v1/models lists {client.model!r}", data={"models": client.listed},
                       fix="" if not problems else "pass --model with a name /v1/models lists, or wait for the "
                       "server to finish loading")


def check_chat(client: OpenAIClient, options: ValidateOptions) -> CheckResult:
    content, problems = options.prompts[0], []
    try:
        whole = client.chat(content, options.max_tokens)
    except RequestFailed as exc:
        whole = {}
        problems.append(str(exc))
    text = (whole.get("message") or {}).get("content") if whole else None
    if whole and not (isinstance(text, str) and text.strip()):
        problems.append("choices[0].message.content is empty or missing")
    if whole and not whole.get("finish_reason"):
        problems.append("choices[0].finish_reason is missing")
    streamed = client.chat_stream(content, options.max_tokens)
    if streamed.error:
        problems.append(f"streamed: {streamed.error}")
    elif text is not None and streamed.text != text:
        problems.append(f"streamed deltas joined {streamed.text!r} != non-streamed {text!r}")
    detail = "; ".join(problems) or (f"{text!r} ({whole['finish_reason']}); streamed in {len(streamed.pieces)} "
                                     "chunks, same content")
    return CheckResult("chat", not problems, detail, data={"content": text, "chunks": len(streamed.pieces)},
                       fix="" if not problems else "the chat endpoint must apply the model's chat template and "
                       "answer the documented JSON (choices[0].message / choices[0].delta)")


def run_openai_checks(client: OpenAIClient, options: ValidateOptions,
                      progress: Callable[[str], None] = lambda name: None) -> list[CheckResult]:
    checks = [check_health(client)]
    if not checks[0].passed:
        return checks
    steps = [("golden", check_golden), ("streaming", check_streaming), ("chat", check_chat),
             ("bad_requests", lambda c, o: check_bad_requests(c, o, openai_bad_requests(o.prompts[0], c.model)))]
    for name, check in steps:
        progress(name)
        checks.append(check(client, options))
    return checks


def validate_openai(url: str, out: Path, options: ValidateOptions, *, model: str | None = None,
                    progress: Callable[[str], None] = lambda name: None) -> ValidationReport:
    """Run the OpenAI checks against the server at `url` and write report.json into `out`."""
    client = OpenAIClient(url, model, options.request_timeout)
    with atomic_output_dir(Path(out)) as tmp:
        progress(f"connecting to {client.url} ({client.model})")
        report = ValidationReport(repo="", server=client.url, checks=run_openai_checks(client, options, progress))
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def validate_openai_repository(repo: Path, out: Path, options: ValidateOptions, *, ready_timeout: float = 600.0,
                               progress: Callable[[str], None] = lambda name: None) -> ValidationReport:
    """Serve `repo` in the embedded server with trtpipe's OpenAI front over it (`pipeline.openai_front`), run the
    OpenAI checks through the front and write report.json (and the server's log) into `out`."""
    from ..openai_front.app import OpenAIFront
    from ..server import embedded_server

    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise UserError(f"model repository {repo} does not exist or is not a directory")
    with atomic_output_dir(Path(out)) as tmp:
        progress("starting the server and the OpenAI front")
        with embedded_server(repo, log_path=tmp / "server.log", ready_timeout=ready_timeout) as server, \
                OpenAIFront(repo, server.http_url, port=0) as front:
            client = OpenAIClient(front.url, None, options.request_timeout)
            checks = run_openai_checks(client, options, progress)
        report = ValidationReport(repo=repo.name, server="the OpenAI front (trtpipe serve --openai)", checks=checks)
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report
