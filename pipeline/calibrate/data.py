"""Calibration data: recipes (calibration/*.json), text loading through `datasets`, tokenized samples.

A recipe names the dataset, the text field, the number of samples, the sequence length and the seed;
the same recipe always gives the same token samples. `--dataset` is a recipe name, a local
text / jsonl / json / parquet / csv file, or a Hugging Face dataset name read from the local cache
(nothing is downloaded: trtpipe runs offline).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import UserError
from ..package_data import RECIPES

DEFAULT_RECIPE = "news"
OFFLINE_CORPUS = "trtpipe:news"
LOCAL_BUILDERS = {".txt": "text", ".cor": "text", ".text": "text", ".jsonl": "json", ".json": "json",
                  ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class CalibrationRecipe:
    name: str
    dataset: str               # "trtpipe:news" | a local file | a Hugging Face dataset name
    field: str = "text"
    samples: int = 64
    seq_len: int = 256
    seed: int = 0
    config: str | None = None  # Hugging Face dataset configuration (e.g. "3.0.0")
    split: str = "train"

    def to_dict(self) -> dict:
        return {"name": self.name, "dataset": self.dataset, "field": self.field, "samples": self.samples,
                "seq_len": self.seq_len, "seed": self.seed, "config": self.config, "split": self.split}


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.json"))


def load_recipe(name: str) -> CalibrationRecipe:
    path = RECIPES / f"{name}.json"
    if not path.is_file():
        raise UserError(f"no calibration recipe {name!r} in {RECIPES} (recipes: {', '.join(recipe_names())})")
    data = json.loads(path.read_text())
    data.pop("description", None)
    return CalibrationRecipe(**data)


def resolve_recipe(dataset: str | None, *, text_field: str | None = None, samples: int | None = None,
                   seq_len: int | None = None, seed: int | None = None) -> CalibrationRecipe:
    """The recipe for `--dataset` (default: the offline news corpus) with the command-line overrides."""
    if dataset is None:
        recipe = load_recipe(DEFAULT_RECIPE)
    elif (RECIPES / f"{dataset}.json").is_file():
        recipe = load_recipe(dataset)
    elif Path(dataset).expanduser().exists():
        path = Path(dataset).expanduser().resolve()
        if path.is_dir() or path.suffix.lower() not in LOCAL_BUILDERS:
            raise UserError(f"--dataset {dataset}: expected a text, jsonl, json, parquet or csv file "
                            f"(suffixes {', '.join(LOCAL_BUILDERS)})")
        recipe = CalibrationRecipe(name=path.name, dataset=str(path))
    elif dataset.count("/") == 1:
        recipe = CalibrationRecipe(name=dataset, dataset=dataset)
    else:
        raise UserError(f"--dataset {dataset!r} is neither a recipe ({', '.join(recipe_names())}), "
                        "an existing file, nor a Hugging Face dataset name (org/name)")
    overrides = {k: v for k, v in dict(field=text_field, samples=samples, seq_len=seq_len, seed=seed).items()
                 if v is not None}
    recipe = replace(recipe, **overrides)
    if recipe.samples < 1:
        raise UserError(f"--samples must be at least 1 (got {recipe.samples})")
    if recipe.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2 tokens (got {recipe.seq_len})")
    return recipe


def load_texts(recipe: CalibrationRecipe) -> list[str]:
    """Every text of the recipe's dataset, in dataset order (empty ones dropped)."""
    if recipe.dataset == OFFLINE_CORPUS:
        from ..evaluate import corpus_split
        texts = list(corpus_split(seed=0)[0])   # the split is fixed; the seed orders samples
    else:
        texts = _texts_from_datasets(recipe)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"calibration dataset {recipe.dataset} has no text in field {recipe.field!r}")
    return texts


def _texts_from_datasets(recipe: CalibrationRecipe) -> list[str]:
    import datasets

    local = Path(recipe.dataset)
    with _offline(), _quiet_datasets():
        try:
            if local.is_file():
                builder = LOCAL_BUILDERS[local.suffix.lower()]
                ds = datasets.load_dataset(builder, data_files=str(local), split="train")
            else:
                ds = datasets.load_dataset(recipe.dataset, recipe.config, split=recipe.split)
        except (FileNotFoundError, ConnectionError, ValueError, OSError) as exc:
            if local.is_file():
                raise UserError(f"cannot read {local} as {LOCAL_BUILDERS[local.suffix.lower()]} data: "
                                f"{str(exc).splitlines()[0][:300]}") from None
            raise UserError(_not_cached_message(recipe, exc)) from None
        except Exception as exc:  # datasets wraps parse errors of local files in its own exception types
            if local.is_file():
                cause = root_cause(exc)
                raise UserError(f"cannot read {local} as {LOCAL_BUILDERS[local.suffix.lower()]} data: "
                                f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:300]}") from None
            raise UserError(_not_cached_message(recipe, exc)) from None
    if recipe.field not in ds.column_names:
        raise UserError(f"calibration dataset {recipe.dataset} has no field {recipe.field!r}; "
                        f"its fields are {', '.join(ds.column_names)} (choose one with --text-field)")
    return [str(t) for t in ds[recipe.field] if t is not None]


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception: datasets' DatasetGenerationError says only "An error occurred while generating the
    dataset"; what was wrong with the file (bad JSON, not UTF-8, empty) is in its cause."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


def _not_cached_message(recipe: CalibrationRecipe, exc: Exception) -> str:
    from datasets import config as ds_config
    config = f", {recipe.config!r}" if recipe.config else ""
    return (f"Hugging Face dataset {recipe.dataset!r} (split {recipe.split!r}) is not in the local datasets "
            f"cache {ds_config.HF_DATASETS_CACHE} and trtpipe does not download at run time "
            f"({type(exc).__name__}). Fetch it once where the network is reachable: python -c \"import "
            f"datasets; datasets.load_dataset({recipe.dataset!r}{config}, split={recipe.split!r})\", "
            "or pass a local text/jsonl/parquet file with --dataset PATH --text-field FIELD")


@contextmanager
def _offline() -> Iterator[None]:
    """Make `datasets` and the hub client use only local files for the duration of the load."""
    import datasets.config as ds_config
    import huggingface_hub.constants as hub_constants

    saved = ds_config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE
    ds_config.HF_DATASETS_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        ds_config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        datasets.enable_progress_bars()


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    tok_dir = checkpoint / "tokenizer"
    if not tok_dir.is_dir():
        raise UserError(f"{checkpoint} has no tokenizer/ directory; re-create the checkpoint with "
                        "`trtpipe convert` (it copies the tokenizer beside the weights)")
    return AutoTokenizer.from_pretrained(tok_dir)


def tokenize_samples(texts: list[str], tokenizer, recipe: CalibrationRecipe) -> list[list[int]]:
    """`recipe.samples` texts in a seeded order, each cut to at most `recipe.seq_len` tokens."""
    order = np.random.default_rng(recipe.seed).permutation(len(texts))
    samples = []
    for k in order:
        ids = tokenizer(texts[k])["input_ids"][: recipe.seq_len]
        if len(ids) >= 2:
            samples.append(ids)
        if len(samples) == recipe.samples:
            break
    if not samples:
        raise UserError(f"calibration dataset {recipe.dataset} has no text of at least 2 tokens")
    return samples
