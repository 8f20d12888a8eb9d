"""`trtpipe check`: static checks of a Triton LLM model repository (ours, or one made with fill_template.py).

Every finding names the file, the field and the fix. Errors make the repository wrong (exit 1);
warnings are worth reading; info lines say which checks could not run (e.g. no engine yet).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import TRTLLM_VERSION
from .backends.llm_api_args import LLM_API_VERSIONS, MODEL_YAML, unknown_llm_api_keys
from .backends.nvidia_contract import (FATAL, LITERAL, MULTIMODAL, MULTIMODAL_PROCESSOR, PROCESSOR_MODEL_TYPES,
                                       PYTHON_MODELS, SKIPPED, TENSORRTLLM, UNSET, Parameter, required_keys)
from .errors import UserError
from .model_repository import CONFIG, NO_CONFIG, ModelRepository, RepositoryModel, read_repository
from .triton_contract import MODELS as NVIDIA_TENSORS, declared_differently
from .triton_names import (NUM_DRAFT_TOKENS, STREAM, STREAMING, TENSORRT_LLM, TENSORRT_LLM_DRAFT_MODEL_NAME,
                           TENSORRT_LLM_MODEL_NAME)
from .tritonconfig import dtype_name

PLACEHOLDER = re.compile(r"\$\{[^}]*\}")
PARAMETER_FIELD = re.compile(r"^parameters\[(.+)\]\.string_value$")
#: Files whose text may legitimately contain "${" (tokenizer vocabularies) or is code, not configuration.
NOT_CONFIGURATION = {"tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json",
                     "special_tokens_map.json", "tokenizer_config.json"}
CONFIG_SUFFIXES = {".pbtxt", ".json", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".env"}
PAGED_FMHA_PARAMETERS = ("enable_kv_cache_reuse", "enable_chunked_context")


@dataclass(frozen=True)
class Finding:
    code: str        # schema | placeholder | parameter | wiring | tensor | batch-size | streaming |
    #                  paged-context-fmha | preferred-batch-size | engine-version | engine | llm-api | draft
    severity: str    # error | warning | info
    file: str        # relative to the repository
    field: str
    problem: str
    fix: str

    def describe(self) -> str:
        return f"{self.severity}: {self.file}: {self.field}: {self.problem}. Fix: {self.fix}"


@dataclass
class CheckReport:
    repo: Path
    models: list[str]
    findings: list[Finding] = field(default_factory=list)
    engine: Path | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"repository": str(self.repo), "ok": self.ok, "models": self.models,
                "engine": str(self.engine) if self.engine else None,
                "findings": [asdict(f) for f in self.findings]}

    def summary(self) -> str:
        lines = [f.describe() for f in self.findings]
        count = {s: sum(f.severity == s for f in self.findings) for s in ("error", "warning")}
        verdict = "OK" if self.ok else "WRONG"
        lines.append(f"{verdict}: {self.repo} ({len(self.models)} models: {', '.join(self.models)}); "
                     f"{count['error']} error(s), {count['warning']} warning(s)")
        return "\n".join(lines)


def check_repository(repo: Path, *, engine: Path | None = None, trtllm_version: str | None = None) -> CheckReport:
    """All static checks on the repository at `repo`; `engine` overrides the engine path in its configs and
    `trtllm_version` the TensorRT-LLM version its manifest records (deploy checks before it writes the manifest)."""
    repo = Path(repo)
    repository = read_repository(repo)
    version = trtllm_version or repository.trtllm_version
    models = repository.models
    findings, unparsed = parse_models(repository)
    if not models and not findings and not any(repo.glob("*.yaml")):
        raise UserError(f"{repo} holds no model (no */config.pbtxt); pass a Triton model repository")
    findings += check_placeholders(repo, models)
    findings += check_required_parameters(models)
    findings += check_preferred_batch_sizes(models)
    for ensemble in (m for m in models.values() if m.config.platform == "ensemble"):
        findings += check_ensemble(ensemble, models, unparsed)
        findings += check_tensor_contract(models)
    findings += check_streaming(models)
    findings += check_draft_target(models)
    findings += check_llm_api_yaml(repo, version)
    engine_path = None
    for model in (m for m in models.values() if m.serves_engine):   # `engine` is the target's (tensorrt_llm)
        found, engine_findings = check_engine(version, model,
                                              engine if model.name == TENSORRT_LLM else None)
        engine_path = found if model.name == TENSORRT_LLM else engine_path
        findings += engine_findings
    return CheckReport(repo, sorted(models), findings, engine_path)


# ------------------------------------------------------------------------------------------ schema

def parse_models(repository: ModelRepository) -> tuple[list[Finding], set[str]]:
    """A finding for each model whose config cannot be used or names another model; the names of those whose
    config does not parse."""
    findings, unparsed = [], set()
    for name, why in repository.unusable.items():
        rel = f"{name}/{CONFIG}"
        if why == NO_CONFIG:
            findings.append(Finding("schema", "error", rel, "(file)", "the model has a version directory but "
                                    "no config.pbtxt", "write its config.pbtxt (trtpipe deploy writes all five)"))
            continue
        findings.append(Finding("schema", "error", rel, _parse_error_field(why), why,
                                "correct the field (an unfilled ${...} placeholder in a number, bool or "
                                "enum field is the usual cause: run fill_template.py with that key)"))
        unparsed.add(name)
    for model in repository.models.values():
        if model.config.name and model.config.name != model.name:
            findings.append(Finding("schema", "error", model.file, "name", f"name {model.config.name!r} differs "
                                    f"from the directory name {model.name!r}", f"set name: \"{model.name}\""))
    return findings, unparsed


def _parse_error_field(message: str) -> str:
    match = re.search(r"(\d+):(\d+)", message)
    return f"line {match.group(1)}, column {match.group(2)}" if match else "(file)"


# ------------------------------------------------------------------------------------- placeholders

def check_placeholders(repo: Path, models: dict[str, RepositoryModel]) -> list[Finding]:
    findings = []
    parsed = {repo / m.file for m in models.values()}
    for path in sorted(p for p in repo.rglob("*") if p.is_file() and p.suffix in CONFIG_SUFFIXES):
        if path.name in NOT_CONFIGURATION:
            continue
        rel = str(path.relative_to(repo))
        if path in parsed:
            spots = [(where, value) for where, value in _string_fields(models[path.parent.name].config)
                     if PLACEHOLDER.search(value)]
        else:
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            spots = [(f"line {i}", line.strip()) for i, line in enumerate(text.splitlines(), 1)
                     if PLACEHOLDER.search(line)]
        for where, value in spots:
            model = models.get(path.parent.name) if path in parsed else None
            findings.append(placeholder_finding(rel, where, value, model, path.name))
    return findings


def contract_of(model: RepositoryModel) -> tuple[str, dict[str, Parameter]]:
    """Who reads the model's parameters (NVIDIA's C++ backend or its Python model of that name) and how."""
    if model.config.backend == "tensorrtllm":
        return "the tensorrtllm backend", TENSORRTLLM
    if model.config.backend == "python" and model.name in PYTHON_MODELS:
        return f"NVIDIA's {model.name} model.py", PYTHON_MODELS[model.name]
    return "", {}


def placeholder_finding(rel: str, where: str, value: str, model: RepositoryModel | None, file_name: str) -> Finding:
    """An unfilled `${...}`: judged by what NVIDIA's code does with that parameter (nvidia_contract), so that a
    placeholder NVIDIA's own fill leaves for "not set" is a warning, and no advice removes a key the model needs."""
    names = ", ".join(m[2:-1] for m in PLACEHOLDER.findall(value))
    fill = f"fill {names} (fill_template.py {file_name} {names.split(',')[0]}:VALUE)"
    match = PARAMETER_FIELD.match(where)
    reader, table = contract_of(model) if model is not None else ("", {})
    known = table.get(match.group(1)) if match and PLACEHOLDER.fullmatch(value) else None
    if known is None:
        return Finding("placeholder", "error", rel, where, f"unfilled placeholder(s) in {value!r}",
                       f"{fill} or remove the entry")
    if known.condition and not condition_holds(known, model):
        return Finding("placeholder", "info", rel, where, f"{value!r} is unfilled; {reader} reads it only with "
                       f"{known.condition} ({known.source})", f"{fill} if you use {known.condition}")
    if known.placeholder == UNSET:
        return Finding("placeholder", "warning", rel, where, f"{value!r} is unfilled: {reader} treats it as not set "
                       f"and uses {known.missing if known.missing != FATAL else 'nothing'} ({known.source})",
                       f"{fill} to set it, or keep it (the entry must stay)" if known.missing == FATAL
                       else f"{fill} to set it, or keep it for the default")
    if known.placeholder == SKIPPED:
        return Finding("placeholder", "warning", rel, where, f"{value!r} is unfilled: {reader} passes it on as it is "
                       f"({known.source}) and {known.final_use}", f"{fill} to set it, or keep it for the default")
    what = ("uses it literally as a path" if known.placeholder == LITERAL else "fails to load")
    return Finding("placeholder", "error", rel, where, f"{value!r} is unfilled: {reader} {what} ({known.source})",
                   f"{fill}; the entry must stay" if known.missing == FATAL else f"{fill} or remove the entry")


def condition_holds(parameter: Parameter, model: RepositoryModel) -> bool:
    """Whether a conditionally read parameter is read by this model's config (lookahead decoding, a multimodal
    engine, one of the multimodal types that load a processor; orchestrator mode)."""
    if parameter.condition == "decoding_mode lookahead":
        return model.parameter("decoding_mode") == "lookahead"
    if parameter.condition == MULTIMODAL:
        return multimodal_engine(model) is not None
    if parameter.condition == MULTIMODAL_PROCESSOR:
        return multimodal_model_type(model) in PROCESSOR_MODEL_TYPES
    return False   # orchestrator mode is an environment variable of the server, not in the config


def multimodal_engine(model: RepositoryModel) -> str | None:
    """multimodal_model_path as NVIDIA's preprocessing reads it: "" and its own placeholder are not set
    (preprocessing/1/model.py:86-87)."""
    path = model.parameter("multimodal_model_path")
    return None if path in (None, "", "${multimodal_model_path}") else path


def multimodal_model_type(model: RepositoryModel) -> str | None:
    """The multimodal engine's `builder_config.model_type` (its config.json, preprocessing/1/model.py:131-136);
    None without a multimodal engine or when its config cannot be read here."""
    path = multimodal_engine(model)
    if path is None:
        return None
    try:
        return json.loads((Path(path) / "config.json").read_text())["builder_config"]["model_type"]
    except (TypeError, OSError, ValueError, KeyError):
        return None


def check_required_parameters(models: dict[str, RepositoryModel]) -> list[Finding]:
    """Keys NVIDIA's code reads with no fallback: their absence fails the model's load (nvidia_contract)."""
    findings = []
    for model in models.values():
        reader, table = contract_of(model)
        for key in required_keys(table):
            if key not in model.config.parameters:
                findings.append(Finding(
                    "parameter", "error", model.file, f"parameters[{key}]",
                    f"missing: {reader} reads it with no fallback and the model fails to load "
                    f"('Cannot find parameter with name: {key}', {table[key].source})",
                    f'add parameters {{ key: "{key}" value: {{ string_value: "" }} }} ("" is "not set")'
                    if table[key].placeholder == UNSET else f"add the {key} parameter with its value"))
    return findings


def _string_fields(message, prefix: str = ""):
    """(field path, value) for every string anywhere in a protobuf message."""
    for descriptor, value in message.ListFields():
        path = f"{prefix}{descriptor.name}"
        if descriptor.message_type and descriptor.message_type.GetOptions().map_entry:
            for key, item in value.items():
                item_path = f"{path}[{key}]"
                if isinstance(item, str):
                    yield item_path, item
                elif hasattr(item, "ListFields"):
                    yield from _string_fields(item, item_path + ".")
        elif descriptor.is_repeated:
            for i, item in enumerate(value):
                if isinstance(item, str):
                    yield f"{path}[{i}]", item
                elif hasattr(item, "ListFields"):
                    yield from _string_fields(item, f"{path}[{i}].")
        elif isinstance(value, str):
            yield path, value
        elif hasattr(value, "ListFields"):
            yield from _string_fields(value, path + ".")


# ------------------------------------------------------------------------------------ batch sizes

def check_preferred_batch_sizes(models: dict[str, RepositoryModel]) -> list[Finding]:
    findings = []
    for m in models.values():
        preferred = list(m.config.dynamic_batching.preferred_batch_size)
        bad = [b for b in preferred if b < 1 or b > m.config.max_batch_size]
        if bad:
            findings.append(Finding("preferred-batch-size", "error", m.file, "dynamic_batching.preferred_batch_size",
                                    f"{bad} outside 1..max_batch_size ({m.config.max_batch_size}); Triton refuses "
                                    "to load the model",
                                    f"use sizes between 1 and {m.config.max_batch_size}, or none"))
    return findings


# ------------------------------------------------------------------------------------------ ensembles

def check_ensemble(ensemble: RepositoryModel, models: dict[str, RepositoryModel], unparsed: set[str]) -> list[Finding]:
    findings = []
    cfg = ensemble.config
    ens_inputs = {t.name: t for t in cfg.input}
    ens_outputs = {t.name: t for t in cfg.output}
    produced: dict[str, tuple[str, object]] = {}   # ensemble tensor -> (where, the step model's output)
    unknown: set[str] = set()   # tensors of steps whose model is missing or unparsable (reported already)
    for step in cfg.ensemble_scheduling.step:
        model = models.get(step.model_name)
        if model is None:
            unknown.update(step.output_map.values())
            continue
        outputs = model.outputs()
        for key, value in step.output_map.items():
            if key in outputs:
                produced[value] = (f"{step.model_name}.{key}", outputs[key])

    def add(field_name: str, problem: str, fix: str, code: str = "wiring") -> None:
        findings.append(Finding(code, "error", ensemble.file, field_name, problem, fix))

    for i, step in enumerate(cfg.ensemble_scheduling.step):
        where = f"ensemble_scheduling.step[{i}]"
        model = models.get(step.model_name)
        if step.model_name in unparsed:
            continue
        if model is None:
            add(f"{where}.model_name", f"no model {step.model_name!r} in the repository",
                f"name one of {sorted(models)} or add the model")
            continue
        if model.config.max_batch_size < cfg.max_batch_size:
            add(f"{where}.model_name", f"{step.model_name} has max_batch_size {model.config.max_batch_size}, "
                f"below the ensemble's {cfg.max_batch_size}",
                f"set the ensemble's max_batch_size to at most {model.config.max_batch_size}", "batch-size")
        inputs, outputs = model.inputs(), model.outputs()
        for key, value in step.input_map.items():
            field_name = f"{where}.input_map[{key}]"
            if key not in inputs:
                add(field_name, f"{step.model_name} has no input {key!r}",
                    f"use one of its inputs: {', '.join(sorted(inputs))}")
                continue
            if value in ens_inputs:
                source, tensor = f"ensemble input {value}", ens_inputs[value]
            elif value in produced:
                source, tensor = produced[value]
            elif value in unknown:
                continue
            else:
                add(field_name, f"tensor {value!r} is neither an ensemble input nor produced by any step",
                    "map it to an ensemble input or to a step's output_map value")
                continue
            findings += _compare(ensemble.file, field_name, source, tensor,
                                 f"{step.model_name} input {key}", inputs[key])
        for name, tensor in inputs.items():
            if not tensor.optional and name not in step.input_map:
                add(f"{where}.input_map", f"required input {name!r} of {step.model_name} is not mapped",
                    f"add input_map {{ key: \"{name}\" value: ... }}")
        for key, value in step.output_map.items():
            field_name = f"{where}.output_map[{key}]"
            if key not in outputs:
                add(field_name, f"{step.model_name} has no output {key!r}",
                    f"use one of its outputs: {', '.join(sorted(outputs))}")
            elif value in ens_outputs:
                findings += _compare(ensemble.file, field_name, f"{step.model_name} output {key}", outputs[key],
                                     f"ensemble output {value}", ens_outputs[value])
    for name in ens_outputs:
        if name not in produced and name not in unknown:
            add(f"output[{name}]", f"ensemble output {name!r} is produced by no step",
                "map a step output to it or remove it")
    return findings


def check_tensor_contract(models: dict[str, RepositoryModel]) -> list[Finding]:
    """An inflight_batcher_llm repository's tensors against NVIDIA's (`triton_contract`): one NVIDIA's own Python
    models request and clients send. A missing tensor is a warning (the feature is lost, and NVIDIA's
    preprocessing or BLS fail on the config); one declared otherwise than NVIDIA declares it is an error."""
    findings = []
    contracts = {**NVIDIA_TENSORS, **{draft: NVIDIA_TENSORS[TENSORRT_LLM] for draft in draft_models(models)}}
    for name, (inputs, outputs) in contracts.items():
        model = models.get(name)
        if model is None:
            continue
        for specs, declared, kind in ((inputs, model.inputs(), "input"), (outputs, model.outputs(), "output")):
            missing = [s.name for s in specs if s.name not in declared]
            if missing:
                findings.append(Finding("tensor", "warning", model.file, f"{kind}s",
                                        f"{len(missing)} of NVIDIA's {len(specs)} {kind}s are not declared: "
                                        f"{', '.join(missing)}",
                                        "declare them as NVIDIA's config.pbtxt does (`trtpipe deploy` writes all); "
                                        "an undeclared tensor is refused by Triton"))
            for spec in (s for s in specs if s.name in declared):
                problem = declared_differently(spec, declared[spec.name], dtype_name, kind == "input")
                if problem:
                    findings.append(Finding("tensor", "error", model.file, f"{kind}[{spec.name}]", problem,
                                            "declare it as NVIDIA's config.pbtxt does"))
    return findings


def _compare(file: str, field_name: str, source: str, a, target: str, b) -> list[Finding]:
    problems = []
    if a.data_type != b.data_type:
        problems.append(f"data type {dtype_name(a.data_type)} of {source} feeds {target} of type "
                        f"{dtype_name(b.data_type)}")
    if not _dims_compatible(list(a.dims), list(b.dims)):
        problems.append(f"shape {list(a.dims)} of {source} does not fit {target} with shape {list(b.dims)}")
    return [Finding("wiring", "error", file, field_name, p, "make the data types and dims agree on both sides")
            for p in problems]


def _dims_compatible(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------- streaming

def check_streaming(models: dict[str, RepositoryModel]) -> list[Finding]:
    findings = []
    for m in models.values():
        if STREAMING not in m.inputs() or m.decoupled:
            continue
        callers = [c for c in models.values() if c.decoupled and c.config.backend == "python"
                   and (c.parameter(TENSORRT_LLM_MODEL_NAME) or TENSORRT_LLM) == m.name and STREAM in c.inputs()]
        for caller in callers:
            findings.append(Finding("streaming", "error", m.file, "model_transaction_policy.decoupled",
                                    f"{caller.name} streams (decoupled) but {m.name} is not decoupled: "
                                    "'Streaming is only supported if model is deployed using decoupled mode'",
                                    "set model_transaction_policy { decoupled: true } (fill_template.py "
                                    "decoupled_mode:true)"))
        if not callers:
            findings.append(Finding("streaming", "warning", m.file, "model_transaction_policy.decoupled",
                                    f"{m.name} accepts the streaming input but is not decoupled: requests with "
                                    "stream=true will fail", "set model_transaction_policy { decoupled: true } "
                                    "if clients stream"))
    return findings


# ---------------------------------------------------------------------------------------- draft-target

def draft_models(models: dict[str, RepositoryModel]) -> set[str]:
    """The models a BLS names as its draft model (tensorrt_llm_draft_model_name)."""
    return {m.set_parameter(TENSORRT_LLM_DRAFT_MODEL_NAME) for m in models.values()
            if m.set_parameter(TENSORRT_LLM_DRAFT_MODEL_NAME)}


def check_draft_target(models: dict[str, RepositoryModel]) -> list[Finding]:
    """A BLS that drafts: its draft model is in the repository, and it, the draft and the target are not decoupled
    (NVIDIA's BLS calls both with exec(decoupled=False) and drafts only for requests that do not stream:
    tensorrt_llm_bls/1/lib/triton_decoder.py and decode.py, tensorrtllm_backend c2e65b8)."""
    findings = []
    for bls in models.values():
        draft = bls.set_parameter(TENSORRT_LLM_DRAFT_MODEL_NAME)
        if not draft:
            continue
        where = f"parameters[{TENSORRT_LLM_DRAFT_MODEL_NAME}]"
        if draft not in models:
            findings.append(Finding("draft", "error", bls.file, where, f"names draft model {draft!r}, which the "
                                    f"repository lacks: requests with {NUM_DRAFT_TOKENS} fail",
                                    f"add {draft}/ (a tensorrt_llm model of the draft's engine), or unset it"))
        target = bls.set_parameter(TENSORRT_LLM_MODEL_NAME) or TENSORRT_LLM
        for model in (models.get(name) for name in (bls.name, target, draft)):
            if model is not None and model.decoupled:
                findings.append(Finding("draft", "error", model.file, "model_transaction_policy.decoupled",
                                        f"{bls.name} drafts with {draft} but {model.name} is decoupled: NVIDIA's BLS "
                                        "calls the draft and target models with decoupled=False",
                                        "set model_transaction_policy { decoupled: false } on the BLS, the target "
                                        "and the draft (NVIDIA's draft-target instructions do)"))
    return findings


# ------------------------------------------------------------------------------------------ LLM API

def check_llm_api_yaml(repo: Path, version: str = TRTLLM_VERSION) -> list[Finding]:
    """Keys of every llmapi model.yaml (MODEL/1/model.yaml) and trtllm-serve options YAML (REPO/*.yaml) against
    the LLM API arguments of the repository's TensorRT-LLM (pipeline/data/llm_api_args_<version>.txt)."""
    import yaml

    paths = sorted([*repo.glob(f"*/*/{MODEL_YAML}"), *repo.glob("*.yaml")])
    if paths and version not in LLM_API_VERSIONS:
        return [Finding("llm-api", "warning", str(paths[0].relative_to(repo)), "(file)", f"the repository targets "
                        f"TensorRT-LLM {version}, whose LLM API trtpipe has not recorded: its keys are unchecked",
                        f"deploy for one of {', '.join(LLM_API_VERSIONS)}")]
    findings = []
    for path in paths:
        rel = str(path.relative_to(repo))
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            findings.append(Finding("llm-api", "error", rel, "(file)", f"not valid YAML ({exc})", "fix the syntax"))
            continue
        if not isinstance(data, dict):
            findings.append(Finding("llm-api", "error", rel, "(file)", "not a mapping of LLM API arguments",
                                    "write key: value pairs (TorchLlmArgs fields)"))
            continue
        for key, nearest in unknown_llm_api_keys(data, path.name == MODEL_YAML, version):
            findings.append(Finding(
                "llm-api", "error", rel, key, f"not an LLM API argument of TensorRT-LLM {version} "
                "(LLM() refuses unknown keys)", f"did you mean {nearest}?" if nearest else
                f"remove it, or see the recorded list pipeline/data/llm_api_args_{version}.txt"))
    return findings


# ------------------------------------------------------------------------------------------- engine

def check_engine(wanted: str, model: RepositoryModel, override: Path | None) -> tuple[Path | None, list[Finding]]:
    """Checks of an engine-serving model (tensorrtllm backend, or NVIDIA's Python runtime) against its engine."""
    path_value = model.parameter("gpt_model_path") or ""
    if override is None and (not path_value or PLACEHOLDER.search(path_value)):
        return None, []  # the placeholder check reports it
    engine = Path(override) if override else Path(path_value)
    config_path = engine / "config.json"
    if not config_path.is_file():
        return engine, [Finding("engine", "info", model.file, "parameters[gpt_model_path]",
                                f"no engine at {engine} yet; engine checks skipped",
                                f"build it (`trtpipe compile ... -o {engine}`) and run check again")]
    try:
        engine_config = json.loads(config_path.read_text())
    except ValueError as exc:
        return engine, [Finding("engine", "error", model.file, "parameters[gpt_model_path]",
                                f"{config_path} is not valid JSON ({exc})", "rebuild the engine")]
    findings = check_engine_version(wanted, model, engine_config, config_path)
    build = engine_config.get("build_config")
    if not isinstance(build, dict):
        return engine, findings
    findings += check_engine_limits(model, build)
    findings += check_paged_context_fmha(model, build)
    return engine, findings


def check_engine_version(wanted: str, model: RepositoryModel, engine_config: dict,
                         config_path: Path) -> list[Finding]:
    """The engine against `wanted`, the TensorRT-LLM version the repository targets."""
    version = engine_config.get("version")
    if "build_config" not in engine_config:
        return [Finding("engine-version", "error", model.file, "parameters[gpt_model_path]",
                        f"{config_path} has no build_config (an engine from an older TensorRT-LLM "
                        f"format{', version ' + str(version) if version else ''}); the {wanted} backend cannot "
                        "load it", f"rebuild the engine with TensorRT-LLM {wanted} (`trtpipe compile`)")]
    if version != wanted:
        return [Finding("engine-version", "error", model.file, "parameters[gpt_model_path]",
                        f"the engine was built with TensorRT-LLM {version}, the repository targets {wanted}",
                        f"rebuild the engine with TensorRT-LLM {wanted} (`trtpipe compile`), or serve it with "
                        f"the {version} backend")]
    return []


def check_engine_limits(model: RepositoryModel, build: dict) -> list[Finding]:
    findings = []
    engine_batch = build.get("max_batch_size")
    if isinstance(engine_batch, int) and model.config.max_batch_size > engine_batch:
        findings.append(Finding("batch-size", "error", model.file, "max_batch_size",
                                f"max_batch_size {model.config.max_batch_size} exceeds the engine's "
                                f"build_config.max_batch_size {engine_batch}",
                                f"set max_batch_size to at most {engine_batch} (fill_template.py "
                                f"triton_max_batch_size:{engine_batch}) or rebuild the engine"))
    beam = model.parameter("max_beam_width")
    engine_beam = build.get("max_beam_width", 1)
    if beam and beam.isdigit() and int(beam) > int(engine_beam):
        findings.append(Finding("batch-size", "error", model.file, "parameters[max_beam_width]",
                                f"max_beam_width {beam} exceeds the engine's build_config.max_beam_width "
                                f"{engine_beam}", f"set it to at most {engine_beam} or rebuild the engine"))
    return findings


def check_paged_context_fmha(model: RepositoryModel, build: dict) -> list[Finding]:
    plugins = build.get("plugin_config") or {}
    if plugins.get("use_paged_context_fmha", False):
        return []
    return [Finding("paged-context-fmha", "error", model.file, f"parameters[{key}]",
                    f"{key} is true but the engine was built without use_paged_context_fmha "
                    "('model has to be built with paged context FMHA support')",
                    f"set {key} to false, or rebuild the engine with --use_paged_context_fmha enable")
            for key in PAGED_FMHA_PARAMETERS if (model.parameter(key) or "").lower() == "true"]
