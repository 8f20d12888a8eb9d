"""A Triton model repository as one typed value, read from disk once.

`read_repository(path)` parses every model's config.pbtxt into its `ModelConfig` message and reads the
manifest `trtpipe deploy` wrote (`DeployManifest`, with its `Deployment` record and plan). What the repository
says is answered here, not by opening its files again: the model names, each model's tensors and parameters,
the engine it serves (`gpt_model_path`), where the tokenizer sits (preprocessing's `tokenizer_dir`, relative
to the repository's root), the plan deploy recorded and the TensorRT-LLM version it targets. check, validate,
tune, versions, k8s, compare, serve and deploy's own check read it.

A model directory whose config.pbtxt is missing (while it has a version directory) or does not parse is kept
in `unusable` with the reason, so `trtpipe check` can name the file; every other reader takes the parsed
models only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from google.protobuf import text_format

from . import TRTLLM_VERSION
from .backends import backend_for
from .errors import UserError
from .outputs import read_manifest, recorded_path
from .plan import Plan
from .precisions import QUANT_ALGO
from .triton_names import ENSEMBLE, OUTPUT_IDS, POSTPROCESSING, PREPROCESSING, TENSORRT_LLM, TENSORRT_LLM_BLS
from .tritonconfig import parse_pbtxt

CONFIG = "config.pbtxt"
DEPLOY_STAGE = "deploy"
#: The models of NVIDIA's inflight_batcher_llm layout, in the order deploy writes them.
INFLIGHT_BATCHER_MODELS = (ENSEMBLE, PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, TENSORRT_LLM_BLS)
UNSET = re.compile(r"^\$\{[^}]*\}$")   # a fill_template.py placeholder nobody filled


@dataclass(frozen=True)
class Deployment:
    """What a repository serves, recorded in its manifest under `deployment` for `trtpipe validate REPO`."""

    model: str | None        # what to load the golden reference from: the plan's model, None for a bare checkpoint
    precision: str
    backend: str
    target: str
    weights_dtype: str       # the served checkpoint's float dtype (the engine's: the plan's dtype)
    world_size: int = 1      # GPUs (tp x pp) one server uses
    serve_command: tuple[str, ...] = ()   # how to start Triton on the repository ($MODEL_REPOSITORY: where it is)

    @property
    def quantized(self) -> bool:
        return self.precision in QUANT_ALGO


@dataclass(frozen=True)
class RepositoryModel:
    """One model: its directory name and its parsed config."""

    name: str
    config: object                # ModelConfig

    @property
    def file(self) -> str:
        return f"{self.name}/{CONFIG}"

    def inputs(self) -> dict:
        return {t.name: t for t in self.config.input}

    def outputs(self) -> dict:
        return {t.name: t for t in self.config.output}

    def parameter(self, key: str) -> str | None:
        """The parameter's string value as written (a `${...}` placeholder included); None when absent."""
        return self.config.parameters[key].string_value if key in self.config.parameters else None

    def set_parameter(self, key: str) -> str | None:
        """The parameter's value when it is really set: not absent, empty or an unfilled placeholder."""
        value = self.parameter(key)
        return value if value and not UNSET.match(value) else None

    @property
    def serves_engine(self) -> bool:
        """The tensorrtllm backend, or NVIDIA's Python runtime model (engine path and the LLM outputs)."""
        return self.config.backend == "tensorrtllm" or (
            bool(self.parameter("gpt_model_path")) and OUTPUT_IDS in self.outputs())

    @property
    def decoupled(self) -> bool:
        return self.config.model_transaction_policy.decoupled


@dataclass(frozen=True)
class DeployManifest:
    """manifest.json of a repository: the stage that wrote it, its parameters, deploy's records."""

    stage: str | None
    params: dict
    deployment: Deployment | None
    trtllm_version: str | None
    versions: dict               # the versions commands' block (`pipeline.versions.repository`)
    created: str | None
    raw: dict                    # the whole file, for the commands that rewrite it

    @property
    def by_deploy(self) -> bool:
        return self.stage == DEPLOY_STAGE

    @property
    def plan(self) -> dict | None:
        plan = self.params.get("plan")
        return plan if isinstance(plan, dict) else None


@dataclass(frozen=True)
class ModelRepository:
    path: Path
    models: dict[str, RepositoryModel]
    unusable: dict[str, str] = field(default_factory=dict)   # model name -> why its config cannot be used
    manifest: DeployManifest | None = None

    @property
    def names(self) -> list[str]:
        """Every model directory with a config.pbtxt, usable or not."""
        return sorted(set(self.models) | {n for n, why in self.unusable.items() if why != NO_CONFIG})

    def model(self, name: str) -> RepositoryModel:
        if name not in self.models:
            why = self.unusable.get(name, "no such model")
            raise UserError(f"{self.path / name / CONFIG}: {why}; re-run `trtpipe deploy`")
        return self.models[name]

    def config(self, name: str):
        return self.model(name).config

    @property
    def by_deploy(self) -> bool:
        return self.manifest is not None and self.manifest.by_deploy

    @property
    def deployment(self) -> Deployment | None:
        return self.manifest.deployment if self.manifest else None

    @property
    def trtllm_version(self) -> str:
        """The TensorRT-LLM version the repository targets: its trtpipe manifest's, else trtpipe's."""
        recorded = self.manifest.trtllm_version if self.manifest else None
        return recorded if isinstance(recorded, str) else TRTLLM_VERSION

    @property
    def engine(self) -> Path | None:
        """The engine directory the tensorrt_llm model names (gpt_model_path), when it names one."""
        model = self.models.get(TENSORRT_LLM)
        value = model.set_parameter("gpt_model_path") if model else None
        return Path(value) if value else None

    @property
    def tokenizer(self) -> Path:
        """The tokenizer deploy copied into the repository (preprocessing's `tokenizer_dir`, relative to the
        repository's root, see `pipeline.deploy.tokenizer_parameter`)."""
        model = self.models.get(PREPROCESSING)
        value = model.set_parameter("tokenizer_dir") if model else None
        return self.path / (value or f"{PREPROCESSING}/1/tokenizer")

    def plan(self) -> Plan:
        """The plan deploy recorded in the manifest; UserError for a repository deploy did not write."""
        if not self.by_deploy or self.manifest.plan is None:
            raise UserError(f"{self.path}/manifest.json is not a `trtpipe deploy` manifest with its plan; pass the "
                            "build directory or re-run `trtpipe deploy`")
        try:
            plan = Plan.from_dict(self.manifest.plan)
        except (KeyError, TypeError) as exc:
            raise UserError(f"{self.path}/manifest.json: malformed plan ({type(exc).__name__}: {exc}); re-run "
                            "`trtpipe deploy`") from None
        backend_for(plan.backend)
        return plan


NO_CONFIG = "the model has no config.pbtxt"


def read_repository(path: Path) -> ModelRepository:
    """The repository at `path` (a directory; UserError otherwise). Its manifest is None when it has none."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"model repository {path} does not exist or is not a directory")
    models, unusable = {}, {}
    for model_dir in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        config_path = model_dir / CONFIG
        if not config_path.is_file():
            if any(p.is_dir() and p.name.isdigit() for p in model_dir.iterdir()):
                unusable[model_dir.name] = NO_CONFIG
            continue
        try:
            models[model_dir.name] = RepositoryModel(model_dir.name, parse_pbtxt(config_path.read_text()))
        except text_format.ParseError as exc:
            unusable[model_dir.name] = f"not a valid inference.ModelConfig: {exc}"
    return ModelRepository(path, models, unusable, read_deploy_manifest(path))


def model_names(path: Path) -> list[str]:
    """The names of the models in `path` (the directories with a config.pbtxt), without parsing them."""
    return sorted(p.parent.name for p in Path(path).glob(f"*/{CONFIG}"))


def read_deploy_manifest(path: Path) -> DeployManifest | None:
    raw = read_manifest(path)
    if not isinstance(raw, dict):
        return None
    params = raw.get("params") if isinstance(raw.get("params"), dict) else {}
    versions = raw.get("versions") if isinstance(raw.get("versions"), dict) else {}
    return DeployManifest(stage=raw.get("stage"), params=params, deployment=parse_deployment(raw, path),
                          trtllm_version=raw.get("trtllm_version"), versions=versions, created=raw.get("created"),
                          raw=raw)


def parse_deployment(raw: dict, path: Path) -> Deployment | None:
    """The manifest's `deployment`, its model path back as this machine's; None for none (or an older one)."""
    record = raw.get("deployment")
    if not isinstance(record, dict):
        return None
    try:
        deployment = Deployment(**record)
    except TypeError:
        return None
    model = deployment.model if deployment.model is None else recorded_path(deployment.model, path.parent)
    return replace(deployment, model=model, serve_command=tuple(deployment.serve_command))


def read_deployment(path: Path) -> Deployment | None:
    """What deploy recorded in the manifest of the repository at `path`; None when it recorded nothing."""
    manifest = read_deploy_manifest(Path(path))
    return manifest.deployment if manifest else None
