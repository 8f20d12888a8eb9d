"""What a GPU plan will do: NVIDIA's AIConfigurator (aiconfigurator-core, `AIC_VERSION`) as the performance model.

AIConfigurator models TensorRT-LLM serving from kernel timings NVIDIA measured on real GPUs (`MEASURED`: l40s,
h100, h200 with TensorRT-LLM 1.3.0rc20 data, a100-80g with 1.0.0). For a plan it gives, at the plan's batch,
ISL/OSL, precision, KV-cache dtype and tp/pp:

- `prefill_s`: one request's prefill alone on the GPU, as TensorRT-LLM schedules it: the whole prompt in one step
  when max_num_tokens holds it, else chunk after chunk (`prefill_alone_ms`);
- `decode_step_s`: one decode step of the whole batch, at the mean context of the output;
- `ttft_s`, `tpot_s`, `output_tokens_per_s`: serving with in-flight batching (AIC's `agg` mode: each iteration
  carries the batch's decode tokens plus prefill chunks up to max_num_tokens, so TTFT grows with load and the
  throughput pays for the prefills); at batch 1 (one closed-loop client, who waits behind no other request) the
  TTFT is the prefill alone (`one_sequence`);
- the memory it needs (weights, activations, KV cache of the batch, the runtime's other 3.5 GiB) and whether that
  fits the card's usable memory.

A target NVIDIA has not measured (`DERIVED_FROM`: rtx4090 from l40s, both AD102 sm_89; a100-40g and rtx3090 from
a100-80g, Ampere) is derived from its nearest measured chip, operation by operation from the two cards'
speed-of-light times, max(FLOPs / tensor rate, bytes / bandwidth) as AIC splits it (`evaluate_ops_sol_json`), with
the rate that applies (the GEMM's precision; attention and the 16-bit lm_head at the 16-bit rate, FP32
accumulate): a compute-bound op is scaled by the ratio, a memory-bound one keeps its measured overhead above the
speed of light (`scaled_ops`). Serving figures are the source chip's in-flight figures
scaled by the prefill and decode-step ratios. docs/planner.md states the assumptions and the validation (h200
derived from h100 against AIC's own h200 data).

Each `Estimate` says what it is (`source`: measured | derived | speed-of-light) and carries AIC's speed-of-light
figures beside the measured ones; Mistral is planned through AIC's Llama model (`AIC_ARCHITECTURES`). Without
aiconfigurator-core, or for what it has no data for (INT8 SmoothQuant, an architecture it does not model), the plan
keeps trtpipe's own speed-of-light bound and says why. AIC is imported only here, on first use (docs/planner.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..arch import ModelArch
from ..targets import Target

AIC_VERSION = "0.12.0"
#: trtpipe target -> (AIC system, TensorRT-LLM version of its measured data)
MEASURED = {"l40s": ("l40s", "1.3.0rc20"), "h100": ("h100_sxm", "1.3.0rc20"), "h200": ("h200_sxm", "1.3.0rc20"),
            "a100-80g": ("a100_sxm", "1.0.0")}
#: target NVIDIA has not measured -> the measured target of the same architecture it is derived from
DERIVED_FROM = {"rtx4090": "l40s", "a100-40g": "a100-80g", "rtx3090": "a100-80g"}
MEASURED_SOURCE, DERIVED_SOURCE, SOL_SOURCE = "measured", "derived", "speed-of-light"
#: the cpu target's figures: its reference runtime timed on the planning host (plan/host_timing.py)
TIMED_SOURCE = "timed"
#: AIC's quantization names for trtpipe's precisions (16-bit GEMMs are modelled as bfloat16; no fp16 data)
GEMM_MODES = {"fp8": "fp8", "bf16": "bfloat16", "fp16": "bfloat16", "int4-awq": "int4_wo"}
#: what a precision's GEMM timings rest on when AIC's kernel is not the one the engine runs
GEMM_BASIS = {"int4-awq": "; int4-awq's GEMMs are AIC's per-channel int4 weight-only ones (int4_wo, the engine "
                          "path's WeightOnlyQuantMatmul plugin), standing in for the group-wise AWQ kernel "
                          "(WeightOnlyGroupwiseQuantMatmul), which it did not measure"}
KV_MODES = {"fp8": "fp8", "int8": "int8", "bfloat16": "bfloat16", "float16": "bfloat16"}
#: architectures AIC does not model by name -> the one it models with the same decoder layer (Mistral-7B: Llama's
#: GQA attention and SwiGLU MLP; AIC's Llama model reads every shape from the config it is given)
AIC_ARCHITECTURES = {"MistralForCausalLM": "LlamaForCausalLM"}
GIB = 1 << 30


@dataclass(frozen=True)
class Workpoint:
    """One serving configuration to estimate."""

    arch: ModelArch
    precision: str
    kv_cache_dtype: str
    fp8_context_fmha: bool
    tp: int
    pp: int
    batch: int
    isl: int
    osl: int
    max_num_tokens: int


@dataclass
class Estimate:
    source: str                        # measured | derived | speed-of-light
    basis: str
    prefill_s: float
    decode_step_s: float
    ttft_s: float
    tpot_s: float
    output_tokens_per_s: float
    memory_bytes: dict = field(default_factory=dict)   # weights, activations, kv_cache, others, total
    capacity_bytes: int = 0
    out_of_memory: bool = False
    speed_of_light: dict = field(default_factory=dict)  # prefill_s, decode_step_s (AIC's SOL mode or derived)

    def to_dict(self) -> dict:
        return asdict(self)


class NotModelled(Exception):
    """AIC has no data for this configuration; the message says why."""


# ------------------------------------------------------------------------------------------------- AIC access

def aic():
    """The AIC SDK modules, imported on first use (ImportError when aiconfigurator-core is missing)."""
    from aiconfigurator_core.sdk import common, config
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.models import get_model

    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)   # per-call notices about other models
    return common, config, get_backend, get_model


@functools.lru_cache(maxsize=None)
def database(system: str, version: str, mode: str = "SILICON"):
    from aiconfigurator_core.sdk.perf_database import get_database_view

    aic()
    db = get_database_view(system, "trtllm", version, database_mode=mode)
    if db is None:
        raise NotModelled(f"aiconfigurator-core has no {system} TensorRT-LLM {version} data")
    return db


def hf_config(arch: ModelArch) -> dict:
    """The Hugging Face config.json AIC reads a model from (under the name of the architecture it models it as)."""
    cfg = {"architectures": [AIC_ARCHITECTURES.get(arch.architecture, arch.architecture)],
           "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
           "num_hidden_layers": arch.num_hidden_layers,
           "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads,
           "head_dim": arch.head_size, "vocab_size": arch.vocab_size,
           "max_position_embeddings": arch.max_position_embeddings, "rope_theta": arch.rotary_base,
           "rms_norm_eps": arch.norm_epsilon, "hidden_act": arch.hidden_act,
           "tie_word_embeddings": arch.tie_word_embeddings, "torch_dtype": "bfloat16"}
    if arch.rotary_scaling:
        cfg["rope_scaling"] = arch.rotary_scaling
    if arch.sliding_window:
        cfg["sliding_window"] = arch.sliding_window
    return cfg


def model_basis(point: Workpoint) -> str:
    """How AIC models the plan's architecture when not by its own name ("" when it does)."""
    arch = point.arch
    stand_in = AIC_ARCHITECTURES.get(arch.architecture)
    if stand_in is None:
        return ""
    context, window = point.isl + point.osl, arch.sliding_window
    beyond = (f"; its attention ignores the {window}-token sliding window, so at this {context}-token context it is "
              "full attention's (an upper bound)" if window and context > window else "")
    return (f"; {arch.architecture} through AIC's {stand_in} model on its own config (the same GEMM and attention "
            f"shapes){beyond}")


def aic_model(point: Workpoint):
    """AIC's model of the plan's architecture and quantization (built once per configuration)."""
    key = (json.dumps(hf_config(point.arch), sort_keys=True), point.precision, point.kv_cache_dtype,
           point.fp8_context_fmha, point.tp, point.pp)
    if key not in MODELS:
        MODELS[key] = build_aic_model(point)
    return MODELS[key]


MODELS: dict = {}


def build_aic_model(point: Workpoint):
    common, config, _, get_model = aic()
    gemm = GEMM_MODES.get(point.precision)
    if gemm is None:
        raise NotModelled(f"aiconfigurator-core has no measured {point.precision} GEMMs for TensorRT-LLM")
    kv = KV_MODES.get(point.kv_cache_dtype, "bfloat16")
    model_config = config.ModelConfig(
        tp_size=point.tp, pp_size=point.pp, gemm_quant_mode=common.GEMMQuantMode[gemm],
        kvcache_quant_mode=common.KVCacheQuantMode[kv],
        fmha_quant_mode=common.FMHAQuantMode.fp8 if point.fp8_context_fmha else common.FMHAQuantMode.bfloat16)
    with tempfile.TemporaryDirectory(prefix="trtpipe-aic-") as directory:
        (Path(directory) / "config.json").write_text(json.dumps(hf_config(point.arch)))
        try:
            return get_model(directory, model_config, "trtllm")
        except Exception as exc:  # AIC raises plain exceptions for architectures it does not model
            first = str(exc).split(". ")[0]
            raise NotModelled(f"aiconfigurator-core does not model {point.arch.architecture} ({first})") from None


def static_run(model, db, point: Workpoint, batch: int, mode: str = "static"):
    _, config, get_backend, _ = aic()
    runtime = config.RuntimeConfig(batch_size=batch, beam_width=1, isl=point.isl, osl=point.osl, prefix=0)
    return get_backend("trtllm").run_static(model, db, runtime, mode=mode, stride=32)


def agg_run(model, db, point: Workpoint):
    """In-flight batching at the plan's batch: each iteration schedules up to max_num_tokens tokens, the batch's
    decode tokens first and prefill chunks in the rest. A new backend per call: AIC's agg cache ignores the
    database it was computed with."""
    _, config, get_backend, _ = aic()
    runtime = config.RuntimeConfig(batch_size=point.batch, isl=point.isl, osl=point.osl)
    ctx_tokens = max(1, min(point.max_num_tokens - point.batch, point.batch * point.isl))
    return get_backend("trtllm").run_agg(model, db, runtime, ctx_tokens=ctx_tokens,
                                         max_num_tokens=point.max_num_tokens, free_gpu_memory_fraction=0.9)


def context_ms(model, db, tokens: int, prefix: int) -> float:
    """One request's context phase over `tokens` prompt tokens whose first `prefix` are in the KV cache already."""
    _, config, get_backend, _ = aic()
    runtime = config.RuntimeConfig(batch_size=1, beam_width=1, isl=tokens, osl=1, prefix=prefix)
    ms, = summary_ms(get_backend("trtllm").run_static(model, db, runtime, mode="static_ctx"), "ttft")
    return ms


def prefill_alone_ms(model, db, point: Workpoint) -> float:
    """One request's prefill alone on the GPU as TensorRT-LLM schedules it: the whole prompt in one step when
    max_num_tokens holds it, else (chunked context) chunks of max_num_tokens, each attending to the KV cache of
    the chunks before it."""
    chunk = min(point.max_num_tokens, point.isl)
    return sum(context_ms(model, db, min(start + chunk, point.isl), start) for start in range(0, point.isl, chunk))


def summary_ms(result, *keys: str) -> list[float]:
    row = result.get_summary_df().iloc[0]
    return [float(row[k]) for k in keys]


def memory_of(result) -> dict:
    gib = result.get_memory()
    return {"weights": gib["weights"] * GIB, "activations": gib["activations"] * GIB,
            "kv_cache": gib["kvcache"] * GIB, "others": (gib["others"] + gib["nccl"]) * GIB,
            "total": gib["total"] * GIB}


# ---------------------------------------------------------------------------------------------- the estimates

def measured_estimate(target: Target, point: Workpoint) -> Estimate:
    """AIC on NVIDIA's measured data for the target's system, with its speed-of-light figures beside."""
    system, version = MEASURED[target.name]
    check_gemm_data(system, version, point.precision)
    model = aic_model(point)
    db = database(system, version)
    prefill = prefill_alone_ms(model, db, point)
    step, = summary_ms(static_run(model, db, point, point.batch), "tpot")
    serving = agg_run(model, db, point)
    served = serving.get_result_dict()
    sol = database(system, version, "SOL")
    sol_prefill, = summary_ms(static_run(model, sol, point, 1), "ttft")
    sol_step, = summary_ms(static_run(model, sol, point, point.batch), "tpot")
    memory = memory_of(serving)    # sized as in-flight batching sizes it: activations for max_num_tokens
    capacity = target.memory_bytes  # what the card reports (AIC's own figure is the marketing one for some)
    return one_sequence(point, Estimate(
        source=MEASURED_SOURCE,
        basis=(f"aiconfigurator-core {AIC_VERSION}, {system} TensorRT-LLM {version} kernel data{model_basis(point)}"
               + GEMM_BASIS.get(point.precision, "")),
        prefill_s=prefill / 1e3, decode_step_s=step / 1e3, ttft_s=float(served["ttft"]) / 1e3,
        tpot_s=float(served["tpot"]) / 1e3, output_tokens_per_s=float(served["tokens/s/gpu"]) * point.tp * point.pp,
        memory_bytes=memory, capacity_bytes=capacity, out_of_memory=memory["total"] > capacity,
        speed_of_light={"prefill_s": sol_prefill / 1e3, "decode_step_s": sol_step / 1e3}))


def op_times(handle, model, point: Workpoint, phase: str, batch: int) -> list[tuple[str, float]]:
    """(op, measured ms) of one prefill (batch requests of ISL) or one decode step (batch tokens at the mean
    context of the output), summed over the layers."""
    if phase == "prefill":
        rows = handle.evaluate_context_ops(list(range(len(model.context_ops))), batch_size=batch, s=point.isl)
    else:
        rows = handle.evaluate_generation_ops(list(range(len(model.generation_ops))), batch_size=batch,
                                              s=point.isl + point.osl // 2 + 1)
    return [(name, ms) for name, ms, *_ in rows]


def op_speed_of_light(handle, model, point: Workpoint, phase: str, batch: int) -> dict[str, tuple[float, float]]:
    """op -> (math ms, memory ms) at the speed of light of the handle's system."""
    from aiconfigurator_core.sdk.engine import build_ops_json

    ops = model.context_ops if phase == "prefill" else model.generation_ops
    s = point.isl if phase == "prefill" else point.isl + point.osl // 2 + 1
    rows = handle.evaluate_ops_sol_json(build_ops_json(list(ops)), is_context=phase == "prefill",
                                        batch_size=batch, s=s)
    return {name: (math_ms, mem_ms) for name, _sol, math_ms, mem_ms in rows}


def engine_handle(model, db):
    import aiconfigurator_core
    from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json

    spec = build_engine_spec_json(model, model_path="trtpipe", system=db.system, backend=db.backend,
                                  backend_version=db.version, kv_block_size=None, systems_path=db.systems_root,
                                  nextn=0, database=db)
    return EngineHandle(bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)), systems_path=db.systems_root)


@dataclass(frozen=True)
class Chip:
    """What the speed of light of an operation depends on."""

    bandwidth: float          # bytes/s
    rate_16bit: float         # tensor FLOP/s, FP32 accumulate
    rate_8bit: float | None

    def rate(self, gemm_8bit: bool) -> float:
        return self.rate_8bit if gemm_8bit and self.rate_8bit else self.rate_16bit


def chip_of_system(db) -> Chip:
    gpu = db.system_spec["gpu"]
    return Chip(float(gpu["mem_bw"]), float(gpu["bfloat16_tc_flops"]), gpu.get("fp8_tc_flops") and
                float(gpu["fp8_tc_flops"]))


def chip_of_target(target: Target) -> Chip:
    return Chip(target.bandwidth_bytes_per_s, target.fp16_tflops * 1e12,
                target.fp8_tflops * 1e12 if target.fp8_tflops else None)


def scaled_ops(times, sol, source: Chip, dest: Chip, gemm_8bit: bool) -> tuple[float, float, float]:
    """(source ms, derived ms, derived speed-of-light ms) of one phase, op by op from the two chips' speed of light
    (SOL = max(FLOPs / rate, bytes / bandwidth)). An op bound by its math keeps its measured efficiency (measured x
    SOL ratio); an op bound by memory keeps its measured time above the speed of light (measured - SOL on the source
    + SOL on the target): its kernel-launch and latency overhead does not shrink with a faster memory. Validated on
    h200 derived from h100 (benchmarks/bench_planner.py). Only the GEMMs of the plan's precision run at the 8-bit
    rate; attention and lm_head (kept 16-bit) at the 16-bit one."""
    total = derived = derived_sol = 0.0
    for name, ms in times:
        math_ms, mem_ms = sol.get(name, (0.0, 0.0))
        eight = gemm_8bit and "gemm" in name and "logits" not in name
        before = max(math_ms, mem_ms)
        after = max(math_ms * source.rate(eight) / dest.rate(eight), mem_ms * source.bandwidth / dest.bandwidth)
        total += ms
        if before <= 0:
            derived += ms
        elif math_ms >= mem_ms:
            derived += ms * after / before
        else:
            derived += max(ms - before, 0.0) + after
        derived_sol += after
    return total, derived, derived_sol


def derived_estimate(target: Target, source_target: str, point: Workpoint) -> Estimate:
    """The source chip's measured figures, per operation scaled to `target` (module docstring)."""
    system, version = MEASURED[source_target]
    check_gemm_data(system, version, point.precision)
    model = aic_model(point)
    db = database(system, version)
    source, dest = chip_of_system(db), chip_of_target(target)
    eight = point.precision == "fp8"
    handle = engine_handle(model, db)     # AIC's engine compiled once for every phase of this estimate
    phases = {}
    for phase, batch in (("prefill", 1), ("decode", point.batch)):
        phases[phase] = scaled_ops(op_times(handle, model, point, phase, batch),
                                   op_speed_of_light(handle, model, point, phase, batch), source, dest, eight)
    (pre_src, pre, pre_sol), (dec_src, dec, dec_sol) = phases["prefill"], phases["decode"]
    serving = agg_run(model, db, point)
    served = serving.get_result_dict()
    prefill_ratio = pre / pre_src
    tpot_ratio = serving_step_ratio(handle, point, float(served["tpot"]), dec_src,
                                    dec / dec_src, prefill_ratio)
    memory = memory_of(serving)    # the same bytes on the derived card; only the capacity differs
    alone = pre if point.max_num_tokens >= point.isl else \
        pre * prefill_alone_ms(model, db, point) / context_ms(model, db, point.isl, 0)   # the chunks' share
    return one_sequence(point, Estimate(
        source=DERIVED_SOURCE,
        basis=(f"aiconfigurator-core {AIC_VERSION} {system} TensorRT-LLM {version} kernel data, each operation scaled "
               f"by {target.name}/{source_target} speed-of-light ratios (docs/planner.md){model_basis(point)}"
               + GEMM_BASIS.get(point.precision, "")),
        prefill_s=alone / 1e3, decode_step_s=dec / 1e3, ttft_s=float(served["ttft"]) * prefill_ratio / 1e3,
        tpot_s=float(served["tpot"]) * tpot_ratio / 1e3,
        output_tokens_per_s=float(served["tokens/s/gpu"]) * point.tp * point.pp / tpot_ratio,
        memory_bytes=memory, capacity_bytes=target.memory_bytes, out_of_memory=memory["total"] > target.memory_bytes,
        speed_of_light={"prefill_s": pre_sol / 1e3, "decode_step_s": dec_sol / 1e3}))


@functools.lru_cache(maxsize=None)
def measured_gemm_modes(system: str, version: str) -> frozenset[str]:
    """The GEMM quantization modes AIC's `system` TensorRT-LLM `version` data holds rows for (its gemm_perf table's
    gemm_dtype column)."""
    import aiconfigurator_core
    import pandas

    table = Path(aiconfigurator_core.__file__).parent / "systems" / "data" / system / "gemm" / "trtllm" / version / \
        "gemm_perf.parquet"
    if not table.is_file():
        return frozenset()
    return frozenset(pandas.read_parquet(table, columns=["gemm_dtype"])["gemm_dtype"].unique())


def check_gemm_data(system: str, version: str, precision: str) -> None:
    """NotModelled when the chip's data has no GEMMs of the precision's mode (AIC would not say which are missing)."""
    mode = GEMM_MODES.get(precision)
    held = measured_gemm_modes(system, version)
    if mode is not None and held and mode not in held:
        raise NotModelled(f"aiconfigurator-core {AIC_VERSION}'s {system} TensorRT-LLM {version} data has no {mode} "
                          f"GEMMs for {precision} (it holds {', '.join(sorted(held))})")


def serving_step_ratio(handle, point: Workpoint, tpot_ms: float, decode_ms: float, decode_ratio: float,
                       prefill_ratio: float) -> float:
    """How much longer the derived card's serving TPOT is than the source's. AIC's serving TPOT on the source lies
    between a pure decode step and a mixed one (the decode tokens plus a prefill chunk of ctx_tokens); the decode
    part scales as a decode step does, the chunk as a prefill does."""
    ctx_tokens = max(1, min(point.max_num_tokens - point.batch, point.batch * point.isl))
    mixed_ms = handle.mixed_step_latency(ctx_tokens, point.batch, point.isl, point.osl)
    if mixed_ms <= decode_ms:
        return decode_ratio
    mixed_share = min(max((tpot_ms - decode_ms) / (mixed_ms - decode_ms), 0.0), 1.0)
    derived_mixed = decode_ms * decode_ratio + (mixed_ms - decode_ms) * prefill_ratio
    derived = (1 - mixed_share) * decode_ms * decode_ratio + mixed_share * derived_mixed
    return derived / tpot_ms


def estimate(target: Target, point: Workpoint) -> Estimate:
    """The best figures trtpipe has for `point` on `target`; NotModelled (with the reason) when AIC cannot give
    them, ImportError without aiconfigurator-core."""
    with aic_errors():
        if target.name in MEASURED:
            return measured_estimate(target, point)
        if target.name in DERIVED_FROM:
            return derived_estimate(target, DERIVED_FROM[target.name], point)
    raise NotModelled(f"no measured chip of {target.name}'s architecture in aiconfigurator-core")


def one_sequence(point: Workpoint, found: Estimate) -> Estimate:
    """`found` as in-flight batching of one sequence serves it (unchanged for a larger batch): one closed-loop client,
    whose request waits behind no other. AIC's agg TTFT is the prefill times a queueing factor for requests that
    arrive together (1.9 for a prompt in one chunk), and its throughput charges the prompt one mixed step of
    ctx_tokens however many chunks it takes; here the TTFT is the prefill alone and the output tokens/s AIC's
    (output - 1) tokens over that prefill and the decode steps."""
    if point.batch > 1:
        return found
    steps_s = found.prefill_s + (point.osl - 1) * found.tpot_s
    return replace(found, ttft_s=found.prefill_s, output_tokens_per_s=(point.osl - 1) / steps_s if steps_s else 0.0)


@contextlib.contextmanager
def aic_errors():
    """AIC's refusals (no measured data for a quantization, a model it cannot build) as NotModelled."""
    from aiconfigurator_core.sdk import errors

    try:
        yield
    except (errors.PerfDataNotAvailableError, errors.InterpolationDataNotAvailableError,
            errors.NoResultsError, errors.SolNotImplementedError) as exc:
        first = str(exc).split(":")[0:2]
        raise NotModelled(f"aiconfigurator-core has no data for this configuration ({': '.join(first)})") from None


def decode_steps(target: Target, point: Workpoint, token_batches: list[int]) -> tuple[list[float], str, str]:
    """Seconds of one decode step carrying each of `token_batches` tokens at the output's mean context, the
    source (measured | derived) and its basis; NotModelled/ImportError as `estimate`. A step that verifies K
    drafts for each of r rows carries r (K + 1) tokens: AIC models speculative verification so (its `nextn`
    queries the generation operations at batch x (nextn + 1)), without the MTP layers its `nextn` also adds
    (`mtp_scale_factor`), which a draft model or prompt lookup does not run. Each token's attention reads its
    row's KV cache, so the verify step's attention is counted K + 1 times: an upper bound on its cost."""
    with aic_errors():
        name = target.name if target.name in MEASURED else DERIVED_FROM.get(target.name)
        if name is None:
            raise NotModelled(f"no measured chip of {target.name}'s architecture in aiconfigurator-core")
        system, version = MEASURED[name]
        check_gemm_data(system, version, point.precision)
        model = aic_model(point)
        db = database(system, version)
        handle = engine_handle(model, db)
        if name == target.name:
            steps = [sum(ms for _, ms in op_times(handle, model, point, "decode", n)) / 1e3 for n in token_batches]
            return steps, MEASURED_SOURCE, (f"aiconfigurator-core {AIC_VERSION}, {system} TensorRT-LLM {version} "
                                            f"decode operations{model_basis(point)}")
        source, dest = chip_of_system(db), chip_of_target(target)
        steps = [scaled_ops(op_times(handle, model, point, "decode", n),
                            op_speed_of_light(handle, model, point, "decode", n), source, dest,
                            point.precision == "fp8")[1] / 1e3 for n in token_batches]
        return steps, DERIVED_SOURCE, (f"aiconfigurator-core {AIC_VERSION} {system} TensorRT-LLM {version} decode "
                                       f"operations scaled to {target.name} (docs/planner.md){model_basis(point)}")


def estimate_or_reason(target: Target, point: Workpoint) -> tuple[Estimate | None, str | None]:
    """`estimate`, or None and why the plan keeps its speed-of-light bound."""
    try:
        return estimate(target, point), None
    except ImportError:
        return None, (f"aiconfigurator-core {AIC_VERSION} is not installed (pip install "
                      f"aiconfigurator-core=={AIC_VERSION}): the figures are trtpipe's speed-of-light bound")
    except NotModelled as exc:
        return None, f"{exc}: the figures are trtpipe's speed-of-light bound"


# ---------------------------------------------------------------------------------------- what the plan states

@dataclass
class Performance:
    """What the plan predicts the GPU will do at its batch and max_num_tokens (plan.json `performance`)."""

    source: str                      # measured | derived | speed-of-light | timed
    basis: str
    batch: int
    max_num_tokens: int
    prefill_s: float                 # one request alone
    decode_step_s: float             # the whole batch, mid-output context
    ttft_s: float                    # serving, in-flight batching at the batch
    tpot_s: float
    output_tokens_per_s: float
    request_latency_s: float         # ttft + (output_len - 1) x tpot
    speed_of_light: dict             # {"prefill_s", "decode_step_s"}: AIC's SOL, else trtpipe's roofline
    percent_of_speed_of_light: float | None   # the decode step's speed of light / its predicted time
    memory: dict | None              # AIC's breakdown (bytes) and the card's usable capacity
    energy: dict                     # watts and output tokens per joule, with what the watts are
    notes: list[str] = field(default_factory=list)
    phases: dict | None = None       # the timed phase tables the per-level prediction interpolates (host_timing)
    correction: dict | None = None   # plan --measured: the factors per phase and the errors before and after

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Performance":
        return cls(**d)


def energy_of(target: Target, tokens_per_s: float, gpus: int) -> dict:
    """AIC's estimate has no power for these operations (its results carry 0 W), so the watts are the boards'
    rated maximum: an upper bound, and the tokens per joule a lower bound."""
    if not target.board_power_w:
        return {"watts": None, "output_tokens_per_joule": None, "basis": f"no board power known for {target.name}"}
    watts = target.board_power_w * gpus
    return {"watts": watts, "output_tokens_per_joule": tokens_per_s / watts,
            "basis": f"upper bound: {gpus} x the board's rated {target.board_power_w:g} W (tokens per joule: a lower "
                     "bound); DCGM's power metric on the dashboard shows the real draw"}


def performance_of(target: Target, point: Workpoint, found: Estimate) -> Performance:
    sol = found.speed_of_light
    return Performance(
        source=found.source, basis=found.basis, batch=point.batch, max_num_tokens=point.max_num_tokens,
        prefill_s=found.prefill_s, decode_step_s=found.decode_step_s, ttft_s=found.ttft_s, tpot_s=found.tpot_s,
        output_tokens_per_s=found.output_tokens_per_s,
        request_latency_s=found.ttft_s + (point.osl - 1) * found.tpot_s, speed_of_light=sol,
        percent_of_speed_of_light=100 * sol["decode_step_s"] / found.decode_step_s if found.decode_step_s else None,
        memory={**found.memory_bytes, "capacity": found.capacity_bytes, "fits": not found.out_of_memory},
        energy=energy_of(target, found.output_tokens_per_s, point.tp * point.pp))


def speed_of_light_performance(target: Target, point: Workpoint, prefill_s: float, decode_step_s: float,
                               why: str) -> Performance:
    """trtpipe's own bound when AIC cannot model the plan: no queueing, no prefill charged to the decode steps."""
    tokens_per_s = point.batch / decode_step_s
    return Performance(
        source=SOL_SOURCE, basis="trtpipe's roofline (plan.roofline): a speed-of-light bound", batch=point.batch,
        max_num_tokens=point.max_num_tokens, prefill_s=prefill_s, decode_step_s=decode_step_s, ttft_s=prefill_s,
        tpot_s=decode_step_s, output_tokens_per_s=tokens_per_s,
        request_latency_s=prefill_s + (point.osl - 1) * decode_step_s,
        speed_of_light={"prefill_s": prefill_s, "decode_step_s": decode_step_s}, percent_of_speed_of_light=100.0,
        memory=None, energy=energy_of(target, tokens_per_s, point.tp * point.pp), notes=[why])


def memory_estimate(target: Target, point: Workpoint) -> tuple[dict, int]:
    """AIC's memory for `point` under in-flight batching (activations for max_num_tokens, the batch's KV cache,
    the runtime's other 3.5 GiB) and the card's usable bytes: the cheap half of `estimate`."""
    source = target.name if target.name in MEASURED else DERIVED_FROM.get(target.name)
    if source is None:
        raise NotModelled(f"no measured chip of {target.name}'s architecture in aiconfigurator-core")
    system, version = MEASURED[source]
    with aic_errors():
        return memory_of(agg_run(aic_model(point), database(system, version), point)), target.memory_bytes
