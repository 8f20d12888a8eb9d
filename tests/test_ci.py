"""`trtpipe ci github`: the generated workflow passes SchemaStore's schema and zizmor, and its SmolLM2 job's
steps, run here in order, build, validate, package and verify."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.models import tiny_model_with_tokenizer
from click.testing import CliRunner
from test_matrix import write_matrix

from pipeline.cli import main

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
SHA_PIN = re.compile(r"^actions/(checkout|cache|upload-artifact)@[0-9a-f]{40}$")


def generate(tmp_path, monkeypatch, model="smollm2-135m") -> tuple[Path, dict]:
    monkeypatch.chdir(tmp_path)
    write_matrix(tmp_path, model=model)
    out = tmp_path / ".github" / "workflows" / "trtpipe.yml"
    result = CliRunner().invoke(main, ["ci", "github", "--matrix", "trtpipe.toml", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out, yaml.safe_load(out.read_text())


def lint(path: Path) -> None:
    schema = subprocess.run([BIN / "check-jsonschema", "--builtin-schema", "vendor.github-workflows", path],
                            capture_output=True, text=True)
    assert schema.returncode == 0, schema.stdout + schema.stderr
    audit = subprocess.run([BIN / "zizmor", "--offline", "--min-severity", "medium", "--no-progress", path],
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr


def steps_of(job: dict) -> list[dict]:
    return job["steps"]


def test_two_build_matrix_workflow_passes_the_schema_and_zizmor(tmp_path, monkeypatch):
    path, workflow = generate(tmp_path, monkeypatch)
    lint(path)
    jobs = workflow["jobs"]
    assert set(jobs) == {"smollm2-cpu", "cpu-builds", "gpu-builds"}
    assert workflow["permissions"] == {} and all(j["permissions"] == {"contents": "read"} for j in jobs.values())
    for job in jobs.values():
        for step in job["steps"]:
            if "uses" in step:
                assert SHA_PIN.match(step["uses"]), step["uses"]
            assert "${{" not in step.get("run", ""), step      # values reach run lines through env only
    gpu = jobs["gpu-builds"]
    (row,) = gpu["strategy"]["matrix"]["include"]
    assert row["runs-on"] == ["self-hosted", "linux", "x64", "gpu", "rtx4090"] and row["sm"] == 89
    assert row["trtllm"] == "1.2.1" and len(row["fingerprint"]) == 16
    assert gpu["container"]["image"] == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    assert "--gpus all" in gpu["container"]["options"] and "--shm-size=2g" in gpu["container"]["options"]
    assert gpu["if"] == "github.event_name != 'pull_request'"
    cache = next(s for s in gpu["steps"] if s.get("uses", "").startswith("actions/cache@"))
    assert all(f"matrix.{k}" in cache["with"]["key"] for k in ("fingerprint", "trtllm", "sm"))
    upload = next(s for s in gpu["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"]["compression-level"] == 0 and 1 <= upload["with"]["retention-days"] <= 90
    assert jobs["cpu-builds"]["runs-on"] == jobs["smollm2-cpu"]["runs-on"] == "ubuntu-24.04"
    assert [r["name"] for r in jobs["cpu-builds"]["strategy"]["matrix"]["include"]] == ["tiny-cpu"]


def test_the_linters_catch_an_injected_expression(tmp_path, monkeypatch):
    """A control: the same checks fail on a workflow with an untrusted expression in a run line."""
    path, workflow = generate(tmp_path, monkeypatch)
    workflow["jobs"]["smollm2-cpu"]["steps"].append({"run": "echo ${{ github.event.pull_request.title }}"})
    path.write_text(yaml.safe_dump(workflow, sort_keys=False))
    with pytest.raises(AssertionError, match="template-injection"):
        lint(path)


def test_matrix_file_outside_the_repository_is_refused(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_matrix(elsewhere)
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    result = CliRunner().invoke(main, ["ci", "github", "--matrix", str(elsewhere / "trtpipe.toml"), "-o", "w.yml"])
    assert result.exit_code == 2 and "outside the current directory" in result.output
    assert not Path("w.yml").exists()


def test_smollm2_job_is_the_readme_command_and_its_steps_run_here_in_order(tmp_path, monkeypatch, tiny_llama):
    """Runs every `run:` step of the smollm2-cpu job after setup, in order, with bash, in a checkout-like
    directory whose .venv is this one. Honest about what differs: scripts/setup.sh is not re-run (it is
    asserted to be the step), and the job's TRTPIPE_CI_MODEL (smollm2-135m) is replaced by a tiny model so
    the build takes seconds; the commands themselves are the workflow's, byte for byte."""
    path, workflow = generate(tmp_path, monkeypatch)
    job = workflow["jobs"]["smollm2-cpu"]
    steps = job["steps"]
    runs = [s for s in steps if "run" in s]
    setup, build = runs[0], runs[1]
    assert setup["run"] == "bash scripts/setup.sh"
    readme_command = f"{setup['run']} && {build['run']}"
    for name, value in job["env"].items():
        readme_command = readme_command.replace(f'"${name}"', value)
    assert readme_command in (REPO / "README.md").read_text()      # the README's first command

    work = tmp_path / "checkout"
    work.mkdir()
    (work / ".venv").symlink_to(REPO / ".venv")
    model = tiny_model_with_tokenizer(tiny_llama("gqa"), tmp_path / "tiny")
    env = {**os.environ, **job["env"], "TRTPIPE_CI_MODEL": str(model), "HF_HUB_OFFLINE": "1"}
    for step in runs[1:]:
        done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=work, env={**env, **step.get("env", {})},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"step {step['name']!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert json.loads((work / job["env"]["BUILD_DIR"] / "build.json").read_text())["passed"] is True
    upload = steps[-1]
    assert upload["uses"].startswith("actions/upload-artifact@") and upload["with"]["path"] == "${{ env.ARTIFACT }}"
    assert (work / job["env"]["ARTIFACT"]).is_file()         # what the upload step would upload


def test_the_projects_own_workflow_is_the_generated_one_and_lints(tmp_path, monkeypatch):
    own = REPO / ".github" / "workflows" / "trtpipe.yml"
    monkeypatch.chdir(tmp_path)       # no trtpipe.toml here: the SmolLM2 job alone, as for this repository
    result = CliRunner().invoke(main, ["ci", "github", "-o", "fresh.yml"])
    assert result.exit_code == 0, result.output
    assert own.read_text() == (tmp_path / "fresh.yml").read_text(), "regenerate: trtpipe ci github"
    lint(own)
