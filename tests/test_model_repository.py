"""The typed model of a Triton repository (`pipeline.model_repository`): what deploy wrote, read back once, and
the one reader of config.pbtxt and a repository's manifest.json in the package."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.model_repository import (INFLIGHT_BATCHER_MODELS, NO_CONFIG, model_names, read_deployment,
                                       read_repository)
from pipeline.plan import load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.targets import get_target

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"


@pytest.fixture(scope="module")
def gpu_repo(smollm2_hf_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu")
    plan = save_plan(make_plan(resolve_model_info("smollm2-135m"), get_target("rtx4090"), "fp16"), root / "p.json")
    return deploy_repository(load_plan(plan), root / "repo", engine=root / "engine", tokenizer=smollm2_hf_dir).path


def test_a_deployed_repository_reads_back_as_what_deploy_wrote(gpu_repo):
    repository = read_repository(gpu_repo)
    plan = load_plan(gpu_repo.parent / "p.json")
    assert repository.names == sorted(INFLIGHT_BATCHER_MODELS) == model_names(gpu_repo)
    assert repository.by_deploy and not repository.unusable
    assert repository.engine == gpu_repo.parent / "engine"
    assert repository.tokenizer == gpu_repo / "preprocessing" / "1" / "tokenizer"
    assert (repository.tokenizer / "tokenizer.json").is_file()
    assert repository.plan().to_dict() == plan.to_dict()
    assert repository.deployment == read_deployment(gpu_repo)
    assert repository.deployment.backend == plan.backend and isinstance(repository.deployment.serve_command, tuple)
    llm = repository.model("tensorrt_llm")
    assert llm.serves_engine and llm.decoupled and llm.file == "tensorrt_llm/config.pbtxt"
    assert llm.config.max_batch_size == plan.triton.triton_max_batch_size


def test_a_placeholder_is_not_a_value(gpu_repo, tmp_path):
    """An unfilled ${...} (fill_template.py's) names no engine; the parameter reads as written for check."""
    repo = tmp_path / "repo"
    shutil.copytree(gpu_repo, repo)
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace(str(gpu_repo.parent / "engine"), "${engine_dir}"))
    repository = read_repository(repo)
    assert repository.engine is None
    assert repository.model("tensorrt_llm").parameter("gpt_model_path") == "${engine_dir}"


def test_unusable_models_are_kept_with_the_reason(gpu_repo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(gpu_repo, repo)
    (repo / "postprocessing" / "config.pbtxt").write_text("max_batch_size: ${triton_max_batch_size}\n")
    (repo / "preprocessing" / "config.pbtxt").unlink()
    (repo / "manifest.json").write_text("not json")
    repository = read_repository(repo)
    assert set(repository.models) == set(INFLIGHT_BATCHER_MODELS) - {"postprocessing", "preprocessing"}
    assert repository.unusable["preprocessing"] == NO_CONFIG
    assert "not a valid inference.ModelConfig" in repository.unusable["postprocessing"]
    assert "postprocessing" in repository.names and "preprocessing" not in repository.names
    assert repository.manifest is None and not repository.by_deploy
    with pytest.raises(UserError, match="postprocessing/config.pbtxt: not a valid"):
        repository.model("postprocessing")
    with pytest.raises(UserError, match="not a `trtpipe deploy` manifest"):
        repository.plan()


def test_an_older_deployment_record_reads_as_none(gpu_repo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(gpu_repo, repo)
    manifest = json.loads((repo / "manifest.json").read_text())
    manifest["deployment"] = {"model": "x", "field_this_trtpipe_does_not_know": 1}
    (repo / "manifest.json").write_text(json.dumps(manifest))
    assert read_deployment(repo) is None and read_repository(repo).by_deploy


def test_not_a_directory_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="does not exist or is not a directory"):
        read_repository(tmp_path / "missing")


def test_only_model_repository_parses_config_pbtxt_or_reads_a_manifest():
    """One home: no other module of the package calls parse_pbtxt or read_manifest (compile reads its own
    engine directory's manifest, and checkpoint its checkpoint's, not a repository's; outputs defines and uses it
    for re-run checks)."""
    allowed = {"model_repository.py", "tritonconfig.py", "outputs.py", "compile.py", "checkpoint.py"}
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"parse_pbtxt", "read_manifest"}:
                callers.add(str(path.relative_to(PACKAGE)))
    assert callers - allowed == set()
