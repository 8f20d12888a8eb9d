"""The GPU runtime images (pipeline/backends/runtime_images.py): what each serves, the defaults, `--runtime-image` on
plan and build, and the PyTorch backend on TensorRT-LLM 1.3 written as a trtllm-serve deployment whose every key is
one of 1.3's LLM API arguments."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from pipeline import TRITON_IMAGE, TRTLLM_TRITON_RELEASES, TRTLLM_VERSION
from pipeline.backends.llm_api_args import LLM_API_VERSIONS, recorded_llm_api_keys, unknown_llm_api_keys
from pipeline.backends.names import ENGINE, PYTORCH
from pipeline.backends.pytorch import EXTRA_OPTIONS, LAUNCH_SCRIPT, SERVE_CONFIG
from pipeline.backends.runtime_images import (DEFAULT_IMAGE, ENGINE_REPOSITORY, IMAGES, LLMAPI_MODEL, TRTLLM_SERVE,
                                              runtime_image)
from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.plan import Workload, resolve_model_info
from pipeline.planner import make_plan
from pipeline.targets import get_target

NEW = "trtllm-1.3.0rc27"


def llama_plan(backend=PYTORCH, image=None, precision="fp8"):
    return make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), precision,
                     workload=Workload(concurrency=8), backend=backend, image=image)


def test_the_triton_images_are_the_ones_with_the_checked_tensorrt_llm():
    triton = {name: image for name, image in IMAGES.items() if image.has_triton}
    assert sorted(triton) == [f"triton-{r}" for r, v in sorted(TRTLLM_TRITON_RELEASES.items()) if v == TRTLLM_VERSION]
    assert all(image.serves == {ENGINE_REPOSITORY, LLMAPI_MODEL, TRTLLM_SERVE} for image in triton.values())
    assert IMAGES[DEFAULT_IMAGE[ENGINE]].image == TRITON_IMAGE == IMAGES[DEFAULT_IMAGE[PYTORCH]].image


def test_every_release_image_is_a_version_whose_llm_api_is_recorded():
    releases = [image for image in IMAGES.values() if not image.has_triton]
    assert sorted(image.trtllm for image in releases) == sorted(LLM_API_VERSIONS)
    assert all(image.serves == {TRTLLM_SERVE} for image in releases)
    assert IMAGES[NEW].options_flag == "--config" and IMAGES[f"trtllm-{TRTLLM_VERSION}"].options_flag == \
        "--extra_llm_api_options"


@pytest.mark.parametrize("name, backend, message", [
    (NEW, ENGINE, "rule engine-removed-1.3"),
    (f"trtllm-{TRTLLM_VERSION}", ENGINE, "has no engine repository"),
    ("triton-99.99", PYTORCH, "--runtime-image must be one of"),
])
def test_an_image_that_cannot_serve_the_backend_is_refused(name, backend, message):
    with pytest.raises(UserError, match=message):
        runtime_image(name, backend)


def test_the_plan_records_its_image_and_writes_that_version_s_llm_api():
    default, new = llama_plan(), llama_plan(image=NEW)
    assert default.runtime_image == DEFAULT_IMAGE[PYTORCH] and default.llm_api.tensorrt_llm_version == TRTLLM_VERSION
    assert new.runtime_image == NEW and new.llm_api.tensorrt_llm_version == "1.3.0rc27"
    assert not unknown_llm_api_keys(new.llm_api.options, False, "1.3.0rc27")
    assert new.llm_api.options["guided_decoding_backend"] == "xgrammar"
    assert llama_plan(backend=ENGINE).runtime_image == DEFAULT_IMAGE[ENGINE]
    assert make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp16").runtime_image is None


def test_a_1_3_deployment_is_trtllm_serve_alone_with_every_key_in_1_3_s_llm_api(tmp_path):
    result = deploy_repository(llama_plan(image=NEW), tmp_path / "deploy")
    out = result.path
    assert result.models == () and "trtllm-serve deployment" in result.summary()
    assert sorted(p.name for p in out.iterdir()) == sorted([LAUNCH_SCRIPT, SERVE_CONFIG, "manifest.json"])
    assert not (out / "tensorrt_llm").exists() and not (out / EXTRA_OPTIONS).exists()
    options = yaml.safe_load((out / SERVE_CONFIG).read_text())
    keys = recorded_llm_api_keys("1.3.0rc27")["llm_args"]
    assert set(options) <= keys
    assert {f"kv_cache_config.{k}" for k in options["kv_cache_config"]} <= keys
    assert not unknown_llm_api_keys(options, False, "1.3.0rc27")
    script = (out / LAUNCH_SCRIPT).read_text()
    assert f"--config {SERVE_CONFIG}" in script and "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27" in script
    assert check_repository(out).ok
    options["build_config"] = {"max_batch_size": 8}     # an engine-era key 1.2.1 took and 1.3 does not
    (out / SERVE_CONFIG).write_text(yaml.safe_dump(options))
    assert [(f.field, f.problem.split(" (")[0]) for f in check_repository(out).errors] == [
        ("build_config", "not an LLM API argument of TensorRT-LLM 1.3.0rc27")]


def test_build_for_rtx4090_on_the_1_3_image_chains_plan_and_deploy(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "--target", "rtx4090", "--precision", "fp16",
                                       "--backend", "pytorch", "--runtime-image", NEW, "--checkpoints-on-cpu",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["runtime_image"] == NEW and plan["llm_api"]["tensorrt_llm_version"] == "1.3.0rc27"
    summary = json.loads((out / "build.json").read_text())
    assert summary["options"]["runtime_image"] == NEW
    deployed = out / "model_repo"
    assert (deployed / SERVE_CONFIG).is_file() and (deployed / "model" / "config.json").is_file()
    script = (deployed / LAUNCH_SCRIPT).read_text()
    assert "exec trtllm-serve model --backend pytorch" in script and f"--config {SERVE_CONFIG}" in script
    assert not unknown_llm_api_keys(yaml.safe_load((deployed / SERVE_CONFIG).read_text()), False, "1.3.0rc27")
    assert str(tmp_path) not in script + (deployed / SERVE_CONFIG).read_text()
    for command in (["k8s", str(out), "-o", str(tmp_path / "k8s")], ["serve", str(deployed)],
                    ["validate", str(deployed), "-o", str(tmp_path / "validate")]):
        refused = CliRunner().invoke(main, command)
        assert refused.exit_code == 2 and "trtllm-serve deployment" in refused.output, (command, refused.output)
        assert "validate --api openai --url" in refused.output
    assert not (tmp_path / "k8s").exists()


def test_the_dry_run_names_the_image_in_its_plan_line():
    result = CliRunner().invoke(main, ["build", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8", "--backend",
                                       "pytorch", "--runtime-image", NEW, "--dry-run"])
    assert result.exit_code == 0, result.output
    plan_line = next(line for line in result.output.splitlines() if "trtpipe plan" in line)
    assert f"--backend pytorch --runtime-image {NEW}" in plan_line


@pytest.mark.parametrize("args, message", [
    (["llama-3-8b", "--target", "rtx4090", "--precision", "fp8", "--runtime-image", NEW],
     "TensorRT-LLM 1.3.0rc27 has no engine path"),
    (["smollm2-135m", "--target", "cpu", "--precision", "fp16", "--runtime-image", NEW],
     "drop --runtime-image"),
    (["llama-3-8b", "--target", "rtx4090", "--precision", "fp8", "--runtime-image", "nope"],
     "--runtime-image"),
])
def test_plan_refuses_an_image_with_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
