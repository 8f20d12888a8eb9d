"""`trtpipe build`: every stage in order, each skipped when its manifest shows unchanged inputs.

    OUT/checkpoint/               convert
    OUT/checkpoint-sparse/        sparsify (--sparsity 2:4)
    OUT/checkpoint-sparse-kd/     distill (--distill-tokens N), from OUT/checkpoint/
    OUT/checkpoint-<precision>/   calibrate (fp8, int8-sq; with hf/ for the pytorch backend)
    OUT/hf/                       export (the pytorch backend at fp16/bf16, or a sparse build's golden reference:
                                  the float checkpoint as a HF model)
    OUT/plan.json                 plan
    OUT/engine/                   compile (the engine backend; with --checkpoints-on-cpu and --dry-run or no GPU:
                                  the command and build config)
    OUT/model_repo/               deploy
    OUT/validation/               validate (the embedded Triton for the reference backends, or --url)
    OUT/build.json                the summary: where everything is, sizes, times, the verdict

The backend (--backend, else the target's default; pipeline.backends) decides what is built between plan
and deploy, which checkpoint is deployed and whether the embedded server can validate. An engine backend's
repository is deployed only for an engine that was built (or, with --checkpoints-on-cpu --dry-run, as the preview
it asks for). When the engine is not built the build stops after compile, writes build.json and says why:
trtllm-build failed (exit 1, with its last lines), or (--checkpoints-on-cpu) this machine has no GPU / TensorRT-LLM
1.2.x (exit 2: the command is written; adding --dry-run asks for only that, exit 0).

A GPU target's checkpoints are made on the GPU machine. There, or anywhere, `--dry-run` answers from the
architecture alone (`preview_build`, pipeline.build_preview): the plan, each stage as its own command, the
download and each stage's estimated time on this machine; nothing is downloaded, converted or written. Without
what the build needs (a CUDA GPU; TensorRT-LLM 1.2.x for an engine) it stops with exit 2 before any of that,
naming what is missing, the dry run and `--checkpoints-on-cpu`: the explicit choice of downloading, converting
and calibrating on this machine's CPU, which says what that costs before it starts and then builds as above.

The pytorch backend (TensorRT-LLM's LLM API) has no compile stage: it serves a Hugging Face model, the
Hugging Face twin of the build's checkpoint (calibrate --format both for fp8, the `export` stage for
fp16/bf16, so a GGUF source is served dequantized in the plan's dtype), planned from the source model.
Nothing it builds needs TensorRT-LLM, so with --checkpoints-on-cpu it deploys on any machine; serving it needs a
GPU and TensorRT-LLM, so without --url nothing is served or validated and the verdict says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import TRTLLM_VERSION
from .backends.names import HF_CHECKPOINT
from .checkpoint import written_exclude_modules
from .compile import CompileStatus, not_built_here_message
from .errors import UserError
from .outputs import portable, write_atomic
from .plan.schema import Workload
from .plan.speculative import SpeculativeRequest, describe as describe_speculation
from .precisions import AUTO, FLOAT_DTYPES, KV_CACHE_QUANT_ALGO, QUANT_ALGO

if TYPE_CHECKING:
    from .build_preview import BuildPreview, Step
    from .plan.schema import ModelInfo, Plan

QUANTIZED = ("fp8", "int8-sq", "int4-awq")
#: an engine draft-target build's draft: its checkpoints' and its engine's directories in the build directory
DRAFT_CHECKPOINTS, DRAFT_ENGINE = "draft", "draft-engine"
#: Held-out documents for the before/after perplexity in a build's calibration report: fewer than
#: `trtpipe calibrate`'s 40, so the whole build of a small model stays within minutes on 2 cores.
BUILD_EVAL_SAMPLES = 16


@dataclass(frozen=True)
class BuildOptions:
    model: str
    target: str
    precision: str
    out: Path
    kv_cache: str = "auto"
    dry_run: bool = False
    url: str | None = None
    load_test: bool = False
    model_dir: Path | None = None
    calibration_samples: int | None = None
    device: str = "auto"          # where calibration and the golden reference run, a layer at a time
    progress: bool = True
    tp: int = 1
    pp: int = 1
    workload: Workload | None = None          # None: the plan's default workload
    calibration_dataset: str | None = None    # a calibration recipe name or dataset (None: the default recipe)
    backend: str | None = None                # None: the target's default (engine on GPUs, reference on cpu)
    runtime_image: str | None = None          # GPU targets: backends.runtime_images (None: the backend's default)
    sparsity: str | None = None               # "2:4": sparsify the converted checkpoint (None: dense)
    distill_tokens: int | None = None         # with sparsity: distill the sparse checkpoint on this many tokens
    checkpoints_on_cpu: bool = False          # a GPU target's checkpoints made on this machine's CPU, without a GPU
    speculative: SpeculativeRequest | None = None   # --speculative (plan/speculative.py)
    quantize_lm_head: bool = False            # int4-awq: calibrate lm_head to 4 bits too


@dataclass
class StageRecord:
    stage: str
    path: str
    skipped: bool
    seconds: float
    detail: str = ""
    bytes: int = 0
    status: str = ""   # done | skipped | not built | FAILED


@dataclass
class BuildSummary:
    options: dict
    stages: list[StageRecord] = field(default_factory=list)
    verdict: str = "not validated"
    passed: bool | None = None
    tool_output: str = ""   # the failing tool's last lines
    preview: BuildPreview | None = None   # a GPU target's dry run: what the build would do (no stage ran)

    def to_dict(self) -> dict:
        return {"options": self.options, "stages": [asdict(s) for s in self.stages], "verdict": self.verdict,
                "passed": self.passed, "tool_output": self.tool_output,
                **({"preview": self.preview.to_dict()} if self.preview else {})}

    def render(self) -> str:
        if self.preview is not None:
            return f"{self.preview.render()}\nvalidation: {self.verdict}"
        lines = [f"{'stage':<10} {'status':<9} {'time':>7} {'size':>10}  output"]
        for s in self.stages:
            size = f"{s.bytes / 1e6:.1f} MB" if s.bytes else ""
            lines.append(f"{s.stage:<10} {s.status:<9} {s.seconds:>6.1f}s {size:>10}  {s.path}"
                         + (f"  ({s.detail})" if s.detail else ""))
        lines.append(f"validation: {self.verdict}")
        if self.tool_output:
            lines += ["last lines of its output:", *("  " + line for line in self.tool_output.splitlines())]
        return "\n".join(lines)

    def save(self, out: Path) -> None:
        """OUT/build.json, its paths relative to OUT wherever the build ran from (it names nothing of this
        machine: see outputs.portable), and SUMMARY.md, the same for a person."""
        from .build_summary import summary_markdown

        record = self.to_dict()
        for stage in record["stages"]:
            stage["path"] = str(Path(stage["path"]).absolute())
        record["options"]["out"] = str(Path(out).absolute())
        record = portable(record, Path(out).absolute())
        write_atomic(out / "build.json", json.dumps(record, indent=2) + "\n")
        write_atomic(out / "SUMMARY.md", summary_markdown(record))


def same_plan(path: Path, plan) -> bool:
    """Whether plan.json at `path` is `plan`; one an older trtpipe wrote, which this one cannot read, is not."""
    from .plan import load_plan, plan_json

    try:
        return plan_json(load_plan(path), path.parent) == plan_json(plan, path.parent)
    except UserError:
        return False


def directory_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def build(options: BuildOptions, say: Callable[[str], None] = print) -> BuildSummary:
    """Run convert -> [sparsify -> distill] -> calibrate -> plan -> compile -> deploy -> validate for one model
    and target.

    Each stage's result goes to the next in memory; what is written (plan.json, the directories) is for
    people and for skipping unchanged stages on the next run.
    """
    from .backends import backend_serving, bls_draft_len
    from .deploy import deploy_repository
    from .plan.speculative_gpu import draft_build_plan
    from .plan import save_plan
    from .planner import make_plan
    from .sources import resolve_model
    from .targets import get_target

    check_compression(options)
    target = get_target(options.target)  # an unknown target or a backend that cannot serve it fails before any work
    backend = backend_serving(options.backend, target)
    options = checkpoints_here(options, target)
    source = resolve_model(options.model, options.model_dir)
    # Plan first from the architecture alone: an impossible plan stops the build before any conversion.
    planned = make_plan(source.arch, target, options.precision, options.kv_cache, tp=options.tp, pp=options.pp,
                        workload=options.workload, backend=backend.name, image=options.runtime_image,
                        speculative=options.speculative)
    if options.precision == AUTO:      # the precision the architecture's plan picks is the one built
        options = replace(options, precision=planned.precision)
        say(planned.warnings[0])
    check_lm_head(options, backend)
    out = Path(options.out)
    summary = BuildSummary(options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()})
    summary.options["backend"] = backend.name

    def record(stage: str, path: Path, started: float, skipped: bool, detail: str = "", status: str = "") -> None:
        status = status or ("skipped" if skipped else "done")
        rec = StageRecord(stage, str(path), skipped, time.monotonic() - started, detail, directory_bytes(path),
                          status)
        summary.stages.append(rec)
        say(f"[{stage}] {'up to date' if skipped else status} in {rec.seconds:.1f}s: {path}"
            + (f" ({detail})" if detail else ""))

    hf = backend.checkpoint_format == HF_CHECKPOINT

    dtype = backend.checkpoint_dtype(planned)
    if target.is_gpu and not options.checkpoints_on_cpu:
        if options.dry_run:
            summary.preview = preview_build(options, source, target, backend, dtype)
            summary.verdict = "not validated: dry run (nothing was downloaded, converted or written)"
            return summary
        refuse_without_gpu(options, source, target, backend, dtype)
    elif options.checkpoints_on_cpu:
        say("--checkpoints-on-cpu: making the checkpoints here on the CPU: "
            + preview_build(options, source, target, backend, dtype).checkpoint_cost()
            + " (estimates: --dry-run says what they rest on)")
    made = make_checkpoints(source, out, dtype, hf, options, record)
    checkpoint, served = made.checkpoint, made.served
    draft_checkpoint = (make_draft_checkpoint(planned, out, dtype, options, record)
                        if backend.builds_engine and bls_draft_len(planned) is not None else None)

    started = time.monotonic()
    plan_path = out / "plan.json"
    plan = make_plan(plan_model(hf, checkpoint, options), target, options.precision, options.kv_cache,
                     tp=options.tp, workload=options.workload, backend=backend.name, image=options.runtime_image,
                        speculative=options.speculative)
    unchanged = plan_path.is_file() and same_plan(plan_path, plan)
    if not unchanged:
        save_plan(plan, plan_path)
    record("plan", plan_path, started, unchanged, f"{plan.backend} backend, max_batch_size "
                                                  f"{plan.triton.triton_max_batch_size}"
           + (f"; {describe_speculation(plan.speculative)}" if plan.speculative else ""))

    engines = {}
    for stage, engine_dir in (("compile", out / "engine"), ("draft compile", out / DRAFT_ENGINE)):
        if stage == "draft compile" and draft_checkpoint is None:
            continue
        started = time.monotonic()
        stage_checkpoint = checkpoint if stage == "compile" else draft_checkpoint
        stage_plan = plan if stage == "compile" else draft_build_plan(plan, stage_checkpoint)
        compiled = backend.build_artifact(stage_checkpoint, stage_plan, engine_dir, dry_run=options.dry_run,
                                          force=True)
        if compiled is None:
            continue
        status = {CompileStatus.FAILED: "FAILED", CompileStatus.NOT_BUILT_HERE: "not built"}.get(compiled.status, "")
        record(stage, engine_dir, started, compiled.skipped, compiled.describe(), status)
        what = "engine" if stage == "compile" else "draft engine"
        if compiled.dry_run:
            say(f"{what} build command (run it on the GPU machine):\n  " + compiled.shell_command)
        if compiled.status is CompileStatus.FAILED:
            summary.passed, summary.tool_output = False, compiled.output_tail
            summary.verdict = f"not validated: the {what} build failed ({compiled.reason}); nothing deployed"
            summary.save(out)
            return summary
        if compiled.status is CompileStatus.NOT_BUILT_HERE:
            summary.verdict = f"not validated: the {what} was not built here ({compiled.reason}); nothing deployed"
            summary.save(out)
            raise UserError(f"{not_built_here_message(compiled, plan)}. The build stopped before deploy (there "
                            "is no engine to serve); with --checkpoints-on-cpu, --dry-run stops there with exit 0")
        engines[stage] = compiled.engine_dir
    engine = engines.get("compile")

    started = time.monotonic()
    repo = out / "model_repo"
    deployed = deploy_repository(plan, repo, engine=engine, checkpoint=served, force=True,
                                 model=served_model(source, made, out), draft_engine=engines.get("draft compile"))
    record("deploy", repo, started, deployed.skipped, f"{deployed.target} target, {backend.name} backend")

    if options.dry_run or (not backend.serves_embedded and options.url is None):
        summary.verdict = "not validated: dry run" if options.dry_run else not_served_verdict(backend, repo)
    else:
        from .validate import golden_reference

        golden = golden_reference(str(made.golden or source.hf_dir()), precision=plan.precision,
                                  weights_dtype=dtype, device=options.device)
        summary.passed, summary.verdict = run_validation(repo, out / "validation", golden, options, record)
    summary.save(out)
    return summary


def make_draft_checkpoint(plan: Plan, out: Path, dtype: str, options: BuildOptions, record) -> Path:
    """An engine draft-target plan's draft as a TensorRT-LLM checkpoint at the plan's precision: a checkpoint named
    as the draft is used as it is (compile --draft checks it); a preset or Hugging Face model is converted, and
    calibrated at a quantized precision, into OUT/draft/ (`make_checkpoints`, its stages recorded as draft ...)."""
    from .plan import resolve_model_info
    from .sources import resolve_model

    name = plan.speculative.draft_model
    if resolve_model_info(name).source == "checkpoint":
        return Path(name)
    return make_checkpoints(resolve_model(name), out / DRAFT_CHECKPOINTS, dtype, False, draft_options(options, name),
                            lambda stage, *rest: record(f"draft {stage}", *rest)).checkpoint


def draft_options(options: BuildOptions, name: str) -> BuildOptions:
    """The build options the draft's checkpoints are made with: the build's precision, calibration and parallelism,
    the draft's model, dense and speculating nothing."""
    return replace(options, model=name, model_dir=None, sparsity=None, distill_tokens=None, quantize_lm_head=False,
                   speculative=None)


@dataclass(frozen=True)
class Checkpoints:
    """What convert, calibrate and export made: the TensorRT-LLM checkpoint (planned, compiled, served by the
    reference runtime) and the directory deploy serves (that checkpoint, or its Hugging Face twin)."""

    checkpoint: Path
    served: Path
    golden: Path | None = None      # the model validation compares with, when not the source (a sparse build's)


def make_checkpoints(source, out: Path, dtype: str, hf: bool, options: BuildOptions, record) -> Checkpoints:
    """convert, sparsify and distill (with --sparsity), then calibrate (quantized precisions, with the Hugging
    Face FP8 export when `hf`), or export the float checkpoint as a Hugging Face model (`hf` at fp16/bf16/fp32).
    A sparse build's golden reference is its own sparse float model (exported), not the dense source."""
    from .calibrate.hf_export import export_float_checkpoint
    from .calibrate.stage import HF_DIR
    from .convert import convert_model

    started = time.monotonic()
    converted = convert_model(source, out / "checkpoint", dtype=dtype, tp=options.tp, pp=options.pp, force=True,
                              progress=options.progress)
    record("convert", converted.path, started, converted.skipped, f"{dtype}")
    float_ckpt = compress(converted.path, out, options, record)
    golden = None
    if float_ckpt != converted.path:
        started = time.monotonic()
        golden = export_float_checkpoint(float_ckpt, out / "hf", force=True)
        record("export", golden.path, started, golden.skipped, f"the {options.sparsity} sparse {dtype} model as a "
                                                                "Hugging Face model (the golden reference)")
        golden = golden.path
    if options.precision in QUANTIZED:
        started = time.monotonic()
        calibrated = run_calibration(float_ckpt, out / f"checkpoint-{options.precision}", options, hf_export=hf)
        ppl = calibrated.perplexity
        detail = f"method {calibrated.method}" + (
            f", perplexity {ppl['float']:.2f} -> {ppl['quantized']:.2f}" if ppl else "")
        detail += f"; the Hugging Face FP8 checkpoint in {HF_DIR}/" if hf else ""
        record("calibrate", calibrated.path, started, calibrated.skipped, detail)
        return Checkpoints(calibrated.path, calibrated.path / HF_DIR if hf else calibrated.path, golden)
    if not hf:
        return Checkpoints(float_ckpt, float_ckpt, golden)
    if golden is not None:
        return Checkpoints(float_ckpt, golden, golden)
    started = time.monotonic()
    exported = export_float_checkpoint(converted.path, out / "hf", force=True)
    record("export", exported.path, started, exported.skipped, f"{dtype} Hugging Face model")
    return Checkpoints(converted.path, exported.path)


def check_lm_head(options: BuildOptions, backend) -> None:
    """--quantize-lm-head: an int4-awq build whose served checkpoint is TensorRT-LLM's (the Hugging Face checkpoints
    the pytorch backends load keep lm_head 16-bit)."""
    from .calibrate.stage import check_lm_head_precision

    if not options.quantize_lm_head:
        return
    check_lm_head_precision(options.precision)
    if backend.checkpoint_format == HF_CHECKPOINT:
        raise UserError(f"--quantize-lm-head: the {backend.name} backend serves a Hugging Face checkpoint, whose "
                        "lm_head trtpipe writes in 16 bits; use the engine or reference backends, or drop the flag")


def check_compression(options: BuildOptions) -> None:
    """--sparsity and --distill-tokens, before any work."""
    from .sparsity.pattern import check_pattern_name

    if options.sparsity is not None:
        check_pattern_name(options.sparsity)
    if options.distill_tokens is not None:
        if options.sparsity is None:
            raise UserError("--distill-tokens recovers what --sparsity 2:4 costs: give both (for quantization-aware "
                            "training of a dense model run `trtpipe distill` on the calibrated checkpoint)")
        if options.distill_tokens <= 0:
            raise UserError(f"--distill-tokens must be positive (got {options.distill_tokens})")


def compress(checkpoint: Path, out: Path, options: BuildOptions, record) -> Path:
    """sparsify (OUT/checkpoint-sparse) and distill from the dense checkpoint (OUT/checkpoint-sparse-kd) when asked;
    the float checkpoint the rest of the build quantizes or serves."""
    if options.sparsity is None:
        return checkpoint
    from dataclasses import replace

    from .calibrate import resolve_recipe
    from .distill.stage import DistillOptions, distill_checkpoint
    from .sparsity.stage import SparsifyOptions, sparsify_checkpoint

    recipe = resolve_recipe(options.calibration_dataset, samples=options.calibration_samples)
    started = time.monotonic()
    sparse = sparsify_checkpoint(checkpoint, out / "checkpoint-sparse", SparsifyOptions(
        recipe=recipe, pattern=options.sparsity, eval_samples=BUILD_EVAL_SAMPLES, device=options.device, force=True,
        progress=options.progress))
    ppl = sparse.perplexity
    record("sparsify", sparse.path, started, sparse.skipped, f"{options.sparsity} {sparse.claim.method}" + (
        f", perplexity {ppl['dense']:.2f} -> {ppl['sparse']:.2f}" if ppl else ""))
    if options.distill_tokens is None:
        return sparse.path
    started = time.monotonic()
    distilled = distill_checkpoint(sparse.path, out / "checkpoint-sparse-kd", DistillOptions(
        teacher=checkpoint, recipe=replace(recipe, samples=0), tokens=options.distill_tokens,
        eval_samples=BUILD_EVAL_SAMPLES, force=True, progress=options.progress))
    ppl = distilled.perplexity
    record("distill", distilled.path, started, distilled.skipped, f"{distilled.tokens_seen} tokens" + (
        f", perplexity {ppl['before']:.2f} -> {ppl['after']:.2f} (dense {ppl['teacher']:.2f})" if ppl else ""))
    return distilled.path


def served_model(source, made: Checkpoints, out: Path) -> str | None:
    """The model the build's repository serves, as its deployment records it for `trtpipe validate REPO`'s golden
    check (the comparison the build's own validate makes): a sparse build's own float model, else the source as
    named (a preset or hub id) or its local directory or GGUF file. None for a path the manifest could only record
    as this machine's (outside the build and the home directory): validate then asks for --golden."""
    if made.golden is not None:
        return str(made.golden)
    if source.path is None or not Path(source.spec).expanduser().exists():
        return source.spec
    recorded = portable(str(source.path), out)
    return None if Path(recorded).is_absolute() else str(source.path)


def plan_model(hf: bool, checkpoint: Path, options: BuildOptions):
    """What the plan is made from: the checkpoint the engine or reference runtime serves; for a backend that
    serves the Hugging Face model (pytorch), the source model (the plan and the golden reference name it)."""
    from .plan import resolve_model_info

    return resolve_model_info(options.model, options.model_dir) if hf else resolve_model_info(str(checkpoint))


def not_served_verdict(backend, repo: Path) -> str:
    """The verdict of a build whose repository this machine cannot serve, saying what did not run."""
    verdict = f"not validated: serve the repository on the GPU machine and run `trtpipe validate {repo} --url URL`"
    if backend.checkpoint_format == HF_CHECKPOINT:
        verdict += (f" (nothing was served here: the {backend.name} backend needs a GPU and TensorRT-LLM "
                    f"{TRTLLM_VERSION}'s LLM API, in NVIDIA's Triton container: tritonserver on {repo.name}/ or "
                    f"{repo.name}/trtllm-serve.sh)")
    return verdict


def run_calibration(checkpoint: Path, out: Path, options: BuildOptions, hf_export: bool = False):
    from .calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe

    recipe = resolve_recipe(options.calibration_dataset, samples=options.calibration_samples)
    return calibrate_checkpoint(checkpoint, out, CalibrateOptions(precision=options.precision, recipe=recipe,
                                                                  kv_cache=calibrated_kv_cache(options),
                                                                  eval_samples=BUILD_EVAL_SAMPLES,
                                                                  device=options.device,
                                                                  format="both" if hf_export else "trtllm",
                                                                  quantize_lm_head=options.quantize_lm_head,
                                                                  force=True, progress=options.progress))


def run_validation(repo: Path, out: Path, golden, options: BuildOptions, record) -> tuple[bool, str]:
    from .validate import ValidateOptions, validate_repository

    started = time.monotonic()
    report = validate_repository(repo, out, ValidateOptions(golden=golden, load_test=options.load_test),
                                 url=options.url)
    failed = [c.name for c in report.checks if c.failed]
    passed = sum(c.passed for c in report.checks)
    record("validate", out, started, False, f"{passed}/{len(report.checks)} checks passed")
    verdict = "passed" if report.passed else f"FAILED: {', '.join(failed)} (see {out / 'report.json'})"
    return report.passed, verdict


def calibrated_kv_cache(options: BuildOptions) -> str | None:
    """The KV-cache quantization calibrate gives the build's checkpoint: the one --kv-cache names, and for auto the
    one `trtpipe plan` resolves with the same flags (fp8 for fp8 weights and int8 for int8-sq on a GPU; none on
    the cpu target, whose runtime stores a float32 cache), so plan and build agree."""
    from .plan.policy import resolve_kv_cache_dtype
    from .targets import get_target

    kv = options.kv_cache
    if kv == "auto":
        kv = resolve_kv_cache_dtype(kv, options.precision, "", target=get_target(options.target))
    return kv if kv in KV_CACHE_QUANT_ALGO else None


# ------------------------------------------------------------------------- a GPU target: where its checkpoints are made

def checkpoints_here(options: BuildOptions, target) -> BuildOptions:
    """--checkpoints-on-cpu, checked: a GPU target's checkpoints (and its golden reference) made on this CPU."""
    if not options.checkpoints_on_cpu:
        return options
    if not target.is_gpu:
        raise UserError("--checkpoints-on-cpu is for GPU targets: a cpu target's build makes everything here")
    if options.device == "cuda":
        raise UserError("--checkpoints-on-cpu makes the checkpoints on the CPU: drop --device cuda")
    return replace(options, device="cpu")


def missing_here(backend) -> str | None:
    """What this machine lacks to build for a GPU target: compile's requirements (TensorRT-LLM 1.2.x, trtllm-build, a
    CUDA GPU) for a backend that builds an engine, a CUDA GPU to calibrate on for the others; None: nothing."""
    if backend.builds_engine:
        from .compile import missing_build_requirements

        return missing_build_requirements()
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU is visible on this machine"


def refuse_without_gpu(options: BuildOptions, source, target, backend, dtype: str) -> None:
    """A GPU target's build on a machine that cannot make it: exit 2 before anything is downloaded or written, naming
    what is missing and the two other ways (the dry run, the checkpoints on this CPU with what they cost)."""
    from .build_preview import command_line

    missing = missing_here(backend)
    if missing is None:
        return
    cost = preview_build(options, source, target, backend, dtype).checkpoint_cost()
    again = command_line("trtpipe", "build", options.model, "--target", options.target, "--precision",
                         options.precision, *plan_flags(options, True), *data_flags(options),
                         *(["--quantize-lm-head"] if options.quantize_lm_head else []))
    raise UserError(f"{missing}: a build for {target.name} makes its checkpoints"
                    + (" and its engine" if backend.builds_engine else "") + " on the GPU machine, so nothing was "
                    f"downloaded or written. Build on the {target.name} GPU machine inside the trtpipe container "
                    f"(docker run --gpus all -v $PWD:/work -w /work trtpipe {again}); see what it would do with "
                    f"--dry-run; or make the checkpoints here on the CPU with --checkpoints-on-cpu ({cost})")


def preview_build(options: BuildOptions, source, target, backend, dtype: str) -> BuildPreview:
    """What the build of `options` would do, from the architecture alone: each stage as its own command with its cost
    on this machine (pipeline.build_preview), the plan it would make and its compile's trtllm-build line. Nothing is
    downloaded, converted or written."""
    from .build_preview import BuildPreview, Step, command_line, host_cores
    from .compile import BUILD_CONFIG_FILE, trtllm_build_command
    from .planner import make_plan

    out, cores = Path(options.out), host_cores()
    hf = backend.checkpoint_format == HF_CHECKPOINT
    steps, checkpoint, served = checkpoint_steps(options, source, out, dtype, hf, cores)
    draft = draft_checkpoint_steps(options, out, dtype, cores, steps) if backend.builds_engine else None
    started = time.monotonic()
    plan = make_plan(expected_model(options, source, checkpoint, dtype, hf), target, options.precision,
                     options.kv_cache, tp=options.tp, workload=options.workload, backend=backend.name,
                     image=options.runtime_image, speculative=options.speculative)
    plan_path, engine, repo = out / "plan.json", out / "engine", out / "model_repo"
    steps.append(Step("plan", command_line("trtpipe", "plan", options.model if hf else checkpoint, "--target",
                                           options.target, "--precision", options.precision,
                                           *plan_flags(options, hf), "-o", plan_path),
                      seconds=time.monotonic() - started, basis="planned now: the `plan` line"))
    engine_command = None
    if backend.builds_engine:
        steps.append(Step("compile", command_line("trtpipe", "compile", checkpoint, "--plan", plan_path, "-o", engine,
                                                  "--force"),
                          basis="trtllm-build on the GPU: never timed by trtpipe, so not estimated"))
        engine_command = command_line(*trtllm_build_command(plan, checkpoint.absolute(), engine.absolute(),
                                                            engine.absolute() / BUILD_CONFIG_FILE))   # as compile
    if draft is not None:
        steps.append(Step("draft compile", command_line("trtpipe", "compile", draft, "--plan", plan_path, "--draft",
                                                        "-o", out / DRAFT_ENGINE, "--force"),
                          basis="trtllm-build on the GPU: never timed by trtpipe, so not estimated"))
    steps.append(Step("deploy", command_line("trtpipe", "deploy", *(["--engine", engine] if engine_command else []),
                                             *(["--draft-engine", out / DRAFT_ENGINE] if draft else []),
                                             "--checkpoint", served, "--plan", plan_path, "-o", repo, "--force")))
    steps.append(Step("validate", command_line("trtpipe", "validate", repo, "--url", options.url or "URL",
                                               *(["--load-test"] if options.load_test else [])),
                      basis="against the repository served on the GPU machine: not estimated"))
    again = command_line("trtpipe", "build", options.model, "--target", options.target, "--precision",
                         options.precision, *plan_flags(options, True), *data_flags(options),
                         *(["--quantize-lm-head"] if options.quantize_lm_head else []))
    preview = BuildPreview(plan, tuple(steps), engine_command, cores)
    return replace(preview, notes=(
        f"to build: `{again}` on the {target.name} GPU machine, inside the trtpipe container; to make the "
        f"checkpoints here on the CPU instead, add --checkpoints-on-cpu ({preview.checkpoint_cost()})",))


def draft_checkpoint_steps(options: BuildOptions, out: Path, dtype: str, cores: int, steps: list) -> Path | None:
    """An engine draft-target build's draft checkpoint (`make_draft_checkpoint`), its stages added to `steps` as
    commands (draft ...); None when the build does not draft through the BLS."""
    from .plan import resolve_model_info
    from .sources import resolve_model

    request = options.speculative
    if request is None or request.draft_model is None:
        return None
    name = request.draft_model
    if resolve_model_info(name).source == "checkpoint":
        return Path(name)
    made, checkpoint, _ = checkpoint_steps(draft_options(options, name), resolve_model(name), out / DRAFT_CHECKPOINTS,
                                           dtype, False, cores)
    steps += [replace(step, stage=f"draft {step.stage}") for step in made]
    return checkpoint


def checkpoint_steps(options: BuildOptions, source, out: Path, dtype: str, hf: bool,
                     cores: int) -> tuple[list[Step], Path, Path]:
    """The stages that make the build's checkpoints (`make_checkpoints`' order and directories) as commands with their
    cost here; the checkpoint the plan is made from, and the directory deploy serves."""
    from .build_preview import Step, calibrate_step, command_line, convert_step, download_step
    from .calibrate import resolve_recipe
    from .calibrate.stage import HF_DIR

    steps = [download_step(source.hub_id, source.arch)] if needs_download(source) else []
    converted = out / "checkpoint"
    precision = next(name for name, float_dtype in FLOAT_DTYPES.items() if float_dtype == dtype)
    steps.append(convert_step(command_line("trtpipe", "convert", options.model, "-o", converted, "--precision",
                                           precision, *parallel_flags(options), *model_dir_flags(options), "--force"),
                              source.arch, dtype, source.kind == "gguf"))
    not_exported = "(no command of its own: trtpipe build exports the float checkpoint as a Hugging Face model)"
    float_ckpt, golden = compression_steps(options, converted, out, steps), None
    if float_ckpt != converted:
        golden = out / "hf"
        steps.append(Step("export", not_exported))
    if options.precision in QUANTIZED:
        calibrated = out / f"checkpoint-{options.precision}"
        recipe = resolve_recipe(options.calibration_dataset, samples=options.calibration_samples)
        kv = calibrated_kv_cache(options)
        steps.append(calibrate_step(command_line(
            "trtpipe", "calibrate", float_ckpt, "-o", calibrated, "--precision", options.precision,
            *(["--kv-cache", kv] if kv else []), *data_flags(options), "--eval-samples", BUILD_EVAL_SAMPLES,
            *device_flags(options), *(["--format", "both"] if hf else []),
            *(["--quantize-lm-head"] if options.quantize_lm_head else []), "--force"),
            source.arch, options.precision, recipe.samples * recipe.seq_len, BUILD_EVAL_SAMPLES, cores))
        return steps, calibrated, calibrated / HF_DIR if hf else calibrated
    if not hf or golden is not None:
        return steps, float_ckpt, golden or float_ckpt
    steps.append(Step("export", not_exported))
    return steps, converted, out / "hf"


def compression_steps(options: BuildOptions, converted: Path, out: Path, steps: list) -> Path:
    """sparsify and distill as `compress` runs them, appended to `steps`; the float checkpoint they leave."""
    from .build_preview import Step, command_line

    if options.sparsity is None:
        return converted
    unmeasured = "not estimated: trtpipe has no measurement of it at this size"
    sparse = out / "checkpoint-sparse"
    steps.append(Step("sparsify", command_line(
        "trtpipe", "sparsify", converted, "-o", sparse, "--pattern", options.sparsity, *data_flags(options),
        "--eval-samples", BUILD_EVAL_SAMPLES, *device_flags(options), "--force"), basis=unmeasured))
    if options.distill_tokens is None:
        return sparse
    distilled = out / "checkpoint-sparse-kd"
    steps.append(Step("distill", command_line(
        "trtpipe", "distill", sparse, "-o", distilled, "--teacher", converted, "--tokens", options.distill_tokens,
        *(["--dataset", options.calibration_dataset] if options.calibration_dataset else []),
        "--eval-samples", BUILD_EVAL_SAMPLES, "--force"), basis=unmeasured))
    return distilled


def needs_download(source) -> bool:
    """Whether making the checkpoints downloads the model: a preset or hub id whose weights are not here."""
    from .sources import cached_model

    return source.hub_id is not None and (source.kind != "hub" or cached_model(source.hub_id) is None)


def expected_model(options: BuildOptions, source, checkpoint: Path, dtype: str, hf: bool) -> ModelInfo:
    """What the build's plan is made from (`plan_model`), before it exists: for a backend that serves the Hugging Face
    model, the source; else the TensorRT-LLM checkpoint the build would make, as `resolve_model_info` reads it (the
    source's architecture in the checkpoint's dtype, quantized as calibrate quantizes it)."""
    from .plan.schema import ModelInfo

    if hf:
        return ModelInfo(name=options.model, source=source.kind, path=str(source.path) if source.path else None,
                         arch=source.arch)
    quantization = {"quant_algo": QUANT_ALGO.get(options.precision),
                    "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO.get(calibrated_kv_cache(options))}
    if options.precision in QUANTIZED:
        quantization["exclude_modules"] = written_exclude_modules(options.quantize_lm_head)
    return ModelInfo(name=str(checkpoint), source="checkpoint", path=str(checkpoint.resolve()),
                     arch=replace(source.arch, dtype=dtype), checkpoint_quantization=quantization,
                     checkpoint_tp_size=options.tp, checkpoint_pp_size=options.pp,
                     checkpoint_sparsity=options.sparsity,
                     source_model=None if options.sparsity else source.reference)


def parallel_flags(options: BuildOptions) -> list:
    return [*(["--tp", options.tp] if options.tp != 1 else []), *(["--pp", options.pp] if options.pp != 1 else [])]


def model_dir_flags(options: BuildOptions) -> list:
    return ["--model-dir", options.model_dir] if options.model_dir else []


def data_flags(options: BuildOptions) -> list:
    return [*(["--dataset", options.calibration_dataset] if options.calibration_dataset else []),
            *(["--samples", options.calibration_samples] if options.calibration_samples else [])]


def device_flags(options: BuildOptions) -> list:
    return ["--device", options.device] if options.device != "auto" else []


def plan_flags(options: BuildOptions, hf: bool) -> list:
    """`trtpipe plan`'s flags for the build's own plan: its KV cache, tp, workload, backend and runtime image."""
    workload, default = options.workload or Workload(), Workload()
    flags = [*(["--kv-cache", options.kv_cache] if options.kv_cache != "auto" else []),
             *(["--tp", options.tp] if options.tp != 1 else [])]
    for name, flag in (("input_len", "--input-len"), ("output_len", "--output-len"), ("max_context", "--max-context"),
                       ("concurrency", "--concurrency"), ("p99_latency_s", "--p99-latency")):
        if getattr(workload, name) != getattr(default, name):
            flags += [flag, getattr(workload, name)]
    return (flags + (["--backend", options.backend] if options.backend else [])
            + (["--runtime-image", options.runtime_image] if options.runtime_image else [])
            + speculative_flags(options.speculative) + (model_dir_flags(options) if hf else []))


def speculative_flags(request: SpeculativeRequest | None) -> list:
    if request is None:
        return []
    return (["--speculative", request.to_flags()] + (["--draft-len", request.draft_len] if request.draft_len else [])
            + (["--acceptance", request.acceptance] if request.acceptance is not None else [])
            + (["--drafts-per-step", request.drafts_per_step] if request.drafts_per_step is not None else []))
