"""`ModelArch` read and written through its family (the registry, `pipeline.model`): from a Hugging Face config
or a checkpoint's, back to a Hugging Face config, and what its family's tensors are and add up to.
"""

from __future__ import annotations

from dataclasses import replace

from ..arch import ModelArch
from ..errors import UserError
from . import ARCHITECTURES, family_of
from .spec import HF_LAYER, dims

#: config.json's torch_dtype / dtype spellings -> trtpipe's dtype names
DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
          "torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def arch_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArch:
    """The numbers of a Hugging Face config.json; UserError naming WHERE for an unknown or invalid one."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    family = family_of(arch)
    if family is None:
        raise UserError(f"{where}: unknown architecture {arch!r}; trtpipe supports {', '.join(ARCHITECTURES)}")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        arch_obj = ModelArch(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_size=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rotary_base=float(cfg.get("rope_theta", 10000.0)),
            rotary_scaling=cfg.get("rope_scaling"),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)),
            hidden_act=cfg.get("hidden_act", "silu"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), "float16"),
            **family.hf_features(arch, cfg, where),
        )
    except KeyError as exc:
        raise UserError(f"{where}: missing field {exc}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise UserError(f"{where}: invalid field value ({exc})") from None
    arch_obj.validate(where)
    return arch_obj


def arch_from_checkpoint_config(cfg: dict, where: str = "config.json") -> ModelArch:
    """The numbers of a TensorRT-LLM checkpoint's config.json (the names convert writes)."""
    architecture = cfg.get("architecture")
    family = family_of(architecture)
    if family is None:
        raise UserError(f"{where}: unknown architecture {architecture!r}; trtpipe supports "
                        f"{', '.join(ARCHITECTURES)}")
    hf_names = {"architectures": [architecture], "head_dim": cfg.get("head_size"),
                "rope_theta": cfg.get("rotary_base", 10000.0), "rope_scaling": cfg.get("rotary_scaling"),
                "rms_norm_eps": cfg.get("norm_epsilon", 1e-5), "torch_dtype": cfg.get("dtype")}
    arch = arch_from_hf_config({**cfg, **hf_names, "attention_bias": False, "use_sliding_window": False}, where)
    return replace(arch, **family.checkpoint_features(architecture, cfg))


def parameter_count(arch: ModelArch) -> int:
    """Every weight the family's spec gives this model (biases and norms included)."""
    family, sizes = family_of(arch.architecture), dims(arch)
    per_layer = sum(lin.out_features(sizes) * (sizes[lin.inputs] + family.has_bias(lin, arch))
                    for lin in family.linears)
    per_layer += sum(sizes[n.size] for n in family.layer_norms(arch))
    lm_head = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return arch.vocab_size * arch.hidden_size + arch.num_hidden_layers * per_layer + arch.hidden_size + lm_head


def hf_config_of(arch: ModelArch, dtype: str) -> dict:
    """A Hugging Face config.json of these numbers (arch_from_hf_config's inverse), weights in `dtype`."""
    return {"architectures": [arch.architecture], "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_hidden_layers,
            "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads,
            "head_dim": arch.head_size, "max_position_embeddings": arch.max_position_embeddings,
            "rope_theta": arch.rotary_base, "rope_scaling": arch.rotary_scaling, "rms_norm_eps": arch.norm_epsilon,
            "hidden_act": arch.hidden_act, "tie_word_embeddings": arch.tie_word_embeddings, "torch_dtype": dtype,
            **family_of(arch.architecture).hf_fields(arch)}


def hf_tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face model of this family and these dimensions has, with its shape (convert
    checks a source against it; the reference runtime reads a Hugging Face checkpoint by it)."""
    family, sizes = family_of(arch.architecture), dims(arch)
    h = arch.hidden_size
    shapes = {family.embedding[0]: (arch.vocab_size, h), family.final_norm[0]: (h,)}
    if not arch.tie_word_embeddings:
        shapes[family.lm_head[0]] = (arch.vocab_size, h)
    for layer in range(arch.num_hidden_layers):
        p = HF_LAYER.format(layer)
        for norm in family.layer_norms(arch):
            shapes[p + norm.hf + ".weight"] = (sizes[norm.size],)
        for lin in family.linears:
            for part in lin.parts:
                rows = sizes[part.rows]
                shapes[p + part.hf + ".weight"] = (rows, sizes[lin.inputs])
                if family.has_bias(lin, arch):
                    shapes[p + part.hf + ".bias"] = (rows,)
    return shapes
