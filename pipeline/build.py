"""`trtpipe build`: every stage in order, each skipped when its manifest shows unchanged inputs.

    OUT/checkpoint/               convert
    OUT/checkpoint-<precision>/   calibrate (fp8, int8-sq)
    OUT/plan.json                 plan
    OUT/engine/                   compile (GPU targets; --dry-run or no GPU: the command and build config)
    OUT/model_repo/               deploy
    OUT/validation/               validate (the embedded Triton for the cpu target, or --url)
    OUT/build.json                the summary: where everything is, sizes, times, the verdict
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .errors import UserError

QUANTIZED = ("fp8", "int8-sq")
FLOAT_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
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
    progress: bool = True


@dataclass
class StageRecord:
    stage: str
    path: str
    skipped: bool
    seconds: float
    detail: str = ""
    bytes: int = 0


@dataclass
class BuildSummary:
    options: dict
    stages: list[StageRecord] = field(default_factory=list)
    verdict: str = "not validated"
    passed: bool | None = None

    def to_dict(self) -> dict:
        return {"options": self.options, "stages": [asdict(s) for s in self.stages], "verdict": self.verdict,
                "passed": self.passed}

    def render(self) -> str:
        lines = [f"{'stage':<10} {'status':<9} {'time':>7} {'size':>10}  output"]
        for s in self.stages:
            status = "skipped" if s.skipped else "done"
            size = f"{s.bytes / 1e6:.1f} MB" if s.bytes else ""
            lines.append(f"{s.stage:<10} {status:<9} {s.seconds:>6.1f}s {size:>10}  {s.path}"
                         + (f"  ({s.detail})" if s.detail else ""))
        lines.append(f"validation: {self.verdict}")
        return "\n".join(lines)


def directory_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def build(options: BuildOptions, say: Callable[[str], None] = print) -> BuildSummary:
    """Run convert -> calibrate -> plan -> compile -> deploy -> validate for one model and target."""
    from .compile import compile_engine
    from .convert import convert_model
    from .plan import load_plan, make_plan, resolve_model_info, save_plan
    from .sources import resolve_model
    from .targets import get_target

    target = get_target(options.target)  # an unknown target fails before any work
    source = resolve_model(options.model, options.model_dir)
    out = Path(options.out)
    summary = BuildSummary(options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()})

    def record(stage: str, path: Path, started: float, skipped: bool, detail: str = "") -> None:
        rec = StageRecord(stage, str(path), skipped, time.monotonic() - started, detail, directory_bytes(path))
        summary.stages.append(rec)
        say(f"[{stage}] {'up to date' if skipped else 'done'} in {rec.seconds:.1f}s: {path}"
            + (f" ({detail})" if detail else ""))

    # Plan first from the architecture alone: an impossible plan stops the build before any conversion.
    make_plan(source.arch, target, options.precision, options.kv_cache)

    started = time.monotonic()
    dtype = checkpoint_dtype(options.precision, source.arch.dtype, target.is_gpu)
    converted = convert_model(source, out / "checkpoint", dtype=dtype, force=True, progress=options.progress)
    record("convert", converted.path, started, converted.skipped, f"{dtype}")
    checkpoint = converted.path

    if options.precision in QUANTIZED:
        started = time.monotonic()
        calibrated = run_calibration(checkpoint, out / f"checkpoint-{options.precision}", options)
        checkpoint = calibrated.path
        ppl = calibrated.perplexity
        detail = f"method {calibrated.method}" + (
            f", perplexity {ppl['float']:.2f} -> {ppl['quantized']:.2f}" if ppl else "")
        record("calibrate", checkpoint, started, calibrated.skipped, detail)

    started = time.monotonic()
    plan_path = out / "plan.json"
    plan = make_plan(resolve_model_info(str(checkpoint)), target, options.precision, options.kv_cache)
    previous = load_plan(plan_path).to_dict() if plan_path.is_file() else None
    unchanged = previous == plan.to_dict()
    if not unchanged:
        save_plan(plan, plan_path)
    record("plan", plan_path, started, unchanged, f"max_batch_size {plan.triton.triton_max_batch_size}")

    engine = None
    if target.is_gpu:
        started = time.monotonic()
        engine = out / "engine"
        try:
            compiled = compile_engine(checkpoint, load_plan(plan_path), engine, dry_run=options.dry_run, force=True)
        except UserError as exc:  # no GPU / TensorRT-LLM here: the command is written, carry on as a dry run
            if options.dry_run:
                raise
            say(f"[compile] {exc}")
            compiled = None
        if compiled is not None:
            record("compile", engine, started, compiled.skipped, "dry run" if compiled.dry_run else "engine built")
            if compiled.dry_run:
                say("engine build command (run it on the GPU machine):\n  " + " ".join(compiled.command))
        else:
            record("compile", engine, started, False, "not built here: no GPU / TensorRT-LLM")

    from .deploy import deploy_repository

    started = time.monotonic()
    repo = out / "model_repo"
    deployed = deploy_repository(plan_path, repo, engine=engine, checkpoint=checkpoint,
                                 force=True)
    record("deploy", repo, started, deployed.skipped, f"{deployed.target} target")

    if options.dry_run or (target.is_gpu and options.url is None):
        summary.verdict = ("not validated: dry run" if options.dry_run else
                           "not validated: serve the repository on the GPU machine and run "
                           f"`trtpipe validate {repo} --url URL`")
    else:
        golden = str(source.hf_dir())
        summary.passed, summary.verdict = run_validation(repo, out / "validation", golden, options, record)
    (out / "build.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def checkpoint_dtype(precision: str, model_dtype: str, gpu: bool) -> str:
    """The float dtype of the converted checkpoint.

    fp16/bf16/fp32 name it. Quantized precisions keep the model's own dtype for what stays unquantized
    on a GPU; the cpu target's reference runtime computes in float32, so there the checkpoint is float32.
    """
    if precision in FLOAT_DTYPES:
        return FLOAT_DTYPES[precision]
    return model_dtype if gpu else "float32"


def run_calibration(checkpoint: Path, out: Path, options: BuildOptions):
    from .calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe

    recipe = resolve_recipe(None, samples=options.calibration_samples)
    kv = options.kv_cache if options.kv_cache in ("fp8", "int8") else None
    return calibrate_checkpoint(checkpoint, out, CalibrateOptions(precision=options.precision, recipe=recipe,
                                                                  kv_cache=kv, eval_samples=BUILD_EVAL_SAMPLES,
                                                                  force=True, progress=options.progress))


def run_validation(repo: Path, out: Path, golden: str, options: BuildOptions, record) -> tuple[bool, str]:
    from .validate import ValidateOptions, reference_for, validate_repository

    started = time.monotonic()
    report = validate_repository(repo, out, ValidateOptions(golden=reference_for(repo, golden),
                                                            load_test=options.load_test), url=options.url)
    failed = [c.name for c in report.checks if not c.passed]
    record("validate", out, started, False, f"{len(report.checks) - len(failed)}/{len(report.checks)} checks passed")
    verdict = "passed" if report.passed else f"FAILED: {', '.join(failed)} (see {out / 'report.json'})"
    return report.passed, verdict
