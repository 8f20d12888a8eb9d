"""The backends: which software serves a plan's model, and what each stage does differently because of it.

The plan names its backend (`plan.backend`, a key of `BACKENDS`); plan, build, compile, deploy and
validate dispatch on that name through `backend_for`, never on the target. One module per backend:

- `engine`: a TensorRT-LLM 1.2.1 engine (trtllm-build) in Triton's `tensorrtllm` backend (GPU targets);
- `reference`: trtpipe's reference runtime serving the checkpoint from a Triton Python model (the cpu target);
  `reference-onnx`: the same model computing with ONNX Runtime over the checkpoint's ONNX export;
- `pytorch`: TensorRT-LLM's LLM API serving the Hugging Face model with no compile step (GPU targets), in
  Triton's llmapi layout or trtllm-serve; `reference_llmapi`: the same llmapi contract on the cpu target.

`base.Backend` is what a backend provides. Adding one is a module with its backend object, its name in
`names.NAMES` and a "module:object" entry in `LOCATIONS`. This module imports only the vocabulary (`names`): a
backend module is imported by name when the backend is first asked for, so the plan's schema and rules, which the
backends build on, can name a backend without an import circle, and a constant costs nothing at start-up.
"""

from __future__ import annotations

import functools
import importlib

from ..errors import UserError
from ..targets import Target
from .names import ENGINE, NAMES, PYTORCH, REFERENCE, REFERENCE_LLMAPI, REFERENCE_ONNX

#: Where each backend object lives, imported when it is first asked for.
LOCATIONS = {
    ENGINE: "pipeline.backends.engine:BACKEND",
    REFERENCE: "pipeline.backends.reference:BACKEND",
    PYTORCH: "pipeline.backends.pytorch:BACKEND",
    REFERENCE_LLMAPI: "pipeline.backends.reference_llmapi:BACKEND",
    REFERENCE_ONNX: "pipeline.backends.reference:ONNX_BACKEND",
}

#: The backend a target kind gets when the plan request names none.
DEFAULT_BACKEND = {"gpu": ENGINE, "cpu": REFERENCE}


@functools.cache
def load(name: str):
    """The backend object (a `base.Backend`) called NAME, its module imported now."""
    module, _, attribute = LOCATIONS[name].partition(":")
    backend = getattr(importlib.import_module(module), attribute)
    if backend.name != name:
        raise AssertionError(f"{LOCATIONS[name]} is the {backend.name} backend, not {name}")
    return backend


def registry() -> dict:
    """Every backend by name, in `names.NAMES` order (each module imported)."""
    return {name: load(name) for name in NAMES}


def __getattr__(name: str):
    if name == "BACKENDS":   # `from pipeline.backends import BACKENDS`: the registry, loaded on first use
        return registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend_for(name: str):
    """The backend (a `base.Backend`) called `name` (a plan's `backend`); UserError for a name trtpipe does not
    know."""
    if name not in LOCATIONS:
        raise UserError(f"unknown backend {name!r}; trtpipe knows {', '.join(NAMES)}")
    return load(name)


def default_backend(target: Target) -> str:
    return DEFAULT_BACKEND[target.kind]


def backend_serving(name: str | None, target: Target):
    """The backend called `name` (None: the target's default) if it serves `target`; UserError naming the
    backends that do, and the one among them with the same repository layout (request contract)."""
    backend = backend_for(name or default_backend(target))
    if target.kind in backend.target_kinds:
        return backend
    serving = [b for b in registry().values() if target.kind in b.target_kinds]
    same = [b.name for b in serving if b.layout == backend.layout]
    hint = f" ({same[0]} serves the same {backend.layout} request contract there)" if same else ""
    raise UserError(f"the {backend.name} backend does not serve {target.kind} targets such as {target.name} "
                    f"({backend.summary}); for {target.name} use --backend "
                    f"{' | '.join(b.name for b in serving)}{hint}")


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "LOCATIONS", "backend_for", "backend_serving", "default_backend",
           "registry"]


def bls_draft_len(plan) -> int | None:
    """K when the deployment of `plan` drafts through tensorrt_llm_bls (draft-target on a backend whose draft is a
    second tensorrt_llm model: its requests carry num_draft_tokens K), else None."""
    from ..runtime.speculative import DRAFT

    spec = plan.speculative
    drafting = spec is not None and spec.method == DRAFT and backend_for(plan.backend).drafts_through_bls
    return spec.draft_len if drafting else None


def not_streamed(plan) -> str | None:
    """Why the deployment of `plan` does not stream (its models are not decoupled), else None."""
    if plan is None or plan.triton.decoupled_mode:
        return None
    if bls_draft_len(plan) is not None:
        return ("the deployment does not stream: draft-target through tensorrt_llm_bls, whose drafting requests "
                "NVIDIA's BLS answers only unstreamed (nothing is decoupled)")
    return "the deployment does not stream: its plan's decoupled_mode is false"
