"""Atomic stage outputs and the manifests that make re-runs no-ops.

Every stage writes into a temporary sibling of its output directory and renames it into place only
when everything succeeded, so an interrupted run never leaves an output that looks complete. The
manifest records the stage's inputs (paths with sizes and modification times), its parameters and the
tool version; a later run with the same fingerprint is skipped. A manifest names no absolute path of the
machine that wrote it (`portable`): paths inside the output's parent (the build directory, in a build) are
recorded relative to it, other inputs by a hash of their location, and the home directory as `~`.
`stage_output` is that whole routine (up to date? -> refuse an occupied output -> temporary directory ->
manifest -> rename); the pieces below it are what it is made of.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import __version__
from .errors import UserError

MANIFEST = "manifest.json"
#: Files up to this size get a sha256 in the manifest; larger ones (weights) are recorded by size.
HASH_LIMIT = 64 << 20


def fingerprint_inputs(paths: list[Path]) -> dict[str, dict]:
    """Size and mtime of every file under the given paths (the cheap, stat-only identity of inputs)."""
    found: dict[str, dict] = {}
    for root in paths:
        root = Path(root).resolve()
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            st = f.stat()
            found[str(f)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return found


def portable(value, base: Path):
    """`value` (JSON data) with every absolute path in its strings made machine-neutral: under `base` relative
    to it (`base` itself is "."), under the home directory as `~/...`. Applied alike when a manifest is
    written and when it is compared, so the up-to-date check still holds; moving `base` keeps it."""
    if isinstance(value, dict):
        return {portable(k, base): portable(v, base) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, base) for v in value]
    if not isinstance(value, str):
        return value
    for root, name in ((str(Path(base).absolute()), "."), (os.path.expanduser("~"), "~")):
        if root not in ("/", "", "~"):
            value = value.replace(root + os.sep, "" if name == "." else name + os.sep)
            value = name if value == root else value
    return value


def recorded_path(value: str, base: Path) -> str:
    """A path a manifest made `portable`, back as this machine's: relative to the
    output's parent when it is there, `~` expanded; anything else (a preset, a hub id) as it is."""
    if value.startswith("~"):
        return str(Path(value).expanduser())
    candidate = base / value
    return str(candidate.resolve()) if candidate.exists() else value


def portable_inputs(inputs: dict[str, dict], base: Path) -> dict[str, dict]:
    """`fingerprint_inputs`' record keyed without the machine's paths: a file under `base` by its path relative
    to it, any other by a hash of its directory and its name (the same file gives the same key)."""
    return {input_key(Path(name), Path(base).absolute()): stat for name, stat in inputs.items()}


def input_key(path: Path, base: Path) -> str:
    """How a manifest names the input file PATH (absolute): relative to BASE when under it, else
    `external-<sha256 of its directory, 16 hex digits>/<its name>`."""
    if path.is_relative_to(base):
        return str(path.relative_to(base))
    return f"external-{hashlib.sha256(str(path.parent).encode()).hexdigest()[:16]}/{path.name}"


def describe_outputs(directory: Path) -> dict[str, dict]:
    """Size of every output file, and its sha256 when it is small enough to hash cheaply."""
    described = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        entry: dict = {"size": f.stat().st_size}
        if entry["size"] <= HASH_LIMIT:
            entry["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
        described[str(f.relative_to(directory))] = entry
    return described


def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_up_to_date(out: Path, stage: str, inputs: dict, params: dict) -> bool:
    """True when `out` is a complete output of `stage` made from the same inputs and parameters."""
    manifest = read_manifest(out)
    base = Path(out).absolute().parent
    return bool(
        manifest
        and manifest.get("stage") == stage
        and manifest.get("inputs") == portable_inputs(inputs, base)
        and manifest.get("params") == portable(params, base)
        and manifest.get("tool_version") == __version__
    )


def write_manifest(directory: Path, stage: str, inputs: dict, params: dict, extra: dict | None = None) -> None:
    """DIRECTORY/manifest.json, its paths made `portable` relative to DIRECTORY's parent (the temporary
    directory is a sibling of the output, so this is the output's parent too)."""
    base = Path(directory).absolute().parent
    manifest = {
        "stage": stage,
        "tool_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": portable_inputs(inputs, base),
        "params": portable(params, base),
        "outputs": describe_outputs(directory),
        **portable(extra or {}, base),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def check_output_is_no_input(out: Path, inputs: dict) -> None:
    """Refuse an output directory that is, or holds, a file the stage reads (`fingerprint_inputs`' keys)."""
    out = Path(out).resolve()
    inside = next((name for name in inputs if Path(name) == out or out in Path(name).parents), None)
    if inside is not None:
        raise UserError(f"output {out} would replace the stage's own input {inside}: choose an -o outside the "
                        "input (--force never replaces an input)")


def check_output_free(out: Path, force: bool, written_by_trtpipe=lambda out: read_manifest(out) is not None) -> None:
    """Refuse an output folder that cannot be written: a file there (never replaced), a folder trtpipe did not write
    (replaced only with --force, which is not suggested for it), or an output of trtpipe's made from other inputs
    (replaced with --force; WRITTEN_BY_TRTPIPE tells them apart, by default a stage's manifest.json). An empty
    folder is free."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise UserError(f"{out} is a file, and this command writes a folder there: choose another -o")
    if force or not any(out.iterdir()):
        return
    if not written_by_trtpipe(out):
        raise UserError(f"{out} exists and trtpipe did not write it: choose another -o (trtpipe replaces only "
                        "its own outputs)")
    raise UserError(f"output directory {out} already exists (made from other inputs); "
                    "choose another -o or pass --force to replace it")


def check_output_file(path: Path, written_by_trtpipe) -> None:
    """Refuse an output file that cannot be written: a folder there, or a file WRITTEN_BY_TRTPIPE(path) says
    trtpipe did not write (never replaced: choose another name)."""
    if path.is_dir():
        raise UserError(f"{path} is a folder, and this command writes a file there: name the file, e.g. "
                        f"{path / 'plan.json'}")
    if path.exists() and not written_by_trtpipe(path):
        raise UserError(f"{path} exists and trtpipe did not write it: choose another -o (trtpipe replaces only "
                        "its own files)")


def link_or_copy(source: str | Path, dest: str | Path) -> None:
    """Hard-link SOURCE at DEST where the file system allows (weights and checkpoints are big), else copy it
    (shutil.copytree's copy_function signature)."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


#: the longest output name: the file system's 255 bytes, less the `.NAME.partial-PID` and `.NAME.lock` siblings
MAX_NAME_BYTES = 255 - len(".") - len(".partial-") - 10


def make_output_parent(out: Path) -> None:
    """`out`'s parent directories, or UserError (exit 2) saying why `out` cannot be written there: a file where a
    directory must be, a name too long for the file system, no permission (a generic OSError before)."""
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"cannot write {out}: {ancestor} is a file, not a directory; choose another -o")
    if len(out.name.encode()) > MAX_NAME_BYTES:
        raise UserError(f"cannot write {out.name[:40]}...: the name is {len(out.name.encode())} bytes, more than the "
                        f"{MAX_NAME_BYTES} an output name may have (the file system allows 255 with the siblings "
                        "trtpipe writes beside it); choose a shorter -o")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {out}: no permission to create anything in {ancestor}; choose another -o")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out.parent}: {exc.strerror or exc}; choose another -o") from None


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write one file whole or not at all: a temporary sibling (named for this process), then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@contextmanager
def atomic_output_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out`, on any failure it is removed."""
    out = Path(out).absolute()
    make_output_parent(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class StageWrite:
    """One run of a stage: `up_to_date` (nothing to do), or `dir`, the temporary directory to fill.

    `extra` holds more manifest fields (source paths, timings, versions); the block may add to it until
    it ends, when the manifest is written.
    """

    up_to_date: bool
    dir: Path | None = None
    extra: dict = field(default_factory=dict)


@contextmanager
def stage_output(out: Path, stage: str, inputs: dict, params: dict, *, force: bool = False,
                 extra: dict | None = None) -> Iterator[StageWrite]:
    """The one way a stage writes its output directory `out`.

    - `out` holds this stage's output of the same `inputs` (see `fingerprint_inputs`), `params` and tool
      version: yields `StageWrite(up_to_date=True)` and touches nothing (the caller returns its skipped
      result from inside the block);
    - `out` is or contains one of the stage's input files: UserError, whatever `force` says (replacing it would
      delete the inputs: `convert SRC -o SRC --force` deleted the model it converted);
    - `out` exists otherwise and `force` is false: UserError before anything is written;
    - else yields a temporary sibling of `out` in `.dir`; when the block ends without an exception the
      manifest (inputs, params, the outputs' sizes and hashes, `extra`) is written into it and it replaces
      `out`; on an exception it is removed and `out` is left as it was.

        with stage_output(out, "deploy", inputs, params, force=force) as output:
            if output.up_to_date:
                return Result(out, skipped=True)
            write_files(output.dir)
            output.extra["seconds"] = ...
    """
    out = Path(out)
    check_output_is_no_input(out, inputs)
    with output_lock(out):
        if is_up_to_date(out, stage, inputs, params):
            yield StageWrite(up_to_date=True)
            return
        check_output_free(out, force)
        with atomic_output_dir(out) as tmp:
            output = StageWrite(up_to_date=False, dir=tmp, extra=dict(extra or {}))
            yield output
            write_manifest(tmp, stage, inputs, params, output.extra)


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """One writer per output directory: an exclusive lock on `.NAME.lock` beside it, held while the stage runs. A
    second process is refused at once (two `calibrate -o SAME` both printed "wrote" and one output was lost).
    Holding the lock, every `.NAME.partial-*` / `.NAME.old-*` sibling is a killed run's leftover and is removed."""
    out = Path(out).absolute()
    make_output_parent(out)
    lock = out.parent / f".{out.name}.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{out} is being written by another trtpipe process right now; wait for it to finish "
                            "or choose another -o") from None
        for stale in [*out.parent.glob(f".{out.name}.partial-*"), *out.parent.glob(f".{out.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
