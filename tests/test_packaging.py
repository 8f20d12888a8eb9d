"""trtpipe as a wheel: what the Dockerfile copies builds a wheel that carries its data, and that wheel,
installed without the source tree, runs the cpu build end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline.outputs import input_key

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PACKAGE_DATA = ["pipeline/data/targets.json", "pipeline/data/calibration/news.json",
                "pipeline/data/calibration/cnn_dailymail.json", "pipeline/data/model_repo/README.md",
                *(f"pipeline/data/model_repo/{m}/1/model.py"
                  for m in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls",
                            "llmapi/tensorrt_llm", "llmapi_pytorch/tensorrt_llm")),
                "pipeline/data/llm_api_args_1.2.1.txt", "pipeline/data/llm_api_args_1.3.0rc27.txt"]
#: The design card's top-level folders beside pipeline/, which the wheel carries as pipeline/data/<folder>/.
TOP_LEVEL_DATA = ("model_repo", "calibration")


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kw)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def build_wheel(tmp_path: Path) -> Path:
    """A wheel from exactly what the Dockerfile copies (pyproject.toml, pipeline/, model_repo/, calibration/), built
    offline."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    for folder in ("pipeline", *TOP_LEVEL_DATA):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
         tmp_path / "dist", src])
    wheel, = (tmp_path / "dist").glob("trtpipe-*.whl")
    return wheel


@pytest.mark.slow
def test_installed_wheel_builds_smollm2_without_the_source_tree(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        shipped = b"".join(zf.read(n) for n in names)
    assert set(PACKAGE_DATA) <= names
    assert not [n for n in names if "__pycache__" in n or n.startswith(("model_repo/", "calibration/"))]
    assert str(tmp_path).encode() not in shipped and str(REPO).encode() not in shipped  # names no machine

    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, wheel])
    work = tmp_path / "work"  # a cwd outside the repository; PYTHONPATH holds the install only
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PATH": os.pathsep.join([str(VENV_BIN), os.environ["PATH"]])}
    probe = ("import json, pipeline, pipeline.calibrate.data as d, pipeline.deploy as p;"
             "import pipeline.backends.reference as r;"
             "sources = [*p.model_source_files(), r.MODEL_SOURCE];"
             "print(json.dumps([pipeline.__file__, d.recipe_names(), [str(f) for f in sources]]))")
    package, recipes, model_sources = json.loads(run([sys.executable, "-c", probe], cwd=work, env=env).stdout)
    assert Path(package).parent == site / "pipeline", package
    assert {"news", "cnn_dailymail"} <= set(recipes)
    assert all(Path(f).is_relative_to(site / "pipeline" / "data" / "model_repo") for f in model_sources)

    out = work / "smollm2-cpu-fp16"
    result = run([site / "bin" / "trtpipe", "build", "smollm2-135m", "--target", "cpu", "--precision", "fp16",
                  "-o", out, "--json"], cwd=work, env=env, timeout=1200)
    assert json.loads(result.stdout[result.stdout.index("{"):])["passed"] is True
    deployed = json.loads((out / "model_repo" / "manifest.json").read_text())["inputs"]
    installed = {input_key(Path(f), out) for f in model_sources}      # manifests name inputs by input_key
    source_tree = {input_key(REPO / Path(f).relative_to(site), out) for f in model_sources}
    assert installed <= set(deployed)
    assert not source_tree & set(deployed), "deploy read the source tree"


def test_the_data_folders_live_once_at_the_top_level_and_the_wheel_lists_every_package():
    """issue 26: model_repo/ and calibration/ beside pipeline/, nothing of them duplicated under it, and
    pyproject's explicit package list (needed to map them into the wheel) misses no package of the tree."""
    import tomllib

    from pipeline.package_data import MODEL_SOURCES, RECIPES

    assert (MODEL_SOURCES, RECIPES) == (REPO / "model_repo", REPO / "calibration")
    assert not any((REPO / "pipeline" / "data" / folder).exists() for folder in TOP_LEVEL_DATA)
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "pipeline").rglob("__init__.py")}
    mapped = {f"pipeline.data.{folder}": folder for folder in TOP_LEVEL_DATA}
    assert set(setuptools["packages"]) == tree | set(mapped)
    assert setuptools["package-dir"] == mapped
