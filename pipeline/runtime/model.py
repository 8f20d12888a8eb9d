"""The decoder forward pass as TensorRT-LLM defines it for the Llama and Qwen families, and generation
with a preallocated KV cache.

Per layer: RMSNorm(norm_epsilon) -> fused qkv (split by head counts and head_size; plus its bias when
the family has one) -> per-head RMSNorm of q and k when the layer has `attention.q_layernorm` /
`k_layernorm` (Qwen3; eps = norm_epsilon, as transformers computes it) -> rope_gpt_neox
-> attention over the KV cache (GQA/MQA: query head h reads K/V head h // (heads / kv_heads)) ->
attention.dense -> residual -> RMSNorm -> GatedMLP proj(silu(fc(x)) * gate(x)) -> residual; then
ln_f and lm_head. Everything is computed in float32; quantized checkpoints run with their weights
dequantized and their activations (and K/V cache entries) quantized-then-dequantized with the
checkpoint's scales, which is what the engine's GEMMs see up to accumulation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..checkpoint import CheckpointConfig
from .trtllm_reader import Layer, Linear, ModelWeights
from .hf_checkpoint import load_checkpoint
from .rope import RotaryTable
from .generate import (
    EndCallback, PollCallback, RowResult, StepCallback, TokenCallback, check_requests, fed_context, generate_rows,
    serve_rows, token_steps,
)
from .sampling import SamplingConfig
from .scheduler import Scheduler
from .speculative import Speculation

Observer = Callable[[str, torch.Tensor], None]
#: the GatedMLP linears that read the same input and can run as one GEMM
FUSED_MLP = ("mlp.fc", "mlp.gate")


class KVCache:
    """K and V of every layer for `batch` sequences of up to `capacity` tokens: [layers, B, kv_heads, S, d]."""

    def __init__(self, layers: int, batch: int, capacity: int, kv_heads: int, head_size: int):
        self.k = torch.zeros(layers, batch, kv_heads, capacity, head_size)
        self.v = torch.zeros_like(self.k)


@dataclass
class Step:
    """What every layer of one forward step shares: where the new tokens go and what they may see."""

    rows: torch.Tensor | None        # cache rows of the B sequences (None: all rows, in order)
    slots: torch.Tensor              # [B * T * kv_heads] flat cache slot of each new (token, kv head)
    cos: torch.Tensor                # [B, T, 1, d]
    sin: torch.Tensor
    visible: torch.Tensor            # [B, 1, T, S] key j visible to the query at position p iff j <= p
    used: int                        # S: cache positions the step reads

    def store(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, kv_heads, d] into one layer's cache [rows, kv_heads, capacity, d]; return the
        cached K, V [B, kv_heads, S, d]."""
        d = k.shape[-1]
        keys.view(-1, d).index_copy_(0, self.slots, k.reshape(-1, d).to(keys.dtype))
        values.view(-1, d).index_copy_(0, self.slots, v.reshape(-1, d).to(values.dtype))
        if self.rows is None:
            return keys[:, :, :self.used], values[:, :, :self.used]
        return keys[self.rows, :, :self.used], values[self.rows, :, :self.used]

    def to(self, device: torch.device) -> "Step":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Step(move(self.rows), move(self.slots), move(self.cos), move(self.sin), move(self.visible), self.used)


class ReferenceModel:
    """A TensorRT-LLM checkpoint executed with torch on the CPU."""

    def __init__(self, cfg: CheckpointConfig, weights: ModelWeights):
        self.cfg = cfg
        self.weights = weights
        self.rotary = RotaryTable(cfg.arch)
        self._fused_mlp = [fuse_fc_gate(layer) for layer in weights.layers]

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> "ReferenceModel":
        return cls(*load_checkpoint(Path(ckpt_dir)))

    @property
    def vocab_size(self) -> int:
        return self.cfg.arch.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.arch.max_position_embeddings

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, observer: Observer | None = None) -> torch.Tensor:
        """Logits float32 [B, T, vocab] of a batch of equal-length sequences [B, T] (causal, from position 0)."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise UserError("input_ids must be a [batch, tokens] tensor with tokens >= 1 "
                            f"(got shape {list(input_ids.shape)})")
        self._check_tokens(input_ids)
        b, t = input_ids.shape
        cache = self._cache(b, t)
        positions = torch.arange(t).expand(b, t)
        hidden = self._hidden(input_ids.long(), positions, cache, None, observer)
        return self._logits(hidden)

    def _cache(self, batch: int, capacity: int) -> KVCache:
        arch = self.cfg.arch
        return KVCache(len(self.weights.layers), batch, capacity, arch.num_key_value_heads, arch.head_size)

    def _check_tokens(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.arch.vocab_size):
            raise UserError(f"token ids must be in [0, {self.cfg.arch.vocab_size}) "
                            f"(got {int(ids.min())}..{int(ids.max())})")

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor | None, observer: Observer | None) -> torch.Tensor:
        """The final hidden states [b, t, hidden] of tokens [b, t] at `positions`, in cache rows `rows`."""
        return self._hidden_groups([(tokens, positions, rows)], cache, observer).reshape(*tokens.shape, -1)

    def _hidden_groups(self, groups: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], cache: KVCache,
                       observer: Observer | None = None) -> torch.Tensor:
        """The final hidden states, flat [tokens, hidden], of groups of (tokens [b, t], positions [b, t], cache rows)
        computed in one pass: every linear reads its weights once for all of them, attention is per group."""
        steps = [make_step(self.cfg, self.rotary, positions, rows, cache.k.shape[3]) for _, positions, rows in groups]
        hidden = self.cfg.arch.hidden_size
        h = torch.cat([self.weights.embedding[tokens].reshape(-1, hidden) for tokens, _, _ in groups])
        for i, layer in enumerate(self.weights.layers):
            h = decoder_layer(self.cfg, i, layer, self._fused_mlp[i], h, steps, cache.k[i], cache.v[i], observer)
        return h

    @property
    def config(self) -> dict:
        """The checkpoint's config.json."""
        return self.cfg.to_dict()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.weights.final_norm, self.cfg.arch.norm_epsilon), self.weights.lm_head)

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                 on_token: TokenCallback | None = None, on_end: EndCallback | None = None,
                 speculation: Speculation | None = None) -> list[list[int]]:
        """New tokens of every prompt. Requests share batched decode steps but never each other's cache rows."""
        return [result.tokens for result in self.generate_rows(prompts, sampling, token_steps(on_token), on_end,
                                                                    speculation)]

    @torch.inference_mode()
    def generate_rows(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                      on_step: StepCallback | None = None, on_end: EndCallback | None = None,
                      speculation: Speculation | None = None) -> list[RowResult]:
        """`generate` with each request's record: its tokens and the log probs and logits it asked for."""
        configs = check_requests(prompts, sampling, self.vocab_size, self.max_position_embeddings)
        if not prompts:
            return []
        decoder = CacheDecoder(self, [fed_context(p, c) for p, c in zip(prompts, configs)], configs)
        return generate_rows(decoder, configs, on_step, on_end, prompts, speculation)

    @torch.inference_mode()
    def serve_rows(self, scheduler: Scheduler, poll: PollCallback, on_step, on_end,
                   speculation: Speculation | None = None) -> None:
        """In-flight generation (pipeline/runtime/generate.py `serve_rows`): the sequences submitted to `scheduler`
        join the running batch between decode steps, each in a cache row a finished one left."""
        serve_rows(self.inflight_decoder(), scheduler, poll, on_step, on_end, speculation)

    def inflight_decoder(self) -> "CacheDecoder":
        """An empty batch whose rows come and go (what serve_rows runs, and what a draft model drafts with)."""
        return CacheDecoder(self)


class CacheDecoder:
    """The reference runtime's `InflightDecoder` (pipeline/runtime/generate.py): one cache row (slot) per running
    prompt, handed to a later prompt once its row ends; the cache grows (more slots, more positions) when an added
    prompt needs it. Made with prompts, it is the one preallocated batch `generate_rows` runs."""

    def __init__(self, model: ReferenceModel, prompts: Sequence[Sequence[int]] = (),
                 configs: Sequence[SamplingConfig] = ()):
        self.model = model
        self.cache = model._cache(0, 0)
        self.prompts: dict[int, Sequence[int]] = {}
        self.slots: dict[int, int] = {}      # row -> its cache row
        self.lengths: dict[int, int] = {}    # row -> the position of its next token
        self.free: list[int] = []            # cache rows no row holds, ascending
        if prompts:
            self.add(list(range(len(prompts))), prompts, configs)

    def add(self, rows: list[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]) -> None:
        need = max(len(p) + c.max_new_tokens for p, c in zip(prompts, configs))
        missing = len(rows) - len(self.free)
        if missing > 0 or need > self.cache.k.shape[3]:
            self._grow(self.cache.k.shape[1] + max(missing, 0), max(need, self.cache.k.shape[3]))
        for row, prompt in zip(rows, prompts):
            self.slots[row], self.prompts[row], self.lengths[row] = self.free.pop(0), prompt, len(prompt)

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.free.append(self.slots.pop(row))
            del self.prompts[row], self.lengths[row]
        self.free.sort()

    def _grow(self, slots: int, capacity: int) -> None:
        """A cache of `slots` rows of `capacity` positions holding what the old one held."""
        old = self.cache
        held, positions = old.k.shape[1], old.k.shape[3]
        self.cache = self.model._cache(slots, capacity)
        self.cache.k[:, :held, :, :positions] = old.k
        self.cache.v[:, :held, :, :positions] = old.v
        self.free = sorted(self.free + list(range(held, slots)))

    def prefill(self, rows: list[int]) -> torch.Tensor:
        logits = torch.empty(len(rows), self.model.vocab_size)
        for i, r in enumerate(rows):
            logits[i] = self.model._logits(self._prompt_hidden(r)[-1])
        return logits

    def prefill_context(self, rows: list[int]) -> list[torch.Tensor]:
        """Each row's logits at every prompt position (the lm_head over all of them: only when asked)."""
        return [self.model._logits(self._prompt_hidden(r)) for r in rows]

    def _prompt_hidden(self, r: int) -> torch.Tensor:
        """Row r's prompt through the model into its cache row: the final hidden states [prompt_len, hidden]."""
        ids = torch.tensor([list(self.prompts[r])])
        return self.model._hidden(ids, torch.arange(ids.shape[1])[None], self.cache, torch.tensor([self.slots[r]]),
                                  None)[0]

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        slots = [self.slots[r] for r in rows]
        cache_rows = None if slots == list(range(self.cache.k.shape[1])) else torch.tensor(slots)
        hidden = self.model._hidden(torch.tensor([[t] for t in tokens]), self._next_positions(rows), self.cache,
                                    cache_rows, None)
        return self.model._logits(hidden[:, 0])

    mixes_prompts = True

    def decode_with_prompt(self, rows: list[int], tokens: list[int], row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of the rows and `row`'s prompt into its cache row in the same pass: (the rows' logits, the logits
        after the prompt)."""
        prompt = torch.tensor([list(self.prompts[row])])
        groups = [(torch.tensor([[t] for t in tokens]), self._next_positions(rows),
                   torch.tensor([self.slots[r] for r in rows])),
                  (prompt, torch.arange(prompt.shape[1])[None], torch.tensor([self.slots[row]]))]
        hidden = self.model._hidden_groups(groups, self.cache)
        logits = self.model._logits(torch.cat([hidden[:len(rows)], hidden[-1:]]))
        return logits[:-1], logits[-1]

    def verify(self, rows: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Each row's tokens after its cache in one pass (rows feeding as many tokens form one attention group):
        float32 [len(tokens[i]), vocab] per row."""
        groups: dict[int, list[int]] = {}
        for i, fed in enumerate(tokens):
            groups.setdefault(len(fed), []).append(i)
        batches = []
        for n, members in groups.items():
            starts = torch.tensor([[self.lengths[rows[i]]] for i in members])
            batches.append((torch.tensor([tokens[i] for i in members]), starts + torch.arange(n)[None],
                            torch.tensor([self.slots[rows[i]] for i in members])))
            for i in members:
                self.lengths[rows[i]] += n
        logits = self.model._logits(self.model._hidden_groups(batches, self.cache))
        out: list[torch.Tensor | None] = [None] * len(rows)
        offset = 0
        for n, members in groups.items():
            for i in members:
                out[i], offset = logits[offset:offset + n], offset + n
        return out

    def rewind(self, row: int, count: int) -> None:
        """Positions are written by index and read up to each query's own, so moving back is enough."""
        self.lengths[row] -= count

    def _next_positions(self, rows: list[int]) -> torch.Tensor:
        """[rows, 1]: where each row's next token goes (and the row moves on by one)."""
        positions = torch.tensor([[self.lengths[r]] for r in rows])
        for r in rows:
            self.lengths[r] += 1
        return positions


def make_step(cfg: CheckpointConfig, rotary: RotaryTable, positions: torch.Tensor, rows: torch.Tensor | None,
              capacity: int) -> Step:
    """Where a forward step's tokens go in a cache of `capacity` positions and what each may attend to."""
    cos, sin = rotary.lookup(positions)
    used = int(positions.max()) + 1
    j = torch.arange(used)
    visible = j[None, None, :] <= positions[:, :, None]
    if cfg.arch.sliding_window:
        visible &= j[None, None, :] > positions[:, :, None] - int(cfg.arch.sliding_window)
    kv_heads = cfg.arch.num_key_value_heads
    batch_rows = torch.arange(positions.shape[0]) if rows is None else rows
    head_rows = batch_rows[:, None, None] * kv_heads + torch.arange(kv_heads)[None, None, :]
    slots = (head_rows * capacity + positions[:, :, None]).reshape(-1)
    return Step(rows, slots, cos, sin, visible[:, None], used)


def decoder_layer(cfg: CheckpointConfig, i: int, layer: Layer, fused_mlp: Linear | None, h: torch.Tensor,
                  step: Step | Sequence[Step], keys: torch.Tensor, values: torch.Tensor,
                  observer: Observer | None) -> torch.Tensor:
    """Layer `i` applied to hidden states h [B, T, hidden] of one step, or the flat [tokens, hidden] of several
    steps' tokens in turn (each step's [b, t] tokens, attending apart), with its K/V cache `keys`, `values`."""
    eps = cfg.arch.norm_epsilon
    x = rms_norm(h, layer.norms["input_layernorm"], eps)
    h = h + attention_block(cfg, i, layer, x, step, keys, values, observer)
    return h + mlp_block(i, layer, fused_mlp, rms_norm(h, layer.norms["post_layernorm"], eps), observer)


def attention_block(cfg: CheckpointConfig, i: int, layer: Layer, x: torch.Tensor, step: Step | Sequence[Step],
                    keys: torch.Tensor, values: torch.Tensor, observer: Observer | None) -> torch.Tensor:
    steps = [step] if isinstance(step, Step) else step
    p = f"transformer.layers.{i}.attention."
    qkv = linear(x.reshape(-1, x.shape[-1]), layer.linears["attention.qkv"], observer, p + "qkv")
    sizes = [s.cos.shape[0] * s.cos.shape[1] for s in steps]
    outs = [attend(cfg, i, layer, part, s, keys, values, observer) for part, s in zip(qkv.split(sizes), steps)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return linear(out, layer.linears["attention.dense"], observer, p + "dense").reshape(*x.shape[:-1], -1)


def attend(cfg: CheckpointConfig, i: int, layer: Layer, qkv: torch.Tensor, step: Step, keys: torch.Tensor,
           values: torch.Tensor, observer: Observer | None) -> torch.Tensor:
    """One step's attention: its fused qkv [b * t, width] -> the heads' output [b * t, heads * d], its K/V stored."""
    b, t = step.cos.shape[:2]
    hd, nq, nkv = cfg.arch.head_size, cfg.arch.num_attention_heads, cfg.arch.num_key_value_heads
    qk, v = qkv.split([(nq + nkv) * hd, nkv * hd], dim=-1)
    q, k = qk.reshape(b, t, nq + nkv, hd).split([nq, nkv], dim=2)
    if "attention.q_layernorm" in layer.norms:
        q = rms_norm(q, layer.norms["attention.q_layernorm"], cfg.arch.norm_epsilon)
        k = rms_norm(k, layer.norms["attention.k_layernorm"], cfg.arch.norm_epsilon)
    q, k = rotate(q, step.cos, step.sin), rotate(k, step.cos, step.sin)
    v = v.reshape(b, t, nkv, hd)
    if observer is not None:
        observer(f"transformer.layers.{i}.attention.k", k.reshape(b * t, nkv * hd))
        observer(f"transformer.layers.{i}.attention.v", v.reshape(b * t, nkv * hd))
    if layer.kv_quant is not None:
        k, v = layer.kv_quant(k), layer.kv_quant(v)
    cached_k, cached_v = step.store(keys, values, k, v)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), cached_k, cached_v, attn_mask=step.visible,
                                         scale=1.0 / math.sqrt(hd), enable_gqa=nq != nkv)
    return out.transpose(1, 2).reshape(b * t, nq * hd)


def mlp_block(i: int, layer: Layer, fused: Linear | None, x: torch.Tensor, observer: Observer | None) -> torch.Tensor:
    """TensorRT-LLM's GatedMLP: proj(silu(fc(x)) * gate(x)), fc and gate as one GEMM when `fused` is given."""
    p = f"transformer.layers.{i}.mlp."
    if fused is not None:
        if observer is not None:
            observer(p + "fc", x.reshape(-1, x.shape[-1]))
            observer(p + "gate", x.reshape(-1, x.shape[-1]))
        fc, gate = linear(x, fused, None, p + "fc").chunk(2, dim=-1)
    else:
        fc = linear(x, layer.linears["mlp.fc"], observer, p + "fc")
        gate = linear(x, layer.linears["mlp.gate"], observer, p + "gate")
    return linear(F.silu(fc) * gate, layer.linears["mlp.proj"], observer, p + "proj")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_gpt_neox on [..., heads, d]: the two halves of each head rotate as (x1, x2) pairs."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def linear(x: torch.Tensor, lin: Linear, observer: Observer | None, name: str) -> torch.Tensor:
    if observer is not None:
        observer(name, x.reshape(-1, x.shape[-1]))
    if lin.prequant is not None:
        x = x * lin.prequant
    if lin.act_quant is not None:
        x = lin.act_quant(x)
    return F.linear(x, lin.weight, lin.bias)


def fuse_fc_gate(layer: Layer) -> Linear | None:
    """mlp.fc and mlp.gate as one GEMM when they quantize their shared input identically (same result)."""
    fc, gate = (layer.linears[name] for name in FUSED_MLP)
    same_prequant = (fc.prequant is None and gate.prequant is None) or (
        fc.prequant is not None and gate.prequant is not None and torch.equal(fc.prequant, gate.prequant))
    if fc.act_quant != gate.act_quant or not same_prequant or (fc.bias is None) != (gate.bias is None):
        return None
    bias = None if fc.bias is None else torch.cat([fc.bias, gate.bias])
    return Linear(torch.cat([fc.weight, gate.weight]), bias, fc.act_quant, fc.prequant)
