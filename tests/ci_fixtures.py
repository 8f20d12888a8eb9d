"""A tiny random Llama with a tokenizer that streams cleanly: what the CI, matrix and artifact tests build."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


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
