"""Where validate's golden reference comes from when no --golden is given: the model a checkpoint was converted
from, recorded by convert, carried by calibrate, plan and deploy; and a skip, not a failure, where none is known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.models import buildable_copy

from pipeline.checkpoint import source_model
from pipeline.plan import load_plan, save_plan
from pipeline.sources import resolve_model
from pipeline.validate.checks import check_golden
from pipeline.validate.report import CheckResult, ValidateOptions, ValidationReport, render_report


def checkpoint_made_by(directory: Path, stage: str, **recorded) -> Path:
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text(json.dumps({"stage": stage, **recorded}))
    return directory


def test_a_converted_checkpoint_names_its_preset_or_hub_id_as_the_user_did(tmp_path):
    assert source_model(checkpoint_made_by(tmp_path / "a", "convert", source="smollm2-135m")) == "smollm2-135m"
    assert source_model(checkpoint_made_by(tmp_path / "b", "convert", source="org/name")) == "org/name"


def test_a_local_model_is_found_again_from_the_path_the_manifest_made_portable(tmp_path):
    (tmp_path / "hf").mkdir()
    ckpt = checkpoint_made_by(tmp_path / "ckpt", "convert", source="hf")   # relative to the checkpoint's parent
    assert source_model(ckpt) == str((tmp_path / "hf").resolve())


def test_calibrate_carries_the_model_and_weight_changing_stages_do_not(tmp_path):
    calibrated = checkpoint_made_by(tmp_path / "fp8", "calibrate", source_model="smollm2-135m",
                                    source_checkpoint="ckpt")
    assert source_model(calibrated) == "smollm2-135m"
    for stage in ("sparsify", "distill"):    # their weights are no longer the source model's
        assert source_model(checkpoint_made_by(tmp_path / stage, stage, source="smollm2-135m")) is None
    (tmp_path / "elsewhere").mkdir()
    assert source_model(tmp_path / "elsewhere") is None      # a checkpoint trtpipe did not write


def test_a_source_names_a_local_model_by_its_absolute_path_and_a_preset_by_name(tiny_llama, monkeypatch):
    directory = tiny_llama("gqa")
    monkeypatch.chdir(directory.parent)
    assert resolve_model(directory.name).reference == str(directory.resolve())
    assert resolve_model("smollm2-135m").reference == "smollm2-135m"


def test_plan_json_keeps_the_source_model_and_finds_it_again_after_a_move(tiny_llama, tmp_path):
    from pipeline.planner import make_plan
    from pipeline.plan import resolve_model_info
    from pipeline.targets import get_target
    from pipeline.convert import convert_model

    build = tmp_path / "build"
    local = buildable_copy(tiny_llama("gqa"), build / "hf")
    convert_model(resolve_model(str(local)), build / "ckpt", progress=False)
    plan = make_plan(resolve_model_info(str(build / "ckpt")), get_target("cpu"), "fp16")
    assert plan.model.reference == str(local.resolve())
    save_plan(plan, build / "plan.json")
    assert '"source_model": "hf"' in (build / "plan.json").read_text()    # no machine path
    build.rename(tmp_path / "moved")
    assert load_plan(tmp_path / "moved" / "plan.json").model.reference == str((tmp_path / "moved" / "hf").resolve())


class NoServer:
    def generate(self, prompt, max_tokens):   # pragma: no cover - a skipped check sends nothing
        raise AssertionError("the golden check sent a request without a reference")


def test_no_reference_is_a_skip_that_names_the_flag_not_a_failure(tmp_path):
    result = check_golden(NoServer(), ValidateOptions(golden=None))
    assert result.skipped and not result.passed and not result.failed
    assert "--golden MODEL" in result.fix
    report = ValidationReport("repo", "http://127.0.0.1:1", [CheckResult("ready", True, "ok"), result])
    assert report.passed and report.to_dict()["passed"] is True
    text = render_report(report, tmp_path)
    assert "SKIP  golden" in text and "to run it: pass --golden MODEL" in text
    assert "all checks passed (1 skipped: golden)" in text
    failing = ValidationReport("repo", "x", [CheckResult("ready", False, "down"), result])
    assert not failing.passed and "1 of 2 checks failed" in render_report(failing, tmp_path)


@pytest.mark.parametrize("key", ["trtpipe_version", "created"])
def test_the_report_says_which_trtpipe_wrote_it_and_when(key):
    from pipeline import __version__

    data = ValidationReport("repo", "server", []).to_dict()
    assert data[key] == __version__ if key == "trtpipe_version" else data[key].endswith("Z")
