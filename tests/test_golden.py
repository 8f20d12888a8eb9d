"""The streamed golden reference: transformers' own layers, one in memory at a time, same choices as the whole model."""

from __future__ import annotations

import shutil

import pytest
import torch

from pipeline.golden import GoldenReference, StreamedTransformers
from pipeline.runtime import stream
from support.models import make_tiny_model

SEQUENCES = [[1, 5, 7, 9, 3, 2, 8], [4, 4, 4], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100], [7]]


@pytest.mark.parametrize("variant", ["gqa", "tied", "llama3-rope", "mistral", "head-dim"])
def test_next_tokens_equal_the_whole_models_argmax(tiny_llama, hf_whole, variant, monkeypatch):
    monkeypatch.setattr(stream, "VOCAB_CHUNK_BYTES", 4 * 48 * 9)      # 12 vocabulary chunks
    streamed = StreamedTransformers(tiny_llama(variant))
    model = hf_whole(variant)
    for seq, choices in zip(SEQUENCES, streamed.next_tokens(SEQUENCES)):
        with torch.no_grad():
            want = model(torch.tensor([seq])).logits[0].argmax(-1)
        assert torch.equal(choices, want), variant
    assert all(p.device.type == "meta" for p in streamed.model.parameters())   # nothing left materialized


def test_weights_are_rounded_to_the_served_dtype(tiny_llama):
    """A float16-served model is compared with a reference whose weights went through float16."""
    path = tiny_llama("gqa")
    full, half = StreamedTransformers(path), StreamedTransformers(path, weights_dtype="float16")
    row = half._rows("model.embed_tokens.weight", (0, 4))
    assert torch.equal(row, full._rows("model.embed_tokens.weight", (0, 4)).half().float())
    assert row.dtype == torch.float32


@pytest.fixture(scope="module")
def hf_whole(tiny_llama):
    from transformers import AutoModelForCausalLM

    return lambda variant: AutoModelForCausalLM.from_pretrained(tiny_llama(variant), dtype=torch.float32).eval()


def test_completions_equal_transformers_generate(smollm2_hf_dir, tmp_path):
    """Greedy completions through layer sweeps equal transformers' generate() (EOS stops both)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = make_tiny_model(tmp_path / "tiny", vocab_size=49152, num_attention_heads=8, num_key_value_heads=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, hf / name)
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    reference = GoldenReference(hf)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    got = reference.complete_all(prompts, 6)
    for prompt, text in zip(prompts, got):
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=tok.eos_token_id)
        assert text == tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    agree, total = reference.agreement(prompts[0], got[0])
    assert total > 0 and agree == total
