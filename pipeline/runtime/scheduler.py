"""Which waiting sequences start at each step of in-flight serving, and which running ones pause.

TensorRT-LLM's executor decides this once per iteration (its capacity and micro-batch schedulers); the cpu target's
`serve_rows` (pipeline/runtime/generate.py) asks a `Scheduler` the same questions between two decode steps:

- **The KV cache is a pool of blocks** of `tokens_per_block` tokens, `max_tokens_in_paged_kv_cache` //
  `tokens_per_block` of them (the plan's numbers). A running sequence holds the blocks its tokens fill; the
  blocks are accounted here (which sequence holds which block ids, what is free), while the runtimes keep the
  tensors of each sequence in a row of their own cache. A sequence that can never fit the pool is refused when it
  is submitted.
- **batch_scheduler_policy**: `guaranteed_no_evict` (NVIDIA's default) reserves a sequence's whole KV
  (prompt + max_new_tokens) when it starts, so nothing that started ever waits for memory; `max_utilization`
  reserves only what its tokens fill so far, starts more sequences, and when a running sequence needs a block the
  pool does not have, pauses the most recently started ones: their blocks are freed and they go back to the front
  of the waiting sequences, to be started again later with their prompt and the tokens they produced prefilled
  anew (TensorRT-LLM's pause and recompute), their client none the wiser but for the wait.
- **Priority levels**, numbered as Triton numbers them (1 is the highest, `priority_levels` the lowest; 0 means
  `default_priority_level`): waiting requests start highest level first, in arrival order within a level. The
  head of the queue is never overtaken by a later request of its level, so nothing starves within a level.
- **max_num_tokens** bounds the tokens of one step: one per running sequence plus the prompts started with it;
  a prompt longer than that is refused at submission (no chunked context: a prompt is prefilled in one call).
- **max_rows** (the model's max_batch_size) bounds the sequences running at once; a request with more sequences
  than that starts alone.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

from ..triton_names import BATCH_SCHEDULER_POLICIES as POLICIES
from ..triton_names import GUARANTEED_NO_EVICT, MAX_UTILIZATION
from .sampling import SamplingConfig, TokenSelector

__all__ = ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "POLICIES", "Scheduler", "SchedulerLimits", "Sequence"]


@dataclass(frozen=True)
class SchedulerLimits:
    """The bounds a Scheduler keeps; None: unbounded. `priority_levels` 0: one level (no priorities)."""

    max_rows: int | None = None
    max_num_tokens: int | None = None
    kv_tokens: int | None = None
    tokens_per_block: int | None = None      # needed with kv_tokens
    policy: str = GUARANTEED_NO_EVICT
    priority_levels: int = 0
    default_priority_level: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"batch_scheduler_policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.kv_tokens is not None and self.tokens_per_block is None:
            raise ValueError("max_tokens_in_paged_kv_cache needs tokens_per_block (the tokens of one KV block)")
        if self.tokens_per_block is not None and self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be at least 1, got {self.tokens_per_block}")
        for name in ("max_rows", "max_num_tokens", "kv_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 when set, got {value}")
        if self.priority_levels < 0 or not 0 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"default_priority_level {self.default_priority_level} must be in [1, priority_levels "
                             f"{self.priority_levels}] (0 and 0 when there are no levels)")
        if self.kv_tokens is not None and self.kv_tokens < self.tokens_per_block:
            raise ValueError(f"max_tokens_in_paged_kv_cache {self.kv_tokens} holds no block of "
                             f"{self.tokens_per_block} tokens")

    @property
    def blocks(self) -> int | None:
        return None if self.kv_tokens is None else self.kv_tokens // self.tokens_per_block


@dataclass(eq=False)
class Sequence:
    """One row of a request: what it was asked, and once it started its selector and record (kept over a pause)."""

    key: object
    prompt: Seq[int]
    config: SamplingConfig
    selector: TokenSelector | None = None
    result: object | None = None            # its RowResult, once started
    blocks: list[int] = field(default_factory=list)
    allocated: int = 0                      # blocks it was ever given (a pause and restart allocates anew)
    paused: int = 0                         # how often it was paused
    level: int = 0                          # its request's priority level and arrival, kept over a pause
    order: int = 0
    started_ns: int = 0                     # time.monotonic_ns() when it first started

    @property
    def produced(self) -> list[int]:
        return [] if self.result is None else self.result.tokens

    def context(self) -> list[int]:
        """What a start prefills: the prompt, and after a pause the tokens produced so far too."""
        return [*self.prompt, *self.produced]

    def final_tokens(self) -> int:
        return len(self.prompt) + self.config.max_new_tokens


@dataclass(eq=False)
class Group:
    """Sequences that start together (one request's rows; a paused sequence alone), at a priority level."""

    sequences: list[Sequence]
    level: int
    order: int

    @property
    def rank(self) -> tuple[int, int]:
        return self.level, self.order


class Scheduler:
    """The waiting groups and the running sequences of one model instance, and its KV block pool."""

    def __init__(self, limits: SchedulerLimits = SchedulerLimits()):
        self.limits = limits
        self.free_blocks: list[int] = list(range(limits.blocks or 0))
        self.waiting: list[Group] = []      # by rank
        self.running: list[Sequence] = []   # in the order they started
        self.arrivals = 0

    # -------------------------------------------------------------- submitting

    def level(self, priority: int | None) -> int:
        """The level a request's priority puts it at: 0 or unset is the default level; without levels, one."""
        if not self.limits.priority_levels:
            return 0
        return self.limits.default_priority_level if not priority else int(priority)

    def refusal(self, sequences: Seq[Sequence], priority: int | None = None) -> str | None:
        """Why these sequences can never run under the limits (None: they can)."""
        levels = self.limits.priority_levels
        if priority and levels and not 1 <= priority <= levels:
            return f"priority {priority} is outside the model's priority levels 1..{levels}"
        if priority and not levels:
            return f"priority {priority}: the model has no priority levels (dynamic_batching priority_levels unset)"
        budget = self.limits.max_num_tokens
        for s in sequences:
            if budget is not None and len(s.prompt) > budget:
                return (f"the prompt's {len(s.prompt)} tokens exceed max_num_tokens {budget} (the tokens of one step; "
                        "the cpu target prefills a prompt in one step)")
        blocks = self.limits.blocks
        if blocks is not None:
            need = sum(self.blocks_for(s.final_tokens()) for s in sequences)
            if need > blocks:
                return (f"the request needs {need} KV-cache blocks of {self.limits.tokens_per_block} tokens for its "
                        f"prompt and output; the pool (max_tokens_in_paged_kv_cache {self.limits.kv_tokens}) holds "
                        f"{blocks}")
        return None

    def submit(self, sequences: Seq[Sequence], priority: int | None = None) -> Group:
        """Queue one request's sequences (check `refusal` first)."""
        group = Group(list(sequences), self.level(priority), self.arrivals)
        self.arrivals += 1
        for s in group.sequences:
            s.level, s.order = group.level, group.order
        self.enqueue(group)
        return group

    def enqueue(self, group: Group) -> None:
        bisect.insort(self.waiting, group, key=lambda g: g.rank)

    def withdraw(self, gone: Callable[[object], bool]) -> list[Group]:
        """Take the waiting groups whose key `gone` says are no longer wanted (stopped, cancelled) out of the queue."""
        taken = [g for g in self.waiting if any(gone(s.key) for s in g.sequences)]
        self.waiting = [g for g in self.waiting if g not in taken]
        return taken

    # -------------------------------------------------------------- each step

    def blocks_for(self, tokens: int) -> int:
        """Blocks of the pool `tokens` fill (without a pool, the count is never used)."""
        return math.ceil(tokens / (self.limits.tokens_per_block or 1))

    def room(self, s: Sequence) -> int | None:
        """Tokens a running sequence may write after its context within the blocks it holds (None: no pool), which
        bounds the drafts a speculative step feeds it."""
        if self.limits.blocks is None:
            return None
        return len(s.blocks) * self.limits.tokens_per_block - len(s.context())

    def reservation(self, s: Sequence) -> int:
        """Blocks a sequence takes when it starts: all it will need, or what its context fills."""
        tokens = s.final_tokens() if self.limits.policy == GUARANTEED_NO_EVICT else len(s.context())
        return self.blocks_for(tokens)

    def admit(self) -> list[Sequence]:
        """The sequences to start now: the waiting groups in rank order while they fit the rows, this step's token
        budget and the free blocks; the first that does not fit ends the admission (no overtaking)."""
        started: list[Sequence] = []
        budget = None if self.limits.max_num_tokens is None else self.limits.max_num_tokens - len(self.running)
        while self.waiting:
            group = self.waiting[0]
            rows = len(self.running) + len(group.sequences)
            if self.running and self.limits.max_rows is not None and rows > self.limits.max_rows:
                break
            tokens = sum(len(s.context()) for s in group.sequences)
            if budget is not None and self.running and tokens > budget:   # alone, a resumed context may exceed it
                break
            need = sum(self.reservation(s) for s in group.sequences)
            if self.limits.blocks is not None and need > len(self.free_blocks):
                break
            self.waiting.pop(0)
            for s in group.sequences:
                s.started_ns = s.started_ns or time.monotonic_ns()
                self.take_blocks(s, self.reservation(s))
                self.running.append(s)
                started.append(s)
            if budget is not None:
                budget -= tokens
        return started

    def make_room(self, stepping: Seq[Sequence]) -> list[Sequence]:
        """Before a decode step that writes one more token of each of `stepping`: each gets the block it needs
        for it. Under max_utilization, when the pool runs out, the most recently started running sequences pause
        (returned: their blocks are free and they wait again, ahead of later arrivals of their level)."""
        paused: list[Sequence] = []
        for s in stepping:
            if s in paused:
                continue
            need = self.blocks_for(len(s.context())) - len(s.blocks)
            while need > 0 and self.limits.blocks is not None and len(self.free_blocks) < need:
                victim = next(v for v in reversed(self.running) if v not in paused)
                self.pause(victim)
                paused.append(victim)
                if victim is s:
                    break
            if s not in paused and need > 0:
                self.take_blocks(s, need)
        return paused

    def pause(self, s: Sequence) -> None:
        self.finish(s)
        s.paused += 1
        self.enqueue(Group([s], s.level, s.order))

    def finish(self, s: Sequence) -> None:
        """A sequence left the batch (ended, or paused): its blocks go back to the pool."""
        if s in self.running:
            self.running.remove(s)
        self.free_blocks.extend(s.blocks)
        s.blocks = []

    def take_blocks(self, s: Sequence, count: int) -> None:
        if self.limits.blocks is None:
            s.allocated += count
            return
        s.blocks += [self.free_blocks.pop() for _ in range(count)]
        s.allocated += count
