"""What `trtpipe tune` starts from: a build directory or a model repository, its plan and what it serves.

- a build directory (`trtpipe build -o OUT`): OUT/plan.json, OUT/model_repo/, the checkpoint it serves
  (OUT/checkpoint-<precision>/ or OUT/checkpoint/); the study lives in OUT/tune/;
- a model repository written by `trtpipe deploy`: its plan is in manifest.json (deploy's params), the
  reference backend's checkpoint is the copy in tensorrt_llm/1/checkpoint, an engine is the
  tensorrt_llm model's gpt_model_path; the study lives beside it (REPO/../tune).

Only NVIDIA's inflight_batcher_llm layout (the engine and the cpu target's reference backends) is tuned:
the llmapi layout's batching belongs to the LLM API, not to Triton's configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..backends import backend_for
from ..backends.names import INFLIGHT_BATCHER
from ..errors import UserError
from ..model_repository import ModelRepository, model_names, read_repository
from ..plan import Plan, load_plan
from ..triton_names import TENSORRT_LLM

TUNE_DIR = "tune"


@dataclass(frozen=True)
class TuneSource:
    """The deployment a study tunes: its plan and the inputs `deploy_repository` needs to render a candidate."""

    path: Path                  # what the user named
    plan: Plan
    repo: Path
    checkpoint: Path | None     # what a reference backend serves; what --rebuild compiles
    engine: Path | None         # the engine backend's engine directory
    tokenizer: Path
    default_out: Path           # where the study and its results go unless -o says otherwise

    @property
    def engine_backend(self) -> bool:
        return self.plan.build_config is not None


def read_source(path: Path) -> TuneSource:
    path = Path(path).expanduser().resolve()
    if (path / "plan.json").is_file() and (path / "model_repo").is_dir():
        plan, repository, out = load_plan(path / "plan.json"), read_repository(path / "model_repo"), path / TUNE_DIR
        checkpoint = built_checkpoint(path, plan.precision)
    elif (path / "manifest.json").is_file() and model_names(path):
        repository, out = read_repository(path), path.parent / TUNE_DIR
        plan = repository.plan()
        served = path / TENSORRT_LLM / "1" / "checkpoint"
        checkpoint = served if served.is_dir() else None
    else:
        raise UserError(f"{path} is neither a build directory (plan.json and model_repo/, from `trtpipe build`) nor "
                        "a model repository written by `trtpipe deploy` (manifest.json)")
    repo = repository.path
    backend = backend_for(plan.backend)
    if backend.layout != INFLIGHT_BATCHER:
        raise UserError(f"{path} is a {plan.backend} deployment (the {backend.layout} layout): its batching is the "
                        "LLM API's, not Triton's; trtpipe tune tunes the engine and reference backends")
    engine = served_engine(repository) if plan.build_config is not None else None
    if plan.build_config is None and checkpoint is None:
        raise UserError(f"{repo} has no tensorrt_llm/1/checkpoint to serve (an onnxruntime repository keeps only the "
                        "export): pass the build directory instead")
    if not repository.tokenizer.is_dir():
        raise UserError(f"{repo} has no preprocessing/1/tokenizer; re-run `trtpipe deploy`")
    return TuneSource(path, plan, repo, checkpoint, engine, repository.tokenizer, out)


def built_checkpoint(build: Path, precision: str) -> Path | None:
    for candidate in (build / f"checkpoint-{precision}", build / "checkpoint"):
        if any(candidate.glob("rank*.safetensors")):
            return candidate
    return None


def served_engine(repository: ModelRepository) -> Path:
    """The tensorrt_llm model's gpt_model_path: the engine the repository serves."""
    if repository.engine is None:
        raise UserError(f"{repository.path}/tensorrt_llm/config.pbtxt names no engine (gpt_model_path); re-run "
                        "`trtpipe deploy`")
    return repository.engine
