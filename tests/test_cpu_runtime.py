"""The cpu target's onnxruntime runtime (`trtpipe deploy --runtime onnxruntime`, backend reference-onnx): the
same five-model repository, its tensorrt_llm model computing with ONNX Runtime, validated like the torch one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.models import tiny_cpu_checkpoint

from pipeline.cli import main
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.targets import get_target
from pipeline.tritonconfig import parse_pbtxt
from pipeline.validate import ValidateOptions, reference_for, validate_repository


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama HF directory with a word tokenizer, its float32 checkpoint and cpu plan.json."""
    return tiny_cpu_checkpoint(tiny_llama("gqa"), tmp_path_factory.mktemp("cpu-runtime"))


def deploy(tiny, out: Path, *args: str):
    ckpt, plan = tiny
    return CliRunner().invoke(main, ["deploy", "--checkpoint", str(ckpt), "--plan", str(plan), "-o", str(out),
                                     *args])


def test_deploy_runtime_onnxruntime_exports_into_the_repository_with_the_same_contract(tiny, tmp_path):
    assert deploy(tiny, tmp_path / "torch").exit_code == 0
    result = deploy(tiny, tmp_path / "ort", "--runtime", "onnxruntime")
    assert result.exit_code == 0, result.output
    assert "ONNX Runtime" in result.output
    version = tmp_path / "ort" / "tensorrt_llm" / "1"
    assert (version / "onnx" / "model.onnx").is_file() and (version / "pipeline" / "onnx" / "runner.py").is_file()
    assert not (version / "checkpoint").exists()
    ort, torch = (parse_pbtxt((tmp_path / r / "tensorrt_llm" / "config.pbtxt").read_text()) for r in ("ort", "torch"))
    assert ort.parameters["runtime"].string_value == "onnxruntime"
    assert ort.input == torch.input and ort.output == torch.output
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (tmp_path / "ort" / model / "config.pbtxt").read_text() == \
            (tmp_path / "torch" / model / "config.pbtxt").read_text()
    manifest = json.loads((tmp_path / "ort" / "manifest.json").read_text())
    assert manifest["deployment"]["backend"] == "reference-onnx"


def test_a_repository_is_exported_anew_when_the_graph_code_changes(tiny, tmp_path):
    """The export's code is an input of an onnxruntime repository (not copied into it): a trtpipe whose graph changed
    does not leave an older graph in a repository it would otherwise call up to date. graph.py's mtime stands in for
    an upgrade, and is put back."""
    import os

    from pipeline.onnx import graph

    assert deploy(tiny, tmp_path / "ort", "--runtime", "onnxruntime").exit_code == 0
    assert "up to date" in deploy(tiny, tmp_path / "ort", "--runtime", "onnxruntime").output
    source = Path(graph.__file__)
    before = source.stat()
    try:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
        again = deploy(tiny, tmp_path / "ort", "--runtime", "onnxruntime", "--force")
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert again.exit_code == 0 and "up to date" not in again.output, again.output
    assert not (tmp_path / "ort" / "tensorrt_llm" / "1" / "pipeline" / "onnx" / "graph.py").exists()


def test_runtime_is_refused_for_a_gpu_plan(tiny, tmp_path):
    gpu = make_plan(resolve_model_info("smollm2-135m"), get_target("l40s"), "fp16")
    (tmp_path / "gpu.json").write_text(json.dumps(gpu.to_dict()))
    result = deploy((tiny[0], tmp_path / "gpu.json"), tmp_path / "repo", "--runtime", "onnxruntime")
    assert result.exit_code == 2
    assert "--runtime onnxruntime applies to the cpu target's reference runtime" in result.output


@pytest.fixture(scope="module")
def tiny_head16(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """`tiny` with a head size of 16: its ONNX export's cache is written in place (GroupQueryAttention)."""
    return tiny_cpu_checkpoint(tiny_llama("head-dim"), tmp_path_factory.mktemp("cpu-runtime-head16"))


@pytest.mark.parametrize("head16,kv_cache", [(False, "concat"), (True, "in-place")])
def test_the_served_export_writes_its_cache_in_place_where_the_head_size_allows(tiny, tiny_head16, head16, kv_cache,
                                                                                tmp_path):
    assert deploy(tiny_head16 if head16 else tiny, tmp_path / "ort", "--runtime", "onnxruntime").exit_code == 0
    config = json.loads((tmp_path / "ort" / "tensorrt_llm" / "1" / "onnx" / "genai_config.json").read_text())
    assert config["trtpipe"]["kv_cache"] == kv_cache
    assert (tmp_path / "ort" / "tensorrt_llm" / "1" / "pipeline" / "onnx" / "inplace.py").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("runtime,head16", [("torch", False), ("onnxruntime", False), ("onnxruntime", True)])
def test_validate_passes_on_both_runtimes(tiny, tiny_head16, tmp_path, runtime, head16):
    """Both runtimes, and ONNX Runtime with its cache written in place (a head size of 16), pass validate."""
    assert deploy(tiny_head16 if head16 else tiny, tmp_path / "repo", "--runtime", runtime).exit_code == 0
    report = validate_repository(tmp_path / "repo", tmp_path / "validation", ValidateOptions(
        golden=reference_for(tmp_path / "repo", None), max_tokens=8, request_timeout=60))
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert not failed, failed
    golden = next(c for c in report.checks if c.name == "golden")
    assert golden.data["mean_token_agreement"] == 1.0
