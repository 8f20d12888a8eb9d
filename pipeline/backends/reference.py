"""The reference backend: trtpipe's reference runtime serves the TensorRT-LLM checkpoint from a Triton
Python-backend `tensorrt_llm` model (the cpu target; no engine, nothing to build).

- plan: float32 weights and KV cache in host memory, small dynamic batches (`plan_reference`);
- build: nothing (the checkpoint is what it serves);
- deploy: `REPO/tensorrt_llm/1` gets model_repo/tensorrt_llm/1/model.py, the checkpoint
  (`checkpoint/`, hard links when possible) and the runtime package (`pipeline/`, exactly the modules
  `pipeline.runtime` and model.py import: `runtime_closure`), so the server's Python needs torch, safetensors,
  numpy and transformers but not trtpipe itself.

`reference-onnx` is the same repository with the onnxruntime runtime: deploy exports the checkpoint
(`trtpipe export-onnx`) into `REPO/tensorrt_llm/1/onnx` and copies pipeline/onnx/runner.py beside the
runtime, and the same model.py generates with `OrtDecoder` (ONNX Runtime) instead of `ReferenceModel`;
`trtpipe deploy --runtime onnxruntime` picks it for a reference plan.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import replace
from pathlib import Path

from ..errors import UserError
from ..outputs import link_or_copy
from ..triton_names import GUARANTEED_NO_EVICT, TENSORRT_LLM
from ..runtime.speculative import (DRAFT, DRAFT_DIR, MAX_DRAFT_LEN, MAX_MATCHING_NGRAM_SIZE, NGRAM,
                                   SPECULATIVE_DECODING_MODE, SPECULATIVE_MAX_ROWS)
from ..plan.memory import (
    CUDA_CONTEXT_RESERVE,
    format_gib,
    kv_bytes_per_token,
    prefill_seconds,
    roofline,
    weights_per_rank_by_stage,
)
from ..plan.host_timing import host_timing, timed_performance
from ..plan.policy import PlanRequest, latency_batch_cap, queue_bound
from ..onnx import in_place_fits
from ..plan.schema import MemoryBudget, ModelArch, Plan, TritonParams
from ..plan.speculative import served_by
from ..plan.trtllm import TOKENS_PER_BLOCK, quantization
from ..precisions import FLOAT_DTYPES, KV_CACHE_QUANT_ALGO, QUANT_ALGO
from ..host import serving_threads
from .base import parameter_string, tritonserver_args
from ..package_data import MODEL_SOURCES, PACKAGE_DIR
from .names import (
    INFLIGHT_BATCHER,
    MODEL_REPOSITORY,
    REFERENCE,
    REFERENCE_ONNX,
    RUNTIMES,
    INFLIGHT_BATCHING,
    TRTLLM_CHECKPOINT,
)

TRITON_BACKEND = "python"
#: Triton's dynamic batcher waits 1 ms to hand the Python model the requests that arrive together in one execute
#: call (their prompts are then prefilled in one admission); the model batches in flight beyond that.
QUEUE_DELAY_US = 1000
#: The `tensorrt_llm` model's source, copied into REPO/tensorrt_llm/1/.
MODEL_SOURCE = MODEL_SOURCES / TENSORRT_LLM / "1" / "model.py"
CHECKPOINT_DIR = "checkpoint"
ONNX_DIR = "onnx"
#: draft-target: the draft's checkpoint (reference) or ONNX export (reference-onnx)
DRAFT_MODEL_DIR = "draft"
#: What the onnxruntime runtime imports besides pipeline/runtime (copied into the repository).
ORT_RUNNER = PACKAGE_DIR / "onnx" / "runner.py"
#: What writes the repository's ONNX export (not copied: the served model needs onnxruntime, not onnx). Inputs of the
#: repository all the same, so a trtpipe whose graph changed exports anew instead of keeping an older graph.
ONNX_EXPORT = PACKAGE_DIR / "onnx" / "export.py"


class ReferenceBackend:
    name = REFERENCE
    triton_backend = TRITON_BACKEND
    target_kinds = ("cpu",)
    builds_engine = False
    exact_checkpoint_dtype = False   # any checkpoint dtype, computed in float32
    serves_embedded = True
    memory_scope = "host"
    layout = INFLIGHT_BATCHER
    batching = INFLIGHT_BATCHING
    request_priorities = True    # pipeline/runtime/scheduler.py
    sparse_kernels = False       # torch / ONNX Runtime dense matmuls: a 2:4 checkpoint runs as its zeros
    profile_start_stop_env = None   # no CUDA: trtpipe profile records torch's profiler instead
    checkpoint_format = TRTLLM_CHECKPOINT
    summary = "no engine: trtpipe's reference runtime serves the checkpoint from a Triton Python model"
    #: the cpu model's drafters (pipeline/runtime/speculative.py, draft_model.py)
    speculative_methods = {NGRAM: "prompt lookup", DRAFT: "draft model"}
    drafts_through_bls = False

    def plan(self, request: PlanRequest) -> Plan:
        return plan_reference(request)

    def drafting_rows(self, arch: ModelArch) -> int | None:
        """The most rows a step that drafts may have whatever the timings say: no bound (torch verifies any rows)."""
        return None

    def checkpoint_dtype(self, plan: Plan) -> str:
        """fp16/bf16/fp32 name it; quantized checkpoints are float32, the dtype the runtime computes in."""
        return FLOAT_DTYPES.get(plan.precision, "float32")

    def build_artifact(self, checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool, force: bool) -> None:
        """Nothing to build: the checkpoint is served as it is."""
        return None

    def check_artifacts(self, engine: Path | None, checkpoint: Path | None) -> tuple[Path | None, Path | None]:
        if checkpoint is None:
            raise UserError("the reference backend (the cpu target) serves the checkpoint with the reference "
                            "runtime: pass --checkpoint DIR (a `trtpipe convert` or `trtpipe calibrate` output)")
        checkpoint = Path(checkpoint).resolve()
        if not (checkpoint / "config.json").is_file() or not list(checkpoint.glob("rank*.safetensors")):
            raise UserError(f"{checkpoint} is not a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors); "
                            "make one with `trtpipe convert`")
        return None, checkpoint

    def repository_inputs(self, engine: Path | None, checkpoint: Path | None) -> list[Path]:
        if not MODEL_SOURCE.is_file():
            raise UserError(f"trtpipe's model source {MODEL_SOURCE} is missing; reinstall trtpipe")
        return [MODEL_SOURCE, *runtime_closure(model=MODEL_SOURCE), checkpoint]

    def model_parameters(self, plan: Plan, engine: Path | None) -> dict[str, str]:
        triton = plan.triton
        scheduler = {"batch_scheduler_policy": triton.batch_scheduler_policy or GUARANTEED_NO_EVICT,
                     **{name: str(value) for name in ("max_tokens_in_paged_kv_cache", "tokens_per_block",
                                                      "max_num_tokens")
                        if (value := getattr(triton, name)) is not None}}
        return {**scheduler, "checkpoint_dir": CHECKPOINT_DIR, "max_seq_len": str(plan.max_seq_len),
                "exclude_input_in_output": parameter_string(plan.triton.exclude_input_in_output),
                # as the engine repository writes it (NVIDIA's default): greedy log probs are then 0
                "normalize_log_probs": "true", **speculative_parameters(plan)}

    def serve_command(self, plan: Plan, model_repository: str = MODEL_REPOSITORY,
                      extra_args: tuple[str, ...] = ()) -> list[str]:
        """One tritonserver whose Python backend has torch and trtpipe (the trtpipe image); on a machine
        with trtpipe's venv, `trtpipe serve REPO` runs the embedded one instead."""
        return tritonserver_args(model_repository, 0, ("--allow-gpu-metrics=false", *extra_args))

    def write_model(self, version_dir: Path, checkpoint: Path | None) -> None:
        shutil.copyfile(MODEL_SOURCE, version_dir / "model.py")
        copy_checkpoint(checkpoint, version_dir / CHECKPOINT_DIR)
        copy_runtime(runtime_closure(model=MODEL_SOURCE), version_dir)

    def write_draft_model(self, version_dir: Path, draft: Path) -> None:
        copy_checkpoint(draft, version_dir / DRAFT_MODEL_DIR)


def speculative_parameters(plan: Plan) -> dict[str, str]:
    """The cpu model's speculative decoding (none without --speculative): the method, K, the most running rows it
    drafts for (the plan's break-even), and prompt lookup's longest n-gram or where the draft model lies."""
    spec = plan.speculative
    if spec is None:
        return {}
    drafting = ({DRAFT_DIR: DRAFT_MODEL_DIR} if spec.draft_checkpoint else
                {MAX_MATCHING_NGRAM_SIZE: str(spec.max_ngram)})
    return {SPECULATIVE_DECODING_MODE: spec.method, MAX_DRAFT_LEN: str(spec.draft_len),
            SPECULATIVE_MAX_ROWS: str(spec.max_rows), **drafting}


class ReferenceOnnxBackend(ReferenceBackend):
    name = REFERENCE_ONNX
    summary = "no engine: ONNX Runtime serves the checkpoint's ONNX export from a Triton Python model"

    def plan(self, request: PlanRequest) -> Plan:
        return with_runtime(plan_reference(request), "onnxruntime")

    def drafting_rows(self, arch: ModelArch) -> int | None:
        """One where the served export writes its cache in place (`in_place_fits`): ONNX Runtime verifies several
        tokens after a cache for one row per run (pipeline/onnx/inplace.py)."""
        return 1 if in_place_fits(arch) else None

    def repository_inputs(self, engine: Path | None, checkpoint: Path | None) -> list[Path]:
        return [MODEL_SOURCE, *runtime_closure((ORT_RUNNER, ONNX_EXPORT), model=MODEL_SOURCE), checkpoint]

    def model_parameters(self, plan: Plan, engine: Path | None) -> dict[str, str]:
        parameters = {key: value for key, value in super().model_parameters(plan, engine).items()
                      if key != "checkpoint_dir"}
        return {**parameters, "runtime": "onnxruntime", "onnx_dir": ONNX_DIR}

    def write_model(self, version_dir: Path, checkpoint: Path | None) -> None:
        from ..onnx.export import export_onnx, serving_options

        shutil.copyfile(MODEL_SOURCE, version_dir / "model.py")
        export_onnx(checkpoint, version_dir / ONNX_DIR, serving_options(checkpoint))
        copy_runtime(runtime_closure((ORT_RUNNER,), model=MODEL_SOURCE), version_dir)

    def write_draft_model(self, version_dir: Path, draft: Path) -> None:
        from ..onnx.export import export_onnx, serving_options

        export_onnx(draft, version_dir / DRAFT_MODEL_DIR, serving_options(draft))


BACKEND = ReferenceBackend()
ONNX_BACKEND = ReferenceOnnxBackend()


def with_runtime(plan: Plan, runtime: str) -> Plan:
    """`plan` (the cpu target's) served with `runtime` (a key of RUNTIMES): its backend for that runtime."""
    if plan.backend not in RUNTIMES.values():
        raise UserError(f"--runtime {runtime} applies to the cpu target's reference runtime; this plan's backend is "
                        f"{plan.backend!r} (plan for --target cpu)")
    backend = RUNTIMES[runtime]
    spec = plan.speculative and served_by(plan.speculative, backend, plan.model.arch)
    return replace(plan, backend=backend, speculative=spec)


# ----------------------------------------------------------------------------------------------
# The plan


def plan_reference(request: PlanRequest) -> Plan:
    """The reference runtime serves the checkpoint in float32 on the host: no engine, small dynamic batches."""
    model, target, precision, kv_dtype = request.model, request.target, request.precision, request.kv_cache_dtype
    workload, overrides, max_context, warnings = (request.workload, request.overrides, request.max_context,
                                                  list(request.warnings))
    arch = model.arch
    if overrides.opt_num_tokens or overrides.multiple_profiles is not None \
            or overrides.use_paged_context_fmha is not None or overrides.enable_kv_cache_reuse \
            or overrides.kv_cache_free_gpu_mem_fraction is not None:
        raise UserError("engine options (--opt-num-tokens, --multiple-profiles, "
                        "--paged-context-fmha, --kv-cache-reuse, --kv-cache-free-gpu-mem-fraction) "
                        f"contradict --target {target.name}, whose {REFERENCE} backend builds no engine")
    if overrides.max_num_tokens is not None and overrides.max_num_tokens < 1:
        raise UserError("--max-num-tokens must be at least 1")
    stages = weights_per_rank_by_stage(arch, "fp32", "float32", 1, 1)
    weights = stages[0]
    kv_per_token = kv_bytes_per_token(arch, "float32", 1, 1)
    draft = request.companion        # a draft model (pipeline/plan/speculative.py host_companion)
    draft_weights, draft_kv = (draft.weights_bytes_per_rank, draft.kv_bytes_per_token) if draft else (0, 0)
    memory = target.memory_bytes
    reserve = CUDA_CONTEXT_RESERVE   # Python, PyTorch and Triton processes
    if weights + draft_weights + reserve >= memory:
        beside = f" beside its draft's {format_gib(draft_weights)}" if draft else ""
        raise UserError(f"{model.name} needs {format_gib(weights)} of float32 weights in the reference "
                        f"runtime{beside}; the cpu target assumes {format_gib(memory)} of host memory. Use a GPU "
                        "target")
    batch = overrides.max_batch_size or min(workload.concurrency or target.triton_max_batch_size,
                                            target.triton_max_batch_size)
    if workload.concurrency and overrides.max_batch_size and overrides.max_batch_size < workload.concurrency:
        raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --concurrency {workload.concurrency}")
    free = memory - weights - draft_weights - reserve
    # whole blocks of the scheduler's pool; a draft keeps a row of its own cache for each of the target's
    kv_tokens = free // (kv_per_token + draft_kv) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
    if kv_tokens < max_context:
        raise UserError(f"no room for one sequence of {max_context} tokens of float32 KV cache in "
                        f"{format_gib(free)} of host memory left; lower --max-context")
    fit = kv_tokens // (workload.input_len + workload.output_len)
    concurrent = max(1, min(batch, fit))
    prefill_s = prefill_seconds(arch, workload.input_len, "fp32", 1, target)
    if workload.p99_latency_s is not None:
        cap = latency_batch_cap(workload.p99_latency_s, prefill_s, workload, weights,
                                workload.input_len + workload.output_len / 2, kv_per_token, target)
        batch = min(batch, cap)
        concurrent = min(concurrent, batch)
    if precision in QUANT_ALGO:
        warnings.append(f"cpu target: the reference runtime computes in float32 and simulates {precision} "
                        "from the checkpoint's scales")
    triton = TritonParams(
        triton_backend=TRITON_BACKEND, triton_max_batch_size=batch, decoupled_mode=True,
        max_queue_delay_microseconds=QUEUE_DELAY_US, **queue_bound(batch),
        preferred_batch_size=[batch], batch_scheduler_policy=overrides.batch_scheduler_policy or GUARANTEED_NO_EVICT,
        max_tokens_in_paged_kv_cache=kv_tokens, tokens_per_block=TOKENS_PER_BLOCK,
        # a step's tokens: by default any prompt the context allows, prefilled in one step (no chunked context)
        max_num_tokens=overrides.max_num_tokens or max_context,
        priority_levels=overrides.priority_levels or 0, default_priority_level=overrides.default_priority_level or (
            overrides.priority_levels or 0))
    budget = MemoryBudget(
        memory_bytes=memory, weights_bytes_per_rank=weights, activation_bytes=0,
        activation_formula="not planned: PyTorch allocates the reference runtime's activations per call",
        activation_basis="the cpu target builds no engine, so nothing is reserved ahead of time",
        runtime_reserve_bytes=reserve, runtime_reserve_formula="1 GiB for the Python/PyTorch/Triton processes",
        free_bytes=free, kv_cache_free_gpu_mem_fraction=1.0, kv_cache_bytes=kv_tokens * kv_per_token,
        kv_cache_tokens=kv_tokens, draft_bytes=draft_weights + kv_tokens * draft_kv)
    roof = roofline(target, workload, weights, kv_per_token, batch, prefill_s)
    timing = host_timing(arch, workload.input_len, workload.output_len, batch, serving_threads())
    return Plan(
        model=model, target=target, backend=REFERENCE, precision=precision, dtype="float32",
        kv_cache_dtype=kv_dtype if kv_dtype in KV_CACHE_QUANT_ALGO else "float32",
        quantization=quantization(precision, kv_dtype),
        tp_size=request.tp, pp_size=request.pp, workload=workload, max_seq_len=max_context, weights_bytes=weights,
        weights_bytes_per_rank=weights,
        kv_bytes_per_token=kv_per_token, max_concurrent_sequences=concurrent, memory=budget, engine=None,
        build_config=None, plugin_config=None, optimization_profiles=[], triton=triton,
        roofline=roof, warnings=warnings, performance=timed_performance(target, workload, batch, timing, roof))


# ----------------------------------------------------------------------------------------------
# The files


def copy_checkpoint(checkpoint: Path, dest: Path) -> None:
    """config.json and the rank files; hard links when the file system allows (checkpoints are big)."""
    dest.mkdir(parents=True)
    for f in [checkpoint / "config.json", *sorted(checkpoint.glob("rank*.safetensors"))]:
        link_or_copy(f, dest / f.name)


def runtime_closure(roots: tuple[Path, ...] = (), model: Path | None = None) -> list[Path]:
    """`pipeline/__init__.py`, `pipeline/runtime/**.py`, `roots`, the pipeline modules `model` (a model.py, not
    itself part of the result) imports at module level (`model_imports`), and every pipeline module they import,
    transitively."""
    runtime = PACKAGE_DIR / "runtime"
    if not (runtime / "__init__.py").is_file():
        raise UserError("trtpipe's reference runtime (pipeline/runtime) is missing; the reference backend needs it")
    todo = [PACKAGE_DIR / "__init__.py", *sorted(runtime.rglob("*.py")), *roots,
            *(model_imports(model) if model is not None else [])]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(pipeline_imports(path))
    return sorted(seen)


def model_imports(model: Path) -> list[Path]:
    """Files of the `pipeline` package that a model.py imports when Triton loads it: its module-level imports (one
    inside a function is a root its backend names, as ORT_RUNNER for the onnxruntime runtime)."""
    tree = ast.parse(Path(model).read_text(), str(model))
    return pipeline_imports(Path(model), [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))])


def pipeline_imports(path: Path, nodes: list | None = None) -> list[Path]:
    """Files of the `pipeline` package that the module at `path` imports (absolute or relative; `nodes`: only
    these import statements of it)."""
    root = PACKAGE_DIR.parent
    package = path.relative_to(root).with_suffix("").parts[:-1] if path.is_relative_to(root) else ()
    if nodes is None:
        nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
    found = []
    for node in nodes:
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
