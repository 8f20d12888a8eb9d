"""The plan stage: what fits on a target, and a build + Triton configuration that agree.

`make_plan` takes the architecture numbers of a model, a target from the catalogue, a precision, a
KV-cache precision, a tensor-parallel size and a workload, and returns a `Plan`: a memory budget,
TensorRT-LLM 1.2.1 BuildConfig / PluginConfig values, the optimization profiles trtllm-build will
derive from them, the Triton `tensorrt_llm` model parameters, and a roofline estimate. `save_plan`
writes it as plan.json (upstream names as keys), `load_plan` reads it back.

Upstream rules used here (see reference/upstream-facts.md A2-A4; TensorRT-LLM 1.2-era sources):
- tensorrt_llm/builder.py `build()`: FP8 context FMHA only with an FP8 quant_algo and sm >= 89;
  with paged context FMHA it needs an FP8 KV cache; paged context FMHA is switched off with an INT8
  KV cache and with an FP8 KV cache when the weights are not FP8; FP8 forces strongly_typed.
- tensorrt_llm/_common.py `check_max_num_tokens`: opt_num_tokens defaults to
  min(max_batch_size * max_beam_width, max_num_tokens) unless multiple_profiles; max_num_tokens is
  clamped to max_seq_len * max_batch_size.
- tensorrt_llm/models/generation_mixin.py `get_profiles_ranges`, `split_num_tokens_range`,
  `default_range`, `prepare_attention_inputs` (the profile derivation, see `derive_profiles`).
- tensorrtllm_backend: KV reuse needs an engine built with paged context FMHA (tensorrtllm_backend#271);
  triton max_batch_size must equal the engine's (tensorrtllm_backend#130).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .arch import ModelArch
from .errors import UserError
from .targets import FP8_MIN_SM, GIB, Target

PLAN_VERSION = 1
TENSORRT_LLM_VERSION = "1.2.1"
PRECISIONS = ("fp16", "bf16", "fp32", "fp8", "int8-sq")
KV_CACHE_CHOICES = ("auto", "fp16", "bf16", "fp32", "fp8", "int8")

_UNQUANTIZED_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1, "int8": 1}
QUANT_ALGO = {"fp8": "FP8", "int8-sq": "W8A8_SQ_PER_CHANNEL"}
KV_CACHE_QUANT_ALGO = {"fp8": "FP8", "int8": "INT8"}

#: Triton's default and NVIDIA's advice: "cannot be set to 1.0" (perf-best-practices.md).
DEFAULT_KV_FRACTION = 0.9
TOKENS_PER_BLOCK = 32            # PluginConfig.tokens_per_block default (1.2.x)
MAX_BATCH_SIZE_CAP = 2048        # BuildConfig.max_batch_size default: the largest we ever plan
MAX_NUM_TOKENS_WARN = 16384      # check_max_num_tokens warns above this
LOGITS_BYTES = 4                 # PretrainedConfig.logits_dtype default 'float32'
CUDA_CONTEXT_RESERVE = 1 * GIB   # CUDA context + cuBLAS(Lt) + TensorRT-LLM plugin workspaces
NCCL_RESERVE = GIB // 2          # all-reduce workspaces when tp > 1
DEFAULT_MAX_CONTEXT = 8192
#: Triton queue bound (0 would be unlimited): this many full batches may wait, so an overload is
#: rejected at once instead of every queued request timing out.
QUEUE_BATCHES = 4
#: In-flight batching schedules per iteration, so the GPU plans no queue delay (as triton_cli does);
#: the cpu target's Python model only batches what the dynamic batcher hands it, so it waits 1 ms.
CPU_QUEUE_DELAY_US = 1000


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

    def to_dict(self) -> dict:
        d = {"name": self.name, "source": self.source, "path": self.path, **self.arch.to_dict()}
        if self.source == "checkpoint":
            d["checkpoint_quantization"] = self.checkpoint_quantization
            d["checkpoint_tp_size"] = self.checkpoint_tp_size
            d["checkpoint_pp_size"] = self.checkpoint_pp_size
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelInfo":
        arch_keys = {f.name for f in fields(ModelArch)}
        return cls(name=d["name"], source=d["source"], path=d.get("path"),
                   arch=ModelArch(**{k: v for k, v in d.items() if k in arch_keys}),
                   checkpoint_quantization=d.get("checkpoint_quantization"),
                   checkpoint_tp_size=d.get("checkpoint_tp_size"),
                   checkpoint_pp_size=d.get("checkpoint_pp_size"))


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

    triton_backend: str                       # "tensorrtllm" | "python" (cpu target)
    triton_max_batch_size: int
    decoupled_mode: bool
    max_queue_delay_microseconds: int
    max_queue_size: int
    preferred_batch_size: list[int]
    max_beam_width: int = 1
    batching_strategy: str | None = None      # "inflight_fused_batching" for engines
    batch_scheduler_policy: str | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    max_tokens_in_paged_kv_cache: int | None = None
    enable_chunked_context: bool | None = None
    enable_kv_cache_reuse: bool | None = None
    exclude_input_in_output: bool = True


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
class Plan:
    model: ModelInfo
    target: Target
    precision: str
    dtype: str
    kv_cache_dtype: str
    quantization: dict
    tp_size: int
    pp_size: int
    workload: Workload
    weights_bytes: int
    weights_bytes_per_rank: int
    kv_bytes_per_token: int           # per GPU (TP-aware): what one token costs in one GPU's cache
    max_concurrent_sequences: int
    memory: MemoryBudget
    engine: dict | None               # None: the cpu target has nothing to compile
    build_config: BuildConfig | None
    plugin_config: PluginConfig | None
    optimization_profiles: list[dict]
    triton: TritonParams
    roofline: Roofline
    warnings: list[str] = field(default_factory=list)
    plan_version: int = PLAN_VERSION

    @property
    def is_cpu(self) -> bool:
        return not self.target.is_gpu

    def to_dict(self) -> dict:
        return {
            "plan_version": self.plan_version,
            "model": self.model.to_dict(),
            "target": self.target.to_dict(),
            "precision": self.precision,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.quantization,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "workload": asdict(self.workload),
            "weights_bytes": self.weights_bytes,
            "weights_bytes_per_rank": self.weights_bytes_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_concurrent_sequences": self.max_concurrent_sequences,
            "memory": asdict(self.memory),
            "engine": self.engine,
            "build_config": asdict(self.build_config) if self.build_config else None,
            "plugin_config": asdict(self.plugin_config) if self.plugin_config else None,
            "optimization_profiles": self.optimization_profiles,
            "triton": asdict(self.triton),
            "roofline": asdict(self.roofline),
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        target_keys = {f.name for f in fields(Target)}
        return cls(
            model=ModelInfo.from_dict(d["model"]),
            target=Target(**{k: v for k, v in d["target"].items() if k in target_keys}),
            precision=d["precision"], dtype=d["dtype"], kv_cache_dtype=d["kv_cache_dtype"],
            quantization=d["quantization"], tp_size=d["tp_size"], pp_size=d["pp_size"],
            workload=Workload(**d["workload"]),
            weights_bytes=d["weights_bytes"], weights_bytes_per_rank=d["weights_bytes_per_rank"],
            kv_bytes_per_token=d["kv_bytes_per_token"],
            max_concurrent_sequences=d["max_concurrent_sequences"],
            memory=MemoryBudget(**d["memory"]),
            engine=d["engine"],
            build_config=BuildConfig(**d["build_config"]) if d["build_config"] else None,
            plugin_config=PluginConfig(**d["plugin_config"]) if d["plugin_config"] else None,
            optimization_profiles=d["optimization_profiles"],
            triton=TritonParams(**d["triton"]),
            roofline=Roofline(**d["roofline"]),
            warnings=d.get("warnings", []),
            plan_version=d.get("plan_version", PLAN_VERSION),
        )


def save_plan(plan: Plan, path: Path) -> Path:
    """Write plan.json atomically (temporary sibling, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def load_plan(path: Path) -> Plan:
    path = Path(path)
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
        return Plan.from_dict(data)
    except (KeyError, TypeError) as exc:
        raise UserError(f"{path}: malformed plan ({type(exc).__name__}: {exc}); re-run `trtpipe plan`") from None


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


def resolve_model_info(spec: str, model_dir: Path | None = None) -> ModelInfo:
    """A preset, HF directory, GGUF, hub id (via pipeline.sources) or a TensorRT-LLM checkpoint."""
    path = Path(spec).expanduser()
    if path.is_dir() and is_trtllm_checkpoint(path):
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        mapping = cfg.get("mapping") or {}
        return ModelInfo(name=spec, source="checkpoint", path=str(path.resolve()),
                         arch=ModelArch.from_checkpoint_config(cfg, str(cfg_path)),
                         checkpoint_quantization=cfg.get("quantization") or {},
                         checkpoint_tp_size=int(mapping.get("tp_size", 1)),
                         checkpoint_pp_size=int(mapping.get("pp_size", 1)))
    from .sources import resolve_model

    source = resolve_model(spec, model_dir)
    return ModelInfo(name=spec, source=source.kind, path=str(source.path) if source.path else None,
                     arch=source.arch)


# ----------------------------------------------------------------------------------------------
# Precision decisions


def engine_dtype(precision: str, arch: ModelArch) -> str:
    """The engine's activation dtype: the precision itself, or for FP8/INT8-SQ the model's 16-bit dtype."""
    if precision in _UNQUANTIZED_DTYPE:
        return _UNQUANTIZED_DTYPE[precision]
    return arch.dtype if arch.dtype in ("float16", "bfloat16") else "float16"


def resolve_kv_cache_dtype(kv_cache: str, precision: str, dtype: str,
                           checkpoint_kv_algo: str | None = None, is_checkpoint: bool = False) -> str:
    """'fp8' | 'int8' | the engine dtype (an unquantized cache is stored in the engine dtype).

    'auto' follows a checkpoint's kv_cache_quant_algo; without a checkpoint it is FP8 for FP8
    weights, INT8 for SmoothQuant, and unquantized otherwise.
    """
    if kv_cache == "auto":
        if is_checkpoint:
            return {"FP8": "fp8", "INT8": "int8"}.get(checkpoint_kv_algo, dtype)
        return {"fp8": "fp8", "int8-sq": "int8"}.get(precision, dtype)
    if kv_cache in _UNQUANTIZED_DTYPE:
        if _UNQUANTIZED_DTYPE[kv_cache] != dtype:
            raise UserError(f"--kv-cache {kv_cache} contradicts the engine dtype {dtype}: an unquantized "
                            f"KV cache is stored in the engine dtype; use --kv-cache auto, fp8 or int8")
        return dtype
    if kv_cache not in KV_CACHE_QUANT_ALGO:
        raise UserError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")
    return kv_cache


def check_checkpoint_agrees(model: ModelInfo, precision: str, kv_cache_dtype: str, dtype: str,
                            tp: int, check_dtype: bool = True) -> None:
    """A checkpoint fixes its precision, KV quantization, dtype and tp: the request must match."""
    if model.source != "checkpoint":
        return
    q = model.checkpoint_quantization or {}
    have_algo, want_algo = q.get("quant_algo"), QUANT_ALGO.get(precision)
    where = model.path
    if have_algo != want_algo:
        raise UserError(f"checkpoint {where} has quant_algo {have_algo}, but --precision {precision} "
                        f"needs {want_algo}; pass the matching --precision or calibrate a new checkpoint")
    have_kv, want_kv = q.get("kv_cache_quant_algo"), KV_CACHE_QUANT_ALGO.get(kv_cache_dtype)
    if have_kv != want_kv:
        raise UserError(f"checkpoint {where} has kv_cache_quant_algo {have_kv}, but the requested KV "
                        f"cache {kv_cache_dtype} needs {want_kv}; pass a matching --kv-cache")
    if check_dtype and precision in _UNQUANTIZED_DTYPE and model.arch.dtype != dtype:
        raise UserError(f"checkpoint {where} is {model.arch.dtype}, --precision {precision} needs {dtype}; "
                        f"convert again with --dtype {dtype}")
    if model.checkpoint_tp_size != tp:
        raise UserError(f"checkpoint {where} is sharded for tp={model.checkpoint_tp_size}, not --tp {tp}; "
                        f"convert again with --tp {tp}")


def check_target_supports(target: Target, precision: str, kv_cache_dtype: str, tp: int, pp: int,
                          arch: ModelArch) -> list[str]:
    warnings = []
    if target.is_gpu and not target.supports_fp8 and "fp8" in (precision, kv_cache_dtype):
        raise UserError(f"FP8 needs compute capability {FP8_MIN_SM // 10}.{FP8_MIN_SM % 10} or newer (Ada, "
                        f"Hopper); {target.name} is sm_{target.sm}. Use --precision fp16/bf16 or int8-sq "
                        "and --kv-cache fp16/int8")
    if tp < 1 or pp < 1:
        raise UserError("--tp and pp must be at least 1")
    if pp > arch.num_hidden_layers:
        raise UserError(f"pp {pp} exceeds the model's {arch.num_hidden_layers} layers")
    if target.is_gpu and tp * pp > target.max_gpus:
        raise UserError(f"tp {tp} x pp {pp} needs {tp * pp} GPUs; the {target.name} target has at most "
                        f"{target.max_gpus}")
    if arch.num_attention_heads % tp:
        raise UserError(f"--tp {tp} does not divide num_attention_heads {arch.num_attention_heads}")
    kv = arch.num_key_value_heads
    if kv % tp and tp % kv:
        raise UserError(f"--tp {tp} and num_key_value_heads {kv}: one must divide the other "
                        "(KV heads are split, or duplicated when tp exceeds them)")
    if target.is_gpu and tp > 1 and not target.p2p:
        warnings.append(f"{target.name} has no GPU peer-to-peer access ({target.interconnect}): tensor-"
                        "parallel all-reduce goes through host memory and will be slow "
                        "(NVIDIA/TensorRT-LLM#1625)")
    return warnings


# ----------------------------------------------------------------------------------------------
# Sizes


def _linear_weight_bytes(in_f: int, out_f: int, precision: str, dtype_bytes: int) -> int:
    """One quantizable linear layer as stored in the checkpoint/engine."""
    n = in_f * out_f
    if precision == "fp8":
        return n + 2 * 4                          # FP8 weight, per-tensor weight + activation scales
    if precision == "int8-sq":
        return n + out_f * 4 + in_f * 4 + 4       # INT8 weight, per-channel scale, smoother, act scale
    return n * dtype_bytes


def _stage_layers(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def weights_per_rank_by_stage(arch: ModelArch, precision: str, dtype: str, tp: int, pp: int) -> list[int]:
    """Bytes of weights one GPU holds, for each pipeline stage (all tp ranks of a stage are equal).

    Linear layers are split over tp (KV heads duplicated when tp > num_key_value_heads); norms whole;
    vocab_embedding whole on pp stage 0; lm_head (vocab padded to a multiple of tp, split) and ln_f on
    the last stage; lm_head stays in the engine dtype (modelopt does not quantize it); a tied lm_head
    shares the embedding when tp == pp == 1 (tensorrt_llm share_embedding).
    """
    h, d = arch.hidden_size, arch.head_size
    eb = _DTYPE_BYTES[dtype]
    q_local = arch.num_attention_heads * d // tp
    kv_local = max(1, arch.num_key_value_heads // tp) * d
    i_local = arch.intermediate_size // tp
    per_layer = (_linear_weight_bytes(h, q_local + 2 * kv_local, precision, eb)   # qkv
                 + _linear_weight_bytes(q_local, h, precision, eb)                # dense
                 + 2 * _linear_weight_bytes(h, i_local, precision, eb)            # fc + gate
                 + _linear_weight_bytes(i_local, h, precision, eb)                # proj
                 + 2 * h * eb                                                     # two RMSNorms
                 + (q_local + 2 * kv_local + h) * eb * arch.attn_bias             # qkv, dense biases
                 + (2 * i_local + h) * eb * arch.mlp_bias)                        # fc, gate, proj biases
    embedding = arch.vocab_size * h * eb
    padded_vocab = math.ceil(arch.vocab_size / tp) * tp
    lm_head = padded_vocab // tp * h * eb
    if arch.tie_word_embeddings and tp == 1 and pp == 1:
        lm_head = 0
    stages = []
    for s, layers in enumerate(_stage_layers(arch.num_hidden_layers, pp)):
        b = layers * per_layer
        if s == 0:
            b += embedding
        if s == pp - 1:
            b += lm_head + h * eb
        stages.append(b)
    return stages


def kv_bytes_per_token(arch: ModelArch, kv_cache_dtype: str, tp: int, pp: int = 1) -> int:
    """2 (K and V) x layers on the GPU x KV heads on the GPU x head size x bytes per element."""
    layers = max(_stage_layers(arch.num_hidden_layers, pp))
    kv_heads_local = max(1, arch.num_key_value_heads // tp)   # duplicated heads when tp > kv heads
    return 2 * layers * kv_heads_local * arch.head_size * _DTYPE_BYTES[kv_cache_dtype]


ACTIVATION_FORMULA = (
    "max_num_tokens * act_bytes * (2*hidden + max(3*intermediate/tp, 2*(q+2*kv)/tp + q/tp))"
    " [+ max_num_tokens * (hidden + intermediate/tp) for the 8-bit GEMM input copies of fp8/int8-sq]"
    " + max_batch_size * vocab_padded/tp * 4 (float32 logits; plans use max_beam_width 1)"
)
ACTIVATION_BASIS = (
    "TensorRT sizes activation memory at build time for the largest profile and reuses it across "
    "layers, so it grows as max_num_tokens x a per-token constant (TensorRT-LLM docs "
    "legacy/reference/memory.md). The constant is the widest live set of one decoder layer with "
    "padding removed: residual + normed hidden, and the fused gate/up GEMM output (2*intermediate) plus "
    "the SwiGLU output (intermediate), or the attention QKV output, its rotary copy and the context "
    "output; logits are produced for the last token of each sequence only. An estimate, not a "
    "measurement: the built engine's device_memory_size_v2 is the real figure."
)


def activation_bytes(arch: ModelArch, precision: str, dtype: str, tp: int, max_num_tokens: int,
                     max_batch_size: int) -> int:
    h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
    i_local = arch.intermediate_size // tp
    per_token = _DTYPE_BYTES[dtype] * (2 * h + max(3 * i_local, 2 * (q + 2 * kv) // tp + q // tp))
    if precision in QUANT_ALGO:
        per_token += h + i_local
    vocab_local = math.ceil(arch.vocab_size / tp)
    return max_num_tokens * per_token + max_batch_size * vocab_local * LOGITS_BYTES


RESERVE_FORMULA = (
    "1 GiB (CUDA context, cuBLAS/cuBLASLt and TensorRT-LLM plugin workspaces) + 0.5 GiB if tp > 1 "
    "(all-reduce workspaces) + max_batch_size * (2 * vocab * 4 + 2 * max_seq_len * 4) "
    "(decoder logits/probabilities and output-id buffers the runtime preallocates, memory.md)"
)


def runtime_reserve_bytes(arch: ModelArch, tp: int, max_batch_size: int, max_seq_len: int) -> int:
    per_seq = 2 * arch.vocab_size * 4 + 2 * max_seq_len * 4
    return CUDA_CONTEXT_RESERVE + (NCCL_RESERVE if tp > 1 else 0) + max_batch_size * per_seq


# ----------------------------------------------------------------------------------------------
# Optimization profiles (TensorRT-LLM 1.2.x generation_mixin.py)


def default_range(max_range: int) -> list[int]:
    """GenerationMixin.default_range with its defaults (min 1, no offset): [1, (max + 1) // 2, max]."""
    return [1, (max_range + 1) // 2, max_range]


def split_num_tokens_range(max_num_tokens: int) -> list[list[int]]:
    """GenerationMixin.split_num_tokens_range for multiple_profiles, with split points 64..1024.

    Upstream returns the flat list [1, max, max] (not a list of ranges) when max_num_tokens <= 64;
    the planner never enables multiple_profiles there (see `choose_multiple_profiles`).
    """
    points = [64, 128, 256, 512, 1024]
    if max_num_tokens <= points[0]:
        raise UserError(f"multiple_profiles with max_num_tokens {max_num_tokens} <= 64 makes TensorRT-LLM "
                        "1.2.1 derive a malformed profile list; raise --max-num-tokens or disable it")
    ranges = [[1, 64, 64]]
    for prev, point in zip(points, points[1:]):
        if max_num_tokens <= point:
            ranges.append([prev, max_num_tokens, max_num_tokens])
            return ranges
        ranges.append([prev, point, point])
    ranges.append([points[-1], max_num_tokens, max_num_tokens])
    return ranges


def derive_profiles(build: BuildConfig, plugin: PluginConfig) -> list[dict]:
    """The optimization profiles trtllm-build 1.2.1 creates for an in-flight-batching decoder.

    With gpt_attention_plugin, remove_input_padding and a paged KV cache the engine supports in-flight
    batching, so `has_ctx_gen_opt_profiles` is False and there is no context/generation split:
    - num_tokens: one profile [1, opt_num_tokens, max_num_tokens], or with multiple_profiles the
      ranges of `split_num_tokens_range(max_num_tokens)`;
    - batch_size_beam_width: default_range(max_batch_size * max_beam_width) in every profile
      (`build()` does not pass BuildConfig.opt_batch_size to prepare_inputs, whose default is 0);
    - max_blocks_per_seq: ceil(default_range(kv_max_seq_len) / tokens_per_block) with kv_max_seq_len =
      max_seq_len (+ tokens_per_block when max_beam_width > 1).
    """
    if not (plugin.gpt_attention_plugin and plugin.remove_input_padding and plugin.paged_kv_cache):
        raise UserError("trtpipe only plans in-flight-batching engines (gpt_attention_plugin, "
                        "remove_input_padding and a paged KV cache)")
    if plugin.multiple_profiles:
        num_tokens = split_num_tokens_range(build.max_num_tokens)
    else:
        opt = build.opt_num_tokens
        if opt is None:
            opt = min(build.max_num_tokens, build.max_batch_size * build.max_beam_width)
        num_tokens = [[1, opt, build.max_num_tokens]]
    batch = default_range(build.max_batch_size * build.max_beam_width)
    kv_max_seq_len = build.max_seq_len + (plugin.tokens_per_block if build.max_beam_width > 1 else 0)
    blocks = [math.ceil(x / plugin.tokens_per_block) for x in default_range(kv_max_seq_len)]
    return [{"num_tokens": r, "batch_size_beam_width": list(batch), "max_blocks_per_seq": list(blocks)}
            for r in num_tokens]


# ----------------------------------------------------------------------------------------------
# Choices


def choose_max_context(workload: Workload, arch: ModelArch) -> int:
    limit = model_context_limit(arch)
    max_context = workload.max_context or min(limit, DEFAULT_MAX_CONTEXT)
    if max_context > limit:
        raise UserError(f"--max-context {max_context} exceeds the model's context of {limit} tokens "
                        "(max_position_embeddings x rotary scaling)")
    if workload.input_len + workload.output_len > max_context:
        raise UserError(f"--input-len {workload.input_len} + --output-len {workload.output_len} exceed "
                        f"the maximum context {max_context}; raise --max-context or shorten the workload")
    return max_context


def model_context_limit(arch: ModelArch) -> int:
    """max_position_embeddings x rotary factor, as builder._init_max_seq_len deduces max_seq_len."""
    scaling = arch.rotary_scaling or {}
    rope_type = scaling.get("type", scaling.get("rope_type"))
    factor = 1.0 if not scaling or rope_type in ("su", "longrope", "llama3") else float(scaling.get("factor", 1.0))
    return int(math.ceil(arch.max_position_embeddings * factor))


def paged_context_fmha_possible(precision: str, kv_cache_dtype: str) -> tuple[bool, str]:
    """builder.build(): paged context FMHA is switched off with an INT8 KV cache, and with an FP8 KV
    cache unless the weights are FP8 (FP8 paged context FMHA needs FP8 context FMHA)."""
    if kv_cache_dtype == "int8":
        return False, "TensorRT-LLM disables paged context FMHA with an INT8 KV cache"
    if kv_cache_dtype == "fp8" and precision != "fp8":
        return False, "TensorRT-LLM disables paged context FMHA with an FP8 KV cache unless the weights are FP8"
    return True, ""


def choose_max_num_tokens(workload: Workload, max_input_len: int, chunked: bool, override: int | None) -> int:
    if override is not None:
        if override < 1:
            raise UserError("--max-num-tokens must be at least 1")
        if not chunked and override < max_input_len:
            raise UserError(f"--max-num-tokens {override} is below max_input_len {max_input_len}, which "
                            "needs chunked context, and chunked context needs paged context FMHA (off here)")
        return override
    tokens = min(max(1024, 1 << (workload.input_len - 1).bit_length()), 8192)
    return tokens if chunked else max(tokens, max_input_len)


def choose_multiple_profiles(override: bool | None, max_num_tokens: int, opt_override: int | None) -> bool:
    if override and opt_override is not None:
        raise UserError("--multiple-profiles and --opt-num-tokens contradict each other: trtllm-build "
                        "refuses both (\"They are not supposed to be working in the same time\")")
    if override is not None:
        return override
    # NVIDIA: "Multiple profiles: Always enable" (useful-build-time-flags.md); upstream breaks <= 64.
    return opt_override is None and max_num_tokens > 64


def choose_plugins(precision: str, kv_cache_dtype: str, dtype: str, target: Target, tp: int,
                   overrides: Overrides, multiple_profiles: bool) -> tuple[PluginConfig, list[str]]:
    warnings = []
    possible, why = paged_context_fmha_possible(precision, kv_cache_dtype)
    paged_ctx = possible if overrides.use_paged_context_fmha is None else overrides.use_paged_context_fmha
    if paged_ctx and not possible:
        raise UserError(f"--paged-context-fmha contradicts --precision {precision} with a "
                        f"{kv_cache_dtype} KV cache: {why}")
    if not paged_ctx and why:
        warnings.append(f"paged context FMHA off: {why}; so no KV-cache reuse and no chunked context")
    fp8_ctx = precision == "fp8" and kv_cache_dtype == "fp8" and (target.sm or 0) >= FP8_MIN_SM and paged_ctx
    plugin = PluginConfig(
        dtype=dtype,
        gpt_attention_plugin="auto",
        # GEMM plugin for FP16/BF16, disabled for FP8 (useful-build-time-flags.md); with SmoothQuant
        # the quantized GEMMs use the smooth_quant plugins and the rest (lm_head) the GEMM plugin.
        gemm_plugin=None if precision == "fp8" else "auto",
        nccl_plugin="auto" if tp > 1 else None,
        use_paged_context_fmha=paged_ctx,
        use_fp8_context_fmha=fp8_ctx,
        multiple_profiles=multiple_profiles,
        # trtllm-build turns use_fused_mlp off for quant algos other than FP8 (commands/build.py).
        use_fused_mlp=precision != "int8-sq",
    )
    return plugin, warnings


def decode_step_seconds(weights_per_rank: int, batch: int, context_tokens: float, kv_per_token: int,
                        target: Target) -> float:
    return (weights_per_rank + batch * context_tokens * kv_per_token) / target.bandwidth_bytes_per_s


def prefill_seconds(arch: ModelArch, input_len: int, precision: str, tp: int, target: Target) -> float:
    """2 FLOPs per weight per token for the decoder GEMMs and lm_head of the last token, plus causal
    attention 2 * layers * L^2 * q_size, over tp GPUs at the dense peak rate."""
    h, i = arch.hidden_size, arch.intermediate_size
    linear = arch.num_hidden_layers * (h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * i)
    flops = 2 * linear * input_len + 2 * arch.vocab_size * h + 2 * arch.num_hidden_layers * input_len ** 2 * arch.q_size
    return flops / (tp * target.peak_ops_per_s(precision))


def latency_batch_cap(budget_s: float, prefill_s: float, workload: Workload, weights_per_rank: int,
                      context: float, kv_per_token: int, target: Target) -> int:
    """Largest batch whose estimated request latency (prefill + output_len decode steps) fits the budget."""
    per_step = (budget_s - prefill_s) / workload.output_len
    base = weights_per_rank / target.bandwidth_bytes_per_s
    if per_step <= base:
        raise UserError(f"the P99 latency budget {budget_s:g} s cannot be met on {target.name} even at batch 1: "
                        f"estimated {prefill_s + workload.output_len * base:.3f} s (prefill {prefill_s:.3f} s + "
                        f"{workload.output_len} decode steps of {base * 1e3:.2f} ms); shorten the output, "
                        "use a lower precision or more GPUs")
    return max(1, int((per_step - base) * target.bandwidth_bytes_per_s / (context * kv_per_token)))


def largest_batch(fits, upper: int) -> int:
    """The largest b in [1, upper] with fits(b), for a fits() that only turns false as b grows (1 if none)."""
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _round_down_to_blocks(tokens: int, tokens_per_block: int) -> int:
    return tokens // tokens_per_block * tokens_per_block


def _blocks_tokens(tokens: int, tokens_per_block: int) -> int:
    return math.ceil(tokens / tokens_per_block) * tokens_per_block


# ----------------------------------------------------------------------------------------------
# The plan


def make_plan(model: ModelInfo | ModelArch, target: Target, precision: str, kv_cache: str = "auto",
              tp: int = 1, workload: Workload | None = None, overrides: Overrides | None = None,
              pp: int = 1) -> Plan:
    """Plan MODEL on TARGET; raises UserError for anything that cannot work."""
    if isinstance(model, ModelArch):
        model = ModelInfo(name=model.architecture, source="arch", path=None, arch=model)
    workload = workload or Workload()
    overrides = overrides or Overrides()
    workload.validate()
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    arch = model.arch
    is_checkpoint = model.source == "checkpoint"
    if is_checkpoint:
        pp = model.checkpoint_pp_size or 1
    dtype = engine_dtype(precision, arch)
    kv_dtype = resolve_kv_cache_dtype(kv_cache, precision, dtype,
                                      (model.checkpoint_quantization or {}).get("kv_cache_quant_algo"),
                                      is_checkpoint)
    warnings = check_target_supports(target, precision, kv_dtype, tp, pp, arch)
    # The cpu target runs any checkpoint dtype in float32; an engine keeps the checkpoint's dtype.
    check_checkpoint_agrees(model, precision, kv_dtype, dtype, tp, check_dtype=target.is_gpu)
    max_context = choose_max_context(workload, arch)
    if target.is_gpu:
        return _gpu_plan(model, target, precision, dtype, kv_dtype, tp, pp, workload, overrides,
                         max_context, warnings)
    return _cpu_plan(model, target, precision, kv_dtype, tp, pp, workload, overrides, max_context, warnings)


def _quantization(precision: str, kv_dtype: str) -> dict:
    return {"quant_algo": QUANT_ALGO.get(precision), "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO.get(kv_dtype)}


def _gpu_plan(model, target, precision, dtype, kv_dtype, tp, pp, workload, overrides, max_context, warnings):
    arch = model.arch
    fraction = overrides.kv_cache_free_gpu_mem_fraction
    fraction = DEFAULT_KV_FRACTION if fraction is None else fraction
    if not 0 < fraction < 1:
        raise UserError(f"--kv-cache-free-gpu-mem-fraction {fraction} must be in (0, 1); NVIDIA: it "
                        "\"cannot be set to 1.0\" (try 0.95 on an unshared GPU)")
    max_seq_len = max_context
    max_input_len = max_seq_len - 1
    possible, _ = paged_context_fmha_possible(precision, kv_dtype)
    chunked = possible if overrides.use_paged_context_fmha is None else overrides.use_paged_context_fmha
    max_num_tokens = choose_max_num_tokens(workload, max_input_len, chunked, overrides.max_num_tokens)
    multiple_profiles = choose_multiple_profiles(overrides.multiple_profiles, max_num_tokens,
                                                 overrides.opt_num_tokens)
    plugin, plugin_warnings = choose_plugins(precision, kv_dtype, dtype, target, tp, overrides, multiple_profiles)
    warnings += plugin_warnings
    if overrides.enable_kv_cache_reuse and not plugin.use_paged_context_fmha:
        raise UserError("--kv-cache-reuse needs an engine built with paged context FMHA, which this plan "
                        "does not have (tensorrtllm_backend#271: \"When KV cache block reuse is set, model "
                        "has to be built with paged context FMHA support\")")
    if max_num_tokens > MAX_NUM_TOKENS_WARN:
        warnings.append(f"max_num_tokens {max_num_tokens} > 16384: TensorRT-LLM warns it may exceed the "
                        "TensorRT tensor volume, and it takes memory from the KV cache")

    stages = weights_per_rank_by_stage(arch, precision, dtype, tp, pp)
    weights_per_rank = max(stages)
    weights_total = tp * sum(stages)
    kv_per_token = kv_bytes_per_token(arch, kv_dtype, tp, pp)
    tpb = plugin.tokens_per_block
    seq_tokens = _blocks_tokens(workload.input_len + workload.output_len, tpb)
    memory = target.memory_bytes
    if weights_per_rank >= memory:
        hint = (f"use a lower precision (fp8, int8-sq) or --tp {min(2 * tp, target.max_gpus)}"
                if tp < target.max_gpus else f"{target.name} has at most {target.max_gpus} GPUs")
        raise UserError(f"{model.name} at {precision} needs {_gib(weights_per_rank)} of weights per GPU; "
                        f"{target.name} has {_gib(memory)}: {hint}")

    def kv_tokens_for(batch: int) -> tuple[int, int, int, int]:
        act = activation_bytes(arch, precision, dtype, tp, min(max_num_tokens, max_seq_len * batch), batch)
        reserve = runtime_reserve_bytes(arch, tp, batch, max_seq_len)
        free = memory - weights_per_rank - act - reserve
        kv_bytes = int(max(free, 0) * fraction)
        return act, reserve, free, _round_down_to_blocks(kv_bytes // kv_per_token, tpb)

    if overrides.max_batch_size is not None:
        if overrides.max_batch_size < 1:
            raise UserError("--max-batch-size must be at least 1")
        if workload.concurrency and overrides.max_batch_size < workload.concurrency:
            raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --concurrency "
                            f"{workload.concurrency}: the engine could never run that many requests at once")
        batch = overrides.max_batch_size
    else:
        # The largest batch whose sequences of typical length all fit in the KV cache that is left
        # once that batch's own activations and runtime buffers are allocated.
        wanted = min(workload.concurrency or MAX_BATCH_SIZE_CAP, MAX_BATCH_SIZE_CAP)
        batch = largest_batch(lambda b: kv_tokens_for(b)[3] // seq_tokens >= b, wanted)
    act, reserve, free, kv_tokens = kv_tokens_for(batch)
    if kv_tokens < max_seq_len:
        raise UserError(
            f"no room for the KV cache: after {_gib(weights_per_rank)} of weights, {_gib(act)} of "
            f"activations (max_num_tokens {max_num_tokens}) and {_gib(reserve)} of runtime reserve, "
            f"{target.name} keeps {kv_tokens} tokens of KV cache, fewer than one sequence of "
            f"max context {max_seq_len}. Lower --max-context, use --kv-cache fp8/int8, a lower "
            "precision or more GPUs (--tp)")
    fit = kv_tokens // seq_tokens
    context = workload.input_len + workload.output_len / 2
    prefill_s = prefill_seconds(arch, workload.input_len, precision, tp, target)
    if workload.p99_latency_s is not None:
        cap = latency_batch_cap(workload.p99_latency_s, prefill_s, workload, weights_per_rank, context,
                                kv_per_token, target)
        if overrides.max_batch_size is not None and overrides.max_batch_size > cap:
            raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --p99-latency "
                            f"{workload.p99_latency_s:g}: at most {cap} sequences per step meet it")
        if batch > cap:
            batch = cap
            act, reserve, free, kv_tokens = kv_tokens_for(batch)
            fit = kv_tokens // seq_tokens
    if overrides.max_batch_size is not None and overrides.max_batch_size > fit:
        warnings.append(f"--max-batch-size {overrides.max_batch_size} is more than the {fit} sequences of "
                        f"{seq_tokens} tokens the KV cache holds; the scheduler will queue the rest")
    if workload.concurrency and workload.concurrency > batch:
        limit = "the KV cache" + (" and the P99 latency budget" if workload.p99_latency_s else "")
        warnings.append(f"--concurrency {workload.concurrency} is more than the planned batch of {batch} "
                        f"({limit} at {workload.input_len}+{workload.output_len} tokens); the rest queue in Triton")
    concurrent = min(batch, fit)

    if max_num_tokens > max_seq_len * batch:
        if overrides.max_num_tokens is not None:
            raise UserError(f"--max-num-tokens {max_num_tokens} exceeds max_seq_len x max_batch_size "
                            f"({max_seq_len} x {batch}); trtllm-build would clamp it")
        max_num_tokens = max_seq_len * batch
    opt_num_tokens = overrides.opt_num_tokens
    if opt_num_tokens is not None and not 1 <= opt_num_tokens <= max_num_tokens:
        raise UserError(f"--opt-num-tokens {opt_num_tokens} must be between 1 and max_num_tokens {max_num_tokens}")
    if opt_num_tokens is None and not multiple_profiles:
        opt_num_tokens = min(batch, max_num_tokens)   # check_max_num_tokens' own default, made explicit

    build = BuildConfig(max_input_len=max_input_len, max_seq_len=max_seq_len, max_batch_size=batch,
                        max_beam_width=1, max_num_tokens=max_num_tokens, opt_num_tokens=opt_num_tokens)
    reuse = plugin.use_paged_context_fmha if overrides.enable_kv_cache_reuse is None else overrides.enable_kv_cache_reuse
    triton = TritonParams(
        triton_backend="tensorrtllm", triton_max_batch_size=batch, decoupled_mode=True,
        max_queue_delay_microseconds=0, max_queue_size=QUEUE_BATCHES * batch,
        preferred_batch_size=[batch], max_beam_width=1, batching_strategy="inflight_fused_batching",
        batch_scheduler_policy="guaranteed_no_evict", kv_cache_free_gpu_mem_fraction=fraction,
        # The runtime takes min(this, fraction x free memory it measures): the cache never exceeds the
        # plan, and a smaller real free memory still bounds it (tensorrtllm_backend docs/model_config.md).
        max_tokens_in_paged_kv_cache=kv_tokens, enable_chunked_context=plugin.use_paged_context_fmha,
        enable_kv_cache_reuse=reuse)
    budget = MemoryBudget(
        memory_bytes=memory, weights_bytes_per_rank=weights_per_rank, activation_bytes=act,
        activation_formula=ACTIVATION_FORMULA, activation_basis=ACTIVATION_BASIS, runtime_reserve_bytes=reserve,
        runtime_reserve_formula=RESERVE_FORMULA, free_bytes=free, kv_cache_free_gpu_mem_fraction=fraction,
        kv_cache_bytes=kv_tokens * kv_per_token, kv_cache_tokens=kv_tokens)
    return Plan(
        model=model, target=target, precision=precision, dtype=dtype, kv_cache_dtype=kv_dtype,
        quantization=_quantization(precision, kv_dtype), tp_size=tp, pp_size=pp, workload=workload,
        weights_bytes=weights_total, weights_bytes_per_rank=weights_per_rank, kv_bytes_per_token=kv_per_token,
        max_concurrent_sequences=concurrent, memory=budget,
        engine={"builder": "trtllm-build", "tensorrt_llm_version": TENSORRT_LLM_VERSION,
                "world_size": tp * pp, "sm": target.sm},
        build_config=build, plugin_config=plugin, optimization_profiles=derive_profiles(build, plugin),
        triton=triton, roofline=_roofline(arch, target, precision, tp, workload, weights_per_rank,
                                          kv_per_token, concurrent, prefill_s),
        warnings=warnings)


def _cpu_plan(model, target, precision, kv_dtype, tp, pp, workload, overrides, max_context, warnings):
    """The reference runtime serves the checkpoint in float32 on the host: no engine, small batches."""
    arch = model.arch
    if overrides.max_num_tokens or overrides.opt_num_tokens or overrides.multiple_profiles is not None \
            or overrides.use_paged_context_fmha is not None or overrides.enable_kv_cache_reuse \
            or overrides.kv_cache_free_gpu_mem_fraction is not None:
        raise UserError("engine options (--max-num-tokens, --opt-num-tokens, --multiple-profiles, "
                        "--paged-context-fmha, --kv-cache-reuse, --kv-cache-free-gpu-mem-fraction) "
                        "contradict --target cpu, which builds no engine")
    stages = weights_per_rank_by_stage(arch, "fp32", "float32", 1, 1)
    weights = stages[0]
    kv_per_token = kv_bytes_per_token(arch, "float32", 1, 1)
    memory = target.memory_bytes
    reserve = CUDA_CONTEXT_RESERVE   # Python, PyTorch and Triton processes
    if weights + reserve >= memory:
        raise UserError(f"{model.name} needs {_gib(weights)} of float32 weights in the reference runtime; "
                        f"the cpu target assumes {_gib(memory)} of host memory. Use a GPU target")
    batch = overrides.max_batch_size or min(workload.concurrency or target.triton_max_batch_size,
                                            target.triton_max_batch_size)
    if workload.concurrency and overrides.max_batch_size and overrides.max_batch_size < workload.concurrency:
        raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --concurrency {workload.concurrency}")
    free = memory - weights - reserve
    kv_tokens = free // kv_per_token
    if kv_tokens < max_context:
        raise UserError(f"no room for one sequence of {max_context} tokens of float32 KV cache in "
                        f"{_gib(free)} of host memory left; lower --max-context")
    fit = kv_tokens // (workload.input_len + workload.output_len)
    concurrent = max(1, min(batch, fit))
    prefill_s = prefill_seconds(arch, workload.input_len, "fp32", 1, target)
    if workload.p99_latency_s is not None:
        cap = latency_batch_cap(workload.p99_latency_s, prefill_s, workload, weights,
                                workload.input_len + workload.output_len / 2, kv_per_token, target)
        batch = min(batch, cap)
        concurrent = min(concurrent, batch)
    if precision in QUANT_ALGO:
        warnings.append(f"cpu target: the reference runtime computes in float32 and simulates {precision} "
                        "from the checkpoint's scales")
    triton = TritonParams(
        triton_backend="python", triton_max_batch_size=batch, decoupled_mode=True,
        max_queue_delay_microseconds=CPU_QUEUE_DELAY_US, max_queue_size=QUEUE_BATCHES * batch, preferred_batch_size=[batch])
    budget = MemoryBudget(
        memory_bytes=memory, weights_bytes_per_rank=weights, activation_bytes=0,
        activation_formula="not planned: PyTorch allocates the reference runtime's activations per call",
        activation_basis="the cpu target builds no engine, so nothing is reserved ahead of time",
        runtime_reserve_bytes=reserve, runtime_reserve_formula="1 GiB for the Python/PyTorch/Triton processes",
        free_bytes=free, kv_cache_free_gpu_mem_fraction=1.0, kv_cache_bytes=kv_tokens * kv_per_token,
        kv_cache_tokens=kv_tokens)
    return Plan(
        model=model, target=target, precision=precision, dtype="float32",
        kv_cache_dtype=kv_dtype if kv_dtype in KV_CACHE_QUANT_ALGO else "float32",
        quantization=_quantization(precision, kv_dtype),
        tp_size=tp, pp_size=pp, workload=workload, weights_bytes=weights, weights_bytes_per_rank=weights,
        kv_bytes_per_token=kv_per_token, max_concurrent_sequences=concurrent, memory=budget, engine=None,
        build_config=None, plugin_config=None, optimization_profiles=[], triton=triton,
        roofline=_roofline(arch, target, "fp32", 1, workload, weights, kv_per_token, batch, prefill_s),
        warnings=warnings)


def _roofline(arch, target, precision, tp, workload, weights_per_rank, kv_per_token, batch, prefill_s) -> Roofline:
    context = workload.input_len + workload.output_len / 2
    step1 = decode_step_seconds(weights_per_rank, 1, context, kv_per_token, target)
    step = decode_step_seconds(weights_per_rank, batch, context, kv_per_token, target)
    return Roofline(
        batch=batch, decode_step_s_batch1=step1, decode_tokens_per_s_per_seq_batch1=1 / step1,
        decode_step_s=step, decode_tokens_per_s_per_seq=1 / step, decode_tokens_per_s_aggregate=batch / step,
        prefill_s_per_request=prefill_s,
        request_latency_s_batch1=prefill_s + workload.output_len * step1,
        request_latency_s=prefill_s + workload.output_len * step,
        basis=("decode step = (weights per GPU + batch x (input_len + output_len/2) x kv_bytes_per_token) / "
               "memory bandwidth; prefill = (2 x linear weights x input_len + 2 x layers x input_len^2 x "
               "q_size) FLOPs / (tp x dense peak rate); request latency = prefill + output_len decode "
               "steps. Lower bounds: no kernel efficiency, communication or scheduling overhead"))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# ----------------------------------------------------------------------------------------------
# Human output


def _kv_table(title: str, rows: list[tuple[str, object]]):
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, "-" if value is None else str(value))
    return table


def render_plan(plan: Plan) -> list:
    """Rich renderables: a readable summary of every section of the plan."""
    from rich.table import Table

    m, w, mem, roof = plan.model, plan.workload, plan.memory, plan.roofline
    a = m.arch
    out = [_kv_table(f"Plan: {m.name} on {plan.target.name}", [
        ("model", f"{a.architecture}: {a.num_hidden_layers} layers, {a.num_attention_heads} heads "
                  f"({a.num_key_value_heads} KV) x {a.head_size}, hidden {a.hidden_size}, "
                  f"intermediate {a.intermediate_size}, vocab {a.vocab_size}"),
        ("target", f"{plan.target.sku} (sm {plan.target.compute_capability or '-'}, "
                   f"{_gib(plan.target.memory_bytes)}, {plan.target.bandwidth_bytes_per_s / 1e9:.0f} GB/s)"),
        ("precision", f"{plan.precision} (engine dtype {plan.dtype}), KV cache {plan.kv_cache_dtype}"),
        ("parallelism", f"tp {plan.tp_size}, pp {plan.pp_size}"),
        ("workload", f"input {w.input_len}, output {w.output_len} tokens, concurrency "
                     f"{w.concurrency or 'as many as fit'}, P99 budget "
                     f"{f'{w.p99_latency_s:g} s' if w.p99_latency_s else 'none'}"),
    ])]
    out.append(_kv_table("Memory budget (per GPU)" if not plan.is_cpu else "Memory budget (host)", [
        ("total", _gib(mem.memory_bytes)),
        ("weights", f"{_gib(mem.weights_bytes_per_rank)} (all ranks: {_gib(plan.weights_bytes)})"),
        ("activations", f"{_gib(mem.activation_bytes)} = {mem.activation_formula}"),
        ("  basis", mem.activation_basis),
        ("runtime reserve", f"{_gib(mem.runtime_reserve_bytes)} = {mem.runtime_reserve_formula}"),
        ("free for KV", f"{_gib(mem.free_bytes)} x kv_cache_free_gpu_mem_fraction "
                        f"{mem.kv_cache_free_gpu_mem_fraction:g} = {_gib(mem.kv_cache_bytes)}"),
        ("kv_bytes_per_token", f"{plan.kv_bytes_per_token} B ({plan.kv_cache_dtype})"),
        ("KV cache tokens", mem.kv_cache_tokens),
        ("max_concurrent_sequences", f"{plan.max_concurrent_sequences} at "
                                     f"{w.input_len}+{w.output_len} tokens"),
    ]))
    if plan.build_config is not None:
        out.append(_kv_table("build_config (TensorRT-LLM 1.2.1 BuildConfig)", list(asdict(plan.build_config).items())))
        out.append(_kv_table("plugin_config (PluginConfig)", list(asdict(plan.plugin_config).items())))
        profiles = Table(title="optimization_profiles (as trtllm-build derives them)", title_justify="left")
        for col in ("#", "num_tokens [min, opt, max]", "batch_size_beam_width", "max_blocks_per_seq"):
            profiles.add_column(col)
        for i, p in enumerate(plan.optimization_profiles):
            profiles.add_row(str(i), str(p["num_tokens"]), str(p["batch_size_beam_width"]),
                             str(p["max_blocks_per_seq"]))
        out.append(profiles)
    else:
        out.append(_kv_table("engine", [("build", "none: the cpu target serves the checkpoint with the "
                                                  "reference runtime")]))
    out.append(_kv_table("triton (tensorrt_llm model parameters)", list(asdict(plan.triton).items())))
    out.append(_kv_table("Roofline estimate", [
        ("decode, batch 1", f"{roof.decode_tokens_per_s_per_seq_batch1:.1f} tokens/s "
                            f"({roof.decode_step_s_batch1 * 1e3:.2f} ms/step)"),
        (f"decode, batch {roof.batch}", f"{roof.decode_tokens_per_s_per_seq:.1f} tokens/s per sequence, "
                                        f"{roof.decode_tokens_per_s_aggregate:.0f} tokens/s aggregate"),
        ("prefill per request", f"{roof.prefill_s_per_request * 1e3:.1f} ms ({w.input_len} tokens)"),
        ("request latency", f"{roof.request_latency_s_batch1:.2f} s at batch 1, "
                            f"{roof.request_latency_s:.2f} s at batch {roof.batch}"),
        ("basis", roof.basis),
    ]))
    if plan.warnings:
        out.append(_kv_table("Warnings", [("!", msg) for msg in plan.warnings]))
    return out
