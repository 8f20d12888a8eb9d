"""pipeline/triton_names.py, the one home of what trtpipe's Triton models and clients share: every tensor name
is one the contract of its group declares, the module runs with the standard library alone (it is imported
inside Triton's Python backend stub), no model file keeps a copy of `parameter` or of a sampling range, deploy
ships the module beside each of trtpipe's model.py files (and beside none of NVIDIA's), and every caller of the
sampling table refuses a value outside it."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from support.models import deploy_tiny_llmapi, save_word_tokenizer, tiny_cpu_checkpoint
from support.triton_stubs import StubError, StubRequest, StubResponse, StubTensor, load_cpu_model

import pipeline.triton_names as names
from pipeline.backends.nvidia_contract import PYTHON_MODELS
from pipeline.backends.pytorch import LLMAPI_INPUTS, LLMAPI_OUTPUTS
from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.package_data import MODEL_SOURCES, MODEL_SUPPORT_FILES, PACKAGE_DIR
from pipeline.plan import load_plan, resolve_model_info
from pipeline.planner import make_plan
from pipeline.runtime import SamplingConfig
from pipeline.targets import get_target
from pipeline.triton_contract import ENSEMBLE_STEPS, MODELS

MODULE = Path(names.__file__)
MODEL_FILES = sorted(MODEL_SOURCES.rglob("model.py"))
#: trtpipe's models of the inflight_batcher_llm layout every backend shares (deploy.COMMON_PYTHON_MODELS)
COMMON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")
#: A value outside each parameter's range, in both tables (SAMPLING_RANGES, TENSORRT_LLM_SAMPLING_RANGES).
OUT_OF_RANGE = {"temperature": -0.5, "top_k": -1, "top_p": 1.5, "min_tokens": -1}


def declared(model: str) -> set[str]:
    inputs, outputs = MODELS[model]
    return {t.name for t in (*inputs, *outputs)}


# ------------------------------------------------------------------------------------------- the names

def test_each_group_of_tensor_names_is_declared_by_its_contract():
    """A misspelt constant is a name its contract does not declare."""
    groups = {
        "ENSEMBLE_NAMES": declared("ensemble") & declared("tensorrt_llm_bls"),   # the BLS has the same contract
        "TENSORRT_LLM_NAMES": declared("tensorrt_llm"),
        "PREPROCESSING_NAMES": declared("preprocessing"),
        "POSTPROCESSING_NAMES": declared("postprocessing"),
        "ENSEMBLE_STEP_NAMES": {v for s in ENSEMBLE_STEPS for v in (*s.input_map.values(), *s.output_map.values())},
        "BLS_NAMES": declared("tensorrt_llm_bls") - declared("ensemble"),
    }
    for group, contract in groups.items():
        assert set(getattr(names, group)) <= contract, (group, set(getattr(names, group)) - contract)
    assert names.LLMAPI_INPUT_NAMES == tuple(t.name for t in LLMAPI_INPUTS)
    assert names.LLMAPI_OUTPUT_NAMES == tuple(t.name for t in LLMAPI_OUTPUTS)
    assert set(names.TENSORRT_LLM_SAMPLING_INPUTS.values()) <= declared("tensorrt_llm")
    assert set(names.LLMAPI_SAMPLING_INPUTS.values()) <= set(names.LLMAPI_INPUT_NAMES)
    # the ensemble's sampling inputs are the parameters' own names
    assert set(names.SAMPLING_RANGES) <= declared("ensemble")


def test_every_name_constant_is_in_a_group_or_is_a_model_or_parameter_name():
    constants = {key: value for key, value in vars(names).items()
                 if key.isupper() and isinstance(value, str)}
    grouped = {n for group in ("ENSEMBLE_NAMES", "TENSORRT_LLM_NAMES", "PREPROCESSING_NAMES", "POSTPROCESSING_NAMES",
                               "ENSEMBLE_STEP_NAMES", "LLMAPI_INPUT_NAMES", "LLMAPI_OUTPUT_NAMES", "BLS_NAMES")
               for n in getattr(names, group)}
    model_names = {names.ENSEMBLE, names.PREPROCESSING, names.TENSORRT_LLM, names.POSTPROCESSING,
                   names.TENSORRT_LLM_BLS}
    assert model_names == set(MODELS)
    bls_parameters = {names.TENSORRT_LLM_MODEL_NAME, names.TENSORRT_LLM_DRAFT_MODEL_NAME}
    assert bls_parameters <= set(PYTHON_MODELS["tensorrt_llm_bls"])
    # a tensorrt_llm model's name, and the key of the BLS's wiring.json deploy writes the target's defaults under
    parameter_values = set(names.BATCH_SCHEDULER_POLICIES) | {names.TENSORRT_LLM_DRAFT, names.TARGET_DEFAULTS}
    others = {k for k, v in constants.items()
              if v not in grouped | model_names | parameter_values | bls_parameters}
    assert not others, f"tensor-name constants in no *_NAMES group: {sorted(others)}"


def test_parameter_treats_empty_and_unfilled_placeholders_as_unset():
    config = {"parameters": {"a": {"string_value": "x"}, "b": {"string_value": ""},
                             "c": {"string_value": "${c}"}}}
    assert [names.parameter(config, key, "d") for key in ("a", "b", "c", "missing")] == ["x", "d", "d", "d"]
    assert names.parameter({}, "a", "d") == "d"


def test_the_module_imports_only_the_standard_library():
    tree = ast.parse(MODULE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import: the module imports no other pipeline module"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - set(sys.stdlib_module_names)


def test_no_model_file_keeps_its_own_parameter_helper_or_sampling_range():
    range_texts = {r.allowed for table in (names.SAMPLING_RANGES, names.TENSORRT_LLM_SAMPLING_RANGES)
                   for r in table.values()}
    assert len(MODEL_FILES) == 6
    for path in MODEL_FILES:
        tree = ast.parse(path.read_text())
        where = path.relative_to(MODEL_SOURCES)
        functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert "parameter" not in functions, f"{where} defines its own parameter()"
        assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert not [a for a in assigned if "RANGE" in a], f"{where} defines its own sampling ranges"
        texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [t for t in texts if any(r in t for r in range_texts)], f"{where} writes a range out itself"
        imports = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert "pipeline.triton_names" in imports, f"{where} does not import pipeline.triton_names"


# ------------------------------------------------------------------------------------ what deploy ships

@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("triton-names")
    checkpoint, plan = tiny_cpu_checkpoint(tiny_llama("gqa"), root)
    return {"root": root, "checkpoint": checkpoint, "plan": load_plan(plan), "tokenizer": root / "model"}


def assert_ships_support(version: Path) -> None:
    for source in MODEL_SUPPORT_FILES:
        copy = version / "pipeline" / source.relative_to(PACKAGE_DIR)
        assert copy.read_bytes() == source.read_bytes(), copy


def test_a_deployed_repository_has_triton_names_beside_each_of_trtpipes_models(tiny):
    repo = deploy_repository(tiny["plan"], tiny["root"] / "repo", checkpoint=tiny["checkpoint"],
                             tokenizer=tiny["tokenizer"]).path
    for model in (*COMMON_MODELS, "tensorrt_llm"):
        assert_ships_support(repo / model / "1")
    # the copy is what a model imports first on sys.path, and it needs nothing but the standard library
    version = repo / "preprocessing" / "1"
    script = ("import sys; sys.path.insert(0, sys.argv[1]); sys.modules['numpy'] = None; "
              "import pipeline.triton_names as t; print(t.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script, str(version)], capture_output=True, text=True, env=env,
                         cwd=repo, check=True)
    assert Path(out.stdout.strip()).resolve() == (version / "pipeline" / "triton_names.py").resolve()


def test_nvidias_python_models_get_no_copy(tiny):
    nvidia = tiny["root"] / "all_models" / "inflight_batcher_llm"
    for name in COMMON_MODELS:
        (nvidia / name / "1").mkdir(parents=True)
        (nvidia / name / "1" / "model.py").write_text(f"# NVIDIA's {name}\n")
    repo = deploy_repository(tiny["plan"], tiny["root"] / "nvidia-repo", checkpoint=tiny["checkpoint"],
                             tokenizer=tiny["tokenizer"], python_models=nvidia).path
    for name in COMMON_MODELS:
        assert not (repo / name / "1" / "pipeline").exists(), name
    assert_ships_support(repo / "tensorrt_llm" / "1")    # the cpu model stays trtpipe's


def test_both_llmapi_repositories_have_triton_names_beside_model_py(tiny, tiny_llama, tmp_path):
    cpu = deploy_tiny_llmapi(tiny["checkpoint"], tiny["tokenizer"], tmp_path / "cpu")
    assert_ships_support(cpu / "tensorrt_llm" / "1")
    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama("gqa"), hf)
    save_word_tokenizer(hf)
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp16", backend="pytorch")
    gpu = deploy_repository(plan, tmp_path / "gpu", checkpoint=hf).path
    assert_ships_support(gpu / "tensorrt_llm" / "1")


# ------------------------------------------------------------------------------------- the sampling ranges

def load_model_file(monkeypatch, relative: str) -> types.ModuleType:
    """model_repo/RELATIVE/1/model.py with a stand-in for triton_python_backend_utils, registered in sys.modules
    (its dataclasses look their module up there)."""
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    stub.Tensor, stub.InferenceResponse, stub.TritonError = StubTensor, StubResponse, StubError
    stub.TritonModelException = RuntimeError
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = "model_" + relative.replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, MODEL_SOURCES / relative / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


class Tokenizer:
    eos_token_id = 1

    def encode(self, text: str) -> list:
        return [2, 3]


def test_the_out_of_range_values_cover_the_table():
    assert set(OUT_OF_RANGE) == set(names.SAMPLING_RANGES) == set(names.TENSORRT_LLM_SAMPLING_RANGES)
    for table in (names.SAMPLING_RANGES, names.TENSORRT_LLM_SAMPLING_RANGES):
        assert all(names.sampling_error(p, v, ranges=table) for p, v in OUT_OF_RANGE.items())
        assert all(names.sampling_error(p, v, ranges=table) for p, v in zip(table, [float("nan")] * 4))
    # NVIDIA's backend reads a top_p <= 0 as unset: only TensorRT-LLM's own range refuses it
    assert names.sampling_error("top_p", 0.0) and names.sampling_error(
        "top_p", 0.0, ranges=names.TENSORRT_LLM_SAMPLING_RANGES) is None
    assert names.sampling_error("min_tokens", 2.5, integer=True) == "min_tokens must be an integer >= 0, got 2.5"


@pytest.mark.parametrize("parameter", sorted(OUT_OF_RANGE))
def test_every_caller_refuses_a_value_outside_the_table(parameter, checkpoint, monkeypatch):
    value = OUT_OF_RANGE[parameter]
    # the reference runtime's SamplingConfig (its temperature rule is its own: > 0 when sampling)
    with pytest.raises(UserError) as refused:
        SamplingConfig(**{"top_k": 0, parameter: value})
    if parameter == "temperature":
        assert "temperature must be > 0" in str(refused.value)
    else:
        assert str(refused.value) == names.sampling_error(parameter, value, integer=parameter == "min_tokens")

    # the cpu tensorrt_llm model, through NVIDIA's tensor for the parameter
    module = load_cpu_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {"checkpoint_dir": {
        "string_value": str(checkpoint("gqa"))}}})})
    tensor = names.TENSORRT_LLM_SAMPLING_INPUTS[parameter]
    [response] = model.execute([StubRequest("r", [3, 14, 15], 4, **{tensor: value})])
    assert response.error.message == names.sampling_error(
        parameter, value, ranges=names.TENSORRT_LLM_SAMPLING_RANGES, source=f"tensorrt_llm input {tensor}")

    # both llmapi models (the contract has no min_tokens)
    if parameter not in names.LLMAPI_SAMPLING_INPUTS:
        return
    field = names.LLMAPI_SAMPLING_INPUTS[parameter]
    expected = names.sampling_error(parameter, value, field)
    inputs = {"text_input": np.array([b" w5"], dtype=np.object_), field: np.array([value])}
    gpu = load_model_file(monkeypatch, "llmapi_pytorch/tensorrt_llm")
    with pytest.raises(gpu.RequestError) as refused:
        gpu.parse_request(inputs, lambda text: 1, max_seq_len=64)
    assert str(refused.value) == expected
    cpu = load_model_file(monkeypatch, "llmapi/tensorrt_llm")
    served = cpu.TritonPythonModel()
    served.tokenizer, served.max_seq_len = Tokenizer(), 64
    with pytest.raises(cpu.RequestError) as refused:
        served.parse(types.SimpleNamespace(inputs=lambda: [StubTensor(k, v) for k, v in inputs.items()]))
    assert str(refused.value) == expected
