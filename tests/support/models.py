"""Tiny random models and their tokenizers, written as Hugging Face directories, and the small repositories built
from them through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

#: Tiny random Llama variants covering the attention layouts and options the converter must handle.
TINY_VARIANTS: dict[str, dict] = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3-rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "head-dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "head8": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, architectures=["MistralForCausalLM"]),
}


#: Tiny random Qwen variants: Qwen2 (q/k/v biases; tied or not) and Qwen3 (per-head q/k norms, head_dim set
#: apart from hidden/heads), with GQA and MQA head layouts.
QWEN_VARIANTS: dict[str, dict] = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied": dict(architectures=["Qwen2ForCausalLM"], num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-mqa": dict(architectures=["Qwen3ForCausalLM"], num_attention_heads=4, num_key_value_heads=1,
                      head_dim=16),
}


#: Hugging Face architecture -> transformers model_type, for every family the registry has
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def make_tiny_model(directory: Path, seed: int = 0, **overrides) -> Path:
    """Save a random model (a Llama unless `architectures` says otherwise) with tiny dimensions as a Hugging
    Face directory; norms and biases far from their initial values, so a mis-mapped or dropped one shows
    in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               tie_word_embeddings=False, torch_dtype="float32", architectures=["LlamaForCausalLM"])
    cfg.update(overrides)
    config = AutoConfig.for_model(MODEL_TYPES[cfg["architectures"][0]], **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def variant_factory(tmp_path_factory, variants: dict[str, dict]):
    """get(name) -> HF directory of that tiny variant, made once per session."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny_model(tmp_path_factory.mktemp(f"hf-{variant}"), **variants[variant])
        return made[variant]

    return get


def save_word_tokenizer(directory: Path, size: int = 101) -> None:
    """A word-level tokenizer of the tiny vocabulary (" w0".." w100" by default, end and padding " w1"), saved as a
    Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # byte-level words that carry their leading space, so tokens decoded one by one join up (streaming). Split
    # on whitespace only: ByteLevel's own regex cuts " w17" into " w" and "17", which made every prompt unknown.
    tokenizer = Tokenizer(models.WordLevel({f"\u0120w{i}": i for i in range(size)}, unk_token="\u0120w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "\u0120w1", "pad_token": "\u0120w1"}))


def buildable_copy(hf_dir: Path, directory: Path) -> Path:
    """`hf_dir` copied to `directory` with the word tokenizer and a context long enough for build's default
    workload (1024 + 256 tokens): a model `trtpipe build` takes."""
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    save_word_tokenizer(directory, config["vocab_size"])
    return directory


def deploy_tiny_llmapi(checkpoint: Path, tokenizer: Path, root: Path) -> Path:
    """The cpu llmapi repository (backend reference-llmapi, context 64) of a tiny checkpoint, deployed through the
    CLI under `root`."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.plan import Workload, resolve_model_info, save_plan
    from pipeline.planner import make_plan
    from pipeline.targets import get_target

    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=8, output_len=8, max_context=64), backend="reference-llmapi")
    save_plan(plan, root / "plan.json")
    repo = root / "repo"
    result = CliRunner().invoke(main, ["deploy", "--checkpoint", str(checkpoint), "--plan", str(root / "plan.json"),
                                       "--tokenizer", str(tokenizer), "-o", str(repo)])
    assert result.exit_code == 0, result.output
    return repo


def tiny_cpu_checkpoint(hf_dir: Path, root: Path) -> tuple[Path, Path]:
    """A copy of the tiny HF model `hf_dir` under `root` with the word tokenizer and the cpu plan's context, its
    float32 checkpoint and cpu plan.json: (checkpoint, plan path)."""
    from pipeline.convert import convert_model
    from pipeline.plan import resolve_model_info
    from pipeline.planner import make_plan
    from pipeline.sources import resolve_model
    from pipeline.targets import get_target

    model = buildable_copy(hf_dir, root / "model")
    ckpt = convert_model(resolve_model(str(model)), root / "ckpt", dtype="float32", progress=False).path
    plan = make_plan(resolve_model_info(str(model)), get_target("cpu"), "fp32")
    (root / "plan.json").write_text(json.dumps(plan.to_dict()))
    return ckpt, root / "plan.json"


def deploy_tiny_cpu_repo(hf_dir: Path, root: Path) -> Path:
    """`tiny_cpu_checkpoint` deployed by the CLI into ROOT/repo (the word tokenizer " w0".." w100")."""
    from click.testing import CliRunner

    from pipeline.cli import main

    ckpt, plan = tiny_cpu_checkpoint(hf_dir, root)
    result = CliRunner().invoke(main, ["deploy", "--checkpoint", str(ckpt), "--plan", str(plan),
                                       "-o", str(root / "repo")])
    assert result.exit_code == 0, result.output
    return root / "repo"


def tiny_model_with_tokenizer(hf_dir: Path, out: Path) -> Path:
    """Copy the tiny Llama HF_DIR to OUT with a 2048-token context and a word-level tokenizer of its 101-word
    vocabulary (byte-level like SmolLM2's, so decoding a token stream piece by piece gives the same text as
    decoding it whole), with eos/bos/pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(hf_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = Tokenizer(models.WordLevel({f"\u0120w{i}": i for i in range(101)}, unk_token="\u0120w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "\u0120w1", "bos_token": "\u0120w2",
        "pad_token": "\u0120w0"}))
    return out
