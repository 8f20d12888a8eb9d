"""What `trtpipe k8s` reads: a build directory or a model repository, and its command-line values.

A build directory (`trtpipe build -o OUT`) has OUT/plan.json and OUT/model_repo/; a model repository
written by `trtpipe deploy` carries its plan in manifest.json (deploy's params). Either way the plan is
what sizes the pods. Flags are parsed here so that a bad one stops before anything is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..backends import backend_for
from ..build import directory_bytes
from ..artifact_signing import SHA256_HEX
from ..errors import UserError
from ..model_repository import read_repository
from ..triton_names import TENSORRT_LLM
from ..backends.runtime_images import not_on_triton
from ..plan import Plan, load_plan
from ..targets import get_target

#: Where the model repository and (for an engine) the engine live inside the pod: the build's layout.
VOLUME_ROOT = "/trtpipe"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Room for the `-<hash>-<hash>` suffixes Kubernetes adds to pod names (63 characters in all).
MAX_NAME = 40


@dataclass(frozen=True)
class Replicas:
    minimum: int
    maximum: int


@dataclass(frozen=True)
class RepoSource:
    """Where model_repo/ (and engine/) come from: a PersistentVolumeClaim (one to create, or an existing
    claim), or a `trtpipe package` archive every pod fetches, verifies and unpacks before Triton starts."""

    claim: str | None
    create: bool
    artifact_url: str | None = None
    artifact_sha256: str | None = None   # the archive's digest the pod pins (`artifact:URL#sha256=HEX`)


@dataclass(frozen=True)
class DeploymentSource:
    """The plan and repository a set of manifests is generated from."""

    plan: Plan
    repo: Path
    name: str              # the Kubernetes name of everything generated
    volume_bytes: int      # what the volume must hold: the repository, plus the engine for the engine backend
    engine_config: object | None   # tensorrt_llm's ModelConfig in an engine repository (its engine path is rewritten)


def parse_replicas(text: str) -> Replicas:
    """MIN:MAX with 1 <= MIN <= MAX."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise UserError(f"--replicas must be MIN:MAX (two whole numbers, e.g. 1:4), got {text!r}")
    minimum, maximum = (int(p) for p in parts)
    if minimum < 1:
        raise UserError(f"--replicas {text}: the minimum must be at least 1 (the autoscaler never scales to zero)")
    if maximum < minimum:
        raise UserError(f"--replicas {text}: the maximum {maximum} is below the minimum {minimum}")
    return Replicas(minimum, maximum)


def parse_repo_source(text: str | None, name: str) -> RepoSource:
    """`pvc` (default): a new claim `<name>-model-repo`; `pvc:CLAIM`: an existing claim, left as it is;
    `artifact:URL#sha256=HEX`: a `trtpipe package` archive at an http(s) URL, pinned by its digest (the pod's
    `trtpipe unpack --sha256` refuses any other: a URL proves nothing of what it serves)."""
    if text in (None, "pvc"):
        return RepoSource(claim=f"{name}-model-repo", create=True)
    kind, _, value = text.partition(":")
    if kind == "artifact" and value.startswith(("https://", "http://")):
        url, _, pin = value.partition("#")
        digest = pin.removeprefix("sha256=").lower()
        if not pin.startswith("sha256=") or not SHA256_HEX.fullmatch(digest):
            raise UserError(f"--repo-source {text}: pin the archive: artifact:URL#sha256=HEX, with the sha256 "
                            "`trtpipe package` printed (the pod refuses any other archive at the URL)")
        return RepoSource(claim=None, create=False, artifact_url=url, artifact_sha256=digest)
    if kind != "pvc" or not DNS_LABEL.match(value):
        raise UserError(f"--repo-source must be `pvc` (a new PersistentVolumeClaim), `pvc:CLAIM` (an existing "
                        f"claim, a lowercase DNS name) or `artifact:URL#sha256=HEX` (a `trtpipe package` archive "
                        f"at an http(s) URL and its digest), got {text!r}")
    return RepoSource(claim=value, create=False)


def check_name(name: str, flag: str = "--name") -> str:
    if len(name) > MAX_NAME or not DNS_LABEL.match(name):
        raise UserError(f"{flag} {name!r} is not a Kubernetes name: lowercase letters, digits and '-', starting "
                        f"and ending with a letter or digit, at most {MAX_NAME} characters")
    return name


def default_name(model: str, target: str) -> str:
    """`<model>-<target>` as a DNS label: the model's last path part, lowercased, other characters as '-'."""
    stem = re.sub(r"[^a-z0-9]+", "-", Path(model).name.lower().removesuffix(".gguf")).strip("-") or "model"
    return f"{stem[:MAX_NAME - len(target) - 1].rstrip('-')}-{target}"


def read_source(path: Path, name: str | None) -> DeploymentSource:
    """A build directory (plan.json + model_repo/) or a `trtpipe deploy` repository (plan in manifest.json)."""
    path = Path(path)
    if (path / "plan.json").is_file() and (path / "model_repo").is_dir():
        plan, model = load_plan(path / "plan.json"), _built_model(path)
        repository = read_repository(path / "model_repo")
    elif (path / "manifest.json").is_file():
        repository = read_repository(path)
        plan = repository.plan()
        model = plan.model.name
    else:
        raise UserError(f"{path} is neither a build directory (plan.json and model_repo/, from `trtpipe build`) "
                        "nor a model repository written by `trtpipe deploy` (manifest.json)")
    get_target(plan.target.name)   # a plan for a target this trtpipe does not know is refused here
    refusal = not_on_triton(plan.runtime_image, "trtpipe k8s")
    if refusal:
        raise refusal
    name = check_name(name) if name else default_name(model, plan.target.name)
    engine_config, repo = None, repository.path
    volume = directory_bytes(repo)
    if backend_for(plan.backend).builds_engine:
        engine_config = repository.config(TENSORRT_LLM)
        volume += plan.weights_bytes   # the engine is about as large as the weights it was built from
    return DeploymentSource(plan=plan, repo=repo, name=name, volume_bytes=volume, engine_config=engine_config)


def _built_model(build: Path) -> str:
    """The model as the user named it to `trtpipe build` (plan.json names the converted checkpoint)."""
    try:
        return json.loads((build / "build.json").read_text())["options"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return load_plan(build / "plan.json").model.name
