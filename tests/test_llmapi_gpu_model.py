"""The GPU llmapi repository's `tensorrt_llm/1/model.py` (trtpipe's, model_repo/llmapi_pytorch): what can
be checked without a GPU or TensorRT-LLM (issue 13).

It has NOT run against TensorRT-LLM or Triton here. These tests load it with stand-ins for
`triton_python_backend_utils` and `tensorrt_llm` (an LLM whose generate_async yields cumulative text as the
LLM API's RequestOutput does) and check: it parses and imports nothing heavy at module level, the names it
reads and writes are those config.pbtxt declares, how it reads model.yaml, that it refuses what `trtpipe
validate` sends as bad requests naming the field, and how it answers (streamed pieces that join to the text,
the final response, finish_reason, the prompt kept or not)."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import shutil
import sys
import time
import types
from dataclasses import dataclass

import numpy as np
import pytest

from pipeline.backends.pytorch import LLMAPI_INPUTS, LLMAPI_OUTPUTS, PYTORCH_MODEL_SOURCE
from pipeline.deploy import deploy_repository
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.targets import get_target
from pipeline.tritonconfig import parse_pbtxt
from pipeline.validate.llmapi import llmapi_bad_requests

FINAL = 1


class TritonModelException(Exception):
    pass


@dataclass
class Tensor:
    name: str
    data: np.ndarray

    def as_numpy(self):
        return self.data


@dataclass
class TritonError:
    message: str


@dataclass
class InferenceResponse:
    output_tensors: list
    error: TritonError | None = None

    def outputs(self) -> dict:
        return {t.name: t.data.reshape(-1)[0].decode() for t in self.output_tensors}


def stub_pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.TritonModelException, module.TritonError = TritonModelException, TritonError
    module.Tensor, module.InferenceResponse = Tensor, InferenceResponse
    return module


@pytest.fixture
def model_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub_pb_utils())
    spec = importlib.util.spec_from_file_location("llmapi_gpu_model", PYTORCH_MODEL_SOURCE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_llama):
    """The GPU llmapi repository of a tiny model's Hugging Face directory (with a tokenizer)."""
    from support.models import save_word_tokenizer

    hf = tmp_path_factory.mktemp("gpu-llmapi") / "hf"
    shutil.copytree(tiny_llama("gqa"), hf)
    save_word_tokenizer(hf)
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp16", backend="pytorch")
    return deploy_repository(plan, hf.parent / "repo", checkpoint=hf).path


def test_it_parses_and_defers_tensorrt_llm_to_initialize():
    tree = ast.parse(PYTORCH_MODEL_SOURCE.read_text())
    top = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    top |= {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    assert top <= {"__future__", "asyncio", "threading", "dataclasses", "pathlib", "numpy", "sys",
                   "triton_python_backend_utils", "yaml", "pipeline.triton_names"}, top
    assert "tensorrt_llm" in PYTORCH_MODEL_SOURCE.read_text()   # imported inside initialize()


def test_deploy_ships_it_and_its_names_are_config_pbtxts(repo, model_module):
    assert (repo / "tensorrt_llm" / "1" / "model.py").read_text() == PYTORCH_MODEL_SOURCE.read_text()
    config = parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert tuple(t.name for t in config.input) == model_module.INPUTS == tuple(t.name for t in LLMAPI_INPUTS)
    assert tuple(t.name for t in config.output) == model_module.OUTPUTS == tuple(t.name for t in LLMAPI_OUTPUTS)
    optional = {t.name for t in config.input if t.optional}
    assert optional == set(model_module.INPUTS) - {"text_input"}


def test_model_yaml_names_the_copied_model_relative_to_the_version_directory(repo, model_module):
    version = repo / "tensorrt_llm" / "1"
    settings = model_module.load_settings(version)
    assert settings.llm_args["model"] == str((version / "model").resolve())
    assert (version / "model" / "config.json").is_file() and (version / "model" / "tokenizer.json").is_file()
    assert "triton_config" not in settings.llm_args and settings.triton_config["decoupled"] is True
    assert settings.llm_args["backend"] == "pytorch" and settings.max_seq_len == settings.llm_args["max_seq_len"]
    # a hub id stays as it is
    (version.parent / "hub").mkdir()
    (version.parent / "hub" / "model.yaml").write_text("model: meta-llama/Meta-Llama-3-8B\n")
    assert model_module.load_settings(version.parent / "hub").llm_args["model"] == "meta-llama/Meta-Llama-3-8B"
    # a draft copied beside it is resolved the same way; a draft hub id stays as it is
    (version.parent / "hub" / "small").mkdir()
    for draft, resolved in (("small", str((version.parent / "hub" / "small").resolve())),
                            ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B")):
        (version.parent / "hub" / "model.yaml").write_text(
            f"model: meta-llama/Meta-Llama-3-8B\nspeculative_config:\n  decoding_type: DraftTarget\n"
            f"  speculative_model_dir: {draft}\n")
        args = model_module.load_settings(version.parent / "hub").llm_args
        assert args["speculative_config"] == {"decoding_type": "DraftTarget", "speculative_model_dir": resolved}
    (version.parent / "hub" / "model.yaml").write_text("[not, a, mapping]\n")
    with pytest.raises(TritonModelException, match="needs a mapping with `model`"):
        model_module.load_settings(version.parent / "hub")


def as_inputs(body: dict) -> dict:
    arrays = {}
    for name, value in body.items():
        if isinstance(value, str):
            arrays[name] = np.array([value.encode()], dtype=np.object_)
        else:
            arrays[name] = np.array([value])
    return arrays


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("bad", [b for b in llmapi_bad_requests(" w5 w6 w7")
                                 if "wrong type" not in b.name and "missing" not in b.name], ids=lambda b: b.name)
def test_it_refuses_validates_bad_requests_naming_the_field(model_module, bad):
    """The bad requests Triton itself lets through (types and the required text_input are checked before)."""
    with pytest.raises(model_module.RequestError) as refused:
        model_module.parse_request(as_inputs(bad.body), words, max_seq_len=64)
    assert bad.parameter is None or bad.parameter in str(refused.value)


def test_sampling_fields_become_samplingparams_arguments(model_module):
    body = {"text_input": " w5 w6", "sampling_param_max_tokens": 4, "sampling_param_temperature": 0.7,
            "sampling_param_top_k": 5, "sampling_param_top_p": 0.9, "sampling_param_seed": 11}
    request = model_module.parse_request(as_inputs(body), words, 64)
    assert request.sampling == {"max_tokens": 4, "temperature": pytest.approx(0.7), "top_k": 5,
                                "top_p": pytest.approx(0.9), "seed": 11}
    greedy = model_module.parse_request(as_inputs({"text_input": " w5", "sampling_param_temperature": 0.0}), words, 64)
    assert greedy.sampling == {"max_tokens": model_module.DEFAULT_MAX_TOKENS, "top_p": 1.0, "top_k": 1}
    assert greedy.exclude_input and not greedy.streaming and not greedy.finish_reason


# ------------------------------------------------------------------- the request path, with stand-ins


class FakeOutput:
    def __init__(self, text, finish_reason=None):
        self.text, self.finish_reason = text, finish_reason


class FakeLLM:
    """generate_async as the LLM API's: an async iterator of RequestOutputs whose outputs[0].text is the text so
    far (one step per streamed token; one result when not streaming)."""

    def __init__(self, **args):
        self.args, self.calls = args, []
        self.tokenizer = types.SimpleNamespace(encode=lambda text: text.split())

    def generate_async(self, prompt, params, streaming=False):
        self.calls.append((prompt, params.kwargs, streaming))
        pieces = [" w9", " w8", " w7"][:params.kwargs["max_tokens"]]

        async def steps():
            texts = ["".join(pieces[:i + 1]) for i in range(len(pieces))] if streaming else ["".join(pieces)]
            for i, text in enumerate(texts):
                await asyncio.sleep(0)
                yield types.SimpleNamespace(outputs=[FakeOutput(text, "length" if i == len(texts) - 1 else None)])
        return steps()

    def shutdown(self):
        self.shut = True


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response, flags))


class FakeRequest:
    def __init__(self, body):
        self.tensors = [Tensor(name, value) for name, value in as_inputs(body).items()]
        self.sender = Sender()

    def inputs(self):
        return [types.SimpleNamespace(name=lambda t=t: t.name, as_numpy=t.as_numpy) for t in self.tensors]

    def get_response_sender(self):
        return self.sender


@pytest.fixture
def served(repo, model_module, monkeypatch):
    fake = types.ModuleType("tensorrt_llm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kwargs: types.SimpleNamespace(kwargs=kwargs)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", fake)
    monkeypatch.setattr(model_module, "HERE", repo / "tensorrt_llm" / "1")
    model = model_module.TritonPythonModel()
    model.initialize({})
    yield model
    model.finalize()


def answer(model, body: dict) -> list:
    request = FakeRequest(body)
    assert model.execute([request]) is None          # decoupled: responses come from the sender
    deadline = time.monotonic() + 10
    while not any(flags == FINAL for _, flags in request.sender.sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    return request.sender.sent


def test_llm_is_built_from_model_yaml(served, repo):
    assert served.llm.args["model"] == str((repo / "tensorrt_llm" / "1" / "model").resolve())
    assert "triton_config" not in served.llm.args and served.llm.args["max_batch_size"] >= 1


def test_streaming_sends_each_steps_new_text_then_a_final_response(served):
    sent = answer(served, {"text_input": " w5 w6", "streaming": True, "sampling_param_max_tokens": 3,
                           "return_finish_reason": True})
    pieces = [r.outputs()["text_output"] for r, flags in sent if flags != FINAL]
    assert pieces == [" w9", " w8", " w7"]
    final, flags = sent[-1]
    assert flags == FINAL and final.outputs() == {"text_output": "", "finish_reason": "length"}
    assert served.llm.calls[-1] == (" w5 w6", {"max_tokens": 3, "temperature": 1.0, "top_p": 1.0}, True)


def test_one_answer_with_or_without_the_prompt(served):
    [(only, flags)] = answer(served, {"text_input": " w5 w6", "sampling_param_max_tokens": 2})
    assert flags == FINAL and only.outputs() == {"text_output": " w9 w8"}
    [(kept, _)] = answer(served, {"text_input": " w5 w6", "sampling_param_max_tokens": 2,
                                  "sampling_param_exclude_input_from_output": False})
    assert kept.outputs()["text_output"] == " w5 w6 w9 w8"


def test_a_bad_request_is_answered_with_an_error_and_the_model_keeps_serving(served):
    [(refused, flags)] = answer(served, {"text_input": " w5", "sampling_param_top_p": 1.5})
    assert flags == FINAL and "sampling_param_top_p" in refused.error.message
    [(ok, _)] = answer(served, {"text_input": " w5", "sampling_param_max_tokens": 1})
    assert ok.error is None and ok.outputs()["text_output"] == " w9"
