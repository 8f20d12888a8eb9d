"""The LLM API arguments of each TensorRT-LLM release trtpipe has checked (data/llm_api_args_<version>.txt, one per
version, its source in the file's header): the keys an llmapi model.yaml or a trtllm-serve options YAML may hold.
The pytorch backend writes those files; `trtpipe check` reads them back against the list of the runtime's version
(LlmArgs forbids extra keys). The fields change between versions (1.3 dropped `build_config`, for one).
"""

from __future__ import annotations

import difflib
from functools import cache

from .. import TRTLLM_VERSION
from ..errors import UserError
from ..package_data import DATA_DIR

#: The llmapi model's own YAML (NVIDIA's triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml).
MODEL_YAML = "model.yaml"
#: The TensorRT-LLM versions whose TorchLlmArgs keys are recorded, oldest first.
LLM_API_VERSIONS = ("1.2.1", "1.3.0rc27")
#: the section whose keys depend on one of its values (decoding_type): recorded as "TYPE KEY" lines
SPECULATIVE_CONFIG = "speculative_config"


def llm_api_args_file(version: str = TRTLLM_VERSION):
    """The recorded TorchLlmArgs keys of `version`, with their source in the file's header."""
    if version not in LLM_API_VERSIONS:
        raise UserError(f"trtpipe has not checked the LLM API of TensorRT-LLM {version}; it knows "
                        f"{', '.join(LLM_API_VERSIONS)}")
    return DATA_DIR / f"llm_api_args_{version}.txt"


@cache
def recorded_llm_api_keys(version: str = TRTLLM_VERSION) -> dict[str, frozenset[str]]:
    """{"llm_args": keys, "model.yaml": the llmapi model's own keys} of `version`; SECTION.KEY for nested keys."""
    path = llm_api_args_file(version)
    if not path.is_file():
        raise UserError(f"trtpipe's LLM API argument list {path} is missing; reinstall trtpipe")
    sections: dict[str, set[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], set())
        elif current is not None:
            current.add(line)
    return {name: frozenset(keys) for name, keys in sections.items()}


def unknown_llm_api_keys(data: dict, model_yaml_file: bool, version: str = TRTLLM_VERSION) -> list[tuple[str, str]]:
    """(key, the nearest known key or "") for every key of an LLM API YAML that TensorRT-LLM `version` would refuse
    (LlmArgs forbids extra keys); nested keys are checked for the sections whose keys are recorded, and
    speculative_config's by its decoding_type (`speculative_config_problems`)."""
    recorded = recorded_llm_api_keys(version)
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
        if name == SPECULATIVE_CONFIG and isinstance(value, dict) and SPECULATIVE_CONFIG in recorded:
            problems += speculative_config_problems(value, recorded[SPECULATIVE_CONFIG])
    return problems


def speculative_config_problems(config: dict, recorded: frozenset[str]) -> list[tuple[str, str]]:
    """speculative_config is one of several classes, chosen by its decoding_type (1.2.x: DecodingBaseConfig.from_dict's
    class map; 1.3: a union discriminated on it), each forbidding keys it lacks. `recorded` holds "TYPE KEY" for
    every key of the types whose keys are recorded, and "TYPE *" for the types only named: a decoding_type that is
    none of them, or a key its type lacks, is a problem."""
    fields: dict[str, set[str]] = {}
    for line in recorded:
        kind, _, key = line.partition(" ")
        fields.setdefault(kind, set()).add(key)
    kind = str(config.get("decoding_type"))
    if kind not in fields:
        return [(f"{SPECULATIVE_CONFIG}.decoding_type: {kind}", _nearest(kind, set(fields)))]
    if "*" in fields[kind]:
        return []
    return [(f"{SPECULATIVE_CONFIG}.{key} ({kind})", _nearest(str(key), fields[kind])) for key in config
            if str(key) not in fields[kind]]


def _nearest(key: str, candidates: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return match[0] if match else ""
