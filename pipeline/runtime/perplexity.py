"""Perplexity of token sequences under a model with `forward(input_ids [1, T]) -> logits [1, T, vocab]`, or
under a `LayerStream`, which scores every window in one pass through the layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import UserError
from .stream import LayerStream


class LogitsModel(Protocol):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens: int          # predicted tokens the perplexity averages over
    nll: float           # mean negative log-likelihood per token (nats)

    def to_dict(self) -> dict:
        return {"perplexity": self.perplexity, "tokens": self.tokens}


def perplexity(model: LogitsModel | LayerStream, sequences: Sequence[Sequence[int]], *, window: int = 512,
               progress: bool = False, desc: str = "perplexity") -> PerplexityResult:
    """exp(mean NLL) of every token after the first of each window of `window` tokens.

    Each sequence is cut into consecutive windows (no overlap); every window is one forward pass from
    position 0, so a model is scored only on what it would see in a prompt of that length.
    """
    if window < 2:
        raise UserError(f"the perplexity window must be at least 2 tokens (got {window})")
    chunks = [list(seq[i:i + window]) for seq in sequences for i in range(0, len(seq), window)]
    chunks = [c for c in chunks if len(c) >= 2]
    total = sum(len(c) - 1 for c in chunks)
    if total == 0:
        raise UserError("the dataset has no text to score (every sample is shorter than 2 tokens)")
    if isinstance(model, LayerStream):
        nll_sum = sum(float(s.nll.double().sum()) for s in model.token_scores(chunks, desc if progress else None))
    else:
        nll_sum = 0.0
        with torch.inference_mode(), tqdm(total=total, desc=desc, unit="tok", disable=not progress, leave=False) as bar:
            for chunk in chunks:
                ids = torch.tensor([chunk])
                logits = model.forward(ids)[0, :-1].float()
                nll_sum += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
                bar.update(len(chunk) - 1)
    mean = nll_sum / total
    return PerplexityResult(math.exp(mean), total, mean)
