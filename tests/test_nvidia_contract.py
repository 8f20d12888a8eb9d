"""The repositories trtpipe writes carry every parameter NVIDIA's code cannot load without
(pipeline/backends/nvidia_contract.py), and the table matches the facts written in docs/upstream-facts.md §B2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.backends.nvidia_contract import FATAL, PYTHON_MODELS, TENSORRTLLM, required_keys
from pipeline.check import check_repository
from pipeline.deploy import deploy_repository
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
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


def written_tensor_contract() -> dict[tuple[str, str], list[tuple]]:
    """docs/upstream-facts.md §B3's blocks: (model, inputs|outputs) -> [(name, type, dims, opt, scalar, ragged)],
    and (step MODEL, input_map|output_map) -> [(model tensor, ensemble tensor)]."""
    text = FACTS.read_text()
    blocks = re.findall(r"^```contract (.+?) (\w+)\n(.*?)^```$", text, re.M | re.S)
    contract = {}
    for model, kind, body in blocks:
        if model.startswith("step "):
            contract[(model, kind)] = [tuple((item.split(":") + [item])[:2]) for item in body.split()]
            continue
        rows = []
        for line in body.strip().splitlines():
            name, dtype, dims, *flags = line.split()
            rows.append((name, "TYPE_FP32" if dtype == "LOGITS" else f"TYPE_{dtype}",
                         tuple(int(d) for d in dims.split(",")), "opt" in flags, "scalar" in flags, "ragged" in flags))
        contract[(model, kind)] = rows
    return contract


def declared(config, kind: str) -> list[tuple]:
    from pipeline.tritonconfig import dtype_name

    if kind == "outputs":
        return [(t.name, dtype_name(t.data_type), tuple(t.dims)) for t in config.output]
    return [(t.name, dtype_name(t.data_type), tuple(t.dims), t.optional, t.HasField("reshape"), t.allow_ragged_batch)
            for t in config.input]


def test_the_written_contract_has_nvidias_counts():
    """The counts read in NVIDIA's 1.2.0rc8 configs (inputs, outputs), the ensemble's duplicate counted once."""
    contract = written_tensor_contract()
    counts = {key: len(rows) for key, rows in contract.items() if not key[0].startswith("step ")}
    assert counts == {("ensemble", "inputs"): 36, ("ensemble", "outputs"): 19, ("preprocessing", "inputs"): 14,
                      ("preprocessing", "outputs"): 20, ("tensorrt_llm", "inputs"): 62, ("tensorrt_llm", "outputs"): 21,
                      ("postprocessing", "inputs"): 2, ("postprocessing", "outputs"): 1,
                      ("tensorrt_llm_bls", "inputs"): 42, ("tensorrt_llm_bls", "outputs"): 19}


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_every_tensor_of_nvidias_contract_is_declared_as_nvidia_declares_it(repositories, kind):
    """Names, data types, dims, optional, reshape and ragged batching of all five models, and the ensemble's maps:
    removing or changing one tensor in a generated repository fails here."""
    contract = written_tensor_contract()
    repo = repositories[kind]
    for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        config = parse_pbtxt((repo / model / "config.pbtxt").read_text())
        for io in ("inputs", "outputs"):
            got = declared(config, io)
            want = [w if io == "inputs" else w[:3] for w in contract[(model, io)]]  # outputs: no input properties
            assert got == want, (kind, model, io, set(want) ^ set(got))
    ensemble = parse_pbtxt((repo / "ensemble" / "config.pbtxt").read_text())
    for step in ensemble.ensemble_scheduling.step:
        for io in ("input_map", "output_map"):
            assert sorted(getattr(step, io).items()) == sorted(contract[(f"step {step.model_name}", io)]), (
                step.model_name, io)
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["preprocessing", "tensorrt_llm",
                                                                         "postprocessing"]
