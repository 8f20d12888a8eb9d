"""The model-family registry: every supported architecture and the one spec each stage reads for it."""

from __future__ import annotations

from .families.llama import LLAMA
from .families.qwen import QWEN
from .spec import Family

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN)
#: Hugging Face `architectures[0]` values trtpipe converts, serves and plans
ARCHITECTURES: tuple[str, ...] = tuple(a for family in FAMILIES for a in family.architectures)
#: GGUF `model_type` -> Hugging Face architecture
GGUF_MODEL_TYPES: dict[str, str] = {k: v for family in FAMILIES for k, v in family.gguf_model_types.items()}


def family_of(architecture: str | None) -> Family | None:
    return next((f for f in FAMILIES if architecture in f.architectures), None)
