"""Run many sequences through a checkpoint one decoder layer at a time (calibration, eval, golden checks).

Holding a whole model is what a serving runtime does; a stage that only needs statistics, perplexity
or the argmax of a few sequences does not. `LayerStream` reads one merged layer (`CheckpointReader`),
moves it to the device, pushes every sequence through it, frees it and goes on, keeping only the
hidden states between layers. The embedding and lm_head are read in vocabulary chunks of at most
`VOCAB_CHUNK_BYTES` of float32. Every sequence goes through a layer on its own, with the same
operations `ReferenceModel.forward` applies to a batch of one, so the results are bit for bit the
whole-model ones (tests/test_stream.py): peak memory is one layer plus the activations, whatever the
depth of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import UserError
from .trtllm_reader import Layer, Linear
from .hf_checkpoint import open_checkpoint
from .model import FUSED_MLP, Observer, decoder_layer, fuse_fc_gate, make_step, rms_norm
from .rope import RotaryTable

DEVICES = ("auto", "cpu", "cuda")
#: float32 bytes of embedding / lm_head rows read at once
VOCAB_CHUNK_BYTES = 256 << 20


@dataclass
class LoadedLayer:
    """Decoder layer `index` as `run_layers` holds it while its passes run. A pass may change a weight in place
    between two passes (sparsify prunes it, and the next pass and the next layer's inputs see the pruned layer)."""

    index: int
    layer: Layer
    fused: Linear | None            # mlp.fc and mlp.gate as one GEMM (then absent from layer.linears)

    def linear(self, name: str) -> Linear:
        """The linear `name` (attention.qkv, mlp.gate, ...): for a fused one, views of its rows of the fused GEMM."""
        if name in self.layer.linears:
            return self.layer.linears[name]
        rows = self.fused.weight.shape[0] // 2
        part = slice(0, rows) if name == FUSED_MLP[0] else slice(rows, 2 * rows)
        return Linear(self.fused.weight[part], None if self.fused.bias is None else self.fused.bias[part],
                      self.fused.act_quant, self.fused.prequant)


#: what a stage runs for each layer: observers, one pass over all sequences each (None: no observer)
LayerPasses = Callable[[LoadedLayer], Iterable[Observer | None]]


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else the CPU; `cuda` without a GPU is the user's mistake."""
    if name not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)} (got {name!r})")
    if name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if name == "cuda":
        raise UserError("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                        "use --device cpu, or run inside NVIDIA's container with the GPU visible")
    return torch.device("cpu")


@dataclass(frozen=True)
class TokenScores:
    """Per predicted token of one sequence (positions 1..T-1): its negative log-likelihood and the argmax."""

    nll: torch.Tensor        # float32 [T-1]
    argmax: torch.Tensor     # int64 [T-1]: the greedy choice after each prefix


class LayerStream:
    """A checkpoint (TensorRT-LLM's, or a Hugging Face one: `open_checkpoint`) executed a decoder layer at a
    time on `device`."""

    def __init__(self, ckpt_dir: str | Path, device: torch.device | str = "cpu"):
        self.reader = open_checkpoint(Path(ckpt_dir))
        self.cfg = self.reader.cfg
        self.device = torch.device(device)
        self.rotary = RotaryTable(self.cfg.arch)

    @property
    def num_layers(self) -> int:
        return self.cfg.arch.num_hidden_layers

    @torch.inference_mode()
    def run_layers(self, sequences: Sequence[Sequence[int]], passes: LayerPasses | None = None,
                   after_layer: Callable[[int], None] | None = None, desc: str | None = None) -> list[torch.Tensor]:
        """Hidden states [1, T, hidden] of each sequence after the last decoder layer (before ln_f).

        For layer i, `passes(LoadedLayer(i, ...))` yields observers lazily (a later one may depend on what an
        earlier one saw, and may follow a change of the layer's weights); each gets one pass of every sequence
        through the layer, in order. `after_layer(i)` runs once the layer's weights are released.
        """
        hidden = self.embed(sequences)
        arch = self.cfg.arch
        steps = {}
        for i in tqdm(range(self.num_layers), desc=desc, unit="layer", disable=desc is None, leave=False):
            layer = _to_device(self.reader.layer(i), self.device)
            fused = fuse_fc_gate(layer)
            if fused is not None:                # the fused GEMM replaces them: do not hold both copies
                layer = replace(layer, linears={k: v for k, v in layer.linears.items() if k not in FUSED_MLP})
            for observer in (passes(LoadedLayer(i, layer, fused)) if passes else (None,)):
                out = []
                for h in hidden:
                    t = h.shape[1]
                    if t not in steps:
                        positions = torch.arange(t)[None]
                        steps[t] = make_step(self.cfg, self.rotary, positions, None, t).to(self.device)
                    keys = torch.zeros(1, arch.num_key_value_heads, t, arch.head_size, device=self.device)
                    out.append(decoder_layer(self.cfg, i, layer, fused, h, steps[t], keys, torch.zeros_like(keys),
                                             observer))
            hidden = out
            del layer, fused
            if after_layer is not None:
                after_layer(i)
        return hidden

    def embed(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """float32 [1, T, hidden] embeddings of each sequence, reading the table a vocabulary chunk at a time."""
        return embed_in_chunks(sequences, self.cfg.arch.vocab_size, self.cfg.arch.hidden_size, self.reader.embedding,
                               self.device)

    def vocab_ranges(self) -> list[tuple[int, int]]:
        return vocab_ranges(self.cfg.arch.vocab_size, self.cfg.arch.hidden_size)

    @torch.inference_mode()
    def token_scores(self, sequences: Sequence[Sequence[int]], desc: str | None = None) -> list[TokenScores]:
        """NLL and argmax of every next token of each sequence, from logits computed a vocabulary chunk at a time."""
        hidden = self.run_layers(sequences, desc=desc)
        norm = self.reader.final_norm().to(self.device)
        normed = [rms_norm(h[0, :-1], norm, self.cfg.arch.norm_epsilon) for h in hidden]
        targets = [torch.tensor(list(s[1:]), dtype=torch.long, device=self.device) for s in sequences]
        lse = [torch.full((len(t),), float("-inf"), device=self.device) for t in targets]
        picked = [torch.zeros(len(t), device=self.device) for t in targets]
        best = [torch.full((len(t),), float("-inf"), device=self.device) for t in targets]
        best_id = [torch.zeros(len(t), dtype=torch.long, device=self.device) for t in targets]
        for start, stop in self.vocab_ranges():
            head = self.reader.lm_head((start, stop)).to(self.device)
            for j, x in enumerate(normed):
                logits = F.linear(x, head)
                lse[j] = torch.logaddexp(lse[j], torch.logsumexp(logits, dim=-1))
                inside = (targets[j] >= start) & (targets[j] < stop)
                rows = inside.nonzero().squeeze(1)
                picked[j][rows] = logits[rows, targets[j][rows] - start]
                best[j], best_id[j] = running_argmax(best[j], best_id[j], logits, start)
        return [TokenScores((lse[j] - picked[j]).cpu(), best_id[j].cpu()) for j in range(len(sequences))]


def vocab_ranges(vocab_size: int, hidden_size: int) -> list[tuple[int, int]]:
    """Row ranges of an embedding / lm_head of at most `VOCAB_CHUNK_BYTES` of float32 each."""
    rows = max(1, VOCAB_CHUNK_BYTES // (4 * hidden_size))
    return [(start, min(start + rows, vocab_size)) for start in range(0, vocab_size, rows)]


def embed_in_chunks(sequences: Sequence[Sequence[int]], vocab_size: int, hidden_size: int,
                    read_rows: Callable[[tuple[int, int]], torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """float32 [1, T, hidden] embeddings of each sequence; `read_rows((start, stop))` reads a range of the table."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise UserError("every sequence needs at least one token")
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise UserError(f"token ids must be in [0, {vocab_size}) (got {int(ids.min())}..{int(ids.max())})")
    flat = torch.empty(len(ids), hidden_size)
    for start, stop in vocab_ranges(vocab_size, hidden_size):
        hit = (ids >= start) & (ids < stop)
        if bool(hit.any()):
            flat[hit] = read_rows((start, stop)).float().cpu()[ids[hit] - start]
    return [part[None].to(device) for part in flat.split([len(s) for s in sequences])]


def running_argmax(best: torch.Tensor, best_id: torch.Tensor, logits: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a vocabulary chunk's logits [T, chunk] (ids from `start`) into the best value and id so far.
    Strictly greater only: the first maximum wins, as torch.argmax over the whole row picks it."""
    value, index = logits.max(dim=-1)
    better = value > best
    return torch.where(better, value, best), torch.where(better, index + start, best_id)


def _to_device(layer: Layer, device: torch.device) -> Layer:
    if device.type == "cpu":
        return layer
    def move(t):
        return None if t is None else t.to(device)
    linears = {name: Linear(move(lin.weight), move(lin.bias), lin.act_quant, move(lin.prequant))
               for name, lin in layer.linears.items()}
    return Layer(linears, {name: norm.to(device) for name, norm in layer.norms.items()}, layer.kv_quant)
