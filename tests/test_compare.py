"""trtpipe compare: the quality figures against hand-computed ones, thresholds, refusals (exit 2, nothing
written), and end to end on the fp16 and fp8 SmolLM2 cpu builds served by real Triton servers, every figure
of the report recomputed here another way."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.compare.quality import generation_figures
from pipeline.compare.verdict import Thresholds, judge


def word_tokenizer(directory: Path, vocab: int = 101):
    """A whitespace word-level tokenizer of "w0".."w{vocab-1}", saved and loaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w1", "pad_token": "w0"}))
    return AutoTokenizer.from_pretrained(directory)


# ------------------------------------------------------------------ the figures, by hand


def rouge_l_by_hand(target: str, prediction: str) -> float:
    """rouge-score's default tokenization (lowercase, non-alphanumerics are separators), LCS F-measure."""
    t, p = (re.sub(r"[^a-z0-9]+", " ", s.lower()).split() for s in (target, prediction))
    table = [[0] * (len(p) + 1) for _ in range(len(t) + 1)]
    for i, x in enumerate(t):
        for j, y in enumerate(p):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    lcs = table[-1][-1]
    if not lcs:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(t)
    return 2 * precision * recall / (precision + recall)


def bleu_by_hand(references: list[str], hypotheses: list[str]) -> float:
    """Corpus BLEU (Papineni et al.) with sacrebleu's exponential smoothing of zero n-gram matches, over
    sacrebleu's 13a tokens (its tokenizer is the only part taken from it)."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tok = Tokenizer13a()
    correct, total, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for ref, hyp in zip(references, hypotheses):
        r, h = tok(ref).split(), tok(hyp).split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hc = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rc = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            correct[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    if hyp_len == 0 or 0 in total:
        return 0.0
    logs, smooth = [], 1.0
    for c, t in zip(correct, total):
        if c == 0:
            smooth *= 2
            logs.append(math.log(1 / (smooth * t)))
        else:
            logs.append(math.log(c / t))
    brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * math.exp(sum(logs) / 4)


def prefix_agreement(tokenizer, a: str, b: str) -> float:
    ids_a, ids_b = (tokenizer(x, add_special_tokens=False)["input_ids"] for x in (a, b))
    same = 0
    while same < min(len(ids_a), len(ids_b)) and ids_a[same] == ids_b[same]:
        same += 1
    return same / len(ids_a) if ids_a else float(not ids_b)


def test_generation_figures_equal_hand_computed_values(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    a = ["w3 w4 w5 w6", "w7 w8", "w9 w10 w11"]
    b = ["w3 w4 w12 w6", "w7 w8", "w13 w10 w11 w14"]
    got = generation_figures(tok, a, b)
    # prefixes: 2 of 4, 2 of 2, 0 of 3; LCS: 3 of 4|4, 2 of 2|2, 2 of 3|4
    assert got.token_agreement == pytest.approx((2 / 4 + 1 + 0) / 3)
    assert got.rouge_l == pytest.approx((0.75 + 1 + 2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3)) / 3)
    assert got.exact_match == pytest.approx(1 / 3)
    assert got.bleu == pytest.approx(bleu_by_hand(a, b))
    # the hand BLEU itself: unigrams 7/10, bigrams 3/7, trigrams 0/4 (smoothed 1/(2*4)), 4-grams 0/2
    # (smoothed 1/(4*2)); 10 hypothesis tokens against 9, so no brevity penalty
    assert bleu_by_hand(a, b) == pytest.approx(100 * math.exp((math.log(0.7) + math.log(3 / 7) + 2 * math.log(1 / 8))
                                                              / 4))
    assert got.prompts == 3


def test_identical_completions_score_perfectly(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    texts = ["w3 w4 w5 w6 w7", "w8 w9 w10 w11"]
    got = generation_figures(tok, texts, texts)
    assert (got.token_agreement, got.rouge_l, got.exact_match) == (1.0, 1.0, 1.0)
    assert got.bleu == pytest.approx(100.0)


def test_thresholds_judge_each_way_and_the_boundary_passes():
    figures = {"perplexity_increase_pct": 2.0, "rouge_l": 0.8, "bleu": 40.0, "token_agreement": 0.9,
               "exact_match": 0.5}
    results = {r.name: r.passed for r in judge(Thresholds(max_ppl_increase=2.0, min_rouge_l=0.85, min_bleu=30,
                                                          min_exact_match=0.5), figures)}
    assert results == {"max_ppl_increase": True, "min_rouge_l": False, "min_bleu": True, "min_exact_match": True}
    assert not judge(Thresholds(max_ppl_increase=1.99), figures)[0].passed
    assert judge(Thresholds(), figures) == []


# ------------------------------------------------------------------ refusals: exit 2, nothing written


def fake_build(directory: Path, *, vocab: int = 101, hidden: int = 48) -> Path:
    """A build directory with everything compare reads before serving (no runnable model)."""
    model = {"architecture": "LlamaForCausalLM", "vocab_size": 101, "hidden_size": hidden, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_size": 12}
    memory = {"memory_bytes": 2**30, "weights_bytes_per_rank": 10, "activation_bytes": 0,
              "runtime_reserve_bytes": 1, "kv_cache_bytes": 5}
    (directory / "model_repo" / "ensemble").mkdir(parents=True)
    (directory / "model_repo" / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')
    (directory / "checkpoint").mkdir()
    (directory / "checkpoint" / "rank0.safetensors").write_bytes(b"")
    word_tokenizer(directory / "checkpoint" / "tokenizer", vocab)
    (directory / "plan.json").write_text(json.dumps({"model": model, "precision": "fp16", "memory": memory,
                                                     "weights_bytes": 10, "target": {"name": "cpu"}}))
    (directory / "build.json").write_text("{}")
    return directory


@pytest.mark.parametrize("b_kwargs, args, message", [
    ({"vocab": 102}, [], "tokenizer"),
    ({"hidden": 64}, [], "hidden_size: 48 vs 64"),
    ({}, ["--min-throughput-speedup", "1.2"], "needs --load-test"),
    ({}, ["--max-ppl-increase", "two"], "percentage"),
    ({}, ["--min-rouge-l", "85"], "from 0 to 1"),
    ({}, ["--prompts", "nonexistent.txt"], "neither a file nor a recipe"),
])
def test_bad_input_exits_2_with_one_message_and_writes_nothing(tmp_path, b_kwargs, args, message):
    a, b = fake_build(tmp_path / "a"), fake_build(tmp_path / "b", **b_kwargs)
    result = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_directory_that_is_not_a_build_is_named(tmp_path):
    a = fake_build(tmp_path / "a")
    (tmp_path / "b").mkdir()
    result = CliRunner().invoke(main, ["compare", str(a), str(tmp_path / "b"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "build B" in result.output and "build.json" in result.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ end to end: fp16 vs fp8 SmolLM2, real servers


@pytest.fixture(scope="module")
def smollm2_builds(tmp_path_factory) -> dict[str, Path]:
    """The fp16 and fp8 SmolLM2 cpu builds (everything but their own validation, which compare does not read)."""
    from pipeline.build import BuildOptions, build

    root = tmp_path_factory.mktemp("ab")
    for precision in ("fp16", "fp8"):
        build(BuildOptions("smollm2-135m", "cpu", precision, root / precision, dry_run=True, calibration_samples=16,
                           progress=False), say=lambda m: None)
    return {p: root / p for p in ("fp16", "fp8")}


def perplexity_by_hand(checkpoint: Path, samples: int) -> float:
    """The whole model (ReferenceModel, not the layer stream compare uses), 512-token windows from position 0."""
    from transformers import AutoTokenizer

    from pipeline.evaluate import corpus_split
    from pipeline.runtime import ReferenceModel

    model, tok = ReferenceModel.load(checkpoint), AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    nll, count = 0.0, 0
    for text in corpus_split()[1][:samples]:
        ids = tok(text)["input_ids"]
        for start in range(0, len(ids), 512):
            window = torch.tensor([ids[start:start + 512]])
            if window.shape[1] < 2:
                continue
            with torch.inference_mode():
                logits = model.forward(window)[0, :-1].float()
            nll += float(F.cross_entropy(logits, window[0, 1:], reduction="sum"))
            count += window.shape[1] - 1
    return math.exp(nll / count)


@pytest.mark.slow
def test_fp16_vs_fp8_smollm2_end_to_end(smollm2_builds, tmp_path):
    from transformers import AutoTokenizer

    a, b, out = smollm2_builds["fp16"], smollm2_builds["fp8"], tmp_path / "report"
    result = CliRunner().invoke(main, [
        "compare", str(a), str(b), "-o", str(out), "--num-prompts", "6", "--max-tokens", "16", "--eval-samples", "3",
        "--load-test", "--concurrency", "2", "--requests-per-client", "2",
        "--max-ppl-increase", "-50%", "--min-bleu", "0", "--max-p99-latency-increase", "1000000%"])
    assert result.exit_code == 1, result.output          # B cannot halve A's perplexity
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["verdict"] == "B fails max_ppl_increase"
    assert {t["name"]: t["passed"] for t in report["thresholds"]} == {
        "max_ppl_increase": False, "min_bleu": True, "max_p99_latency_increase": True}
    ra, rb = report["builds"]["A"], report["builds"]["B"]
    assert (ra["checkpoint"], rb["checkpoint"]) == ("checkpoint", "checkpoint-fp8")

    # perplexity: the whole model in memory, scored here
    ppl_a, ppl_b = perplexity_by_hand(a / "checkpoint", 3), perplexity_by_hand(b / "checkpoint-fp8", 3)
    assert ra["perplexity"]["perplexity"] == pytest.approx(ppl_a, rel=1e-4)
    assert rb["perplexity"]["perplexity"] == pytest.approx(ppl_b, rel=1e-4)
    assert report["changes"]["perplexity_increase_pct"] == pytest.approx((ppl_b / ppl_a - 1) * 100, abs=1e-2)
    assert ppl_b != ppl_a

    # A's completions are the fp16 checkpoint's greedy ones (the servers really served the builds)
    from pipeline.runtime import ReferenceModel, SamplingConfig

    tok = AutoTokenizer.from_pretrained(a / "checkpoint" / "tokenizer")
    prompts = [c["prompt"] for c in report["completions"]]
    assert len(prompts) == 6 == report["prompts"]["count"]
    model, greedy = ReferenceModel.load(a / "checkpoint"), SamplingConfig(max_new_tokens=16, end_id=tok.eos_token_id)
    expected = [tok.decode(model.generate([tok(p)["input_ids"]], greedy)[0], skip_special_tokens=True)
                for p in prompts]       # one request at a time, as compare sends them
    assert [c["a"] for c in report["completions"]] == expected

    # generation figures from the completions, by hand
    texts_a, texts_b = [c["a"] for c in report["completions"]], [c["b"] for c in report["completions"]]
    g = report["generation"]
    assert g["token_agreement"] == pytest.approx(sum(prefix_agreement(tok, x, y) for x, y in zip(texts_a, texts_b))
                                                 / 6)
    assert g["rouge_l"] == pytest.approx(sum(rouge_l_by_hand(x, y) for x, y in zip(texts_a, texts_b)) / 6)
    assert g["bleu"] == pytest.approx(bleu_by_hand(texts_a, texts_b))
    assert g["exact_match"] == pytest.approx(sum(x == y for x, y in zip(texts_a, texts_b)) / 6)

    # memory from each plan.json
    for side, build in (("A", a), ("B", b)):
        plan = json.loads((build / "plan.json").read_text())
        m = report["builds"][side]["memory"]
        assert m["weights_bytes"] == plan["weights_bytes"]
        assert m["planned_bytes_per_instance"] == sum(plan["memory"][k] for k in (
            "weights_bytes_per_rank", "activation_bytes", "runtime_reserve_bytes", "kv_cache_bytes"))
    assert report["changes"]["weights_saving"] == pytest.approx(ra["memory"]["weights_bytes"]
                                                                / rb["memory"]["weights_bytes"])

    # the load test: same load on both, figures consistent with their own counts
    for load in (ra["load"], rb["load"]):
        assert (load["concurrency"], load["requests"], load["completed"], load["shed"], load["failed"]) == (
            2, 4, 4, 0, 0)
        assert load["output_tokens_per_s"] == pytest.approx(load["output_tokens"] / load["wall_s"])
        assert load["ttft_ms"]["p50"] <= load["ttft_ms"]["p90"] <= load["ttft_ms"]["p99"] <= load["latency_ms"]["p99"]
    assert report["changes"]["throughput_speedup"] == pytest.approx(rb["load"]["output_tokens_per_s"]
                                                                    / ra["load"]["output_tokens_per_s"])
    assert report["changes"]["ttft_p99_speedup"] == pytest.approx(ra["load"]["ttft_ms"]["p99"]
                                                                  / rb["load"]["ttft_ms"]["p99"])

    markdown = (out / "report.md").read_text()
    assert "**Verdict: B fails max_ppl_increase**" in markdown
    assert f"| held-out perplexity | {ra['perplexity']['perplexity']:.4f} | {rb['perplexity']['perplexity']:.4f} |" \
        in markdown
    from PIL import Image

    assert Image.open(out / "report.png").size == (1200, 450)


# ------------------------------------------------------------------ instance density (the planner)


def test_llama3_8b_density_on_the_4090_matches_hand_computed_values(no_aic):
    """Each of N instances is planned with 24 GiB / N and its own 1 GiB CUDA context reserve (trtpipe's own memory
    model: aiconfigurator-core's 3.5 GiB of other memory per instance fits fp8 once, tested below)."""
    from pipeline.plan import resolve_model_info
    from pipeline.planner import densities, plan_instances
    from pipeline.targets import get_target

    gib, model, gpu = 2**30, resolve_model_info("llama-3-8b"), get_target("rtx4090")
    h, inter, layers, vocab = 4096, 14336, 32, 128256
    # fp8: five linears per layer (qkv, dense, fc, gate, proj) at 1 byte plus two float32 scales each, two
    # fp16 norms; embedding and lm_head (untied, not quantized) and ln_f in fp16
    linears = h * (h + 2 * 1024) + h * h + 3 * h * inter
    fp8_weights = layers * (linears + 5 * 8 + 2 * h * 2) + 2 * vocab * h * 2 + h * 2
    fp16_weights = layers * (linears * 2 + 2 * h * 2) + 2 * vocab * h * 2 + h * 2
    assert fp8_weights == 9_081_201_920 and fp8_weights / gib == pytest.approx(8.4575, abs=1e-4)
    # int4-awq: two codes a byte, a float32 scale per 128 inputs of every row, AWQ's bf16 smoother per input
    shapes = [(h, h + 2 * 1024), (h, h), (h, inter), (h, inter), (inter, h)]   # (in, out) of each linear
    int4_weights = layers * (sum(i * o // 2 + o * (i // 128) * 4 + i * 2 for i, o in shapes) + 2 * h * 2) \
        + 2 * vocab * h * 2 + h * 2
    assert plan_instances(model, gpu, "int4-awq", 3).memory.weights_bytes_per_rank == int4_weights == 5_811_609_600
    # fp16 fits once (14.96 GiB > 12 GiB for two); fp8 and int8-sq twice (8.46 GiB > 8 GiB for three); int4-awq three
    # times (5.41 GiB + the 1 GiB reserve and activations > 6 GiB for four)
    got = {d.precision: d.max_instances for d in densities(model, gpu)}
    assert got == {"fp16": 1, "bf16": 1, "fp32": 0, "fp8": 2, "int8-sq": 2, "int4-awq": 3}
    half = (24564 << 20) // 2   # of the 24564 MiB the card reports
    assert fp16_weights > half and (24564 << 20) / 3 < fp8_weights < half

    two = plan_instances(model, gpu, "fp8", 2)
    m, batch, max_num_tokens, max_seq_len = two.memory, two.triton.triton_max_batch_size, 1024, 8192
    activations = max_num_tokens * (2 * (2 * h + 3 * inter) + h + inter) + batch * vocab * 4
    reserve = gib + batch * (2 * vocab * 4 + 2 * max_seq_len * 4)          # the CUDA context, per instance
    assert (m.memory_bytes, m.weights_bytes_per_rank) == (half, fp8_weights)
    assert (m.activation_bytes, m.runtime_reserve_bytes) == (activations, reserve)
    assert m.free_bytes == half - fp8_weights - activations - reserve
    kv_tokens = int(m.free_bytes * 0.9) // (2 * layers * 8 * 128) // 32 * 32   # fp8 KV, 32-token blocks
    assert m.kv_cache_tokens == kv_tokens and batch == kv_tokens // 1280  # 1024 in + 256 out
    with pytest.raises(UserError, match="3 instances do not fit on one rtx4090"):
        plan_instances(model, gpu, "fp8", 3)


def test_with_aic_two_fp8_instances_do_not_fit_a_4090_and_the_refusal_says_why():
    """aiconfigurator-core counts 3.5 GiB of runtime memory per instance beside the 8.46 GiB of weights: more than the
    11.99 GiB each of two instances gets."""
    from pipeline.plan import resolve_model_info
    from pipeline.planner import densities, plan_instances
    from pipeline.targets import get_target

    model, gpu = resolve_model_info("llama-3-8b"), get_target("rtx4090")
    assert {d.precision: d.max_instances for d in densities(model, gpu)}["fp8"] == 1
    with pytest.raises(UserError, match="2 instances do not fit on one rtx4090 .* aiconfigurator-core's memory"):
        plan_instances(model, gpu, "fp8", 2)


def test_plan_instances_prints_the_per_instance_budget_and_the_largest_n_per_precision(no_aic):
    result = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--instances", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["memory"]["memory_bytes"] == (24564 << 20) // 2
    result = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp8",
                                       "--instances", "2"], terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = dict(re.findall(r"^\s+(fp16|bf16|fp32|fp8|int8-sq)\s+(\d+)", result.output, re.MULTILINE))
    assert rows == {"fp16": "1", "bf16": "1", "fp32": "0", "fp8": "2", "int8-sq": "2"}
    result = CliRunner().invoke(main, ["plan", "llama-3-8b", "--target", "rtx4090", "--precision", "fp16",
                                       "--instances", "2"])
    assert result.exit_code == 2 and "2 instances do not fit on one rtx4090 (each gets 11.99 GiB)" in result.output
