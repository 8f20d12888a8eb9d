"""A checkpoint as a network to train (the student) or to learn from (the teacher), forward with autograd.

The decoder layers are the runtime's own (`runtime.model.decoder_layer`), so the student trains on exactly the
computation the reference runtime and the engine run. What trains: every decoder linear and norm; the embedding,
ln_f and lm_head stay as they are (the writer copies them). A 2:4 student keeps its masks: the gradient of a
pruned weight is zeroed before each step and the weights are masked after it, so every zero stays a zero.

A quantized student trains through its quantizers (quantization-aware training): the forward pass sees each
weight quantized with the checkpoint's own weights_scaling_factor and each activation and K/V value with its
calibrated scale, as the engine computes them; the gradient goes straight through the rounding (the
straight-through estimator) to a float master copy of the weights, which the writer quantizes back with the same
scales. The scales themselves stay fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..checkpoint import CheckpointConfig
from ..errors import UserError
from ..runtime.model import decoder_layer, make_step, rms_norm
from ..runtime.quant import FAKE_QUANT, TensorQuant
from ..runtime.rope import RotaryTable
from ..runtime.trtllm_reader import CheckpointReader, Layer, Linear, merge_weights

#: tokens of the lm_head + KL at once: their logits are recomputed in the backward pass, never all held
LOSS_CHUNK = 256


class StraightThrough:
    """A fake quantizer whose gradient is the identity (the straight-through estimator)."""

    def __init__(self, quant: TensorQuant):
        self.quant = quant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.quant(x) - x).detach()


def trainable_weight_kind(quant_algo: str) -> str | None:
    """The quantizer distill trains a checkpoint's weights through: FP8, or INT8 for every SmoothQuant variant; None
    for a format it cannot train (NVIDIA's 4-bit AWQ checkpoints, which the runtime only executes)."""
    return "fp8" if quant_algo == "FP8" else "int8" if quant_algo.startswith("W8A8_SQ") else None

@dataclass
class Network:
    cfg: CheckpointConfig
    embedding: torch.Tensor
    layers: list[Layer]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    masks: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)       # kept weights (2:4)
    weight_scales: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # QAT: per-element scales
    weight_kind: str | None = None                                                  # "fp8" | "int8" (QAT)

    @property
    def quantized(self) -> bool:
        return self.weight_kind is not None

    def parameters(self) -> list[torch.Tensor]:
        params = []
        for layer in self.layers:
            for lin in layer.linears.values():
                params += [lin.weight] + ([lin.bias] if lin.bias is not None else [])
            params += list(layer.norms.values())
        return params

    def hidden(self, ids: torch.Tensor, recompute: bool = False) -> torch.Tensor:
        """ln_f(decoder layers(embedding(ids))) [B, T, hidden] for ids [B, T] from position 0; with `recompute`
        each layer's activations are recomputed in the backward pass instead of kept."""
        arch = self.cfg.arch
        b, t = ids.shape
        step = make_step(self.cfg, RotaryTable(arch), torch.arange(t).expand(b, t), None, t)
        h = F.embedding(ids, self.embedding)

        def run(i: int, x: torch.Tensor) -> torch.Tensor:
            keys = torch.zeros(b, arch.num_key_value_heads, t, arch.head_size)
            return decoder_layer(self.cfg, i, self._as_run(i), None, x, step, keys, torch.zeros_like(keys), None)

        for i in range(len(self.layers)):
            h = checkpoint(run, i, h, use_reentrant=False) if recompute else run(i, h)
        return rms_norm(h, self.final_norm, arch.norm_epsilon)

    def _as_run(self, i: int) -> Layer:
        """Layer i as the forward pass computes it: with its weights fake-quantized when the student is quantized."""
        layer = self.layers[i]
        if not self.quantized:
            return layer
        fake = FAKE_QUANT[self.weight_kind]
        linears = {name: Linear(lin.weight + (fake(lin.weight, self.weight_scales[i, name]) - lin.weight).detach(),
                                lin.bias, lin.act_quant, lin.prequant)
                   for name, lin in layer.linears.items()}
        return Layer(linears, layer.norms, layer.kv_quant)

    def keep_masks(self, grads: bool) -> None:
        """Zero the pruned weights' gradients (before a step) or the weights themselves (after it)."""
        for (i, name), mask in self.masks.items():
            w = self.layers[i].linears[name].weight
            target = w.grad if grads else w.data
            if target is not None:
                target.mul_(mask)


def load_network(path, trainable: bool) -> Network:
    """The checkpoint at `path`, merged; with `trainable` its layers' weights and norms require gradients, the
    quantizers pass gradients straight through, and the 2:4 masks and the weight scales are recorded."""
    reader = CheckpointReader(path)
    cfg = reader.cfg
    embedding = reader.embedding()
    lm_head = embedding if reader.tied_lm_head else reader.lm_head()
    layers = [reader.layer(i) for i in range(reader.num_layers)]
    net = Network(cfg, embedding, layers, reader.final_norm(), lm_head)
    if not trainable:
        return net
    claim = cfg.sparsity
    if cfg.quant_algo is not None:
        net.weight_kind = trainable_weight_kind(cfg.quant_algo)
        if net.weight_kind is None:
            raise UserError(f"{path} is quantized as {cfg.quant_algo}; distill trains float, FP8 and "
                            "INT8-SmoothQuant checkpoints: distill the float checkpoint it came from")
    for i, layer in enumerate(layers):
        for name, lin in layer.linears.items():
            module = f"transformer.layers.{i}.{name}"
            if claim is not None and claim.covers(module):
                net.masks[i, name] = lin.weight != 0
            if cfg.quantizes(module):
                net.weight_scales[i, name] = weight_scale_map(reader, i, name)
            lin.weight.requires_grad_(True)
            if lin.bias is not None:
                lin.bias.requires_grad_(True)
            if lin.act_quant is not None:
                lin.act_quant = StraightThrough(lin.act_quant)
        if layer.kv_quant is not None:
            layer.kv_quant = StraightThrough(layer.kv_quant)
        for norm in layer.norms.values():
            norm.requires_grad_(True)
    return net


def weight_scale_map(reader: CheckpointReader, layer: int, name: str) -> torch.Tensor:
    """The scale each element of the merged weight of `name` in `layer` is quantized with, as the engine does:
    each tp rank's own (per tensor for FP8, per row for INT8), the larger of a fused FP8 pair's."""
    cfg = reader.cfg
    spec = cfg.family.linear(name)
    stage = [rf for rf in reader.ranks if layer in rf.position.layers]
    local = f"transformer.layers.{layer - stage[0].layer_offset}."
    per_rank = []
    for rf in stage:
        shape = rf.file.shape(local + name + ".weight")
        scale = rf.read(local + name + ".weights_scaling_factor").float().reshape(-1)
        fused = spec.fused_with and cfg.quantizes(f"transformer.layers.{layer}.{spec.fused_with}")
        if cfg.quant_algo == "FP8" and fused:
            partner = rf.read(local + spec.fused_with + ".weights_scaling_factor").float().reshape(-1)
            scale = torch.maximum(scale, partner)
        per_rank.append(scale.reshape(-1, 1).expand(shape) if scale.numel() > 1 else scale.expand(shape))
    if len(per_rank) == 1:
        return per_rank[0]                  # an expanded view: nothing as large as the weight is made
    return merge_weights(cfg, spec, [p.contiguous() for p in per_rank], f"transformer.layers.{layer}.{name}")


def kl_to_teacher(student_hidden: torch.Tensor, student_head: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) of the next-token distributions, from the student's final hidden
    states [N, hidden] and the teacher's log-probabilities [N, vocab], a chunk of tokens at a time."""
    total = student_hidden.new_zeros(())
    for start in range(0, student_hidden.shape[0], LOSS_CHUNK):
        stop = start + LOSS_CHUNK
        total = total + checkpoint(_chunk_kl, student_hidden[start:stop], student_head, teacher_logp[start:stop],
                                   use_reentrant=False)
    return total / student_hidden.shape[0]


def _chunk_kl(hidden: torch.Tensor, head: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(F.linear(hidden, head), dim=-1)
    return F.kl_div(logp, teacher_logp, log_target=True, reduction="sum")


@torch.no_grad()        # not inference_mode: the rotary tables it caches are read by the student's autograd too
def teacher_log_probs(teacher: Network, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's next-token log-probabilities [B * T, vocab] for ids [B, T]."""
    hidden = teacher.hidden(ids).reshape(-1, teacher.cfg.arch.hidden_size)
    return torch.cat([F.log_softmax(F.linear(hidden[s:s + LOSS_CHUNK], teacher.lm_head), dim=-1)
                      for s in range(0, hidden.shape[0], LOSS_CHUNK)])
