"""The decoder as an ONNX graph, written node by node with the `onnx` helper API from the merged float32 weights.

It computes the reference runtime's forward pass (pipeline/runtime/model.py) for one step over a KV cache:
embedding -> per layer [RMSNorm -> fused qkv (+bias) -> per-head q/k RMSNorm (Qwen3) -> rope_gpt_neox with
cos/sin gathered at `position_ids` -> K/V appended to `past_key_values.N.*` (the result is `present.N.*`)
-> GQA attention, key j visible to the query at position P + t iff j <= P + t and attention_mask[b, j]
(and within the sliding window, if any) -> attention.dense -> residual -> RMSNorm -> proj(silu(fc) * gate)
-> residual] -> ln_f -> lm_head -> `logits`. Names follow optimum / onnxruntime-genai
(docs/onnx.md): inputs `input_ids`, `attention_mask`, `position_ids`, `past_key_values.N.key/value`
[batch, kv_heads, past, head_size], and the optional `logits_to_keep` (an int64 scalar, default 0 = every
position; N > 0: only the last N positions' logits are computed); outputs `logits`, `present.N.key/value`.

The optional prompt group: `prompt_ids` [prompt_length] (default: empty) is one more sequence's prompt from position
0, without a cache. Its tokens go through every linear, norm and the rope together with the rows' tokens (the
layers work on the flat [B * T + prompt_length, hidden] tokens), and apart only in attention, where the prompt sees
its own earlier tokens. Outputs `prompt_logits` [1, vocab] (its last token's; [0, vocab] without a prompt) and
`prompt_present.N.key/value` [1, kv_heads, prompt_length, head_size]. A server thus computes a joining prompt in
the step that decodes the running rows, reading the weights once for both.

With `GraphBuilder.in_place` (`export-onnx --in-place-kv`) the rows' attention is ONNX Runtime's GroupQueryAttention
instead (`attend_in_place`, `attend_rotary`): past and present are one buffer [batch, kv_heads, cache_length,
head_size] the runner binds to both, each row's tokens first, `attention_mask` [batch, total] ones over each row's
tokens after the step; the kernel writes the new keys and values at each row's length (docs/onnx.md).

The tensor each linear reads (after SmoothQuant's smoothing, where the checkpoint has it) is named
exactly like the activation calibrate measures, `transformer.layers.N.attention.qkv` ... `mlp.proj`,
and K/V after rope `transformer.layers.N.attention.k` / `.v`: the TensorRT calibration cache names
tensors of this graph (pipeline/calibrate/trtcache.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from onnx import GraphProto, TensorProto, helper, numpy_helper

from ..checkpoint import CheckpointConfig
from ..runtime.trtllm_reader import Layer, Linear
from ..runtime.quant import TensorQuant
from ..runtime.rope import RotaryTable
from . import LOGITS_TO_KEEP, PROMPT_IDS, PROMPT_LOGITS, prompt_present
from .quantize import QuantizedHead, QuantizedWeight, activation_scale, int4_tensors, weight_tensor, zero_point

BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
CACHE = "cache_length"           # in place: the cache buffer's positions, past and present alike
KEPT = "kept_sequence_length"     # logits' positions: the last logits_to_keep of SEQ
PROMPT, PROMPT_KEPT = "prompt_length", "prompt_kept"   # the prompt group's tokens; 1, or 0 without a prompt
LOWEST = np.float32(np.finfo(np.float32).min)
TO_HEADS_FIRST = [0, 2, 1, 3]    # [b, t, heads, d] <-> [b, heads, t, d]
#: ONNX Runtime's contrib operators (MatMulNBits)
CONTRIB_DOMAIN = "com.microsoft"


def past_names(i: int) -> tuple[str, str]:
    return f"past_key_values.{i}.key", f"past_key_values.{i}.value"


def present_names(i: int) -> tuple[str, str]:
    return f"present.{i}.key", f"present.{i}.value"


def prompt_present_names(i: int) -> tuple[str, str]:
    key, value = present_names(i)
    return prompt_present(key), prompt_present(value)


@dataclass
class GraphBuilder:
    """Nodes and initializers of one graph, with unique generated names."""

    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    weight_dtype: int = TensorProto.FLOAT       # FLOAT16: float weights stored in half, cast up when used
    int4_accuracy: int = 0                      # MatMulNBits' accuracy_level (0: float32 compute)
    in_place: bool = False                      # the rows' KV cache written in place by GroupQueryAttention
    rotary_attention: bool = False              # in place: GroupQueryAttention rotates q and k itself (do_rotary)
    _count: int = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"/{hint}_{self._count}"

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.fresh(op_type)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "/" + op_type, **attrs))
        return out

    def ops(self, op_type: str, inputs: list[str], count: int, **attrs) -> list[str]:
        outs = [self.fresh(op_type) for _ in range(count)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0] + "/" + op_type, **attrs))
        return outs

    def const(self, name: str, value) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def tensor(self, proto: TensorProto) -> str:
        self.initializers.append(proto)
        return proto.name

    def float_weight(self, name: str, value: torch.Tensor) -> str:
        """A float32 initializer (a weight kept in half precision when weight_dtype says so, cast back)."""
        if self.weight_dtype == TensorProto.FLOAT16:
            self.const(name, value.half().numpy())
            return self.op("Cast", [name], to=TensorProto.FLOAT)
        return self.const(name, value.float().numpy())


@dataclass
class Shared:
    """What every layer of the step reads. The layers work on the flat tokens [N, ...]: the rows' B * T, then the
    prompt group's."""

    cos: str            # [N, 1, d] rope tables at each token's position
    sin: str
    visible: str        # bool [B, 1, 1, T, S]: the rows' keys each of their queries sees (in place: unused)
    prompt_visible: str  # bool [P, P]: the prompt's (causal)
    groups: str         # int64 [2]: B * T and P, the flat tokens of each group
    rows_shape: str     # int64 [2]: B, T
    row_heads: dict     # heads -> int64: the rows' q, k, v shape per head count, [B, T, heads, head_size] (in
    #                     place: [B, T, heads * head_size], GroupQueryAttention's)
    seqlens: str = ""   # in place: int32 [B], each row's tokens after this step less one (GroupQueryAttention's)
    total: str = ""     # in place: int32 scalar, the longest row's
    prompt_seqlens: str = ""   # rotary attention: the prompt group's seqlens ([P - 1]), total (P) and P > 0
    prompt_total: str = ""
    has_prompt: str = ""


def build_shared(g: GraphBuilder, cfg: CheckpointConfig) -> Shared:
    rotary = RotaryTable(cfg.arch)
    zero, one = g.const("int.0", np.array(0, np.int64)), g.const("int.1", np.array(1, np.int64))
    axes0, axes1 = g.const("axes.0", np.array([0], np.int64)), g.const("axes.1", np.array([1], np.int64))
    prompt_length = g.op("Shape", [PROMPT_IDS])                                     # [1]
    prompt_positions = g.op("Range", [zero, g.op("Gather", [prompt_length, zero]), one])
    positions = g.op("Concat", [g.op("Reshape", ["position_ids", g.const("shape.flat", np.array([-1], np.int64))]),
                                prompt_positions], axis=0)                          # [N]
    table = {n: g.const(f"rope.{n}", t[:cfg.arch.max_position_embeddings].numpy())
             for n, t in (("cos", rotary.cos), ("sin", rotary.sin))}
    if g.rotary_attention:      # GroupQueryAttention's cos_cache / sin_cache: [positions, head_size / 2]
        half = cfg.arch.head_size // 2
        cos, sin = (g.const(f"rope.{n}.half", t[:cfg.arch.max_position_embeddings, :half].numpy())
                    for n, t in (("cos", rotary.cos), ("sin", rotary.sin)))
    else:
        cos, sin = (g.op("Unsqueeze", [g.op("Gather", [table[n], positions]), axes1]) for n in ("cos", "sin"))
    rows_shape = g.op("Shape", ["input_ids"])
    groups = g.op("Concat", [g.op("Unsqueeze", [g.op("Size", ["input_ids"]), axes0]), prompt_length], axis=0)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"]), one])
    new = g.op("Gather", [rows_shape, one])
    keys = g.op("Range", [zero, total, one])                                         # [S]
    queries = g.op("Range", [g.op("Sub", [total, new]), total, one])               # [T] absolute positions
    mask = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], to=TensorProto.BOOL),
                              g.const("axes.1.2.3", np.array([1, 2, 3], np.int64))])  # [B, 1, 1, 1, S]
    window = g.const("sliding_window", np.array(int(cfg.arch.sliding_window), np.int64)) \
        if cfg.arch.sliding_window else None
    hd = cfg.arch.head_size
    nq, nkv = cfg.arch.num_attention_heads, cfg.arch.num_key_value_heads
    per_row = (lambda n: [n * hd]) if g.in_place else (lambda n: [n, hd])
    row_heads = {n: g.op("Concat", [rows_shape, g.const(f"attention.row_heads.{n}", np.array(per_row(n)))], axis=0)
                 for n in ({nq + 2 * nkv} if g.rotary_attention else {nq, nkv})}
    prompt_visible = causal(g, prompt_positions, prompt_positions, window)
    if g.in_place:      # right-padded rows: attention_mask [B, total] holds each row's tokens first
        lengths = g.op("ReduceSum", ["attention_mask", "axes.1"], keepdims=0)
        seqlens = g.op("Cast", [g.op("Sub", [lengths, one])], to=TensorProto.INT32)
        prompt_total = g.op("Cast", [g.op("Gather", [prompt_length, zero])], to=TensorProto.INT32)
        return Shared(cos, sin, "", prompt_visible, groups, rows_shape, row_heads, seqlens,
                      g.op("Cast", [total], to=TensorProto.INT32),
                      g.op("Sub", [g.op("Cast", [prompt_length], to=TensorProto.INT32),
                                   g.const("int32.1", np.array(1, np.int32))]), prompt_total,
                      g.op("Greater", [prompt_total, g.const("int32.0", np.array(0, np.int32))]))
    return Shared(cos, sin, g.op("And", [mask, causal(g, keys, queries, window)]), prompt_visible, groups,
                  rows_shape, row_heads)


def causal(g: GraphBuilder, keys: str, queries: str, window: str | None) -> str:
    """bool [T, S]: key j visible to the query at position p iff j <= p (and p - j < window, with one)."""
    queries = g.op("Unsqueeze", [queries, "axes.1"])
    visible = g.op("LessOrEqual", [keys, queries])
    if window is not None:
        visible = g.op("And", [visible, g.op("Greater", [keys, g.op("Sub", [queries, window])])])
    return visible


def rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, axes: str) -> str:
    """x / sqrt(mean(x^2) + eps) * weight, the square as Pow(x, 2) (start_graph's float.2): the pattern ONNX Runtime
    fuses into one SimplifiedLayerNormalization kernel (docs/upstream-facts.md §L)."""
    square = g.op("Pow", [x, "float.2"])
    mean_sq = g.op("ReduceMean", [square, axes], keepdims=1)
    rms = g.op("Sqrt", [g.op("Add", [mean_sq, g.const(g.fresh("eps")[1:], np.array(eps, np.float32))])])
    return g.op("Mul", [g.op("Div", [x, rms]), weight])


def rotate(g: GraphBuilder, x: str, shared: Shared, half: int) -> str:
    """x * cos + cat(-x2, x1) * sin on [N, heads, d]."""
    x1, x2 = g.ops("Split", [x, g.const(g.fresh("halves")[1:], np.array([half, half], np.int64))], 2, axis=-1)
    turned = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
    return g.op("Add", [g.op("Mul", [x, shared.cos]), g.op("Mul", [turned, shared.sin])])


def qdq(g: GraphBuilder, x: str, quant: TensorQuant, name: str) -> str:
    scale = g.tensor(activation_scale(name + ".scale", quant))
    zp = g.tensor(zero_point(name + ".zero_point", quant.kind))
    return g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, scale, zp]), scale, zp])


def smoothed_input(g: GraphBuilder, x: str, lin: Linear, name: str) -> str:
    """x * prequant (SmoothQuant's smoothing, when the linear has it), named `name` (the calibration cache's name)."""
    if lin.prequant is not None:
        x = g.op("Mul", [x, g.const(name + ".prequant_scaling_factor", lin.prequant.numpy())])
    return g.op("Identity", [x], out=name)


def linear_input(g: GraphBuilder, x: str, lin: Linear, name: str) -> str:
    """quant(x * prequant), the smoothed input (before Q/DQ) named `name`."""
    x = smoothed_input(g, x, lin, name)
    return x if lin.act_quant is None else qdq(g, x, lin.act_quant, name + ".activation")


def with_bias(g: GraphBuilder, y: str, lin: Linear, name: str) -> str:
    return y if lin.bias is None else g.op("Add", [y, g.float_weight(name + ".bias", lin.bias)])


def matmul(g: GraphBuilder, x: str, lin: Linear, qw: QuantizedWeight | None, name: str) -> str:
    """x @ W^T + b, W dequantized from its stored values when quantized (int4: ONNX Runtime's MatMulNBits)."""
    if qw is not None and qw.kind == "int4":
        return with_bias(g, int4_matmul(g, x, qw, name), lin, name)
    if qw is None:
        weight = g.float_weight(name + ".weight", lin.weight.t().contiguous())
    else:
        data, scale = weight_tensor(name + ".weight", qw)
        weight = g.op("DequantizeLinear", [g.tensor(data), g.tensor(scale)], axis=1)
    return with_bias(g, g.op("MatMul", [x, weight]), lin, name)


def int4_matmul(g: GraphBuilder, x: str, qw: QuantizedWeight, name: str) -> str:
    """x @ W^T for a 4-bit W: ONNX Runtime's MatMulNBits on its codes and group scales."""
    data, scale = int4_tensors(name + ".weight", qw)
    out, width = qw.values.shape
    return g.op("MatMulNBits", [x, g.tensor(data), g.tensor(scale)], domain=CONTRIB_DOMAIN, K=width, N=out, bits=4,
                block_size=qw.group_size, accuracy_level=g.int4_accuracy)


def linear(g: GraphBuilder, x: str, lin: Linear, qw: QuantizedWeight | None, name: str) -> str:
    if qw is not None and qw.blocks > 1:
        return rank_blocked_matmul(g, x, lin, qw, name)
    return matmul(g, linear_input(g, x, lin, name), lin, qw, name)


def rank_blocked_matmul(g: GraphBuilder, x: str, lin: Linear, qw: QuantizedWeight, name: str) -> str:
    """A row-parallel linear whose tp ranks quantized their slices of the input with scales of their own, computed as
    the ranks compute it: the smoothed input split into the ranks' slices, each quantized (the one activation scale,
    a Q/DQ pair per slice so that ONNX Runtime fuses each into an integer GEMM) and multiplied by its slice of the
    weight, the partial products summed (the ranks' all-reduce), then the bias."""
    x = smoothed_input(g, x, lin, name)
    width = qw.values.shape[1] // qw.blocks
    widths = g.const(name + ".rank_widths", np.array([width] * qw.blocks, np.int64))
    partial = []
    for rank, piece in enumerate(g.ops("Split", [x, widths], qw.blocks, axis=-1)):
        piece = qdq(g, piece, lin.act_quant, f"{name}.rank{rank}.activation")
        data, scale = weight_tensor(f"{name}.rank{rank}.weight", qw.block(rank))
        partial.append(g.op("MatMul", [piece, g.op("DequantizeLinear", [g.tensor(data), g.tensor(scale)], axis=1)]))
    return with_bias(g, g.op("Sum", partial), lin, name)


def attention(g: GraphBuilder, cfg: CheckpointConfig, i: int, layer: Layer, quantized: dict, x: str,
              shared: Shared) -> str:
    """The rows' queries attend to their cache and new keys (present = past + new), the prompt's to its own."""
    arch, p = cfg.arch, f"transformer.layers.{i}."
    hd, nq, nkv = arch.head_size, arch.num_attention_heads, arch.num_key_value_heads
    qkv = linear(g, x, layer.linears["attention.qkv"], quantized.get("attention.qkv"), p + "attention.qkv")
    if g.rotary_attention:
        out = attend_rotary(g, cfg, i, qkv, shared)
        return linear(g, out, layer.linears["attention.dense"], quantized.get("attention.dense"), p + "attention.dense")
    split = g.const(p + "attention.split", np.array([nq * hd, nkv * hd, nkv * hd], np.int64))
    q, k, v = g.ops("Split", [qkv, split], 3, axis=-1)
    heads = {n: g.const(f"{p}attention.heads.{n}", np.array([0, n, hd], np.int64)) for n in {nq, nkv}}
    q, k, v = (g.op("Reshape", [t, heads[n]]) for t, n in ((q, nq), (k, nkv), (v, nkv)))   # [N, h, d]
    if "attention.q_layernorm" in layer.norms:
        last = "axes.-1"
        q = rms_norm(g, q, g.float_weight(p + "attention.q_layernorm.weight", layer.norms["attention.q_layernorm"]),
                     arch.norm_epsilon, last)
        k = rms_norm(g, k, g.float_weight(p + "attention.k_layernorm.weight", layer.norms["attention.k_layernorm"]),
                     arch.norm_epsilon, last)
    q, k = rotate(g, q, shared, hd // 2), rotate(g, k, shared, hd // 2)
    k, v = (g.op("Identity", [t], out=p + f"attention.{n}") for t, n in ((k, "k"), (v, "v")))
    if layer.kv_quant is not None:      # the cache's Q/DQ, elementwise: on the flat tokens of both groups at once
        k, v = qdq(g, k, layer.kv_quant, p + "attention.k.cache"), qdq(g, v, layer.kv_quant, p + "attention.v.cache")
    (q, prompt_q), (k, prompt_k), (v, prompt_v) = (g.ops("Split", [t, shared.groups], 2, axis=0) for t in (q, k, v))
    prompt_q, prompt_k, prompt_v = (g.op("Unsqueeze", [t, "axes.0"]) for t in (prompt_q, prompt_k, prompt_v))
    prompt_k, prompt_v = (g.op("Transpose", [t], perm=TO_HEADS_FIRST) for t in (prompt_k, prompt_v))
    prompt_keys, prompt_values = (g.op("Identity", [t], out=name)
                                  for t, name in zip((prompt_k, prompt_v), prompt_present_names(i)))
    rows = (attend_in_place if g.in_place else attend_after_past)(g, cfg, i, q, k, v, shared)
    out = g.op("Concat", [rows, attend(g, prompt_q, prompt_keys, prompt_values, shared.prompt_visible)], axis=0)
    return linear(g, out, layer.linears["attention.dense"], quantized.get("attention.dense"), p + "attention.dense")


def attend_after_past(g: GraphBuilder, cfg: CheckpointConfig, i: int, q: str, k: str, v: str, shared: Shared) -> str:
    """The rows' attention over their cache and new keys, the cache grown by a Concat (present = past + new):
    flat q, k, v [B * T, heads, d] -> [B * T, heads * d]."""
    nq, nkv = cfg.arch.num_attention_heads, cfg.arch.num_key_value_heads
    q, k, v = (g.op("Reshape", [t, shared.row_heads[n]]) for t, n in ((q, nq), (k, nkv), (v, nkv)))   # [B, T, h, d]
    k, v = (g.op("Transpose", [t], perm=TO_HEADS_FIRST) for t in (k, v))
    past_k, past_v = past_names(i)
    keys = g.op("Concat", [past_k, k], present_names(i)[0], axis=2)
    values = g.op("Concat", [past_v, v], present_names(i)[1], axis=2)
    return attend(g, q, keys, values, shared.visible)


def attend_in_place(g: GraphBuilder, cfg: CheckpointConfig, i: int, q: str, k: str, v: str, shared: Shared) -> str:
    """The rows' attention by ONNX Runtime's GroupQueryAttention, which writes the new keys and values into the
    cache at each row's length (in place when the caller binds past and present to one buffer) and attends each row
    over its own length (`seqlens_k`): flat q, k, v [B * T, heads, d] -> [B * T, heads * d]. The rope is the graph's
    own (do_rotary 0), so that the cache's Q/DQ and the calibration names stay where they are."""
    arch = cfg.arch
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    q, k, v = (g.op("Reshape", [t, shared.row_heads[n]]) for t, n in ((q, nq), (k, nkv), (v, nkv)))  # [B, T, h * d]
    out = g.fresh("GroupQueryAttention")
    g.nodes.append(helper.make_node("GroupQueryAttention", [q, k, v, *past_names(i), shared.seqlens, shared.total],
                                    [out, *present_names(i)], name=out + "/GroupQueryAttention",
                                    domain=CONTRIB_DOMAIN, num_heads=nq, kv_num_heads=nkv))
    return g.op("Reshape", [out, "attention.flat"])


def attend_rotary(g: GraphBuilder, cfg: CheckpointConfig, i: int, qkv: str, shared: Shared) -> str:
    """Both groups' attention by GroupQueryAttention on the packed q, k, v [N, (heads + 2 kv_heads) * d], which
    rotates q and k at each token's position (a row's: its length before the token; the prompt's: from 0): the rows'
    over their cache, written in place, the prompt's (when there is one: an If, since the kernel refuses an empty
    sequence) over its own tokens, its keys and values `prompt_present.N.*`. -> [N, heads * d]"""
    arch = cfg.arch
    nq, nkv, hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_size
    attrs = dict(domain=CONTRIB_DOMAIN, num_heads=nq, kv_num_heads=nkv, do_rotary=1)
    rows, prompt = g.ops("Split", [qkv, shared.groups], 2, axis=0)
    rows = g.op("Reshape", [rows, shared.row_heads[nq + 2 * nkv]])
    out = g.fresh("GroupQueryAttention")
    g.nodes.append(helper.make_node("GroupQueryAttention", [rows, "", "", *past_names(i), shared.seqlens, shared.total,
                                                            shared.cos, shared.sin],
                                    [out, *present_names(i)], name=out + "/GroupQueryAttention", **attrs))
    prompt_out, prompt_in = g.fresh("prompt_attention"), g.fresh("prompt_packed")
    keys, values = prompt_present_names(i)
    computed = helper.make_graph(
        [helper.make_node("Unsqueeze", [prompt, "axes.0"], [prompt_in]),
         helper.make_node("GroupQueryAttention", [prompt_in, "", "", "", "", shared.prompt_seqlens,
                                                  shared.prompt_total, shared.cos, shared.sin],
                          [prompt_out + "/heads", keys + "/then", values + "/then"], **attrs),
         helper.make_node("Reshape", [prompt_out + "/heads", "attention.flat"], [prompt_out + "/then"])],
        prompt_out + "/then", [], [helper.make_tensor_value_info(name + "/then", TensorProto.FLOAT, None)
                                   for name in (prompt_out, keys, values)])
    empty = helper.make_graph(
        [helper.make_node("Constant", [], [name + "/else"], value=numpy_helper.from_array(np.zeros(shape, np.float32)))
         for name, shape in ((prompt_out, (0, nq * hd)), (keys, (1, nkv, 0, hd)), (values, (1, nkv, 0, hd)))],
        prompt_out + "/else", [], [helper.make_tensor_value_info(name + "/else", TensorProto.FLOAT, None)
                                   for name in (prompt_out, keys, values)])
    g.nodes.append(helper.make_node("If", [shared.has_prompt], [prompt_out, keys, values], name=prompt_out + "/If",
                                    then_branch=computed, else_branch=empty))
    return g.op("Concat", [g.op("Reshape", [out, "attention.flat"]), prompt_out], axis=0)


def attend(g: GraphBuilder, q: str, keys: str, values: str, visible: str) -> str:
    """GQA attention of queries q [b, t, heads, d] over keys/values [b, kv, s, d] where `visible` (broadcast to
    [b, kv, rep, t, s]) lets them see: the output [b * t, heads * d]. The attention.* shapes are start_graph's."""
    q5 = g.op("Reshape", [g.op("Transpose", [q], perm=TO_HEADS_FIRST), "attention.groups"])  # [b, kv, rep, t, d]
    k5 = g.op("Transpose", [g.op("Unsqueeze", [keys, "axes.2"])], perm=[0, 1, 2, 4, 3])   # [b, kv, 1, d, s]
    scores = g.op("Mul", [g.op("MatMul", [q5, k5]), "attention.scale"])
    probs = g.op("Softmax", [g.op("Where", [visible, scores, "attention.masked"])], axis=-1)
    out = g.op("MatMul", [probs, g.op("Unsqueeze", [values, "axes.2"])])                 # [b, kv, rep, t, d]
    out = g.op("Reshape", [out, "attention.merge"])                                       # [b, heads, t, d]
    return g.op("Reshape", [g.op("Transpose", [out], perm=TO_HEADS_FIRST), "attention.flat"])


def mlp(g: GraphBuilder, i: int, layer: Layer, quantized: dict, x: str) -> str:
    """proj(silu(fc(x)) * gate(x)). When fc and gate smooth and quantize their input alike (calibrate measures it
    once), gate reads fc's smoothed input tensor through a Q/DQ pair of its own: ONNX Runtime fuses a Q/DQ pair
    into an integer GEMM only when its QuantizeLinear feeds that one GEMM (a shared one left both in float32)."""
    p = f"transformer.layers.{i}.mlp."
    fc_lin, gate_lin = layer.linears["mlp.fc"], layer.linears["mlp.gate"]
    fc_in = linear_input(g, x, fc_lin, p + "fc")
    if same_input_quant(fc_lin, gate_lin):
        gate_in = fc_in if gate_lin.act_quant is None else qdq(g, p + "fc", gate_lin.act_quant, p + "gate.activation")
    else:
        gate_in = linear_input(g, x, gate_lin, p + "gate")
    fc = matmul(g, fc_in, fc_lin, quantized.get("mlp.fc"), p + "fc")
    gate = matmul(g, gate_in, gate_lin, quantized.get("mlp.gate"), p + "gate")
    act = g.op("Mul", [g.op("Mul", [fc, g.op("Sigmoid", [fc])]), gate])
    return linear(g, act, layer.linears["mlp.proj"], quantized.get("mlp.proj"), p + "proj")


def same_input_quant(a: Linear, b: Linear) -> bool:
    if a.act_quant != b.act_quant or (a.prequant is None) != (b.prequant is None):
        return False
    return a.prequant is None or torch.equal(a.prequant, b.prequant)


def decoder_layer(g: GraphBuilder, cfg: CheckpointConfig, i: int, layer: Layer, quantized: dict, h: str,
                  shared: Shared) -> str:
    eps, last = cfg.arch.norm_epsilon, "axes.-1"
    x = rms_norm(g, h, g.float_weight(f"transformer.layers.{i}.input_layernorm.weight",
                                      layer.norms["input_layernorm"]), eps, last)
    h = g.op("Add", [h, attention(g, cfg, i, layer, quantized, x, shared)])
    x = rms_norm(g, h, g.float_weight(f"transformer.layers.{i}.post_layernorm.weight",
                                      layer.norms["post_layernorm"]), eps, last)
    return g.op("Add", [h, mlp(g, i, layer, quantized, x)])


def graph_io(cfg: CheckpointConfig, in_place: bool) -> tuple[list, list]:
    arch = cfg.arch
    length = (lambda past: CACHE) if in_place else (lambda past: PAST if past else TOTAL)
    kv = lambda name, past: helper.make_tensor_value_info(  # noqa: E731
        name, TensorProto.FLOAT, [BATCH, arch.num_key_value_heads, length(past), arch.head_size])
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [BATCH, SEQ]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [BATCH, TOTAL]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [BATCH, SEQ])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, KEPT, arch.vocab_size])]
    for i in range(arch.num_hidden_layers):
        inputs += [kv(n, True) for n in past_names(i)]
        outputs += [kv(n, False) for n in present_names(i)]
    inputs += [helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, []),
               helper.make_tensor_value_info(PROMPT_IDS, TensorProto.INT64, [PROMPT])]
    outputs.append(helper.make_tensor_value_info(PROMPT_LOGITS, TensorProto.FLOAT, [PROMPT_KEPT, arch.vocab_size]))
    for i in range(arch.num_hidden_layers):
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT,
                                                  [1, arch.num_key_value_heads, PROMPT, arch.head_size])
                    for n in prompt_present_names(i)]
    return inputs, outputs


def start_graph(g: GraphBuilder, cfg: CheckpointConfig, embedding: torch.Tensor) -> tuple[str, Shared]:
    """The embedded tokens, flat [N, hidden] (the rows' input_ids, then prompt_ids), and what the layers share."""
    arch = cfg.arch
    hd, nq, nkv = arch.head_size, arch.num_attention_heads, arch.num_key_value_heads
    g.const("axes.-1", np.array([-1], np.int64))
    g.const("axes.2", np.array([2], np.int64))
    g.const("float.2", np.array(2.0, np.float32))
    g.const("attention.groups", np.array([0, nkv, nq // nkv, -1, hd], np.int64))
    g.const("attention.merge", np.array([0, nq, -1, hd], np.int64))
    g.const("attention.flat", np.array([-1, nq * hd], np.int64))
    g.const("attention.scale", np.array(1.0 / math.sqrt(hd), np.float32))
    g.const("attention.masked", LOWEST)
    if not g.in_place:      # the input's default: no prompt group (an IOBinding cannot bind an input with one)
        g.const(PROMPT_IDS, np.zeros(0, np.int64))
    shared = build_shared(g, cfg)
    table = g.float_weight("transformer.vocab_embedding.weight", embedding)
    rows = g.op("Reshape", [g.op("Gather", [table, "input_ids"]),
                            g.const("shape.tokens", np.array([-1, arch.hidden_size], np.int64))])
    return g.op("Concat", [rows, g.op("Gather", [table, PROMPT_IDS])], axis=0), shared


def kept_positions(g: GraphBuilder, x: str) -> str:
    """x [B, T, H] from position T - logits_to_keep on (every position when logits_to_keep is 0 or exceeds T).
    `logits_to_keep` is a graph input with a default (an initializer of the same name), so feeds without it work;
    an in-place export requires it, as it does prompt_ids: its runner binds every input anyway.
    int.0, int.1, axes.0 and axes.1 are build_shared's."""
    keep = LOGITS_TO_KEEP if g.in_place else g.const(LOGITS_TO_KEEP, np.array(0, np.int64))
    length = g.op("Gather", [g.op("Shape", [x]), "int.1"])
    start = g.op("Max", [g.op("Sub", [length, keep]), "int.0"])
    start = g.op("Where", [g.op("Greater", [keep, "int.0"]), start, "int.0"])
    starts = g.op("Unsqueeze", [start, "axes.0"])
    ends = g.const("ends.max", np.array([np.iinfo(np.int64).max], np.int64))
    return g.op("Slice", [x, starts, ends, "axes.1"])


def head_logits(g: GraphBuilder, x: str, lm_head: torch.Tensor | QuantizedHead | None) -> str:
    """x @ lm_head^T (`finish_graph`)."""
    if isinstance(lm_head, QuantizedHead):
        if lm_head.prequant is not None:
            x = g.op("Mul", [x, g.const("lm_head.prequant_scaling_factor", lm_head.prequant.numpy())])
        return int4_matmul(g, x, lm_head.weight, "lm_head")
    if lm_head is None:
        table = "transformer.vocab_embedding.weight"
        if g.weight_dtype == TensorProto.FLOAT16:
            table = g.op("Cast", [table], to=TensorProto.FLOAT)
        head = g.op("Transpose", [table], perm=[1, 0])
    else:
        head = g.float_weight("lm_head.weight", lm_head.t().contiguous())
    return g.op("MatMul", [x, head])


def finish_graph(g: GraphBuilder, cfg: CheckpointConfig, h: str, final_norm: torch.Tensor,
                 lm_head: torch.Tensor | QuantizedHead | None, shared: Shared) -> GraphProto:
    """ln_f and lm_head (None: tied to the embedding, whose initializer is reused transposed; a 4-bit one: its
    smoothing Mul and a MatMulNBits), over the rows' kept positions and the prompt's last token in one product."""
    arch = cfg.arch
    x = rms_norm(g, h, g.float_weight("transformer.ln_f.weight", final_norm), arch.norm_epsilon, "axes.-1")
    rows, prompt = g.ops("Split", [x, shared.groups], 2, axis=0)
    hidden = g.const("shape.hidden", np.array([arch.hidden_size], np.int64))
    rows = kept_positions(g, g.op("Reshape", [rows, g.op("Concat", [shared.rows_shape, hidden], axis=0)]))
    last = g.op("Slice", [prompt, g.const("starts.-1", np.array([-1], np.int64)), "ends.max", "axes.0"])
    flat = g.op("Reshape", [rows, "shape.tokens"])
    sizes = g.op("Concat", [g.op("Shape", [flat], start=0, end=1), g.op("Shape", [last], start=0, end=1)], axis=0)
    kept = g.op("Concat", [flat, last], axis=0)
    rows_logits, prompt_logits = g.ops("Split", [head_logits(g, kept, lm_head), sizes], 2, axis=0)
    vocab = g.const("shape.vocab", np.array([arch.vocab_size], np.int64))
    g.op("Reshape", [rows_logits, g.op("Concat", [g.op("Shape", [rows], start=0, end=2), vocab], axis=0)],
         out="logits")
    g.op("Identity", [prompt_logits], out=PROMPT_LOGITS)
    inputs, outputs = graph_io(cfg, g.in_place)
    return helper.make_graph(g.nodes, "trtpipe_decoder", inputs, outputs, g.initializers)
