"""What a GPU build would do, said before it does anything: `trtpipe build MODEL --target GPU --dry-run`, the cost
line `--checkpoints-on-cpu` prints before it starts, and the numbers in the refusal of a GPU build without a GPU.

From the architecture alone (a preset, or a config.json): each stage as its own command, what it downloads and
writes, and how long it would take on this machine's CPU. The times are estimates scaled from what trtpipe measured
of its own stages at the real size (benchmarks/bench_scale.py on a 2-core machine; docs/usage.md, "At the real
size"), each with the basis it rests on:

- convert: a byte copy at the rate measured for the Llama-3-8B shape (14.96 GiB in 11.2 s; I/O, not cores);
- calibrate: GPTQ's work per decoder layer (one layer of Llama-3-8B's widths took 299 s with 4 x 128 tokens), scaled
  by the layer's GPTQ arithmetic (per fused linear, out x in^2 for the error feedback and in^3 for the inverse of its
  input's Hessian; for the benchmark's 1.1B shape this predicts 513 s, which measured 457 s), plus the tokens it
  runs through the model (the calibration samples for each observing pass and GPTQ's x^T x, which costs a forward
  pass again; the held-out documents before and after) at the rate eval measured (137 s for 637 tokens of the
  Llama-3-8B shape), scaled by parameters; both scaled from 2 cores to this machine's.

What runs on the GPU (compile, and deploy and validate after it) was never timed by trtpipe: it is not estimated.
Nothing here downloads, converts or writes anything.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .arch import ModelArch
from .model import family_of
from .model.arch_config import parameter_count
from .model.spec import dims
from .presets import PRESETS
from .sources import HUB_FILES, HUB_SKIP

if TYPE_CHECKING:
    from .plan import Plan

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
#: benchmarks/bench_scale.py: the shape it measured, on how many cores
MEASURED_SHAPE = "llama-3-8b"
MEASURED_CORES = 2
#: convert of that shape: 14.96 GiB of float16 tensors (a byte copy), 11.2 s (best of 2, page cache warm)
CONVERT_BYTES_PER_S = 14.96 * 2**30 / 11.2
#: calibrate --precision fp8 --samples 4 --seq-len 128 --eval-samples 0 of one decoder layer of its widths
GPTQ_LAYER_S = 299.0
#: eval of the whole shape on the first 4 held-out documents: 637 tokens (the benchmark's SmolLM2 tokenizer), 137 s
EVAL_TOKENS, EVAL_S = 637, 137.0
#: the held-out documents of a build's perplexity: the first 16 are 3185 tokens with SmolLM2's tokenizer
HELDOUT_TOKENS_PER_DOCUMENT = 200


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


def command_line(*words) -> str:
    return shlex.join(str(w) for w in words)


@dataclass(frozen=True)
class Step:
    """One stage of a build as its own command, and what it would cost on this machine."""

    stage: str
    command: str
    bytes: int = 0                  # what it downloads (download) or writes
    seconds: float | None = None    # estimated here; None: not estimated (`basis` says why)
    basis: str = ""                 # what the estimate rests on

    def cost(self) -> str:
        if self.stage.endswith("download"):
            return f"{self.bytes / 1e9:.1f} GB"
        return "-" if self.seconds is None else duration(self.seconds)


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class BuildPreview:
    """A build's stages in order (the ones before `plan` make the checkpoints), the plan it would make, and the
    trtllm-build line its compile runs (engine backends)."""

    plan: Plan
    steps: tuple[Step, ...]
    engine_command: str | None
    cores: int
    notes: tuple[str, ...] = ()

    @property
    def checkpoint_steps(self) -> tuple[Step, ...]:
        return self.steps[:[s.stage for s in self.steps].index("plan")]

    @property
    def download_bytes(self) -> int:
        return sum(s.bytes for s in self.steps if s.stage.endswith("download"))   # the draft's too

    def checkpoint_cost(self) -> str:
        """What making the checkpoints here costs: the download, then each stage's estimated time."""
        timed = [s for s in self.checkpoint_steps if not s.stage.endswith("download")]
        known = [s.seconds for s in timed if s.seconds is not None]
        parts = [f"download {self.download_bytes / 1e9:.1f} GB"] if self.download_bytes else []
        parts.append(f"about {duration(sum(known))} on this machine's {self.cores} cores: "
                     + ", ".join(f"{s.stage} {s.cost() if s.seconds is not None else 'not estimated'}" for s in timed))
        return ", then ".join(parts)

    def render(self) -> str:
        width = max(len(s.stage) for s in self.steps)
        costs = [s.cost() for s in self.steps]
        cost_width = max(len(c) for c in costs)
        lines = ["dry run: nothing was downloaded, converted or written. The build would run, in order:",
                 f"  {'stage':<{width}}  {'here':>{cost_width}}  command"]
        lines += [f"  {s.stage:<{width}}  {c:>{cost_width}}  {s.command}" for s, c in zip(self.steps, costs)]
        if self.engine_command:
            lines += ["engine build command (run it on the GPU machine):", "  " + self.engine_command]
        lines.append(plan_summary(self.plan))
        lines += [f"  plan warning: {w}" for w in self.plan.warnings]
        lines.append(f"estimates for this machine ({self.cores} cores; not measured here):")
        lines += [f"  {s.stage}: {s.basis}" for s in self.steps if s.basis]
        return "\n".join(lines + list(self.notes))

    def to_dict(self) -> dict:
        from .plan import plan_document

        return {"steps": [asdict(s) for s in self.steps], "engine_command": self.engine_command,
                "download_bytes": self.download_bytes, "cores": self.cores, "notes": list(self.notes),
                "plan": plan_document(self.plan)}


def plan_summary(plan: Plan) -> str:
    memory, gib = plan.memory, 2**30
    return (f"plan ({plan.backend} backend on {plan.target.name}, tp {plan.tp_size} pp {plan.pp_size}): "
            f"{plan.precision} weights ({plan.dtype}) {memory.weights_bytes_per_rank / gib:.2f} GiB per GPU, KV cache "
            f"{plan.kv_cache_dtype} {memory.kv_cache_bytes / gib:.2f} GiB ({memory.kv_cache_tokens} tokens), "
            f"max_batch_size {plan.triton.triton_max_batch_size}, {plan.max_concurrent_sequences} sequences of "
            f"{plan.workload.input_len}+{plan.workload.output_len} tokens at once, max_seq_len {plan.max_seq_len}")


# ---------------------------------------------------------------------------------------------------- the stages

def download_step(hub_id: str, arch: ModelArch) -> Step:
    """What `ModelSource.hf_dir` downloads from the hub: the files conversion reads."""
    params = parameter_count(arch)
    return Step("download", command_line("hf", "download", hub_id, "--include", *HUB_FILES, "--exclude", *HUB_SKIP),
                params * DTYPE_BYTES.get(arch.dtype, 2), None,
                f"{params / 1e9:.2f} B parameters in {arch.dtype} (its config's dtype), plus the tokenizer and "
                f"configs; its time is the network's")


def convert_step(command: str, arch: ModelArch, dtype: str, from_gguf: bool) -> Step:
    written = parameter_count(arch) * DTYPE_BYTES[dtype]
    if from_gguf:
        return Step("convert", command, written, None, "a GGUF is dequantized into the cache first: not measured at "
                                                       "this size")
    basis = (f"{written / 1e9:.1f} GB copied at {CONVERT_BYTES_PER_S / 1e9:.2f} GB/s, the rate of the "
             f"{MEASURED_SHAPE} shape's byte copy (14.96 GiB in 11.2 s)")
    if arch.dtype != dtype:
        basis += f"; this one casts {arch.dtype} to {dtype}, which is slower than a copy"
    return Step("convert", command, written, written / CONVERT_BYTES_PER_S, basis)


def calibrate_step(command: str, arch: ModelArch, precision: str, tokens: int, eval_documents: int,
                   cores: int) -> Step:
    """`tokens`: at most, the recipe's samples x seq_len; `eval_documents`: the held-out documents of the perplexity
    before and after."""
    reference = PRESETS[MEASURED_SHAPE].arch
    scale = MEASURED_CORES / cores
    gptq = arch.num_hidden_layers * GPTQ_LAYER_S * gptq_work(arch) / gptq_work(reference) * scale
    per_token = EVAL_S / EVAL_TOKENS * parameter_count(arch) / parameter_count(reference) * scale
    passes = 3 if precision == "int8-sq" else 2     # SmoothQuant's channel maxima, the statistics, GPTQ's x^T x
    heldout = 2 * eval_documents * HELDOUT_TOKENS_PER_DOCUMENT
    through = (tokens * passes + heldout) * per_token
    basis = (f"GPTQ {duration(gptq)} ({arch.num_hidden_layers} layers; one layer of {MEASURED_SHAPE}'s widths took "
             f"{GPTQ_LAYER_S:.0f} s, scaled by this layer's GPTQ arithmetic) + {duration(through)} running at most "
             f"{tokens} calibration tokens {passes} times and {eval_documents} held-out documents twice through the "
             f"model (eval of {MEASURED_SHAPE}: {EVAL_S:.0f} s for {EVAL_TOKENS} tokens, scaled by parameters); "
             f"measured on {MEASURED_CORES} cores, scaled to this machine's {cores}")
    return Step("calibrate", command, 0, gptq + through, basis)


def gptq_work(arch: ModelArch) -> int:
    """GPTQ's arithmetic for one decoder layer, up to a constant: for each linear as the family fuses it (one Hessian
    per input), out x in^2 to feed each column's error forward and in^3 to invert the Hessian."""
    sizes = dims(arch)
    return sum(lin.out_features(sizes) * sizes[lin.inputs] ** 2 + sizes[lin.inputs] ** 3
               for lin in family_of(arch.architecture).linears)
