"""A Hugging Face tokenizer's files: which they are, and copying them where a stage needs them.

convert keeps them beside the checkpoint (`copy_tokenizer_files`); deploy and the pytorch backend put them into
the model repository, checked by loading them (`copy_tokenizer`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .errors import UserError

#: What a Hugging Face tokenizer may consist of.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")


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
