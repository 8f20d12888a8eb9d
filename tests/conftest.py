"""Shared fixtures: tiny random Llamas, the offline SmolLM2 model and its converted checkpoint, the one pool of
embedded Triton servers. The helpers they use are in tests/support/."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Tests never reach the Hugging Face Hub and never find models the machine happens to have in a user
# directory. Set here, before huggingface_hub is imported: it reads HF_HUB_OFFLINE once, at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("TRTPIPE_MODEL_DIR", None)

from support.marks import mark_what_runs  # noqa: E402
from support.models import (  # noqa: E402
    QWEN_VARIANTS,
    TINY_VARIANTS,
    deploy_tiny_cpu_repo,
    make_tiny_model,
    variant_factory,
)


def pytest_collection_modifyitems(items):
    """`server`, `calibration` and `build` on the tests that start one (`slow` too: `-m "not slow"` is the quick
    loop), read from what the test and its fixtures call."""
    mark_what_runs(items)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """Factory: tiny_qwen("qwen3") -> HF directory of that Qwen variant."""
    return variant_factory(tmp_path_factory, QWEN_VARIANTS)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Factory: tiny_llama("gqa") -> HF directory of that Llama variant."""
    return variant_factory(tmp_path_factory, TINY_VARIANTS)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama, tmp_path_factory):
    """A tiny Llama Hugging Face directory a GPU build can take (weights, config and tokenizer)."""
    from support.models import buildable_copy

    return buildable_copy(tiny_llama("gqa"), tmp_path_factory.mktemp("tiny-buildable") / "tiny")


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
def triton_pool():
    """The one pool of embedded Triton servers: one per repository, started on first use, all stopped when the
    session ends."""
    from pipeline.server import ServerPool

    pool = ServerPool(ready_timeout=300)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tiny_cpu_server(tiny_llama, tmp_path_factory, triton_pool):
    """A tiny cpu repository (word tokenizer " w0".." w100") deployed by the CLI, in the embedded Triton server."""
    return triton_pool.get(deploy_tiny_cpu_repo(tiny_llama("gqa"), tmp_path_factory.mktemp("tiny-cpu-server")))


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


@pytest.fixture
def no_aic(monkeypatch):
    """Plans made as on a machine without aiconfigurator-core: trtpipe's own memory model and speed-of-light bound."""
    from pipeline.plan import performance

    def missing():
        raise ImportError("No module named 'aiconfigurator_core'")

    monkeypatch.setattr(performance, "aic", missing)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, smollm2_hf_dir) -> Path:
    """A random tiny Llama (GQA) with SmolLM2's vocabulary and tokenizer, so real text tokenizes (calibrate,
    sparsify, distill)."""
    d = make_tiny_model(tmp_path_factory.mktemp("tiny-calib"), vocab_size=49152, num_attention_heads=8,
                        num_key_value_heads=2, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, d / name)
    return d


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_hf, tmp_path_factory) -> Path:
    """tiny_hf's float32 checkpoint."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    return convert_model(resolve_model(str(tiny_hf)), tmp_path_factory.mktemp("tiny-ck") / "ckpt",
                         dtype="float32", progress=False).path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """40 documents of the offline corpus's calibration split, as a .txt dataset."""
    from pipeline.evaluate import corpus_split

    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text("\n".join(corpus_split(seed=0)[0][:40]) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_sparse_ckpt(tiny_ckpt, text_file, tmp_path_factory) -> Path:
    """tiny_ckpt pruned 2:4 by `trtpipe sparsify` (SparseGPT on text_file), with its dense/sparse perplexity."""
    from click.testing import CliRunner

    from pipeline.cli import main

    out = tmp_path_factory.mktemp("sparse") / "ckpt-24"
    result = CliRunner().invoke(main, ["sparsify", str(tiny_ckpt), "-o", str(out), "--dataset", str(text_file),
                                       "--samples", "6", "--seq-len", "48", "--eval-samples", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    return out
