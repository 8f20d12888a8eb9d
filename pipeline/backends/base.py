"""What a backend provides, and the few things the backends share.

A backend is the software that serves a plan's model inside Triton as the `tensorrt_llm` model; the
plan names it (`plan.backend`) and every stage after planning dispatches on that name through
`pipeline.backends.backend_for`, never on the target:

- plan: the backend's planner turns a checked request (`PlanRequest`) into a `Plan`;
- build: `build_artifact` makes what the backend serves besides the checkpoint (the engine backend
  compiles an engine; the reference backend builds nothing); `checkpoint_format` says which checkpoint
  `trtpipe build` deploys (the pytorch backend: the Hugging Face one);
- deploy: `check_artifacts`, `repository_inputs`, `model_parameters` and `write_model` give the
  `tensorrt_llm` model its backend, parameters and files; the other four models are the same for all;
- serve: `serve_command` is how Triton is started for the repository (one process, or one per GPU rank).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .names import MODEL_REPOSITORY, PORTS

if TYPE_CHECKING:
    from ..compile import CompileResult
    from ..plan import Plan
    from ..plan.policy import PlanRequest

class Backend(Protocol):
    """One backend: its planner, its build step and its part of the model repository."""

    name: str                        # plan.json's `backend`
    triton_backend: str              # the Triton backend of the `tensorrt_llm` model
    target_kinds: tuple[str, ...]    # the target kinds it plans for ("gpu", "cpu")
    builds_engine: bool              # compiles a TensorRT-LLM engine (trtllm-build) that the repository names
    exact_checkpoint_dtype: bool     # serves a checkpoint in its own dtype (an engine is built in it)
    serves_embedded: bool            # trtpipe's embedded Triton server (this machine) can serve it
    memory_scope: str                # whose memory the plan budgets: "per GPU" | "host"
    layout: str                      # the repository: INFLIGHT_BATCHER (five models) | "llmapi" (pytorch.py)
    checkpoint_format: str           # deploy's --checkpoint: TRTLLM_CHECKPOINT | HF_CHECKPOINT
    batching: str                    # STATIC_BATCHING | INFLIGHT_BATCHING
    request_priorities: bool         # its scheduler starts a request by its `priority` (Triton's priority levels)
    sparse_kernels: bool             # can run 2:4 weights on sparse kernels (TensorRT's SPARSE_WEIGHTS tactics)
    #: the environment variable naming the iterations its runtime brackets with cudaProfilerStart/Stop (nsys
    #: --capture-range=cudaProfilerApi; trtpipe profile); None: no CUDA runtime to profile (the cpu target)
    profile_start_stop_env: str | None
    #: the speculative decoding it runs (pipeline/plan/speculative.py's methods) -> what its upstream names it
    #: (trtllm-build's --speculative_decoding_mode, the LLM API's config class, or the cpu runtimes' drafter)
    speculative_methods: dict[str, str]
    #: draft-target as NVIDIA's Triton deploys it: the draft's engine in a second tensorrt_llm model
    #: (TENSORRT_LLM_DRAFT) that tensorrt_llm_bls calls (deploy --draft-engine); else the draft is in the
    #: tensorrt_llm model (`write_draft_model`) or the LLM API configuration
    drafts_through_bls: bool
    summary: str                     # one line for people: what serves the model

    def plan(self, request: PlanRequest) -> Plan:
        """The plan for a request `make_plan` has checked; UserError for anything that cannot work."""

    def checkpoint_dtype(self, plan: Plan) -> str:
        """The float dtype the checkpoint for `plan` is converted to."""

    def build_artifact(self, checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool,
                       force: bool) -> CompileResult | None:
        """Build what the backend serves besides the checkpoint into `out`; None: nothing to build."""

    def check_artifacts(self, engine: Path | None, checkpoint: Path | None) -> tuple[Path | None, Path | None]:
        """deploy's --engine and --checkpoint, checked and resolved (UserError names what is missing)."""

    def repository_inputs(self, engine: Path | None, checkpoint: Path | None) -> list[Path]:
        """The files deploy reads for this backend's `tensorrt_llm` model (its manifest fingerprints them)."""

    def model_parameters(self, plan: Plan, engine: Path | None) -> dict[str, str]:
        """The `tensorrt_llm` model's config.pbtxt parameters."""

    def write_model(self, version_dir: Path, checkpoint: Path | None) -> None:
        """Files of the `tensorrt_llm` model's version directory (`REPO/tensorrt_llm/1`)."""

    def configure_speculation(self, plan: Plan) -> Plan:
        """A GPU plan with speculation planned (pipeline/plan/speculative_gpu.py), configured as this backend's
        upstream takes it (only the GPU backends that speculate)."""

    def write_draft_model(self, version_dir: Path, draft: Path) -> None:
        """A draft-target plan's draft checkpoint, as this backend serves it, into the version directory (only the
        backends whose plans draft with a model: pipeline/plan/speculative.py)."""

    def serve_command(self, plan: Plan, model_repository: str = MODEL_REPOSITORY,
                      extra_args: tuple[str, ...] = ()) -> list[str]:
        """The command that serves the repository of `plan` in the trtpipe image (NVIDIA's Triton container)
        (argv; `model_repository` where it lies; `extra_args` for every tritonserver it starts)."""


def shell_command(argv: list[str] | tuple[str, ...]) -> str:
    """argv as one shell line, every word quoted except the $MODEL_REPOSITORY it expands."""
    def word(arg: str) -> str:
        pieces = arg.split(MODEL_REPOSITORY)
        return f'"{MODEL_REPOSITORY}"'.join(shlex.quote(p) if p else "" for p in pieces)
    return " ".join(word(a) for a in argv)


def tritonserver_args(model_repository: str, rank: int = 0, extra_args: tuple[str, ...] = ()) -> list[str]:
    """One tritonserver as NVIDIA's launch_triton_server.py starts it: NVIDIA's configs are complete (no
    auto-complete) and each MPI rank's Python models get their own shared-memory prefix."""
    return ["tritonserver", f"--model-repository={model_repository}", "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
            *(f"--{name}-port={port}" for name, port in PORTS.items()), *extra_args]


def parameter_string(value) -> str:
    """A config.pbtxt parameter value: booleans as true/false, lists comma-separated."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(parameter_string(v) for v in value)
    return str(value)
