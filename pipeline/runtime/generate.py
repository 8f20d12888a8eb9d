"""The generation loop every runtime shares: sampling, end_id, min_tokens, stop words and streaming callbacks.

A runtime provides a `Decoder` for one batch of prompts: `prefill(rows)` computes the prompts of those
rows and returns the logits of each prompt's last token, `decode(rows, tokens)` feeds one new token per
row after everything that row has seen and returns the next logits. A `ContextDecoder` can also return the
logits of every prompt position (`prefill_context`), which `generate_rows` asks for only when a request wants
its context logits. `generate_rows` picks tokens with `TokenSelector` (pipeline/runtime/sampling.py), decides
when each request ends and records what each request asked for in a `RowResult`, so the torch reference
runtime (pipeline/runtime/model.py) and ONNX Runtime (pipeline/onnx/runner.py) generate alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from ..errors import UserError
from ..spans import span
from .sampling import Choice, SamplingConfig, TokenSelector
from .scheduler import Scheduler
from .speculative import DraftRequest, Speculation, SpeculativeDecoder, draft_limit, leading_matches
from .scheduler import Sequence as ScheduledSequence

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


@runtime_checkable
class ContextDecoder(Decoder, Protocol):
    def prefill_context(self, rows: list[int]) -> list[torch.Tensor]:
        """What `prefill` does, returning each row's logits at every prompt position: float32 [prompt_len, vocab]
        per row, whose last row is what `prefill` returns."""


@dataclass
class RowResult:
    """What one request produced, filled in as it generates (a streaming callback sees it grow).

    tokens: the output tokens (no end id). log_probs: one per output token when the request asks for them
    (see TokenSelector for which distribution). end_log_prob: the end id's log probability when the request
    ended with it: TensorRT-LLM adds the sampled token's log prob to cum_log_probs before it checks for the end
    id (kernels/samplingTopKKernels.cu @ 0396172), so `cum_log_prob` includes it. context_logits: float32
    [prompt_len, vocab], the raw logits of every prompt position. generation_logits: the raw model logits
    [vocab] of each step that produced an output token (`generation_logits_tensor()` stacks them).
    """

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    end_log_prob: float | None = None
    context_logits: torch.Tensor | None = None
    generation_logits: list[torch.Tensor] | None = None
    #: speculative decoding: the draft tokens verified for this request, and how many of them it accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @classmethod
    def for_request(cls, cfg: SamplingConfig) -> "RowResult":
        return cls(log_probs=[] if cfg.log_probs else None, generation_logits=[] if cfg.generation_logits else None)

    @property
    def cum_log_prob(self) -> float | None:
        if self.log_probs is None:
            return None
        return sum(self.log_probs) + (self.end_log_prob or 0.0)

    def generation_logits_tensor(self) -> torch.Tensor | None:
        """float32 [len(tokens), vocab], or None when the request did not ask for generation logits."""
        if self.generation_logits is None:
            return None
        return torch.stack(self.generation_logits) if self.generation_logits else torch.empty(0, 0)

    def add(self, choice: Choice, logits: torch.Tensor) -> None:
        self.tokens.append(choice.token)
        if self.log_probs is not None:
            self.log_probs.append(choice.log_prob)
        if self.generation_logits is not None:
            self.generation_logits.append(logits.detach().clone().float())


#: on_step(row, result), called after every output token with that row's record (the token is
#: result.tokens[-1], its log prob result.log_probs[-1]); returning False ends that row now
StepCallback = Callable[[int, RowResult], "bool | None"]


def check_requests(prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                   vocab_size: int, max_positions: int) -> list[SamplingConfig]:
    """One SamplingConfig per prompt; UserError for an empty prompt, an id outside the vocabulary, a
    request longer than the model's positions or an embedding bias that is not [vocab_size]."""
    configs = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(configs) != len(prompts):
        raise UserError(f"got {len(configs)} sampling configs for {len(prompts)} prompts")
    for r, (prompt, cfg) in enumerate(zip(prompts, configs)):
        if len(prompt) == 0:
            raise UserError(f"prompt {r} is empty; every request needs at least one input token")
        for what, ids in (("token ids", prompt), (f"prompt {r}'s draft tokens", cfg.drafts)):
            if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                raise UserError(f"{what} must be in [0, {vocab_size}) (got {min(ids)}..{max(ids)})")
        total = len(prompt) + cfg.max_new_tokens
        if total > max_positions:
            raise UserError(f"prompt {r}: {len(prompt)} input + {cfg.max_new_tokens} new tokens exceed "
                            f"max_position_embeddings {max_positions}")
        if cfg.embedding_bias is not None and cfg.embedding_bias.numel() != vocab_size:
            raise UserError(f"prompt {r}: embedding_bias has {cfg.embedding_bias.numel()} entries, the vocabulary "
                            f"{vocab_size}")
    return configs


def generate(decoder: Decoder, configs: list[SamplingConfig], on_token: TokenCallback | None,
             on_end: EndCallback | None = None, prompts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """New tokens of every row (`generate_rows` without the records). Without `prompts`, penalties and bad
    words see only each row's output."""
    return [result.tokens for result in generate_rows(decoder, configs, token_steps(on_token), on_end, prompts)]


def token_steps(on_token: TokenCallback | None) -> StepCallback | None:
    """An on_token(row, token) callback as an on_step(row, result) one."""
    return None if on_token is None else (lambda r, result: on_token(r, result.tokens[-1]))


def generate_rows(decoder: Decoder, configs: list[SamplingConfig], on_step: StepCallback | None = None,
                  on_end: EndCallback | None = None, prompts: Sequence[Sequence[int]] | None = None,
                  speculation: Speculation | None = None) -> list[RowResult]:
    """Every row's RowResult. Rows share batched decode steps; a finished row leaves the batch. A row with
    max_new_tokens 0 is still prefilled when it asks for its context logits. With `speculation`, each step feeds
    every row its drafts too (pipeline/runtime/speculative.py)."""
    speculation = check_speculation(decoder, speculation)
    histories = prompts if prompts is not None else [()] * len(configs)
    selectors = [TokenSelector(c, p) for c, p in zip(configs, histories)]
    results = [RowResult.for_request(c) for c in configs]
    end = on_end or (lambda _row: None)
    prefilled = [r for r, c in enumerate(configs) if c.max_new_tokens or c.context_logits]
    for r in sorted(set(range(len(configs))) - set(prefilled)):
        end(r)
    logits = dict(zip(prefilled, prefill(decoder, prefilled, configs, results))) if prefilled else {}
    active = [r for r in prefilled if configs[r].max_new_tokens]
    for r in prefilled:
        if r not in active:
            end(r)
    steps, drafts, timed = [logits[r] for r in active], [list(configs[r].drafts) for r in active], None
    while active:
        fed, accepted = [], 0
        for i, r in enumerate(active):
            before = results[r].accepted_draft_tokens
            if take(decoder, r, steps[i], drafts[i], selectors[r], configs[r], results[r], on_step):
                fed.append(r)
            else:
                end(r)
            accepted += results[r].accepted_draft_tokens - before
        if timed is not None:
            speculation.observe(*timed, accepted)
        active = fed
        if active:
            started = time.perf_counter()       # a drafting step's time includes its drafter's
            drafts = step_drafts(speculation, [(r, selectors[r].history, configs[r], results[r], None)
                                               for r in active])
            steps = decode_step(decoder, active, [results[r].tokens[-1] for r in active], drafts)
            timed = None if speculation is None else (len(active), any(drafts), time.perf_counter() - started)
    return results


def check_speculation(decoder: Decoder, speculation: Speculation | None) -> Speculation | None:
    """The speculation a loop over `decoder` runs: `speculation`, drafting at no more rows than the decoder verifies
    in one step (its `verify_rows`, where it has one)."""
    if speculation is None:
        return None
    if not isinstance(decoder, SpeculativeDecoder):
        raise UserError(f"{type(decoder).__name__} cannot verify draft tokens (no speculative decoding)")
    rows = getattr(decoder, "verify_rows", None)
    if rows is None or (speculation.max_rows is not None and speculation.max_rows <= rows):
        return speculation
    return replace(speculation, max_rows=rows)


def step_drafts(speculation: Speculation | None,
                rows: list[tuple[int, Sequence[int], SamplingConfig, RowResult, int | None]]) -> list[list[int]]:
    """Each row's drafts for the next step, from its (row, history, config, record, room): none unless the
    speculation drafts at this many rows (`Speculation.drafts`); never more than its request can still output after
    the token it feeds, nor than `room` (the KV its blocks still hold; None: no bound)."""
    if speculation is None:
        return [[] for _ in rows]
    requests = []
    for row, history, cfg, result, room in rows:
        limit = draft_limit(cfg.max_new_tokens, len(result.tokens))
        longest = len(history) - len(result.tokens) + cfg.max_new_tokens
        requests.append(DraftRequest(row, history, limit if room is None else min(limit, room), longest))
    return speculation.drafts(requests)


def decode_step(decoder: Decoder, rows: list[int], tokens: list[int], drafts: list[list[int]]) -> list[torch.Tensor]:
    """Each row's logits [1 + its drafts, vocab] after feeding its token and its drafts: a plain decode step when no
    row has a draft."""
    if not any(drafts):
        logits = decoder.decode(rows, tokens)
        return [logits[i:i + 1] for i in range(len(rows))]
    return decoder.verify(rows, [[token, *d] for token, d in zip(tokens, drafts)])


def take(decoder: Decoder, r: int, logits: torch.Tensor, drafts: list[int], selector: TokenSelector,
         cfg: SamplingConfig, result: RowResult, on_step: StepCallback | None, key: object = None) -> bool:
    """Choose row r's tokens from the logits of one step ([1 + drafts, vocab]) in order until one differs from its
    draft (that one is the step's last) or the request ends; True when it continues. The decoder forgets the
    rejected drafts. `key`: what on_step is told (default: r)."""
    before = len(result.tokens)
    for j in range(logits.shape[0]):
        if not advance(r if key is None else key, logits[j], selector, cfg, result, on_step):
            going = False
            break
        if j == len(drafts) or result.tokens[-1] != drafts[j]:
            going = True
            break
    if drafts:
        result.draft_tokens += len(drafts)
        result.accepted_draft_tokens += leading_matches(result.tokens[before:], drafts)
        if going and j < len(drafts):
            decoder.rewind(r, len(drafts) - j)
    return going


def prefill(decoder: Decoder, rows: list[int], configs, results) -> list[torch.Tensor]:
    """Each row's logits [1 + its drafts, vocab]: after its prompt, and after each draft token it brought (fed with
    the prompt: the decoder was given `fed_context`); every prompt position's too (into the results) only when a row
    asks. `configs` and `results` are indexed by row (lists, or dicts of the rows)."""
    if not any(configs[r].context_logits or configs[r].drafts for r in rows):
        logits = decoder.prefill(rows)
        return [logits[i:i + 1] for i in range(len(rows))]
    if not isinstance(decoder, ContextDecoder):
        raise UserError(f"{type(decoder).__name__} cannot return context logits nor verify draft tokens")
    context = decoder.prefill_context(rows)
    for r, logits in zip(rows, context):
        if configs[r].context_logits:
            results[r].context_logits = logits[:len(logits) - len(configs[r].drafts)]
    return [logits[len(logits) - 1 - len(configs[r].drafts):] for r, logits in zip(rows, context)]


def fed_context(context: Sequence[int], config: SamplingConfig) -> list[int]:
    """What a decoder prefills for a request: its context, and the draft tokens it brought."""
    return [*context, *config.drafts]


def advance(r: int, logits: torch.Tensor, selector: TokenSelector, cfg: SamplingConfig, result: RowResult,
            on_step: StepCallback | None) -> bool:
    """Choose and record row r's next token; True when the request continues. end_id ends it without being
    output; on_step returning False ends it after this token."""
    choice = selector.choose(logits, len(result.tokens))
    if cfg.end_id is not None and choice.token == cfg.end_id:
        result.end_log_prob = choice.log_prob
        return False
    result.add(choice, logits)
    if on_step is not None and on_step(r, result) is False:
        return False
    out = result.tokens
    if len(out) >= cfg.max_new_tokens:
        return False
    return not any(len(out) >= len(s) and out[-len(s):] == list(s) for s in cfg.stop_words)


# ---------------------------------------------------------------------------------------------- in-flight serving

#: poll(), called before every step: the caller submits to the scheduler what arrived and withdraws what its client
#: no longer wants, so a request that arrives while others generate joins them at the next step
PollCallback = Callable[[], None]


class InflightDecoder(Decoder, Protocol):
    """A `Decoder` whose rows come and go: `add` makes room for new rows (their prompts are computed by the next
    `prefill`), `release` frees a row that left the batch for a later one."""

    def add(self, rows: list[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]) -> None: ...

    def release(self, rows: list[int]) -> None: ...


@runtime_checkable
class MixingDecoder(InflightDecoder, Protocol):
    """An `InflightDecoder` that can compute one row's prompt in the step that decodes the others (weights read
    once for both), when `mixes_prompts` (an ONNX export without the prompt group cannot)."""

    @property
    def mixes_prompts(self) -> bool: ...

    def decode_with_prompt(self, rows: list[int], tokens: list[int], row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(`decode(rows, tokens)`, float32 [vocab]: the logits after `row`'s prompt, which it prefills)."""


def serve_rows(decoder: InflightDecoder, scheduler: Scheduler, poll: PollCallback,
               on_step: Callable[[object, RowResult], "bool | None"], on_end: Callable[[object], None],
               speculation: Speculation | None = None) -> None:
    """Generate every sequence submitted to `scheduler`, admitting new ones between decode steps, until none runs
    and none waits (a sequence resumed after a pause is prefilled with the tokens it produced).

    Each step: the scheduler starts sequences; the scheduler finds every running row the KV block for its next
    token (pausing some under max_utilization); the running rows are decoded together and choose their next tokens
    at once. A decoder that mixes prompts (`MixingDecoder`) computes the prompt of one started sequence in that
    same step, which then chooses its first token: the running rows go on while a prompt joins, and the weights are
    read once for both; the others started wait for the next steps, one per step. Otherwise, and for a sequence
    that wants its context logits or starts on an empty batch, each started sequence is prefilled on its own first,
    choosing (and streaming) its first token as soon as its prompt is done. The callbacks see a sequence's key; its
    row is freed once it ends (a server answers it then). With `speculation`, a step that admits no prompt feeds
    each running row its drafts too (pipeline/runtime/speculative.py), within the KV blocks the row holds."""
    speculation = check_speculation(decoder, speculation)
    rows: dict[int, ScheduledSequence] = {}
    fed: list[int] = []        # rows whose last chosen token the next decode step feeds
    #: started rows whose prompt a coming decode step computes, with what their prefill would be told (`start_config`)
    joining: list[tuple[int, SamplingConfig]] = []
    mixing = isinstance(decoder, MixingDecoder) and decoder.mixes_prompts
    next_row = 0

    def chosen(row: int, logits: torch.Tensor, drafts: list[int] = ()) -> bool:
        """Row `row`'s tokens from a step's logits ([vocab], or [1 + drafts, vocab]); False once it ended."""
        s = rows[row]
        if take(decoder, row, logits.reshape(-1, logits.shape[-1]), list(drafts), s.selector, s.config, s.result,
                on_step, s.key):
            return True
        _end(decoder, scheduler, rows, row, on_end)
        return False

    def prefill_alone(row: int, config: SamplingConfig) -> None:
        with span("forward", phase="prefill", rows=1, tokens=len(rows[row].context()) + len(config.drafts)):
            logits = prefill(decoder, [row], {row: config}, {row: rows[row].result})
        if not config.max_new_tokens:
            _end(decoder, scheduler, rows, row, on_end)
            return
        with span("sample", rows=1):
            if chosen(row, logits[0], config.drafts):
                fed.append(row)

    while True:
        with span("schedule", running=len(fed)):
            poll()
            started = scheduler.admit()
        if not started and not scheduler.running:
            if scheduler.waiting:
                raise RuntimeError("the scheduler starts nothing on an empty batch: a sequence was submitted that "
                                   "cannot fit (Scheduler.refusal)")
            return
        for s in started:
            row, next_row = next_row, next_row + 1
            config = start_config(s, scheduler.room(s))  # before the result exists: it tells a fresh start
            decoder.add([row], [fed_context(s.context(), config)], [config])
            rows[row] = s
            if s.result is None:
                s.selector, s.result = TokenSelector(s.config, s.prompt), RowResult.for_request(s.config)
            if not config.max_new_tokens and not config.context_logits:
                _end(decoder, scheduler, rows, row, on_end)
            elif mixing and not config.context_logits and not config.drafts:       # so max_new_tokens > 0
                joining.append((row, config))
            else:
                prefill_alone(row, config)
        if joining and not fed:
            prefill_alone(*joining.pop(0))
        with span("schedule", running=len(fed)):
            paused = scheduler.make_room([rows[row] for row in fed])
            if paused:
                gone = [row for row in fed + [j for j, _ in joining] if rows[row] in paused]
                decoder.release(gone)
                for row in gone:
                    del rows[row]
                fed = [row for row in fed if row not in gone]
                joining = [(j, config) for j, config in joining if j not in gone]
        if not fed:
            continue
        tokens = [rows[row].result.tokens[-1] for row in fed]
        if joining:
            row, _ = joining.pop(0)
            with span("forward", phase="decode", rows=len(fed), prompt_tokens=len(rows[row].context())):
                logits, first = decoder.decode_with_prompt(fed, tokens, row)
            drafts, timed = [[] for _ in fed], None
        else:
            row = None
            started = time.perf_counter()       # a drafting step's time includes its drafter's
            drafts = step_drafts(speculation, [(r, rows[r].selector.history, rows[r].config, rows[r].result,
                                                scheduler.room(rows[r])) for r in fed])
            with span("forward", phase="decode", rows=len(fed), drafts=sum(map(len, drafts))):
                logits = decode_step(decoder, fed, tokens, drafts)
                timed = None if speculation is None else (len(fed), any(drafts), time.perf_counter() - started)
        with span("sample", rows=len(fed) + (row is not None)):
            records = [rows[r].result for r in fed]
            before = sum(result.accepted_draft_tokens for result in records)
            fed = [r for i, r in enumerate(fed) if chosen(r, logits[i], drafts[i])]
            if timed is not None:
                speculation.observe(*timed, sum(result.accepted_draft_tokens for result in records) - before)
            if row is not None and chosen(row, first):
                fed.append(row)


def start_config(s: ScheduledSequence, room: int | None) -> SamplingConfig:
    """What the decoder and prefill are told of a sequence that starts: itself when fresh, its draft tokens within
    `room` (the KV its blocks hold after its prompt: `Scheduler.room`, None: no bound); after a pause, only the
    tokens it still has to produce, no context logits (it returned them when it first started) and no drafts."""
    if s.result is None:
        return s.config if room is None or len(s.config.drafts) <= room else replace(
            s.config, drafts=s.config.drafts[:room])
    return replace(s.config, max_new_tokens=s.config.max_new_tokens - len(s.result.tokens), context_logits=False,
                   drafts=())


def _end(decoder: InflightDecoder, scheduler: Scheduler, rows: dict, row: int,
         on_end: Callable[[object], None]) -> None:
    s = rows.pop(row)
    scheduler.finish(s)
    decoder.release([row])
    on_end(s.key)
