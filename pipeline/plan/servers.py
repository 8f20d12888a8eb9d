"""The same plan for vLLM and TGI: their launch settings that give the same batch, context and KV-cache
budget as an engine plan, each with the arithmetic that produced it and where the servers differ.

The concepts map one to one only in part (docs/serving-equivalents.md has the table and its sources):
- vLLM's `--gpu-memory-utilization` is a fraction of the GPU's *total* memory for weights, activations
  and KV cache; TensorRT-LLM's `kv_cache_free_gpu_mem_fraction` is a fraction of what is *left* after
  weights and buffers. The plan's figures are converted, not copied.
- TGI budgets the KV cache in tokens (`--max-batch-total-tokens`), like `max_tokens_in_paged_kv_cache`,
  and has no batch-size knob on GPUs: it admits up to `--max-concurrent-requests` and rejects the rest.
- Quantization: the plan's FP8 is a calibrated checkpoint (static scales); `--quantization fp8` (vLLM) and
  `--quantize fp8` (TGI) quantize the bf16/fp16 weights at load time with no calibration. INT8
  SmoothQuant has no equivalent in either.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from .schema import Plan

SERVERS = ("vllm", "tgi")
#: the plan's KV-cache dtype -> each server's --kv-cache-dtype (None: the model dtype, the default)
KV_CACHE_DTYPE = {"vllm": {"fp8": "fp8_e4m3"}, "tgi": {"fp8": "fp8_e4m3fn"}}


@dataclass(frozen=True)
class Setting:
    flag: str
    value: str
    arithmetic: str            # how the value follows from the plan


@dataclass(frozen=True)
class ServerSettings:
    server: str
    settings: list[Setting]
    notes: list[str] = field(default_factory=list)

    def launch_line(self, model: str) -> str:
        program = {"vllm": ["vllm", "serve", model], "tgi": ["text-generation-launcher", "--model-id", model]}
        words = program[self.server] + [w for s in self.settings for w in (s.flag, s.value)]
        return shlex.join(words)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Budget:
    """What the servers' flags are derived from, read from whichever settings the plan's backend has: the engine's
    BuildConfig, or the LLM API options of a PyTorch-backend plan (the same budget, no engine)."""

    max_batch_size: int
    max_num_tokens: int
    max_input_len: int
    source: str                # where the batch and token figures come from, for the arithmetic notes
    input_note: str            # how max_input_len was found


def serving_budget(plan: Plan) -> Budget | None:
    """The plan's batch/token budget, or None for a plan no GPU server can express (the cpu target's)."""
    if plan.build_config is not None:
        build = plan.build_config
        return Budget(build.max_batch_size, build.max_num_tokens, build.max_input_len, "BuildConfig", "max_input_len")
    options = plan.llm_api.options if plan.llm_api else None
    if plan.target.is_gpu and options:
        # The LLM API bounds a prompt only by max_seq_len: at least one token must be left to generate.
        return Budget(options["max_batch_size"], options["max_num_tokens"], options["max_seq_len"] - 1,
                      "the LLM API options", "max_seq_len - 1 (the LLM API has no separate input limit here)")
    return None


def server_settings(plan: Plan, server: str) -> ServerSettings:
    """`server`'s settings for a GPU plan (UserError for a server or plan they cannot express)."""
    if server not in SERVERS:
        raise UserError(f"unknown server {server!r}; choose one of {', '.join(SERVERS)}")
    budget = serving_budget(plan)
    if budget is None:
        raise UserError(f"{server} settings come from a GPU plan (an engine or the PyTorch backend); this plan is "
                        f"for the {plan.backend} backend on {plan.target.name}")
    return (_vllm if server == "vllm" else _tgi)(plan, budget)


def equivalents(plan: Plan) -> dict[str, dict]:
    """Every server's settings for plan.json; for a plan they cannot express, why not (under each server)."""
    if serving_budget(plan) is None:
        return {server: {"server": server, "settings": [], "notes": [
            f"no equivalent: the {plan.target.name} target's {plan.backend} backend runs trtpipe's reference runtime "
            f"on the host; {server} settings are planned for GPU targets"]} for server in SERVERS}
    result = {}
    for server in SERVERS:
        try:
            result[server] = server_settings(plan, server).to_dict()
        except UserError as exc:
            result[server] = {"server": server, "settings": [], "notes": [f"no equivalent: {exc}"]}
    return result


def _vllm(plan: Plan, budget: Budget) -> ServerSettings:
    memory = plan.memory
    used = memory.weights_bytes_per_rank + memory.activation_bytes + memory.kv_cache_bytes
    fraction = used / memory.memory_bytes
    settings = [
        Setting("--tensor-parallel-size", str(plan.tp_size), "the plan's tp"),
        Setting("--pipeline-parallel-size", str(plan.pp_size), "the plan's pp"),
        Setting("--dtype", plan.dtype, "the engine dtype"),
        Setting("--max-model-len", str(plan.max_seq_len), "max_seq_len (longest prompt + output)"),
        Setting("--max-num-seqs", str(budget.max_batch_size),
                f"max_batch_size of {budget.source} (sequences per step)"),
        Setting("--max-num-batched-tokens", str(max(budget.max_num_tokens, budget.max_batch_size)),
                f"max_num_tokens {budget.max_num_tokens} of {budget.source} (vLLM needs at least max-num-seqs)"),
        Setting("--gpu-memory-utilization", f"{fraction:.3f}",
                f"(weights {memory.weights_bytes_per_rank} + activations {memory.activation_bytes} + KV cache "
                f"{memory.kv_cache_bytes} bytes) / {memory.memory_bytes} bytes of GPU memory"),
    ]
    kv = KV_CACHE_DTYPE["vllm"].get(plan.kv_cache_dtype)
    if kv:
        settings.append(Setting("--kv-cache-dtype", kv, f"KV cache {plan.kv_cache_dtype}"))
    notes = [f"--gpu-memory-utilization is a share of total memory (weights included), unlike TensorRT-LLM's "
             f"kv_cache_free_gpu_mem_fraction {memory.kv_cache_free_gpu_mem_fraction} of what is left after the "
             "weights: the value above gives vLLM the plan's KV-cache bytes, less what vLLM's own CUDA graphs "
             "and sampler take",
             "vLLM runs chunked prefill by default: max-num-batched-tokens caps each step's tokens, as "
             "max_num_tokens does"]
    notes += _quantization_notes(plan, "--quantization fp8", "vllm")
    return ServerSettings("vllm", settings, notes)


def _tgi(plan: Plan, budget: Budget) -> ServerSettings:
    if plan.pp_size > 1:
        raise UserError(f"TGI shards by tensor parallelism only (--num-shard); this plan uses pp {plan.pp_size}")
    triton = plan.triton
    settings = [
        Setting("--num-shard", str(plan.tp_size), "the plan's tp"),
        Setting("--dtype", plan.dtype, "the engine dtype"),
        Setting("--max-input-tokens", str(budget.max_input_len), budget.input_note),
        Setting("--max-total-tokens", str(plan.max_seq_len), "max_seq_len (input + new tokens per request)"),
        Setting("--max-batch-prefill-tokens", str(budget.max_num_tokens),
                f"max_num_tokens of {budget.source} (tokens per step)"),
        Setting("--max-batch-total-tokens", str(plan.memory.kv_cache_tokens),
                "the KV cache's tokens (max_tokens_in_paged_kv_cache)"),
        Setting("--max-concurrent-requests", str(budget.max_batch_size + triton.max_queue_size),
                f"max_batch_size {budget.max_batch_size} in flight + max_queue_size {triton.max_queue_size} "
                "queued: Triton rejects beyond that, as TGI does"),
    ]
    kv = KV_CACHE_DTYPE["tgi"].get(plan.kv_cache_dtype)
    if kv:
        settings.append(Setting("--kv-cache-dtype", kv, f"KV cache {plan.kv_cache_dtype}"))
    notes = ["TGI has no batch-size knob on GPUs: the batch grows until --max-batch-total-tokens is used up",
             "TGI's --max-batch-prefill-tokens budgets prefill only; max_num_tokens budgets every step"]
    notes += _quantization_notes(plan, "--quantize fp8", "tgi")
    return ServerSettings("tgi", settings, notes)


def _quantization_notes(plan: Plan, flag: str, server: str) -> list[str]:
    if plan.precision == "fp8" and plan.llm_api:
        return [f"the plan's FP8 weights are the calibrated Hugging Face checkpoint the PyTorch backend loads "
                f"(ModelOpt format, static scales): serve that same checkpoint, not {flag}, which quantizes the "
                "16-bit weights at load time without calibration and is not the same model"]
    if plan.precision == "fp8":
        return [f"the plan's FP8 weights are calibrated (static scales); {flag} quantizes at load time without "
                "calibration, and is not the same model"]
    if plan.precision == "int8-sq":
        return ["INT8 SmoothQuant has no equivalent here: serve the fp16/bf16 weights or plan fp8"]
    if plan.precision == "int4-awq" and server == "vllm":
        return ["the plan's 4-bit weights for vLLM: `trtpipe calibrate CHECKPOINT -o OUT --precision int4-awq --format "
                "vllm` writes the same calibration as AutoAWQ's checkpoint, which vLLM's awq method loads from its "
                "config.json (no --quantization flag; docs/int4.md)"]
    if plan.precision == "int4-awq":
        return ["the plan's 4-bit weights: which 4-bit checkpoint TGI loads was not checked here (no TGI install); "
                "`calibrate --format vllm` writes AutoAWQ's checkpoint, the one vLLM serves"]
    return []
