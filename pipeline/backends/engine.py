"""The engine backend: a TensorRT-LLM 1.2.1 engine built by trtllm-build, served by Triton's `tensorrtllm` backend.

- plan: in-flight batching, BuildConfig / PluginConfig values and the optimization profiles trtllm-build
  derives from them, and the `tensorrt_llm` model's parameters (`plan_engine`);
- build: `trtpipe compile` (pipeline/compile.py) writes the trtllm-build command and builds the engine;
- deploy: the `tensorrt_llm` model names the engine directory (`gpt_model_path`, which need not exist
  yet) and carries the plan's parameters with the backend's documented defaults for the rest; no files.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

from ..triton_names import GUARANTEED_NO_EVICT
from .. import TRTLLM_VERSION
from ..errors import UserError
from ..plan.memory import (
    ACTIVATION_BASIS,
    CUDA_CONTEXT_RESERVE,
    ACTIVATION_FORMULA,
    RESERVE_FORMULA,
    activation_bytes,
    decode_step_seconds,
    format_gib,
    host_allreduce_seconds,
    kv_bytes_per_token,
    prefill_seconds,
    roofline,
    runtime_reserve_bytes,
    weights_per_rank_by_stage,
    weights_read_per_step,
)
from ..plan.performance import Workpoint
from ..plan.serving_choice import largest_batch, plan_serving
from ..plan.policy import PlanRequest, latency_batch_cap, queue_bound
from ..plan.schema import (BuildConfig, EngineBuild, MemoryBudget, Overrides, Plan, PluginConfig, TritonParams,
                           Workload)
from ..precisions import PRECISIONS, WEIGHT_BITS
from ..plan.trtllm import (
    MAX_BATCH_SIZE_CAP,
    MAX_NUM_TOKENS_WARN,
    derive_profiles,
    paged_context_fmha_possible,
    quantization,
)
from .capabilities import runnable
from ..targets import Target
from .nvidia_contract import TENSORRTLLM, required_keys
from .base import parameter_string, tritonserver_args
from .names import ENGINE, INFLIGHT_BATCHER, INFLIGHT_BATCHING, MODEL_REPOSITORY, TRTLLM_CHECKPOINT
from ..compile import compile_checkpoint
from ..runtime.speculative import DRAFT
from ..plan.speculative import LOOKAHEAD

TRITON_BACKEND = "tensorrtllm"
#: Triton's default and NVIDIA's advice: "cannot be set to 1.0" (perf-best-practices.md).
DEFAULT_KV_FRACTION = 0.9
#: Parameters of NVIDIA's tensorrt_llm config.pbtxt (tensorrtllm_backend@c2e65b8, docs/upstream-facts.md §B).
TRTLLM_PARAMETERS = {
    "max_beam_width", "FORCE_CPU_ONLY_INPUT_TENSORS", "gpt_model_type", "gpt_model_path", "encoder_model_path",
    "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length", "batch_scheduler_policy",
    "kv_cache_free_gpu_mem_fraction", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes",
    "kv_cache_onboard_blocks", "exclude_input_in_output", "cancellation_check_period_ms",
    "stats_check_period_ms", "iter_stats_max_iterations", "request_stats_max_iterations",
    "enable_kv_cache_reuse", "normalize_log_probs", "enable_chunked_context", "gpu_device_ids",
    "participant_ids", "num_nodes", "lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size",
    "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes", "lora_prefetch_dir", "decoding_mode",
    "executor_worker_path", "lookahead_window_size", "lookahead_ngram_size",
    "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
    "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size",
    "speculative_decoding_fast_logits", "tokenizer_dir", "guided_decoding_backend",
    "xgrammar_tokenizer_info_path", "enable_trt_overlap",
}
#: tensorrt_llm parameters deploy always writes, with the backend's documented default when the plan
#: does not name them (BE:docs/model_config.md), so nothing is unset by accident.
TRTLLM_PARAMETER_DEFAULTS = {
    "gpt_model_type": "inflight_fused_batching",
    "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    "batch_scheduler_policy": "guaranteed_no_evict",
    "kv_cache_free_gpu_mem_fraction": "0.9",
    "enable_chunked_context": "false",
    "enable_kv_cache_reuse": "false",
    "exclude_input_in_output": "false",
    "normalize_log_probs": "true",
}


class EngineBackend:
    name = ENGINE
    triton_backend = TRITON_BACKEND
    target_kinds = ("gpu",)
    builds_engine = True
    exact_checkpoint_dtype = True
    serves_embedded = False   # needs a GPU and the tensorrtllm backend: --url
    memory_scope = "per GPU"
    layout = INFLIGHT_BATCHER
    batching = INFLIGHT_BATCHING
    request_priorities = False   # tensorrtllm builds executor::Request without one (docs/upstream-facts.md)
    sparse_kernels = True        # trtllm-build --weight_sparsity: TensorRT times sparse tactics per layer
    # the C++ executor reads it first, then its legacy name TLLM_GPTM_PROFILE_START_STOP (docs/upstream-facts.md K)
    profile_start_stop_env = "TLLM_PROFILE_START_STOP"
    checkpoint_format = TRTLLM_CHECKPOINT
    summary = f"a TensorRT-LLM {TRTLLM_VERSION} engine (trtllm-build) in Triton's tensorrtllm backend"
    #: trtllm-build's --speculative_decoding_mode (commands/build.py; examples/draft_target_model/README.md)
    speculative_methods = {DRAFT: "draft_tokens_external", LOOKAHEAD: "lookahead_decoding"}
    drafts_through_bls = True

    def configure_speculation(self, plan: Plan) -> Plan:
        """The target engine built to verify K external drafts a step (`--speculative_decoding_mode` in the
        trtllm-build command, `max_draft_len` in its build config too). Draft-target runs through NVIDIA's BLS,
        which calls the draft and target models with decoupled=False and refuses streaming with drafts
        (tensorrt_llm_bls/1/lib, tensorrtllm_backend c2e65b8): the repository is not decoupled, and every step
        sends the whole sequence again, which only KV-cache reuse keeps from being computed again."""
        spec = plan.speculative
        plan = replace(plan, build_config=replace(plan.build_config, max_draft_len=spec.draft_len),
                       speculative=replace(spec, decoding_mode=self.speculative_methods[spec.method]))
        if spec.method != DRAFT:
            return plan
        warnings = [*plan.warnings, (
            f"draft-target runs through tensorrt_llm_bls: clients send num_draft_tokens {spec.draft_len} to it, "
            "without streaming (NVIDIA's BLS drafts for non-streaming requests only), and the repository is not "
            "decoupled; requests without num_draft_tokens, and the ensemble's, decode plainly")]
        if not plan.triton.enable_kv_cache_reuse:
            warnings.append("draft-target without KV-cache reuse (paged context FMHA is off): every step of the BLS "
                            "computes the whole sequence again on both models")
        return replace(plan, triton=replace(plan.triton, decoupled_mode=False), warnings=warnings)

    def plan(self, request: PlanRequest) -> Plan:
        return plan_engine(request)

    def checkpoint_dtype(self, plan: Plan) -> str:
        return plan.dtype   # the engine's dtype: compile refuses a checkpoint in another

    def build_artifact(self, checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool, force: bool):
        return compile_checkpoint(checkpoint, plan, out, dry_run=dry_run, force=force)

    def check_artifacts(self, engine: Path | None, checkpoint: Path | None) -> tuple[Path | None, Path | None]:
        if engine is None:
            raise UserError("the engine backend serves a TensorRT-LLM engine: pass --engine DIR (the directory "
                            "`trtpipe compile` writes to; it need not exist yet)")
        engine = Path(engine).resolve()
        if engine.exists() and not engine.is_dir():
            raise UserError(f"--engine {engine} is a file; pass the engine directory")
        return engine, Path(checkpoint).resolve() if checkpoint else None

    def repository_inputs(self, engine: Path | None, checkpoint: Path | None) -> list[Path]:
        config = engine / "config.json"
        return [config] if config.is_file() else []

    def model_parameters(self, plan: Plan, engine: Path | None) -> dict[str, str]:
        return engine_parameters(plan, engine)

    def serve_command(self, plan: Plan, model_repository: str = MODEL_REPOSITORY,
                      extra_args: tuple[str, ...] = ()) -> list[str]:
        return engine_serve_command(plan.tp_size * plan.pp_size, model_repository, extra_args)

    def write_model(self, version_dir: Path, checkpoint: Path | None) -> None:
        """Nothing: the engine is referenced by gpt_model_path, not copied."""


BACKEND = EngineBackend()


# ----------------------------------------------------------------------------------------------
# Planning choices


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


def paged_context_fmha_warning(why: str) -> str:
    """The plan's warning when TensorRT-LLM switches paged context FMHA off (`why`: its reason)."""
    return f"paged context FMHA off: {why}; so no KV-cache reuse and no chunked context"


def choose_plugins(precision: str, kv_cache_dtype: str, dtype: str, target: Target, tp: int,
                   overrides: Overrides, multiple_profiles: bool) -> tuple[PluginConfig, list[str]]:
    warnings = []
    possible, why = paged_context_fmha_possible(precision, kv_cache_dtype)
    paged_ctx = possible if overrides.use_paged_context_fmha is None else overrides.use_paged_context_fmha
    if paged_ctx and not possible:
        raise UserError(f"--paged-context-fmha contradicts --precision {precision} with a "
                        f"{kv_cache_dtype} KV cache: {why}")
    if not paged_ctx and why:
        warnings.append(paged_context_fmha_warning(why))
    fp8_ctx = precision == "fp8" and kv_cache_dtype == "fp8" and target.supports_fp8 and paged_ctx
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


def choose_weight_sparsity(pattern: str | None, precision: str, plugin: PluginConfig) -> tuple[bool, list[str]]:
    """`--weight_sparsity` for a checkpoint that claims 2:4, with the gemm plugin off (so `plugin` changes) and
    the warnings that say what it costs and what it does not promise.

    The flag only lets TensorRT time sparse tactics against dense ones per layer; a GEMM in a plugin (the gemm
    plugin's cuBLASLt, SmoothQuant's plugin) never sees one (docs/sparsity.md). No speedup is planned for.
    """
    if pattern is None:
        return False, []
    warnings = [f"{pattern} sparse checkpoint: built with --weight_sparsity; TensorRT keeps a sparse tactic only "
                "where it times faster than the dense one, and on an RTX 4090 it picked none for FP8 Llama-3-8B "
                "(TensorRT-LLM #1913): this plan assumes no speedup; compile's engine manifest lists the layers "
                "that went sparse"]
    if plugin.gemm_plugin is not None:
        plugin.gemm_plugin = None
        warnings.append("gemm plugin off (its cuBLASLt GEMMs have no sparse tactics): NVIDIA recommends it for "
                        "FP16/BF16 GEMMs, so a layer TensorRT keeps dense may run slower than with it; unmeasured "
                        "here, and not in the throughput this plan predicts")
    if precision == "int8-sq":
        warnings.append("int8-sq: the SmoothQuant GEMMs run in TensorRT-LLM's SmoothQuant plugin "
                        "(smooth_quant_plugins, on by default), which has no sparse tactics: expect no quantized "
                        "linear to go sparse")
    return True, warnings


def _round_down_to_blocks(tokens: int, tokens_per_block: int) -> int:
    return tokens // tokens_per_block * tokens_per_block


def _blocks_tokens(tokens: int, tokens_per_block: int) -> int:
    return math.ceil(tokens / tokens_per_block) * tokens_per_block



def plan_engine(request: PlanRequest) -> Plan:
    """An engine with in-flight batching: the largest batch whose sequences fit the KV cache left after
    weights, activations and runtime buffers, and the build and Triton parameters that agree with it."""
    model, target, precision, dtype = request.model, request.target, request.precision, request.dtype
    kv_dtype, tp, pp, workload, overrides = (request.kv_cache_dtype, request.tp, request.pp, request.workload,
                                             request.overrides)
    max_context, warnings = request.max_context, list(request.warnings)
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
    sparse, sparse_warnings = choose_weight_sparsity(model.checkpoint_sparsity, precision, plugin)
    warnings += sparse_warnings
    if overrides.enable_kv_cache_reuse and not plugin.use_paged_context_fmha:
        raise UserError("--kv-cache-reuse needs an engine built with paged context FMHA, which this plan "
                        "does not have (tensorrtllm_backend#271: \"When KV cache block reuse is set, model "
                        "has to be built with paged context FMHA support\")")
    if max_num_tokens > MAX_NUM_TOKENS_WARN:
        warnings.append(f"max_num_tokens {max_num_tokens} > 16384: TensorRT-LLM warns it may exceed the "
                        "TensorRT tensor volume, and it takes memory from the KV cache")

    stages = weights_per_rank_by_stage(arch, precision, dtype, tp, pp, model.quantized_lm_head)
    weights_per_rank = max(stages)
    weights_total = tp * sum(stages)
    kv_per_token = kv_bytes_per_token(arch, kv_dtype, tp, pp)
    draft = request.companion
    draft_weights, draft_kv = (draft.weights_bytes_per_rank, draft.kv_bytes_per_token) if draft else (0, 0)
    tpb = plugin.tokens_per_block
    seq_tokens = _blocks_tokens(workload.input_len + workload.output_len, tpb)
    memory = target.memory_bytes
    if weights_per_rank + draft_weights >= memory:
        beside = f" beside its draft's {format_gib(draft_weights)}" if draft else ""
        raise UserError(f"{model.name} at {precision} needs {format_gib(weights_per_rank)} of weights per "
                        f"GPU{beside}; {target.name} has {format_gib(memory)}: "
                        f"{too_big_hint(target, precision, tp, pp, weights_per_rank + draft_weights)}")

    def kv_tokens_for(batch: int, tokens: int | None = None) -> tuple[int, int, int, int]:
        tokens = max_num_tokens if tokens is None else tokens
        act = activation_bytes(arch, precision, dtype, tp, min(tokens, max_seq_len * batch), batch)
        reserve = runtime_reserve_bytes(arch, tp, batch, max_seq_len)
        if draft:    # the draft runs the same tokens a step and keeps its own decoder buffers
            act += activation_bytes(draft.arch, draft.precision, draft.dtype, tp, min(tokens, max_seq_len * batch),
                                    batch)
            reserve += runtime_reserve_bytes(draft.arch, tp, batch, max_seq_len) - CUDA_CONTEXT_RESERVE
        free = memory - weights_per_rank - draft_weights - act - reserve
        kv_bytes = int(max(free, 0) * fraction)
        return act, reserve, free, _round_down_to_blocks(kv_bytes // (kv_per_token + draft_kv), tpb)

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
            f"no room for the KV cache: after {format_gib(weights_per_rank)} of weights"
            f"{f' (and its draft model: {format_gib(draft_weights)})' if draft else ''}, {format_gib(act)} "
            f"of activations (max_num_tokens {max_num_tokens}) and {format_gib(reserve)} of runtime reserve, "
            f"{target.name} keeps {kv_tokens} tokens of KV cache, fewer than one sequence of "
            f"max context {max_seq_len}. Lower --max-context, use --kv-cache fp8/int8, a lower "
            "precision or more GPUs (--tp)")
    fit = kv_tokens // seq_tokens
    context = workload.input_len + workload.output_len / 2
    prefill_s = prefill_seconds(arch, workload.input_len, precision, tp, target)
    read = weights_read_per_step(arch, precision, dtype, tp, pp, model.quantized_lm_head)
    if workload.p99_latency_s is not None:
        cap = latency_batch_cap(workload.p99_latency_s, prefill_s, workload, read, context,
                                kv_per_token, target)
        if overrides.max_batch_size is not None and overrides.max_batch_size > cap:
            raise UserError(f"--max-batch-size {overrides.max_batch_size} contradicts --p99-latency "
                            f"{workload.p99_latency_s:g}: at most {cap} sequences per step meet it")
        if batch > cap:
            batch = cap
            act, reserve, free, kv_tokens = kv_tokens_for(batch)
            fit = kv_tokens // seq_tokens
    if max_num_tokens > max_seq_len * batch:
        if overrides.max_num_tokens is not None:
            raise UserError(f"--max-num-tokens {max_num_tokens} exceeds max_seq_len x max_batch_size "
                            f"({max_seq_len} x {batch}); trtllm-build would clamp it")
        max_num_tokens = max_seq_len * batch
    point = Workpoint(arch, precision, kv_dtype, plugin.use_fp8_context_fmha, tp, pp, batch, workload.input_len,
                      workload.output_len, max_num_tokens)
    sol_step = decode_step_seconds(read, batch, context, kv_per_token, target)
    point, performance, serving_warnings = plan_serving(request, point, chunked, max_seq_len, prefill_s, sol_step)
    warnings += serving_warnings
    if (point.batch, point.max_num_tokens) != (batch, max_num_tokens):
        batch, max_num_tokens = point.batch, point.max_num_tokens
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
    if tp > 1 and not target.p2p:
        warnings.append(no_p2p_warning(arch, target, dtype, tp, pp, concurrent, read, kv_per_token,
                                       context))

    opt_num_tokens = overrides.opt_num_tokens
    if opt_num_tokens is not None and not 1 <= opt_num_tokens <= max_num_tokens:
        raise UserError(f"--opt-num-tokens {opt_num_tokens} must be between 1 and max_num_tokens {max_num_tokens}")
    if opt_num_tokens is None and not multiple_profiles:
        opt_num_tokens = min(batch, max_num_tokens)   # check_max_num_tokens' own default, made explicit

    build = BuildConfig(max_input_len=max_input_len, max_seq_len=max_seq_len, max_batch_size=batch,
                        max_beam_width=1, max_num_tokens=max_num_tokens, opt_num_tokens=opt_num_tokens,
                        weight_sparsity=sparse)
    reuse = overrides.enable_kv_cache_reuse
    reuse = plugin.use_paged_context_fmha if reuse is None else reuse
    triton = TritonParams(
        triton_backend=TRITON_BACKEND, triton_max_batch_size=batch, decoupled_mode=True,
        max_queue_delay_microseconds=0, **queue_bound(batch),
        preferred_batch_size=[batch], max_beam_width=1, batching_strategy="inflight_fused_batching",
        batch_scheduler_policy=overrides.batch_scheduler_policy or GUARANTEED_NO_EVICT,
        kv_cache_free_gpu_mem_fraction=fraction,
        # The runtime takes min(this, fraction x free memory it measures): the cache never exceeds the
        # plan, and a smaller real free memory still bounds it (tensorrtllm_backend docs/model_config.md).
        max_tokens_in_paged_kv_cache=kv_tokens, enable_chunked_context=plugin.use_paged_context_fmha,
        enable_kv_cache_reuse=reuse)
    budget = MemoryBudget(
        memory_bytes=memory, weights_bytes_per_rank=weights_per_rank, activation_bytes=act,
        activation_formula=ACTIVATION_FORMULA, activation_basis=ACTIVATION_BASIS, runtime_reserve_bytes=reserve,
        runtime_reserve_formula=RESERVE_FORMULA, free_bytes=free, kv_cache_free_gpu_mem_fraction=fraction,
        kv_cache_bytes=kv_tokens * kv_per_token, kv_cache_tokens=kv_tokens,
        draft_bytes=draft_weights + kv_tokens * draft_kv if draft else 0)
    return Plan(
        model=model, target=target, backend=ENGINE, precision=precision, dtype=dtype, kv_cache_dtype=kv_dtype,
        quantization=quantization(precision, kv_dtype), tp_size=tp, pp_size=pp, workload=workload,
        max_seq_len=max_seq_len,
        weights_bytes=weights_total, weights_bytes_per_rank=weights_per_rank, kv_bytes_per_token=kv_per_token,
        max_concurrent_sequences=concurrent, memory=budget,
        engine=EngineBuild("trtllm-build", TRTLLM_VERSION, world_size=tp * pp, sm=target.sm),
        build_config=build, plugin_config=plugin, optimization_profiles=derive_profiles(build, plugin),
        triton=triton, roofline=roofline(target, workload, read, kv_per_token, concurrent, prefill_s),
        warnings=warnings, performance=performance)


def engine_serve_command(world_size: int, model_repository: str, extra_args: tuple[str, ...] = ()) -> list[str]:
    """Triton for an engine of `world_size` GPU ranks, as tensorrtllm_backend's launch_triton_server.py
    starts it (leader mode): one GPU, one tritonserver; more, one tritonserver per rank under mpirun, the
    ranks after the first loading only the tensorrt_llm model (rank r drives GPU r of the node)."""
    if world_size == 1:
        return tritonserver_args(model_repository, 0, extra_args)
    command = ["mpirun", "--allow-run-as-root"]
    for rank in range(world_size):
        args = tritonserver_args(model_repository, rank, extra_args)
        if rank:
            args[2:2] = ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
        command += ["-n", "1", *args, ":"]
    return command[:-1]


def no_p2p_warning(arch, target: Target, dtype: str, tp: int, pp: int, batch: int, weights_per_rank: int,
                   kv_per_token: int, context: float) -> str:
    """What the missing peer-to-peer access costs a decode step, next to the step's memory-bound time."""
    count, seconds = host_allreduce_seconds(arch, dtype, tp, pp, batch)
    step = decode_step_seconds(weights_per_rank, batch, context, kv_per_token, target)
    return (f"{target.name} has no GPU peer-to-peer access ({target.interconnect}): every tensor-parallel "
            f"all-reduce is staged through host memory. A decode step makes {count} of them; at batch {batch} "
            f"moving their data over PCIe 4.0 x16 takes at least {seconds * 1e3:.1f} ms, next to the step's "
            f"{step * 1e3:.1f} ms memory-bound estimate (the roofline leaves it out), plus a per-call latency "
            "not modelled here that dominates at small batch (NVIDIA/TensorRT-LLM#1625)")


def too_big_hint(target: Target, precision: str, tp: int, pp: int, weights_per_rank: int) -> str:
    """What could make the weights fit: a lower precision the target runs, or the fewest GPUs (by doubling
    tp, the weights split about evenly) that could hold them, or a bigger GPU."""
    options = []
    lower = runnable([p for p in PRECISIONS if WEIGHT_BITS[p] < WEIGHT_BITS[precision]], backend=ENGINE, sm=target.sm)
    if lower:
        options.append(f"a lower precision ({', '.join(lower)})")
    more = tp * 2
    while more * pp <= target.max_gpus and weights_per_rank * tp / more >= target.memory_bytes:
        more *= 2
    if more * pp <= target.max_gpus:
        options.append(f"more GPUs (--tp {more})")
    if not options:
        return (f"{target.name} has at most {target.max_gpus} GPUs and {precision} is already the lowest precision "
                "trtpipe plans: use a target with more memory per GPU")
    return "use " + " or ".join(options)


# ----------------------------------------------------------------------------------------------
# The tensorrt_llm model's parameters


def lookahead_parameters(plan: Plan) -> dict[str, str]:
    """A lookahead plan's executor parameters: decoding_mode "lookahead" and its window, n-gram and verification set
    sizes, which the backend reads only then and then requires (model_instance_state.cc; nvidia_contract)."""
    spec = plan.speculative
    if not (spec and spec.lookahead):
        return {}
    w, n, g = spec.lookahead
    return {"decoding_mode": "lookahead", "lookahead_window_size": str(w), "lookahead_ngram_size": str(n),
            "lookahead_verification_set_size": str(g)}


def engine_parameters(plan: Plan, engine: Path | None) -> dict[str, str]:
    """The tensorrtllm backend's parameters: the plan's, the backend defaults for the rest, the engine path."""
    triton = asdict(plan.triton)   # its other keys are config.pbtxt fields (batching, decoupled mode)
    params = dict(TRTLLM_PARAMETER_DEFAULTS)
    params["gpt_model_type"] = str(triton.get("batching_strategy") or params["gpt_model_type"])
    params["max_beam_width"] = str(int(plan.build_config.max_beam_width if plan.build_config else 1))
    for key, value in triton.items():
        if key in TRTLLM_PARAMETERS and value is not None:
            params[key] = parameter_string(value)
    params["gpt_model_path"] = str(engine)
    # The backend reads these outside any try/catch and fails to load without them (nvidia_contract); "" is its
    # "not set": guided decoding off, tokenizer_dir unused by the C++ model.
    for key in required_keys(TENSORRTLLM):
        params.setdefault(key, "")
    params.update(lookahead_parameters(plan))
    wants_paged_fmha = [k for k in ("enable_kv_cache_reuse", "enable_chunked_context") if params[k] == "true"]
    if wants_paged_fmha and plan.plugin_config is not None and plan.plugin_config.use_paged_context_fmha is False:
        raise UserError(f"the plan sets {' and '.join(wants_paged_fmha)} but builds the engine without "
                        "use_paged_context_fmha; re-run `trtpipe plan` (both need paged context FMHA)")
    return params
