"""The backends' vocabulary: their names, what they can be and the constants they share.

A leaf module (it imports nothing of trtpipe's), so that the plan's schema, the command line and the stages can
name a backend, a layout or a batching mode without loading a backend: `pipeline.backends` imports the backend
modules by name when one is first asked for.
"""

from __future__ import annotations

#: The backends' names as plan.json spells them (here, not beside each backend, so that the command line can offer
#: them without importing the backends).
ENGINE = "engine"
REFERENCE = "reference"
REFERENCE_ONNX = "reference-onnx"
PYTORCH = "pytorch"
REFERENCE_LLMAPI = "reference-llmapi"
NAMES = (ENGINE, REFERENCE, PYTORCH, REFERENCE_LLMAPI, REFERENCE_ONNX)
#: The reference backend's `runtime` parameter (deploy --runtime) -> the backend that deploys it.
RUNTIMES = {"torch": REFERENCE, "onnxruntime": REFERENCE_ONNX}
#: How a backend batches (`Backend.batching`; pipeline/plan/feedback.py models each): a batch generated to its end
#: before the next starts (the llmapi contract's cpu model), or in flight: requests join the running batch between
#: steps (TensorRT-LLM's per iteration; the reference runtime's joining prompt within a decode step).
STATIC_BATCHING, INFLIGHT_BATCHING = "static", "inflight"
#: NVIDIA's inflight_batcher_llm repository layout (ensemble, pre/postprocessing, tensorrt_llm, BLS).
INFLIGHT_BATCHER = "inflight_batcher_llm"
#: The launch script of a pytorch deployment's trtllm-serve (beside the Triton repository, or alone on an image
#: without Triton).
LAUNCH_SCRIPT = "trtllm-serve.sh"
#: What a backend serves (besides an engine): the TensorRT-LLM checkpoint convert/calibrate write, or its
#: Hugging Face twin (calibrate --format both; the float checkpoint exported back for fp16/bf16).
TRTLLM_CHECKPOINT = "trtllm"
HF_CHECKPOINT = "hf"

#: Triton's ports, as NVIDIA's images, launcher and Kubernetes examples use them
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
#: Where a serve command expects the model repository (set in the environment: a recorded command never
#: names the machine the repository was built on)
MODEL_REPOSITORY = "$MODEL_REPOSITORY"
