"""The LLM API arguments of the pinned TensorRT-LLM release (data/llm_api_args_<version>.txt, its source in the
file's header): the keys an llmapi model.yaml or a trtllm-serve options YAML may hold. The pytorch backend writes
those files; `trtpipe check` reads them back against this list (LlmArgs forbids extra keys).
"""

from __future__ import annotations

import difflib
from functools import cache

from .. import TRTLLM_VERSION
from ..errors import UserError
from ..package_data import DATA_DIR

#: The llmapi model's own YAML (NVIDIA's triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml).
MODEL_YAML = "model.yaml"
#: TorchLlmArgs keys of the pinned TensorRT-LLM release, with their source (the file's header).
LLM_API_ARGS_FILE = DATA_DIR / f"llm_api_args_{TRTLLM_VERSION}.txt"



@cache
def recorded_llm_api_keys() -> dict[str, frozenset[str]]:
    """{"llm_args": keys, "model.yaml": the llmapi model's own keys}; SECTION.KEY for nested keys."""
    if not LLM_API_ARGS_FILE.is_file():
        raise UserError(f"trtpipe's LLM API argument list {LLM_API_ARGS_FILE} is missing; reinstall trtpipe")
    sections: dict[str, set[str]] = {}
    current = None
    for line in LLM_API_ARGS_FILE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], set())
        elif current is not None:
            current.add(line)
    return {name: frozenset(keys) for name, keys in sections.items()}


def unknown_llm_api_keys(data: dict, model_yaml_file: bool) -> list[tuple[str, str]]:
    """(key, the nearest known key or "") for every key of an LLM API YAML that TensorRT-LLM would refuse
    (LlmArgs forbids extra keys); nested keys are checked for the sections whose keys are recorded."""
    recorded = recorded_llm_api_keys()
    known = recorded["llm_args"] | (recorded["model.yaml"] if model_yaml_file else frozenset())
    problems = []
    for key, value in data.items():
        name = str(key)
        if name not in known:
            problems.append((name, _nearest(name, {k for k in known if "." not in k})))
            continue
        nested = {k for k in known if k.startswith(name + ".")}
        if nested and isinstance(value, dict):
            problems += [(f"{name}.{sub}", _nearest(f"{name}.{sub}", nested)) for sub in value
                         if f"{name}.{sub}" not in nested]
    return problems


def _nearest(key: str, candidates: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return match[0] if match else ""
