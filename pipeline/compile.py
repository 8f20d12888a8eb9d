"""The compile stage: a TensorRT-LLM 1.2.1 engine from a checkpoint and a plan.

`compile_engine` always produces the exact `trtllm-build` command line and the `--build_config`
JSON that carries the plan's BuildConfig and PluginConfig. With `dry_run` (or on a machine without
TensorRT-LLM 1.2.x and a GPU) it writes them into the output directory and stops. Otherwise the
small adapter `build_with_trtllm` runs trtllm-build, streams its log, checks the engine's
config.json against the plan and records the TensorRT-LLM/TensorRT versions and the GPU.

trtllm-build 1.2.x semantics this relies on (tensorrt_llm/commands/build.py): when `--build_config`
is given, the max_* command-line options are ignored and `BuildConfig.from_json_file(path,
plugin_config=<PluginConfig from the plugin flags>)` is used, the JSON's `plugin_config` updating the
flag-built one (pydantic `model_copy(update=...)`, so the JSON holds real values: true/false/null).
The plugin flags are therefore passed too, with the same values, so both routes agree.

The real-build adapter has not been run here (no GPU, TensorRT-LLM does not install on this machine):
it is unverified until run inside the container described by the Dockerfile.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import UserError
from .outputs import (atomic_output_dir, check_output_free, fingerprint_inputs, is_up_to_date, read_manifest,
                      write_manifest)
from .plan import Plan, TENSORRT_LLM_VERSION, is_trtllm_checkpoint

BUILD_CONFIG_FILE = "build_config.json"
COMMAND_FILE = "trtllm-build.sh"
CONTAINER = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
#: The PluginConfig fields trtllm-build 1.2.x exposes as flags (tensorrt_llm/plugin/plugin.py
#: `cli_plugin_args`); the others are set by the builder itself.
CLI_PLUGIN_ARGS = (
    "bert_attention_plugin", "gpt_attention_plugin", "gemm_plugin", "gemm_swiglu_plugin",
    "fp8_rowwise_gemm_plugin", "lora_plugin", "dora_plugin", "moe_plugin", "mamba_conv1d_plugin",
    "nccl_plugin", "low_latency_gemm_plugin", "low_latency_gemm_swiglu_plugin", "gemm_allreduce_plugin",
    "context_fmha", "bert_context_fmha_fp32_acc", "remove_input_padding", "tokens_per_block",
    "use_paged_context_fmha", "use_fp8_context_fmha", "fuse_fp4_quant", "multiple_profiles", "paged_state",
    "streamingllm", "norm_quant_fusion", "reduce_fusion", "user_buffer", "use_fused_mlp", "pp_reduce_scatter",
)
#: Engine config.json `build_config` keys that must equal the plan.
CHECKED_BUILD_KEYS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width")
#: plugin_config keys that must equal the plan (the builder may override some: that is what we catch).
CHECKED_PLUGIN_KEYS = ("context_fmha", "remove_input_padding", "paged_kv_cache", "tokens_per_block",
                       "use_paged_context_fmha", "use_fp8_context_fmha", "multiple_profiles")


@dataclass(frozen=True)
class CompileResult:
    engine_dir: Path
    command: list[str]
    build_config: dict
    dry_run: bool
    skipped: bool = False

    @property
    def shell_command(self) -> str:
        return shlex.join(self.command)

    def to_dict(self) -> dict:
        return {"engine_dir": str(self.engine_dir), "command": self.command, "shell_command": self.shell_command,
                "build_config": self.build_config, "dry_run": self.dry_run, "skipped": self.skipped}


def build_config_json(plan: Plan) -> dict:
    """The `--build_config` file: BuildConfig fields with the PluginConfig under `plugin_config`."""
    config = asdict(plan.build_config)
    config["plugin_config"] = asdict(plan.plugin_config)
    return config


def _flag_value(value) -> str:
    if isinstance(value, bool):
        return "enable" if value else "disable"
    if value is None:
        return "disable"
    return str(value)


def trtllm_build_command(plan: Plan, checkpoint_dir: Path, engine_dir: Path, build_config_path: Path,
                         workers: int = 1) -> list[str]:
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--build_config", str(build_config_path), "--workers", str(workers), "--log_level", "info"]
    for name, value in asdict(plan.plugin_config).items():
        if name in CLI_PLUGIN_ARGS:
            argv += [f"--{name}", _flag_value(value)]
    return argv


def check_checkpoint_matches_plan(checkpoint: Path, plan: Plan) -> None:
    """The checkpoint must be the model, precision, KV quantization and tp the plan was made for."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir() or not is_trtllm_checkpoint(checkpoint):
        raise UserError(f"{checkpoint} is not a TensorRT-LLM checkpoint (a directory with config.json and "
                        "rank<N>.safetensors); make one with `trtpipe convert` or `trtpipe calibrate`")
    cfg = json.loads((checkpoint / "config.json").read_text())
    mapping = cfg.get("mapping") or {}
    world = int(mapping.get("world_size", 1))
    missing = [f"rank{r}.safetensors" for r in range(world) if not (checkpoint / f"rank{r}.safetensors").is_file()]
    if missing:
        raise UserError(f"checkpoint {checkpoint} lacks {', '.join(missing)} (mapping.world_size {world})")
    arch = plan.model.arch
    wanted = {"architecture": arch.architecture, "hidden_size": arch.hidden_size,
              "num_hidden_layers": arch.num_hidden_layers, "num_attention_heads": arch.num_attention_heads,
              "num_key_value_heads": arch.num_key_value_heads, "vocab_size": arch.vocab_size,
              "intermediate_size": arch.intermediate_size, "dtype": plan.dtype}
    differ = [f"{k} {cfg.get(k)!r} (plan: {v!r})" for k, v in wanted.items() if cfg.get(k) != v]
    quant = cfg.get("quantization") or {}
    for key in ("quant_algo", "kv_cache_quant_algo"):
        if quant.get(key) != plan.quantization.get(key):
            differ.append(f"quantization.{key} {quant.get(key)!r} (plan: {plan.quantization.get(key)!r})")
    if int(mapping.get("tp_size", 1)) != plan.tp_size or int(mapping.get("pp_size", 1)) != plan.pp_size:
        differ.append(f"mapping tp {mapping.get('tp_size', 1)} pp {mapping.get('pp_size', 1)} "
                      f"(plan: tp {plan.tp_size} pp {plan.pp_size})")
    if differ:
        raise UserError(f"checkpoint {checkpoint} does not match the plan: {'; '.join(differ)}. "
                        "Plan this checkpoint (`trtpipe plan CHECKPOINT ...`) or convert/calibrate to match")


def check_engine_config(engine_dir: Path, plan: Plan) -> None:
    """The built engine's config.json (EngineConfig: version, pretrained_config, build_config) agrees."""
    path = Path(engine_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
        build, plugin = config["build_config"], config["build_config"]["plugin_config"]
        mapping = config["pretrained_config"]["mapping"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a TensorRT-LLM engine config ({type(exc).__name__}: {exc})") from None
    planned_build, planned_plugin = asdict(plan.build_config), asdict(plan.plugin_config)
    differ = [f"build_config.{k} {build.get(k)!r} (plan {planned_build[k]!r})"
              for k in CHECKED_BUILD_KEYS if build.get(k) != planned_build[k]]
    if str(build.get("kv_cache_type", "")).upper() != plan.build_config.kv_cache_type:
        differ.append(f"build_config.kv_cache_type {build.get('kv_cache_type')!r} (plan {plan.build_config.kv_cache_type!r})")
    differ += [f"plugin_config.{k} {plugin.get(k)!r} (plan {planned_plugin[k]!r})"
               for k in CHECKED_PLUGIN_KEYS if plugin.get(k) != planned_plugin[k]]
    if mapping.get("tp_size") != plan.tp_size:
        differ.append(f"mapping.tp_size {mapping.get('tp_size')!r} (plan {plan.tp_size})")
    if differ:
        raise UserError(f"the engine in {engine_dir} does not match the plan (the Triton parameters would "
                        f"disagree with it): {'; '.join(differ)}")


def compile_engine(checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool = False, workers: int = 1,
                   force: bool = False) -> CompileResult:
    if plan.build_config is None or plan.plugin_config is None:
        raise UserError(f"the plan is for the {plan.target.name} target, which builds no engine; deploy the "
                        "checkpoint directly: trtpipe deploy --checkpoint CHECKPOINT --plan PLAN -o REPO")
    if workers < 1:
        raise UserError("--workers must be at least 1")
    checkpoint, out = Path(checkpoint).absolute(), Path(out).absolute()
    check_checkpoint_matches_plan(checkpoint, plan)
    config = build_config_json(plan)
    command = trtllm_build_command(plan, checkpoint, out, out / BUILD_CONFIG_FILE, workers)
    missing = None if dry_run else missing_build_requirements()
    dry = dry_run or missing is not None
    inputs = fingerprint_inputs([checkpoint])
    params = {"plan": plan.to_dict(), "command": command, "dry_run": dry}
    skipped = is_up_to_date(out, "compile", inputs, params)
    if not skipped:
        previous = read_manifest(out) or {}
        check_output_free(out, force or (previous.get("stage") == "compile" and previous.get("dry_run") is True))
        with atomic_output_dir(out) as tmp:
            (tmp / BUILD_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            (tmp / COMMAND_FILE).write_text("#!/bin/sh\n# Written by trtpipe compile: the exact TensorRT-LLM "
                                            f"{TENSORRT_LLM_VERSION} engine build.\nexec {shlex.join(command)}\n")
            extra = {"dry_run": True} if dry else build_with_trtllm(command, tmp, out, plan)
            write_manifest(tmp, "compile", inputs, params, extra)
    if missing is not None:
        raise UserError(f"{missing}. Wrote the exact trtllm-build command ({out / COMMAND_FILE}) and its "
                        f"--build_config ({out / BUILD_CONFIG_FILE}); build on a {plan.target.name}-class GPU "
                        f"inside the trtpipe container (Dockerfile, base {CONTAINER}): docker run --gpus all "
                        "-v $PWD:/work -w /work trtpipe trtpipe compile CHECKPOINT --plan PLAN -o ENGINE\n"
                        f"{shlex.join(command)}")
    return CompileResult(out, command, config, dry, skipped=skipped)


# ----------------------------------------------------------------------------------------------
# The real-build adapter (needs TensorRT-LLM 1.2.x and a GPU; unverified on this machine)


def missing_build_requirements() -> str | None:
    """Why an engine cannot be built here, or None when TensorRT-LLM 1.2.x and a CUDA GPU are present."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return f"TensorRT-LLM {TENSORRT_LLM_VERSION} is not importable on this machine"
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("tensorrt_llm")
    except PackageNotFoundError:
        found = "unknown"
    if not found.startswith("1.2."):
        return (f"TensorRT-LLM {found} is installed, but trtpipe plans for {TENSORRT_LLM_VERSION} (later "
                "releases removed trtllm-build)")
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible on this machine"
    return None


def _gpu_description() -> dict:
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "sm": major * 10 + minor,
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory}


def _tool_versions() -> dict:
    from importlib.metadata import version

    import tensorrt

    return {"tensorrt_llm": version("tensorrt_llm"), "tensorrt": tensorrt.__version__}


def build_with_trtllm(command: list[str], tmp: Path, out: Path, plan: Plan) -> dict:
    """Run trtllm-build into `tmp` (the command names `out`, so it is rewritten), stream its log."""
    from rich.console import Console

    gpu = _gpu_description()
    if gpu["sm"] != plan.target.sm:
        raise UserError(f"this GPU ({gpu['name']}, sm_{gpu['sm']}) is not the plan's target {plan.target.name} "
                        f"(sm_{plan.target.sm}); TensorRT engines only run on the GPU kind they were built for")
    argv = [str(tmp) if a == str(out) else str(tmp / Path(a).name) if a == str(out / BUILD_CONFIG_FILE) else a
            for a in command]
    console = Console(stderr=True)
    log_lines = []
    with console.status("trtllm-build: building the engine") as status:
        # cwd: trtllm-build writes its timing cache (output_timing_cache 'model.cache') relative to it.
        proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        for line in proc.stdout:
            log_lines.append(line)
            console.print(line.rstrip(), markup=False, highlight=False)
            status.update(f"trtllm-build: {line.strip()[:100]}")
        code = proc.wait()
    (tmp / "trtllm-build.log").write_text("".join(log_lines))
    if code != 0:
        raise UserError(f"trtllm-build failed with exit status {code}; see the log above")
    check_engine_config(tmp, plan)
    return {"dry_run": False, "versions": _tool_versions(), "gpu": gpu}
