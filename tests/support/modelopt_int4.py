"""nvidia-modelopt 0.37's own 4-bit AWQ of a tiny Llama: the oracle the 4-bit tests compare trtpipe with."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch

from support.models import make_tiny_model

#: TensorRT-LLM quant_algo -> modelopt's preset
ALGOS = {"W4A16_AWQ": "INT4_AWQ_CFG", "W4A8_AWQ": "W4A8_AWQ_BETA_CFG"}
GROUP = 64


def tiny_int4_llama(directory: Path) -> Path:
    """A random Llama whose widths (128, 256) take groups of 64 and 128, vocabulary 128."""
    return make_tiny_model(directory, vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)


def modelopt_int4(hf_dir: Path, algo: str, group: int = GROUP):
    """The model quantized by modelopt with ALGO's preset at `group` inputs per scale, after 4 calibration batches
    of 32 random tokens (float32, modelopt's fake-quantized forward)."""
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(getattr(mtq, ALGOS[algo]))
    weight = cfg["quant_cfg"]["*weight_quantizer"]
    (weight[0] if isinstance(weight, list) else weight)["block_sizes"][-1] = group
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    data = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(model, cfg, lambda m: [m(data[i:i + 1]) for i in range(len(data))])
