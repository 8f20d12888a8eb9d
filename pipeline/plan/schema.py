"""The plan's schema: its inputs (workload, overrides, model) and outputs, and plan.json itself.

Output field names are TensorRT-LLM 1.2.1 / tensorrtllm_backend names where one exists, so plan.json
reads like the upstream configuration it becomes (`document.save_plan` writes it); `load_plan` reads it
back and turns anything that is not a plan into one clear message.

`Plan.backend` names what serves the model (`pipeline.backends`: "engine" or "reference"); every stage
after planning dispatches on it. Plans written before it was recorded get it from their target: the cpu
target's reference runtime, an engine on any other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..arch import ModelArch
from ..backends.names import NAMES
from ..checkpoint import CheckpointConfig, quantizes_lm_head, source_model
from ..errors import UserError
from ..outputs import recorded_path
from ..targets import Target
from .performance import Performance
from .trtllm import TOKENS_PER_BLOCK, OptimizationProfile, model_context_limit

PLAN_VERSION = 1
#: The longest context planned when the workload names none: every sequence's KV cache is sized for it.
DEFAULT_MAX_CONTEXT = 8192


# ----------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Workload:
    """What the deployment should serve: typical lengths, the longest context, the concurrency."""

    input_len: int = 1024
    output_len: int = 256
    max_context: int | None = None      # default: min(model context, 8192)
    concurrency: int | None = None      # default: as many sequences as the KV cache holds
    p99_latency_s: float | None = None  # optional end-to-end budget for one request

    def validate(self) -> None:
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_context is not None and self.max_context < 2:
            raise UserError("--max-context must be at least 2")
        if self.concurrency is not None and self.concurrency < 1:
            raise UserError("--concurrency must be at least 1")
        if self.p99_latency_s is not None and self.p99_latency_s <= 0:
            raise UserError("--p99-latency must be a positive number of seconds")

    def context_for(self, arch: ModelArch) -> int:
        """The longest prompt + output to plan for: max_context, by default the model's context capped at
        DEFAULT_MAX_CONTEXT (a longer one costs KV cache and runtime buffers for every sequence)."""
        return self.max_context or min(model_context_limit(arch), DEFAULT_MAX_CONTEXT)


@dataclass(frozen=True)
class Overrides:
    """Values a user pins instead of letting the planner choose; contradictions are errors."""

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    opt_num_tokens: int | None = None
    multiple_profiles: bool | None = None
    use_paged_context_fmha: bool | None = None
    enable_kv_cache_reuse: bool | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    batch_scheduler_policy: str | None = None
    priority_levels: int | None = None           # Triton's dynamic_batching priority_levels (1 is the highest)
    default_priority_level: int | None = None


@dataclass(frozen=True)
class ModelInfo:
    """The model a plan is for: how the user named it and its architecture numbers."""

    name: str
    source: str                  # "preset" | "hf-dir" | "gguf" | "checkpoint"
    path: str | None
    arch: ModelArch
    checkpoint_quantization: dict | None = None   # a checkpoint's config.json `quantization`
    checkpoint_tp_size: int | None = None
    checkpoint_pp_size: int | None = None
    checkpoint_sparsity: str | None = None        # a checkpoint's 2:4 claim (its pattern), None: dense
    source_model: str | None = None   # the model a checkpoint was made from (`checkpoint.source_model`), if known
    #: a Hugging Face model's config.json `quantization_config` (a pre-quantized upload), None: float weights
    source_quantization: dict | None = None

    @property
    def quantized_lm_head(self) -> bool:
        """A checkpoint whose lm_head is 4-bit (`calibrate --quantize-lm-head`)."""
        return self.checkpoint_quantization is not None and quantizes_lm_head(self.checkpoint_quantization)

    @property
    def reference(self) -> str | None:
        """What validate's golden reference loads: the model as named, or the model the checkpoint came from."""
        if self.source == "checkpoint":
            return self.source_model
        return None if self.source == "arch" else (self.path or self.name)

    def to_dict(self) -> dict:
        d = {"name": self.name, "source": self.source, "path": self.path, **self.arch.to_dict()}
        if self.source == "checkpoint":
            d["checkpoint_quantization"] = self.checkpoint_quantization
            d["checkpoint_tp_size"] = self.checkpoint_tp_size
            d["checkpoint_pp_size"] = self.checkpoint_pp_size
            d["checkpoint_sparsity"] = self.checkpoint_sparsity
            d["source_model"] = self.source_model
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelInfo:
        arch_keys = {f.name for f in fields(ModelArch)}
        return cls(name=d["name"], source=d["source"], path=d.get("path"),
                   arch=ModelArch(**{k: v for k, v in d.items() if k in arch_keys}),
                   checkpoint_quantization=d.get("checkpoint_quantization"),
                   checkpoint_tp_size=d.get("checkpoint_tp_size"),
                   checkpoint_pp_size=d.get("checkpoint_pp_size"),
                   checkpoint_sparsity=d.get("checkpoint_sparsity"), source_model=d.get("source_model"))


# ----------------------------------------------------------------------------------------------
# Outputs (field names are TensorRT-LLM 1.2.1 / tensorrtllm_backend names where one exists)


@dataclass
class BuildConfig:
    """The subset of TensorRT-LLM 1.2.1 `BuildConfig` fields trtpipe sets (same names)."""

    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    max_beam_width: int
    max_num_tokens: int
    opt_num_tokens: int | None
    opt_batch_size: int = 8           # upstream default; build() does not pass it to prepare_inputs
    max_prompt_embedding_table_size: int = 0
    kv_cache_type: str = "PAGED"
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    strongly_typed: bool = True
    force_num_profiles: int | None = None
    max_draft_len: int = 0
    use_refit: bool = False
    weight_sparsity: bool = False
    weight_streaming: bool = False
    use_strip_plan: bool = False


@dataclass
class PluginConfig:
    """TensorRT-LLM 1.2.1 `PluginConfig` fields trtpipe sets (values as the pydantic model takes them)."""

    dtype: str
    gpt_attention_plugin: str | None = "auto"
    gemm_plugin: str | None = None
    nccl_plugin: str | None = None
    context_fmha: bool = True
    remove_input_padding: bool = True
    paged_kv_cache: bool = True
    tokens_per_block: int = TOKENS_PER_BLOCK
    use_paged_context_fmha: bool = True
    use_fp8_context_fmha: bool = False
    multiple_profiles: bool = False
    use_fused_mlp: bool = True
    reduce_fusion: bool = False
    gemm_swiglu_plugin: str | None = None
    low_latency_gemm_plugin: str | None = None
    streamingllm: bool = False


@dataclass
class TritonParams:
    """Parameters of the Triton models, named as the tensorrt_llm model's config.pbtxt placeholders."""

    triton_backend: str                       # the backend's: "tensorrtllm" (engine) | "python" (reference)
    triton_max_batch_size: int
    decoupled_mode: bool
    max_queue_delay_microseconds: int
    max_queue_size: int
    preferred_batch_size: list[int]
    max_queue_size_reason: str = ""           # why this bound (plans written before it was recorded have none)
    max_beam_width: int = 1
    batching_strategy: str | None = None      # "inflight_fused_batching" for engines
    batch_scheduler_policy: str | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    max_tokens_in_paged_kv_cache: int | None = None
    enable_chunked_context: bool | None = None
    enable_kv_cache_reuse: bool | None = None
    exclude_input_in_output: bool = True
    priority_levels: int = 0                  # dynamic_batching's (0: none); a request's `priority` picks its level
    default_priority_level: int = 0
    max_num_tokens: int | None = None         # the cpu model's tokens per step (an engine's is its build's)
    tokens_per_block: int | None = None       # the cpu model's KV block (an engine's is its plugin config's)


@dataclass
class SpeculativePlan:
    """Speculative decoding as planned (pipeline/plan/speculative.py): the drafting method, K drafts verified a step,
    the acceptance rate assumed, the steps timed with and without drafts at each concurrency, the predicted speedup
    there, and the most running rows the server drafts for (above it speculation loses and is off)."""

    method: str                      # "ngram" | "draft" | "lookahead" | "eagle"
    draft_len: int                   # K
    max_ngram: int | None            # prompt lookup's longest n-gram (ngram)
    acceptance: float                # accepted / drafted tokens (TensorRT-LLM's acceptance_rate)
    acceptance_basis: str
    rows: list[int]                  # concurrencies predicted
    step_s: list[float]              # a plain decode step of that many rows
    verify_step_s: list[float]       # a step of K + 1 tokens a row
    speedup: list[float]             # output tokens/s with speculation over without
    max_rows: int                    # 0: it never pays on this host
    basis: str
    #: draft-target: the draft model's checkpoint, its decode step at each concurrency (a drafting step runs K of
    #: them), its weights and its KV cache per token (host memory beside the target's)
    draft_checkpoint: str | None = None
    draft_step_s: list[float] | None = None
    draft_weights_bytes: int | None = None
    draft_kv_bytes_per_token: int | None = None
    drafts_per_step: float | None = None       # D, the drafts a step verifies on average (None: K, older plans)
    #: a GPU plan's draft model as --speculative named it, and as its path loads it (a preset's hub id)
    draft_model: str | None = None
    draft_served: str | None = None
    #: lookahead (engine path): [window W, n-gram N, verification set G] (draft_len is the drafts a step it verifies)
    lookahead: list[int] | None = None
    #: a GPU plan's mode as its path names it: trtllm-build's --speculative_decoding_mode, or the LLM API's
    #: speculative_config.decoding_type (None: the cpu target's, named by `method`)
    decoding_mode: str | None = None


@dataclass
class MemoryBudget:
    """Per-GPU memory (host RAM for the cpu target), in bytes."""

    memory_bytes: int
    weights_bytes_per_rank: int
    activation_bytes: int
    activation_formula: str
    activation_basis: str
    runtime_reserve_bytes: int
    runtime_reserve_formula: str
    free_bytes: int                   # what the runtime finds free after the engine is loaded
    kv_cache_free_gpu_mem_fraction: float
    kv_cache_bytes: int
    kv_cache_tokens: int              # whole blocks of tokens_per_block
    #: a draft model beside it (speculative decoding on a GPU): its weights and its KV cache of kv_cache_tokens;
    #: its activations and decoder buffers are in activation_bytes and runtime_reserve_bytes
    draft_bytes: int = 0


@dataclass
class Roofline:
    """Bound-based estimates (no measurement): decode is memory-bound, prefill compute-bound."""

    batch: int
    decode_step_s_batch1: float
    decode_tokens_per_s_per_seq_batch1: float
    decode_step_s: float
    decode_tokens_per_s_per_seq: float
    decode_tokens_per_s_aggregate: float
    prefill_s_per_request: float
    request_latency_s_batch1: float
    request_latency_s: float
    basis: str


@dataclass
class EngineBuild:
    """How the plan's engine is built (plan.json `engine`): the builder, its release, the GPUs and their SM."""

    builder: str                      # "trtllm-build"
    tensorrt_llm_version: str
    world_size: int                   # tp x pp ranks, one engine file each
    sm: int | None


@dataclass
class LlmApiSettings:
    """The LLM API settings of a pytorch-backend plan (plan.json `llm_api`)."""

    tensorrt_llm_version: str
    options: dict                     # LLM() keyword arguments, upstream names (extra_llm_api_options.yaml)
    reasons: dict[str, str]           # option (dotted for nested ones) -> why the planner chose its value


@dataclass
class Plan:
    """Everything `trtpipe plan` decides; `to_dict` is plan.json."""

    model: ModelInfo
    target: Target
    backend: str                      # pipeline.backends: "engine" | "reference"
    precision: str
    dtype: str
    kv_cache_dtype: str
    quantization: dict
    tp_size: int
    pp_size: int
    workload: Workload
    max_seq_len: int                  # longest prompt + output of one request (BuildConfig.max_seq_len)
    weights_bytes: int
    weights_bytes_per_rank: int
    kv_bytes_per_token: int           # per GPU (TP-aware): what one token costs in one GPU's cache
    max_concurrent_sequences: int
    memory: MemoryBudget
    engine: EngineBuild | None        # None: the backend compiles nothing
    build_config: BuildConfig | None
    plugin_config: PluginConfig | None
    optimization_profiles: list[OptimizationProfile]
    triton: TritonParams
    roofline: Roofline
    warnings: list[str] = field(default_factory=list)
    plan_version: int = PLAN_VERSION
    llm_api: LlmApiSettings | None = None   # the LLM API settings (pytorch backends)
    performance: Performance | None = None   # plan/performance.py; None: the cpu target, --backend pytorch
    #: --precision auto: {"chosen": precision, "rejected": {precision: why it was not planned}} (None: asked for)
    precision_choice: dict | None = None
    #: the GPU runtime image it deploys onto (`backends.runtime_images`); None: the cpu target, trtpipe's own Triton
    runtime_image: str | None = None
    speculative: SpeculativePlan | None = None   # --speculative (None: every step decodes one token a row)

    @property
    def request_latency_s(self) -> float:
        """One request's latency at the planned batch: the performance model's prediction where the plan has one
        (measured or derived serving figures), else the roofline's bound."""
        return self.performance.request_latency_s if self.performance else self.roofline.request_latency_s

    @property
    def decode_step_s(self) -> float:
        """The planned batch's decode step (its serving TPOT where the performance model gives one)."""
        return self.performance.tpot_s if self.performance else self.roofline.decode_step_s

    def to_dict(self) -> dict:
        return {
            "plan_version": self.plan_version,
            "model": self.model.to_dict(),
            "target": self.target.to_dict(),
            "backend": self.backend,
            "precision": self.precision,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.quantization,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "workload": asdict(self.workload),
            "max_seq_len": self.max_seq_len,
            "weights_bytes": self.weights_bytes,
            "weights_bytes_per_rank": self.weights_bytes_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_concurrent_sequences": self.max_concurrent_sequences,
            "memory": asdict(self.memory),
            "engine": asdict(self.engine) if self.engine else None,
            "build_config": asdict(self.build_config) if self.build_config else None,
            "plugin_config": asdict(self.plugin_config) if self.plugin_config else None,
            "optimization_profiles": [asdict(p) for p in self.optimization_profiles],
            "triton": asdict(self.triton),
            "roofline": asdict(self.roofline),
            "warnings": list(self.warnings),
            "llm_api": asdict(self.llm_api) if self.llm_api else None,
            "performance": self.performance.to_dict() if self.performance else None,
            "precision_choice": self.precision_choice,
            "runtime_image": self.runtime_image,
            "speculative": asdict(self.speculative) if self.speculative else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        target_keys = {f.name for f in fields(Target)}
        model, workload = ModelInfo.from_dict(d["model"]), Workload(**d["workload"])
        target = Target(**{k: v for k, v in d["target"].items() if k in target_keys})
        return cls(
            model=model,
            target=target,
            # Plans written before the backend was recorded: the cpu target's reference runtime, else an engine.
            backend=d.get("backend") or ("reference" if target.kind == "cpu" else "engine"),
            precision=d["precision"], dtype=d["dtype"], kv_cache_dtype=d["kv_cache_dtype"],
            quantization=d["quantization"], tp_size=d["tp_size"], pp_size=d["pp_size"],
            workload=workload,
            # Plans written before max_seq_len was recorded were sized for the workload's context.
            max_seq_len=d.get("max_seq_len") or workload.context_for(model.arch),
            weights_bytes=d["weights_bytes"], weights_bytes_per_rank=d["weights_bytes_per_rank"],
            kv_bytes_per_token=d["kv_bytes_per_token"],
            max_concurrent_sequences=d["max_concurrent_sequences"],
            memory=MemoryBudget(**d["memory"]),
            engine=EngineBuild(**d["engine"]) if d["engine"] else None,
            build_config=BuildConfig(**d["build_config"]) if d["build_config"] else None,
            plugin_config=PluginConfig(**d["plugin_config"]) if d["plugin_config"] else None,
            optimization_profiles=[OptimizationProfile(**p) for p in d["optimization_profiles"]],
            triton=TritonParams(**d["triton"]),
            roofline=Roofline(**d["roofline"]),
            warnings=d.get("warnings", []),
            plan_version=d.get("plan_version", PLAN_VERSION),
            llm_api=LlmApiSettings(**d["llm_api"]) if d.get("llm_api") else None,
            performance=Performance.from_dict(d["performance"]) if d.get("performance") else None,
            precision_choice=d.get("precision_choice"),
            runtime_image=d.get("runtime_image"),
            speculative=SpeculativePlan(**d["speculative"]) if d.get("speculative") else None,
        )


def load_plan(path: Path) -> Plan:
    path = Path(path)
    if not path.exists():
        raise UserError(f"plan {path} does not exist; make one with `trtpipe plan MODEL --target T "
                        "--precision P -o plan.json`")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read plan {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("plan_version") != PLAN_VERSION:
        raise UserError(f"{path} is not a trtpipe plan (plan_version {PLAN_VERSION}); "
                        "make one with `trtpipe plan MODEL --target T --precision P --json > plan.json`")
    try:
        data["model"]["path"] = located(data["model"].get("path"), path.parent)
        if data["model"].get("source_model"):
            data["model"]["source_model"] = recorded_path(data["model"]["source_model"], path.parent)
        plan = Plan.from_dict(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{path}: malformed plan ({type(exc).__name__}: {exc}); re-run `trtpipe plan`") from None
    if plan.backend not in NAMES:
        raise UserError(f"{path}: unknown backend {plan.backend!r}; trtpipe knows {', '.join(NAMES)}")
    return plan


def located(value: str | None, directory: Path) -> str | None:
    """A path `document.plan_json` recorded, absolute again: `~/...` under home, a relative one under DIRECTORY."""
    if not value:
        return value
    where = Path(value).expanduser()
    return str(where if where.is_absolute() else (directory / where).absolute())


# ----------------------------------------------------------------------------------------------
# Reading a model: a TensorRT-LLM checkpoint directory or anything pipeline.sources resolves


def is_trtllm_checkpoint(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except ValueError:
        return False
    return isinstance(data, dict) and "architecture" in data and "architectures" not in data


def looks_like_path(spec: str) -> bool:
    """./x, ../x, /x, ~/x (and .\\x on Windows): what only a path is spelt as, never a preset or a hub id."""
    return spec.startswith(("./", "../", "/", "~", ".\\", "..\\")) or spec in (".", "..")


def resolve_model_info(spec: str, model_dir: Path | None = None) -> ModelInfo:
    """A preset, HF directory, GGUF, hub id (via pipeline.sources) or a TensorRT-LLM checkpoint. A spec written as
    a path (./, ../, / or ~ first) is a path: one that does not exist is said to be missing, not taken for a hub
    id."""
    path = Path(spec).expanduser()
    if looks_like_path(spec) and not path.exists():
        raise UserError(f"{spec}: no such file or directory ({path.absolute()}); MODEL is a preset, a hub id "
                        "(org/name), or an existing Hugging Face directory, GGUF file or TensorRT-LLM checkpoint")
    if path.is_dir() and is_trtllm_checkpoint(path):
        cfg = CheckpointConfig.read(path)
        return ModelInfo(name=spec, source="checkpoint", path=str(path.resolve()), arch=cfg.arch,
                         checkpoint_quantization=cfg.quantization, checkpoint_tp_size=cfg.layout.tp,
                         checkpoint_pp_size=cfg.layout.pp,
                         checkpoint_sparsity=None if cfg.sparsity is None else cfg.sparsity.pattern,
                         source_model=source_model(path))
    from ..sources import resolve_model

    source = resolve_model(spec, model_dir)
    return ModelInfo(name=spec, source=source.kind, path=str(source.path) if source.path else None,
                     arch=source.arch, source_quantization=source.quantization_config())
