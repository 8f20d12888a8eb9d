"""`trtpipe package | verify | unpack`: a build as one archive that proves what it is.

    NAME.tar
      artifact.json          what it is: target, SM, TensorRT-LLM and Triton versions, the model source's
                             fingerprint, the calibration recipe, the validation verdict, and the size and
                             sha256 of every other member
      build.json             the build summary
      model_repo/...         the Triton model repository (for the cpu target it holds the served checkpoint;
                             for the pytorch backend the served Hugging Face model, in tensorrt_llm/1/model/)
      engine/...             the engine backend (the GPU default): the TensorRT-LLM engine
      validation/report.json (and its plots)

The backend is build.json's `options.backend` (builds made before it was recorded: the target's default,
engine on GPUs, reference on cpu) and artifact.json records it. Only the engine backend needs and ships
an engine; a pytorch build (TensorRT-LLM's LLM API) ships its repository, whose model.yaml and
trtllm-serve.sh name the model directory relative to the repository.

Nothing in the archive names the build machine: manifests and build.json record paths relative to the
build directory (pipeline.outputs.portable); the validation report is made portable the same way when
packaged, and a JSON file naming a local model directory outside the build (the pytorch repository's
manifest names the source model its plan was made from) gets that directory's last component instead
(pipeline.artifact_paths); a file that must hold an absolute path (the engine's `gpt_model_path` in the
GPU repository, the engine's build command) gets `@ARTIFACT_ROOT@` in its place, which `unpack` replaces
with the directory it extracts to (those files are listed under `relocate`; a pytorch repository has
none). `package` refuses to write an archive in which the build directory, the home directory or such a
model directory still appears.

`package --key` signs artifact.json and `verify` / `unpack --public-key | --sha256` prove where the archive comes
from (pipeline/artifact_signing.py); without them the hashes prove consistency only, and the command says so.
`verify` reads every member, checks its size and hash, refuses members that could escape the directory
they are extracted to (absolute paths, `..`, links, devices) and, with --target, an artifact for another
TensorRT-LLM version or one the target cannot run: an engine (or a cpu build) only on the SM it was built
for; a pytorch build, which compiles nothing, on any GPU target the capability table lets run its precision and
KV cache (`pipeline.backends.capabilities`, as the planner asks it). `unpack` verifies first and extracts only a
verified archive.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from . import TRITON_IMAGE, TRTLLM_VERSION
from .artifact_paths import BuildMachine
from .artifact_signing import SIGNATURE, Origin, key_id, load_private_key, signature_member, signature_problem
from .backends import BACKENDS, DEFAULT_BACKEND, default_backend
from .backends.names import PYTORCH
from .errors import UserError
from .outputs import portable
from .backends.capabilities import Combination, refusal
from .targets import get_target

MANIFEST = "artifact.json"
FORMAT = 1
ROOT_PLACEHOLDER = "@ARTIFACT_ROOT@"
#: Text files that may have to name where the build lives (Triton needs an absolute gpt_model_path).
RELOCATABLE_SUFFIXES = (".pbtxt", ".sh")
SKIPPED_DIRS = {"__pycache__"}      # written by the Python backend when it serves; not build outputs
VALIDATION_FILES = ("report.json", "*.png")
CHUNK = 1 << 20
#: Backends whose archive holds no engine: it runs on any GPU target that supports its precision.
NOT_SM_BOUND = (PYTORCH,)


class VerificationFailed(Exception):
    """The archive is not what it says (exit status 1): altered, truncated, unsafe or for another target."""

    exit_code = 1


# ------------------------------------------------------------------------------------------------ package

@dataclass(frozen=True)
class Packaged:
    path: Path
    files: int
    bytes: int
    artifact: dict
    sha256: str = ""
    signed_by: str | None = None      # the signing key's id

    def to_dict(self) -> dict:
        return {"path": str(self.path), "files": self.files, "bytes": self.bytes, "sha256": self.sha256,
                "signed_by": self.signed_by, "artifact": self.artifact}

    def summary(self) -> str:
        a = self.artifact
        return (f"wrote {self.path}: {self.files} files, {self.bytes / 1e6:.1f} MB; target {a['target']} "
                f"(sm {a['sm']}), {a['backend']} backend, TensorRT-LLM {a['tensorrt_llm_version']}, validation "
                f"{'passed' if a['validation']['passed'] else 'FAILED'}\n"
                f"sha256 {self.sha256} ({'signed by key ' + self.signed_by if self.signed_by else 'unsigned'}; "
                "verify its origin with --public-key or --sha256)")


def package_build(build_dir: Path, out: Path, key: Path | None = None) -> Packaged:
    """Write BUILD_DIR's deliverables and their artifact.json into the tar OUT (atomically); with KEY (an Ed25519
    private key) signed (pipeline/artifact_signing.py)."""
    private_key = load_private_key(key) if key else None   # a bad key is refused before anything is read
    build_dir = Path(build_dir).absolute()
    summary = read_json(build_dir / "build.json", f"{build_dir} is not a trtpipe build directory (no build.json)")
    report_path = build_dir / "validation" / "report.json"
    report = read_json(report_path, f"{build_dir} has no validation report (validation/report.json); validate "
                                    "the build first (`trtpipe validate REPO`, with --url for a GPU target)")
    if not (build_dir / "model_repo").is_dir():
        raise UserError(f"{build_dir} has no model_repo/ (the build stopped before deploy)")
    target = get_target(summary["options"]["target"])
    backend = build_backend(summary, target)
    builds_engine = BACKENDS[backend].builds_engine
    if builds_engine and not (build_dir / "engine" / "config.json").is_file():
        raise UserError(f"{build_dir}/engine holds no built engine (engine/config.json); build it on the GPU first")
    machine = BuildMachine.of(build_dir, summary)
    contents = {rel: data for rel, data in collect(machine, engine=builds_engine)}
    artifact = describe(machine, summary, report, target, contents)
    artifact["directories"] = empty_directories(build_dir / "model_repo", build_dir)
    manifest = (json.dumps(artifact, indent=2) + "\n").encode()
    signed = {SIGNATURE: signature_member(manifest, private_key)} if private_key else {}
    write_tar({MANIFEST: manifest, **signed, **contents}, Path(out))
    return Packaged(Path(out), len(contents), sum(len(d) if isinstance(d, bytes) else d.stat().st_size
                                                 for d in contents.values()), artifact,
                    file_digest(Path(out))["sha256"], key_id(private_key.public_key()) if private_key else None)


def build_backend(summary: dict, target) -> str:
    """The build's backend: build.json's `options.backend`, else (older builds) the target's default."""
    return summary["options"].get("backend") or default_backend(target)


def collect(machine: BuildMachine, engine: bool):
    """(member name, bytes or the Path to copy) of everything the archive ships, paths made portable."""
    build_dir = machine.build_dir
    roots = ["model_repo"] + (["engine"] if engine else [])
    for root in roots:
        for path in sorted((build_dir / root).rglob("*")):
            if path.is_file() and not SKIPPED_DIRS & set(path.relative_to(build_dir).parts):
                yield path.relative_to(build_dir).as_posix(), portable_file(path, machine)
    yield "build.json", shipped_summary(machine)
    for pattern in VALIDATION_FILES:
        for path in sorted((build_dir / "validation").glob(pattern)):
            shipped = shipped_report(path) if path.name == "report.json" else portable_file(path, machine)
            yield path.relative_to(build_dir).as_posix(), shipped


def shipped_report(path: Path) -> bytes:
    """validation/report.json with the repository and log it names as the archive's own (`model_repo`,
    `validation/server.log`): validate recorded them absolute, and a build moved since names a directory that is
    neither this one nor home, which the machine check cannot know (issue 25: the old path was shipped)."""
    report = json.loads(path.read_text())
    if report.get("repo"):
        report["repo"] = "model_repo"
    if report.get("server_log"):
        report["server_log"] = "validation/server.log"
    return (json.dumps(report, indent=2) + "\n").encode()


def empty_directories(root: Path, base: Path) -> list[str]:
    """Directories under ROOT holding no file at any depth (the ensemble's `1/`: Triton loads no model without a
    version directory, and a tar of files alone drops it), relative to BASE."""
    return sorted(d.relative_to(base).as_posix() for d in root.rglob("*")
                  if d.is_dir() and not any(p.is_file() for p in d.rglob("*")))


def shipped_summary(machine: BuildMachine) -> bytes:
    summary = machine.neutral(json.loads((machine.build_dir / "build.json").read_text()))
    summary["options"]["model"] = machine.shipped_model(summary["options"]["model"])
    return (json.dumps(summary, indent=2) + "\n").encode()


def portable_file(path: Path, machine: BuildMachine) -> bytes | Path:
    """The file as shipped: unchanged unless it names the build machine; then a JSON file gets portable paths
    and a relocatable text file the placeholder (anything else is caught by `describe`)."""
    if not machine.named_in(path):
        return path
    if path.suffix == ".json":
        return (json.dumps(machine.neutral(json.loads(path.read_text())), indent=2) + "\n").encode()
    if path.suffix in RELOCATABLE_SUFFIXES:
        return path.read_bytes().replace(str(machine.build_dir).encode(), ROOT_PLACEHOLDER.encode())
    return path


def describe(machine: BuildMachine, summary: dict, report: dict, target, contents: dict) -> dict:
    build_dir = machine.build_dir
    files = {name: file_digest(data) for name, data in contents.items()}
    leaks = [name for name, data in contents.items() if machine.named_in(data)]
    if leaks:
        models = "".join(f", the model directory {m}" for m in machine.models)
        raise RuntimeError(f"refusing to package: {', '.join(leaks)} name(s) the build directory {build_dir}"
                           f"{models} or the home directory")
    options = summary["options"]
    return {
        "format": FORMAT,
        "name": build_dir.name,
        "target": target.name,
        "sm": target.sm,
        "backend": build_backend(summary, target),
        "tensorrt_llm_version": TRTLLM_VERSION,
        "triton_container": TRITON_IMAGE,
        "model": {"spec": machine.shipped_model(options["model"]),
                  "checkpoint_sha256": checkpoint_digest(build_dir)},
        "precision": options["precision"],
        "kv_cache": options["kv_cache"],
        "calibration": calibration_recipe(build_dir, options["precision"]),
        "validation": {"passed": bool(report.get("passed")), "checks": len(report.get("checks", []))},
        "relocate": sorted(n for n, d in contents.items() if isinstance(d, bytes) and ROOT_PLACEHOLDER.encode() in d),
        "files": files,
    }


def checkpoint_digest(build_dir: Path) -> str | None:
    """The model source's fingerprint: sha256 over the float checkpoint convert made of it (config.json and
    the rank files, by name), which is a function of the source weights alone.

    Every backend's build has that checkpoint (OUT/checkpoint): the engine is compiled from it (or from its
    calibration), the reference runtime serves it, and the pytorch backend's served Hugging Face model is
    made from it (calibrate's FP8 export in checkpoint-<precision>/hf/, or `export` to OUT/hf/). So the same
    source at the same dtype has one fingerprint whichever backend serves it; what is served is identified
    by that fingerprint with `calibration`, and byte for byte by its files' sha256 under `files`."""
    ckpt = build_dir / "checkpoint"
    files = sorted(p for p in ckpt.glob("*") if p.name == "config.json" or p.suffix == ".safetensors")
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_digest(path)["sha256"].encode())
    return digest.hexdigest()


def calibration_recipe(build_dir: Path, precision: str) -> dict | None:
    manifest = build_dir / f"checkpoint-{precision}" / "manifest.json"
    if not manifest.is_file():
        return None
    return portable(json.loads(manifest.read_text()).get("params"), build_dir)


def file_digest(data: bytes | Path) -> dict:
    if isinstance(data, bytes):
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    digest = hashlib.sha256()
    with open(data, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return {"size": data.stat().st_size, "sha256": digest.hexdigest()}


def write_tar(members: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.mode = 0o644
                if isinstance(data, bytes):
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    info.size = data.stat().st_size
                    with open(data, "rb") as f:
                        tar.addfile(info, f)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path, missing: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(missing) from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None


# ------------------------------------------------------------------------------------------------ verify

@dataclass
class Verification:
    archive: str
    artifact: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    origin: str | None = None          # how its origin was proven (None: consistency only)
    manifest: bytes = field(default=b"", repr=False)
    signature: bytes | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        found = asdict(self)
        del found["manifest"], found["signature"]
        return {**found, "ok": self.ok}

    def summary(self) -> str:
        a = self.artifact
        lines = [f"{self.archive}: {a.get('name', '?')}, target {a.get('target', '?')} (sm {a.get('sm')}), "
                 f"{archive_backend(a)} backend, TensorRT-LLM {a.get('tensorrt_llm_version', '?')}, "
                 f"{len(a.get('files', {}))} files, "
                 f"validation {'passed' if a.get('validation', {}).get('passed') else 'FAILED'}"] if a else []
        lines += [f"  FAIL  {p}" for p in self.problems]
        if not self.ok:
            lines.append(f"NOT verified: {len(self.problems)} problem(s)")
        elif self.origin:
            lines.append(f"verified: every file matches its sha256; origin: {self.origin}")
        else:
            lines.append("consistent: every file matches its sha256 in artifact.json; origin NOT proven (anyone can "
                         "write matching hashes): pass --public-key or --sha256")
        return "\n".join(lines)


def verify_archive(archive: Path, target: str | None = None, extract_to: Path | None = None,
                   origin: Origin = Origin()) -> Verification:
    """Read every member of ARCHIVE against its artifact.json, and its origin against ORIGIN (its signature, its
    digest); problems are collected, not raised. The file is opened once: its digest, the members and what
    EXTRACT_TO receives all come from that one open file, so what is extracted is exactly what was verified
    (reading the archive twice let a file swapped in between be extracted unverified)."""
    archive = Path(archive)
    wanted = get_target(target) if target else None     # an unknown --target is the user's mistake
    if not archive.is_file():
        raise UserError(f"{archive} does not exist (or is not a file)")
    result = Verification(str(archive))
    try:
        with open(archive, "rb") as f:
            digest = stream_digest(f)["sha256"]
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as tar:
                seen = check_members(tar, result, extract_to)
    except (tarfile.TarError, EOFError, OSError) as exc:
        result.problems.append(f"{archive}: unreadable or truncated archive ({exc})")
        return result
    result.problems += origin_problems(result, digest, origin)
    expected = result.artifact.get("files", {})
    result.problems += [f"{name}: listed in {MANIFEST} but missing from the archive"
                        for name in expected if name not in seen]
    result.problems += [f"{name}: directory {why}" for name in result.artifact.get("directories", [])
                        if (why := unsafe_directory(name))]
    if wanted is not None and result.artifact:
        result.problems += target_mismatches(result.artifact, wanted)
    return result


def origin_problems(result: Verification, digest: str, origin: Origin) -> list[str]:
    """Why the archive is not the one ORIGIN names; sets how its origin was proven."""
    problems, proofs = [], []
    if origin.sha256 is not None:
        if digest != origin.sha256:
            problems.append(f"the archive's sha256 {digest} is not the pinned {origin.sha256}")
        proofs.append("the pinned sha256")
    if origin.public_key is not None and result.manifest:
        problem = signature_problem(result.manifest, result.signature, origin.public_key)
        problems += [problem] if problem else []
        proofs.append(f"signed by key {key_id(origin.public_key)}")
    result.origin = " and ".join(proofs) if proofs and not problems else None
    return problems


def unsafe_directory(name) -> str | None:
    """Why creating artifact.json's directory `name` could reach outside the extraction directory."""
    return "not a name" if not isinstance(name, str) or not name else path_problem(name)


def check_members(tar: tarfile.TarFile, result: Verification, extract_to: Path | None = None) -> set[str]:
    """Hash every regular member (and write it under EXTRACT_TO); artifact.json must come first (package writes it
    first). An unsafe or unlisted member is never written."""
    seen: set[str] = set()
    for info in tar:
        unsafe = unsafe_reason(info)
        if unsafe:
            result.problems.append(f"{info.name}: refused, {unsafe}")
            continue
        if not result.artifact:
            if info.name != MANIFEST:
                result.problems.append(f"{info.name}: the archive does not start with {MANIFEST}")
                return seen
            data = tar.extractfile(info).read()
            result.manifest = data
            try:
                result.artifact = json.loads(data)
            except ValueError as exc:
                result.problems.append(f"{MANIFEST}: not valid JSON ({exc})")
                return seen
            if extract_to is not None:
                extract_to.mkdir(parents=True, exist_ok=True)
                (extract_to / MANIFEST).write_bytes(data)
            continue
        if info.name == SIGNATURE and result.signature is None:   # right after artifact.json, never extracted
            result.signature = tar.extractfile(info).read(1 << 16)
            continue
        listed = result.artifact.get("files", {}).get(info.name)
        seen.add(info.name)
        if listed is None:
            result.problems.append(f"{info.name}: not listed in {MANIFEST}")
            continue
        try:
            got = stream_digest(tar.extractfile(info), None if extract_to is None else extract_to / info.name)
        except (tarfile.TarError, EOFError, OSError) as exc:
            result.problems.append(f"{info.name}: truncated ({exc})")
            continue
        if got != listed:
            result.problems.append(f"{info.name}: sha256/size {got['sha256'][:12]}…/{got['size']} do not match "
                                   f"{MANIFEST}'s {listed['sha256'][:12]}…/{listed['size']} (altered)")
    if not result.artifact:
        result.problems.append(f"the archive holds no {MANIFEST}")
    return seen


def unsafe_reason(info: tarfile.TarInfo) -> str | None:
    """Why extracting this member could write outside the directory, or something other than a file."""
    path = PurePosixPath(info.name)
    if problem := path_problem(info.name):
        return problem
    if info.issym() or info.islnk():
        base = path.parent if info.issym() else PurePosixPath()   # a hard link names a member of the archive
        outside = escapes(base / info.linkname)
        return f"link to {info.linkname}{' outside the archive' if outside else ''} (an artifact holds only files)"
    if info.isdev() or info.isfifo():
        return "device or fifo"
    if not info.isfile():
        return f"not a regular file (type {info.type!r})"
    return None


def path_problem(name: str) -> str | None:
    """Why a member or directory name, taken relative to the extraction directory, could lead out of it."""
    if PurePosixPath(name).is_absolute() or name.startswith(("/", "\\")):
        return "absolute path"
    if ".." in PurePosixPath(name).parts:
        return "path with '..'"
    return None


def escapes(path: PurePosixPath) -> bool:
    """True when PATH, taken relative to the extraction directory, leads out of it."""
    if path.is_absolute():
        return True
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return True
    return False


def stream_digest(f, copy_to: Path | None = None) -> dict:
    """sha256 and size of the stream F, written to COPY_TO as it is read when given."""
    digest, size = hashlib.sha256(), 0
    if copy_to is not None:
        copy_to.parent.mkdir(parents=True, exist_ok=True)
    with open(copy_to, "wb") if copy_to is not None else contextlib.nullcontext() as sink:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if sink is not None:
                sink.write(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def archive_backend(artifact: dict) -> str:
    """artifact.json's backend; archives written before it was recorded: the default of their target's kind."""
    return artifact.get("backend") or DEFAULT_BACKEND["cpu" if artifact.get("sm") is None else "gpu"]


def target_mismatches(artifact: dict, target) -> list[str]:
    backend = archive_backend(artifact)
    if backend in NOT_SM_BOUND:
        problems = precision_mismatches(artifact, target, backend)
    elif artifact.get("sm") != target.sm:
        problems = [f"built for sm {artifact.get('sm')} ({artifact.get('target')}), but {target.name} is "
                    f"sm {target.sm}: an engine runs only on the SM it was built for"]
    else:
        problems = []
    if artifact.get("tensorrt_llm_version") != TRTLLM_VERSION:
        problems.append(f"built with TensorRT-LLM {artifact.get('tensorrt_llm_version')}, but {target.name} "
                        f"deployments run {TRTLLM_VERSION}")
    return problems


def precision_mismatches(artifact: dict, target, backend: str) -> list[str]:
    """Why `target` cannot run an archive of a backend that compiles nothing: not a kind of target the backend
    serves, or a combination the capability table forbids (`pipeline.backends.capabilities`, as the planner asks it)."""
    if target.kind not in BACKENDS[backend].target_kinds:
        return [f"a {backend} artifact runs on {' or '.join(BACKENDS[backend].target_kinds)} targets; "
                f"{target.name} is a {target.kind} target"]
    combination = Combination(str(artifact.get("precision")), artifact.get("kv_cache"), backend,
                              target.sm if target.is_gpu else None)
    rule = refusal(combination)
    return [f"built with precision {combination.precision} and KV cache {combination.kv_cache}, but {target.name} "
            f"(sm {target.sm}) cannot run it: {rule.message(combination)}"] if rule else []


# ------------------------------------------------------------------------------------------------ unpack

def unpack_archive(archive: Path, out: Path, target: str | None = None, origin: Origin = Origin()) -> Verification:
    """Verify ARCHIVE (and its ORIGIN), then extract its files into OUT (a new directory) and point relocatable
    files at OUT."""
    out = Path(out).absolute()
    if out.exists():
        raise UserError(f"{out} already exists; unpack into a new directory")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = verify_archive(archive, target, extract_to=tmp, origin=origin)   # one read: extracted = verified
        if not result.ok:
            return result
        for name in result.artifact.get("directories", []):
            (tmp / name).mkdir(parents=True, exist_ok=True)
        for name in set(result.artifact.get("relocate", [])) & set(result.artifact["files"]):  # verified members
            path = tmp / name
            path.write_bytes(path.read_bytes().replace(ROOT_PLACEHOLDER.encode(), str(out).encode()))
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
