"""`trtpipe k8s BUILD_B --canary-of A`: A's Service name is read from what `trtpipe k8s` wrote for A."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from support.models import make_tiny_model, save_word_tokenizer
from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.plan import resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.plan.schema import Workload
from pipeline.sources import resolve_model
from pipeline.targets import get_target


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """Two build directories (plan.json + model_repo/) of one tiny model."""
    root = tmp_path_factory.mktemp("canary")
    hf = make_tiny_model(root / "tiny")
    ckpt = convert_model(resolve_model(str(hf)), root / "ckpt", dtype="float32", progress=False).path
    (ckpt / "tokenizer").mkdir(exist_ok=True)
    save_word_tokenizer(ckpt / "tokenizer")
    plan = make_plan(resolve_model_info(str(hf)), get_target("cpu"), "fp32", workload=Workload(64, 32))
    made = {}
    for name in ("a", "b"):
        save_plan(plan, root / name / "plan.json")
        deploy_repository(plan, root / name / "model_repo", checkpoint=ckpt)
        made[name] = root / name
    return made


def k8s(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["k8s", *map(str, args)])
    return result.exit_code, result.output


def stable_backend(out: Path) -> str:
    return yaml.safe_load((out / "httproute.yaml").read_text())["spec"]["rules"][0]["backendRefs"][0]["name"]


def test_the_stable_name_is_read_from_a_manifests_directory(builds, tmp_path):
    code, output = k8s(builds["a"], "-o", tmp_path / "k8s-a", "--name", "chat-stable")
    assert code == 0, output
    code, output = k8s(builds["b"], "-o", tmp_path / "k8s-b", "--canary-of", tmp_path / "k8s-a", "--name", "chat-fp8")
    assert code == 0, output
    assert stable_backend(tmp_path / "k8s-b") == "chat-stable"   # not the default tiny-cpu
    assert "read from the manifests" in (tmp_path / "k8s-b" / "CANARY.md").read_text()
    assert "note:" not in output


def test_the_stable_name_is_read_from_a_builds_k8s_directory(builds, tmp_path):
    build = tmp_path / "a"
    shutil.copytree(builds["a"], build)
    assert k8s(build, "-o", build / "k8s", "--name", "chat-stable")[0] == 0   # as `trtpipe build --k8s` places them
    code, output = k8s(builds["b"], "-o", tmp_path / "k8s-b", "--canary-of", build, "--name", "chat-fp8")
    assert code == 0, output
    assert stable_backend(tmp_path / "k8s-b") == "chat-stable"


def test_without_manifests_of_a_the_default_name_is_assumed_and_said(builds, tmp_path):
    code, output = k8s(builds["b"], "-o", tmp_path / "k8s-b", "--canary-of", builds["a"], "--name", "chat-fp8")
    assert code == 0, output
    assert stable_backend(tmp_path / "k8s-b") == "tiny-cpu"
    assert "note: A's Service name, tiny-cpu, is the name `trtpipe k8s BUILD_A` gives by default" in output
    assert "--canary-of A's manifests directory" in (tmp_path / "k8s-b" / "CANARY.md").read_text()


@pytest.mark.parametrize("service, message", [
    (None, "neither A's manifests directory"),
    ({"kind": "Deployment", "metadata": {"name": "x"}}, "is not the Service"),
    ({"kind": "Service", "metadata": {"name": "Not_A_Name"}}, "is not a Kubernetes name"),
])
def test_an_unusable_canary_of_exits_2_and_writes_nothing(builds, tmp_path, service, message):
    a = tmp_path / "k8s-a"
    a.mkdir()
    if service is not None:
        (a / "kustomization.yaml").write_text("resources: [service.yaml]\n")
        (a / "service.yaml").write_text(yaml.safe_dump(service))
    code, output = k8s(builds["b"], "-o", tmp_path / "k8s-b", "--canary-of", a, "--name", "chat-fp8")
    assert code == 2 and message in output, output
    assert not (tmp_path / "k8s-b").exists()
