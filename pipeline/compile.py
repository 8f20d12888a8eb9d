"""The compile stage: a TensorRT-LLM 1.2.1 engine from a checkpoint and a plan.

`compile_checkpoint` always produces the exact `trtllm-build` command line and the `--build_config`
JSON that carries the plan's BuildConfig and PluginConfig, and returns a `CompileResult` whose status
says what happened:

- `built`: trtllm-build ran, wrote every rank's engine, and the engine's config.json agrees with the plan;
- `dry-run`: asked for; the command and build config are written, nothing is run;
- `not-built-here`: the requirement check found no TensorRT-LLM 1.2.x / trtllm-build / CUDA GPU on this
  machine (`reason` says which); the command and build config are written;
- `failed`: trtllm-build could not run, exited non-zero, or wrote an engine that disagrees with the plan;
  `reason` and `output_tail` (its last lines) say why, and nothing is left in the output directory.

The user's mistakes (a checkpoint that is not the plan's, a plan without an engine, a GPU that is not the
plan's target, an occupied output) raise `UserError` before anything is written. `compile_engine` is the
command line's form: `not-built-here` becomes a `UserError` (exit 2), `failed` an `EngineBuildFailed` (exit 1).

trtllm-build 1.2.x semantics this relies on (tensorrt_llm/commands/build.py): when `--build_config`
is given, the max_* command-line options are ignored and `BuildConfig.from_json_file(path,
plugin_config=<PluginConfig from the plugin flags>)` is used, the JSON's `plugin_config` updating the
flag-built one (pydantic `model_copy(update=...)`, so the JSON holds real values: true/false/null).
The plugin flags are therefore passed too, with the same values, so both routes agree; so is
`--profiling_verbosity`, also written into the JSON (`from_dict` takes it from there, default layer_names_only).
After a real `detailed` build TensorRT's engine inspector summarises each rank's layers in the manifest
(`pipeline/engine_inspect.py`).

The real-build adapter has only run here against a fake `trtllm-build` (tests/test_compile.py): there is
no GPU and TensorRT-LLM does not install on this machine. It is unverified until `trtpipe doctor` passes
and scripts/gpu-acceptance.sh runs inside the container described by the Dockerfile
(docs/gpu-acceptance.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

from .backends import backend_for
from .engine_inspect import DEFAULT_PROFILING_VERBOSITY, INSPECTED_VERBOSITY, PROFILING_VERBOSITIES, inspect_engines
from .errors import UserError
from .onnx.trtexec import TRTEXEC_FILE, trtexec_for_export
from .outputs import fingerprint_inputs, read_manifest, stage_output
from . import TRITON_IMAGE, TRTLLM_VERSION
from .plan import Plan, is_trtllm_checkpoint
from .sparsity.engine_log import sparse_layers
from .sparsity.pattern import claim_of

BUILD_CONFIG_FILE = "build_config.json"
COMMAND_FILE = "trtllm-build.sh"
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


#: How many of trtllm-build's last output lines a failure reports.
OUTPUT_TAIL_LINES = 25


class CompileStatus(str, Enum):
    BUILT = "built"
    DRY_RUN = "dry-run"
    NOT_BUILT_HERE = "not-built-here"
    FAILED = "failed"


class EngineBuildFailed(UserError):
    """trtllm-build failed or wrote an engine that is not the plan's: exit status 1, not 2.

    Not the user's input at fault, but a `UserError` so that the command line prints the message (with
    the tool's last lines) instead of a traceback.
    """

    exit_code = 1

    def __init__(self, reason: str, output_tail: str = ""):
        super().__init__(reason + (f"; the last lines trtllm-build printed:\n{output_tail}" if output_tail else ""))
        self.reason = reason
        self.output_tail = output_tail


@dataclass(frozen=True)
class CompileResult:
    engine_dir: Path
    command: list[str]
    build_config: dict
    status: CompileStatus
    skipped: bool = False
    reason: str = ""        # why it was not built here, or why the build failed
    output_tail: str = ""   # trtllm-build's last output lines, when it failed

    @property
    def dry_run(self) -> bool:
        """The command was written, not run."""
        return self.status in (CompileStatus.DRY_RUN, CompileStatus.NOT_BUILT_HERE)

    @property
    def shell_command(self) -> str:
        return shlex.join(self.command)

    def describe(self) -> str:
        """One line for summaries; says "not built here" only with the requirement check's own reason."""
        return {CompileStatus.BUILT: "engine up to date" if self.skipped else "engine built",
                CompileStatus.DRY_RUN: "dry run: command written",
                CompileStatus.NOT_BUILT_HERE: f"command written, not built here: {self.reason}",
                CompileStatus.FAILED: self.reason}[self.status]

    def to_dict(self) -> dict:
        return {"engine_dir": str(self.engine_dir), "command": self.command, "shell_command": self.shell_command,
                "build_config": self.build_config, "status": self.status.value, "dry_run": self.dry_run,
                "skipped": self.skipped, "reason": self.reason, "output_tail": self.output_tail}


def build_config_json(plan: Plan, profiling_verbosity: str = DEFAULT_PROFILING_VERBOSITY) -> dict:
    """The `--build_config` file: BuildConfig fields with the PluginConfig under `plugin_config`. With
    `--build_config` trtllm-build ignores its --profiling_verbosity flag, so the JSON carries it too."""
    config = asdict(plan.build_config)
    config["profiling_verbosity"] = profiling_verbosity
    config["plugin_config"] = asdict(plan.plugin_config)
    return config


def _flag_value(value) -> str:
    if isinstance(value, bool):
        return "enable" if value else "disable"
    if value is None:
        return "disable"
    return str(value)


def trtllm_build_command(plan: Plan, checkpoint_dir: Path, engine_dir: Path, build_config_path: Path,
                         workers: int = 1, profiling_verbosity: str = DEFAULT_PROFILING_VERBOSITY) -> list[str]:
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--build_config", str(build_config_path), "--workers", str(workers), "--log_level", "info",
            "--profiling_verbosity", profiling_verbosity]   # in the --build_config JSON too (it wins)
    for name, value in asdict(plan.plugin_config).items():
        if name in CLI_PLUGIN_ARGS:
            argv += [f"--{name}", _flag_value(value)]
    if plan.build_config.weight_sparsity:     # in the --build_config JSON too; the flag says it where people read
        argv.append("--weight_sparsity")
    if plan.speculative and plan.speculative.decoding_mode:   # max_draft_len is in the JSON too
        argv += ["--speculative_decoding_mode", plan.speculative.decoding_mode,
                 "--max_draft_len", str(plan.build_config.max_draft_len)]
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
    claimed = claim_of(cfg, str(checkpoint))
    claim = None if claimed is None else claimed.pattern
    if claim != plan.model.checkpoint_sparsity:
        differ.append(f"sparsity {claim or 'dense'} (plan: {plan.model.checkpoint_sparsity or 'dense'}"
                      + (", built with --weight_sparsity)" if plan.build_config.weight_sparsity else ")"))
    if int(mapping.get("tp_size", 1)) != plan.tp_size or int(mapping.get("pp_size", 1)) != plan.pp_size:
        differ.append(f"mapping tp {mapping.get('tp_size', 1)} pp {mapping.get('pp_size', 1)} "
                      f"(plan: tp {plan.tp_size} pp {plan.pp_size})")
    if differ:
        raise UserError(f"checkpoint {checkpoint} does not match the plan: {'; '.join(differ)}. "
                        + plan_this_checkpoint(checkpoint, cfg, plan))


def plan_this_checkpoint(checkpoint: Path, cfg: dict, plan: Plan) -> str:
    """The `trtpipe plan` command that plans CHECKPOINT as it is (its precision, from its quant_algo or dtype, its tp,
    its KV cache: `--kv-cache auto` follows it) on the plan's target and workload, for compile's --plan."""
    from .plan.policy import checkpoint_precision

    precision = checkpoint_precision((cfg.get("quantization") or {}).get("quant_algo"), cfg.get("dtype"))
    if precision is None:
        return "Plan this checkpoint with `trtpipe plan`, or convert/calibrate one that matches the plan"
    w, defaults = plan.workload, type(plan.workload)()
    mapping = cfg.get("mapping") or {}
    words = ["trtpipe", "plan", str(checkpoint), "--target", plan.target.name, "--precision", precision]
    words += ["--tp", str(mapping.get("tp_size"))] if int(mapping.get("tp_size", 1)) != 1 else []
    for flag, value, default in (("--input-len", w.input_len, defaults.input_len),
                                 ("--output-len", w.output_len, defaults.output_len),
                                 ("--max-context", w.max_context, None), ("--concurrency", w.concurrency, None),
                                 ("--p99-latency", w.p99_latency_s, None)):
        if value is not None and value != default:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    out = checkpoint.parent / f"{checkpoint.name}-plan.json"
    words += ["-o", str(out)]
    return (f"Plan this checkpoint as it is: `{shlex.join(words)}`, then compile it with --plan {shlex.quote(str(out))}"
            " (or convert/calibrate a checkpoint that matches the plan)")


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
        differ.append(f"build_config.kv_cache_type {build.get('kv_cache_type')!r} "
                      f"(plan {plan.build_config.kv_cache_type!r})")
    differ += [f"plugin_config.{k} {plugin.get(k)!r} (plan {planned_plugin[k]!r})"
               for k in CHECKED_PLUGIN_KEYS if plugin.get(k) != planned_plugin[k]]
    if mapping.get("tp_size") != plan.tp_size:
        differ.append(f"mapping.tp_size {mapping.get('tp_size')!r} (plan {plan.tp_size})")
    if differ:
        raise UserError(f"the engine in {engine_dir} does not match the plan (the Triton parameters would "
                        f"disagree with it): {'; '.join(differ)}")


def compile_engine(checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool = False, workers: int = 1,
                   force: bool = False, onnx: Path | None = None,
                   profiling_verbosity: str = DEFAULT_PROFILING_VERBOSITY) -> CompileResult:
    """`compile_checkpoint` for the command line: an engine that was not built is an error."""
    result = compile_checkpoint(checkpoint, plan, out, dry_run=dry_run, workers=workers, force=force, onnx=onnx,
                                profiling_verbosity=profiling_verbosity)
    if result.status is CompileStatus.NOT_BUILT_HERE:
        raise UserError(f"{not_built_here_message(result, plan)}\n{result.shell_command}")
    if result.status is CompileStatus.FAILED:
        raise EngineBuildFailed(result.reason, result.output_tail)
    return result


def not_built_here_message(result: CompileResult, plan: Plan) -> str:
    return (f"{result.reason}. Wrote the exact trtllm-build command ({result.engine_dir / COMMAND_FILE}) and its "
            f"--build_config ({result.engine_dir / BUILD_CONFIG_FILE}); build on a {plan.target.name}-class GPU "
            f"inside the trtpipe container (Dockerfile, base {TRITON_IMAGE}): docker run --gpus all "
            "-v $PWD:/work -w /work trtpipe trtpipe compile CHECKPOINT --plan PLAN -o ENGINE")


def compile_checkpoint(checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool = False, workers: int = 1,
                       force: bool = False, onnx: Path | None = None,
                       profiling_verbosity: str = DEFAULT_PROFILING_VERBOSITY) -> CompileResult:
    """Write the command and build config into `out`, and build the engine when this machine can. With
    `onnx` (an `export-onnx` directory) also write the classic TensorRT build of that graph, trtexec.sh:
    written only, never run (no TensorRT here; unverified). `profiling_verbosity` is trtllm-build's; a real
    `detailed` build is also inspected (`engine_inspect`)."""
    if not backend_for(plan.backend).builds_engine or plan.build_config is None or plan.plugin_config is None:
        raise UserError(f"the plan's backend is {plan.backend} ({plan.target.name} target), which builds no "
                        "engine; deploy the checkpoint directly: trtpipe deploy --checkpoint CHECKPOINT --plan "
                        "PLAN -o REPO")
    if workers < 1:
        raise UserError("--workers must be at least 1")
    if profiling_verbosity not in PROFILING_VERBOSITIES:
        raise UserError(f"profiling verbosity {profiling_verbosity!r} is not one of {', '.join(PROFILING_VERBOSITIES)}")
    checkpoint, out = Path(checkpoint).absolute(), Path(out).absolute()
    check_checkpoint_matches_plan(checkpoint, plan)
    config = build_config_json(plan, profiling_verbosity)
    command = trtllm_build_command(plan, checkpoint, out, out / BUILD_CONFIG_FILE, workers, profiling_verbosity)
    trtexec = None if onnx is None else trtexec_for_export(plan, Path(onnx), str(out / "model.plan"))
    missing = None if dry_run else missing_build_requirements()
    status = (CompileStatus.DRY_RUN if dry_run else
              CompileStatus.NOT_BUILT_HERE if missing is not None else CompileStatus.BUILT)
    gpu = check_gpu_is_the_target(plan) if status is CompileStatus.BUILT else None
    inputs = fingerprint_inputs([checkpoint])
    params = {"plan": plan.to_dict(), "command": command, "dry_run": status is not CompileStatus.BUILT,
              "trtexec": trtexec}
    previous = read_manifest(out) or {}
    replaceable = previous.get("stage") == "compile" and previous.get("dry_run") is True
    try:
        with stage_output(out, "compile", inputs, params, force=force or replaceable) as output:
            if output.up_to_date:
                return CompileResult(out, command, config, status, skipped=True, reason=missing or "")
            tmp = output.dir
            (tmp / BUILD_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            (tmp / COMMAND_FILE).write_text(shell_script(f"the exact TensorRT-LLM {TRTLLM_VERSION} engine build",
                                                         command, out))
            if trtexec is not None:
                (tmp / TRTEXEC_FILE).write_text(shell_script("TensorRT's build of the exported graph (--onnx; "
                                                             "unverified: never run by trtpipe)", trtexec, out))
            output.extra.update(build_with_trtllm(command, tmp, out, plan, gpu, profiling_verbosity)
                                if gpu is not None else {"dry_run": True})
    except EngineBuildFailed as exc:  # the partial output is gone; the result carries why
        return CompileResult(out, command, config, CompileStatus.FAILED, reason=exc.reason,
                             output_tail=exc.output_tail)
    return CompileResult(out, command, config, status, reason=missing or "")


def shell_script(what: str, argv: list[str], here: Path) -> str:
    """A script that runs ARGV from its own folder HERE, every path in it relative to that folder: the engine
    directory names no machine and still runs where it is copied with the checkpoint beside it as it was."""
    return (f"#!/bin/sh\n# Written by trtpipe compile: {what}.\n# Paths are relative to this script's folder.\n"
            f'cd "$(dirname "$0")" || exit 1\nexec {shlex.join(relative_paths(argv, here))}\n')


def relative_paths(argv: list[str], here: Path) -> list[str]:
    """ARGV with each absolute path (an argument, or the value of `--flag=PATH`) made relative to HERE."""
    def relative(arg: str) -> str:
        flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        if not Path(value).is_absolute():
            return arg
        return f"{flag}{eq}{os.path.relpath(value, here)}"

    return [relative(arg) for arg in argv]


# ----------------------------------------------------------------------------------------------
# The real-build adapter (needs TensorRT-LLM 1.2.x and a GPU; unverified on this machine)


def missing_build_requirements() -> str | None:
    """Why an engine cannot be built here, or None when TensorRT-LLM 1.2.x, trtllm-build and a CUDA GPU are."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return f"TensorRT-LLM {TRTLLM_VERSION} is not importable on this machine"
    found = installed_version("tensorrt_llm") or "unknown"
    if not found.startswith("1.2."):
        return (f"TensorRT-LLM {found} is installed, but trtpipe plans for {TRTLLM_VERSION} (later "
                "releases removed trtllm-build)")
    if shutil.which("trtllm-build") is None:
        return "TensorRT-LLM is importable but its trtllm-build command is not on PATH"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible on this machine"
    return None


def installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def gpu_description() -> dict:
    """The GPU trtllm-build will use (CUDA device 0, as CUDA_VISIBLE_DEVICES orders them)."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "sm": major * 10 + minor,
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory}


def check_gpu_is_the_target(plan: Plan) -> dict:
    """This machine's GPU, when it is the plan's target kind: engines only run on the SM they were built for."""
    gpu = gpu_description()
    if gpu["sm"] != plan.target.sm:
        raise UserError(f"this GPU ({gpu['name']}, sm_{gpu['sm']}) is not the plan's target {plan.target.name} "
                        f"(sm_{plan.target.sm}); TensorRT engines only run on the GPU kind they were built for. "
                        "Plan for this GPU (`trtpipe targets`) or build on the target")
    return gpu


def build_with_trtllm(command: list[str], tmp: Path, out: Path, plan: Plan, gpu: dict,
                      profiling_verbosity: str = DEFAULT_PROFILING_VERBOSITY) -> dict:
    """Run trtllm-build into `tmp` (the command names `out`, so it is rewritten) and check what it wrote.

    Raises EngineBuildFailed when it cannot be run, exits non-zero, leaves out a rank's engine or writes
    an engine config that disagrees with the plan (the builder overrides some settings silently). After a
    `detailed` build, each rank's engine is inspected (rankN.layers.json, the manifest's `inspection`); an
    inspection that cannot run is recorded and warned about, not a failed build.
    """
    argv = [str(tmp) if a == str(out) else str(tmp / Path(a).name) if a == str(out / BUILD_CONFIG_FILE) else a
            for a in command]
    try:
        code, log_lines = run_logged(argv, tmp)
    except OSError as exc:
        raise EngineBuildFailed(f"could not run {argv[0]}: {exc}") from None
    (tmp / "trtllm-build.log").write_text("".join(log_lines))
    tail = "".join(log_lines[-OUTPUT_TAIL_LINES:]).rstrip()
    if code != 0:
        raise EngineBuildFailed(f"trtllm-build exited with status {code}", tail)
    ranks = plan.tp_size * plan.pp_size
    absent = [f"rank{r}.engine" for r in range(ranks) if not (tmp / f"rank{r}.engine").is_file()]
    if absent:
        raise EngineBuildFailed(f"trtllm-build exited with status 0 but wrote no {', '.join(absent)}", tail)
    try:
        check_engine_config(tmp, plan)
    except UserError as exc:
        raise EngineBuildFailed(str(exc), tail) from None
    built = {"dry_run": False, "gpu": gpu,
             "versions": {name: installed_version(name) for name in ("tensorrt_llm", "tensorrt")}}
    if plan.build_config.weight_sparsity:
        layers = sparse_layers(log_lines)
        warning = layers.warning()
        if warning:
            print(warning, file=sys.stderr, flush=True)
        built["sparsity"] = {"pattern": plan.model.checkpoint_sparsity, **layers.to_dict(), "warning": warning}
    if profiling_verbosity == INSPECTED_VERBOSITY:
        built["inspection"] = inspect_engines(tmp, ranks)
    return built


def run_logged(argv: list[str], cwd: Path) -> tuple[int, list[str]]:
    """Run `argv`, echo its output (stdout and stderr interleaved, in order) to stderr; exit status and lines."""
    from rich.console import Console

    console = Console(stderr=True)
    lines = []
    with console.status(f"{Path(argv[0]).name}: building the engine") as status:
        # cwd: trtllm-build writes its timing cache (output_timing_cache 'model.cache') relative to it.
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        for line in proc.stdout:
            lines.append(line)
            console.print(line.rstrip(), markup=False, highlight=False)
            status.update(f"{Path(argv[0]).name}: {line.strip()[:100]}")
        code = proc.wait()
    return code, lines
