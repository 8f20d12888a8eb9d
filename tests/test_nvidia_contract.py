"""The repositories trtpipe writes carry every parameter NVIDIA's code cannot load without
(pipeline/backends/nvidia_contract.py), and the table matches the facts written in docs/upstream-facts.md §B2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.backends.nvidia_contract import FATAL, PYTHON_MODELS, TENSORRTLLM, required_keys
from pipeline.check import check_repository
from pipeline.deploy import deploy_repository
from pipeline.plan import make_plan, resolve_model_info
from pipeline.targets import get_target
from pipeline.tritonconfig import parse_pbtxt

FACTS = Path(__file__).resolve().parents[1] / "docs" / "upstream-facts.md"


def test_the_required_keys_are_the_ones_nvidias_source_reads_without_a_fallback():
    assert required_keys(TENSORRTLLM) == ["gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path",
                                          "guided_decoding_backend"]
    assert required_keys(PYTHON_MODELS["preprocessing"]) == ["tokenizer_dir", "multimodal_model_path"]
    assert required_keys(PYTHON_MODELS["postprocessing"]) == ["tokenizer_dir"]
    assert required_keys(PYTHON_MODELS["tensorrt_llm_bls"]) == []


def test_the_written_facts_name_every_parameter_and_whether_it_is_fatal():
    """docs/upstream-facts.md §B2's table, one row per parameter: `| model | key | missing | placeholder | source |`."""
    text = FACTS.read_text()
    section = text[text.index("## B2."):]
    section = section[:section.index("\n## ", 5)]
    rows = re.findall(r"^\| (\S+) \| `([^`]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", section, re.M)
    written = {(model, key): (missing.strip(), placeholder.strip()) for model, key, missing, placeholder, _ in rows}
    tables = {"tensorrt_llm": TENSORRTLLM, **PYTHON_MODELS}
    expected = {(model, p.name): (FATAL if p.missing == FATAL else "fallback", p.placeholder)
                for model, table in tables.items() for p in table.values()}
    got = {k: ("fatal" if v[0].startswith("**fatal**") else "fallback", v[1].strip("*")) for k, v in written.items()}
    assert got == expected


@pytest.fixture(scope="module")
def repositories(smollm2_checkpoint, smollm2_hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    gpu = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")
    cpu = make_plan(resolve_model_info(str(smollm2_checkpoint)), get_target("cpu"), "fp32")
    return {"gpu": deploy_repository(gpu, root / "gpu", engine=root / "engine", tokenizer=smollm2_hf_dir).path,
            "cpu": deploy_repository(cpu, root / "cpu", checkpoint=smollm2_checkpoint).path}


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_every_key_nvidias_code_cannot_load_without_is_written(repositories, kind):
    repo = repositories[kind]
    tables = {**PYTHON_MODELS, **({"tensorrt_llm": TENSORRTLLM} if kind == "gpu" else {})}
    for model, table in tables.items():
        config = parse_pbtxt((repo / model / "config.pbtxt").read_text())
        missing = [key for key in required_keys(table) if key not in config.parameters]
        assert missing == [], (model, missing)
    report = check_repository(repo)
    assert not [f for f in report.findings if f.code == "parameter"]


def test_removing_one_is_caught_by_check(repositories, tmp_path):
    import shutil

    from pipeline.tritonconfig import to_pbtxt

    repo = Path(shutil.copytree(repositories["gpu"], tmp_path / "repo"))
    path = repo / "tensorrt_llm" / "config.pbtxt"
    config = parse_pbtxt(path.read_text())
    config.parameters.pop("guided_decoding_backend")
    path.write_text(to_pbtxt(config))
    assert [f.field for f in check_repository(repo).findings if f.code == "parameter"] == [
        "parameters[guided_decoding_backend]"]
