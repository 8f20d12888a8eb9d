"""`trtpipe serve` stops by draining (pipeline/serve.py), run for real on a tiny cpu repository: new requests are
refused, the accepted streams finish (or end with an error event past --drain-timeout, exit 1), and nothing of the
server is left: no process of its group, no shared-memory region."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from support.models import deploy_tiny_cpu_repo

TOKENS = 1200


@pytest.fixture(scope="module")
def repo(tiny_llama, tmp_path_factory) -> Path:
    return deploy_tiny_cpu_repo(tiny_llama("gqa"), tmp_path_factory.mktemp("drain"))


def stream(url: str, out: list) -> None:
    """One streamed request of TOKENS tokens: (status, events, error)."""
    events, error, status = 0, None, None
    body = {"text_input": " w5 w6", "max_tokens": TOKENS, "min_tokens": TOKENS, "stream": True}
    try:
        with requests.post(f"{url}/v2/models/ensemble/generate_stream", json=body, stream=True, timeout=120) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    data = json.loads(line[5:])
                    error = data.get("error", error)
                    events += "error" not in data
    except requests.RequestException as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.append((status, events, error))


def start_serve(repo: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def serving_url(process: subprocess.Popen) -> str:
    """The HTTP URL `trtpipe serve` prints once every model is ready."""
    lines = []
    while "Ctrl-C to stop" not in "".join(lines) and process.poll() is None:
        lines.append(process.stdout.readline())
    return re.search(r"HTTP\s+(\S+)", "".join(lines)).group(1)


def server_processes(repo: Path) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if str(repo) in line and "pytest" not in line]


@pytest.mark.slow
@pytest.mark.parametrize("drain_timeout", [60, 0.1])
def test_serve_drains_on_sigterm(repo, drain_timeout):
    shm_before = set(Path("/dev/shm").iterdir())
    process = start_serve(repo, "--drain-timeout", str(drain_timeout))
    try:
        url = serving_url(process)
        results: list = []
        clients = [threading.Thread(target=stream, args=(url, results)) for _ in range(4)]
        for client in clients:
            client.start()
        # every stream under way, and far from its end: on a fast machine 4 streams of TOKENS tokens finished within
        # 1.5 s + a 0.5 s drain, so the short drain cut none
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = requests.post(f"{url}/v2/models/ensemble/generate", json={"text_input": " w5", "max_tokens": 2},
                                 timeout=30)
        except requests.ConnectionError:     # the short drain may be over and the server gone 0.3 s after SIGTERM
            late = None
        for client in clients:
            client.join(120)
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    # a request after SIGTERM is refused while the server drains; after a short drain it may find no server at all
    assert (late is None and drain_timeout < 1) or (late.status_code != 200 and "shutting down" in late.text)
    assert len(results) == 4
    if drain_timeout == 60:
        assert process.returncode == 0, rest
        assert "every request answered" in rest
        assert all(events == TOKENS and error is None for _, events, error in results), results
    else:
        assert process.returncode == 1, rest
        assert "ended with an error" in rest
        # a stream cut before its first token is an HTTP error; one cut later ends with an error event
        cut = [(status, error) for status, events, error in results if events < TOKENS]
        assert cut and all("the server shut down before this request finished" in error for _, error in cut)
        assert all(status == 200 for status, events, _ in results if events)
    assert not server_processes(repo)
    assert not {p for p in set(Path("/dev/shm").iterdir()) - shm_before if p.name.startswith("trtpipe_")}


# ---------------------------------------------------------------------------------------- a model that died

class Answer:
    def __init__(self, status: int, body: dict):
        self.status_code, self._body, self.text = status, body, json.dumps(body)

    def json(self) -> dict:
        return self._body


@pytest.mark.parametrize("outcome, problem", [
    (Answer(200, {"text_output": "x"}), None),
    (Answer(400, {"error": "in ensemble 'ensemble', Stub process 'tensorrt_llm_0_0' is not healthy."}),
     "Stub process 'tensorrt_llm_0_0' is not healthy"),
    (Answer(400, {"error": "Exceeds maximum queue size"}), None),            # shed: busy, alive
    # no model answered: Triton says so with HTTP 200 (docs/upstream-facts.md §C)
    (Answer(200, {"error": "generate expects model to produce exactly 1 response, use generate stream for model "
                           "that generates various number of responses"}),
     "answered 200 without a text_output: {\"error\": \"generate expects model to produce exactly 1 response"),
    (Answer(400, {"error": "the server is shutting down and accepts no new requests"}), None),
    (requests.Timeout("slow"), None),
    (requests.ConnectionError("refused"), "does not answer"),
])
def test_the_liveness_request_tells_a_dead_model_from_a_busy_one(monkeypatch, outcome, problem):
    from pipeline.serve import model_problem

    def post(url, json, timeout):
        assert url.endswith("/v2/models/ensemble/generate") and json["max_tokens"] == 1
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr("pipeline.serve.requests.post", post)
    found = model_problem("http://server:8000")
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.slow
def test_serve_stops_when_a_models_process_dies_and_probe_says_so(repo, monkeypatch):
    """kill -9 of the tensorrt_llm model's stub: Triton keeps /v2/health/ready at 200 and answers every request
    "Stub process ... is not healthy" without restarting it; trtpipe probe exits 1 and serve stops with exit 1."""
    process = start_serve(repo)
    try:
        url = serving_url(process)
        assert subprocess.run([sys.executable, "-m", "pipeline.cli", "probe", "--url", url]).returncode == 0
        stub = next(line.split()[0] for line in subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True,
                                                               text=True).stdout.splitlines()
                    if "triton_python_backend_stub" in line and f"{repo}/tensorrt_llm/" in line)
        subprocess.run(["kill", "-9", stub], check=True)
        time.sleep(1)
        assert requests.get(f"{url}/v2/health/ready", timeout=10).status_code == 200   # Triton's view
        probed = subprocess.run([sys.executable, "-m", "pipeline.cli", "probe", "--url", url],
                                capture_output=True, text=True)
        assert probed.returncode == 1 and "is not healthy" in probed.stderr
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1 and "a served model stopped working" in rest
    assert not server_processes(repo)
