"""The build matrix: the builds a project keeps, in `trtpipe.toml` or `[tool.trtpipe]` of pyproject.toml.

    output = "out"                  # where `trtpipe build --matrix` puts each build (OUT/<name>)

    [[build]]
    name = "smollm2-cpu-fp8"        # letters, digits, . _ - (a directory, a CI job and an artifact name)
    model = "smollm2-135m"
    target = "cpu"
    precision = "fp8"
    kv_cache = "auto"               # optional, as the build options below
    tp = 1
    pp = 1
    calibration = "news"            # a calibration recipe or dataset (default: the default recipe)
    samples = 64                    # calibration samples (default: the recipe's)
    workload = { input_len = 1024, output_len = 256, concurrency = 8 }

`trtpipe build --matrix FILE [--only NAME]` runs the builds (pipeline.build.build, one per entry);
`trtpipe matrix FILE` prints them; pipeline.ci generates the GitHub Actions workflow from them.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .errors import UserError
from .plan.schema import Workload
from .precisions import PRECISIONS
from .targets import get_target

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
KV_CACHES = ("auto", "fp16", "fp8", "int8")
REQUIRED = ("name", "model", "target", "precision")
OPTIONAL = {"kv_cache": str, "tp": int, "pp": int, "calibration": str, "samples": int, "workload": dict}


@dataclass(frozen=True)
class MatrixEntry:
    """One build of the matrix: what `trtpipe build` is given."""

    name: str
    model: str
    target: str
    precision: str
    kv_cache: str = "auto"
    tp: int = 1
    pp: int = 1
    calibration: str | None = None
    samples: int | None = None
    workload: Workload = field(default_factory=Workload)

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """sha256 (first 16 hex digits) of the entry's settings: half of the CI cache key (with the SM and
        the TensorRT-LLM version)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def build_options(self, root: Path, **extra):
        from .build import BuildOptions

        return BuildOptions(model=self.model, target=self.target, precision=self.precision, out=Path(root) / self.name,
                            kv_cache=self.kv_cache, tp=self.tp, pp=self.pp, workload=self.workload,
                            calibration_dataset=self.calibration, calibration_samples=self.samples, **extra)


@dataclass(frozen=True)
class Matrix:
    path: Path
    output: Path
    entries: tuple[MatrixEntry, ...]

    def select(self, only: tuple[str, ...] = ()) -> tuple[MatrixEntry, ...]:
        """The entries named in `only` (all when empty); an unknown name is a UserError listing the known."""
        known = {e.name: e for e in self.entries}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise UserError(f"{self.path}: no build named {', '.join(map(repr, unknown))}; "
                            f"the matrix has {', '.join(known)}")
        return tuple(known[n] for n in only) if only else self.entries

    def to_dict(self) -> dict:
        """What `trtpipe matrix --json` prints: {"include": [entry...]}, the shape of a CI matrix."""
        return {"include": [entry_for_ci(e) for e in self.entries]}


def entry_for_ci(entry: MatrixEntry) -> dict:
    """An entry with what CI needs beside it: the target's SM and whether it needs a GPU runner."""
    target = get_target(entry.target)
    return {**entry.to_dict(), "gpu": target.is_gpu, "sm": target.sm, "fingerprint": entry.fingerprint()}


def load_matrix(path: Path) -> Matrix:
    """Read and check FILE (trtpipe.toml, or pyproject.toml's [tool.trtpipe]); every mistake is a UserError
    that names the file and the entry."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"matrix file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{path} is not a readable TOML file: {exc}") from None
    if path.name == "pyproject.toml":
        data = data.get("tool", {}).get("trtpipe")
        if not isinstance(data, dict):
            raise UserError(f"{path} has no [tool.trtpipe] table with [[tool.trtpipe.build]] entries")
    unknown = set(data) - {"output", "build"}
    if unknown:
        raise UserError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))} (expected output, build)")
    builds = data.get("build")
    if not isinstance(builds, list) or not builds:
        raise UserError(f"{path} lists no builds: add [[build]] tables (name, model, target, precision)")
    entries = tuple(parse_entry(path, i, raw) for i, raw in enumerate(builds))
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UserError(f"{path}: build names must be unique; repeated: {', '.join(duplicates)}")
    output = data.get("output", "out")
    if not isinstance(output, str) or not output:
        raise UserError(f"{path}: output must be a directory name (a string)")
    return Matrix(path, Path(output), entries)


def parse_entry(path: Path, index: int, raw: dict) -> MatrixEntry:
    where = f"{path}: build {raw.get('name', f'#{index + 1}')!r}" if isinstance(raw, dict) else f"{path}: build"
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a table")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}")
    unknown = set(raw) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                        f"(known: {', '.join(REQUIRED + tuple(OPTIONAL))})")
    for key, value in raw.items():
        wanted = OPTIONAL.get(key, str)
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise UserError(f"{where}: {key} must be a {wanted.__name__}, not {value!r}")
    if not NAME_PATTERN.match(raw["name"]):
        raise UserError(f"{where}: name may hold only letters, digits, '.', '_' and '-' (it names a directory, "
                        "a CI job and an artifact)")
    if raw["precision"] not in PRECISIONS:
        raise UserError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, not {raw['precision']!r}")
    if raw.get("kv_cache", "auto") not in KV_CACHES:
        raise UserError(f"{where}: kv_cache must be one of {', '.join(KV_CACHES)}")
    for key in ("tp", "pp", "samples"):
        if key in raw and raw[key] < 1:
            raise UserError(f"{where}: {key} must be at least 1")
    try:
        get_target(raw["target"])
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return MatrixEntry(**{k: v for k, v in raw.items() if k != "workload"},
                       workload=parse_workload(where, raw.get("workload", {})))


def parse_workload(where: str, raw: dict) -> Workload:
    known = {f.name for f in fields(Workload)}
    unknown = set(raw) - known
    if unknown:
        raise UserError(f"{where}: unknown workload key(s) {', '.join(sorted(unknown))} "
                        f"(known: {', '.join(sorted(known))})")
    wrong = [k for k, v in raw.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if wrong:
        raise UserError(f"{where}: workload {', '.join(wrong)} must be numbers")
    workload = Workload(**raw)
    try:
        workload.validate()
    except UserError as exc:
        raise UserError(f"{where}: workload: {exc}") from None
    return workload


def run_matrix(matrix: Matrix, only: tuple[str, ...], root: Path | None, say, **options) -> dict:
    """Build the selected entries in order into ROOT/<name> (ROOT: the matrix's `output`, relative to the
    current directory); returns {name: BuildSummary}. A UserError names the entry it came from."""
    from .build import build

    summaries = {}
    for entry in matrix.select(only):
        say(f"== {entry.name}: {entry.model} -> {entry.target} {entry.precision}")
        try:
            summaries[entry.name] = build(entry.build_options(root or matrix.output, **options), say=say)
        except UserError as exc:
            raise UserError(f"build {entry.name!r}: {exc}") from None
    return summaries
