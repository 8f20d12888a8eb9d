"""The GPU runtime images trtpipe deploys onto, as data (docs/capabilities.md, "Runtime images"): each image's
TensorRT-LLM version and what it serves, with the sources.

- NVIDIA's Triton images `tritonserver:<release>-trtllm-python-py3` carry TensorRT-LLM (Triton's release
  compatibility matrix) and with it the engine path (trtllm-build, the inflight_batcher_llm C++ backend), Triton's
  `llmapi` Python model and trtllm-serve. Only 26.04-26.07 carry 1.2.1, the version trtpipe checked; no later
  Triton image carries TensorRT-LLM at all.
- TensorRT-LLM's own release images `tensorrt-llm/release:<version>` carry trtllm-serve and no Triton. From 1.3 the
  engine path is gone (the capability table's rule engine-removed-1.3) and trtllm-serve's options file is named with
  `--config` (1.2.1: `--extra_llm_api_options`, which 1.3 keeps as an alias).

The planner resolves `--runtime-image` here (the default: `DEFAULT_IMAGE`), asks the capability table with the image's
TensorRT-LLM version, and records the image in the plan; the pytorch backend writes the LLM API options of that
version (checked against `llm_api_args` for it) and, on an image without Triton, a trtllm-serve deployment only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import TRTLLM_TRITON_RELEASES, TRTLLM_VERSION
from ..errors import UserError
from .capabilities import Combination, runtime_refusal
from .llm_api_args import LLM_API_VERSIONS
from .names import ENGINE, LAUNCH_SCRIPT, PYTORCH

#: What an image serves: trtpipe's inflight_batcher_llm repository of a TensorRT engine on tritonserver with NVIDIA's
#: tensorrtllm backend; Triton's llmapi Python model; TensorRT-LLM's own OpenAI server.
ENGINE_REPOSITORY, LLMAPI_MODEL, TRTLLM_SERVE = "engine repository", "llmapi model", "trtllm-serve"
TRITON_SOURCE = ("triton-inference-server/server docs/introduction/compatibility.md @ e1db8a60 (the -trtllm-python-py3 "
                 "images and their TensorRT-LLM)")
RELEASE_IMAGE_SOURCE = ("NVIDIA/TensorRT-LLM docker/release images nvcr.io/nvidia/tensorrt-llm/release:<version>; "
                        "tensorrt_llm/commands/serve.py @ 00209af1 (`--config`, alias `--extra_llm_api_options`)")


@dataclass(frozen=True)
class RuntimeImage:
    name: str                   # what --runtime-image takes
    image: str                  # the container image
    trtllm: str                 # the TensorRT-LLM version inside
    serves: frozenset[str]      # of ENGINE_REPOSITORY, LLMAPI_MODEL, TRTLLM_SERVE
    options_flag: str           # the trtllm-serve flag that names the LLM API options YAML
    source: str

    @property
    def has_triton(self) -> bool:
        return LLMAPI_MODEL in self.serves


def _triton_images() -> list[RuntimeImage]:
    return [RuntimeImage(f"triton-{release}", f"nvcr.io/nvidia/tritonserver:{release}-trtllm-python-py3", version,
                         frozenset({ENGINE_REPOSITORY, LLMAPI_MODEL, TRTLLM_SERVE}), "--extra_llm_api_options",
                         TRITON_SOURCE)
            for release, version in sorted(TRTLLM_TRITON_RELEASES.items()) if version == TRTLLM_VERSION]


def _release_images() -> list[RuntimeImage]:
    return [RuntimeImage(f"trtllm-{version}", f"nvcr.io/nvidia/tensorrt-llm/release:{version}", version,
                         frozenset({TRTLLM_SERVE}), "--extra_llm_api_options" if version == TRTLLM_VERSION
                         else "--config", RELEASE_IMAGE_SOURCE)
            for version in LLM_API_VERSIONS]


#: Every image trtpipe can deploy onto, by name: those whose TensorRT-LLM version trtpipe has checked.
IMAGES = {image.name: image for image in (*_triton_images(), *_release_images())}
#: The default per backend. The engine path: the newest Triton image with TensorRT-LLM 1.2.1. The PyTorch backend:
#: the same image (Triton's llmapi model and trtllm-serve), because validate, serve, k8s and ci speak to Triton;
#: `--runtime-image trtllm-1.3.0rc27` is the newest TensorRT-LLM whose LLM API trtpipe checked (trtllm-serve only).
NEWEST_TRITON = max(name for name, image in IMAGES.items() if image.has_triton)
DEFAULT_IMAGE = {ENGINE: NEWEST_TRITON, PYTORCH: NEWEST_TRITON}
#: What each GPU backend needs of an image.
NEEDS = {ENGINE: ENGINE_REPOSITORY, PYTORCH: TRTLLM_SERVE}


def on_triton(name: str | None) -> bool:
    """Whether a plan for the image `name` deploys a Triton repository (None: the cpu target, or a plan written
    before images were recorded: trtpipe's own or the default Triton)."""
    return name not in IMAGES or IMAGES[name].has_triton


def not_on_triton(name: str | None, what: str) -> UserError | None:
    """The refusal for `what` (a command that needs Triton) of a deployment for an image without Triton."""
    if on_triton(name):
        return None
    return UserError(f"{what} needs a Triton model repository; this is a trtllm-serve deployment for --runtime-image "
                     f"{name} ({IMAGES[name].image}, no Triton): run its {LAUNCH_SCRIPT} in that image, and "
                     "validate it with `trtpipe validate --api openai --url http://HOST:8000`")


def runtime_image(name: str | None, backend: str) -> RuntimeImage:
    """The image `name` (None: the backend's default) checked to serve `backend`; UserError otherwise."""
    if backend not in NEEDS:
        raise UserError(f"--runtime-image names a GPU runtime image; the {backend} backend runs in trtpipe's own "
                        "Triton")
    name = name or DEFAULT_IMAGE[backend]
    if name not in IMAGES:
        raise UserError(f"--runtime-image must be one of {', '.join(IMAGES)} (the images whose TensorRT-LLM trtpipe "
                        f"checked), not {name!r}")
    image = IMAGES[name]
    removed = runtime_refusal(backend, image.trtllm)
    if removed is not None:
        combination = Combination("fp16", None, backend, None, image.trtllm)
        raise UserError(f"--runtime-image {name}: {removed.message(combination)}")
    if NEEDS[backend] not in image.serves:
        raise UserError(f"{image.image} has no {NEEDS[backend]} (it serves {', '.join(sorted(image.serves))}); the "
                        f"{backend} backend needs a Triton image with TensorRT-LLM {TRTLLM_VERSION}: "
                        f"--runtime-image {DEFAULT_IMAGE[backend]}")
    return image
