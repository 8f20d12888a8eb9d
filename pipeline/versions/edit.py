"""Adding, serving and removing versions of a repository's `tensorrt_llm`, each change atomic on disk.

Nothing is written before every check passed. A version is copied into a temporary sibling of the repository
(hard links where the file system allows: checkpoints are big) and renamed into `tensorrt_llm/N` whole; the
config.pbtxt and manifest.json are replaced with `os.replace`. The order keeps every intermediate state
servable: the config is pinned to the served version before the new directory appears (Triton's default
policy, latest 1, would otherwise load the new one at the next start), and names a new version only once its
directory is complete.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..outputs import recorded_path
from ..errors import UserError
from ..outputs import MANIFEST, describe_outputs, link_or_copy
from ..tritonconfig import to_pbtxt
from .compat import refuse_unless_compatible
from .live import LiveSwitch, apply_on_server
from .repository import (TRTLLM, VERSIONS_KEY, Repository, VersionRecord, neutral_path, read_repository,
                         resolve_source, source_version)

PREVIOUS = "previous"


@dataclass(frozen=True)
class AddResult:
    repo: Path
    version: int
    record: VersionRecord
    served: int

    def to_dict(self) -> dict:
        return {"repository": str(self.repo), "version": self.version, "served": self.served,
                **self.record.to_dict()}

    def summary(self) -> str:
        serving = (f"it is served now (restart the server, or `trtpipe versions serve {self.repo} {self.version} "
                   "--url URL` for a running one)" if self.served == self.version else
                   f"version {self.served} is still the one served; switch with "
                   f"`trtpipe versions serve {self.repo} {self.version}`")
        return f"added {self.record.describe()} as version {self.version} of {TRTLLM} in {self.repo}; {serving}"


@dataclass(frozen=True)
class ServeResult:
    repo: Path
    version: int
    before: tuple[int, ...]        # the versions the config served before
    live: LiveSwitch | None        # the running server switched with --url

    @property
    def changed(self) -> bool:
        return self.before != (self.version,)

    def to_dict(self) -> dict:
        return {"repository": str(self.repo), "served": self.version, "before": list(self.before),
                "live": self.live.to_dict() if self.live else None}

    def summary(self) -> str:
        done = (f"{self.repo}: {TRTLLM} version {self.version} is served (was {', '.join(map(str, self.before))})"
                if self.changed else f"{self.repo}: {TRTLLM} version {self.version} was already the one served")
        if self.live:
            return f"{done}\n{self.live.summary()}"
        return (f"{done}\na server reads this when it loads the model: restart `trtpipe serve {self.repo}` (it "
                "starts Triton with model control none, which reads configs once); for a Triton started with "
                f"--model-control-mode=explicit, apply it with `trtpipe versions serve {self.repo} {self.version} "
                "--url URL`")


# ----------------------------------------------------------------------------------------------- add

def add_version(repo_path: Path, source_path: Path, *, serve: bool = False) -> AddResult:
    """SOURCE's served version (a build directory or a repository) as the next version of REPO's tensorrt_llm."""
    repo = read_repository(repo_path)
    source = read_repository(resolve_source(source_path), "SOURCE")
    if source.path.resolve() == repo.path.resolve():
        raise UserError(f"SOURCE is REPO itself ({repo.path}); pass another build's directory or repository")
    current = single_served(repo)
    refuse_unless_compatible(repo, source)
    taken = source_version(source)
    version = repo.on_disk[-1] + 1
    record = VersionRecord(version, neutral_path(str(Path(source_path).expanduser().absolute()), repo.path.parent),
                           source_deployment(source, taken, repo.path.parent), utc_now())
    staged = stage_copy(source.version_dir(taken), repo, version)
    try:
        write_config(repo, (current,))
        staged.rename(repo.version_dir(version))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    served = version if serve else current
    if serve:
        write_config(repo, (version,))
    save_manifest(repo, {**repo.records, version: record}, served, current if serve else repo.previous)
    return AddResult(repo.path, version, record, served)


def single_served(repo: Repository) -> int:
    if len(repo.served) != 1:
        raise UserError(f"{repo.path / TRTLLM / 'config.pbtxt'} has Triton serve {len(repo.served)} versions "
                        f"({list(repo.served)} of {list(repo.on_disk)} on disk); pick one with "
                        "`trtpipe versions serve REPO N` first")
    return repo.served[0]


def source_deployment(source: Repository, version: int, base: Path) -> dict:
    """SOURCE's record of the version taken, its model path re-based from SOURCE's parent onto `base`."""
    record = source.records.get(version)
    deployment = dict(record.deployment if record else source.deployment)
    if isinstance(deployment.get("model"), str):
        deployment["model"] = neutral_path(recorded_path(deployment["model"], source.path.parent), base)
    return deployment


def stage_copy(version_dir: Path, repo: Repository, version: int) -> Path:
    """A copy of `version_dir` in a temporary sibling of the repository (hard links where possible)."""
    staged = repo.path.parent / f".{repo.path.name}.{TRTLLM}-{version}.partial-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    try:
        shutil.copytree(version_dir, staged, copy_function=link_or_copy,
                        ignore=shutil.ignore_patterns("__pycache__"))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


# ----------------------------------------------------------------------------------------------- serve

def serve_version(repo_path: Path, wanted: str, *, url: str | None = None, timeout: float = 600.0) -> ServeResult:
    """Have REPO's config serve version `wanted` (a number or `previous`); with `url`, switch the running
    server first (model control), so a refusal there leaves the repository as it was."""
    repo = read_repository(repo_path)
    version = resolve_version(repo, wanted)
    live = apply_on_server(url, repo, with_policy(repo.config, (version,)), version, timeout) if url else None
    before = repo.served
    if before != (version,):
        write_config(repo, (version,))
        previous = before[0] if len(before) == 1 else repo.previous
        save_manifest(repo, repo.records, version, previous)
    return ServeResult(repo.path, version, before, live)


def resolve_version(repo: Repository, wanted: str) -> int:
    """VERSION as given: a version held on disk and recorded, or `previous` (the one served before)."""
    if wanted == PREVIOUS:
        if repo.previous is None:
            raise UserError(f"{repo.path} records no previously served version; name one of "
                            f"{', '.join(map(str, repo.on_disk))}")
        wanted = str(repo.previous)
    if not wanted.isdigit():
        raise UserError(f"VERSION must be a version number or `previous`, got {wanted!r}")
    version = int(wanted)
    held = ", ".join(map(str, repo.on_disk))
    if version not in repo.on_disk:
        raise UserError(f"{repo.path} has no version {version} of {TRTLLM} (it holds {held}); "
                        "`trtpipe versions list` shows them")
    if version not in repo.records or not (repo.version_dir(version) / "model.py").is_file():
        raise UserError(f"{repo.version_dir(version)} is not a complete, recorded version (an interrupted add?); "
                        f"remove it with `trtpipe versions remove {repo.path} {version}`")
    return version


# ----------------------------------------------------------------------------------------------- remove

def remove_version(repo_path: Path, wanted: str) -> tuple[Path, int]:
    """Delete a version that is not served (its directory goes first, then its record)."""
    repo = read_repository(repo_path)
    if not wanted.isdigit() or int(wanted) not in repo.on_disk:
        raise UserError(f"{repo.path} has no version {wanted} of {TRTLLM} (it holds "
                        f"{', '.join(map(str, repo.on_disk))})")
    version = int(wanted)
    if version in repo.served:
        raise UserError(f"version {version} is the one {repo.path} serves; serve another first "
                        f"(`trtpipe versions serve {repo.path} N`)")
    trash = repo.path.parent / f".{repo.path.name}.{TRTLLM}-{version}.removed-{os.getpid()}"
    repo.version_dir(version).rename(trash)
    records = {v: r for v, r in repo.records.items() if v != version}
    save_manifest(repo, records, single_served(repo), None if repo.previous == version else repo.previous)
    shutil.rmtree(trash, ignore_errors=True)
    return repo.path, version


# ----------------------------------------------------------------------------------------------- writing

def with_policy(config, versions: tuple[int, ...]):
    """A copy of tensorrt_llm's ModelConfig with `version_policy { specific { versions: [...] } }`."""
    changed = type(config)()
    changed.CopyFrom(config)
    changed.version_policy.specific.versions[:] = list(versions)
    return changed


def write_config(repo: Repository, versions: tuple[int, ...]) -> None:
    """tensorrt_llm/config.pbtxt serving `versions` (replaced atomically; left alone when it says so already)."""
    config = with_policy(repo.config, versions)
    if config != repo.config:
        replace_file(repo.model_dir / "config.pbtxt", to_pbtxt(config), repo.path.parent)


def save_manifest(repo: Repository, records: dict[int, VersionRecord], served: int, previous: int | None) -> None:
    """The manifest with the versions block, `deployment` of the served version (what `trtpipe validate`
    reads) and the outputs as they are now."""
    import json

    manifest = dict(repo.manifest)
    manifest[VERSIONS_KEY] = {"served": served, "previous": previous,
                              "held": {str(v): r.to_dict() for v, r in sorted(records.items())}}
    if served in records and records[served].deployment:
        manifest["deployment"] = records[served].deployment
    manifest["outputs"] = describe_outputs(repo.path)
    manifest["modified"] = utc_now()
    replace_file(repo.path / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n", repo.path.parent)


def replace_file(dest: Path, text: str, scratch: Path) -> None:
    """Write `text` to a temporary file in `scratch` (outside the repository Triton watches), then rename it
    over `dest`."""
    tmp = scratch / f".{dest.parent.name}-{dest.name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def list_versions(repo_path: Path) -> Repository:
    return read_repository(repo_path)
