"""SmolLM2's tokenizer, as trtpipe writes it, read by transformers 4.x (trtpipe's pin) and 5.x (vLLM 0.32's line).

transformers 5.0-5.2 rebuild a tokenizer labelled `LlamaTokenizer` from that class's own rules and drop SmolLM2's
spaces; trtpipe labels it `PreTrainedTokenizerFast` (pipeline/tokenizer.py `label_tokenizer_as_saved`). This
script encodes and decodes one sentence with spaces under this interpreter's transformers and under each given
transformers 5 release (installed once into its own virtual environment under --workdir, CPU only, no torch),
for trtpipe's label and the old one, and prints whether the ids equal this interpreter's and the text comes back.

    .venv/bin/python benchmarks/check_tokenizer_versions.py [--versions 5.0.0 5.2.0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from pipeline.sources import resolve_model
from pipeline.tokenizer import TOKENIZER_FILES

SENTENCE = "The capital of France is Paris.  Two  spaces,\nnew line; émigré 123"
PROBE = """
import json, sys
from transformers import AutoTokenizer, __version__
t = AutoTokenizer.from_pretrained(sys.argv[1])
ids = t(sys.argv[2], add_special_tokens=False)["input_ids"]
print(json.dumps({"version": __version__, "class": type(t).__name__, "ids": ids, "text": t.decode(ids)}))
"""


def tokenizer_dirs(workdir: Path) -> dict[str, Path]:
    """SmolLM2's tokenizer files as trtpipe writes them, and a copy with the label transformers' GGUF loader gave."""
    source = resolve_model("smollm2-135m").hf_dir()
    dirs = {"PreTrainedTokenizerFast (trtpipe)": workdir / "labelled", "LlamaTokenizer (before)": workdir / "old"}
    for directory in dirs.values():
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, directory / name)
    old = dirs["LlamaTokenizer (before)"] / "tokenizer_config.json"
    config = {k: v for k, v in json.loads(old.read_text()).items() if k != "model_input_names"}
    old.write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    return dirs


def python_with(version: str, workdir: Path) -> Path:
    env = workdir / f"transformers-{version}"
    python = env / "bin" / "python"
    if not python.is_file():
        venv.create(env, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"transformers=={version}"], check=True)
    return python


def probe(python: Path | str, directory: Path) -> dict:
    out = subprocess.run([str(python), "-c", PROBE, str(directory), SENTENCE], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=["5.0.0", "5.2.0"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-tokenizers"))
    args = parser.parse_args()
    dirs = tokenizer_dirs(args.workdir.resolve())
    pythons = [sys.executable, *(python_with(v, args.workdir.resolve()) for v in args.versions)]
    reference = probe(sys.executable, dirs["PreTrainedTokenizerFast (trtpipe)"])["ids"]
    print(f"{'label':<36} {'transformers':<13} {'loaded as':<26} {'ids = 4.x':<10} text back")
    for label, directory in dirs.items():
        for python in pythons:
            seen = probe(python, directory)
            print(f"{label:<36} {seen['version']:<13} {seen['class']:<26} {str(seen['ids'] == reference):<10} "
                  f"{seen['text'] == SENTENCE}")


if __name__ == "__main__":
    main()
