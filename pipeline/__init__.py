"""trtpipe: a Hugging Face causal LM to a validated Triton + TensorRT-LLM deployment."""

__version__ = "0.1.0"

#: The TensorRT-LLM release the checkpoint format, the compile stage and the Triton templates target.
TRTLLM_VERSION = "1.2.1"
