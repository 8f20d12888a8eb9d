"""TensorRT-LLM's per-request generation features in the cpu target's reference runtime (torch and ONNX Runtime):
repetition/presence/frequency penalties, bad words, embedding bias, log probabilities, context and generation
logits, streamed per token and returned at the end, checked against hand computations on the model's own
forward logits."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.errors import UserError
from pipeline.onnx.export import export_onnx
from pipeline.onnx.runner import OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.generate import RowResult, generate, generate_rows
from pipeline.runtime.sampling import TokenSelector, process_logits, trtllm_sampling

BASE = [5, 6, 7, 8] * 3
VOCAB = 10


@pytest.fixture(scope="module")
def model(checkpoint) -> ReferenceModel:
    return ReferenceModel.load(checkpoint("gqa"))


@pytest.fixture(scope="module")
def ort(checkpoint, tmp_path_factory) -> OrtDecoder:
    out = tmp_path_factory.mktemp("onnx") / "onnx"
    export_onnx(checkpoint("gqa"), out)
    return OrtDecoder(out)


def last_logits(model: ReferenceModel, ids: list[int]) -> torch.Tensor:
    return model.forward(torch.tensor([ids]))[0, -1]


def repeating_prompt(model: ReferenceModel) -> list[int]:
    """BASE plus its first greedy tokens: a prompt whose next greedy token is already in it."""
    prompt = BASE + model.generate([BASE], SamplingConfig(max_new_tokens=3))[0]
    assert int(torch.argmax(last_logits(model, prompt))) in prompt
    return prompt


class FixedDecoder:
    """A Decoder whose logits always rank 3 first, 4 second, 5 third."""

    def __init__(self):
        self.prompts = None

    def logits(self, rows):
        out = torch.zeros(len(rows), VOCAB)
        out[:, 3], out[:, 4], out[:, 5] = 3.0, 2.0, 1.0
        return out

    def prefill(self, rows):
        return self.logits(rows)

    def decode(self, rows, tokens):
        return self.logits(rows)


def fixed(prompt: list[int], **config) -> RowResult:
    return generate_rows(FixedDecoder(), [SamplingConfig(**config)], prompts=[prompt])[0]


# ------------------------------------------------------------------------------ logits processing, by hand

def test_processing_order_is_bias_temperature_then_penalties_on_prompt_and_output():
    logits = torch.tensor([4.0, -2.0, 1.0, 6.0])
    cfg = SamplingConfig(top_k=0, temperature=2.0, repetition_penalty=2.0, presence_penalty=0.5,
                         frequency_penalty=0.25, embedding_bias=[0.0, 0.0, 1.0, 2.0])
    counts = torch.tensor([3, 1, 0, 0])           # token 0 seen three times, token 1 once
    got = process_logits(logits, cfg, [0, 0, 1, 0], counts, generated=0)
    by_hand = [4.0 / 2 / 2 - 0.5 - 0.25 * 3,      # positive: divided by the repetition penalty
               -2.0 / 2 * 2 - 0.5 - 0.25 * 1,     # negative: multiplied
               (1.0 + 1.0) / 2,                    # unseen: bias and temperature only
               (6.0 + 2.0) / 2]
    assert got.tolist() == pytest.approx(by_hand)
    assert logits.tolist() == [4.0, -2.0, 1.0, 6.0]   # the model's logits are left as they were


def test_selector_counts_the_prompt_and_every_chosen_token():
    cfg = SamplingConfig(max_new_tokens=4, frequency_penalty=0.6, log_probs=True)
    selector = TokenSelector(cfg, prompt=[4, 4])
    logits = torch.zeros(VOCAB)
    logits[3], logits[4] = 2.0, 2.7
    assert selector(logits) == 3                  # 2.7 - 0.6 * 2 < 2.0
    assert selector(logits) == 4                  # 3 was seen once: 2.0 - 0.6 < 2.7 - 1.2
    assert selector.counts[3] == 1 and selector.counts[4] == 3


def test_min_tokens_mask_comes_with_the_penalties():
    cfg = SamplingConfig(end_id=3, min_tokens=2, presence_penalty=1.0)
    got = process_logits(torch.tensor([0.0, 1.0, 2.0, 3.0]), cfg, [1], torch.tensor([0, 1, 0, 0]), generated=0)
    assert got.tolist() == [0.0, 0.0, 2.0, float("-inf")]


# ------------------------------------------------------------------------------ bad words and embedding bias

def test_a_single_token_bad_word_never_appears():
    out = fixed([1, 2], max_new_tokens=6, bad_words=[[3]]).tokens
    assert out == [4] * 6


def test_a_multi_token_bad_word_bans_its_last_token_after_its_prefix_prompt_included():
    assert fixed([1, 2], max_new_tokens=6, bad_words=[[3, 3]]).tokens == [3, 4] * 3
    assert fixed([1, 3], max_new_tokens=3, bad_words=[[3, 3]]).tokens == [4, 3, 4]   # the prompt's 3 counts
    assert fixed([1, 2], max_new_tokens=4, bad_words=[[2, 4, 4], [3]]).tokens == [4, 5, 4, 4]


def test_bad_words_hold_in_the_model_runtime(model):
    plain = model.generate([BASE], SamplingConfig(max_new_tokens=12))[0]
    banned = model.generate([BASE], SamplingConfig(max_new_tokens=12, bad_words=[[plain[0]], plain[1:3]]))[0]
    assert plain[0] not in banned
    assert all(banned[i:i + 2] != plain[1:3] for i in range(len(banned) - 1))


def test_a_large_bias_makes_a_token_the_greedy_choice(model):
    plain = model.generate([BASE], SamplingConfig(max_new_tokens=6))[0]
    favourite = next(t for t in range(model.vocab_size) if t not in plain)
    bias = torch.zeros(model.vocab_size)
    bias[favourite] = 1e4
    assert model.generate([BASE], SamplingConfig(max_new_tokens=6, embedding_bias=bias))[0] == [favourite] * 6


# ------------------------------------------------------------------------------ penalties in the model runtime

def test_repetition_penalty_changes_greedy_output_to_the_penalised_argmax(model):
    prompt = repeating_prompt(model)
    logits = last_logits(model, prompt)
    penalised = logits.clone()
    for t in set(prompt):
        penalised[t] = penalised[t] * 3.0 if penalised[t] < 0 else penalised[t] / 3.0
    plain = model.generate([prompt], SamplingConfig(max_new_tokens=8))[0]
    out = model.generate([prompt], SamplingConfig(max_new_tokens=8, repetition_penalty=3.0))[0]
    assert out[0] == int(torch.argmax(penalised)) != plain[0]
    assert out != plain


def test_presence_and_frequency_penalties_match_a_hand_computation_for_one_step(model):
    prompt = repeating_prompt(model)
    logits = last_logits(model, prompt)
    counts = torch.bincount(torch.tensor(prompt), minlength=model.vocab_size).float()
    by_hand = torch.where(counts > 0, logits / 0.5 - 0.7 - 0.3 * counts, logits / 0.5)
    cfg = SamplingConfig(max_new_tokens=1, temperature=0.5, presence_penalty=0.7, frequency_penalty=0.3, log_probs=True)
    result = model.generate_rows([prompt], cfg)[0]
    assert result.tokens == [int(torch.argmax(by_hand))]
    assert result.log_probs[0] == pytest.approx(float(torch.log_softmax(by_hand, -1)[result.tokens[0]]), abs=1e-5)


# ------------------------------------------------------------------------------ log probs and logits

def forward_rows(model: ReferenceModel, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The full-sequence logits that predicted each output token: [len(out), vocab]."""
    full = model.forward(torch.tensor([prompt + out]))[0]
    return full[len(prompt) - 1:len(prompt) - 1 + len(out)]


def test_greedy_log_probs_and_logits_equal_the_models_forward_pass(model):
    prompt = BASE[:7]
    cfg = SamplingConfig(max_new_tokens=8, log_probs=True, context_logits=True, generation_logits=True)
    result = model.generate_rows([prompt], cfg)[0]
    want = forward_rows(model, prompt, result.tokens)
    chosen = torch.log_softmax(want, -1)[torch.arange(len(result.tokens)), result.tokens]
    assert result.log_probs == pytest.approx(chosen.tolist(), abs=1e-5)
    assert result.cum_log_prob == pytest.approx(float(chosen.sum()), abs=1e-4)
    assert torch.allclose(result.context_logits, model.forward(torch.tensor([prompt]))[0], atol=1e-5)
    assert result.generation_logits_tensor().shape == (8, model.vocab_size)
    assert torch.allclose(result.generation_logits_tensor(), want, atol=1e-5)
    assert result.tokens == model.generate([prompt], SamplingConfig(max_new_tokens=8))[0]


def test_sampled_log_probs_are_of_the_temperature_scaled_untruncated_distribution(model):
    prompt = BASE[:5]
    cfg = SamplingConfig(max_new_tokens=6, top_k=5, top_p=0.9, temperature=0.7, seed=3, log_probs=True)
    result = model.generate_rows([prompt], cfg)[0]
    want = torch.log_softmax(forward_rows(model, prompt, result.tokens) / 0.7, -1)
    assert result.log_probs == pytest.approx(want[torch.arange(6), result.tokens].tolist(), abs=1e-5)
    assert result.tokens == model.generate([prompt], SamplingConfig(max_new_tokens=6, top_k=5, top_p=0.9,
                                                                    temperature=0.7, seed=3))[0]


def test_normalized_log_probs_are_over_the_top_k_candidates(model):
    greedy = model.generate_rows([BASE], SamplingConfig(max_new_tokens=4, log_probs=True, normalize_log_probs=True))
    assert greedy[0].log_probs == [0.0] * 4         # as the executor's normalizeLogProbs reports greedy
    cfg = SamplingConfig(max_new_tokens=3, top_k=4, seed=1, log_probs=True, normalize_log_probs=True)
    result = model.generate_rows([BASE], cfg)[0]
    rows = forward_rows(model, BASE, result.tokens)
    for lp, row, token in zip(result.log_probs, rows, result.tokens):
        assert lp == pytest.approx(float(row[token] - torch.logsumexp(torch.topk(row, 4).values, -1)), abs=1e-5)


def test_cum_log_prob_includes_the_end_ids_as_upstream(model):
    plain = model.generate_rows([BASE], SamplingConfig(max_new_tokens=6, log_probs=True))[0]
    ended = model.generate_rows([BASE], SamplingConfig(max_new_tokens=6, end_id=plain.tokens[2], log_probs=True))[0]
    assert ended.tokens == plain.tokens[:2] and ended.end_log_prob == pytest.approx(plain.log_probs[2])
    assert ended.cum_log_prob == pytest.approx(sum(plain.log_probs[:3]))


def test_streaming_sees_each_tokens_log_prob_and_logits_as_the_final_record(model):
    seen = []

    def on_step(row, result):
        seen.append((row, result.tokens[-1], result.log_probs[-1], result.generation_logits[-1].clone()))

    cfgs = [SamplingConfig(max_new_tokens=5, log_probs=True, generation_logits=True),
            SamplingConfig(max_new_tokens=3, top_k=0, seed=2, log_probs=True, generation_logits=True)]
    results = model.generate_rows([BASE[:4], BASE[:9]], cfgs, on_step=on_step)
    for r, result in enumerate(results):
        mine = [s for s in seen if s[0] == r]
        assert [s[1] for s in mine] == result.tokens and [s[2] for s in mine] == result.log_probs
        assert all(torch.equal(s[3], g) for s, g in zip(mine, result.generation_logits))


def test_a_request_with_features_off_is_unchanged_by_its_neighbours(model):
    prompts = [BASE[:6], BASE]
    plain = model.generate(prompts, SamplingConfig(max_new_tokens=6))
    mixed = model.generate_rows(prompts, [SamplingConfig(max_new_tokens=6),
                                          SamplingConfig(max_new_tokens=6, repetition_penalty=2.0, log_probs=True,
                                                         context_logits=True, generation_logits=True)])
    assert mixed[0].tokens == plain[0]
    assert mixed[0].log_probs is None and mixed[0].context_logits is None and mixed[0].generation_logits is None


def test_context_logits_without_new_tokens(model):
    result = model.generate_rows([BASE], SamplingConfig(max_new_tokens=0, context_logits=True))[0]
    assert result.tokens == [] and torch.allclose(result.context_logits, model.forward(torch.tensor([BASE]))[0],
                                                  atol=1e-5)


def test_a_decoder_without_prompt_logits_refuses_context_logits():
    with pytest.raises(UserError, match="cannot return context logits"):
        generate_rows(FixedDecoder(), [SamplingConfig(context_logits=True)])
    assert generate(FixedDecoder(), [SamplingConfig(max_new_tokens=2)], None) == [[3, 3]]


# ------------------------------------------------------------------------------ ONNX Runtime

def test_onnx_runtime_returns_the_same_records(model, ort):
    prompts = [BASE[:5], BASE, BASE[:9]]
    bias = torch.zeros(model.vocab_size)
    bias[17] = 2.0
    features = dict(log_probs=True, context_logits=True, generation_logits=True)
    cfgs = [SamplingConfig(max_new_tokens=6, repetition_penalty=1.5, bad_words=[[33]], **features),
            SamplingConfig(max_new_tokens=4, presence_penalty=0.5, frequency_penalty=0.2, embedding_bias=bias,
                           **features),
            SamplingConfig(max_new_tokens=5, top_k=10, temperature=0.8, seed=4, **features)]
    got, want = ort.generate_rows(prompts, cfgs), model.generate_rows(prompts, cfgs)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert g.log_probs == pytest.approx(w.log_probs, abs=1e-4)
        assert torch.allclose(g.context_logits, w.context_logits, atol=1e-4)
        assert torch.allclose(g.generation_logits_tensor(), w.generation_logits_tensor(), atol=1e-4)


# ------------------------------------------------------------------------------ refused values

@pytest.mark.parametrize("config,match", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=math.nan), "repetition_penalty must be a finite number"),
    (dict(presence_penalty=math.inf), "presence_penalty must be a finite number"),
    (dict(frequency_penalty="1"), "frequency_penalty must be a finite number"),
    (dict(bad_words=[[]]), "bad_words must be a list of non-empty token-id lists"),
    (dict(bad_words=[[1.5]]), "bad_words must be a list of non-empty token-id lists"),
    (dict(embedding_bias=[[0.0, 1.0]]), "embedding_bias must be a \\[vocab\\] vector"),
    (dict(embedding_bias=[0.0, math.nan]), "embedding_bias must be a \\[vocab\\] vector"),
])
def test_bad_values_are_user_errors(config, match):
    with pytest.raises(UserError, match=match):
        SamplingConfig(**config)


def test_negative_presence_and_frequency_penalties_are_accepted_as_upstream():
    assert SamplingConfig(presence_penalty=-1.0, frequency_penalty=-0.5).penalised


def test_an_embedding_bias_of_the_wrong_size_is_refused(model):
    with pytest.raises(UserError, match="embedding_bias has 3 entries"):
        model.generate([BASE], SamplingConfig(embedding_bias=[0.0, 0.0, 1.0]))


def test_trtllm_sampling_passes_the_features_through():
    cfg = trtllm_sampling(top_k=0, top_p=0.0, temperature=0.0, repetition_penalty=1.2, bad_words=[[1, 2]],
                          log_probs=True, generation_logits=True)
    assert cfg.greedy and cfg.repetition_penalty == 1.2 and cfg.bad_words == [[1, 2]]
    assert cfg.log_probs and cfg.generation_logits and not cfg.context_logits
