"""trtpipe's reference runtime: TensorRT-LLM checkpoints executed with torch on the CPU.

    from pipeline.runtime import ReferenceModel, SamplingConfig
    model = ReferenceModel.load(ckpt_dir)
    logits = model.forward(input_ids)                      # [B, T] -> float32 [B, T, vocab]
    outs = model.generate(prompts, SamplingConfig(max_new_tokens=32))
"""

from .model import ReferenceModel
from .perplexity import PerplexityResult, perplexity
from .sampling import SamplingConfig

__all__ = ["ReferenceModel", "PerplexityResult", "SamplingConfig", "perplexity"]
