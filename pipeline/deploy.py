"""The deploy stage: a plan (+ engine or checkpoint) -> a Triton model repository.

The repository has the five models of NVIDIA's inflight_batcher_llm layout with NVIDIA's tensor
contract (`triton_contract`): `ensemble`, `preprocessing`, `tensorrt_llm`, `postprocessing` and
`tensorrt_llm_bls`. Every config.pbtxt is a `ModelConfig` protobuf message serialized with text_format.

Four models are the same for every plan; `tensorrt_llm` is the plan's backend's (`pipeline.backends`,
chosen by `plan.backend`):

- engine: the `tensorrtllm` backend; `gpt_model_path` is the absolute path of the engine directory,
  which need not exist yet (deploy renders from the plan alone; `trtpipe check` verifies the repository
  against the engine's config.json once it exists, and deploy does so now when it already exists);
- reference: a Python-backend model (model_repo/tensorrt_llm) that runs trtpipe's reference runtime
  over the checkpoint copied into `tensorrt_llm/1/checkpoint`, with the runtime package copied beside it.

Tokenizer files are copied into `preprocessing/1/tokenizer` and `postprocessing/1/tokenizer`, named relative
to the repository's root (`tokenizer_parameter`): the repository is self-contained and relocatable (the GPU
engine excepted, which is referenced, not copied).

What the repository serves is recorded in its manifest under `deployment` (see `Deployment`): the model,
precision, backend, target and the served checkpoint's dtype. `trtpipe validate REPO` reads it there
(`model_repository.read_deployment`) to pick its golden reference; nothing else outside the repository's configs
is read.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from . import NVIDIA_MODEL_FILES, TRTLLM_VERSION
from .backends import backend_for, bls_draft_len
from .backends.base import shell_command
from .backends.pytorch import (LLMAPI, LLMAPI_MODELS, local_draft, served_files, serves_on_triton,
                               write_llmapi_repository, write_trtllm_serve_deployment)
from .backends.reference import with_runtime
from .errors import UserError
from .model_repository import INFLIGHT_BATCHER_MODELS, Deployment
from .outputs import fingerprint_inputs, stage_output
from .package_data import MODEL_SOURCES, MODEL_SUPPORT_FILES, copy_model_support
from .plan import Plan
from .tokenizer import TOKENIZER_FILES, copy_tokenizer
from .triton_contract import (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, ENSEMBLE_STEPS, POSTPROCESSING_INPUTS,
                              POSTPROCESSING_OUTPUTS, PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS,
                              TENSORRT_LLM_BLS_INPUTS, TENSORRT_LLM_BLS_OUTPUTS, TENSORRT_LLM_INPUTS,
                              TENSORRT_LLM_OUTPUTS)
from .triton_names import (ENSEMBLE, EXCLUDE_INPUT_IN_OUTPUT, POSTPROCESSING, PREPROCESSING, TARGET_DEFAULTS,
                           TENSORRT_LLM, TENSORRT_LLM_BLS, TENSORRT_LLM_DRAFT, TENSORRT_LLM_DRAFT_MODEL_NAME,
                           TENSORRT_LLM_MODEL_NAME)
from .tritonconfig import Batching, ModelSpec, build_model_config, to_pbtxt

STAGE = "deploy"
#: The models whose Python source is the same for every backend (model_repo/<name>/1/model.py).
COMMON_PYTHON_MODELS = (PREPROCESSING, POSTPROCESSING, TENSORRT_LLM_BLS)
#: The datatype of the logits outputs (NVIDIA's default `logits_datatype`).
LOGITS_DTYPE = "TYPE_FP32"


@dataclass(frozen=True)
class DeploySettings:
    """What the repository's configs say, derived from the plan (and the engine, when it exists)."""

    target: str
    triton_backend: str  # the tensorrt_llm model's, from plan.backend
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_microseconds: int
    max_queue_size: int
    decoupled: bool
    trtllm_parameters: dict  # tensorrt_llm model parameters (strings), the backend's
    priority_levels: int = 0
    default_priority_level: int = 0
    #: draft-target through the BLS: the draft's tensorrt_llm model's parameters (TENSORRT_LLM_DRAFT); None: none
    draft_parameters: dict | None = None

    def batching(self, scheduling: bool = False) -> Batching:
        """The dynamic_batching block; with the priority levels for the model that schedules (tensorrt_llm)."""
        levels = (self.priority_levels, self.default_priority_level) if scheduling else (0, 0)
        return Batching(self.preferred_batch_sizes, self.max_queue_delay_microseconds, self.max_queue_size, *levels)


@dataclass(frozen=True)
class DeployResult:
    path: Path
    target: str
    skipped: bool
    models: tuple[str, ...]
    engine: Path | None
    deployment: Deployment

    def to_dict(self) -> dict:
        return {"repository": str(self.path), "target": self.target, "skipped": self.skipped,
                "models": list(self.models), "engine": str(self.engine) if self.engine else None,
                "backend": self.deployment.backend}

    def summary(self) -> str:
        if self.skipped:
            return f"model repository {self.path} is up to date (inputs unchanged); nothing to do"
        if not self.models:
            return (f"wrote a trtllm-serve deployment {self.path} for target {self.target} (no Triton in its image)"
                    f"\ncheck it with `trtpipe check {self.path}`\nserve it in that image with:\n  "
                    f"cd {shlex.quote(str(self.path))} && {shell_command(self.deployment.serve_command)}")
        backend = f"engine {self.engine}" if self.engine else backend_for(self.deployment.backend).summary
        gpus = f" on {self.deployment.world_size} GPUs" if self.deployment.world_size > 1 else ""
        here = (f"serve it here with `trtpipe serve {self.path}`, or in the trtpipe image with:\n  "
                if backend_for(self.deployment.backend).serves_embedded
                else f"serve it{gpus} in the trtpipe image with:\n  ")
        return (f"wrote Triton model repository {self.path} for target {self.target}: "
                f"{', '.join(self.models)} ({backend})\ncheck it with `trtpipe check {self.path}`\n{here}"
                f"cd {shlex.quote(str(self.path))} && "
                f"MODEL_REPOSITORY=. {shell_command(self.deployment.serve_command)}")


def deploy_repository(plan: Plan, out: Path, *, engine: Path | None = None, checkpoint: Path | None = None,
                      tokenizer: Path | None = None, force: bool = False, runtime: str | None = None,
                      python_models: Path | None = None, model: str | None = None,
                      draft_engine: Path | None = None) -> DeployResult:
    """Write the model repository for `plan` at `out` (a no-op when `out` is up to date); `runtime` (cpu target:
    torch or onnxruntime, `backends.base.RUNTIMES`) overrides the plan's; `python_models`: a directory of
    NVIDIA's inflight_batcher_llm models whose pre/postprocessing and BLS model files are shipped instead of
    trtpipe's (`nvidia_python_models`); `model`: the model the repository serves, recorded for validate's golden
    check, when the plan cannot name it (a plan made from a sparsified or distilled checkpoint: `build` passes its
    own float model); `draft_engine`: a draft-target plan's draft engine on a backend that drafts through the BLS
    (`bls_draft_engine`)."""
    out = Path(out)
    if runtime is not None:
        plan = with_runtime(plan, runtime)
    backend = backend_for(plan.backend)
    draft_engine = bls_draft_engine(plan, draft_engine)
    engine, checkpoint = backend.check_artifacts(engine, checkpoint)
    settings = settings_from_plan(plan, engine, draft_engine)
    llmapi = backend.layout == LLMAPI
    on_triton = serves_on_triton(plan)
    models = (LLMAPI_MODELS if llmapi else INFLIGHT_BATCHER_MODELS) if on_triton else ()
    models += (TENSORRT_LLM_DRAFT,) if draft_engine else ()
    # NVIDIA's llmapi model on a GPU tokenizes with the Hugging Face model it loads: no tokenizer files
    tokenizer_dir = None if llmapi and not backend.serves_embedded else find_tokenizer(tokenizer, checkpoint, engine)
    deployment = describe_deployment(plan, checkpoint, model)
    # trtpipe's model files with the package files they import (package_data.MODEL_SUPPORT_FILES), or NVIDIA's
    sources = nvidia_python_models(python_models, llmapi) if python_models else [*model_source_files(),
                                                                                 *MODEL_SUPPORT_FILES]
    draft = draft_checkpoint(plan)
    inputs = fingerprint_inputs([*([tokenizer_dir] if tokenizer_dir else []), *sources,
                                 *backend.repository_inputs(engine, checkpoint), *([draft] if draft else []),
                                 *(backend.repository_inputs(draft_engine, None) if draft_engine else []),
                                 *(served_files(local_draft(plan)) if local_draft(plan) else [])])
    params = {"plan": plan.to_dict(), "engine": str(engine) if engine else None,
              **({"draft_engine": str(draft_engine)} if draft_engine else {})}
    with stage_output(out, STAGE, inputs, params, force=force,
                      extra={"trtllm_version": plan.llm_api.tensorrt_llm_version if plan.llm_api else TRTLLM_VERSION,
                             "target": settings.target,
                             "deployment": asdict(deployment)}) as output:
        if output.up_to_date:
            return DeployResult(out, settings.target, True, models, engine, deployment)
        if not on_triton:
            write_trtllm_serve_deployment(output.dir, plan, checkpoint)
        elif llmapi:
            write_llmapi_repository(output.dir, plan, checkpoint, tokenizer_dir)
        else:
            write_repository(output.dir, settings, tokenizer_dir, python_models)
        if on_triton:
            backend.write_model(output.dir / TENSORRT_LLM / "1", checkpoint)
            if draft:
                backend.write_draft_model(output.dir / TENSORRT_LLM / "1", draft)
        refuse_if_check_fails(output.dir, engine, plan.llm_api.tensorrt_llm_version if plan.llm_api else None)
    return DeployResult(out, settings.target, False, models, engine, deployment)


def bls_draft_engine(plan: Plan, draft_engine: Path | None) -> Path | None:
    """The draft engine of a draft-target plan whose backend drafts through the BLS (resolved; it need not exist
    yet); UserError when such a plan lacks it or another plan is given one."""
    spec = plan.speculative
    drafting = bls_draft_len(plan) is not None
    if draft_engine is not None and not drafting:
        raise UserError("--draft-engine is for a draft-target plan on the engine backend (`trtpipe plan --speculative "
                        "draft:MODEL`); this plan has no draft model there")
    if drafting and draft_engine is None:
        raise UserError(f"the plan drafts with {spec.draft_model}: pass --draft-engine DIR, its engine (trtllm-build "
                        "of its checkpoint with --use_paged_context_fmha enable and this plan's max_batch_size, "
                        "max_input_len and max_seq_len; it need not exist yet)")
    if draft_engine is None:
        return None
    draft_engine = Path(draft_engine).resolve()
    if draft_engine.exists() and not draft_engine.is_dir():
        raise UserError(f"--draft-engine {draft_engine} is a file; pass the draft's engine directory")
    return draft_engine


def draft_checkpoint(plan: Plan) -> Path | None:
    """A draft-target plan's draft checkpoint (pipeline/plan/speculative.py); UserError when it is gone since."""
    spec = plan.speculative
    if spec is None or spec.draft_checkpoint is None:
        return None
    draft = Path(spec.draft_checkpoint)
    if not (draft / "config.json").is_file():
        raise UserError(f"the plan drafts with {draft}, which is not a TensorRT-LLM checkpoint (any more): plan "
                        "again with --speculative draft:CHECKPOINT")
    return draft


def describe_deployment(plan: Plan, checkpoint: Path | None, model: str | None = None) -> Deployment:
    """The record of what the repository serves: the served checkpoint's dtype is its config.json's when
    deploy was given it, else the plan's (an engine is built in the plan's dtype); the model is the plan's (the
    model it names, or the one its checkpoint was converted from: `ModelInfo.reference`), else `model`."""
    spec = plan.model.reference or model
    dtype, config = plan.dtype, checkpoint / "config.json" if checkpoint else None
    if config is not None and config.is_file():
        dtype = json.loads(config.read_text()).get("dtype", dtype)
    return Deployment(model=spec, precision=plan.precision, backend=plan.backend, target=plan.target.name,
                      weights_dtype=dtype, world_size=plan.tp_size * plan.pp_size,
                      serve_command=tuple(backend_for(plan.backend).serve_command(plan)))


# ----------------------------------------------------------------------------------------------- inputs

def find_tokenizer(tokenizer: Path | None, checkpoint: Path | None, engine: Path | None) -> Path:
    """The directory whose tokenizer files go into the repository."""
    candidates = [tokenizer] if tokenizer else [d / "tokenizer" for d in (checkpoint, engine) if d]
    for directory in candidates:
        if directory and any((Path(directory) / name).is_file() for name in TOKENIZER_FILES[:2]):
            return Path(directory).resolve()
    looked = ", ".join(str(c) for c in candidates) or "nowhere"
    raise UserError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) found (looked in {looked}); "
                    "pass --tokenizer DIR, e.g. the Hugging Face model directory")


def settings_from_plan(plan: Plan, engine: Path | None, draft_engine: Path | None = None) -> DeploySettings:
    triton = plan.triton
    max_batch = triton.triton_max_batch_size
    if max_batch < 1:
        raise UserError("the plan's triton_max_batch_size is below 1; re-run `trtpipe plan`")
    preferred = tuple(int(b) for b in triton.preferred_batch_size)
    too_big = [b for b in preferred if not 1 <= b <= max_batch]
    if too_big:
        raise UserError(f"the plan's preferred_batch_size {list(preferred)} has sizes outside 1..{max_batch} "
                        "(triton_max_batch_size); re-run `trtpipe plan`")
    backend = backend_for(plan.backend)
    return DeploySettings(
        target=plan.target.name, triton_backend=backend.triton_backend, max_batch_size=max_batch,
        preferred_batch_sizes=preferred, max_queue_delay_microseconds=triton.max_queue_delay_microseconds,
        max_queue_size=triton.max_queue_size, decoupled=triton.decoupled_mode,
        trtllm_parameters=backend.model_parameters(plan, engine),
        priority_levels=triton.priority_levels, default_priority_level=triton.default_priority_level,
        draft_parameters=backend.model_parameters(plan, draft_engine) if draft_engine else None,
    )


# ------------------------------------------------------------------------------------------ the configs

def tokenizer_parameter(model: str) -> dict[str, str]:
    """`tokenizer_dir` relative to the repository's root. NVIDIA's pre/postprocessing hand the value to
    `AutoTokenizer.from_pretrained` as it is (preprocessing/1/model.py:63-64, 108-111), so a relative path is
    relative to tritonserver's working directory; every server trtpipe starts or writes a command for runs in
    the repository's root (server._launch, the Kubernetes pod's workingDir, the recorded serve command), and
    trtpipe's own models resolve it against the root too, whatever the working directory. An absolute path
    would name this machine; a bare "tokenizer" made NVIDIA's models fall back to the Hugging Face Hub."""
    return {"tokenizer_dir": f"{model}/1/tokenizer"}


def model_specs(s: DeploySettings) -> list[ModelSpec]:
    """The repository's models; with a draft (`DeploySettings.draft_parameters`), the draft's tensorrt_llm model
    beside the target's, as NVIDIA's draft-target instructions make it (a copy of tensorrt_llm renamed, its engine
    the draft's: examples/draft_target_model/README.md), and the BLS naming it."""
    draft = s.draft_parameters is not None
    llm = [(TENSORRT_LLM, s.trtllm_parameters), *([(TENSORRT_LLM_DRAFT, s.draft_parameters)] if draft else [])]
    return [
        ModelSpec(ENSEMBLE, s.max_batch_size, ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, platform="ensemble",
                  steps=ENSEMBLE_STEPS),
        ModelSpec(PREPROCESSING, s.max_batch_size, PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS, backend="python",
                  batching=s.batching(), instance_count=1,
                  # NVIDIA's preprocessing reads multimodal_model_path with []: "" = text only
                  parameters={**tokenizer_parameter(PREPROCESSING), "add_special_tokens": "true",
                              "multimodal_model_path": ""}),
        *(ModelSpec(name, s.max_batch_size, TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS, backend=s.triton_backend,
                    batching=s.batching(scheduling=True), decoupled=s.decoupled, instance_count=1,
                    parameters=parameters) for name, parameters in llm),
        ModelSpec(POSTPROCESSING, s.max_batch_size, POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS,
                  backend="python", batching=Batching(), instance_count=1,
                  parameters={**tokenizer_parameter(POSTPROCESSING), "skip_special_tokens": "true"}),
        ModelSpec(TENSORRT_LLM_BLS, s.max_batch_size, TENSORRT_LLM_BLS_INPUTS, TENSORRT_LLM_BLS_OUTPUTS,
                  backend="python",
                  decoupled=s.decoupled, instance_count=1,
                  parameters={TENSORRT_LLM_MODEL_NAME: TENSORRT_LLM, "accumulate_tokens": "false",
                              **({TENSORRT_LLM_DRAFT_MODEL_NAME: TENSORRT_LLM_DRAFT} if draft else {})}),
    ]


# ------------------------------------------------------------------------------------------- the files

def model_source_files() -> list[Path]:
    """The model.py files of the backend-independent models, from model_repo/ (`package_data.MODEL_SOURCES`)."""
    files = [MODEL_SOURCES / name / "1" / "model.py" for name in COMMON_PYTHON_MODELS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"trtpipe's model sources are missing ({', '.join(missing)}); reinstall trtpipe")
    return files


def nvidia_python_models(directory: Path, llmapi: bool) -> list[Path]:
    """The files of NVIDIA's preprocessing, postprocessing and BLS models under `directory` (NVIDIA's
    all_models/inflight_batcher_llm: `NVIDIA_MODEL_FILES` in the container): each model.py, and the BLS's lib/."""
    if llmapi:
        raise UserError("--python-models is for the inflight_batcher_llm layout; this plan's backend deploys "
                        "NVIDIA's llmapi model")
    directory = Path(directory)
    files = [directory / name / "1" / "model.py" for name in COMMON_PYTHON_MODELS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"NVIDIA's model files are not in {directory} (missing {', '.join(missing)}); in "
                        f"NVIDIA's Triton container they are at {NVIDIA_MODEL_FILES}")
    lib = directory / TENSORRT_LLM_BLS / "1" / "lib"
    return files + sorted(p for p in lib.rglob("*.py") if p.is_file())


def write_repository(repo: Path, s: DeploySettings, tokenizer_dir: Path, python_models: Path | None = None) -> None:
    """Every config.pbtxt, and the files of the models every backend shares (trtpipe's, with the package files
    they import beside each model.py (`copy_model_support`), or NVIDIA's from `python_models`)."""
    for spec in model_specs(s):
        model_dir = repo / spec.name
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(to_pbtxt(build_model_config(spec, LOGITS_DTYPE)))
    source = Path(python_models) if python_models else MODEL_SOURCES
    for name in COMMON_PYTHON_MODELS:
        shutil.copyfile(source / name / "1" / "model.py", repo / name / "1" / "model.py")
        if not python_models:
            copy_model_support(repo / name / "1")
    if python_models and (source / TENSORRT_LLM_BLS / "1" / "lib").is_dir():
        shutil.copytree(source / TENSORRT_LLM_BLS / "1" / "lib", repo / TENSORRT_LLM_BLS / "1" / "lib",
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in (PREPROCESSING, POSTPROCESSING):
        copy_tokenizer(tokenizer_dir, repo / name / "1" / "tokenizer")
    (repo / TENSORRT_LLM_BLS / "1" / "wiring.json").write_text(json.dumps(bls_wiring(s), indent=2) + "\n")


def bls_wiring(s: DeploySettings) -> dict:
    """The ensemble's step maps, for tensorrt_llm_bls to call the same models the same way; and under
    `TARGET_DEFAULTS` what the LLM model does when a request does not say (its drafting loop answers as the model
    would, its own calls saying it)."""
    return {**{step.model_name: {"input_map": step.input_map, "output_map": step.output_map}
               for step in ENSEMBLE_STEPS},
            TARGET_DEFAULTS: {EXCLUDE_INPUT_IN_OUTPUT: s.trtllm_parameters.get(EXCLUDE_INPUT_IN_OUTPUT) == "true"}}


def refuse_if_check_fails(repo: Path, engine: Path | None, trtllm_version: str | None) -> None:
    """Run `trtpipe check` on the freshly written repository, against the TensorRT-LLM version the manifest will
    record; a plan/engine mismatch stops the deploy."""
    from .check import check_repository

    errors = [f for f in check_repository(repo, engine=engine, trtllm_version=trtllm_version).findings
              if f.severity == "error"]
    if errors:
        raise UserError("the repository would not be right for this engine:\n"
                        + "\n".join(f"  {f.describe()}" for f in errors))
