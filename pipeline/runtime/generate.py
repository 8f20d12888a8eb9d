"""The generation loop every runtime shares: sampling, end_id, min_tokens, stop words and streaming callbacks.

A runtime provides a `Decoder` for one batch of prompts: `prefill(rows)` computes the prompts of those
rows and returns the logits of each prompt's last token, `decode(rows, tokens)` feeds one new token per
row after everything that row has seen and returns the next logits. `generate` picks tokens with
`TokenSelector` (pipeline/runtime/sampling.py) and decides when each request ends, so the torch reference
runtime (pipeline/runtime/model.py) and ONNX Runtime (pipeline/onnx/runner.py) generate alike.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from ..errors import UserError
from .sampling import SamplingConfig, TokenSelector

#: on_token(row, token), called for every output token; returning False ends that row now (its client is gone)
TokenCallback = Callable[[int, int], "bool | None"]
#: on_end(row), called once when a row leaves the batch (end id, stop word, max_new_tokens or on_token's False),
#: while the other rows go on: a server answers that request now instead of after the whole batch
EndCallback = Callable[[int], None]


class Decoder(Protocol):
    def prefill(self, rows: list[int]) -> torch.Tensor:
        """float32 [len(rows), vocab]: the logits after each row's prompt."""

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """float32 [len(rows), vocab]: the logits after feeding `tokens[i]` to row `rows[i]`."""


def check_requests(prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                   vocab_size: int, max_positions: int) -> list[SamplingConfig]:
    """One SamplingConfig per prompt; UserError for an empty prompt, an id outside the vocabulary or a
    request longer than the model's positions."""
    configs = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(configs) != len(prompts):
        raise UserError(f"got {len(configs)} sampling configs for {len(prompts)} prompts")
    for r, (prompt, cfg) in enumerate(zip(prompts, configs)):
        if len(prompt) == 0:
            raise UserError(f"prompt {r} is empty; every request needs at least one input token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise UserError(f"token ids must be in [0, {vocab_size}) (got {min(prompt)}..{max(prompt)})")
        total = len(prompt) + cfg.max_new_tokens
        if total > max_positions:
            raise UserError(f"prompt {r}: {len(prompt)} input + {cfg.max_new_tokens} new tokens exceed "
                            f"max_position_embeddings {max_positions}")
    return configs


def generate(decoder: Decoder, configs: list[SamplingConfig], on_token: TokenCallback | None,
             on_end: EndCallback | None = None) -> list[list[int]]:
    """New tokens of every row. Rows share batched decode steps; a finished row leaves the batch."""
    selectors = [TokenSelector(c) for c in configs]
    outputs: list[list[int]] = [[] for _ in configs]
    end = on_end or (lambda _row: None)
    active = [r for r, c in enumerate(configs) if c.max_new_tokens]
    for r in sorted(set(range(len(configs))) - set(active)):
        end(r)
    logits = decoder.prefill(active) if active else None
    while active:
        fed = []
        for i, r in enumerate(active):
            if accept(r, selectors[r](logits[i], len(outputs[r])), configs[r], outputs[r], on_token):
                fed.append(r)
            else:
                end(r)
        active = fed
        if active:
            logits = decoder.decode(active, [outputs[r][-1] for r in active])
    return outputs


def accept(r: int, token: int, cfg: SamplingConfig, out: list[int], on_token: TokenCallback | None) -> bool:
    """Record a new token; True when the request continues. end_id ends it without being output; on_token
    returning False ends it after this token."""
    if cfg.end_id is not None and token == cfg.end_id:
        return False
    out.append(token)
    if on_token is not None and on_token(r, token) is False:
        return False
    if len(out) >= cfg.max_new_tokens:
        return False
    return not any(len(out) >= len(s) and out[-len(s):] == list(s) for s in cfg.stop_words)
