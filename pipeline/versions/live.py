"""Switching the version a running Triton serves, through its model-control API.

`POST /v2/repository/models/tensorrt_llm/load` with the new config (version_policy naming the version) as the
`config` parameter: Triton loads the version from the repository's directory, routes new requests to it once
it is ready, and unloads the version it no longer names when its in-flight requests are done. The ensemble
and BLS call tensorrt_llm with version -1 (the latest ready one), so they follow without a reload.

Triton accepts this only with `--model-control-mode=explicit` (`trtpipe serve --model-control-mode explicit`);
with `none` (its default, and `trtpipe serve`'s) or `poll` it answers 503 "explicit model load / unload is
not allowed if polling is enabled" (tritonserver 2.51, verified here), and the switch is refused with nothing
written. Before loading, the server's tensorrt_llm config is compared with the repository's (apart from
version_policy), so a server started on another repository is not switched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests

from ..errors import UserError
from .repository import TRTLLM, Repository
from ..triton_admin import LoadRefused, NotServed, TritonAdmin

REQUEST_TIMEOUT_S = 30.0
POLL_S = 0.25


@dataclass(frozen=True)
class LiveSwitch:
    """What the running server did."""

    url: str
    version: int
    unloaded: tuple[int, ...]      # versions no longer ready when the switch returned
    still_ready: tuple[int, ...]   # versions still finishing in-flight requests (unloaded when done)
    seconds: float

    def to_dict(self) -> dict:
        return {"url": self.url, "version": self.version, "unloaded": list(self.unloaded),
                "still_ready": list(self.still_ready), "seconds": round(self.seconds, 2)}

    def summary(self) -> str:
        rest = (f"; version {', '.join(map(str, self.still_ready))} unloads once its requests are done"
                if self.still_ready else "")
        return (f"the server at {self.url} serves version {self.version} ({self.url}/v2/models/{TRTLLM}/versions/"
                f"{self.version}/ready), switched in {self.seconds:.1f} s{rest}")


def apply_on_server(url: str, repo: Repository, config, version: int, timeout: float) -> LiveSwitch:
    """Load `config` (tensorrt_llm's, serving `version`) on the server at `url`; UserError when it cannot."""
    http = base_url(url)
    check_serves_repository(http, repo)
    started = time.monotonic()
    load(http, config)
    wait_ready(http, version, started + timeout)
    others = tuple(v for v in repo.on_disk if v != version)
    still = wait_unloaded(http, others, time.monotonic() + min(timeout, 10.0))
    return LiveSwitch(http, version, tuple(v for v in others if v not in still), still, time.monotonic() - started)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def check_serves_repository(http: str, repo: Repository) -> None:
    """The server answers and its tensorrt_llm is REPO's (every field REPO's config sets, version_policy aside)."""
    from ..validate.checks import config_differences
    from .compat import model_config

    try:
        served = TritonAdmin(http, timeout=REQUEST_TIMEOUT_S).model_config(TRTLLM)
    except requests.RequestException as exc:
        raise UserError(f"no Triton server answers at {http} ({type(exc).__name__}); check --url") from None
    except NotServed as missing:
        raise UserError(f"the server at {http} has no {TRTLLM} model ({missing.status}: {missing.text}); is it "
                        f"serving {repo.path}?") from None
    served.ClearField("version_policy")
    differences = config_differences(model_config(repo, TRTLLM), served)
    if differences:
        raise UserError(f"the server at {http} does not serve {repo.path}: its {TRTLLM} config differs "
                        f"({'; '.join(differences[:4])}); nothing was changed")


def load(http: str, config) -> None:
    try:
        TritonAdmin(http).load(TRTLLM, config)
    except LoadRefused as refused:
        status, message = refused.status, refused.text
        if not refused.model_control:
            raise RuntimeError(f"the server at {http} could not load the version ({status}: {message}); "
                               "nothing was changed in the repository and the server keeps what it served") from None
        raise UserError(f"the server at {http} does not allow model control ({status}: {message}): "
                        "it was started with --model-control-mode none (the default, also of `trtpipe serve`) or "
                        "poll. Nothing was changed. Either run this without --url and restart the server, or start "
                        "it with `trtpipe serve REPO --model-control-mode explicit` (tritonserver: "
                        "--model-control-mode=explicit --load-model=*) to switch it live") from None


def is_ready(http: str, version: int) -> bool:
    return TritonAdmin(http, timeout=REQUEST_TIMEOUT_S).ready(TRTLLM, version)


def wait_ready(http: str, version: int, deadline: float) -> None:
    while not is_ready(http, version):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {http} accepted the load but version {version} of {TRTLLM} is not "
                               "ready; see its log")
        time.sleep(POLL_S)


def wait_unloaded(http: str, versions: tuple[int, ...], deadline: float) -> tuple[int, ...]:
    """The versions still ready at `deadline` (Triton unloads them once their in-flight requests finish)."""
    ready = tuple(v for v in versions if is_ready(http, v))
    while ready and time.monotonic() < deadline:
        time.sleep(POLL_S)
        ready = tuple(v for v in ready if is_ready(http, v))
    return ready
