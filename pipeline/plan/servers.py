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


def server_settings(plan: Plan, server: str) -> ServerSettings:
    """`server`'s settings for an engine plan (UserError for a server or plan they cannot express)."""
    if server not in SERVERS:
        raise UserError(f"unknown server {server!r}; choose one of {', '.join(SERVERS)}")
    if plan.backend != "engine" or plan.build_config is None:
        raise UserError(f"{server} settings come from a GPU engine plan; this plan is for the {plan.backend} "
                        f"backend on {plan.target.name}")
    return (_vllm if server == "vllm" else _tgi)(plan)


def equivalents(plan: Plan) -> dict[str, dict]:
    """Every server's settings for plan.json (empty for a plan they cannot express)."""
    if plan.backend != "engine" or plan.build_config is None:
        return {}
    return {server: server_settings(plan, server).to_dict() for server in SERVERS}


def _vllm(plan: Plan) -> ServerSettings:
    build, memory = plan.build_config, plan.memory
    used = memory.weights_bytes_per_rank + memory.activation_bytes + memory.kv_cache_bytes
    fraction = used / memory.memory_bytes
    settings = [
        Setting("--tensor-parallel-size", str(plan.tp_size), "the plan's tp"),
        Setting("--pipeline-parallel-size", str(plan.pp_size), "the plan's pp"),
        Setting("--dtype", plan.dtype, "the engine dtype"),
        Setting("--max-model-len", str(plan.max_seq_len), "max_seq_len (longest prompt + output)"),
        Setting("--max-num-seqs", str(build.max_batch_size), "max_batch_size (sequences per step)"),
        Setting("--max-num-batched-tokens", str(max(build.max_num_tokens, build.max_batch_size)),
                f"max_num_tokens {build.max_num_tokens} (vLLM needs at least max-num-seqs)"),
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
    notes += _quantization_notes(plan, "--quantization fp8")
    return ServerSettings("vllm", settings, notes)


def _tgi(plan: Plan) -> ServerSettings:
    if plan.pp_size > 1:
        raise UserError(f"TGI shards by tensor parallelism only (--num-shard); this plan uses pp {plan.pp_size}")
    build, triton = plan.build_config, plan.triton
    settings = [
        Setting("--num-shard", str(plan.tp_size), "the plan's tp"),
        Setting("--dtype", plan.dtype, "the engine dtype"),
        Setting("--max-input-tokens", str(build.max_input_len), "max_input_len"),
        Setting("--max-total-tokens", str(plan.max_seq_len), "max_seq_len (input + new tokens per request)"),
        Setting("--max-batch-prefill-tokens", str(build.max_num_tokens), "max_num_tokens (tokens per step)"),
        Setting("--max-batch-total-tokens", str(plan.memory.kv_cache_tokens),
                "the KV cache's tokens (max_tokens_in_paged_kv_cache)"),
        Setting("--max-concurrent-requests", str(build.max_batch_size + triton.max_queue_size),
                f"max_batch_size {build.max_batch_size} in flight + max_queue_size {triton.max_queue_size} "
                "queued: Triton rejects beyond that, as TGI does"),
    ]
    kv = KV_CACHE_DTYPE["tgi"].get(plan.kv_cache_dtype)
    if kv:
        settings.append(Setting("--kv-cache-dtype", kv, f"KV cache {plan.kv_cache_dtype}"))
    notes = ["TGI has no batch-size knob on GPUs: the batch grows until --max-batch-total-tokens is used up",
             "TGI's --max-batch-prefill-tokens budgets prefill only; max_num_tokens budgets every step"]
    notes += _quantization_notes(plan, "--quantize fp8")
    return ServerSettings("tgi", settings, notes)


def _quantization_notes(plan: Plan, flag: str) -> list[str]:
    if plan.precision == "fp8":
        return [f"the plan's FP8 weights are calibrated (static scales); {flag} quantizes at load time without "
                "calibration, and is not the same model"]
    if plan.precision == "int8-sq":
        return ["INT8 SmoothQuant has no equivalent here: serve the fp16/bf16 weights or plan fp8"]
    return []
