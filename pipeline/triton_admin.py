"""Triton's model administration over HTTP, in one place: a served model's config and readiness, the repository
index, and loading a model with a new config (explicit model control). validate, tune, versions and the embedded
server ask through `TritonAdmin`; what a refusal means for each is theirs to say.
"""

from __future__ import annotations

from dataclasses import dataclass

import requests

#: Seconds a single administrative request may take (a load waits as long as the model takes: no limit).
ADMIN_TIMEOUT_S = 30.0


class Refusal(Exception):
    """The server answered a request about MODEL with STATUS (not 200) and TEXT."""

    def __init__(self, model: str, status: int, text: str):
        super().__init__(f"{model}: {status} {text}")
        self.model, self.status, self.text = model, status, text.strip()


class NotServed(Refusal):
    """The server has no such model (or version) to describe."""


class LoadRefused(Refusal):
    """A load the server refused; `model_control` when it was started without explicit model control."""

    @property
    def model_control(self) -> bool:
        return self.status in (404, 405, 503) or "not allowed" in self.text or "explicit" in self.text


@dataclass(frozen=True)
class TritonAdmin:
    http_url: str
    timeout: float = ADMIN_TIMEOUT_S

    def config(self, model: str) -> dict:
        """The config the server serves MODEL with (JSON); NotServed when it has none."""
        response = requests.get(f"{self.http_url}/v2/models/{model}/config", timeout=self.timeout)
        if response.status_code != 200:
            raise NotServed(model, response.status_code, response.text)
        return response.json()

    def model_config(self, model: str):
        """`config` as Triton's ModelConfig message (fields this tritonclient does not know are dropped)."""
        from google.protobuf import json_format
        from tritonclient.grpc import model_config_pb2

        return json_format.ParseDict(self.config(model), model_config_pb2.ModelConfig(), ignore_unknown_fields=True)

    def serves(self, model: str) -> bool:
        try:
            self.config(model)
        except NotServed:
            return False
        return True

    def ready(self, model: str, version: int | None = None) -> bool:
        """Whether MODEL (that version of it) answers ready; False when the server does not answer."""
        where = f"{model}/versions/{version}" if version is not None else model
        try:
            return requests.get(f"{self.http_url}/v2/models/{where}/ready", timeout=self.timeout).status_code == 200
        except requests.RequestException:
            return False

    def states(self) -> dict[str, str]:
        """State of every model in the server's repository index (READY, UNAVAILABLE, LOADING, ...).

        The index has one entry per model version Triton knows: after a model was reloaded with another version
        (`trtpipe versions serve --url`) the one it unloaded stays listed as UNAVAILABLE, so a model with any
        READY version is READY."""
        response = requests.post(f"{self.http_url}/v2/repository/index", json={}, timeout=self.timeout)
        response.raise_for_status()
        states: dict[str, str] = {}
        for entry in response.json():
            if states.get(entry["name"]) != "READY":
                states[entry["name"]] = entry.get("state", "UNKNOWN")
        return states

    def load(self, model: str, config) -> None:
        """Load MODEL with CONFIG (a ModelConfig message), waiting for it; LoadRefused when the server does not."""
        from google.protobuf import json_format

        body = {"parameters": {"config": json_format.MessageToJson(config, preserving_proto_field_name=True)}}
        response = requests.post(f"{self.http_url}/v2/repository/models/{model}/load", json=body, timeout=None)
        if response.status_code != 200:
            raise LoadRefused(model, response.status_code, response.text)
