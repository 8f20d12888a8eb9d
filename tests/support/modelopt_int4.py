"""nvidia-modelopt 0.37's own 4-bit AWQ of a tiny Llama: the oracle the 4-bit tests compare trtpipe with."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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


def tensors(directory: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    with safe_open(directory / f"rank{rank}.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def dequantized_float_checkpoint(exported: Path, out: Path) -> Path:
    """The float16 checkpoint whose weights are modelopt's quantized ones, un-smoothed (code x scale x prequant)."""
    from pipeline.runtime.int4 import dequantize_groupwise, unpack_int4

    config = json.loads((exported / "config.json").read_text())
    out.mkdir()
    for rank in range(config["mapping"]["world_size"]):
        q = tensors(exported, rank)
        plain = {}
        for name, t in q.items():
            if not name.endswith(".weight") or t.dtype != torch.int8:
                if not name.endswith(("_scaling_factor", "_scaling_factor_2")):
                    plain[name] = t
                continue
            prefix = name[: -len(".weight")]
            w = dequantize_groupwise(unpack_int4(t), q[prefix + ".weights_scaling_factor"])
            plain[name] = (w * q[prefix + ".prequant_scaling_factor"].float()[None, :]).half()
        save_file(plain, out / f"rank{rank}.safetensors", metadata={"format": "pt"})
    config["quantization"] = {"quant_algo": None, "kv_cache_quant_algo": None}
    (out / "config.json").write_text(json.dumps(config))
    return out
