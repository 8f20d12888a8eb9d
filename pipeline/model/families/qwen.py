"""Qwen2 / Qwen2.5 and dense Qwen3: TensorRT-LLM's QWenForCausalLM, chosen by `qwen_type`
(tensorrt_llm/models/qwen; docs/model-families.md §2, §6).

The decoder layer is Llama's with two differences: Qwen2 has q/k/v biases and never an o_proj bias
(TensorRT-LLM's Qwen `attn_bias` is the qkv bias only, `dense_bias=False`); Qwen3 has no biases and
normalizes every q and k head with an RMSNorm over head_dim (`attention.q_layernorm`, `k_layernorm`)
before rope. Layouts the engine cannot express are refused: Qwen3 with `attention_bias` (TensorRT-LLM
would drop the biases) and per-layer sliding windows (`use_sliding_window`).
"""

from __future__ import annotations

from ...errors import UserError
from ..spec import Family, NormSpec
from .llama import DECODER_LINEARS, DECODER_NORMS

QWEN_TYPES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
#: QWenConfig's `seq_length` when the HF config has none (only read for logn scaling, which Qwen2/3 do not use)
DEFAULT_SEQ_LENGTH = 8192
#: MoeConfig of a dense Qwen, as QWenConfig writes it (normalization_mode 0 = NONE)
DENSE_MOE = {"num_experts": 0, "shared_expert_intermediate_size": 0, "top_k": 0, "normalization_mode": 0,
             "sparse_mixer_epsilon": 0.01, "tp_mode": 0}


def hf_features(architecture: str, cfg: dict, where: str) -> dict:
    qwen3 = QWEN_TYPES[architecture] == "qwen3"
    if qwen3 and cfg.get("attention_bias"):
        raise UserError(f"{where}: attention_bias is true, but TensorRT-LLM's Qwen3 has no attention biases "
                        "(they would be dropped silently); trtpipe cannot convert this model")
    if cfg.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window is true; TensorRT-LLM's Qwen checkpoint cannot express "
                        "per-layer sliding windows (max_window_layers), so trtpipe cannot convert this model")
    extra = {"seq_length": int(cfg["seq_length"])} if cfg.get("seq_length") else {}
    return {"qkv_bias": not qwen3, "dense_bias": False, "mlp_bias": False, "qk_norm": qwen3, "extra": extra}


def checkpoint_features(architecture: str, cfg: dict) -> dict:
    qwen_type = cfg.get("qwen_type") or QWEN_TYPES.get(architecture)
    return {"qkv_bias": bool(cfg.get("attn_bias", False)), "dense_bias": False,
            "mlp_bias": bool(cfg.get("mlp_bias", False)), "qk_norm": qwen_type == "qwen3",
            "extra": {"seq_length": int(cfg.get("seq_length") or DEFAULT_SEQ_LENGTH)}}


def checkpoint_fields(arch) -> dict:
    """QWenConfig's own keys (`qwen_type` and `seq_length` are read unconditionally by the engine)."""
    return {"qwen_type": QWEN_TYPES[arch.architecture], "attn_bias": arch.qkv_bias, "mlp_bias": arch.mlp_bias,
            "seq_length": arch.extra.get("seq_length", DEFAULT_SEQ_LENGTH), "use_logn_attn": False,
            "disable_weight_only_quant_plugin": False, "moe": dict(DENSE_MOE), "moe_intermediate_size": 0,
            "moe_shared_expert_intermediate_size": 0, "num_labels": 1, "mlp_only_layers": [],
            "decoder_sparse_step": 1}


def hf_fields(arch) -> dict:
    qwen_type = QWEN_TYPES[arch.architecture]
    extra = {"attention_bias": False} if qwen_type == "qwen3" else {}
    return {"model_type": qwen_type, "use_sliding_window": False, **extra}


QWEN = Family(
    name="qwen",
    architectures=tuple(QWEN_TYPES),
    gguf_model_types={"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"},
    linears=DECODER_LINEARS,
    norms=DECODER_NORMS + (NormSpec("attention.q_layernorm", "self_attn.q_norm", "head", feature="qk_norm"),
                           NormSpec("attention.k_layernorm", "self_attn.k_norm", "head", feature="qk_norm")),
    hf_features=hf_features,
    checkpoint_features=checkpoint_features,
    checkpoint_fields=checkpoint_fields,
    hf_fields=hf_fields,
)
