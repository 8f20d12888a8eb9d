"""Per-request sampling parameters, TensorRT-LLM's logits processing and token selection.

One request's next token is chosen in TensorRT-LLM's decoder-layer order (cpp/tensorrt_llm/layers/layersFactory.h
@ c629546: PENALTY_LAYER, BAN_WORDS_LAYER, then the sampling layer): `process_logits` applies the
penalty layer's kernel (embedding bias, temperature, repetition/presence/frequency penalties, min length; see its
docstring) and then bans bad words; `TokenSelector` draws from what is left (greedy, top-k, top-p) and reports the
chosen token's log probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Sequence

import torch

from ..errors import UserError
from ..triton_names import sampling_error


@dataclass
class SamplingConfig:
    """How one request generates. top_k=1 is greedy; top_k=0 means no top-k limit.

    min_tokens: end_id cannot be chosen before the output has this many tokens (TensorRT-LLM's min length:
    its penalty kernel sets the end id's logit to -inf while generated < min_tokens, before sampling). 0 and
    1 mean no constraint, as for a lone upstream request (its default min length is 1, and the penalty is only
    applied when some request asks for more). Stop words and max_new_tokens still end a request earlier.

    TensorRT-LLM executor features, each off at its default (semantics in `process_logits` and `TokenSelector`):
    repetition_penalty (1.0 off; > 0), presence_penalty and frequency_penalty (0.0 off; any finite number):
    penalise every token seen so far, prompt included. bad_words: token-id sequences whose last token is
    banned (-inf) when the rest ends the prompt + output so far; a one-token entry is always banned.
    embedding_bias: float [vocab] added to the logits first. log_probs: report each output token's log
    probability; normalize_log_probs: renormalise it over the top-k candidates as the executor's
    normalizeLogProbs does (greedy then reports 0). context_logits: keep the raw logits of every prompt
    position; generation_logits: keep the raw logits of every generated step.

    drafts: draft tokens the request brings for what follows its prompt (TensorRT-LLM's external draft tokens,
    NVIDIA's `draft_input_ids`: what its BLS model sends the target with a draft model's output). They are fed with
    the prompt and verified by its prefill, as a speculative step verifies drafts (pipeline/runtime/speculative.py):
    the output is what plain decoding gives, the accepted drafts only save steps. A step verifying K drafts outputs
    up to K + 1 tokens, so a request brings fewer than max_new_tokens.
    """

    max_new_tokens: int = 16
    end_id: int | None = None
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 1.0
    seed: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)  # token-id sequences that end generation
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = field(default=None, compare=False)  # float32 [vocab]
    log_probs: bool = False
    normalize_log_probs: bool = False
    context_logits: bool = False
    generation_logits: bool = False
    drafts: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        self.drafts = tuple(int(t) for t in self.drafts)
        if self.drafts and len(self.drafts) >= self.max_new_tokens:
            raise UserError(f"{len(self.drafts)} draft tokens need max_new_tokens of at least {len(self.drafts) + 1} "
                            f"(got {self.max_new_tokens}): a step verifying K drafts outputs up to K + 1 tokens")
        # TensorRT-LLM's ranges (triton_names.SAMPLING_RANGES); the temperature's is the runtime's own: here a
        # temperature of 0 is not greedy (trtllm_sampling made it top_k 1 already), so sampling needs one > 0
        for name, integer in (("min_tokens", True), ("top_k", False), ("top_p", False)):
            error = sampling_error(name, getattr(self, name), integer=integer)
            if error:
                raise UserError(error)
        if not self.greedy and self.temperature <= 0:
            raise UserError(f"temperature must be > 0 when sampling (got {self.temperature})")
        self.stop_words = token_lists(self.stop_words, "stop_words")
        self.check_penalties()
        self.bad_words = token_lists(self.bad_words, "bad_words")
        if self.embedding_bias is not None:
            self.embedding_bias = bias_vector(self.embedding_bias)

    def check_penalties(self) -> None:
        """The executor's ranges (executor/samplingConfig.cpp checkRepetitionPenalty: > 0; kernels/penaltyTypes.h
        getLimitsPenalty: presence and frequency anywhere in float's range)."""
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
                raise UserError(f"{name} must be a finite number (got {value!r})")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty must be > 0 (got {self.repetition_penalty}; 1.0 is off)")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether any occurrence penalty is on (then the selector counts the tokens seen)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def token_lists(value, name: str) -> list[list[int]]:
    if any(not len(seq) or not all(isinstance(t, Integral) for t in seq) for seq in value):
        raise UserError(f"{name} must be a list of non-empty token-id lists")
    return [[int(t) for t in seq] for seq in value]


def bias_vector(value) -> torch.Tensor:
    bias = torch.as_tensor(value, dtype=torch.float32).detach().clone()
    if bias.dim() != 1 or torch.isnan(bias).any():
        raise UserError(f"embedding_bias must be a [vocab] vector of numbers (got shape {list(bias.shape)})")
    return bias


def trtllm_sampling(top_k: int, top_p: float, temperature: float, **config) -> SamplingConfig:
    """TensorRT-LLM's sampling semantics as a SamplingConfig: top_k 1, temperature 0, or top_k 0 with top_p 0
    (the executor's defaults when a request sets neither) mean greedy; a temperature or top_p of 0 is not
    applied otherwise. `config`: the other SamplingConfig fields (penalties, bad_words, embedding_bias,
    log_probs, context_logits, generation_logits ... pass through unchanged)."""
    greedy = top_k == 1 or (top_k == 0 and top_p == 0) or temperature == 0
    return SamplingConfig(temperature=temperature if temperature > 0 else 1.0, top_k=1 if greedy else top_k,
                          top_p=top_p if top_p > 0 else 1.0, **config)


def process_logits(logits: torch.Tensor, cfg: SamplingConfig, history: Sequence[int], counts: torch.Tensor | None,
                   generated: int, scale: bool = True) -> torch.Tensor:
    """The logits TensorRT-LLM samples from, as a new tensor (`logits` is left as it is).

    Facts from TensorRT-LLM cpp/tensorrt_llm/kernels/penaltyKernels.cu (batchApplyPenalty @ 249d93d, 2024),
    per vocabulary entry, in this order: + embedding bias; * 1/temperature; then, for a token seen
    `counts[t] > 0` times in the prompt and the output so far (the kernel counts the prompt's tokens in the
    context step and adds each generated one): repetition (logit < 0 ? logit * p : logit / p), presence
    (- p, once), frequency (- p * count); then the end id is masked while generated < min_tokens. The ban
    words layer runs after the penalty layer (layers/layersFactory.h @ c629546) with banBadWords.cu @ 829d3e2: a
    one-token bad word is always banned, a longer one bans its last token when its other tokens end the
    sequence so far (prompt included: the kernel reads the request's whole output_ids from its sequence
    length back); ids outside the vocabulary are ignored. Upstream scales by 1/(temperature + 1e-6); this
    divides by the temperature, as the runtime always has. `scale=False` skips the temperature (greedy
    selection, where only the order of the logits matters). `counts` is None when no penalty is on.
    """
    out = logits if cfg.embedding_bias is None else logits + cfg.embedding_bias
    if scale and cfg.temperature > 0 and cfg.temperature != 1.0:
        out = out / cfg.temperature
    if counts is not None:
        out = apply_penalties(out, cfg, counts)
    banned = banned_tokens(cfg, history, generated, out.numel())
    if banned:
        out = out.clone() if out is logits else out
        out[banned] = float("-inf")
    return out


def apply_penalties(logits: torch.Tensor, cfg: SamplingConfig, counts: torch.Tensor) -> torch.Tensor:
    seen = counts > 0
    if cfg.repetition_penalty != 1.0:
        p = cfg.repetition_penalty
        logits = torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)
    if cfg.presence_penalty != 0.0:
        logits = torch.where(seen, logits - cfg.presence_penalty, logits)
    if cfg.frequency_penalty != 0.0:
        logits = torch.where(seen, logits - cfg.frequency_penalty * counts.to(logits.dtype), logits)
    return logits


def banned_tokens(cfg: SamplingConfig, history: Sequence[int], generated: int, vocab: int) -> list[int]:
    """The ids whose logit is -inf this step: the end id before min_tokens, and the bad words' last tokens."""
    banned = []
    end, least = cfg.end_id, cfg.min_tokens
    if end is not None and least > 1 and generated < least:
        banned.append(end)
    for word in cfg.bad_words:
        head = len(word) - 1
        if head == 0 or (len(history) >= head and list(history[len(history) - head:]) == word[:-1]):
            banned.append(word[-1])
    return [t for t in banned if 0 <= t < vocab]


@dataclass
class Choice:
    """One selected token and, when the request asks for log probabilities, its log probability."""

    token: int
    log_prob: float | None = None


class TokenSelector:
    """Chooses the next tokens of one request from its float32 logits [vocab], one call a step.

    It remembers the prompt and every token it chose (what penalties and bad words look at), so one selector
    serves one request from its first step to its last.

    Log probabilities follow TensorRT-LLM's sampling layer (layers/samplingLayer.cpp @ 95ca1ea: when log
    probs are asked the processed logits go through a softmax over the whole vocabulary before sampling;
    kernels/samplingTopKKernels.cu @ 0396172 and samplingTopPKernels.cu @ 03cff08 then report log(p) of the
    chosen token): log_softmax of the processed logits (bias, temperature, penalties, min-tokens and bad-word
    masks; before top-k/top-p truncation). With normalize_log_probs, top-k selection (greedy included)
    reports log(p / sum of the top-k candidates' p), which is what the top-k kernel does under the executor's
    normalizeLogProbs (ExecutorConfig, default true upstream; greedy then gives 0, tensorrtllm_backend
    issue #276); top-p-only sampling is never renormalised upstream.
    """

    def __init__(self, cfg: SamplingConfig, prompt: Sequence[int] = ()):
        self.cfg = cfg
        self.generator = torch.Generator()
        if cfg.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(cfg.seed)
        self.history = [int(t) for t in prompt]
        self.counts: torch.Tensor | None = None
        # greedy ignores the temperature unless the additive penalties or the log probabilities depend on it
        additive = cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0
        self.scale = not cfg.greedy or additive or cfg.log_probs

    def __call__(self, logits: torch.Tensor, generated: int = 0) -> int:
        """The next token after `generated` output tokens (end_id is masked while generated < min_tokens)."""
        return self.choose(logits, generated).token

    def choose(self, logits: torch.Tensor, generated: int = 0) -> Choice:
        cfg = self.cfg
        processed = process_logits(logits, cfg, self.history, self.occurrences(logits.numel()), generated, self.scale)
        if cfg.greedy:
            token = int(torch.argmax(processed))
            candidates = processed[token:token + 1]
        else:
            k = cfg.top_k or processed.numel()
            candidates, indices = torch.topk(processed, min(k, processed.numel()))   # sorted, largest first
            probs = torch.softmax(candidates, dim=-1)
            if cfg.top_p < 1.0:
                before = torch.cumsum(probs, dim=-1) - probs                  # mass of the tokens ranked above
                probs = torch.where(before < cfg.top_p, probs, torch.zeros_like(probs))
            token = int(indices[torch.multinomial(probs, 1, generator=self.generator)])
        log_prob = self.log_prob(processed, token, candidates) if cfg.log_probs else None
        self.record(token)
        return Choice(token, log_prob)

    def log_prob(self, processed: torch.Tensor, token: int, candidates: torch.Tensor) -> float:
        if self.cfg.normalize_log_probs and self.cfg.top_k > 0:
            return float(processed[token] - torch.logsumexp(candidates, dim=-1))
        return float(torch.log_softmax(processed, dim=-1)[token])

    def occurrences(self, vocab: int) -> torch.Tensor | None:
        """How often each id occurs in the prompt and the output so far; None when no penalty needs it."""
        if not self.cfg.penalised:
            return None
        if self.counts is None:
            self.counts = torch.bincount(torch.tensor(self.history, dtype=torch.long), minlength=vocab)[:vocab]
        return self.counts

    def record(self, token: int) -> None:
        self.history.append(token)
        if self.counts is not None and 0 <= token < self.counts.numel():
            self.counts[token] += 1
