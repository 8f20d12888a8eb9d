"""Per-request sampling parameters and token selection (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral

import torch

from ..errors import UserError


@dataclass
class SamplingConfig:
    """How one request generates. top_k=1 is greedy; top_k=0 means no top-k limit.

    min_tokens: end_id cannot be chosen before the output has this many tokens (TensorRT-LLM's min length:
    its penalty kernel sets the end id's logit to -inf while generated < min_tokens, before sampling). 0 and
    1 mean no constraint, as for a lone upstream request (its default min length is 1, and the penalty is only
    applied when some request asks for more). Stop words and max_new_tokens still end a request earlier.
    """

    max_new_tokens: int = 16
    end_id: int | None = None
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 1.0
    seed: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)  # token-id sequences that end generation
    min_tokens: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        if not isinstance(self.min_tokens, Integral) or self.min_tokens < 0:
            raise UserError(f"min_tokens must be an integer >= 0 (got {self.min_tokens!r})")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (got {self.top_k}; 1 is greedy, 0 means no limit)")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not self.greedy and self.temperature <= 0:
            raise UserError(f"temperature must be > 0 when sampling (got {self.temperature})")
        if any(not len(seq) or not all(isinstance(t, Integral) for t in seq) for seq in self.stop_words):
            raise UserError("stop_words must be a list of non-empty token-id lists")
        self.stop_words = [[int(t) for t in seq] for seq in self.stop_words]

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def trtllm_sampling(top_k: int, top_p: float, temperature: float, **config) -> SamplingConfig:
    """TensorRT-LLM's sampling semantics as a SamplingConfig: top_k 1, temperature 0, or top_k 0 with top_p 0
    (the executor's defaults when a request sets neither) mean greedy; a temperature or top_p of 0 is not
    applied otherwise. `config`: the other SamplingConfig fields."""
    greedy = top_k == 1 or (top_k == 0 and top_p == 0) or temperature == 0
    return SamplingConfig(temperature=temperature if temperature > 0 else 1.0, top_k=1 if greedy else top_k,
                          top_p=top_p if top_p > 0 else 1.0, **config)


class TokenSelector:
    """Chooses the next token of one request from its float32 logits [vocab]."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self.generator = torch.Generator()
        if cfg.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(cfg.seed)

    def __call__(self, logits: torch.Tensor, generated: int = 0) -> int:
        """The next token after `generated` output tokens (end_id is masked while generated < min_tokens)."""
        end, least = self.cfg.end_id, self.cfg.min_tokens
        if end is not None and 0 <= end < logits.numel() and least > 1 and generated < least:
            logits = logits.clone()
            logits[end] = float("-inf")
        if self.cfg.greedy:
            return int(torch.argmax(logits))
        scaled = logits / self.cfg.temperature
        k = self.cfg.top_k or scaled.numel()
        values, indices = torch.topk(scaled, min(k, scaled.numel()))   # sorted, largest first
        probs = torch.softmax(values, dim=-1)
        if self.cfg.top_p < 1.0:
            before = torch.cumsum(probs, dim=-1) - probs                  # mass of the tokens ranked above
            probs = torch.where(before < self.cfg.top_p, probs, torch.zeros_like(probs))
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(indices[choice])
