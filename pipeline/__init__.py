"""trtpipe: a Hugging Face causal LM to a validated Triton + TensorRT-LLM deployment."""

__version__ = "0.1.0"

#: The TensorRT-LLM release the checkpoint format, the compile stage and the Triton templates target.
TRTLLM_VERSION = "1.2.1"
#: Triton's `-trtllm-python-py3` releases and the TensorRT-LLM each ships, from Triton's Release Compatibility Matrix
#: (triton-inference-server/server docs/introduction/compatibility.md@e1db8a60, 2026-08-19; 25.12-26.02 ship
#: 1.1.0). No later Triton image ships TensorRT-LLM (release 26.11's notes: the TensorRT-LLM container "is not
#: included"), and TensorRT-LLM 1.3 removed the engine path: 26.07 is the last image with trtpipe's engine path.
TRTLLM_TRITON_RELEASES = {"26.03": "1.2.0", "26.04": "1.2.1", "26.05": "1.2.1", "26.06": "1.2.1", "26.07": "1.2.1"}
#: The newest Triton release that ships TRTLLM_VERSION (TensorRT 10.14.1.48, CUDA 13.1.0.036, Python 3.12.3).
TRITON_RELEASE = max(r for r, v in TRTLLM_TRITON_RELEASES.items() if v == TRTLLM_VERSION)
#: Its image: the Dockerfile builds on it; ci.py, compile.py and doctor.py name it (docs/upstream-facts.md).
TRITON_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_RELEASE}-trtllm-python-py3"
#: Where TRITON_IMAGE holds NVIDIA's inflight_batcher_llm model files (tensorrtllm_backend's
#: dockerfile/Dockerfile.triton.trt_llm_backend: `WORKDIR /app`, `COPY ... triton_backend/all_models all_models`;
#: docs/upstream-facts.md §0). `trtpipe deploy --python-models nvidia` ships them from here.
NVIDIA_MODEL_FILES = "/app/all_models/inflight_batcher_llm"
