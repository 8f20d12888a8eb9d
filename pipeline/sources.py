"""Model sources: one resolver that every stage uses.

A source is a local Hugging Face directory, a GGUF file, a preset name or a hub id. Hub ids are
resolved offline only: from a directory the user names (--model-dir / $TRTPIPE_MODEL_DIR) or from
the local Hugging Face cache. Nothing here touches the network.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .arch import ModelArch
from .assets import cache_dir, smollm2_gguf_path
from .errors import UserError, read_config_json
from .outputs import atomic_output_dir
from .presets import PRESETS


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what the user named, the architecture numbers, and where weights are."""

    spec: str
    kind: str                 # "hf-dir" | "gguf" | "preset" (architecture only, no weights here)
    arch: ModelArch
    path: Path | None = None  # the HF directory or the GGUF file
    missing_weights_hint: str = ""

    def hf_dir(self) -> Path:
        """A Hugging Face directory with safetensors weights (a GGUF is dequantized into the cache once)."""
        if self.kind == "hf-dir":
            return self.path
        if self.kind == "gguf":
            return materialize_gguf(self.path)
        raise UserError(self.missing_weights_hint)


def resolve_model(spec: str, model_dir: Path | None = None) -> ModelSource:
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSource(spec, "hf-dir", read_hf_arch(path), path.resolve())
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path} is a file but not a GGUF file; pass a Hugging Face directory, "
                            "a .gguf file, a preset name or a hub id")
        return ModelSource(spec, "gguf", read_gguf_arch(path), path.resolve())
    preset = PRESETS.get(spec)
    if preset and preset.hub_id is None:
        gguf = smollm2_gguf_path()
        return ModelSource(spec, "gguf", preset.arch, gguf)
    hub_id = preset.hub_id if preset else spec
    if not preset and spec.count("/") != 1:
        raise UserError(f"model {spec!r} is not a directory, a .gguf file, a preset "
                        f"({', '.join(PRESETS)}) or a hub id (org/name)")
    found, looked = find_local_hub_model(hub_id, spec, model_dir)
    if found:
        return ModelSource(spec, "hf-dir", read_hf_arch(found), found)
    hint = (f"weights for {spec!r} ({hub_id}) are not on this machine; looked in {', '.join(looked)}. "
            f"Download them where the network is reachable (`hf download {hub_id}`) and point "
            "--model-dir or $TRTPIPE_MODEL_DIR at the directory, or pass the directory itself")
    if preset:
        return ModelSource(spec, "preset", preset.arch, None, hint)
    raise UserError(hint)


def find_local_hub_model(hub_id: str, name: str, model_dir: Path | None) -> tuple[Path | None, list[str]]:
    looked = []
    roots = [Path(p) for p in (model_dir, os.environ.get("TRTPIPE_MODEL_DIR")) if p]
    for root in roots:
        for candidate in (root / name, root / hub_id, root / hub_id.split("/")[-1], root):
            looked.append(str(candidate))
            if (candidate / "config.json").is_file():
                return candidate.resolve(), looked
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    looked.append(f"the Hugging Face cache {HF_HUB_CACHE}")
    try:
        snap = Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:
        return None, looked
    return (snap, looked) if (snap / "config.json").is_file() else (None, looked)


def read_hf_arch(directory: Path) -> ModelArch:
    cfg = read_config_json(directory, f"{directory} has no config.json; it is not a Hugging Face model directory")
    return ModelArch.from_hf_config(cfg, where=str(directory / "config.json"))


def read_gguf_arch(path: Path) -> ModelArch:
    config = _load_gguf_config(path)
    return ModelArch.from_hf_config(_clean_config_dict(config), where=str(path))


def _load_gguf_config(path: Path):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for a bad GGUF
        raise UserError(f"{path}: cannot read GGUF metadata ({type(exc).__name__}: {exc})") from None


def _clean_config_dict(config) -> dict:
    """The HF config without the GGUF `quantization_config`: the weights are dequantized on load."""
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [
        {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(cfg.get("model_type"), "?")]
    return cfg


def materialize_gguf(path: Path) -> Path:
    """Dequantize a GGUF into a float32 Hugging Face directory in the cache (once per file version)."""
    st = path.stat()
    out = cache_dir() / "hf" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig

    config = _load_gguf_config(path)
    clean = _clean_config_dict(config)
    clean["torch_dtype"] = "float32"
    config_cls = MistralConfig if clean["architectures"][0] == "MistralForCausalLM" else LlamaConfig
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        raise UserError(f"{path}: cannot load GGUF weights ({type(exc).__name__}: {exc})") from None
    model.config = config_cls.from_dict({k: v for k, v in clean.items() if k != "transformers_version"})
    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out
