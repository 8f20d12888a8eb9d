"""Shared fixtures: tiny random Llamas, the offline SmolLM2 model and its converted checkpoint."""

from __future__ import annotations

import json
import shutil
import os
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

# Tests never reach the Hugging Face Hub and never find models the machine happens to have in a user
# directory. Set here, before huggingface_hub is imported: it reads HF_HUB_OFFLINE once, at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("TRTPIPE_MODEL_DIR", None)

#: Tiny random Llama variants covering the attention layouts and options the converter must handle.
TINY_VARIANTS: dict[str, dict] = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3-rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "head-dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, architectures=["MistralForCausalLM"]),
}


#: Tiny random Qwen variants: Qwen2 (q/k/v biases; tied or not) and Qwen3 (per-head q/k norms, head_dim set
#: apart from hidden/heads), with GQA and MQA head layouts.
QWEN_VARIANTS: dict[str, dict] = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied": dict(architectures=["Qwen2ForCausalLM"], num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-mqa": dict(architectures=["Qwen3ForCausalLM"], num_attention_heads=4, num_key_value_heads=1,
                      head_dim=16),
}


#: Hugging Face architecture -> transformers model_type, for every family the registry has
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def make_tiny_model(directory: Path, seed: int = 0, **overrides) -> Path:
    """Save a random model (a Llama unless `architectures` says otherwise) with tiny dimensions as a Hugging
    Face directory; norms and biases far from their initial values, so a mis-mapped or dropped one shows
    in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               tie_word_embeddings=False, torch_dtype="float32", architectures=["LlamaForCausalLM"])
    cfg.update(overrides)
    config = AutoConfig.for_model(MODEL_TYPES[cfg["architectures"][0]], **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def variant_factory(tmp_path_factory, variants: dict[str, dict]):
    """get(name) -> HF directory of that tiny variant, made once per session."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny_model(tmp_path_factory.mktemp(f"hf-{variant}"), **variants[variant])
        return made[variant]

    return get


def save_word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of the tiny vocabulary (" w0".." w100", end and padding " w1"), saved as a
    Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # byte-level words that carry their leading space, so tokens decoded one by one join up (streaming). Split
    # on whitespace only: ByteLevel's own regex cuts " w17" into " w" and "17", which made every prompt unknown.
    tokenizer = Tokenizer(models.WordLevel({f"\u0120w{i}": i for i in range(101)}, unk_token="\u0120w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "\u0120w1", "pad_token": "\u0120w1"}))


def buildable_copy(hf_dir: Path, directory: Path) -> Path:
    """`hf_dir` copied to `directory` with the word tokenizer and a context long enough for build's default
    workload (1024 + 256 tokens): a model `trtpipe build` takes."""
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    save_word_tokenizer(directory)
    return directory


def deploy_tiny_llmapi(checkpoint: Path, tokenizer: Path, root: Path) -> Path:
    """The cpu llmapi repository (backend reference-llmapi, context 64) of a tiny checkpoint, deployed through the
    CLI under `root`."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.plan import Workload, make_plan, resolve_model_info, save_plan
    from pipeline.targets import get_target

    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=8, output_len=8, max_context=64), backend="reference-llmapi")
    save_plan(plan, root / "plan.json")
    repo = root / "repo"
    result = CliRunner().invoke(main, ["deploy", "--checkpoint", str(checkpoint), "--plan", str(root / "plan.json"),
                                       "--tokenizer", str(tokenizer), "-o", str(repo)])
    assert result.exit_code == 0, result.output
    return repo


def tiny_cpu_checkpoint(hf_dir: Path, root: Path) -> tuple[Path, Path]:
    """A copy of the tiny HF model `hf_dir` under `root` with the word tokenizer and the cpu plan's context, its
    float32 checkpoint and cpu plan.json: (checkpoint, plan path)."""
    from pipeline.convert import convert_model
    from pipeline.plan import make_plan, resolve_model_info
    from pipeline.sources import resolve_model
    from pipeline.targets import get_target

    model = buildable_copy(hf_dir, root / "model")
    ckpt = convert_model(resolve_model(str(model)), root / "ckpt", dtype="float32", progress=False).path
    plan = make_plan(resolve_model_info(str(model)), get_target("cpu"), "fp32")
    (root / "plan.json").write_text(json.dumps(plan.to_dict()))
    return ckpt, root / "plan.json"


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """Factory: tiny_qwen("qwen3") -> HF directory of that Qwen variant."""
    return variant_factory(tmp_path_factory, QWEN_VARIANTS)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Factory: tiny_llama("gqa") -> HF directory of that Llama variant."""
    return variant_factory(tmp_path_factory, TINY_VARIANTS)
@pytest.fixture(scope="session")
def checkpoint(tiny_llama, tmp_path_factory):
    """Factory: checkpoint(variant, tp, pp) -> float32 TensorRT-LLM checkpoint of that tiny model."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    made: dict[tuple, Path] = {}

    def get(variant: str, tp: int = 1, pp: int = 1) -> Path:
        key = (variant, tp, pp)
        if key not in made:
            out = tmp_path_factory.mktemp(f"ckpt-{variant}-tp{tp}-pp{pp}") / "ckpt"
            made[key] = convert_model(resolve_model(str(tiny_llama(variant))), out, dtype="float32",
                                      tp=tp, pp=pp, progress=False).path
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_cpu_server(tiny_llama, tmp_path_factory):
    """A tiny cpu repository (word tokenizer " w0".." w100") deployed by the CLI, in the embedded Triton server."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.server import embedded_server

    root = tmp_path_factory.mktemp("tiny-cpu-server")
    ckpt, plan = tiny_cpu_checkpoint(tiny_llama("gqa"), root)
    result = CliRunner().invoke(main, ["deploy", "--checkpoint", str(ckpt), "--plan", str(plan),
                                       "-o", str(root / "repo")])
    assert result.exit_code == 0, result.output
    with embedded_server(root / "repo", ready_timeout=300) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct dequantized from the offline GGUF into a float32 HF directory (cached)."""
    from pipeline.sources import resolve_model

    return resolve_model("smollm2-135m").hf_dir()


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_hf_dir, tmp_path_factory) -> Path:
    """SmolLM2 converted to a float32 tp=1 TensorRT-LLM checkpoint, once per session."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    out = tmp_path_factory.mktemp("smollm2") / "checkpoint"
    return convert_model(resolve_model(str(smollm2_hf_dir)), out, dtype="float32", progress=False).path


class StubTensor:
    """triton_python_backend_utils.Tensor as the cpu model uses it."""

    def __init__(self, name: str, array):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self._array


@pytest.fixture
def no_aic(monkeypatch):
    """Plans made as on a machine without aiconfigurator-core: trtpipe's own memory model and speed-of-light bound."""
    from pipeline.plan import performance

    def missing():
        raise ImportError("No module named 'aiconfigurator_core'")

    monkeypatch.setattr(performance, "aic", missing)


class StubRequest:
    """A Triton request of one row as the cpu model reads it (its tensors, id, parameters); subclasses decide what
    the sender does with each response (`send`)."""

    def __init__(self, name: str, prompt: list, max_tokens: int, parameters: dict | None = None, **inputs):
        import numpy as np

        self.name, self.params = name, parameters or {}
        tensors = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
                   "request_output_len": np.array([[max_tokens]], np.int32)}
        tensors.update({k: v if isinstance(v, np.ndarray) else np.array([[v]]) for k, v in inputs.items()})
        self.tensors = [StubTensor(k, v) for k, v in tensors.items()]

    def inputs(self):
        return self.tensors

    def get_response_sender(self):
        return self

    def request_id(self) -> str:
        return self.name

    def is_cancelled(self) -> bool:
        return False

    def parameters(self) -> str:
        """The request parameters as Triton hands them to a Python model: a JSON object."""
        return json.dumps(self.params)


class StubResponse:
    def __init__(self, output_tensors: list, error=None):
        self.output_tensors, self.error = output_tensors, error

    def outputs(self) -> dict:
        return {t.name(): t.as_numpy() for t in self.output_tensors}


class StubError:
    CANCELLED = "CANCELLED"

    def __init__(self, message: str, code=None):
        self.message, self.code = message, code


def load_cpu_model(monkeypatch, model: str = "tensorrt_llm"):
    """model_repo/MODEL/1/model.py (default: the cpu target's tensorrt_llm), imported with stand-ins for
    Triton's Python backend (triton_python_backend_utils: tensors, responses, errors, the decoupled policy)."""
    import importlib.util
    import sys
    import types

    stub = types.ModuleType("triton_python_backend_utils")
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    stub.Tensor, stub.InferenceResponse, stub.TritonError = StubTensor, StubResponse, StubError
    stub.using_decoupled_model_transaction_policy = lambda config: bool(
        config.get("model_transaction_policy", {}).get("decoupled"))
    stub.get_input_tensor_by_name = lambda request, name: next((t for t in request.inputs() if t.name() == name), None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the model puts its own directory first
    path = Path(__file__).parent.parent / "model_repo" / model / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"cpu_{model}_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in HTTP server's handler: JSON replies, no request log."""

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass
