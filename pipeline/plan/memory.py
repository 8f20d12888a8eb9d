"""The memory model and the roofline: bytes of weights, KV cache, activations and runtime reserve per
GPU, and lower-bound timings of a decode step and a prefill.

Every figure is an estimate from the architecture numbers, written so it can be checked by hand (the
tests do): weights as TensorRT-LLM's checkpoint stores them, activations as TensorRT sizes them for the
largest profile, timings from memory bandwidth and the dense peak rate of the target.
"""

from __future__ import annotations

import math

from ..arch import ModelArch
from ..model.layout import RankLayout, kv_heads_per_rank, padded_vocab
from ..model.spec import dims
from ..precisions import DTYPE_CODES, EIGHT_BIT_ACTIVATIONS, INT4_GROUP_SIZES
from ..safetensors_stream import ITEM_SIZE
from ..targets import GIB, Target
from .schema import Roofline, Workload
from ..model import family_of

LOGITS_BYTES = 4                 # PretrainedConfig.logits_dtype default 'float32'
CUDA_CONTEXT_RESERVE = 1 * GIB   # CUDA context + cuBLAS(Lt) + TensorRT-LLM plugin workspaces
NCCL_RESERVE = GIB // 2          # all-reduce workspaces when tp > 1


def format_gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _element_bytes(dtype: str) -> int:
    return ITEM_SIZE[DTYPE_CODES[dtype]]


def _linear_weight_bytes(in_f: int, out_f: int, precision: str, dtype_bytes: int) -> int:
    """One quantizable linear layer as stored in the checkpoint/engine."""
    n = in_f * out_f
    if precision == "fp8":
        return n + 2 * 4                          # FP8 weight, per-tensor weight + activation scales
    if precision == "int8-sq":
        return n + out_f * 4 + in_f * 4 + 4       # INT8 weight, per-channel scale, smoother, act scale
    if precision == "int4-awq":                   # two codes a byte, float32 group scales, AWQ's smoother
        return n // 2 + out_f * (in_f // int4_group_size(in_f)) * 4 + in_f * dtype_bytes
    return n * dtype_bytes


def int4_group_size(in_f: int) -> int:
    """The group size calibrate gives a 4-bit linear of `in_f` inputs: the first of INT4_GROUP_SIZES dividing it."""
    return next((g for g in INT4_GROUP_SIZES if in_f % g == 0), INT4_GROUP_SIZES[-1])


def layer_bytes_per_rank(arch: ModelArch, precision: str, dtype: str, tp: int) -> int:
    """One decoder layer on one tp rank, from the family's spec: every linear split as the spec says (K/V
    heads duplicated when tp > num_key_value_heads), its bias in the model dtype, norms whole."""
    family, eb = family_of(arch.architecture), _element_bytes(dtype)
    rank = RankLayout(tp, 1, arch.num_hidden_layers).rank(0)
    total = sum(dims(arch)[n.size] * eb for n in family.layer_norms(arch))
    for lin in family.linears:
        out_f, in_f = rank.linear_shape(arch, lin)
        total += _linear_weight_bytes(in_f, out_f, precision, eb) + out_f * eb * family.has_bias(lin, arch)
    return total


def weights_per_rank_by_stage(arch: ModelArch, precision: str, dtype: str, tp: int, pp: int,
                              quantized_head: bool = False) -> list[int]:
    """Bytes of weights one GPU holds, for each pipeline stage (all tp ranks of a stage are equal).

    Decoder layers as `layer_bytes_per_rank`; vocab_embedding whole on pp stage 0; lm_head (vocab padded
    to a multiple of tp, split) and ln_f on the last stage; lm_head stays in the engine dtype (modelopt
    does not quantize it) unless `quantized_head` (`calibrate --quantize-lm-head`: a 4-bit linear, untied); a
    tied float lm_head shares the embedding when tp == pp == 1 (tensorrt_llm share_embedding).
    """
    h, eb = arch.hidden_size, _element_bytes(dtype)
    per_layer = layer_bytes_per_rank(arch, precision, dtype, tp)
    embedding = arch.vocab_size * h * eb
    rows = padded_vocab(arch.vocab_size, tp) // tp
    lm_head = _linear_weight_bytes(h, rows, "int4-awq", eb) if quantized_head else rows * h * eb
    if arch.tie_word_embeddings and tp == 1 and pp == 1 and not quantized_head:
        lm_head = 0
    layout = RankLayout(tp, pp, arch.num_hidden_layers)
    stages = []
    for s in range(pp):
        b = len(layout.stage_layers(s)) * per_layer
        if s == 0:
            b += embedding
        if s == pp - 1:
            b += lm_head + h * eb
        stages.append(b)
    return stages


def weights_read_per_step(arch: ModelArch, precision: str, dtype: str, tp: int, pp: int,
                          quantized_head: bool = False) -> int:
    """Bytes of weights one GPU reads in a decode step: its weights less the input embedding table, of which a
    step gathers only the batch's rows (a tied lm_head still reads the shared table whole). The busiest stage."""
    stages = weights_per_rank_by_stage(arch, precision, dtype, tp, pp, quantized_head)
    shared = arch.tie_word_embeddings and tp == 1 and pp == 1 and not quantized_head
    stages[0] -= 0 if shared else arch.vocab_size * arch.hidden_size * _element_bytes(dtype)
    return max(stages)


def kv_bytes_per_token(arch: ModelArch, kv_cache_dtype: str, tp: int, pp: int = 1) -> int:
    """2 (K and V) x layers on the GPU x KV heads on the GPU x head size x bytes per element."""
    layers = RankLayout(tp, pp, arch.num_hidden_layers).layers_per_stage
    return (2 * layers * kv_heads_per_rank(arch.num_key_value_heads, tp) * arch.head_size
            * _element_bytes(kv_cache_dtype))


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
    per_token = _element_bytes(dtype) * (2 * h + max(3 * i_local, 2 * (q + 2 * kv) // tp + q // tp))
    if precision in EIGHT_BIT_ACTIVATIONS:
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
# Roofline timings


#: PCIe 4.0 x16, one direction (the PCI-SIG rate, 16 GT/s x 16 lanes, 128b/130b): what a GPU without
#: peer-to-peer access moves its all-reduce traffic over, twice (to host memory and back)
PCIE4_X16_BYTES_PER_S = 31.5e9


def host_allreduce_seconds(arch: ModelArch, dtype: str, tp: int, pp: int, batch: int) -> tuple[int, float]:
    """Tensor-parallel all-reduces of one decode step on a GPU and their bandwidth-bound time when staged
    through host memory: two per decoder layer (attention output, MLP output) of batch x hidden values;
    a ring all-reduce moves 2 (tp - 1) / tp of them per GPU, and without peer-to-peer every byte crosses
    PCIe twice. A lower bound: the per-call latency, which dominates at small batch, is not modelled."""
    count = 2 * RankLayout(tp, pp, arch.num_hidden_layers).layers_per_stage
    per_call = batch * arch.hidden_size * _element_bytes(dtype)
    return count, count * 2 * (2 * (tp - 1) / tp) * per_call / PCIE4_X16_BYTES_PER_S


def decode_step_seconds(weights_per_rank: int, batch: int, context_tokens: float, kv_per_token: int,
                        target: Target) -> float:
    return (weights_per_rank + batch * context_tokens * kv_per_token) / target.bandwidth_bytes_per_s


def prefill_seconds(arch: ModelArch, input_len: int, precision: str, tp: int, target: Target) -> float:
    """2 FLOPs per weight per token for the decoder GEMMs and lm_head of the last token, plus causal
    attention 2 * layers * L^2 * q_size, over tp GPUs at the dense peak rate."""
    h, sizes = arch.hidden_size, dims(arch)
    linears = family_of(arch.architecture).linears
    linear = arch.num_hidden_layers * sum(lin.out_features(sizes) * sizes[lin.inputs] for lin in linears)
    flops = 2 * linear * input_len + 2 * arch.vocab_size * h + 2 * arch.num_hidden_layers * input_len ** 2 * arch.q_size
    return flops / (tp * target.peak_ops_per_s(precision))


def roofline(target: Target, workload: Workload, weights_per_rank: int, kv_per_token: int, batch: int,
             prefill_s: float) -> Roofline:
    """The speed-of-light bound; `weights_per_rank`: the bytes a decode step reads (weights_read_per_step)."""
    context = workload.input_len + workload.output_len / 2
    step1 = decode_step_seconds(weights_per_rank, 1, context, kv_per_token, target)
    step = decode_step_seconds(weights_per_rank, batch, context, kv_per_token, target)
    return Roofline(
        batch=batch, decode_step_s_batch1=step1, decode_tokens_per_s_per_seq_batch1=1 / step1,
        decode_step_s=step, decode_tokens_per_s_per_seq=1 / step, decode_tokens_per_s_aggregate=batch / step,
        prefill_s_per_request=prefill_s,
        request_latency_s_batch1=prefill_s + workload.output_len * step1,
        request_latency_s=prefill_s + workload.output_len * step,
        basis=("decode step = (weights per GPU read per step, the input embedding table excepted, + batch x "
               "(input_len + output_len/2) x kv_bytes_per_token) / "
               "memory bandwidth; prefill = (2 x linear weights x input_len + 2 x layers x input_len^2 x "
               "q_size) FLOPs / (tp x dense peak rate); request latency = prefill + output_len decode "
               "steps. Lower bounds: no kernel efficiency, communication or scheduling overhead"))
