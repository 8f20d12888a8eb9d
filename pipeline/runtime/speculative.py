"""Speculative decoding for the runtimes of the cpu target: drafts proposed cheaply, verified by one forward pass.

A `Drafter` proposes up to K tokens that may follow a row's tokens so far. The decoder then feeds the row's last
chosen token and the K drafts in one step (`SpeculativeDecoder.verify`), which gives the logits after each of them:
K + 1 next-token distributions for about the cost of one decode step, since a small step is bound by reading the
weights. `accept_drafts` chooses the tokens from those logits in order, with the row's own `TokenSelector`, and
stops at the first chosen token that differs from its draft; that token is the step's last. The decoder then
forgets what it cached for the rejected drafts (`rewind`): their positions are written again by the next step.

Why this is exact. The logits after draft j are the target's logits for the sequence the row has once drafts
0..j-1 are accepted, so choosing from them in order is what plain decoding would do, token for token: the same
penalties and bad words (the selector's history grows as it chooses), the same end id, stop words and
max_new_tokens (`advance` is the plain loop's), and with a seed the same random draws (one per output token).
The drafts here are deterministic (a draft distribution q that puts all its mass on the proposed token), and for
such a q the standard speculative-sampling rule (accept draft d with probability min(1, p(d) / q(d)) = p(d), else
draw from the normalised max(0, p - q), which is p without d) gives token x with probability p(x): the same as
drawing x from p and accepting the draft when x == d, which is what `accept_drafts` does. Greedy requests and
sampled ones are both exact in distribution; greedy ones equal plain decoding up to the float rounding of a
several-token step against a one-token one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from ..errors import UserError

#: the drafting methods the cpu runtimes run (`--speculative`)
NGRAM = "ngram"
#: prompt lookup's defaults: the longest and shortest n-gram matched (vLLM's prompt_lookup_max / _min, TensorRT-LLM
#: NGramDecodingConfig.max_matching_ngram_size)
MAX_NGRAM, MIN_NGRAM = 3, 1


@runtime_checkable
class SpeculativeDecoder(Protocol):
    """A decoder that can feed several tokens of a row in one step and forget the last ones it fed."""

    def verify(self, rows: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """float32 [len(tokens[i]), vocab] per row: the logits after each of `tokens[i]`, fed to row `rows[i]`
        after everything it has seen (the row moves on by len(tokens[i]))."""

    def rewind(self, row: int, count: int) -> None:
        """Forget the last `count` tokens fed to `row` (the next step writes their positions again)."""


class Drafter(Protocol):
    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that may follow `history` (the prompt and the tokens chosen so far)."""


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the history's last n tokens (n from
    max_ngram down to min_ngram), up to draft_len of them. Pays where the output repeats the input: a summary, an
    extraction, code edits, a quoted document."""

    draft_len: int
    max_ngram: int = MAX_NGRAM
    min_ngram: int = MIN_NGRAM

    def __post_init__(self):
        if self.draft_len < 1:
            raise UserError(f"the draft length must be at least 1 (got {self.draft_len})")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError(f"n-gram sizes must satisfy 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})")

    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        k = min(self.draft_len, limit)
        n_max = min(self.max_ngram, len(history) - 1)
        if k < 1 or n_max < self.min_ngram:
            return []
        for n in range(n_max, self.min_ngram - 1, -1):
            tail = list(history[-n:])
            first = tail[0]
            # the latest start before the tail itself whose n tokens equal the tail
            for start in range(len(history) - n - 1, -1, -1):
                if history[start] == first and list(history[start:start + n]) == tail:
                    return list(history[start + n:start + n + k])
        return []


@dataclass
class Speculation:
    """How a loop speculates: the drafter, and the most rows a step may have for it to draft (above that a step of
    K + 1 tokens a row costs more than the accepted tokens save: the plan's break-even concurrency)."""

    drafter: Drafter
    max_rows: int | None = None

    def drafts(self, rows: int, history: Sequence[int], limit: int) -> list[int]:
        if self.max_rows is not None and rows > self.max_rows:
            return []
        return self.drafter.propose(history, limit)


def draft_limit(max_new_tokens: int, produced: int) -> int:
    """The drafts worth proposing after `produced` tokens: a step of k drafts outputs up to k + 1 tokens."""
    return max_new_tokens - produced - 1


def leading_matches(chosen: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts, from the first, equal the tokens chosen in their place."""
    n = 0
    while n < len(drafts) and n < len(chosen) and chosen[n] == drafts[n]:
        n += 1
    return n
