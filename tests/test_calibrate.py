"""The calibrate stage end to end: recipes, checkpoint layout (modelopt 0.37 export), reports, bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe
from pipeline.calibrate.data import recipe_names
from pipeline.calibrate.smoothquant import smoothing_vector
from pipeline.calibrate.trtcache import read_calibration_cache
from pipeline.cli import main
from pipeline.errors import UserError

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


def run_calibrate(ckpt: Path, out: Path, precision: str, data: Path, **kw):
    recipe = resolve_recipe(str(data), samples=kw.pop("samples", 6), seq_len=kw.pop("seq_len", 48),
                            seed=kw.pop("seed", None))
    return calibrate_checkpoint(ckpt, out, CalibrateOptions(precision, recipe, eval_samples=kw.pop("eval_samples", 0),
                                                            progress=False, **kw))


def tensors(directory: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    with safe_open(directory / f"rank{rank}.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="session")
def fp8_out(tiny_ckpt, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "ckpt-fp8"
    return run_calibrate(tiny_ckpt, out, "fp8", text_file, kv_cache="fp8", method="entropy")


@pytest.fixture(scope="session")
def sq_out(tiny_ckpt, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("sq") / "ckpt-sq"
    return run_calibrate(tiny_ckpt, out, "int8-sq", text_file, kv_cache="int8", alpha=0.6, weight_rounding="nearest")


def report(out: Path) -> dict:
    return json.loads((out / "calibration" / "report.json").read_text())


def test_fp8_checkpoint_has_modelopts_layout_and_scales(fp8_out, tiny_ckpt):
    out = fp8_out.path
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    q, f = tensors(out), tensors(tiny_ckpt)
    amax = {t["name"]: t["chosen_amax"] for t in report(out)["tensors"]}
    for layer in range(4):
        p = f"transformer.layers.{layer}."
        for lin in LINEARS:
            w, wsf = q[p + lin + ".weight"], q[p + lin + ".weights_scaling_factor"]
            assert w.dtype == torch.float8_e4m3fn and w.shape == f[p + lin + ".weight"].shape
            assert wsf.dtype == torch.float32 and wsf.shape == (1,)
            act = q[p + lin + ".activation_scaling_factor"]
            source = p + ("mlp.fc" if lin == "mlp.gate" else lin)
            assert act.shape == (1,) and act.item() == pytest.approx(amax[source] / 448, rel=1e-6)
            original, restored = f[p + lin + ".weight"], w.float() * wsf
            # GPTQ: the first input column is rounded to nearest, the rest absorb earlier columns' errors
            assert torch.allclose(restored[:, 0], original[:, 0], rtol=0.07, atol=wsf.item() * 2 ** -9)
            assert (restored - original).norm() < 0.1 * original.norm()
        fc_amax = max(f[p + "mlp.fc.weight"].abs().max(), f[p + "mlp.gate.weight"].abs().max())
        assert q[p + "mlp.fc.weights_scaling_factor"].item() == pytest.approx(float(fc_amax) / 448, rel=1e-6)
        assert torch.equal(q[p + "mlp.fc.weights_scaling_factor"], q[p + "mlp.gate.weights_scaling_factor"])
        assert q[p + "attention.qkv.weights_scaling_factor"].item() == pytest.approx(
            float(f[p + "attention.qkv.weight"].abs().max()) / 448, rel=1e-6)
        k, v, kv = (q[p + f"attention.{n}_cache_scaling_factor"].item() for n in ("k", "v", "kv"))
        assert kv == max(k, v) and k == pytest.approx(max(amax[p + "attention.k"] / 448, 1.0))
    assert q["lm_head.weight"].dtype == torch.float32 and torch.equal(q["lm_head.weight"], f["lm_head.weight"])
    assert torch.equal(q["transformer.vocab_embedding.weight"], f["transformer.vocab_embedding.weight"])


def test_int8_sq_checkpoint_has_modelopts_layout_and_reconstructs_the_weights(sq_out, tiny_ckpt):
    out = sq_out.path
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert config["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert config["quantization"]["smoothquant_val"] == 0.6
    q, f = tensors(out), tensors(tiny_ckpt)
    amax = {t["name"]: t["chosen_amax"] for t in report(out)["tensors"]}
    for layer in range(4):
        p = f"transformer.layers.{layer}."
        for lin in LINEARS:
            w, wsf, pqs = (q[p + lin + s] for s in (".weight", ".weights_scaling_factor", ".prequant_scaling_factor"))
            original = f[p + lin + ".weight"]
            assert w.dtype == torch.int8 and w.shape == original.shape
            assert wsf.shape == (original.shape[0],) and wsf.dtype == torch.float32
            assert pqs.shape == (original.shape[1],) and bool((pqs > 0).all())
            smoothed = original / pqs[None, :]
            assert torch.allclose(wsf, smoothed.abs().amax(dim=1) / 127, rtol=1e-6)
            restored = w.float() * wsf[:, None] * pqs[None, :]
            assert torch.allclose(restored, original, atol=float((wsf[:, None] * pqs[None, :]).max()) * 0.51)
            source = p + ("mlp.fc" if lin == "mlp.gate" else lin)
            assert q[p + lin + ".activation_scaling_factor"].item() == pytest.approx(amax[source] / 127, rel=1e-6)
        assert torch.equal(q[p + "mlp.fc.prequant_scaling_factor"], q[p + "mlp.gate.prequant_scaling_factor"])
        assert q[p + "attention.kv_cache_scaling_factor"].item() == pytest.approx(
            max(amax[p + "attention.k"], amax[p + "attention.v"]) / 127, rel=1e-6)


def test_smoothquant_vector_follows_modelopts_formula():
    act = torch.tensor([4.0, 0.0, 1e-10, 100.0])
    weight = torch.tensor([1.0, 2.0, 3.0, 1e-30])
    s = smoothing_vector(act, weight, 0.5)
    assert s[0] == pytest.approx(1.0 / 2.0)          # sqrt(1) / sqrt(4)
    assert s[1] == 1.0 and s[2] == 1.0                 # channels that never fire are left alone
    assert s[3] == pytest.approx(1e-4)                 # clamped like modelopt
    assert torch.allclose(smoothing_vector(act[:1], weight[:1], 1.0), torch.tensor([0.25]))


def test_quantized_checkpoints_run_close_to_the_float_model(fp8_out, sq_out, tiny_ckpt):
    from pipeline.runtime import ReferenceModel

    ids = torch.tensor([[1, 200, 3000, 45, 812, 9, 17, 4000]])
    ref = ReferenceModel.load(tiny_ckpt).forward(ids)
    for result in (fp8_out, sq_out):
        logits = ReferenceModel.load(result.path).forward(ids)
        rel = (logits - ref).norm() / ref.norm()
        assert rel < 0.1, f"{result.path.name}: relative logits error {rel:.3f}"
        assert rel > 0, "quantization must change something"


def test_report_cache_plots_and_manifest(fp8_out):
    out = fp8_out.path
    rep = report(out)
    assert rep["method"] == "entropy" and rep["precision"] == "fp8" and rep["samples"] == 6
    names = {t["name"] for t in rep["tensors"]}
    assert "transformer.layers.0.attention.qkv" in names and "transformer.layers.3.attention.v" in names
    assert "transformer.layers.0.mlp.gate" not in names           # shares mlp.fc's input
    for t in rep["tensors"]:
        assert set(t["amax"]) == {"max", "percentile", "mse", "entropy"}
        assert t["amax"]["max"] == pytest.approx(t["running_max"])
        assert 0 < t["chosen_amax"] <= t["running_max"] * (1 + 1e-6)
        assert 0.0 <= t["saturation"] < 0.5 and t["snr_db"] > 0
    cache = read_calibration_cache(out / "calibration" / "calibration.cache")
    first = (out / "calibration" / "calibration.cache").read_text().splitlines()[0]
    assert first == "TRT-101401-EntropyCalibration2"
    for t in rep["tensors"]:
        if t["kind"] == "activation":
            assert cache[t["name"]] == pytest.approx(t["chosen_amax"], rel=1e-6)
    png = (out / "calibration" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "calibrate" and manifest["params"]["method"] == "entropy"
    assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_same_recipe_gives_identical_checkpoints(tiny_ckpt, text_file, tmp_path):
    digests = []
    for name in ("a", "b"):
        run_calibrate(tiny_ckpt, tmp_path / name, "fp8", text_file, method="percentile", seed=3)
        digests.append(hashlib.sha256((tmp_path / name / "rank0.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    again = run_calibrate(tiny_ckpt, tmp_path / "a", "fp8", text_file, method="percentile", seed=3)
    assert again.skipped


def test_sharded_checkpoints_quantize_like_the_unsharded_one(tiny_hf, text_file, tmp_path, fp8_out):
    """tp=2 / pp=2 layouts get the same scales, so the quantized models compute the same logits."""
    from pipeline.convert import convert_model
    from pipeline.runtime import ReferenceModel
    from pipeline.sources import resolve_model

    ids = torch.tensor([[5, 300, 2000, 45, 9]])
    single = ReferenceModel.load(fp8_out.path).forward(ids)
    for tp, pp in ((2, 1), (1, 2)):
        ck = convert_model(resolve_model(str(tiny_hf)), tmp_path / f"ck{tp}{pp}", dtype="float32", tp=tp, pp=pp,
                           progress=False).path
        out = tmp_path / f"q{tp}{pp}"
        run_calibrate(ck, out, "fp8", text_file, kv_cache="fp8", method="entropy")
        config = json.loads((out / "config.json").read_text())
        assert config["mapping"]["world_size"] == 2 and len(list(out.glob("rank*.safetensors"))) == 2
        logits = ReferenceModel.load(out).forward(ids)
        assert torch.allclose(logits, single, atol=1e-3, rtol=1e-3), f"tp={tp} pp={pp}"


def test_statistics_live_for_one_layer_and_gptq_differs_from_nearest(tiny_ckpt, text_file, tmp_path, monkeypatch):
    """Each layer's statistics are complete (every sample seen) when its weights are rounded, then dropped."""
    from pipeline.calibrate import collect

    held = []
    real_finish = collect.LayerCalibrator.finish

    def finish(self, layer):
        held.append((sorted({name.split(".")[2] for name in self._layer.histograms}),
                     {h.tokens for h in self._layer.hessians.values()}))
        real_finish(self, layer)
        assert self._layer is None

    monkeypatch.setattr(collect.LayerCalibrator, "finish", finish)
    gptq = run_calibrate(tiny_ckpt, tmp_path / "gptq", "int8-sq", text_file)
    tokens = {gptq.tokens}
    assert held == [([str(i)], tokens) for i in range(4)]       # 4 layers, x^T x of every token
    nearest = tensors(run_calibrate(tiny_ckpt, tmp_path / "nearest", "int8-sq", text_file,
                                    weight_rounding="nearest").path)
    a = tensors(gptq.path)
    assert not torch.equal(nearest["transformer.layers.1.mlp.proj.weight"], a["transformer.layers.1.mlp.proj.weight"])


def test_default_recipe_uses_the_offline_corpus_split():
    from pipeline.calibrate.data import load_texts
    from pipeline.evaluate import corpus_split

    recipe = resolve_recipe(None)
    assert (recipe.name, recipe.samples, recipe.seq_len, recipe.seed) == ("news", 64, 256, 0)
    texts = load_texts(recipe)
    calibration, heldout = corpus_split(seed=0)
    assert texts == calibration and not set(texts) & set(heldout)
    assert {"news", "cnn_dailymail"} <= set(recipe_names())
    cnn = resolve_recipe("cnn_dailymail", samples=8)
    assert (cnn.dataset, cnn.field, cnn.config, cnn.samples) == ("abisee/cnn_dailymail", "article", "3.0.0", 8)


def test_local_jsonl_and_parquet_with_a_text_field(tmp_path, tiny_ckpt):
    import datasets

    rows = [{"body": f"Line number {i} of a local calibration file about trains.", "id": i} for i in range(12)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    from pipeline.calibrate.data import load_texts, load_tokenizer, tokenize_samples

    for path in (jsonl, parquet):
        recipe = resolve_recipe(str(path), text_field="body", samples=5, seq_len=4)
        texts = load_texts(recipe)
        assert texts == [r["body"] for r in rows]
        samples = tokenize_samples(texts, load_tokenizer(tiny_ckpt), recipe)
        assert len(samples) == 5 and all(2 <= len(s) <= 4 for s in samples)


def cli(*args):
    return CliRunner().invoke(main, ["calibrate", *map(str, args)])


@pytest.mark.parametrize("case", ["empty", "field", "quantized", "kv-without-attention", "too-long", "not-cached",
                                  "no-checkpoint", "damp"])
def test_bad_input_exits_2_and_writes_nothing(case, tiny_ckpt, fp8_out, text_file, tmp_path):
    out = tmp_path / "out"
    args = [tiny_ckpt, "-o", out, "--precision", "fp8", "--samples", "2", "--seq-len", "16", "--eval-samples", "0"]
    expect = {"empty": "has no text", "field": "has no field 'missing'", "quantized": "already quantized",
              "kv-without-attention": "needs a quantized attention path", "too-long": "longer than the model's context",
              "not-cached": "not in the local datasets cache", "no-checkpoint": "no config.json",
              "damp": "--damp must be positive"}[case]
    if case == "empty":
        empty = tmp_path / "empty.txt"
        empty.write_text("\n  \n")
        args += ["--dataset", empty]
    elif case == "field":
        data = tmp_path / "d.jsonl"
        data.write_text('{"text": "a b c d e f"}\n')
        args += ["--dataset", data, "--text-field", "missing"]
    elif case == "quantized":
        args[0] = fp8_out.path
        args += ["--dataset", text_file]
    elif case == "kv-without-attention":
        args += ["--dataset", text_file, "--kv-cache", "fp8", "--exclude", "*.attention.qkv"]
    elif case == "too-long":
        args[args.index("--seq-len") + 1] = "4096"
        args += ["--dataset", text_file]
    elif case == "not-cached":
        args += ["--dataset", "nobody-has/this-dataset-xyz"]
    elif case == "no-checkpoint":
        args[0] = tmp_path
        args += ["--dataset", text_file]
    elif case == "damp":
        args += ["--dataset", text_file, "--damp", "0"]
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert expect in result.output and "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_excluded_modules_stay_float(tiny_ckpt, text_file, tmp_path):
    result = run_calibrate(tiny_ckpt, tmp_path / "q", "fp8", text_file, exclude=("transformer.layers.0.mlp.proj",))
    q, f = tensors(result.path), tensors(tiny_ckpt)
    assert torch.equal(q["transformer.layers.0.mlp.proj.weight"], f["transformer.layers.0.mlp.proj.weight"])
    assert "transformer.layers.0.mlp.proj.weights_scaling_factor" not in q
    assert q["transformer.layers.1.mlp.proj.weight"].dtype == torch.float8_e4m3fn
    assert result.config["quantization"]["exclude_modules"] == ["lm_head", "transformer.layers.0.mlp.proj"]


def test_cli_prints_a_summary_and_json(tiny_ckpt, text_file, tmp_path):
    out = tmp_path / "q"
    result = cli(tiny_ckpt, "-o", out, "--precision", "int8-sq", "--dataset", text_file, "--samples", "3",
                 "--seq-len", "24", "--eval-samples", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["method"] == "max" and data["samples"] == 3
    assert data["perplexity"]["quantized"] > 0 and data["perplexity"]["float"] > 0
    defaults = report(out)                       # options left out take the stage's measured defaults
    assert (defaults["alpha"], defaults["weight_rounding"], defaults["damp"]) == (0.8, "gptq", 0.3)
    text = cli(tiny_ckpt, "-o", tmp_path / "q2", "--precision", "fp8", "--dataset", text_file, "--samples", "2",
               "--seq-len", "16", "--eval-samples", "0", "--quiet")
    assert text.exit_code == 0 and "SNR dB" in text.output and "FP8" in text.output


def test_recipe_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="neither a recipe"):
        resolve_recipe("not-a-recipe")
    with pytest.raises(UserError, match="--samples"):
        resolve_recipe(None, samples=0)
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"0")
    with pytest.raises(UserError, match="expected a text"):
        resolve_recipe(str(bad))


@pytest.mark.slow
def test_smollm2_fp8_and_int8_sq_keep_perplexity(smollm2_checkpoint, tmp_path):
    """The real model through the CLI defaults: small calibration, held-out perplexity in the report."""
    # Sanity bounds for this tiny calibration (8 x 128 tokens, INT8/FP8 KV too, 6 documents): a wrong scale
    # or layout sends perplexity into the hundreds. Measured here with the defaults (GPTQ, alpha 0.8):
    # fp8 +2.4%, int8-sq +7.1% (alpha 0.5 with nearest rounding gave +17.8%). The goals at 64 x 256 are
    # measured by benchmarks/measure_calibration_quality.py (docs/calibrate.md), not asserted.
    for precision, kv, limit in (("fp8", "fp8", 1.06), ("int8-sq", "int8", 1.15)):
        out = tmp_path / precision
        result = cli(smollm2_checkpoint, "-o", out, "--precision", precision, "--kv-cache", kv, "--samples", "8",
                     "--seq-len", "128", "--eval-samples", "6", "--quiet")
        assert result.exit_code == 0, result.output
        ppl = report(out)["perplexity"]
        assert 1.0 < ppl["float"] < 100 and ppl["tokens"] > 1000
        assert ppl["ratio"] < limit, f"{precision}: perplexity {ppl['float']:.2f} -> {ppl['quantized']:.2f}"


@pytest.mark.parametrize("name, content, says", [
    ("bad.jsonl", '{"text": "a b"\n{not json}\n', "as json data: "),
    ("binary.jsonl", "\x00\xff\xfe garbage", "as json data: "),
])
def test_an_unreadable_local_dataset_says_what_is_wrong_with_it(tmp_path, name, content, says):
    """issue 25: only "DatasetGenerationError" (datasets' wrapper, which says nothing of the file) was reported."""
    from pipeline.calibrate.data import load_texts

    path = tmp_path / name
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(UserError, match=says) as raised:
        load_texts(resolve_recipe(str(path)))
    assert "DatasetGenerationError" not in str(raised.value) and "An error occurred while generating" not in \
        str(raised.value)


def test_calibrating_on_a_handful_of_tokens_warns(tiny_ckpt, tmp_path):
    """issue 25: a dataset of 1-2-token lines calibrated on 4 tokens without a word."""
    from pipeline.calibrate.stage import MIN_CALIBRATION_TOKENS, few_tokens_warning

    data = tmp_path / "short.txt"
    data.write_text("\n".join(" w5 w6" for _ in range(8)))
    result = cli(tiny_ckpt, "-o", tmp_path / "out", "--precision", "fp8", "--samples", "2", "--eval-samples", "0",
                 "--seq-len", "16", "--dataset", data)
    assert result.exit_code == 0, result.output
    assert "warning: calibrated on" in result.output and "too few values" in result.output
    assert few_tokens_warning(64, MIN_CALIBRATION_TOKENS) == ()
