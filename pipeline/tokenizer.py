"""A Hugging Face tokenizer's files: which they are, and copying them where a stage needs them.

convert keeps them beside the checkpoint (`copy_tokenizer_files`); deploy and the pytorch backend put them into
the model repository, checked by loading them (`copy_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from .errors import UserError

#: What a Hugging Face tokenizer may consist of.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")


#: The class a tokenizer directory trtpipe writes from a GGUF names: its tokenizer.json, read as it is.
FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def label_tokenizer_as_saved(directory: Path) -> None:
    """Name DIRECTORY's tokenizer class so every transformers version reads tokenizer.json as saved.

    transformers converts a GGUF's tokenizer into a fast tokenizer labelled after the model's architecture
    (`LlamaTokenizer` for SmolLM2's byte-level BPE). Under transformers 5.x a label like that rebuilds the
    tokenizer from its own class's rules instead of loading tokenizer.json, and SmolLM2 then loses its spaces
    ("ThecapitalofFranceis"); `PreTrainedTokenizerFast` loads the file as it is under 4.x and 5.x alike, with
    the same ids as the converted tokenizer (tests/test_sources.py). The converted class's `model_input_names`
    are written too: PreTrainedTokenizerFast would otherwise add `token_type_ids`, which a causal LM's generate
    refuses. A directory without tokenizer.json is left alone; the file is rewritten only when the label differs.
    """
    config_path = Path(directory) / "tokenizer_config.json"
    if not (Path(directory) / "tokenizer.json").is_file() or not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == FAST_TOKENIZER_CLASS:
        return
    from transformers import AutoTokenizer

    inputs = list(AutoTokenizer.from_pretrained(directory).model_input_names)
    config.update(tokenizer_class=FAST_TOKENIZER_CLASS, model_input_names=inputs)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def copy_tokenizer_files(hf_dir: Path, dest: Path) -> None:
    """Keep the tokenizer beside the checkpoint (DEST/tokenizer): deploy and validate need it, and it is small."""
    tok_dir = dest / "tokenizer"
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            tok_dir.mkdir(exist_ok=True)
            (tok_dir / name).write_bytes((hf_dir / name).read_bytes())


def copy_tokenizer(source: Path, dest: Path) -> None:
    """SOURCE's tokenizer files into DEST (made here), then loaded with transformers: UserError if they do not."""
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(dest)
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        raise UserError(f"the tokenizer in {source} does not load ({type(exc).__name__}: {exc}); "
                        "pass --tokenizer with a Hugging Face model directory") from None


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids: the vocabulary, the added tokens and the special-token ids."""
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    added = sorted((tok, i) for tok, i in tokenizer.get_added_vocab().items())
    payload = json.dumps([sorted(tokenizer.get_vocab().items()), added, special])
    return hashlib.sha256(payload.encode()).hexdigest()


def tokenizer_dir_of(path: Path, checkpoint: bool) -> Path:
    """Where a model's tokenizer files are: beside a TensorRT-LLM checkpoint (convert's copy), or in a Hugging Face
    directory itself."""
    return Path(path) / "tokenizer" if checkpoint else Path(path)


def has_tokenizer_files(directory: Path) -> bool:
    return any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer directories give the same token ids (vocabulary, added and special tokens)."""
    from transformers import AutoTokenizer

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(a)) == tokenizer_fingerprint(
        AutoTokenizer.from_pretrained(b))
