"""The deploy stage: a plan (+ engine or checkpoint) -> a Triton model repository.

The repository has the five models of NVIDIA's inflight_batcher_llm layout with NVIDIA's tensor
contract (see `tritonconfig`): `ensemble`, `preprocessing`, `tensorrt_llm`, `postprocessing` and
`tensorrt_llm_bls`. Every config.pbtxt is a `ModelConfig` protobuf message serialized with text_format.

- GPU targets: `tensorrt_llm` uses the `tensorrtllm` backend; `gpt_model_path` is the absolute path of
  the engine directory, which need not exist yet (deploy renders from the plan alone; `trtpipe check`
  verifies the repository against the engine's config.json once it exists, and deploy does so now when
  it already exists).
- The cpu target: `tensorrt_llm` is a Python-backend model (data/model_repo/tensorrt_llm) that runs
  trtpipe's reference runtime over the checkpoint copied into `tensorrt_llm/1/checkpoint`. The runtime
  package is copied too (`tensorrt_llm/1/pipeline/`, exactly the modules `pipeline.runtime` imports),
  so the server's Python needs torch, safetensors, numpy and transformers but not trtpipe itself.

Tokenizer files are copied into `preprocessing/1/tokenizer` and `postprocessing/1/tokenizer` and the
Python models resolve every path relative to their own directory: the repository is self-contained
and relocatable (the GPU engine excepted, which is referenced, not copied).
"""

from __future__ import annotations

import ast
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import TRTLLM_VERSION
from .convert import TOKENIZER_FILES
from .errors import UserError
from .outputs import atomic_output_dir, check_output_free, fingerprint_inputs, is_up_to_date, write_manifest
from .tritonconfig import (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, ENSEMBLE_STEPS, POSTPROCESSING_INPUTS,
                           POSTPROCESSING_OUTPUTS, PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS,
                           TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS, Batching, ModelSpec, build_model_config,
                           to_pbtxt)

STAGE = "deploy"
MODEL_NAMES = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
PACKAGE_DIR = Path(__file__).resolve().parent
#: The Python model sources shipped with trtpipe as package data.
MODEL_SOURCES = PACKAGE_DIR / "data" / "model_repo"
#: plan["triton"] keys that are config.pbtxt fields or other models' settings, not tensorrt_llm parameters.
CONFIG_FIELD_KEYS = {"triton_max_batch_size", "decoupled_mode", "max_queue_delay_microseconds", "max_queue_size",
                     "preferred_batch_size", "preprocessing_instance_count", "postprocessing_instance_count",
                     "bls_instance_count", "logits_datatype", "triton_backend", "engine_dir", "batching_strategy"}
#: Parameters of NVIDIA's tensorrt_llm config.pbtxt (tensorrtllm_backend@c2e65b8, upstream-facts B).
TRTLLM_PARAMETERS = {
    "max_beam_width", "FORCE_CPU_ONLY_INPUT_TENSORS", "gpt_model_type", "gpt_model_path", "encoder_model_path",
    "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length", "batch_scheduler_policy",
    "kv_cache_free_gpu_mem_fraction", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes",
    "kv_cache_onboard_blocks", "exclude_input_in_output", "cancellation_check_period_ms",
    "stats_check_period_ms", "iter_stats_max_iterations", "request_stats_max_iterations",
    "enable_kv_cache_reuse", "normalize_log_probs", "enable_chunked_context", "gpu_device_ids",
    "participant_ids", "num_nodes", "lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size",
    "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes", "lora_prefetch_dir", "decoding_mode",
    "executor_worker_path", "lookahead_window_size", "lookahead_ngram_size",
    "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
    "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size",
    "speculative_decoding_fast_logits", "tokenizer_dir", "guided_decoding_backend",
    "xgrammar_tokenizer_info_path", "enable_trt_overlap",
}
#: tensorrt_llm parameters deploy always writes, with the backend's documented default when the plan
#: does not name them (BE:docs/model_config.md), so nothing is unset by accident.
TRTLLM_PARAMETER_DEFAULTS = {
    "gpt_model_type": "inflight_fused_batching",
    "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    "batch_scheduler_policy": "guaranteed_no_evict",
    "kv_cache_free_gpu_mem_fraction": "0.9",
    "enable_chunked_context": "false",
    "enable_kv_cache_reuse": "false",
    "exclude_input_in_output": "false",
    "normalize_log_probs": "true",
}


@dataclass(frozen=True)
class DeploySettings:
    """What the repository's configs say, derived from the plan (and the engine, when it exists)."""

    target: str
    cpu: bool
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_microseconds: int
    max_queue_size: int
    decoupled: bool
    preprocessing_instances: int
    postprocessing_instances: int
    bls_instances: int
    max_seq_len: int
    logits_dtype: str
    exclude_input_in_output: bool  # the default for requests that do not say
    trtllm_parameters: dict  # tensorrt_llm model parameters (strings)

    def batching(self) -> Batching:
        return Batching(self.preferred_batch_sizes, self.max_queue_delay_microseconds, self.max_queue_size)


@dataclass(frozen=True)
class DeployResult:
    path: Path
    target: str
    skipped: bool
    models: tuple[str, ...]
    engine: Path | None

    def to_dict(self) -> dict:
        return {"repository": str(self.path), "target": self.target, "skipped": self.skipped,
                "models": list(self.models), "engine": str(self.engine) if self.engine else None}

    def summary(self) -> str:
        if self.skipped:
            return f"model repository {self.path} is up to date (inputs unchanged); nothing to do"
        backend = f"engine {self.engine}" if self.engine else "the reference runtime over the checkpoint"
        return (f"wrote Triton model repository {self.path} for target {self.target}: "
                f"{', '.join(self.models)} ({backend})\ncheck it with `trtpipe check {self.path}`")


def deploy_repository(plan_path: Path, out: Path, *, engine: Path | None = None, checkpoint: Path | None = None,
                      tokenizer: Path | None = None, force: bool = False) -> DeployResult:
    """Write the model repository for `plan_path` at `out` (a no-op when `out` is up to date)."""
    out, plan_path = Path(out), Path(plan_path)
    plan = read_plan(plan_path)
    cpu = is_cpu_target(plan)
    engine, checkpoint = check_artifacts(cpu, engine, checkpoint)
    settings = settings_from_plan(plan, engine)
    tokenizer_dir = find_tokenizer(tokenizer, checkpoint, engine)
    sources = model_source_files(cpu)
    runtime_files = runtime_closure() if cpu else []
    inputs = fingerprint_inputs([plan_path, tokenizer_dir, *sources, *runtime_files]
                                + ([checkpoint] if cpu else [])
                                + ([engine / "config.json"] if engine and (engine / "config.json").is_file() else []))
    params = {"target": settings.target, "engine": str(engine) if engine else None}
    if is_up_to_date(out, STAGE, inputs, params):
        return DeployResult(out, settings.target, True, MODEL_NAMES, engine)
    check_output_free(out, force)

    with atomic_output_dir(out) as tmp:
        write_repository(tmp, settings, tokenizer_dir, checkpoint, runtime_files)
        refuse_if_check_fails(tmp, engine)
        write_manifest(tmp, STAGE, inputs, params, {"trtllm_version": TRTLLM_VERSION, "target": settings.target,
                                                   "plan": str(plan_path.resolve())})
    return DeployResult(out, settings.target, False, MODEL_NAMES, engine)


# ----------------------------------------------------------------------------------------------- inputs

def read_plan(plan_path: Path) -> dict:
    from .plan import load_plan

    if not plan_path.is_file():
        raise UserError(f"plan {plan_path} does not exist; make one with `trtpipe plan MODEL --target T "
                        "--precision P -o plan.json`")
    return load_plan(plan_path).to_dict()


def is_cpu_target(plan: dict) -> bool:
    target = plan.get("target") or {}
    return target.get("kind") == "cpu" or target.get("name") == "cpu"


def check_artifacts(cpu: bool, engine: Path | None, checkpoint: Path | None) -> tuple[Path | None, Path | None]:
    if cpu:
        if checkpoint is None:
            raise UserError("the cpu target serves the checkpoint with the reference runtime: pass "
                            "--checkpoint DIR (a `trtpipe convert` or `trtpipe calibrate` output)")
        checkpoint = checkpoint.resolve()
        if not (checkpoint / "config.json").is_file() or not list(checkpoint.glob("rank*.safetensors")):
            raise UserError(f"{checkpoint} is not a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors); "
                            "make one with `trtpipe convert`")
        return None, checkpoint
    if engine is None:
        raise UserError("a GPU target serves a TensorRT-LLM engine: pass --engine DIR (the directory "
                        "`trtpipe compile` writes to; it need not exist yet)")
    engine = engine.resolve()
    if engine.exists() and not engine.is_dir():
        raise UserError(f"--engine {engine} is a file; pass the engine directory")
    return engine, checkpoint.resolve() if checkpoint else None


def find_tokenizer(tokenizer: Path | None, checkpoint: Path | None, engine: Path | None) -> Path:
    """The directory whose tokenizer files go into the repository."""
    candidates = [tokenizer] if tokenizer else [d / "tokenizer" for d in (checkpoint, engine) if d]
    for directory in candidates:
        if directory and any((Path(directory) / name).is_file() for name in TOKENIZER_FILES[:2]):
            return Path(directory).resolve()
    looked = ", ".join(str(c) for c in candidates) or "nowhere"
    raise UserError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) found (looked in {looked}); "
                    "pass --tokenizer DIR, e.g. the Hugging Face model directory")


def settings_from_plan(plan: dict, engine: Path | None) -> DeploySettings:
    triton = dict(plan.get("triton") or {})
    build = dict(plan.get("build_config") or {})
    target = (plan.get("target") or {}).get("name", "?")
    cpu = is_cpu_target(plan)
    max_batch = int(triton.get("triton_max_batch_size") or build.get("max_batch_size") or 0)
    if max_batch < 1:
        raise UserError("the plan names no batch size (triton.triton_max_batch_size or "
                        "build_config.max_batch_size); re-run `trtpipe plan`")
    preferred = tuple(int(b) for b in triton.get("preferred_batch_size") or ())
    too_big = [b for b in preferred if not 1 <= b <= max_batch]
    if too_big:
        raise UserError(f"the plan's preferred_batch_size {list(preferred)} has sizes outside 1..{max_batch} "
                        "(triton_max_batch_size); re-run `trtpipe plan`")
    return DeploySettings(
        target=target, cpu=cpu, max_batch_size=max_batch, preferred_batch_sizes=preferred,
        max_queue_delay_microseconds=int(triton.get("max_queue_delay_microseconds") or 0),
        max_queue_size=int(triton.get("max_queue_size") or 0),
        decoupled=bool(triton.get("decoupled_mode", True)),
        preprocessing_instances=int(triton.get("preprocessing_instance_count") or 1),
        postprocessing_instances=int(triton.get("postprocessing_instance_count") or 1),
        bls_instances=int(triton.get("bls_instance_count") or 1),
        max_seq_len=int(plan["max_seq_len"]),
        logits_dtype=str(triton.get("logits_datatype") or "TYPE_FP32"),
        exclude_input_in_output=bool(triton.get("exclude_input_in_output", False)),
        trtllm_parameters={} if cpu else gpu_trtllm_parameters(triton, build, plan, engine),
    )


def gpu_trtllm_parameters(triton: dict, build: dict, plan: dict, engine: Path | None) -> dict[str, str]:
    """The tensorrtllm backend's parameters: the plan's, the backend defaults for the rest, the engine path."""
    unknown = sorted(k for k in triton if k not in TRTLLM_PARAMETERS and k not in CONFIG_FIELD_KEYS)
    if unknown:
        raise UserError(f"the plan's triton section has keys the tensorrt_llm model does not know: "
                        f"{', '.join(unknown)}")
    params = dict(TRTLLM_PARAMETER_DEFAULTS)
    params["gpt_model_type"] = str(triton.get("batching_strategy") or params["gpt_model_type"])
    params["max_beam_width"] = str(int(build.get("max_beam_width") or 1))
    for key, value in triton.items():
        if key in TRTLLM_PARAMETERS and value is not None:
            params[key] = parameter_string(value)
    params["gpt_model_path"] = str(engine)
    wants_paged_fmha = [k for k in ("enable_kv_cache_reuse", "enable_chunked_context") if params[k] == "true"]
    plugins = plan.get("plugin_config") or {}
    if wants_paged_fmha and plugins.get("use_paged_context_fmha") is False:
        raise UserError(f"the plan sets {' and '.join(wants_paged_fmha)} but builds the engine without "
                        "use_paged_context_fmha; re-run `trtpipe plan` (both need paged context FMHA)")
    return params


def parameter_string(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(parameter_string(v) for v in value)
    return str(value)


# ------------------------------------------------------------------------------------------ the configs

def model_specs(s: DeploySettings) -> list[ModelSpec]:
    tokenizer = {"tokenizer_dir": "tokenizer"}
    if s.cpu:
        trtllm = ModelSpec("tensorrt_llm", s.max_batch_size, TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS,
                           backend="python", batching=s.batching(), decoupled=s.decoupled, instance_count=1,
                           parameters={"checkpoint_dir": "checkpoint", "max_seq_len": str(s.max_seq_len),
                                       "exclude_input_in_output": parameter_string(s.exclude_input_in_output)})
    else:
        trtllm = ModelSpec("tensorrt_llm", s.max_batch_size, TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS,
                           backend="tensorrtllm", batching=s.batching(), decoupled=s.decoupled, instance_count=1,
                           parameters=s.trtllm_parameters)
    return [
        ModelSpec("ensemble", s.max_batch_size, ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, platform="ensemble",
                  steps=ENSEMBLE_STEPS),
        ModelSpec("preprocessing", s.max_batch_size, PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS, backend="python",
                  batching=s.batching(), instance_count=s.preprocessing_instances,
                  parameters={**tokenizer, "add_special_tokens": "true"}),
        trtllm,
        ModelSpec("postprocessing", s.max_batch_size, POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS,
                  backend="python", batching=Batching(), instance_count=s.postprocessing_instances,
                  parameters={**tokenizer, "skip_special_tokens": "true"}),
        ModelSpec("tensorrt_llm_bls", s.max_batch_size, ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, backend="python",
                  decoupled=s.decoupled, instance_count=s.bls_instances,
                  parameters={"tensorrt_llm_model_name": "tensorrt_llm", "accumulate_tokens": "false"}),
    ]


# ------------------------------------------------------------------------------------------- the files

def model_source_files(cpu: bool) -> list[Path]:
    """The model.py files deploy copies from the package's data/model_repo/."""
    names = ["preprocessing", "postprocessing", "tensorrt_llm_bls"] + (["tensorrt_llm"] if cpu else [])
    files = [MODEL_SOURCES / name / "1" / "model.py" for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"trtpipe's model sources are missing ({', '.join(missing)}); reinstall trtpipe")
    return files


def write_repository(repo: Path, s: DeploySettings, tokenizer_dir: Path, checkpoint: Path | None,
                     runtime_files: list[Path]) -> None:
    for spec in model_specs(s):
        model_dir = repo / spec.name
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(to_pbtxt(build_model_config(spec, s.logits_dtype)))
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        shutil.copyfile(MODEL_SOURCES / name / "1" / "model.py", repo / name / "1" / "model.py")
    for name in ("preprocessing", "postprocessing"):
        copy_tokenizer(tokenizer_dir, repo / name / "1" / "tokenizer")
    (repo / "tensorrt_llm_bls" / "1" / "wiring.json").write_text(json.dumps(bls_wiring(), indent=2) + "\n")
    if s.cpu:
        version_dir = repo / "tensorrt_llm" / "1"
        shutil.copyfile(MODEL_SOURCES / "tensorrt_llm" / "1" / "model.py", version_dir / "model.py")
        copy_checkpoint(checkpoint, version_dir / "checkpoint")
        copy_runtime(runtime_files, version_dir)


def bls_wiring() -> dict:
    """The ensemble's step maps, for tensorrt_llm_bls to call the same models the same way."""
    return {step.model_name: {"input_map": step.input_map, "output_map": step.output_map}
            for step in ENSEMBLE_STEPS}


def copy_tokenizer(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(dest)
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        raise UserError(f"the tokenizer in {source} does not load ({type(exc).__name__}: {exc}); "
                        "pass --tokenizer with a Hugging Face model directory") from None


def copy_checkpoint(checkpoint: Path, dest: Path) -> None:
    """config.json and the rank files; hard links when the file system allows (checkpoints are big)."""
    dest.mkdir(parents=True)
    for f in [checkpoint / "config.json", *sorted(checkpoint.glob("rank*.safetensors"))]:
        try:
            (dest / f.name).hardlink_to(f)
        except OSError:
            shutil.copyfile(f, dest / f.name)


def runtime_closure() -> list[Path]:
    """`pipeline/__init__.py`, `pipeline/runtime/**.py` and every pipeline module they import, transitively."""
    runtime = PACKAGE_DIR / "runtime"
    if not (runtime / "__init__.py").is_file():
        raise UserError("trtpipe's reference runtime (pipeline/runtime) is missing; the cpu target needs it")
    todo = [PACKAGE_DIR / "__init__.py", *sorted(runtime.rglob("*.py"))]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(pipeline_imports(path))
    return sorted(seen)


def pipeline_imports(path: Path) -> list[Path]:
    """Files of the `pipeline` package that the module at `path` imports (absolute or relative)."""
    package = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[tuple[str, ...]] = []
        if isinstance(node, ast.Import):
            targets = [tuple(a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = tuple(node.module.split(".")) if node.module else ()
            if node.level:
                base = package[:len(package) - node.level + 1] + base
            targets = [base] + [base + (a.name,) for a in node.names]
        for parts in targets:
            if parts and parts[0] == "pipeline":
                found.extend(_module_files(parts))
    return found


def _module_files(parts: tuple[str, ...]) -> list[Path]:
    """The file of module `parts` plus the __init__.py of every package on the way."""
    files = []
    for i in range(1, len(parts) + 1):
        base = PACKAGE_DIR.parent.joinpath(*parts[:i])
        if (base / "__init__.py").is_file():
            files.append(base / "__init__.py")
        elif base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
    return files


def copy_runtime(files: list[Path], version_dir: Path) -> None:
    for f in files:
        dest = version_dir / f.relative_to(PACKAGE_DIR.parent)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)


def refuse_if_check_fails(repo: Path, engine: Path | None) -> None:
    """Run `trtpipe check` on the freshly written repository; a plan/engine mismatch stops the deploy."""
    from .check import check_repository

    errors = [f for f in check_repository(repo, engine=engine).findings if f.severity == "error"]
    if errors:
        raise UserError("the repository would not be right for this engine:\n"
                        + "\n".join(f"  {f.describe()}" for f in errors))
