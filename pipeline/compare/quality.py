"""Quality figures of B against A: held-out perplexity of each checkpoint, and B's greedy generations
scored against A's.

- perplexity: `trtpipe eval`'s (pipeline.evaluate): the same held-out text, each build's tokenizer, the
  checkpoint run a decoder layer at a time with the reference runtime's quantization semantics.
- token agreement: per prompt, the tokens of B's completion that agree with A's from the start (the
  agreeing prefix) over the tokens of A's completion, averaged over prompts; both tokenized with A's
  tokenizer. A greedy decoder that differs once follows another path, so what follows is not counted.
- ROUGE-L: rouge-score's F-measure of the longest common subsequence (B as prediction, A as target),
  averaged over prompts.
- BLEU: sacrebleu's corpus BLEU (0-100, 13a tokenization, exponential smoothing) of B against A.
- exact match: the share of prompts whose completions are identical strings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..evaluate import evaluate


@dataclass(frozen=True)
class PerplexityFigures:
    perplexity: float
    tokens: int
    dataset: str


@dataclass(frozen=True)
class GenerationFigures:
    token_agreement: float
    rouge_l: float
    bleu: float
    exact_match: float
    prompts: int

    def to_dict(self) -> dict:
        return asdict(self)


def heldout_perplexity(checkpoint: Path, samples: int, device: str = "auto") -> PerplexityFigures:
    result = evaluate(checkpoint, None, max_samples=samples, device=device, progress=False)
    return PerplexityFigures(result.perplexity, result.tokens, f"{result.dataset}, first {samples} documents")


def agreeing_prefix(reference: list[int], candidate: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(reference, candidate)) if x != y), min(len(reference),
                                                                                         len(candidate)))


def token_agreement(tokenizer, texts_a: list[str], texts_b: list[str]) -> float:
    shares = []
    for a, b in zip(texts_a, texts_b, strict=True):
        ids_a = tokenizer(a, add_special_tokens=False)["input_ids"]
        ids_b = tokenizer(b, add_special_tokens=False)["input_ids"]
        shares.append(agreeing_prefix(ids_a, ids_b) / len(ids_a) if ids_a else float(not ids_b))
    return sum(shares) / len(shares)


def rouge_l(texts_a: list[str], texts_b: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(a, b)["rougeL"].fmeasure for a, b in zip(texts_a, texts_b, strict=True)]
    return sum(scores) / len(scores)


def bleu(texts_a: list[str], texts_b: list[str]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(texts_b, [texts_a]).score)


def generation_figures(tokenizer, texts_a: list[str], texts_b: list[str]) -> GenerationFigures:
    exact = sum(a == b for a, b in zip(texts_a, texts_b, strict=True)) / len(texts_a)
    return GenerationFigures(token_agreement(tokenizer, texts_a, texts_b), rouge_l(texts_a, texts_b),
                             bleu(texts_a, texts_b), exact, len(texts_a))
