"""Llama and Mistral: TensorRT-LLM's LLaMAForCausalLM (tensorrt_llm/models/llama; docs/model-families.md §1, §6).

The decoder layer every family here shares: fused qkv, the output projection, and a gated SiLU MLP
whose `gate_proj` becomes `mlp.fc` (the activated branch) and `up_proj` becomes `mlp.gate`. For Llama,
`attention_bias` gives q/k/v *and* o_proj a bias (TensorRT-LLM's `attn_bias` sets both).
"""

from __future__ import annotations

from ..spec import COLUMN, QKV, ROW, Family, LinearSpec, NormSpec, Part

DECODER_LINEARS = (
    LinearSpec("attention.qkv", (Part("self_attn.q_proj", "q"), Part("self_attn.k_proj", "kv"),
                                 Part("self_attn.v_proj", "kv")), "hidden", QKV, bias="qkv_bias",
               input_norm="input_layernorm"),
    LinearSpec("attention.dense", (Part("self_attn.o_proj", "hidden"),), "q", ROW, bias="dense_bias",
               input_from="self_attn.v_proj"),
    LinearSpec("mlp.fc", (Part("mlp.gate_proj", "intermediate"),), "hidden", COLUMN, bias="mlp_bias",
               fused_with="mlp.gate", input_norm="post_layernorm"),
    LinearSpec("mlp.gate", (Part("mlp.up_proj", "intermediate"),), "hidden", COLUMN, bias="mlp_bias",
               shares_input_with="mlp.fc", fused_with="mlp.fc", input_norm="post_layernorm"),
    LinearSpec("mlp.proj", (Part("mlp.down_proj", "hidden"),), "intermediate", ROW, bias="mlp_bias",
               input_from="mlp.up_proj"),
)
DECODER_NORMS = (
    NormSpec("input_layernorm", "input_layernorm", "hidden"),
    NormSpec("post_layernorm", "post_attention_layernorm", "hidden"),
)
#: MoeConfig of a dense model, as LLaMAConfig writes it (normalization_mode 1 = RENORMALIZE)
DENSE_MOE = {"num_experts": 0, "shared_expert_intermediate_size": 0, "top_k": 0, "normalization_mode": 1,
             "sparse_mixer_epsilon": 0.01, "tp_mode": 0}


def _sliding_window(cfg: dict) -> dict:
    return {"sliding_window": cfg["sliding_window"]} if cfg.get("sliding_window") is not None else {}


def hf_features(architecture: str, cfg: dict, where: str) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "dense_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False)), "qk_norm": False,
            "extra": _sliding_window(cfg)}


def checkpoint_features(architecture: str, cfg: dict) -> dict:
    bias = bool(cfg.get("attn_bias", cfg.get("bias", False)))
    return {"qkv_bias": bias, "dense_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", cfg.get("bias", False))),
            "qk_norm": False, "extra": _sliding_window(cfg)}


def checkpoint_fields(arch) -> dict:
    """LLaMAConfig's own keys."""
    return {"mlp_bias": arch.mlp_bias, "attn_bias": arch.qkv_bias, "residual_mlp": False,
            "disable_weight_only_quant_plugin": False, "fc_after_embed": False,
            "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "layer_idx_offset": 0,
            "moe": dict(DENSE_MOE), **arch.extra}


def hf_fields(arch) -> dict:
    model_type = "mistral" if arch.architecture == "MistralForCausalLM" else "llama"
    return {"model_type": model_type, "attention_bias": arch.qkv_bias, "mlp_bias": arch.mlp_bias,
            **({"sliding_window": arch.sliding_window} if arch.sliding_window else {})}


LLAMA = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
    linears=DECODER_LINEARS,
    norms=DECODER_NORMS,
    hf_features=hf_features,
    checkpoint_features=checkpoint_features,
    checkpoint_fields=checkpoint_fields,
    hf_fields=hf_fields,
)
