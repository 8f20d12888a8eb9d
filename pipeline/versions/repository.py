"""A model repository's versions of `tensorrt_llm`: the version directories on disk, the ones its config.pbtxt
has Triton load (`version_policy`), and the manifest's record of which build each version holds.

The record lives in the repository's manifest.json under `versions`:

    "versions": {"served": 2, "previous": 1,
                 "held": {"1": {"source": ".", "deployment": {...}, "added": "..."},
                          "2": {"source": "../fp8", "deployment": {...}, "added": "..."}}}

`source` is the build directory or repository the version was copied from and `deployment` that build's
record (deploy's `Deployment`: model, precision, backend, target, weights dtype), both machine-neutral
(`outputs.portable`, relative to the repository's parent). A repository `trtpipe deploy` wrote has no such
block: its one version is described by the manifest's own `deployment`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..model_repository import CONFIG, ModelRepository, read_repository as read_models
from ..triton_names import TENSORRT_LLM as TRTLLM

VERSIONS_KEY = "versions"


@dataclass(frozen=True)
class VersionRecord:
    """Which build one version of tensorrt_llm holds."""

    version: int
    source: str          # the build directory or repository it came from, relative to the repository's parent
    deployment: dict     # that build's deploy record (model, precision, backend, target, weights_dtype, ...)
    added: str           # UTC time it entered the repository

    def describe(self) -> str:
        d = self.deployment
        model = d.get("model") or "(a checkpoint)"
        where = "the build that holds this repository" if self.source == "." else self.source
        return f"{d.get('precision', '?')} {model} ({d.get('backend', '?')}) from {where}"

    def to_dict(self) -> dict:
        return {"source": self.source, "deployment": self.deployment, "added": self.added}


@dataclass(frozen=True)
class Repository:
    """A `trtpipe deploy` repository as the versions commands see it."""

    triton: ModelRepository             # its models and manifest, as read
    on_disk: tuple[int, ...]            # numeric version directories of tensorrt_llm, ascending
    records: dict[int, VersionRecord]
    previous: int | None = None         # the version served before the last switch

    @property
    def path(self) -> Path:
        return self.triton.path

    @property
    def manifest(self) -> dict:
        """manifest.json as read, for the commands that rewrite it."""
        return self.triton.manifest.raw

    @property
    def config(self):
        """tensorrt_llm's ModelConfig message."""
        return self.triton.config(TRTLLM)

    @property
    def model_dir(self) -> Path:
        return self.path / TRTLLM

    @property
    def deployment(self) -> dict:
        return self.manifest.get("deployment") or {}

    @property
    def backend(self) -> str:
        return str(self.deployment.get("backend", "?"))

    @property
    def plan(self) -> dict:
        return self.triton.manifest.plan or {}

    @property
    def served(self) -> tuple[int, ...]:
        """The versions Triton loads under the config's version_policy (unset: the latest one)."""
        return served_versions(self.config, self.on_disk)

    def version_dir(self, version: int) -> Path:
        return self.model_dir / str(version)


def served_versions(config, on_disk: tuple[int, ...]) -> tuple[int, ...]:
    """Triton's reading of `version_policy`: specific -> those on disk, all -> every one, latest N (the
    default, N = 1) -> the N highest."""
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice")
    if kind == "specific":
        return tuple(sorted(v for v in set(policy.specific.versions) if v in on_disk))
    if kind == "all":
        return on_disk
    latest = policy.latest.num_versions if kind == "latest" else 1
    return on_disk[-max(latest, 1):]


def read_repository(path: Path, role: str = "REPO") -> Repository:
    """The deploy repository at `path`; UserError (naming `role`) for anything else."""
    path = Path(path).expanduser().absolute()
    triton = read_models(path) if path.is_dir() else None
    if triton is None or not triton.by_deploy:
        raise UserError(f"{role} {path} is not a model repository written by `trtpipe deploy` (no deploy "
                        "manifest.json); pass the repository (BUILD/model_repo) or, for the version to add, "
                        "the build directory")
    if TRTLLM not in triton.models:
        raise UserError(f"{role} {path / TRTLLM / CONFIG} is missing or not a ModelConfig "
                        f"({triton.unusable.get(TRTLLM, 'no such file')}); re-run `trtpipe deploy`")
    on_disk = tuple(sorted(int(p.name) for p in (path / TRTLLM).iterdir() if p.is_dir() and p.name.isdigit()))
    if not on_disk:
        raise UserError(f"{role} {path / TRTLLM} has no version directory; re-run `trtpipe deploy`")
    manifest = triton.manifest.raw
    block = triton.manifest.versions
    records = parse_records(block.get("held"), manifest, on_disk, served_versions(triton.config(TRTLLM), on_disk),
                            path)
    return Repository(triton, on_disk, records, block.get("previous"))


def parse_records(held, manifest: dict, on_disk: tuple[int, ...], served: tuple[int, ...],
                  path: Path) -> dict[int, VersionRecord]:
    """The manifest's version records; for a repository deploy wrote, its one version from `deployment`, its
    source the build directory that holds it (".") or the repository itself."""
    if isinstance(held, dict) and held:
        return {int(v): VersionRecord(int(v), str(r.get("source", "?")), dict(r.get("deployment") or {}),
                                      str(r.get("added", "?")))
                for v, r in held.items() if str(v).isdigit() and isinstance(r, dict)}
    version = served[-1] if served else on_disk[-1]
    source = "." if (path.parent / "build.json").is_file() else path.name
    deployment = dict(manifest.get("deployment") or {})
    if isinstance(deployment.get("model"), str):
        deployment["model"] = neutral_path(deployment["model"], path.parent)
    return {version: VersionRecord(version, source, deployment,
                                   str(manifest.get("created", "?")))}


def neutral_path(value: str, base: Path) -> str:
    """An absolute path as relative to `base` (the repository's parent), so the record names no directory of
    this machine; anything else (a relative path, a preset, a hub id) as it is."""
    return os.path.relpath(value, base) if os.path.isabs(value) else value


def resolve_source(path: Path) -> Path:
    """The repository of SOURCE: a `trtpipe build` directory's model_repo/, or SOURCE itself."""
    path = Path(path).expanduser().absolute()
    if (path / "model_repo" / "manifest.json").is_file():
        return path / "model_repo"
    return path


def source_version(source: Repository) -> int:
    """The version of SOURCE to copy: the one it serves."""
    if len(source.served) != 1:
        raise UserError(f"SOURCE {source.path} serves {len(source.served)} versions of {TRTLLM} "
                        f"({list(source.served)}); serve one of them first (`trtpipe versions serve`)")
    return source.served[0]
