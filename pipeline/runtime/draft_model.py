"""Draft-target speculative decoding on the cpu target: a second, cheaper model with the target's vocabulary drafts.

The draft model keeps a KV cache row per running row of the target (any `InflightDecoder` that verifies and rewinds:
pipeline/runtime/model.py `CacheDecoder`, pipeline/onnx/runner.py `OrtBatch`). Each drafting step it first catches up
with what the target chose since (`catch_up`: the positions it fed past the tokens the target kept are rewound, the
tokens it has not seen fed in one pass), then drafts greedily, one batched decode step per draft token. The last
draft is never fed: if the target accepts it, the next catch-up feeds it with the target's own token. Greedy drafts
are deterministic, so the target's acceptance rule stays exact (pipeline/runtime/speculative.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..errors import UserError
from .sampling import SamplingConfig
from .speculative import DraftRequest, leading_matches

if TYPE_CHECKING:
    from .generate import InflightDecoder


class ModelDrafter:
    """Drafts `draft_len` tokens a row with the draft model's `decoder`, which must verify and rewind."""

    free = False        # a decode step of the draft model a draft

    def __init__(self, decoder: InflightDecoder, draft_len: int):
        if draft_len < 1:
            raise UserError(f"the draft length must be at least 1 (got {draft_len})")
        self.decoder = decoder
        self.draft_len = draft_len
        self.fed: dict[object, list[int]] = {}     # row -> the tokens its draft cache row holds

    def draft(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self._forget_gone({r.key for r in requests})
        logits = self._catch_up(requests)
        wanted = [min(self.draft_len, max(r.limit, 0)) for r in requests]
        keys = [r.key for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        for step in range(max(wanted, default=0)):
            tokens = [int(row.argmax()) for row in logits]
            for row, token in zip(drafts, tokens):
                row.append(token)
            if step + 1 < max(wanted):
                logits = self.decoder.decode(keys, tokens)
                for key, token in zip(keys, tokens):
                    self.fed[key].append(token)
        return [row[:n] for row, n in zip(drafts, wanted)]

    def _forget_gone(self, running: set) -> None:
        gone = [key for key in self.fed if key not in running]
        if gone:
            self.decoder.release(gone)
            for key in gone:
                del self.fed[key]

    def _catch_up(self, requests: Sequence[DraftRequest]) -> list:
        """The draft model's next-token logits of every row after its whole history: rows it holds are fed what
        they have not seen (one verify pass), new rows are added and prefilled."""
        logits: dict[object, object] = {}
        held = [r for r in requests if r.key in self.fed]
        if held:
            feeds = [self._unseen(r) for r in held]
            for r, out in zip(held, self.decoder.verify([r.key for r in held], feeds)):
                logits[r.key] = out[-1]
        new = [r for r in requests if r.key not in self.fed]
        if new:
            keys = [r.key for r in new]
            # room for every token the row may still produce and the drafts fed past them
            configs = [SamplingConfig(max_new_tokens=r.longest - len(r.history) + self.draft_len) for r in new]
            self.decoder.add(keys, [list(r.history) for r in new], configs)
            for r, out in zip(new, self.decoder.prefill(keys)):
                logits[r.key], self.fed[r.key] = out, list(r.history)
        return [logits[r.key] for r in requests]

    def _unseen(self, r: DraftRequest) -> list[int]:
        """What row r's draft cache must be fed to hold its history: the drafts the target rejected are rewound
        first (at least the history's last token is fed, so the pass gives the logits after it)."""
        fed, history = self.fed[r.key], list(r.history)
        kept = leading_matches(fed, history)
        kept = min(kept, len(history) - 1)
        if len(fed) > kept:
            self.decoder.rewind(r.key, len(fed) - kept)
        self.fed[r.key] = history
        return history[kept:]

