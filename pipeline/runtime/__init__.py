"""trtpipe's reference runtime: TensorRT-LLM checkpoints executed with torch.

    from pipeline.runtime import LayerStream, ReferenceModel, SamplingConfig, perplexity
    model = ReferenceModel.load(ckpt_dir)                  # the whole model, for serving
    logits = model.forward(input_ids)                      # [B, T] -> float32 [B, T, vocab]
    outs = model.generate(prompts, SamplingConfig(max_new_tokens=32))
    stream = LayerStream(ckpt_dir, device)                 # one layer at a time, for statistics and scores
    ppl = perplexity(stream, sequences)
"""

from .model import ReferenceModel
from .perplexity import PerplexityResult, perplexity
from .sampling import SamplingConfig
from .stream import LayerStream, resolve_device
from ..host import serving_threads

__all__ = ["LayerStream", "ReferenceModel", "PerplexityResult", "SamplingConfig", "perplexity", "resolve_device",
           "serving_threads"]
