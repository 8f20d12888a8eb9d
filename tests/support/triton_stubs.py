"""Stand-ins for Triton's Python backend (triton_python_backend_utils), so a model.py of model_repo/ can be
imported and driven request by request without a server."""

from __future__ import annotations

import json
from pathlib import Path

class StubTensor:
    """triton_python_backend_utils.Tensor as the cpu model uses it."""

    def __init__(self, name: str, array):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self._array


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
    path = Path(__file__).resolve().parents[2] / "model_repo" / model / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"cpu_{model}_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
