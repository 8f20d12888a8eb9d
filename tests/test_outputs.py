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
    assert manifest["stage"] == "demo" and manifest["inputs"] == inputs and manifest["params"] == {"n": 1}
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
