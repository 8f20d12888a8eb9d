"""The build matrix: trtpipe.toml / [tool.trtpipe], `trtpipe matrix` and `trtpipe build --matrix`."""

from __future__ import annotations

import json

import pytest
from support.models import tiny_model_with_tokenizer
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.matrix import load_matrix

TWO_BUILDS = """
output = "builds"

[[build]]
name = "tiny-cpu"
model = "{model}"
target = "cpu"
precision = "fp16"
workload = {{ input_len = 64, output_len = 32, max_context = 128 }}

[[build]]
name = "tiny-4090-fp8"
model = "{model}"
target = "rtx4090"
precision = "fp8"
kv_cache = "fp8"
tp = 1
calibration = "news"
samples = 8
"""


def write_matrix(directory, model="smollm2-135m", text=TWO_BUILDS, name="trtpipe.toml"):
    path = directory / name
    path.write_text(text.format(model=model))
    return path


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_matrix_prints_each_build_with_its_sm_and_fingerprint_as_a_ci_matrix(tmp_path):
    result = invoke("matrix", write_matrix(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["include"]
    assert [r["name"] for r in rows] == ["tiny-cpu", "tiny-4090-fp8"]
    assert [(r["target"], r["sm"], r["gpu"]) for r in rows] == [("cpu", None, False), ("rtx4090", 89, True)]
    assert rows[0]["workload"]["max_context"] == 128 and rows[1]["calibration"] == "news"
    assert rows[0]["fingerprint"] != rows[1]["fingerprint"]
    text = invoke("matrix", tmp_path / "trtpipe.toml")
    assert "tiny-4090-fp8" in text.output and "rtx4090 (sm 89) fp8" in text.output


def test_fingerprint_changes_with_any_setting(tmp_path):
    before = load_matrix(write_matrix(tmp_path)).entries[1].fingerprint()
    after = load_matrix(write_matrix(tmp_path, text=TWO_BUILDS.replace("samples = 8", "samples = 9"))).entries[1]
    assert after.fingerprint() != before


def test_pyproject_tool_table_is_read(tmp_path):
    text = "[project]\nname = 'x'\n\n[tool.trtpipe]\n" + TWO_BUILDS.replace("[[build]]", "[[tool.trtpipe.build]]")
    path = write_matrix(tmp_path, text=text, name="pyproject.toml")
    matrix = load_matrix(path)
    assert [e.name for e in matrix.entries] == ["tiny-cpu", "tiny-4090-fp8"] and str(matrix.output) == "builds"


@pytest.mark.parametrize("change,message", [
    (('precision = "fp16"', 'precision = "fp4"'), "precision must be one of"),
    (('target = "cpu"', 'target = "h900"'), "unknown target 'h900'"),
    (('name = "tiny-4090-fp8"', 'name = "tiny-cpu"'), "repeated: tiny-cpu"),
    (('name = "tiny-cpu"', 'name = "../evil"'), "name may hold only"),
    (("tp = 1", "tp = 0"), "tp must be at least 1"),
    (("tp = 1", 'tp = "2"'), "tp must be a int"),
    (("tp = 1", "tensor_parallel = 2"), "unknown key(s) tensor_parallel"),
    (("input_len = 64", "input_length = 64"), "unknown workload key(s) input_length"),
    (("max_context = 128", "max_context = 1"), "--max-context must be at least 2"),
    (('kv_cache = "fp8"', 'kv_cache = "fp4"'), "kv_cache must be one of"),
    (('model = "{model}"\ntarget = "cpu"', 'target = "cpu"'), "lacks model"),
])
def test_bad_matrices_stop_with_one_message_naming_file_and_build(tmp_path, change, message):
    text = TWO_BUILDS.replace(*change, 1)
    assert text != TWO_BUILDS
    path = write_matrix(tmp_path, text=text)
    result = invoke("matrix", path)
    assert result.exit_code == 2, result.output
    assert message in result.output and str(path) in result.output and "Traceback" not in result.output


def test_missing_and_unparsable_files(tmp_path):
    assert "does not exist" in invoke("matrix", tmp_path / "nope.toml").output
    bad = tmp_path / "bad.toml"
    bad.write_text("[[build]\n")
    result = invoke("matrix", bad)
    assert result.exit_code == 2 and "not a readable TOML file" in result.output


def test_build_matrix_only_builds_the_named_entry_with_its_settings(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_matrix(tmp_path, model=tiny_model_with_tokenizer(tiny_llama("gqa"), tmp_path / "tiny"))
    result = invoke("build", "--matrix", path, "--only", "tiny-cpu", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    summaries = json.loads(result.stdout[result.stdout.index("{"):])
    assert list(summaries) == ["tiny-cpu"]
    plan = json.loads((tmp_path / "builds" / "tiny-cpu" / "plan.json").read_text())
    assert plan["workload"]["input_len"] == 64 and plan["max_seq_len"] == 128
    assert not (tmp_path / "builds" / "tiny-4090-fp8").exists()


@pytest.mark.parametrize("args,message", [
    (["--only", "nope"], "no build named 'nope'"),
    (["smollm2-135m"], "give MODEL or --matrix, not both"),
])
def test_build_matrix_usage_mistakes(tmp_path, args, message):
    path = write_matrix(tmp_path)
    model_args = [a for a in args if not a.startswith("-") and a != "nope"]
    rest = [a for a in args if a not in model_args]
    result = invoke("build", *model_args, "--matrix", path, *rest, "-o", tmp_path / "out")
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_only_without_matrix_and_no_model_are_refused():
    assert "give --matrix FILE" in invoke("build", "smollm2-135m", "--only", "x").output
    result = invoke("build")
    assert result.exit_code == 2 and "give MODEL" in result.output
