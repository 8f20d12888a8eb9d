"""`trtpipe serve`: the embedded Triton server in the foreground, and how it stops: it drains first.

Triton's own graceful shutdown (SIGINT/SIGTERM: stop accepting, wait up to --exit-timeout-secs for in-flight
inferences, unload) does not wait for the cpu target's streams: Triton 2.51 counts a decoupled Python model's
request as in flight only until its `execute` returns, and the cpu model returns at once and generates on its own
thread. It logged "Found 0 model versions that have in-flight inferences" with 8 streams running, unloaded the
ensemble first, and every stream ended with HTTP 200 after its first event, as if complete (docs/upstream-facts.md).

So serve drains first, through the drain file it named in the server's environment (`host.DRAIN_FILE_ENV`):

1. it writes DRAINING: the cpu model refuses new requests (503, "the server is shutting down") and finishes the
   ones it accepted;
2. it waits until the model's live-request gauge on /metrics (`host.LIVE_REQUESTS_METRIC`) is 0, for at most
   the drain timeout;
3. past it, it writes CANCELLING: each running request ends at its next token with an error event (never a
   clean end), and serve waits for the gauge to reach 0 again (CANCEL_WAIT_S);

and then stops Triton (pipeline.server.stop_server: SIGINT, the process group's leftovers, the shared memory).
A repository without the gauge (NVIDIA's models, a GPU engine) is stopped as Triton stops it.
"""

from __future__ import annotations

import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import requests

from .errors import UserError
from .host import CANCELLING, DRAINING, LIVE_REQUESTS_METRIC
from .server import STOP_TIMEOUT_S, TritonServer, embedded_server
from .triton_names import ENSEMBLE, TEXT_OUTPUT
from .validate.metrics import parse_samples

#: how often `trtpipe serve` sends its liveness request (`model_problem`)
LIVENESS_PERIOD_S = 30.0
#: what Triton's Python backend answers for a model whose process died; it does not start it again (2.51: the
#: server and the model stay "ready" while every request gets this; docs/upstream-facts.md)
DEAD_STUB = "is not healthy"
#: how long `trtpipe serve` lets accepted requests finish when it stops (--drain-timeout)
DRAIN_TIMEOUT_S = 30.0
#: how long the running requests get to end with their error once the drain timeout passed
CANCEL_WAIT_S = 10.0
POLL_S = 0.2


@dataclass(frozen=True)
class Drained:
    """How the drain ended: requests still live when the timeout passed (ended with an error), or None when
    the server reports no live requests (a model without the gauge)."""

    cut: int | None
    waited_s: float

    @property
    def clean(self) -> bool:
        return not self.cut


def live_requests(metrics_url: str | None) -> int | None:
    """The sum of LIVE_REQUESTS_METRIC over the server's models; None when it is not exported."""
    if not metrics_url:
        return None
    try:
        text = requests.get(f"{metrics_url}/metrics", timeout=5).text
    except requests.RequestException:
        return None
    values = [value for name, _, value in parse_samples(text) if name == LIVE_REQUESTS_METRIC]
    return int(sum(values)) if values else None


def wait_for_no_live(server: TritonServer, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    live = live_requests(server.endpoints.metrics_url)
    while live and time.monotonic() < deadline and server.is_alive():
        time.sleep(POLL_S)
        live = live_requests(server.endpoints.metrics_url)
    return live


def drain(server: TritonServer, timeout_s: float, echo: Callable[[str], None] = print) -> Drained:
    """Refuse new requests, let the accepted ones finish for up to `timeout_s`, then end the rest with an error."""
    start = time.monotonic()
    if server.drain_file is None or live_requests(server.endpoints.metrics_url) is None:
        return Drained(None, 0.0)
    server.drain_file.write_text(DRAINING)
    live = live_requests(server.endpoints.metrics_url)
    if live:
        echo(f"draining: {live} request(s) in flight, new ones refused (up to {timeout_s:g} s)")
    live = wait_for_no_live(server, timeout_s)
    if not live:
        return Drained(0, time.monotonic() - start)
    echo(f"drain timeout: ending the {live} request(s) still running with an error")
    server.drain_file.write_text(CANCELLING)
    wait_for_no_live(server, CANCEL_WAIT_S)
    return Drained(live, time.monotonic() - start)


def model_problem(http_url: str, timeout: float = 60.0) -> str | None:
    """Whether the served models still work, by a one-token request through the ensemble: None when it is
    answered with a text_output, shed or refused (a busy or draining server is alive) or slow; what is wrong when
    a model's process died, the server does not answer, or it answers 200 without a text_output (Triton's answer
    when no model answered: an error in a 200 body; docs/upstream-facts.md §C). Triton's own health endpoints say
    200 in all these cases."""
    try:
        response = requests.post(f"{http_url}/v2/models/ensemble/generate",
                                 json={"text_input": "ping", "max_tokens": 1}, timeout=timeout)
    except requests.Timeout:
        return None
    except requests.RequestException as exc:
        return f"the server does not answer at {http_url} ({type(exc).__name__})"
    if response.status_code == 200 and TEXT_OUTPUT not in json_body(response):
        return f"the {ENSEMBLE} answered 200 without a {TEXT_OUTPUT}: {response.text.strip()[:300]}"
    if response.status_code != 200 and DEAD_STUB in response.text:
        return json_body(response).get("error", response.text.strip())
    return None


def json_body(response: requests.Response) -> dict:
    """A response's JSON object; {} for any other body."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def watch(server: TritonServer, period_s: float = LIVENESS_PERIOD_S) -> None:
    """Until the server exits: every `period_s` the liveness request; a model that stopped working stops serve
    (a RuntimeError, exit 1) so that whatever supervises it starts it again."""
    checks = ENSEMBLE in server.models
    next_check = time.monotonic() + period_s
    while server.is_alive():
        time.sleep(0.5)
        if checks and time.monotonic() >= next_check:
            problem = model_problem(server.http_url)
            if problem:
                raise RuntimeError(f"a served model stopped working: {problem}. Triton does not restart a Python "
                                   "model whose process died, so serve stops; start it again")
            next_check = time.monotonic() + period_s


def serve_forever(repo: Path, *, http_port: int | None, host: str, log_path: Path | None, ready_timeout: float,
                  model_control: str = "none", drain_timeout: float = DRAIN_TIMEOUT_S,
                  openai_port: int | None = None, echo: Callable[[str], None] = print) -> Drained:
    """Run the embedded server in the foreground until Ctrl-C or SIGTERM, then drain (`drain`) and stop it;
    how the drain ended. A server that exits on its own, or whose models stop working (`watch`), is a
    RuntimeError. With `openai_port` (0: a free one) the OpenAI-compatible front (`pipeline.openai_front`) serves
    beside it, and stops after the drain.

    SIGINT is handled explicitly: a process started in the background by a non-interactive shell
    (`trtpipe serve ... &` in a script) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt, so `kill -INT` would not stop it.
    """
    previous = {sig: signal.signal(sig, handler) for sig, handler in (
        (signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _raise_keyboard_interrupt))}
    try:
        with embedded_server(repo, http_port=http_port, host=host, log_path=log_path, ready_timeout=ready_timeout,
                             model_control=model_control) as server, \
                openai_front(repo, server, host, openai_port) as front:
            echo(f"Triton is serving {Path(repo).resolve()} — models ready: {', '.join(server.models)}")
            echo(server.endpoints.describe())
            if front:
                echo(f"openai   {front.url}/v1  (models: {', '.join(front.front.models)})")
            echo(f"log      {server.log_path}")
            echo("Ctrl-C to stop")
            try:
                watch(server)
            except KeyboardInterrupt:
                signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second signal does not cut the drain short
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                drained = drain(server, drain_timeout, echo)
                echo(f"stopping (up to {STOP_TIMEOUT_S:.0f} s for Triton's graceful shutdown)")
                return drained
            raise RuntimeError(f"the Triton server exited unexpectedly (status {server.process.returncode}); "
                               f"last lines of its log:\n{server.log_tail()}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def openai_front(repo: Path, server: TritonServer, host: str, port: int | None):
    """The OpenAI front over `server` (a context manager), or a null context without a port."""
    if port is None:
        return nullcontext()
    from .openai_front.app import OpenAIFront

    return OpenAIFront(repo, server.http_url, host=host, port=port)


def serve_front_forever(repo: Path, triton_url: str, *, host: str, port: int, ready_timeout: float,
                        echo: Callable[[str], None] = print) -> None:
    """The OpenAI front alone over the Triton server at `triton_url` serving `repo` (a GPU image's tritonserver, a
    Kubernetes pod's Triton container), in the foreground until Ctrl-C or SIGTERM. It waits up to `ready_timeout`
    seconds for the server to be ready, so it may start beside it."""
    from .openai_front.app import OpenAIFront

    front = OpenAIFront(repo, triton_url, host=host, port=port)   # the repository's models and tokenizer first
    wait_for_triton(triton_url, ready_timeout)
    previous = {sig: signal.signal(sig, handler) for sig, handler in (
        (signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _raise_keyboard_interrupt))}
    try:
        with front:
            echo(f"openai   {front.url}/v1  over Triton at {triton_url} (models: {', '.join(front.front.models)})")
            echo("Ctrl-C to stop")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                echo("stopping")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_triton(url: str, timeout: float) -> None:
    """Until `url`'s /v2/health/ready answers 200; UserError after `timeout` seconds."""
    deadline, last = time.monotonic() + timeout, "no answer"
    while True:
        try:
            response = requests.get(f"{url}/v2/health/ready", timeout=5)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        if time.monotonic() > deadline:
            raise UserError(f"the Triton server at {url} was not ready within {timeout:g} s ({last})")
        time.sleep(1)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
