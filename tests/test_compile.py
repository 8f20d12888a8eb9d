"""The compile stage: the exact trtllm-build command and --build_config JSON, checked against the flags and
config fields of TensorRT-LLM 1.2.1; the engine-config check; the Dockerfile lint; and what compile does
with and without a GPU box. Nothing here depends on what the machine has: the requirement check and the
GPU are monkeypatched, and a fake `trtllm-build` on PATH stands in for the real one."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import types
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import pipeline.compile as compile_module
from pipeline.cli import main
from pipeline.compile import (
    BUILD_CONFIG_FILE,
    COMMAND_FILE,
    CompileStatus,
    build_config_json,
    check_engine_config,
    compile_checkpoint,
    compile_engine,
    missing_build_requirements,
    trtllm_build_command,
)
from pipeline.errors import UserError
from pipeline.plan import Workload, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.targets import get_target

FLAGS_FILE = Path(__file__).parent / "data" / "trtllm_build_1.2.1_flags.txt"
REPO = Path(__file__).resolve().parents[1]

# TensorRT-LLM 1.2.x field names, from tensorrt_llm/builder.py (dataclass BuildConfig) and
# tensorrt_llm/plugin/plugin.py (pydantic PluginConfig, extra="ignore": a misspelt key would be
# silently dropped, so the names are checked here).
BUILD_CONFIG_FIELDS = {
    "max_input_len", "max_seq_len", "opt_batch_size", "max_batch_size", "max_beam_width", "max_num_tokens",
    "opt_num_tokens", "max_prompt_embedding_table_size", "kv_cache_type", "gather_context_logits",
    "gather_generation_logits", "strongly_typed", "force_num_profiles", "profiling_verbosity",
    "enable_debug_output", "max_draft_len", "speculative_decoding_mode", "use_refit", "input_timing_cache",
    "output_timing_cache", "lora_config", "weight_sparsity", "weight_streaming", "plugin_config",
    "use_strip_plan", "max_encoder_input_len", "dry_run", "visualize_network", "monitor_memory", "use_mrope",
}
# BuildConfig.from_dict in the older 1.x builder pops these without a default: they must be present.
BUILD_CONFIG_REQUIRED = {"max_input_len", "max_seq_len", "max_batch_size", "max_beam_width", "max_num_tokens",
                         "opt_num_tokens"}
PLUGIN_CONFIG_FIELDS = {
    "dtype", "bert_attention_plugin", "gpt_attention_plugin", "gemm_plugin", "gemm_swiglu_plugin",
    "fp8_rowwise_gemm_plugin", "qserve_gemm_plugin", "identity_plugin", "nccl_plugin", "lora_plugin",
    "dora_plugin", "weight_only_groupwise_quant_matmul_plugin", "weight_only_quant_matmul_plugin",
    "smooth_quant_plugins", "smooth_quant_gemm_plugin", "layernorm_quantization_plugin",
    "rmsnorm_quantization_plugin", "quantize_per_token_plugin", "quantize_tensor_plugin", "moe_plugin",
    "mamba_conv1d_plugin", "low_latency_gemm_plugin", "low_latency_gemm_swiglu_plugin", "gemm_allreduce_plugin",
    "context_fmha", "bert_context_fmha_fp32_acc", "paged_kv_cache", "remove_input_padding", "norm_quant_fusion",
    "reduce_fusion", "user_buffer", "tokens_per_block", "use_paged_context_fmha", "use_fp8_context_fmha",
    "fuse_fp4_quant", "multiple_profiles", "paged_state", "streamingllm", "manage_weights", "use_fused_mlp",
    "pp_reduce_scatter",
}


def load_flags() -> dict[str, str]:
    """flag -> kind from the test data (aliases map to the same kind)."""
    flags = {}
    for line in FLAGS_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        names, kind = line.split()
        for name in names.split(","):
            flags[name] = kind
    return flags


def assert_valid_trtllm_build_argv(argv: list[str]) -> None:
    flags = load_flags()
    assert argv[0] == "trtllm-build"
    i = 1
    while i < len(argv):
        flag = argv[i]
        assert flag in flags, f"{flag} is not a trtllm-build 1.2.1 flag"
        kind = flags[flag]
        if kind == "store_true":
            i += 1
            continue
        value = argv[i + 1]
        if kind == "int":
            int(value)
        elif kind.startswith("{"):
            assert value in kind[1:-1].split(","), f"{flag} {value}: not one of {kind}"
        i += 2


@pytest.fixture(scope="module")
def fp16_checkpoint(tiny_llama, tmp_path_factory) -> Path:
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    out = tmp_path_factory.mktemp("compile-ckpt") / "ckpt"
    return convert_model(resolve_model(str(tiny_llama("gqa"))), out, dtype="float16", progress=False).path


@pytest.fixture(scope="module")
def gpu_plan(fp16_checkpoint):
    return make_plan(resolve_model_info(str(fp16_checkpoint)), get_target("rtx4090"), "fp16", "auto", 1,
                     Workload(input_len=64, output_len=32, concurrency=16))


def test_flags_file_parses_and_names_the_plugin_flags():
    flags = load_flags()
    assert flags["--max_seq_len"] == flags["--max_decoder_seq_len"] == "int"
    assert flags["--use_paged_context_fmha"] == "{enable,disable}"
    assert "--paged_kv_cache" in flags and "--context_fmha_fp32_acc" not in flags   # removed from PluginConfig


def test_dry_run_command_and_build_config(fp16_checkpoint, gpu_plan, tmp_path):
    out = tmp_path / "engine"
    result = compile_engine(fp16_checkpoint, gpu_plan, out, dry_run=True)
    assert result.dry_run and not result.skipped
    assert_valid_trtllm_build_argv(result.command)
    argv = result.command
    assert argv[argv.index("--checkpoint_dir") + 1] == str(fp16_checkpoint.absolute())
    assert argv[argv.index("--output_dir") + 1] == str(out.absolute())
    config_path = Path(argv[argv.index("--build_config") + 1])
    config = json.loads(config_path.read_text())
    assert config == build_config_json(gpu_plan)
    assert BUILD_CONFIG_REQUIRED <= set(config) and set(config) <= BUILD_CONFIG_FIELDS
    assert set(config["plugin_config"]) <= PLUGIN_CONFIG_FIELDS
    assert config["max_batch_size"] == 16 and config["max_seq_len"] == 256
    assert config["plugin_config"]["use_paged_context_fmha"] is True   # a real bool, as model_copy needs
    # the plugin flags say the same as the JSON (the flags build the PluginConfig the JSON updates)
    spelled = {True: "enable", False: "disable", None: "disable"}
    for name, value in config["plugin_config"].items():
        if f"--{name}" in argv:
            expected = spelled[value] if value is None or isinstance(value, bool) else str(value)
            assert argv[argv.index(f"--{name}") + 1] == expected, name
    assert argv[argv.index("--tokens_per_block") + 1] == "32" and "--dtype" not in argv
    script = (out / COMMAND_FILE).read_text()
    assert 'cd "$(dirname "$0")"' in script and str(tmp_path) not in script   # names no machine path
    ran = shlex.split(script.splitlines()[-1])[1:]
    assert ran == [str(p) if p not in (str(fp16_checkpoint.absolute()), str(out.absolute()), str(config_path))
                   else os.path.relpath(p, out) for p in argv]
    assert (out / ran[ran.index("--checkpoint_dir") + 1]).resolve() == fp16_checkpoint.resolve()
    assert ran[ran.index("--build_config") + 1] == "build_config.json"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "compile" and manifest["dry_run"] is True
    assert not list(out.glob("*.engine"))
    again = compile_engine(fp16_checkpoint, gpu_plan, out, dry_run=True)
    assert again.skipped


def test_fp8_plan_command_flags(tmp_path):
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")
    argv = trtllm_build_command(plan, Path("/ckpt"), tmp_path, tmp_path / BUILD_CONFIG_FILE)
    assert_valid_trtllm_build_argv(argv)
    assert argv[argv.index("--gemm_plugin") + 1] == "disable"
    assert argv[argv.index("--use_fp8_context_fmha") + 1] == "enable"
    assert argv[argv.index("--multiple_profiles") + 1] == "enable"


FAKE_TRTLLM_BUILD = """
import json, pathlib, sys
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--output_dir") + 1])
build = json.loads(pathlib.Path(args[args.index("--build_config") + 1]).read_text())
print("[TRT-LLM] [I] Set dtype to float16.")
if LOG:
    print(LOG)
if MODE == "fail":
    print("[TRT-LLM] [E] fake-trtllm-build: CUDA out of memory while building layer 3", file=sys.stderr)
    sys.exit(3)
build.update(OVERRIDES)
if MODE == "build":
    (out / "rank0.engine").write_bytes(b"not really an engine")
(out / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": build,
    "pretrained_config": {"mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}}}))
"""


def pretend_gpu_box(monkeypatch, bindir: Path, mode: str = "build", sm: int = 89, log: str = "",
                    **overrides) -> None:
    """This machine as an RTX 4090 box with TensorRT-LLM 1.2.1, whose trtllm-build (a fake on PATH) prints `log`,
    then fails (mode "fail": message on stderr, exit 3), writes no engine ("no-engine"), or writes rank0.engine
    and config.json with the --build_config it was given, `overrides` changed ("build")."""
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "trtllm-build"
    script.write_text(f"#!{sys.executable}\nMODE = {mode!r}\nOVERRIDES = {overrides!r}\nLOG = {log!r}\n"
                      f"{FAKE_TRTLLM_BUILD}")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(compile_module, "missing_build_requirements", lambda: None)
    monkeypatch.setattr(compile_module, "gpu_description",
                        lambda: {"name": "NVIDIA GeForce RTX 4090", "sm": sm, "memory_bytes": 24 << 30})


def pretend_no_gpu(monkeypatch, reason: str = "no CUDA GPU is visible on this machine") -> None:
    monkeypatch.setattr(compile_module, "missing_build_requirements", lambda: reason)


def test_without_tensorrt_llm_writes_the_command_and_says_where_to_build(fp16_checkpoint, gpu_plan, tmp_path,
                                                                         monkeypatch):
    pretend_no_gpu(monkeypatch, "TensorRT-LLM 1.2.1 is not importable on this machine")
    plan_path = save_plan(gpu_plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o", str(out)])
    assert result.exit_code == 2
    assert "TensorRT-LLM 1.2.1 is not importable" in result.output
    assert "tritonserver:26.07-trtllm-python-py3" in result.output and "Traceback" not in result.output
    assert (out / BUILD_CONFIG_FILE).is_file() and (out / COMMAND_FILE).is_file()
    assert "trtllm-build --checkpoint_dir" in result.output   # the exact command is printed too
    result = compile_checkpoint(fp16_checkpoint, gpu_plan, out)
    assert result.status is CompileStatus.NOT_BUILT_HERE and result.skipped and result.dry_run
    assert result.describe() == "command written, not built here: TensorRT-LLM 1.2.1 is not importable on this machine"


@pytest.mark.parametrize("found,trtllm_build,cuda,reason", [
    (None, True, True, "TensorRT-LLM 1.2.1 is not importable on this machine"),
    ("1.3.0", True, True, "TensorRT-LLM 1.3.0 is installed, but trtpipe plans for 1.2.1"),
    ("1.2.1", False, True, "its trtllm-build command is not on PATH"),
    ("1.2.1", True, False, "no CUDA GPU is visible on this machine"),
    ("1.2.1", True, True, None),
])
def test_requirement_check_names_what_is_missing(found, trtllm_build, cuda, reason, monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "tensorrt_llm":
            return object() if found else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(compile_module, "installed_version", lambda name: found)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if trtllm_build:
        (tmp_path / "trtllm-build").write_text("#!/bin/sh\n")
        (tmp_path / "trtllm-build").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) if trtllm_build else "/nonexistent")
    missing = missing_build_requirements()
    assert missing is None if reason is None else reason in missing


def test_built_with_trtllm_build(fp16_checkpoint, gpu_plan, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin")
    plan_path = save_plan(gpu_plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"engine written: {out.absolute()}" in result.output and "Set dtype to float16" in result.output
    assert (out / "rank0.engine").is_file() and (out / "config.json").is_file()
    assert "Set dtype to float16" in (out / "trtllm-build.log").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dry_run"] is False and manifest["gpu"]["sm"] == 89 and "tensorrt_llm" in manifest["versions"]
    again = compile_checkpoint(fp16_checkpoint, gpu_plan, out)
    assert again.status is CompileStatus.BUILT and again.skipped and again.describe() == "engine up to date"


def test_failed_trtllm_build_exits_1_with_its_output(fp16_checkpoint, gpu_plan, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin", mode="fail")
    plan_path = save_plan(gpu_plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o", str(out)])
    assert result.exit_code == 1, result.output
    error = result.output[result.output.index("error: "):]
    assert "trtllm-build exited with status 3" in error and "CUDA out of memory while building layer 3" in error
    assert "Traceback" not in result.output and "no GPU" not in result.output
    assert not out.exists() and not list(tmp_path.glob(".engine.partial-*"))


def test_failed_build_is_a_result_and_leaves_the_previous_output(fp16_checkpoint, gpu_plan, tmp_path, monkeypatch):
    out = tmp_path / "engine"
    compile_checkpoint(fp16_checkpoint, gpu_plan, out, dry_run=True)
    pretend_gpu_box(monkeypatch, tmp_path / "bin", mode="fail")
    result = compile_checkpoint(fp16_checkpoint, gpu_plan, out)
    assert result.status is CompileStatus.FAILED and not result.dry_run
    assert result.reason == "trtllm-build exited with status 3"
    assert result.output_tail.splitlines()[-1].endswith("CUDA out of memory while building layer 3")
    assert json.loads((out / "manifest.json").read_text())["dry_run"] is True   # the dry run's, untouched
    assert not list(out.glob("*.engine"))


@pytest.mark.parametrize("mode,overrides,message", [
    ("no-engine", {}, "trtllm-build exited with status 0 but wrote no rank0.engine"),
    ("build", {"max_batch_size": 2048}, ("does not match the plan (the Triton parameters would disagree with it): "
                                         "build_config.max_batch_size 2048 (plan 16)")),
])
def test_engine_that_is_not_the_plans_fails_the_build(mode, overrides, message, fp16_checkpoint, gpu_plan, tmp_path,
                                                       monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin", mode=mode, **overrides)
    with pytest.raises(compile_module.EngineBuildFailed, match=re.escape(message)) as exc:
        compile_engine(fp16_checkpoint, gpu_plan, tmp_path / "engine")
    assert exc.value.exit_code == 1 and not (tmp_path / "engine").exists()


def test_a_gpu_that_is_not_the_target_is_the_users_mistake(fp16_checkpoint, gpu_plan, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin", sm=86)
    plan_path = save_plan(gpu_plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "this GPU (NVIDIA GeForce RTX 4090, sm_86) is not the plan's target rtx4090 (sm_89)" in result.output
    assert not out.exists()


def test_cli_dry_run_prints_the_command(fp16_checkpoint, gpu_plan, tmp_path):
    plan_path = save_plan(gpu_plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o", str(out),
                                       "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["dry_run"] and data["shell_command"].startswith("trtllm-build --checkpoint_dir")
    assert shlex.split(data["shell_command"]) == data["command"]


def test_cpu_plan_has_nothing_to_compile(fp16_checkpoint, tmp_path):
    plan = make_plan(resolve_model_info(str(fp16_checkpoint)), get_target("cpu"), "fp16", "auto", 1,
                     Workload(input_len=64, output_len=32))
    with pytest.raises(UserError, match="builds no engine"):
        compile_engine(fp16_checkpoint, plan, tmp_path / "engine", dry_run=True)


def test_only_an_engine_backend_plan_is_compiled(fp16_checkpoint, gpu_plan, tmp_path):
    """compile follows plan.backend: a GPU plan with its build config, but naming the reference backend, is refused."""
    with pytest.raises(UserError, match="backend is reference .*builds no engine"):
        compile_engine(fp16_checkpoint, replace(gpu_plan, backend="reference"), tmp_path / "engine", dry_run=True)
    assert not (tmp_path / "engine").exists()


def test_checkpoint_that_does_not_match_the_plan(fp16_checkpoint, tmp_path):
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp16")
    with pytest.raises(UserError, match="does not match the plan"):
        compile_engine(fp16_checkpoint, plan, tmp_path / "engine", dry_run=True)
    with pytest.raises(UserError, match="not a TensorRT-LLM checkpoint"):
        compile_engine(tmp_path, plan, tmp_path / "engine", dry_run=True)
    assert not (tmp_path / "engine").exists()


def _engine_config(plan) -> dict:
    """An engine config.json in the shape TensorRT-LLM's EngineConfig.to_dict writes."""
    build = build_config_json(plan)
    return {"version": "1.2.1",
            "pretrained_config": {"architecture": plan.model.arch.architecture, "dtype": plan.dtype,
                                  "mapping": {"world_size": plan.tp_size, "tp_size": plan.tp_size, "pp_size": 1}},
            "build_config": {**build, "plugin_config": {**asdict(plan.plugin_config), "paged_state": False}}}


def test_engine_config_check(gpu_plan, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_engine_config(gpu_plan)))
    check_engine_config(tmp_path, gpu_plan)
    # the builder turned paged context FMHA off (e.g. an INT8 KV cache): Triton's KV reuse would fail
    changed = _engine_config(gpu_plan)
    changed["build_config"]["plugin_config"]["use_paged_context_fmha"] = False
    changed["build_config"]["max_batch_size"] = 2048
    (tmp_path / "config.json").write_text(json.dumps(changed))
    with pytest.raises(UserError, match="max_batch_size 2048.*use_paged_context_fmha"):
        check_engine_config(tmp_path, gpu_plan)


def test_the_pinned_image_is_the_newest_that_ships_the_engine_paths_tensorrt_llm():
    """Triton's compatibility matrix (server docs/introduction/compatibility.md@e1db8a60): 26.04-26.07 ship
    TensorRT-LLM 1.2.1, 26.03 ships 1.2.0; no later image ships TensorRT-LLM (release 26.11's notes)."""
    from pipeline import TRITON_RELEASE, TRTLLM_TRITON_RELEASES, TRTLLM_VERSION

    assert {r for r, v in TRTLLM_TRITON_RELEASES.items() if v == "1.2.1"} == {"26.04", "26.05", "26.06", "26.07"}
    assert TRTLLM_TRITON_RELEASES["26.03"] == "1.2.0"
    assert TRTLLM_VERSION == "1.2.1" and TRITON_RELEASE == "26.07"
    text = (REPO / "docs" / "gpu-acceptance.md").read_text()
    assert "26.04, 26.05, 26.06 and 26.07" in text and "no Triton image after 26.07" in text


def test_dockerfile_lints_clean_and_uses_the_trtllm_container():
    text = (REPO / "Dockerfile").read_text()
    from pipeline import TRITON_IMAGE

    # the newest image Triton's compatibility matrix lists with TensorRT-LLM 1.2.1 (docs/upstream-facts.md §0)
    assert TRITON_IMAGE == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    assert re.findall(r"^FROM (\S+)", text, re.M) == [TRITON_IMAGE]
    # not root: the uid the Kubernetes pods run as (issue 25 case 12)
    from pipeline.k8s.manifests import RUN_AS

    assert re.findall(r"^USER (\S+)", text, re.M) == [f"{RUN_AS}:{RUN_AS}"]
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(REPO / "Dockerfile")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # the image's own self-check (the last RUN line's Python) holds for this package
    (check,) = re.findall(r'python3 -c "([^"]+)"', text)
    ran = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr
    # and the linter does reject a bad Dockerfile (so a clean result means something)
    bad = subprocess.run([str(hadolint), "-"], input="FROM ubuntu\nRUN pip install requests\n",
                         capture_output=True, text=True, check=False)
    assert bad.returncode != 0


def test_compile_onnx_writes_trtexec_next_to_trtllm_build(fp16_checkpoint, gpu_plan, tmp_path):
    """The classic TensorRT build of the exported graph: its shapes from the plan, its sizes from the export
    (4 layers: 3 + 2 x 4 inputs per shape), written only (unverified: no TensorRT here)."""
    from pipeline.onnx.export import export_onnx

    export_onnx(fp16_checkpoint, tmp_path / "onnx")
    plan_path = save_plan(gpu_plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o", str(out),
                                       "--dry-run", "--onnx", str(tmp_path / "onnx")])
    assert result.exit_code == 0, result.output
    script = (out / "trtllm-build.sh").read_text(), (out / "trtexec.sh").read_text()
    assert "unverified" in script[1]
    argv = shlex.split(script[1].splitlines()[-1])[1:]
    flags = dict(a.split("=", 1) for a in argv if "=" in a)
    assert argv[0] == "trtexec" and flags["--onnx"] == "../onnx/model.onnx"   # relative to the script's folder
    batch = gpu_plan.optimization_profiles[0].batch_size_beam_width
    for k, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
        shapes = dict(s.split(":") for s in flags[flag].split(","))
        assert len(shapes) == 3 + 2 * 4 and shapes["input_ids"].startswith(f"{batch[k]}x")
    bad = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(plan_path), "-o",
                                    str(tmp_path / "e2"), "--dry-run", "--onnx", str(tmp_path)])
    assert bad.exit_code == 2 and "no readable genai_config.json" in bad.output and not (tmp_path / "e2").exists()


# -- 2:4 sparse checkpoints on the engine path ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sparse_fp16_checkpoint(fp16_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compile-sparse") / "ckpt-24"
    result = CliRunner().invoke(main, ["sparsify", str(fp16_checkpoint), "-o", str(out), "--method", "magnitude",
                                       "--eval-samples", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def sparse_plan(checkpoint: Path, precision: str = "fp16"):
    return make_plan(resolve_model_info(str(checkpoint)), get_target("rtx4090"), precision, "auto", 1,
                     Workload(input_len=64, output_len=32, concurrency=16))


def test_a_sparse_checkpoint_plans_weight_sparsity_with_the_gemm_plugin_off(sparse_fp16_checkpoint, gpu_plan):
    plan = sparse_plan(sparse_fp16_checkpoint)
    assert plan.model.checkpoint_sparsity == "2:4" and plan.build_config.weight_sparsity is True
    assert plan.plugin_config.gemm_plugin is None and gpu_plan.plugin_config.gemm_plugin == "auto"
    assert any("assumes no speedup" in w and "#1913" in w for w in plan.warnings)
    assert any(w.startswith("gemm plugin off") for w in plan.warnings)
    # no throughput is promised for the zeros: the same prediction as the dense plan's
    assert plan.to_dict()["performance"] == gpu_plan.to_dict()["performance"]
    assert not gpu_plan.build_config.weight_sparsity and not any("sparse" in w for w in gpu_plan.warnings)


def test_the_sparse_command_passes_weight_sparsity(sparse_fp16_checkpoint, tmp_path):
    plan = sparse_plan(sparse_fp16_checkpoint)
    result = compile_engine(sparse_fp16_checkpoint, plan, tmp_path / "engine", dry_run=True)
    assert_valid_trtllm_build_argv(result.command)
    assert "--weight_sparsity" in result.command and result.build_config["weight_sparsity"] is True
    assert result.command[result.command.index("--gemm_plugin") + 1] == "disable"


def test_sparse_and_dense_checkpoints_are_not_each_others_plan(sparse_fp16_checkpoint, fp16_checkpoint, gpu_plan,
                                                              tmp_path):
    for checkpoint, plan, says in ((fp16_checkpoint, sparse_plan(sparse_fp16_checkpoint),
                                    "sparsity dense (plan: 2:4, built with --weight_sparsity)"),
                                   (sparse_fp16_checkpoint, gpu_plan, "sparsity 2:4 (plan: dense)")):
        plan_path = save_plan(plan, tmp_path / "plan.json")
        result = CliRunner().invoke(main, ["compile", str(checkpoint), "--plan", str(plan_path), "-o",
                                           str(tmp_path / "engine"), "--dry-run"])
        assert result.exit_code == 2 and says in result.output, result.output
        assert not (tmp_path / "engine").exists()


SPARSE_LOG = ("[12/03/2026-09:00:00] [TRT] [I] (Sparsity) Layers eligible for sparse math: "
              "transformer.layers.0.mlp.fc, transformer.layers.0.mlp.proj, transformer.layers.1.mlp.fc\n"
              "[12/03/2026-09:00:01] [TRT] [I] (Sparsity) TRT inference plan picked sparse implementation for "
              "layers: {picked}")


@pytest.mark.parametrize("log, picked, warning", [
    (SPARSE_LOG.format(picked="transformer.layers.0.mlp.proj"), ["transformer.layers.0.mlp.proj"], None),
    (SPARSE_LOG.format(picked=""), [], "picked the dense tactic for every one"),
    ("", [], "logged no sparsity lines"),
])
def test_a_real_sparse_build_records_the_layers_that_went_sparse(log, picked, warning, sparse_fp16_checkpoint,
                                                                 tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin", log=log)
    plan_path = save_plan(sparse_plan(sparse_fp16_checkpoint), tmp_path / "plan.json")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["compile", str(sparse_fp16_checkpoint), "--plan", str(plan_path), "-o",
                                       str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "manifest.json").read_text())["sparsity"]
    assert recorded["pattern"] == "2:4" and recorded["picked"] == picked
    assert recorded["eligible"] == ([] if not log else ["transformer.layers.0.mlp.fc", "transformer.layers.0.mlp.proj",
                                                        "transformer.layers.1.mlp.fc"])
    if warning is None:
        assert recorded["warning"] is None and "WARNING" not in result.output
    else:
        assert warning in recorded["warning"] and "WARNING" in result.output and warning in result.output



# -- engine inspection: trtllm-build --profiling_verbosity and TensorRT's engine inspector -------------------------
# Unverified here: no TensorRT on this machine; `fake_tensorrt` stands in for NVIDIA's module.

def _detailed_layers() -> dict:
    """A synthetic `get_engine_information(LayerInformationFormat.JSON)` of a `detailed` engine: 2 + 1 GEMMs with
    two tactics, 2 plugin layers reporting only a TacticValue, a reformat with none, and 12 Myelin layers each with
    its own tactic (so the top-10 list is cut)."""
    gemm = [{"Name": f"gemm{i}", "LayerType": "CaskGemm", "TacticName": name, "TacticValue": "0x1"}
            for i, name in enumerate(["sm89_xmma_gemm_f16f16_f16f32_a", "sm89_xmma_gemm_f16f16_f16f32_a",
                                      "sm89_xmma_gemm_f16f16_f16f32_b"])]
    plugins = [{"Name": f"attn{i}", "LayerType": "PluginV2", "TacticName": "", "TacticValue": "0x0000000000000000"}
               for i in range(2)]
    myelin = [{"Name": f"myelin{i}", "LayerType": "Myelin", "TacticName": f"myelin_tactic_{i:02d}"} for i in range(12)]
    reformat = [{"Name": "reformat0", "LayerType": "Reformat"}]
    return {"Layers": gemm + plugins + myelin + reformat, "Bindings": ["input_ids", "logits"]}


def fake_tensorrt(monkeypatch, info: dict) -> list:
    """A `tensorrt` module in sys.modules whose engine inspector returns `info` as JSON; returns the list of the
    engine bytes it was asked to deserialize (with the format asked for)."""
    calls = []
    trt = types.ModuleType("tensorrt")
    trt.LayerInformationFormat = types.SimpleNamespace(JSON="JSON", ONELINE="ONELINE")

    class Inspector:
        def __init__(self, data):
            self.data = data

        def get_engine_information(self, fmt):
            calls.append((self.data, fmt))
            return json.dumps(info)

    class Engine:
        def __init__(self, data):
            self.data = data

        def create_engine_inspector(self):
            return Inspector(self.data)

    class Runtime:
        def __init__(self, logger):
            assert isinstance(logger, trt.Logger)

        def deserialize_cuda_engine(self, data):
            return Engine(data)

    trt.Logger, trt.Runtime = type("Logger", (), {}), Runtime
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)   # its plugin library: not here either
    return calls


def _compile(checkpoint, plan, tmp_path, *args):
    plan_path = save_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "engine"
    return out, CliRunner().invoke(main, ["compile", str(checkpoint), "--plan", str(plan_path), "-o", str(out),
                                          *args])


def test_profiling_verbosity_reaches_the_command_and_the_build_config(fp16_checkpoint, gpu_plan, tmp_path):
    default = trtllm_build_command(gpu_plan, Path("/ckpt"), tmp_path, tmp_path / BUILD_CONFIG_FILE)
    assert default[default.index("--profiling_verbosity") + 1] == "layer_names_only"   # trtllm-build's default
    assert build_config_json(gpu_plan)["profiling_verbosity"] == "layer_names_only"
    out, result = _compile(fp16_checkpoint, gpu_plan, tmp_path, "--dry-run", "--profiling-verbosity", "detailed")
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.splitlines()[0])   # the printed command
    assert_valid_trtllm_build_argv(argv)
    assert argv[argv.index("--profiling_verbosity") + 1] == "detailed"
    # with --build_config trtllm-build takes the JSON's value, not the flag's: both say the same
    assert json.loads((out / BUILD_CONFIG_FILE).read_text())["profiling_verbosity"] == "detailed"
    assert "--profiling_verbosity detailed" in (out / COMMAND_FILE).read_text()


def test_a_bad_profiling_verbosity_is_a_usage_error(fp16_checkpoint, gpu_plan, tmp_path):
    out, result = _compile(fp16_checkpoint, gpu_plan, tmp_path, "--dry-run", "--profiling-verbosity", "verbose")
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: Invalid value for '--profiling-verbosity': 'verbose' is not one of "
                      "'layer_names_only', 'detailed', 'none'."]
    assert "Traceback" not in result.output and not out.exists()
    with pytest.raises(UserError, match="profiling verbosity 'verbose' is not one of"):
        compile_checkpoint(fp16_checkpoint, gpu_plan, out, dry_run=True, profiling_verbosity="verbose")


def test_a_detailed_build_writes_each_ranks_layers_and_summarises_them(fp16_checkpoint, gpu_plan, tmp_path,
                                                                       monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin")
    calls = fake_tensorrt(monkeypatch, _detailed_layers())
    out, result = _compile(fp16_checkpoint, gpu_plan, tmp_path, "--profiling-verbosity", "detailed")
    assert result.exit_code == 0, result.output
    assert calls == [(b"not really an engine", "JSON")]   # rank0.engine's bytes, JSON format
    assert json.loads((out / "rank0.layers.json").read_text()) == _detailed_layers()
    inspection = json.loads((out / "manifest.json").read_text())["inspection"]
    assert inspection["ran"] is True and inspection["verified_here"] is False and "fake" in inspection["note"]
    rank0 = inspection["ranks"]["rank0"]
    assert rank0["file"] == "rank0.layers.json" and rank0["layers"] == 18 and rank0["names_only"] == 0
    assert rank0["profiles"] == 1 and rank0["layers_all_profiles"] == 18
    assert rank0["layer_types"] == {"Myelin": 12, "CaskGemm": 3, "PluginV2": 2, "Reformat": 1}
    assert rank0["layers_with_tactic"] == 17   # all but the reformat; the plugins by TacticValue
    # by count, ties in the engine's layer order, ten at most
    assert rank0["top_tactics"] == [{"tactic": "sm89_xmma_gemm_f16f16_f16f32_a", "layers": 2},
                                    {"tactic": "0x0000000000000000", "layers": 2},
                                    {"tactic": "sm89_xmma_gemm_f16f16_f16f32_b", "layers": 1},
                                    *({"tactic": f"myelin_tactic_{i:02d}", "layers": 1} for i in range(7))]
    assert "WARNING" not in result.output


def test_without_tensorrt_the_manifest_says_inspection_did_not_run(fp16_checkpoint, gpu_plan, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin")
    monkeypatch.setitem(sys.modules, "tensorrt", None)   # `import tensorrt` raises ImportError
    out, result = _compile(fp16_checkpoint, gpu_plan, tmp_path, "--profiling-verbosity", "detailed")
    assert result.exit_code == 0, result.output   # the engine was built and checked: inspection is a diagnostic
    inspection = json.loads((out / "manifest.json").read_text())["inspection"]
    assert inspection["ran"] is False and "ranks" not in inspection and inspection["verified_here"] is False
    assert inspection["reason"].startswith("the tensorrt Python module is not importable here")
    assert f"WARNING: engine inspection did not run: {inspection['reason']}" in result.output
    assert (out / "rank0.engine").is_file() and not list(out.glob("*.layers.json"))


def test_layer_names_only_attempts_no_inspection(fp16_checkpoint, gpu_plan, tmp_path, monkeypatch):
    pretend_gpu_box(monkeypatch, tmp_path / "bin")
    calls = fake_tensorrt(monkeypatch, {"Layers": ["gemm0"]})
    out, result = _compile(fp16_checkpoint, gpu_plan, tmp_path)   # the default: layer_names_only
    assert result.exit_code == 0, result.output
    assert calls == [] and "inspection" not in json.loads((out / "manifest.json").read_text())
    assert not list(out.glob("*.layers.json"))


def test_the_summary_of_names_only_and_of_several_profiles():
    from pipeline.engine_inspect import summarise_layers

    assert summarise_layers({"Layers": ["gemm0", "gemm1"], "Bindings": []}) == {
        "layers": 2, "names_only": 2, "layer_types": {}, "layers_with_tactic": 0, "top_tactics": [],
        "profiles": 1, "layers_all_profiles": 2}
    # multiple_profiles: each profile's graph, all but the first suffixed "[profile N]"; the first is counted
    layers = [{"Name": "gemm" + suffix, "LayerType": "CaskGemm", "TacticName": tactic}
              for suffix, tactic in (("", "small"), (" [profile 1]", "mid"), (" [profile 12]", "large"))]
    summary = summarise_layers({"Layers": [*layers, "gemm [profile 1]"]})
    assert summary["layers"] == 1 and summary["layer_types"] == {"CaskGemm": 1}
    assert summary["top_tactics"] == [{"tactic": "small", "layers": 1}]
    assert summary["profiles"] == 3 and summary["layers_all_profiles"] == 4
    with pytest.raises(ValueError, match="no \"Layers\" list"):
        summarise_layers({"Bindings": []})


def test_a_dtype_mismatch_names_the_plan_command_that_matches_and_compiling_with_it_works(fp16_checkpoint, tiny_llama,
                                                                                         tmp_path):
    """compile of a float16 checkpoint with a bfloat16 plan used to say "plan this checkpoint", and `plan CKPT
    --precision bf16` failed the same way (plan has no dtype): now it names the command, with the checkpoint's own
    precision, and that command and the compile after it succeed."""
    bf16 = tmp_path / "bf16-plan.json"
    planned = CliRunner().invoke(main, ["plan", str(tiny_llama("gqa")), "--target", "rtx4090", "--precision", "bf16",
                                        "--input-len", "64", "--output-len", "32", "-o", str(bf16), "--json"])
    assert planned.exit_code == 0, planned.output
    refused = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", str(bf16), "-o",
                                        str(tmp_path / "engine"), "--dry-run"])
    assert refused.exit_code == 2 and "dtype 'float16' (plan: 'bfloat16')" in refused.output, refused.output
    command = re.search(r"`(trtpipe plan [^`]+)`", refused.output).group(1)
    args = shlex.split(command)[1:]
    assert args[args.index("--precision") + 1] == "fp16"
    followed = CliRunner().invoke(main, args)
    assert followed.exit_code == 0, followed.output
    plan_path = re.search(r"--plan (\S+?)\s", refused.output + " ").group(1)
    assert plan_path == args[args.index("-o") + 1]
    compiled = CliRunner().invoke(main, ["compile", str(fp16_checkpoint), "--plan", plan_path, "-o",
                                         str(tmp_path / "engine"), "--dry-run"])
    assert compiled.exit_code == 0, compiled.output
