"""The `reference-llmapi` backend: the llmapi request contract (NVIDIA's triton_backend/all_models/llmapi, one
`tensorrt_llm` model; pytorch.py defines it) on the cpu target, served by trtpipe's reference runtime from
model_repo/llmapi/tensorrt_llm/1/model.py over the TensorRT-LLM checkpoint, so the contract the GPU's pytorch
backend serves is validated live here.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from .. import TRTLLM_VERSION
from ..errors import UserError
from ..plan.policy import PlanRequest
from ..plan.schema import LlmApiSettings, Plan
from . import reference
from .base import tritonserver_args
from .names import MODEL_REPOSITORY, REFERENCE_LLMAPI, STATIC_BATCHING, TRTLLM_CHECKPOINT
from .pytorch import LLMAPI, LLMAPI_MODEL_SOURCE
from .reference import CHECKPOINT_DIR, copy_checkpoint, copy_runtime, plan_reference, runtime_closure


class ReferenceLlmapiBackend:
    name = REFERENCE_LLMAPI
    triton_backend = "python"
    target_kinds = ("cpu",)
    builds_engine = False
    exact_checkpoint_dtype = False
    serves_embedded = True
    memory_scope = "host"
    layout = LLMAPI
    batching = STATIC_BATCHING
    request_priorities = False   # its cpu model generates each batch to its end, in arrival order
    sparse_kernels = False       # the reference runtime's dense matmuls
    profile_start_stop_env = None
    checkpoint_format = TRTLLM_CHECKPOINT
    summary = "the llmapi request contract served by trtpipe's reference runtime from a Triton Python model"
    speculative_methods: dict[str, str] = {}   # its cpu model generates plainly
    drafts_through_bls = False

    def plan(self, request: PlanRequest) -> Plan:
        base = plan_reference(request)
        options = {"max_batch_size": base.triton.triton_max_batch_size, "max_seq_len": base.max_seq_len}
        return replace(base, backend=REFERENCE_LLMAPI,
                       llm_api=LlmApiSettings(TRTLLM_VERSION, options, {}))

    def checkpoint_dtype(self, plan: Plan) -> str:
        return reference.BACKEND.checkpoint_dtype(plan)

    def build_artifact(self, checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool, force: bool) -> None:
        """Nothing to build: the checkpoint is served as it is."""
        return None

    def check_artifacts(self, engine: Path | None, checkpoint: Path | None) -> tuple[Path | None, Path | None]:
        return reference.BACKEND.check_artifacts(engine, checkpoint)

    def repository_inputs(self, engine: Path | None, checkpoint: Path | None) -> list[Path]:
        if not LLMAPI_MODEL_SOURCE.is_file():
            raise UserError(f"trtpipe's model source {LLMAPI_MODEL_SOURCE} is missing; reinstall trtpipe")
        return [LLMAPI_MODEL_SOURCE, *runtime_closure(model=LLMAPI_MODEL_SOURCE), checkpoint]

    def model_parameters(self, plan: Plan, engine: Path | None) -> dict[str, str]:
        return {}

    def write_model(self, version_dir: Path, checkpoint: Path | None) -> None:
        """model.py, the checkpoint and the runtime package with what model.py imports (pipeline/triton_names.py
        among it: the files `package_data.copy_model_support` ships beside trtpipe's other models)."""
        shutil.copyfile(LLMAPI_MODEL_SOURCE, version_dir / "model.py")
        copy_checkpoint(checkpoint, version_dir / CHECKPOINT_DIR)
        copy_runtime(runtime_closure(model=LLMAPI_MODEL_SOURCE), version_dir)

    def serve_command(self, plan: Plan, model_repository: str = MODEL_REPOSITORY,
                      extra_args: tuple[str, ...] = ()) -> list[str]:
        return tritonserver_args(model_repository, 0, ("--allow-gpu-metrics=false", *extra_args))


BACKEND = ReferenceLlmapiBackend()
