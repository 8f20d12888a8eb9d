"""`stage_output`: the one routine every stage writes its output directory with."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import UserError
from pipeline.outputs import fingerprint_inputs, read_manifest, stage_output


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "input.txt").write_text("data")
    return fingerprint_inputs([tmp_path / "input.txt"])


def write(out, inputs, params, force=False, fail=False) -> bool:
    """One run of a stage that writes result.txt; True when it wrote, False when it was up to date."""
    with stage_output(out, "demo", inputs, params, force=force, extra={"source": "input.txt"}) as output:
        if output.up_to_date:
            return False
        (output.dir / "result.txt").write_text(json.dumps(params))
        if fail:
            raise RuntimeError("interrupted")
        output.extra["seconds"] = 1.5
    return True


def test_writes_once_then_is_up_to_date_and_touches_nothing(tmp_path, inputs):
    out = tmp_path / "out"
    assert write(out, inputs, {"n": 1}) is True
    manifest = read_manifest(out)
    assert manifest["stage"] == "demo" and manifest["params"] == {"n": 1}
    assert manifest["inputs"] == {"input.txt": inputs[str(tmp_path / "input.txt")]}  # relative to out's parent
    assert manifest["source"] == "input.txt" and manifest["seconds"] == 1.5
    assert set(manifest["outputs"]) == {"result.txt"}
    stamp = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert write(out, inputs, {"n": 1}) is False
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamp


def test_other_params_need_force_and_a_failure_leaves_the_old_output(tmp_path, inputs):
    out = tmp_path / "out"
    write(out, inputs, {"n": 1})
    with pytest.raises(UserError, match="already exists"):
        write(out, inputs, {"n": 2})
    with pytest.raises(RuntimeError, match="interrupted"):
        write(out, inputs, {"n": 2}, force=True, fail=True)
    assert json.loads((out / "result.txt").read_text()) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.txt", "out"]   # no temporary left behind
    assert write(out, inputs, {"n": 2}, force=True) is True
    assert read_manifest(out)["params"] == {"n": 2}


def test_manifests_name_no_absolute_path_and_a_moved_build_is_still_up_to_date(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    build = tmp_path / "machine-specific" / "build"
    (build / "ckpt").mkdir(parents=True)
    (build / "ckpt" / "w.bin").write_text("weights")
    (home / "models").mkdir(parents=True)
    (home / "models" / "config.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.txt").write_text("corpus")

    def run(root, force=False):
        inputs = fingerprint_inputs([root / "ckpt", home / "models", elsewhere / "data.txt"])
        params = {"engine": str(root / "engine"), "model": str(home / "models"), "out": str(root)}
        with stage_output(root / "repo", "demo", inputs, params,
                          extra={"note": f"see {root / 'ckpt' / 'w.bin'}"}, force=force) as output:
            if output.up_to_date:
                return False
            (output.dir / "x").write_text("x")
        return True

    assert run(build) is True
    text = (build / "repo" / "manifest.json").read_text()
    assert str(tmp_path) not in text and str(home) not in text
    manifest = json.loads(text)
    assert manifest["params"] == {"engine": "engine", "model": "~/models", "out": "."}
    assert manifest["note"] == "see ckpt/w.bin"
    assert "ckpt/w.bin" in manifest["inputs"]
    external = [k for k in manifest["inputs"] if k.startswith("external-")]
    assert sorted(k.rsplit("/", 1)[1] for k in external) == ["config.json", "data.txt"]
    assert run(build) is False                      # same inputs: up to date
    moved = tmp_path / "moved"
    build.rename(moved)
    assert run(moved) is False                      # the whole build moved: still up to date
    (moved / "ckpt" / "w.bin").write_text("changed weights")
    assert run(moved, force=True) is True           # an input changed: rebuilt


@pytest.mark.parametrize("where, says", [
    ("a-file/out", "is a file, not a directory"),
    ("a-file/deeper/out", "is a file, not a directory"),
    ("n" * 240, "more than the 235 an output name may have"),
])
def test_an_output_that_cannot_be_written_there_is_one_clear_user_error(tmp_path, inputs, where, says):
    """issue 25's unclear cases: -o under a file, or a name over the file system's limit, were exit 1 with a bare
    FileExistsError / OSError."""
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match=says):
        with stage_output(tmp_path / where, "convert", inputs, {}):
            pytest.fail("nothing may be written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "input.txt"]


def test_a_parent_without_write_permission_is_a_user_error(tmp_path, inputs, monkeypatch):
    """Checked with os.access (root passes any permission check, so the test asks both ways)."""
    from pipeline import outputs

    monkeypatch.setattr(outputs.os, "access", lambda path, mode: False)
    with pytest.raises(UserError, match="no permission to create anything in"):
        with stage_output(tmp_path / "out", "convert", inputs, {}):
            pytest.fail("nothing may be written")
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: True)
    with stage_output(tmp_path / "out", "convert", inputs, {}) as output:
        (output.dir / "x").write_text("y")
    assert (tmp_path / "out" / "x").read_text() == "y"


def test_a_file_where_a_folder_goes_is_refused_even_with_force_and_never_offered_force(tmp_path, inputs):
    notes = tmp_path / "README.md"
    notes.write_text("mine")
    for force in (False, True):
        with pytest.raises(UserError, match="is a file, and this command writes a folder there") as refused:
            with stage_output(notes, "convert", inputs, {}, force=force):
                pass
        assert "--force" not in str(refused.value)
    assert notes.read_text() == "mine"


def test_a_folder_trtpipe_did_not_write_is_replaced_only_with_force_which_is_not_suggested(tmp_path, inputs):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="trtpipe did not write it") as refused:
        with stage_output(theirs, "convert", inputs, {}):
            pass
    assert "--force" not in str(refused.value) and (theirs / "keep.txt").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    with stage_output(empty, "convert", inputs, {}) as output:   # an empty folder is free
        (output.dir / "x").write_text("1")
    assert (empty / "x").is_file()


def test_plan_writes_a_file_only_over_its_own_plans(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    args = ["plan", "smollm2-135m", "--target", "cpu", "--precision", "fp16", "-o"]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for where, says in ((notes, "trtpipe did not write it"), (tmp_path, "is a folder")):
        result = CliRunner().invoke(main, [*args, str(where)])
        assert result.exit_code == 2 and says in result.output and "--force" not in result.output, result.output
        assert "Traceback" not in result.output
    assert notes.read_text() == "mine"
    plan = tmp_path / "plan.json"
    for _ in range(2):                                          # its own plan is written again
        assert CliRunner().invoke(main, [*args, str(plan)]).exit_code == 0
