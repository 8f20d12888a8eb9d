"""`trtpipe eval`: perplexity of a TensorRT-LLM checkpoint or a Hugging Face FP8 checkpoint (reference runtime),
or of a Hugging Face model (transformers).

Both paths tokenize the same text with the same tokenizer and score it with the same windowing
(`pipeline.runtime.perplexity`), so `trtpipe eval MODEL` and `trtpipe eval CHECKPOINT` compare a model
before and after conversion or quantization. The default text is the held-out part of the offline
news corpus; `corpus_split` is the one deterministic split calibration and evaluation share, so
calibration never sees the evaluation lines.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError
from .plan import is_trtllm_checkpoint

HELDOUT_FRACTION = 0.2
DEFAULT_WINDOW = 512


def corpus_lines() -> list[str]:
    from .assets import calibration_corpus_path

    path = calibration_corpus_path()
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


def corpus_split(seed: int = 0) -> tuple[list[str], list[str]]:
    """(calibration_lines, heldout_lines) of the offline corpus: a seeded shuffle, 20% held out.

    Repeated lines are kept once (the corpus has a few), so no held-out text is ever calibrated on.
    Both lists keep the corpus order; together they are every distinct line.
    """
    lines = list(dict.fromkeys(corpus_lines()))
    order = list(range(len(lines)))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, round(len(lines) * HELDOUT_FRACTION))])
    return ([t for i, t in enumerate(lines) if i not in held], [t for i, t in enumerate(lines) if i in held])


@dataclass(frozen=True)
class EvalResult:
    perplexity: float
    tokens: int
    model: str
    kind: str            # "checkpoint" (reference runtime) | "huggingface" (transformers)
    dataset: str
    seconds: float

    def to_dict(self) -> dict:
        """JSON: a non-finite perplexity (an overflow) is null, since NaN is not JSON (`eval --json` printed NaN)."""
        finite = self.perplexity if math.isfinite(self.perplexity) else None
        return {"perplexity": finite, "tokens": self.tokens}

    def summary(self) -> str:
        runner = "reference runtime" if self.kind == "checkpoint" else "transformers"
        return (f"perplexity {self.perplexity:.4f} over {self.tokens} tokens of {self.dataset}\n"
                f"model: {self.model} ({runner}), {self.seconds:.1f}s")


def evaluate(model: str | Path, dataset: str | None = None, *, tokenizer: Path | None = None,
             window: int = DEFAULT_WINDOW, max_samples: int | None = None, device: str = "auto",
             progress: bool = True) -> EvalResult:
    """Perplexity of `model` (checkpoint dir, HF dir, preset, GGUF or hub id) over `dataset`.

    A checkpoint is scored a decoder layer at a time on `device` (`LayerStream`), so its size does not
    bound what fits; a Hugging Face model runs whole in transformers (float32, CPU).
    """
    if max_samples is not None and max_samples < 1:
        raise UserError(f"--eval-samples must be positive (got {max_samples})")
    description, texts = load_texts(dataset)
    texts = texts[:max_samples] if max_samples else texts
    kind, runner, tok_dir = open_model(str(model), tokenizer, device)
    sequences = tokenize(tok_dir, texts)
    from .runtime import perplexity

    start = time.perf_counter()
    result = perplexity(runner, sequences, window=window, progress=progress, desc="eval")
    return EvalResult(result.perplexity, result.tokens, str(model), kind, description, time.perf_counter() - start)


def is_checkpoint_dir(path: Path) -> bool:
    """Rank files (a checkpoint, even without its config.json: the runtime then names what is missing), or
    a TensorRT-LLM config.json."""
    return any(path.glob("rank*.safetensors")) or is_trtllm_checkpoint(path)


def open_model(spec: str, tokenizer: Path | None, device: str = "auto"):
    """("checkpoint" | "huggingface", a model `perplexity` scores, the tokenizer directory).

    A quantized Hugging Face checkpoint (modelopt's FP8 layout, `calibrate --format both`) is scored by the
    reference runtime as the checkpoint it is; a float one by transformers."""
    from .runtime.hf_checkpoint import is_quantized_hf_checkpoint

    path = Path(spec).expanduser()
    hf_quantized = path.is_dir() and is_quantized_hf_checkpoint(path)
    if path.is_dir() and (is_checkpoint_dir(path) or hf_quantized):
        from .runtime import LayerStream, resolve_device

        model = LayerStream(path, resolve_device(device))
        tok_dir = tokenizer or (path if hf_quantized else path / "tokenizer")
        if not (tok_dir / "tokenizer_config.json").is_file() and not (tok_dir / "tokenizer.json").is_file():
            raise UserError(f"no tokenizer in {tok_dir}; pass --tokenizer with the Hugging Face model directory "
                            "the checkpoint was converted from")
        return "checkpoint", model, tok_dir
    from .sources import resolve_model

    hf_dir = resolve_model(spec).hf_dir()
    return "huggingface", HuggingFaceLogits(hf_dir), tokenizer or hf_dir


class HuggingFaceLogits:
    """A transformers causal LM in float32 with the runtime's forward(ids) -> float32 logits interface."""

    def __init__(self, hf_dir: Path):
        from transformers import AutoModelForCausalLM

        try:
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        except Exception as exc:  # transformers raises many types for a bad directory
            raise UserError(f"{hf_dir}: cannot load the Hugging Face model ({type(exc).__name__}: {exc})") from None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits.float()


def tokenize(tok_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tok_dir)
    except Exception as exc:
        raise UserError(f"cannot load a tokenizer from {tok_dir} ({type(exc).__name__}: {exc})") from None
    return [tok(text)["input_ids"] for text in texts]


def load_texts(dataset: str | None) -> tuple[str, list[str]]:
    """(description, texts): the held-out corpus, a plain text file (one sample per line) or a HF dataset."""
    if dataset is None:
        return "the held-out offline news corpus", corpus_split()[1]
    path = Path(dataset).expanduser()
    if path.is_file():
        texts = [t.strip() for t in path.read_text(encoding="utf-8", errors="replace").splitlines() if t.strip()]
        if not texts:
            raise UserError(f"{path} has no text (every line is empty)")
        return str(path), texts
    if path.exists():
        raise UserError(f"--dataset {dataset} is a directory; pass a plain text file or a dataset name")
    return dataset, load_hf_dataset(dataset)


def load_hf_dataset(spec: str) -> list[str]:
    """NAME or NAME:CONFIG from the local Hugging Face datasets cache (never downloads)."""
    name, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise UserError(f"--dataset {spec}: loading named datasets needs the `datasets` package "
                        "(pip install 'trtpipe[calib]'), or pass a plain text file") from None
    errors = []
    for split in ("test", "validation", "train"):
        try:
            with offline():
                ds = datasets.load_dataset(name, config or None, split=split)
        except Exception as exc:  # datasets raises many types when a split or the cache is missing
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        column = "text" if "text" in ds.column_names else next(
            (c for c, f in ds.features.items() if getattr(f, "dtype", None) == "string"), None)
        if column is None:
            raise UserError(f"dataset {spec} has no text column (columns: {', '.join(ds.column_names)})")
        texts = [t.strip() for t in ds[column] if t and t.strip()]
        if texts:
            return texts
    raise UserError(f"--dataset {spec} is not a file and could not be loaded offline from the Hugging Face "
                    f"datasets cache ({errors[-1] if errors else 'no text'}); pass a plain text file instead")


@contextmanager
def offline():
    """datasets and huggingface_hub in offline mode for the duration (nothing is downloaded at run time).

    Both libraries read their offline switches at import time, so the module flags are set directly.
    """
    import datasets.config as dconfig
    from huggingface_hub import constants as hconstants

    flags = [(dconfig, "HF_HUB_OFFLINE"), (dconfig, "HF_DATASETS_OFFLINE"), (hconstants, "HF_HUB_OFFLINE")]
    saved = [getattr(module, name) for module, name in flags]
    for module, name in flags:
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(flags, saved):
            setattr(module, name, value)
