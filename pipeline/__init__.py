"""trtpipe: a Hugging Face causal LM to a validated Triton + TensorRT-LLM deployment."""

__version__ = "0.1.0"

#: The TensorRT-LLM release the checkpoint format, the compile stage and the Triton templates target.
TRTLLM_VERSION = "1.2.1"
#: NVIDIA's Triton image that ships TRTLLM_VERSION: the first `-trtllm-python-py3` tag with TensorRT-LLM 1.2.1
#: (TensorRT 10.14.1.48, CUDA 13.1.0.036, Python 3.12.3) in Triton's Release Compatibility Matrix
#: (triton-inference-server/server docs/introduction/compatibility.md; 25.12 ships 1.1.0, 26.03 ships 1.2.0).
#: The Dockerfile builds on it; ci.py, compile.py and doctor.py name it (docs/upstream-facts.md).
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
#: Where TRITON_IMAGE holds NVIDIA's inflight_batcher_llm model files (tensorrtllm_backend's
#: dockerfile/Dockerfile.triton.trt_llm_backend: `WORKDIR /app`, `COPY ... triton_backend/all_models all_models`;
#: docs/upstream-facts.md §0). `trtpipe deploy --python-models nvidia` ships them from here.
NVIDIA_MODEL_FILES = "/app/all_models/inflight_batcher_llm"
