"""The reference runtime, proven against Hugging Face transformers running the original model.

The runtime is written from TensorRT-LLM's layer semantics, not from our converter, so agreement
here checks both: logits within 1e-4 x max|logit| in float32 and token-identical greedy generation for
every attention layout at tp 1/2/4 and pp 2, and tests that the parity check fails when the
checkpoint is wrong (swapped mlp.fc/mlp.gate, swapped K/V, dropped rope scaling).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.errors import UserError
from pipeline.evaluate import corpus_lines, corpus_split
from pipeline.runtime import ReferenceModel, SamplingConfig, perplexity
from pipeline.sources import resolve_model

TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2)]
VARIANTS = ["mha", "gqa", "mqa", "tied", "llama3-rope", "head-dim", "mistral"]


@pytest.fixture(scope="session")
def hf_model(tiny_llama):
    """Factory: hf_model(variant) -> the transformers model in float32, EOS disabled for generate()."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(variant: str):
        if variant not in made:
            model = AutoModelForCausalLM.from_pretrained(tiny_llama(variant), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            made[variant] = model
        return made[variant]

    return get


def random_ids(shape, vocab=101, seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rewrite_rank(ckpt: Path, rank: int, edit) -> None:
    path = ckpt / f"rank{rank}.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(checkpoint, hf_model, variant, tp, pp):
    ids = random_ids((2, 40))
    with torch.no_grad():
        want = hf_model(variant)(ids).logits
    got = ReferenceModel.load(checkpoint(variant, tp, pp)).forward(ids)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert relative_error(got, want) <= TOL


@pytest.mark.parametrize("variant,tp,pp", [("gqa", 2, 1), ("mqa", 4, 1), ("llama3-rope", 1, 2), ("head-dim", 2, 1)])
def test_greedy_generation_matches_transformers(checkpoint, hf_model, variant, tp, pp):
    model = ReferenceModel.load(checkpoint(variant, tp, pp))
    prompts = [random_ids((n,), seed=n).tolist() for n in (5, 17, 9, 30)]
    want = [hf_greedy(hf_model(variant), p, 32) for p in prompts]
    batched = model.generate(prompts, SamplingConfig(max_new_tokens=32))
    unbatched = [model.generate([p], SamplingConfig(max_new_tokens=32))[0] for p in prompts]
    assert batched == want
    assert unbatched == want
    assert all(len(w) == 32 for w in want)


def swap_fc_gate(tensors: dict, kv_rows: int) -> None:
    for name in [n for n in tensors if n.endswith("mlp.fc.weight")]:
        gate = name.replace("mlp.fc", "mlp.gate")
        tensors[name], tensors[gate] = tensors[gate], tensors[name]


def swap_k_v(tensors: dict, kv_rows: int) -> None:
    for name in [n for n in tensors if n.endswith("attention.qkv.weight")]:
        w = tensors[name]
        q, k, v = w.split([w.shape[0] - 2 * kv_rows, kv_rows, kv_rows])
        tensors[name] = torch.cat([q, v, k])


@pytest.mark.parametrize("damage", ["swap_fc_gate", "swap_k_v", "drop_rope_scaling"])
def test_parity_check_catches_a_wrong_checkpoint(checkpoint, hf_model, tmp_path, damage):
    variant = "llama3-rope"
    good = checkpoint(variant, 2, 1)
    ckpt = copy_checkpoint(good, tmp_path / "bad")
    cfg = json.loads((ckpt / "config.json").read_text())
    if damage == "drop_rope_scaling":
        cfg["rotary_scaling"] = None
        (ckpt / "config.json").write_text(json.dumps(cfg))
    else:
        kv_rows = cfg["num_key_value_heads"] // 2 * cfg["head_size"]
        edit = swap_fc_gate if damage == "swap_fc_gate" else swap_k_v
        for rank in range(2):
            rewrite_rank(ckpt, rank, lambda t: edit(t, kv_rows))
    ids = random_ids((2, 40))
    with torch.no_grad():
        want = hf_model(variant)(ids).logits
    assert relative_error(ReferenceModel.load(good).forward(ids), want) <= TOL
    assert relative_error(ReferenceModel.load(ckpt).forward(ids), want) > 10 * TOL


# ------------------------------------------------------------------ generation semantics


def test_batched_requests_do_not_cross_talk(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa", 2, 1))
    a, b, c = (random_ids((n,), seed=s).tolist() for n, s in ((7, 1), (23, 2), (3, 3)))
    short, long = SamplingConfig(max_new_tokens=5), SamplingConfig(max_new_tokens=20)
    alone = model.generate([a], [long])[0]
    with_b = model.generate([a, b], [long, short])
    with_c = model.generate([c, a], [short, long])
    assert with_b[0] == alone and with_c[1] == alone
    assert len(with_b[1]) == 5 and len(with_c[0]) == 5
    assert with_b[1] == model.generate([b], [short])[0]


def test_generation_equals_full_forward_argmax(checkpoint):
    """Each cached decode step predicts what a full causal forward over the whole sequence predicts."""
    model = ReferenceModel.load(checkpoint("mqa", 4, 1))
    prompt = random_ids((11,), seed=5).tolist()
    out = model.generate([prompt], SamplingConfig(max_new_tokens=12))[0]
    logits = model.forward(torch.tensor([prompt + out]))[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_end_id_stops_without_being_output(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    prompt = random_ids((9,), seed=7).tolist()
    free = model.generate([prompt], SamplingConfig(max_new_tokens=24))[0]
    end = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    cut = free.index(end)
    assert model.generate([prompt], SamplingConfig(max_new_tokens=24, end_id=end))[0] == free[:cut]


def test_stop_words_end_generation_after_the_sequence(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    prompt = random_ids((9,), seed=8).tolist()
    free = model.generate([prompt], SamplingConfig(max_new_tokens=24))[0]
    stop = free[3:5]
    first = next(i for i in range(len(free) - 1) if free[i:i + 2] == stop)
    got = model.generate([prompt], SamplingConfig(max_new_tokens=24, stop_words=[[99999], stop]))[0]
    assert got == free[:first + 2]


def test_on_token_streams_each_token_as_it_is_produced(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    prompts = [random_ids((n,), seed=n).tolist() for n in (4, 12)]
    events = []
    outs = model.generate(prompts, SamplingConfig(max_new_tokens=6), on_token=lambda r, t: events.append((r, t)))
    assert [t for r, t in events if r == 0] == outs[0] and [t for r, t in events if r == 1] == outs[1]
    assert [r for r, _ in events] == [0, 1] * 6      # interleaved step by step, not delivered at the end


def test_on_end_reports_each_row_as_it_leaves_the_batch(checkpoint):
    """A row that ends (its end id, its max_new_tokens) is reported in the step it ends, while the others go
    on: what lets the served model answer a request before the rest of its batch is done."""
    model = ReferenceModel.load(checkpoint("gqa"))
    prompts = [random_ids((n,), seed=n).tolist() for n in (9, 5, 7)]
    free = model.generate([prompts[0]], SamplingConfig(max_new_tokens=24))[0]
    end = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    cut = free.index(end)           # row 0 samples its end id in step `cut` and leaves without outputting it
    configs = [SamplingConfig(max_new_tokens=24, end_id=end), SamplingConfig(max_new_tokens=3),
               SamplingConfig(max_new_tokens=cut + 4)]
    events = []
    outs = model.generate(prompts, configs, on_token=lambda r, t: events.append(("token", r)),
                          on_end=lambda r: events.append(("end", r)))
    assert [len(o) for o in outs] == [cut, 3, cut + 4] and outs[0] == free[:cut]
    assert sorted(e for e in events if e[0] == "end") == [("end", 0), ("end", 1), ("end", 2)]
    row2_tokens = [i for i, e in enumerate(events) if e == ("token", 2)]
    assert events.index(("end", 1)) < row2_tokens[3]          # row 1 left after its 3rd token
    assert events.index(("end", 0)) < row2_tokens[cut]         # row 0 left in the step it drew its end id
    assert events[-1] == ("end", 2)


def test_sampling_is_seeded_and_respects_top_k(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    prompt = random_ids((6,), seed=9).tolist()
    cfg = dict(max_new_tokens=16, temperature=1.5, top_k=0)
    first = model.generate([prompt], SamplingConfig(seed=1, **cfg))[0]
    assert model.generate([prompt], SamplingConfig(seed=1, **cfg))[0] == first
    others = [model.generate([prompt], SamplingConfig(seed=s, **cfg))[0] for s in (2, 3, 4)]
    assert any(o != first for o in others)
    top2 = model.generate([prompt], SamplingConfig(seed=5, max_new_tokens=16, temperature=2.0, top_k=2))[0]
    logits = model.forward(torch.tensor([prompt + top2]))[0, len(prompt) - 1:-1]
    allowed = logits.topk(2, dim=-1).indices
    assert all(t in allowed[i].tolist() for i, t in enumerate(top2))
    greedy = model.generate([prompt], SamplingConfig(max_new_tokens=16))[0]
    assert top2 != greedy        # with two candidates at temperature 2, some step picks the runner-up


def test_top_p_keeps_the_smallest_nucleus(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    prompt = random_ids((6,), seed=10).tolist()
    greedy = model.generate([prompt], SamplingConfig(max_new_tokens=10))[0]
    tiny_p = model.generate([prompt], SamplingConfig(max_new_tokens=10, top_k=0, top_p=1e-6, seed=3))[0]
    assert tiny_p == greedy


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(temperature=0.0, top_k=0), "temperature"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(stop_words=[[]]), "stop_words"),
])
def test_bad_sampling_configs_are_user_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingConfig(**kwargs)


def test_bad_prompts_are_user_errors(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    with pytest.raises(UserError, match="empty"):
        model.generate([[]], SamplingConfig())
    with pytest.raises(UserError, match="token ids"):
        model.generate([[5, 101]], SamplingConfig())
    with pytest.raises(UserError, match="max_position_embeddings"):
        model.generate([[1] * 250], SamplingConfig(max_new_tokens=10))


# ------------------------------------------------------------------ observer (calibration hook)


def test_observer_sees_every_quantizable_input(checkpoint, hf_model):
    model = ReferenceModel.load(checkpoint("gqa", 2, 2))
    seen: dict[str, torch.Tensor] = {}
    ids = random_ids((2, 10))
    model.forward(ids, observer=lambda name, t: seen.__setitem__(name, t.clone()))
    cfg = model.config
    hd, kv = cfg["head_size"], cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        assert seen[p + "attention.qkv"].shape == (20, cfg["hidden_size"])
        assert seen[p + "attention.dense"].shape == (20, cfg["num_attention_heads"] * hd)
        assert seen[p + "mlp.proj"].shape == (20, cfg["intermediate_size"])
        assert seen[p + "attention.k"].shape == seen[p + "attention.v"].shape == (20, kv * hd)
        assert torch.equal(seen[p + "mlp.fc"], seen[p + "mlp.gate"])
    captured = {}
    hf = hf_model("gqa")
    hooks = [hf.model.layers[3].self_attn.o_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("o", i[0])),
             hf.model.layers[3].mlp.down_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("d", i[0]))]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    assert torch.allclose(seen["transformer.layers.3.attention.dense"], captured["o"].reshape(20, -1), atol=1e-5)
    assert torch.allclose(seen["transformer.layers.3.mlp.proj"], captured["d"].reshape(20, -1), atol=1e-5)


# ------------------------------------------------------------------ validation of checkpoints


def _damage_unexpected(ckpt):
    rewrite_rank(ckpt, 1, lambda t: t.__setitem__("transformer.layers.0.attention.extra", torch.zeros(3)))


def _damage_missing(ckpt):
    rewrite_rank(ckpt, 0, lambda t: t.pop("transformer.layers.1.mlp.gate.weight"))


def _damage_shape(ckpt):
    rewrite_rank(ckpt, 1, lambda t: t.__setitem__("transformer.layers.0.mlp.proj.weight",
                                                  t["transformer.layers.0.mlp.proj.weight"][:, :-1].contiguous()))


def _damage_dtype(ckpt):
    rewrite_rank(ckpt, 0, lambda t: t.__setitem__("transformer.ln_f.weight", t["transformer.ln_f.weight"].half()))


def _damage_rank_file(ckpt):
    (ckpt / "rank1.safetensors").unlink()


def _damage_extra_rank(ckpt):
    shutil.copy(ckpt / "rank1.safetensors", ckpt / "rank2.safetensors")


def _damage_unreadable(ckpt):
    (ckpt / "rank0.safetensors").write_bytes(b"not a safetensors file")


def _damage_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _damage_quant_algo(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["quant_algo"] = "NVFP4"
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _damage_duplicated_kv(ckpt):
    """tp=4 with 2 K/V heads: ranks 0 and 1 must carry the same K head."""
    rewrite_rank(ckpt, 1, lambda t: t.__setitem__("transformer.layers.0.attention.qkv.weight",
                                                  t["transformer.layers.0.attention.qkv.weight"] * 1.5))


def _damage_layer_count(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,message", [
    (_damage_unexpected, r"rank1.safetensors: unexpected tensor transformer.layers.0.attention.extra"),
    (_damage_missing, r"rank0.safetensors: missing tensor transformer.layers.1.mlp.gate.weight"),
    (_damage_shape, r"rank1.safetensors: tensor transformer.layers.0.mlp.proj.weight has shape \[48, 47\], "
                    r"expected \[48, 48\]"),
    (_damage_dtype, r"rank0.safetensors: tensor transformer.ln_f.weight has dtype F16, expected float32"),
    (_damage_rank_file, r"missing rank1.safetensors"),
    (_damage_extra_rank, r"unexpected rank2.safetensors for a 2-rank checkpoint"),
    (_damage_unreadable, r"rank0.safetensors: not a readable safetensors file"),
    (_damage_config, r"missing field 'hidden_size'"),
    (_damage_quant_algo, r"quant_algo 'NVFP4' is not supported"),
    (_damage_duplicated_kv, r"transformer.layers.0.attention.qkv: tp ranks 0 and 1 "
                            r"must hold the same duplicated K head"),
    (_damage_layer_count, r"holds 4 layers .* num_hidden_layers=5"),
])
def test_bad_checkpoints_are_reported_by_name(checkpoint, tmp_path, damage, message):
    layout = (4, 1) if damage is _damage_duplicated_kv else (2, 1)
    ckpt = copy_checkpoint(checkpoint("gqa", *layout), tmp_path / "ckpt")
    damage(ckpt)
    with pytest.raises(UserError, match=message):
        ReferenceModel.load(ckpt)


def test_all_problems_are_listed_at_once(checkpoint, tmp_path):
    ckpt = copy_checkpoint(checkpoint("gqa", 2, 1), tmp_path / "ckpt")
    _damage_missing(ckpt)
    _damage_shape(ckpt)
    with pytest.raises(UserError, match=r"2 problem\(s\)") as err:
        ReferenceModel.load(ckpt)
    assert "mlp.gate.weight" in str(err.value) and "mlp.proj.weight" in str(err.value)


# ------------------------------------------------------------------ perplexity and `trtpipe eval`


class Uniform:
    """A model with equal logits everywhere: its perplexity is exactly the vocabulary size."""

    def forward(self, ids):
        return torch.zeros(ids.shape[0], ids.shape[1], 37)


def test_perplexity_of_a_uniform_model_is_the_vocab_size():
    result = perplexity(Uniform(), [[1, 2, 3, 4, 5], [6] * 9], window=4)
    assert math.isclose(result.perplexity, 37.0, rel_tol=1e-6)
    assert result.tokens == 3 + 3 + 3     # windows [1..4], [6]*4, [6]*4 score 3 each; [5] and [6] score none


def test_perplexity_matches_a_direct_computation(checkpoint):
    model = ReferenceModel.load(checkpoint("gqa"))
    seq = random_ids((30,), seed=11).tolist()
    logits = model.forward(torch.tensor([seq]))[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(seq[1:]))
    assert math.isclose(perplexity(model, [seq]).perplexity, math.exp(float(nll)), rel_tol=1e-5)


def test_corpus_split_is_deterministic_and_disjoint():
    calib, held = corpus_split()
    assert corpus_split() == (calib, held)
    distinct = set(corpus_lines())
    assert set(calib).isdisjoint(held) and set(calib) | set(held) == distinct
    assert len(calib) + len(held) == len(distinct) and len(held) == round(0.2 * len(distinct))
    assert corpus_split(seed=1)[1] != held


@pytest.fixture(scope="session")
def smollm2_tp3(smollm2_hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-tp3") / "ckpt"
    return convert_model(resolve_model(str(smollm2_hf_dir)), out, dtype="float32", tp=3, progress=False).path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(smollm2_hf_dir)


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                "Once upon a time, in a small village by the sea,", "Water boils at"]


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_hf):
    """Prompts, transformers logits of the third prompt, and transformers' greedy 32-token continuations."""
    hf, tok = smollm2_hf
    prompts = [tok(p)["input_ids"] for p in SMOL_PROMPTS]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[2]])).logits
    return prompts, logits, [hf_greedy(hf, p, 32) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "tp3"])
def test_smollm2_logits_and_greedy_generation_match_transformers(smollm2_checkpoint, smollm2_tp3, smollm2_reference,
                                                                 layout):
    prompts, want, expected = smollm2_reference
    model = ReferenceModel.load(smollm2_checkpoint if layout == "tp1" else smollm2_tp3)
    assert relative_error(model.forward(torch.tensor([prompts[2]])), want) <= TOL
    assert model.generate(prompts, SamplingConfig(max_new_tokens=32)) == expected
    assert model.generate([prompts[0]], SamplingConfig(max_new_tokens=32)) == expected[:1]


@pytest.mark.slow
def test_eval_cli_compares_checkpoint_with_the_source_model(smollm2_checkpoint, smollm2_hf_dir, tmp_path):
    text = tmp_path / "sample.txt"
    text.write_text("\n".join(corpus_split()[1][:2]) + "\n\n")
    runner = CliRunner()
    ck = runner.invoke(main, ["eval", str(smollm2_checkpoint), "--dataset", str(text), "--json"])
    hf = runner.invoke(main, ["eval", str(smollm2_hf_dir), "--dataset", str(text), "--json"])
    assert ck.exit_code == 0, ck.output
    assert hf.exit_code == 0, hf.output
    a, b = json.loads(ck.stdout), json.loads(hf.stdout)
    assert set(a) == {"perplexity", "tokens"} and a["tokens"] == b["tokens"] > 100
    assert math.isclose(a["perplexity"], b["perplexity"], rel_tol=1e-4)
    assert 1.0 < a["perplexity"] < 200.0


def test_eval_cli_reports_bad_input_in_one_line(checkpoint, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(main, ["eval", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "Traceback" not in missing.output
    no_tok = runner.invoke(main, ["eval", str(checkpoint("gqa")), "--dataset", __file__])
    assert no_tok.exit_code == 2 and "--tokenizer" in no_tok.output
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    bad = runner.invoke(main, ["eval", str(checkpoint("gqa")), "--dataset", str(empty)])
    assert bad.exit_code == 2 and "no text" in bad.output
    no_ranks = tmp_path / "no-ranks"
    no_ranks.mkdir()
    shutil.copy(checkpoint("gqa") / "config.json", no_ranks / "config.json")
    missing_ranks = runner.invoke(main, ["eval", str(no_ranks), "--tokenizer", str(tmp_path)])
    assert missing_ranks.exit_code == 2 and "missing rank0.safetensors" in missing_ranks.output
    unknown = runner.invoke(main, ["eval", str(checkpoint("gqa")), "--dataset", "no-such-dataset-anywhere"])
    assert unknown.exit_code == 2 and "could not be loaded offline" in unknown.output


def test_a_nan_weight_is_refused_by_name_by_calibrate_and_the_runtime(tiny_llama, tmp_path):
    """NaN/inf weights converted and calibrated with exit 0 and "perplexity float nan" (issue 25 case 2)."""
    from click.testing import CliRunner
    from support.models import save_word_tokenizer
    from safetensors.torch import load_file, save_file

    from pipeline.cli import main
    from pipeline.convert import convert_model
    from pipeline.errors import UserError
    from pipeline.sources import resolve_model

    ckpt = convert_model(resolve_model(str(tiny_llama("gqa"))), tmp_path / "ckpt", dtype="float32",
                         progress=False).path
    (ckpt / "tokenizer").mkdir(exist_ok=True)
    save_word_tokenizer(ckpt / "tokenizer")
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    tensors["transformer.layers.2.mlp.fc.weight"][3, 5] = float("nan")
    save_file(tensors, str(ckpt / "rank0.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"transformer\.layers\.2\.mlp\.fc\.weight holds 1 NaN or infinite"):
        ReferenceModel.load(ckpt)
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", "fp8", "--samples", "2", "--seq-len",
                                       "16", "--eval-samples", "0", "--quiet", "-o", str(tmp_path / "fp8")])
    assert result.exit_code == 2 and "transformer.layers.2.mlp.fc.weight holds 1 NaN" in result.output, result.output
    assert not (tmp_path / "fp8").exists()


def test_eval_json_writes_an_overflowed_perplexity_as_null():
    """`eval --json` printed NaN, which no JSON parser reads (issue 25, unclear cases)."""
    import json

    from pipeline.evaluate import EvalResult

    for value in (float("nan"), float("inf")):
        text = json.dumps(EvalResult(value, 10, "m", "checkpoint", "d", 0.1).to_dict(), allow_nan=False)
        assert json.loads(text) == {"perplexity": None, "tokens": 10}
