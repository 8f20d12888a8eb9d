"""The backends: which software serves a plan's model, and what each stage does differently because of it.

The plan names its backend (`plan.backend`, a key of `BACKENDS`); plan, build, compile, deploy and
validate dispatch on that name through `backend_for`, never on the target. One module per backend:

- `engine`: a TensorRT-LLM 1.2.1 engine (trtllm-build) in Triton's `tensorrtllm` backend (GPU targets);
- `reference`: trtpipe's reference runtime serving the checkpoint from a Triton Python model (the cpu target);
  `reference-onnx`: the same model computing with ONNX Runtime over the checkpoint's ONNX export;
- `pytorch`: TensorRT-LLM's LLM API serving the Hugging Face model with no compile step (GPU targets), in
  Triton's llmapi layout or trtllm-serve; `reference-llmapi`: the same llmapi contract on the cpu target.

`base.Backend` is what a backend provides. Adding one is a module with a `BACKEND` object and an entry here.
"""

from __future__ import annotations

from ..errors import UserError
from ..targets import Target
from .base import ENGINE, REFERENCE, Backend
from .engine import BACKEND as _ENGINE
from .pytorch import BACKEND as _PYTORCH
from .pytorch import REFERENCE_BACKEND as _REFERENCE_LLMAPI
from .reference import BACKEND as _REFERENCE
from .reference import ONNX_BACKEND as _REFERENCE_ONNX

BACKENDS: dict[str, Backend] = {b.name: b for b in (_ENGINE, _REFERENCE, _PYTORCH, _REFERENCE_LLMAPI,
                                                    _REFERENCE_ONNX)}
#: The backend a target kind gets when the plan request names none.
DEFAULT_BACKEND = {"gpu": ENGINE, "cpu": REFERENCE}


def backend_for(name: str) -> Backend:
    """The backend called `name` (a plan's `backend`); UserError for a name trtpipe does not know."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UserError(f"unknown backend {name!r}; trtpipe knows {', '.join(BACKENDS)}") from None


def default_backend(target: Target) -> str:
    return DEFAULT_BACKEND[target.kind]


def backend_serving(name: str | None, target: Target) -> Backend:
    """The backend called `name` (None: the target's default) if it serves `target`; UserError naming the
    backends that do, and the one among them with the same repository layout (request contract)."""
    backend = backend_for(name or default_backend(target))
    if target.kind in backend.target_kinds:
        return backend
    serving = [b for b in BACKENDS.values() if target.kind in b.target_kinds]
    same = [b.name for b in serving if b.layout == backend.layout]
    hint = f" ({same[0]} serves the same {backend.layout} request contract there)" if same else ""
    raise UserError(f"the {backend.name} backend does not serve {target.kind} targets such as {target.name} "
                    f"({backend.summary}); for {target.name} use --backend "
                    f"{' | '.join(b.name for b in serving)}{hint}")


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "ENGINE", "REFERENCE", "Backend", "backend_for", "backend_serving",
           "default_backend"]
