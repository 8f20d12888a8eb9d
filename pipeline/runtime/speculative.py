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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, Sequence, runtime_checkable

from ..errors import UserError

if TYPE_CHECKING:
    import torch

#: the drafting methods the cpu runtimes run (`--speculative`): prompt lookup, and draft-target (a second model)
NGRAM, DRAFT = "ngram", "draft"
#: the cpu model's parameters that switch it on (pipeline/plan/speculative.py writes them; TensorRT-LLM names the
#: first two so in trtllm-build's --speculative_decoding_mode / --max_draft_len, the third in its NGram configuration)
SPECULATIVE_DECODING_MODE = "speculative_decoding_mode"
MAX_DRAFT_LEN = "max_draft_len"
MAX_MATCHING_NGRAM_SIZE = "max_matching_ngram_size"
SPECULATIVE_MAX_ROWS = "speculative_max_rows"
#: draft-target: where the draft model's checkpoint (reference runtime) or ONNX export (onnxruntime) lies in the model
#: version directory
DRAFT_DIR = "draft_dir"
#: prompt lookup's defaults: the longest and shortest n-gram matched (vLLM's prompt_lookup_max / _min, TensorRT-LLM
#: NGramDecodingConfig.max_matching_ngram_size)
MAX_NGRAM, MIN_NGRAM = 3, 1


@runtime_checkable
class SpeculativeDecoder(Protocol):
    """A decoder that can feed several tokens of a row in one step and forget the last ones it fed. One that verifies
    several rows' tokens only in separate runs says so with `verify_rows` (the most rows a step that drafts may
    have; the loops then draft at no more: pipeline/onnx/inplace.py)."""

    def verify(self, rows: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """float32 [len(tokens[i]), vocab] per row: the logits after each of `tokens[i]`, fed to row `rows[i]`
        after everything it has seen (the row moves on by len(tokens[i]))."""

    def rewind(self, row: int, count: int) -> None:
        """Forget the last `count` tokens fed to `row` (the next step writes their positions again)."""


@dataclass(frozen=True)
class DraftRequest:
    """A running row to draft for: its key (the decoder's row), its history (the prompt and the tokens chosen so
    far), the most drafts worth proposing (fewer than 1: none) and the longest its history may grow (its prompt and
    max_new_tokens)."""

    key: object
    history: Sequence[int]
    limit: int
    longest: int


class Drafter(Protocol):
    #: whether drafting costs next to nothing beside a decode step (prompt lookup): `Speculation` then drafts in the
    #: shadow of its plain steps too, to keep its figure of accepted drafts current without a drafting step
    free: bool

    def draft(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts (at most its limit): tokens that may follow its history. A row the drafter drafted
        for before and that `requests` lacks has left the batch (a drafter keeping state per row frees it)."""


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the history's last n tokens (n from
    max_ngram down to min_ngram). Pays where the output repeats the input: a summary, an extraction, code edits, a
    quoted document.

    How many: draft_len after a match of max_ngram tokens, half as many for each token the match is shorter (at
    least one), since a longer match predicts a longer run: SmolLM2-135M on benchmarks/bench_speculative.py's
    input-grounded workload, drafting 8 after every match, accepted 4.8 of them on average after a 3-token match,
    1.2 after a 2-token one and 1.0 after a 1-token one (29, 43 and 119 steps); drafting 8 / 4 / 2 gave 1.51x plain
    decoding in process where 3 after every match gave 1.41x (1.98x against 1.72x on the open workload; a step
    verifying 9 tokens a row costs 1.6 times a plain one at one row there, 4 tokens 1.2 times)."""

    draft_len: int
    max_ngram: int = MAX_NGRAM
    min_ngram: int = MIN_NGRAM
    free: ClassVar[bool] = True

    def __post_init__(self):
        if self.draft_len < 1:
            raise UserError(f"the draft length must be at least 1 (got {self.draft_len})")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError(f"n-gram sizes must satisfy 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})")

    def draft(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose(r.history, r.limit) for r in requests]

    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        n_max = min(self.max_ngram, len(history) - 1)
        if limit < 1 or n_max < self.min_ngram:
            return []
        for n in range(n_max, self.min_ngram - 1, -1):
            tail = list(history[-n:])
            first = tail[0]
            # the latest start before the tail itself whose n tokens equal the tail
            for start in range(len(history) - n - 1, -1, -1):
                if history[start] == first and list(history[start:start + n]) == tail:
                    return list(history[start + n:start + n + min(self.drafts_after(n), limit)])
        return []

    def drafts_after(self, n: int) -> int:
        """The drafts proposed after a match of n tokens (class docstring)."""
        return max(1, self.draft_len >> (self.max_ngram - n))


#: a step of the other kind every this many steps of one number of rows, so that the figures the choice rests on stay
#: current (the acceptance moves with the requests; a step's cost with the contexts)
PROBE_EVERY = 32
#: what a drafting step of several rows must gain over a plain one, by its own time, to go on drafting: it also leaves
#: costs to later steps (the cache positions of its rejected drafts, which the ONNX cache drops only when it is
#: rebuilt: every row's attention reads the holes of any, and the rebuild copies every row)
MARGIN = 1.15
#: the same at one row: its holes lengthen only its own attention and a rebuild copies one row, so the drafting
#: step's own time is the whole of its cost
SINGLE_ROW_MARGIN = 1.0
#: the most drafts a row of a step of several rows is fed: such a step is bound by its arithmetic, so each drafted
#: token costs its share and long drafts lose (prompt lookup drafting 8 / 4 / 2 by the match read 0.96-0.98x plain
#: at concurrency 8 on benchmarks/bench_speculative.py, 3 after every match 1.02-1.10x); one row drafts all of them
MULTI_ROW_DRAFTS = 3
#: the weight of a new observation in the running step times (an exponential moving average)
SMOOTHING = 0.25
#: the weight of a new observation in the running accepted drafts: slower, since a step accepts all its drafts or
#: none far more often than its average, and a figure that followed each step would read a run of rejections as the
#: end of drafting's gains (prompt lookup's next step still accepts 0.4 drafts on average after them, SmolLM2 here)
GAIN_SMOOTHING = 0.1


@dataclass(frozen=True)
class Shadow:
    """Drafts a free drafter proposed at a plain step that were not fed: what a drafting step would have accepted is
    read off the tokens the row then chooses (a drafting step at the same history chooses the same ones)."""

    rows: int               # the number of rows of the step it shadows
    start: int              # the length of the row's history when proposed
    drafts: tuple[int, ...]

    def accepted(self, history: Sequence[int]) -> int | None:
        """The drafts a drafting step would have accepted, once the history shows it (None: not yet): it stops at the
        first chosen token that differs from its draft, or after its last draft and one token more."""
        chosen = history[self.start:]
        matched = leading_matches(chosen, self.drafts)
        return matched if matched < len(chosen) else None


@dataclass
class Speculation:
    """How a loop speculates: the drafter, the most rows a step may have for it to draft (the plan's break-even), and,
    when `adaptive`, the choice of each step made from what the loop observed at that number of rows: a step that
    drafts outputs each row's accepted drafts and one token in `verify_s`, a plain one a token a row in `plain_s`, so
    it drafts while (1 + accepted drafts per row) x plain_s >= MARGIN x verify_s (SINGLE_ROW_MARGIN at one row).
    One step in PROBE_EVERY does the other kind to keep both figures current (a drafting probe stays due until a step
    has drafts); a number of rows not yet seen drafts first, then steps plainly once.

    A free drafter (prompt lookup) also drafts at plain steps, unfed (`Shadow`): how many of those drafts the rows
    then chose keeps the accepted figure current while the gate steps plainly. Without it the figure would only move
    on the rare drafting probes, and an early low one (a continuation only starts repeating itself after a while)
    would keep the gate plain long after drafting pays."""

    drafter: Drafter
    max_rows: int | None = None
    adaptive: bool = True
    plain_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[int, float] = field(default_factory=dict)
    gain: dict[int, float] = field(default_factory=dict)      # accepted drafts per row of a drafting step
    steps: dict[int, int] = field(default_factory=dict)
    #: numbers of rows whose drafting probe is still due: a step chosen to draft in which no row had a draft (prompt
    #: lookup found no match) measured nothing, so the next steps draft until one does
    due: set[int] = field(default_factory=set)
    shadows: dict[object, Shadow] = field(default_factory=dict)

    def drafts(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts for the next step: none unless the step drafts (`drafting`), at most
        MULTI_ROW_DRAFTS a row in a step of several rows."""
        shadowing = self.adaptive and self.drafter.free
        if shadowing:
            self._read_shadows(requests)
        if self.drafting(len(requests)):
            drafts = self.drafter.draft(requests)
            return drafts if len(requests) == 1 else [d[:MULTI_ROW_DRAFTS] for d in drafts]
        if shadowing and self.allows(len(requests)):
            self._shadow(requests)
        return [[] for _ in requests]

    def allows(self, rows: int) -> bool:
        """Whether a step of `rows` rows may draft at all (the plan's break-even)."""
        return self.max_rows is None or rows <= self.max_rows

    def drafting(self, rows: int) -> bool:
        """Whether the next step of `rows` rows drafts."""
        if not self.allows(rows):
            return False
        if not self.adaptive:
            return True
        self.steps[rows] = count = self.steps.get(rows, 0) + 1
        if rows not in self.verify_s or rows in self.due:
            return True
        if rows not in self.plain_s:
            return False
        probe = count % PROBE_EVERY == 0
        if self.gains(rows):
            return not probe
        if probe:
            self.due.add(rows)
        return probe

    def gains(self, rows: int) -> bool:
        margin = SINGLE_ROW_MARGIN if rows == 1 else MARGIN
        return (1 + self.gain[rows]) * self.plain_s[rows] >= margin * self.verify_s[rows]

    def observe(self, rows: int, drafted: bool, seconds: float, accepted: int) -> None:
        """A step of `rows` rows took `seconds`; when it `drafted`, its rows accepted `accepted` drafts in all."""
        if drafted:
            self.due.discard(rows)
            smooth(self.verify_s, rows, seconds)
            smooth(self.gain, rows, accepted / rows, GAIN_SMOOTHING)
        else:
            smooth(self.plain_s, rows, seconds)

    def _shadow(self, requests: Sequence[DraftRequest]) -> None:
        """Unfed drafts for the rows without a shadow."""
        new = [r for r in requests if r.key not in self.shadows]
        cap = None if len(requests) == 1 else MULTI_ROW_DRAFTS
        for request, drafts in zip(new, self.drafter.draft(new)):
            self.shadows[request.key] = Shadow(len(requests), len(request.history), tuple(drafts[:cap]))

    def _read_shadows(self, requests: Sequence[DraftRequest]) -> None:
        """The shadows the rows' histories settle, into the accepted figure (their mean per number of rows, as one
        drafting step's); the shadows of rows that left are dropped."""
        running = {r.key: r.history for r in requests}
        settled: dict[int, list[int]] = {}
        for key, shadow in list(self.shadows.items()):
            accepted = shadow.accepted(running[key]) if key in running else None
            if key not in running or accepted is not None:
                del self.shadows[key]
            if accepted is not None:
                settled.setdefault(shadow.rows, []).append(accepted)
        for rows, accepted in settled.items():
            smooth(self.gain, rows, sum(accepted) / len(accepted), GAIN_SMOOTHING)


def smooth(figures: dict[int, float], rows: int, value: float, weight: float = SMOOTHING) -> None:
    old = figures.get(rows)
    figures[rows] = value if old is None else old + weight * (value - old)


def draft_limit(max_new_tokens: int, produced: int) -> int:
    """The drafts worth proposing after `produced` tokens: a step of k drafts outputs up to k + 1 tokens."""
    return max_new_tokens - produced - 1


def leading_matches(chosen: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts, from the first, equal the tokens chosen in their place."""
    n = 0
    while n < len(drafts) and n < len(chosen) and chosen[n] == drafts[n]:
        n += 1
    return n
