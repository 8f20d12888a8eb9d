"""`trtpipe validate --url URL --api openai` (pipeline/validate/openai.py) against a stand-in server.

No real trtllm-serve or vLLM ran here: neither runs on this CPU-only machine and no OpenAI-compatible server
installs offline. The server below is a tiny stdlib http.server fixture that speaks only the documented wire
format (/v1/completions, /v1/chat/completions, `stream` -> `data: {json}` server-sent events ending with
`data: [DONE]`, /v1/models, /health); its "model" completes a prompt with its words in reverse order. One
server per module; tests switch its faults on (`Fixture.faults`) to show each check catching its fault.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from click.testing import CliRunner

import pipeline.validate
from support.http import JsonHandler
from pipeline.cli import main
from pipeline.validate import ValidateOptions
from pipeline.validate.openai import validate_openai

MODEL = "tiny-reverse"
PROMPTS = ("w1 w2 w3", "a b")


def complete(prompt: str, max_tokens: int) -> list[str]:
    words = prompt.split()[::-1] or ["?"]
    return [" " + words[i % len(words)] for i in range(max_tokens)]


class ReverseReference:
    """The golden reference of the fixture's model."""

    name, exact = "reverse", True

    def complete_all(self, prompts, max_tokens):
        return ["".join(complete(p, max_tokens)) for p in prompts]

    def tokenize(self, text):
        return text.split()


class Fixture(JsonHandler):
    faults: set[str] = set()  # "no_done", "lax_top_p"

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {})
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def refusal(self, body: dict) -> str | None:
        chat = self.path == "/v1/chat/completions"
        if body.get("model") != MODEL:
            return f"model {body.get('model')!r} does not exist"
        if not isinstance(body.get("messages" if chat else "prompt"), list if chat else str):
            return "messages is required" if chat else "prompt is required"
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            return "max_tokens must be an integer >= 1"
        if body.get("temperature", 1.0) < 0:
            return "temperature must be non-negative"
        if not 0 < body.get("top_p", 1.0) <= 1 and "lax_top_p" not in self.faults:
            return "top_p must be in (0, 1]"
        return None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self.reply(404, {"error": {"message": "not found"}})
        error = self.refusal(body)
        if error:
            return self.reply(400, {"error": {"message": error, "type": "BadRequestError"}})
        chat = self.path == "/v1/chat/completions"
        tokens = complete(body["messages"][-1]["content"] if chat else body["prompt"], body["max_tokens"])
        if not body.get("stream"):
            choice = ({"message": {"role": "assistant", "content": "".join(tokens)}} if chat
                      else {"text": "".join(tokens)})
            return self.reply(200, {"object": "chat.completion" if chat else "text_completion",
                                    "choices": [{"index": 0, **choice, "finish_reason": "length"}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = ([{"delta": {"role": "assistant"}}] if chat else []) + \
            [{"delta": {"content": t}} if chat else {"text": t} for t in tokens]
        for i, chunk in enumerate(chunks):
            event = {"choices": [{**chunk, "finish_reason": "length" if i == len(chunks) - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        if "no_done" not in self.faults:
            self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fixture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def faults():
    yield Fixture.faults
    Fixture.faults.clear()


def run(url, tmp_path, **kwargs):
    options = ValidateOptions(prompts=PROMPTS, max_tokens=5, golden=ReverseReference())
    report = validate_openai(url, tmp_path / "out", options, **kwargs)
    return {c.name: c for c in report.checks}, report


def test_the_cli_validates_an_openai_server(url, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline.validate, "reference_for", lambda repo, golden, device: ReverseReference())
    result = CliRunner().invoke(main, ["validate", "--url", url + "/v1", "--api", "openai", "--max-tokens", "4",
                                       "-o", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["health", "golden", "streaming", "chat", "bad_requests"] and report["passed"]
    assert checks["golden"]["data"]["cases"][0]["got"] == " is France of capital"
    assert checks["chat"]["data"]["chunks"] == 4 and checks["chat"]["data"]["content"].startswith(" is France")
    assert all(c["responses"] == 4 for c in checks["streaming"]["data"]["cases"])
    outcomes = checks["bad_requests"]["data"]["outcomes"]
    assert len(outcomes) == 5 and all(o["rejected"] and o["answer"].startswith("400") for o in outcomes)


def test_a_stream_without_done_fails_streaming_and_chat(url, tmp_path, faults):
    faults.add("no_done")
    checks, report = run(url, tmp_path)
    assert not report.passed and [n for n, c in checks.items() if not c.passed] == ["streaming", "chat"]
    assert "without `data: [DONE]`" in checks["streaming"].detail and "[DONE]" in checks["chat"].detail


def test_an_accepted_out_of_range_top_p_fails_bad_requests(url, tmp_path, faults):
    faults.add("lax_top_p")
    checks, _ = run(url, tmp_path)
    assert [n for n, c in checks.items() if not c.passed] == ["bad_requests"]
    assert checks["bad_requests"].detail.startswith("top_p above 1: accepted with 200")


def test_a_model_the_server_does_not_list_fails_health(url, tmp_path):
    checks, _ = run(url, tmp_path, model="no-such-model")
    assert list(checks) == ["health"] and "not 'no-such-model'" in checks["health"].detail


@pytest.mark.parametrize("args,message", [
    (["--api", "openai"], "give a model repository to serve, or --url"),
    (["--api", "openai", "--url", "http://x:1", "--load-test"], "['--load-test']"),
    (["repo", "--model", "m"], "pass it with --api openai"),
    ([], "give a model repository to serve, or --url"),
    (["--api", "openai", "--url", "http://127.0.0.1:9"], "does not answer an OpenAI model list"),
])
def test_bad_options_exit_2_with_one_message(args, message, tmp_path):
    result = CliRunner().invoke(main, ["validate", *args, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output, result.output
