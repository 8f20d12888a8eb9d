"""4-bit calibration (int4-awq = W4A16_AWQ, w4a8-awq = W4A8_AWQ): the search, the checkpoint nvidia-modelopt 0.37's
exporter writes (rewritten bit for bit from its own quantization), the runtime reading it, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe
from pipeline.calibrate import int4, quantized_checkpoint
from pipeline.cli import main
from pipeline.errors import UserError

from support.models import make_tiny_model
from support.modelopt_int4 import ALGOS, dequantized_float_checkpoint, modelopt_int4, tensors, tiny_int4_llama

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
PRECISION = {"W4A16_AWQ": "int4-awq", "W4A8_AWQ": "w4a8-awq"}


def run_calibrate(ckpt: Path, out: Path, precision: str, data: Path, **kw):
    recipe = resolve_recipe(str(data), samples=kw.pop("samples", 6), seq_len=kw.pop("seq_len", 48))
    return calibrate_checkpoint(ckpt, out, CalibrateOptions(precision, recipe, eval_samples=kw.pop("eval_samples", 0),
                                                            progress=False, **kw))


@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory, smollm2_hf_dir) -> Path:
    """A random Llama whose linears take 64-wide groups (hidden 192: 128 does not divide it), SmolLM2's tokenizer."""
    d = make_tiny_model(tmp_path_factory.mktemp("int4-hf"), vocab_size=49152, hidden_size=192, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, d / name)
    return d


@pytest.fixture(scope="module")
def wide_ckpt(wide_hf, tmp_path_factory) -> Path:
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    return convert_model(resolve_model(str(wide_hf)), tmp_path_factory.mktemp("int4-ck") / "ckpt", dtype="float32",
                         progress=False).path


@pytest.fixture(scope="module")
def int4_out(wide_ckpt, text_file, tmp_path_factory):
    return {p: run_calibrate(wide_ckpt, tmp_path_factory.mktemp(p) / "out", p, text_file)
            for p in ("int4-awq", "w4a8-awq")}


# --- the search ---------------------------------------------------------------------------------------------------

def test_awq_smoothing_lowers_the_output_error_of_a_weight_with_outlier_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    x[:, :4] *= 30.0                                  # four channels carry most of the signal
    w = torch.randn(64, 128, generator=g)
    h = x.T @ x / x.shape[0]
    prequant, alpha = int4.awq_smoothing(w, h, 64)
    assert alpha > 0 and prequant.shape == (128,)

    def output_error(p):
        deq = int4.groupwise_nearest(w / p, 64) * p
        return float(((x @ (w - deq).T) ** 2).mean())

    assert output_error(prequant) < 0.7 * output_error(torch.ones(128))


def test_group_scales_search_never_does_worse_than_amax_over_7_and_uses_code_minus_8():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 128, generator=g)
    moments = torch.rand(128, generator=g) + 0.1
    searched = int4.group_scales(w, moments, 64)
    plain = w.reshape(32, 2, 64).abs().amax(dim=2) / 7

    def error(scale):
        s = scale.repeat_interleave(64, dim=1)
        return ((w - int4.int4_codes(w / s) * s) ** 2 * moments).reshape(32, 2, 64).sum(dim=2)

    assert bool((error(searched) <= error(plain) + 1e-7).all())
    assert float(error(searched).sum()) < 0.9 * float(error(plain).sum())
    assert float(int4.int4_codes(w / searched.repeat_interleave(64, dim=1)).min()) == -8


def test_the_default_group_size_is_128_where_it_divides_every_width_else_64_with_a_note():
    assert int4.default_group_size({"a": 256, "b": 512}) == (128, None)
    size, note = int4.default_group_size({"transformer.layers.0.attention.qkv": 576, "b": 512})
    assert size == 64 and "576" in note and "layers.0.attention.qkv" in note
    with pytest.raises(UserError, match=r"does not divide .*'s 48 inputs"):
        int4.default_group_size({"transformer.layers.0.mlp.proj": 48})


# --- the checkpoint, as modelopt 0.37's exporter writes it --------------------------------------------------------

@pytest.fixture(scope="module")
def modelopt_exports(tmp_path_factory):
    """modelopt 0.37's TensorRT-LLM export (float16, group 64) of a tiny model after its own AWQ, tp 1 and 2."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    root = tmp_path_factory.mktemp("modelopt-int4")
    hf = tiny_int4_llama(root / "hf")
    out = {}
    for algo in ALGOS:
        model = modelopt_int4(hf, algo)
        for tp in (1, 2):
            export_tensorrt_llm_checkpoint(model, "llama", torch.float16, root / f"{algo}-tp{tp}",
                                           inference_tensor_parallel=tp)
            out[algo, tp] = root / f"{algo}-tp{tp}"
    return out


def modelopts_choices(exported: Path, float_ckpt) -> dict:
    """What modelopt chose, per global linear: prequant (full width), per-rank group scales, W4A8's two scalars."""
    choices = {"prequant": {}, "scales": {}, "act": {}, "wsf2": {}}
    for rf in float_ckpt.ranks:
        q = tensors(exported, rf.rank)
        for name in q:
            if not name.endswith(".weights_scaling_factor"):
                continue
            local = name[: -len(".weights_scaling_factor")]
            module = float_ckpt.linear_of(rf.global_name(local + ".weight"))
            pqs = q[local + ".prequant_scaling_factor"]
            if float_ckpt.is_row_parallel(module):
                parts = choices["prequant"].setdefault(module, {})
                parts[rf.tp_rank] = pqs
            else:
                choices["prequant"][module] = {0: pqs}
            choices["scales"][module, rf.tp_rank] = q[name]
            if local + ".activation_scaling_factor" in q:
                choices["act"][module] = float(q[local + ".activation_scaling_factor"]) * 448.0
                choices["wsf2"][module, rf.tp_rank] = q[local + ".weights_scaling_factor_2"]
    choices["prequant"] = {m: torch.cat([p[r] for r in sorted(p)]) for m, p in choices["prequant"].items()}
    return choices


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("algo", list(ALGOS))
def test_writer_rewrites_modelopts_export_bit_for_bit(modelopt_exports, algo, tp, tmp_path, monkeypatch):
    """Given modelopt's own choices (prequant, group scales, W4A8's activation and FP8 weight scales), trtpipe's
    writer writes every tensor of modelopt 0.37's export with the same name, dtype, shape and bytes, and the same
    quantization block: the packing, layout, fused q/k/v and fc/gate handling and tp sharding are NVIDIA's."""
    exported = modelopt_exports[algo, tp]
    float_ckpt = quantized_checkpoint.open_float_checkpoint(dequantized_float_checkpoint(exported, tmp_path / "f"))
    chosen = modelopts_choices(exported, float_ckpt)
    original = quantized_checkpoint._rounding_input

    def modelopts_scales(plan, module, row, tensor, tp_rank, tp_size):
        smoothed, _ = original(plan, module, row, tensor, tp_rank, tp_size)
        return smoothed, chosen["scales"][module, tp_rank]

    monkeypatch.setattr(quantized_checkpoint, "_rounding_input", modelopts_scales)
    monkeypatch.setattr(quantized_checkpoint, "_fp8_weight_scale",
                        lambda rf, name, module, ckpt, plan: chosen["wsf2"][module, rf.tp_rank])
    precision = PRECISION[algo]
    (tmp_path / "q").mkdir()
    writer = quantized_checkpoint.QuantizedCheckpointWriter(float_ckpt, precision, None, (), None, tmp_path / "q", 64)
    for layer in range(float_ckpt.num_layers):
        modules = float_ckpt.layer_modules(layer)
        writer.write_layer(layer, quantized_checkpoint.QuantPlan(
            precision=precision, kv_cache=None, activation_amax={m: chosen["act"].get(m) for m in modules},
            weight_amax={}, prequant={m: chosen["prequant"][m] for m in modules}, kv_amax={}, exclude=(),
            group_size=64, input_moments={m: torch.ones_like(chosen["prequant"][m]).float() for m in modules}))
    config = writer.close()
    assert config["quantization"] == json.loads((exported / "config.json").read_text())["quantization"]
    for rank in range(tp):
        ours, theirs = tensors(tmp_path / "q", rank), tensors(exported, rank)
        assert sorted(ours) == sorted(theirs)
        for name, t in theirs.items():
            assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
            assert torch.equal(ours[name], t), name


def test_packing_is_modelopts():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    from pipeline.runtime.int4 import pack_int4, unpack_int4

    codes = torch.randint(-8, 8, (6, 10), generator=torch.Generator().manual_seed(3))
    ours = pack_int4(codes)
    assert ours.dtype == torch.int8 and ours.shape == (3, 10)
    assert torch.equal(ours.view(torch.uint8), pack_int4_in_uint8(codes.float(), torch.ones(6, 5)))
    assert torch.equal(unpack_int4(ours), codes.to(torch.int8))


# --- calibrate end to end -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["int4-awq", "w4a8-awq"])
def test_calibrated_4bit_checkpoint_has_nvidias_layout_and_runs_close_to_float(int4_out, wide_ckpt, precision):
    from pipeline.runtime import ReferenceModel
    from pipeline.runtime.int4 import unpack_int4

    result = int4_out[precision]
    out = result.path
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant == {"quant_algo": {"int4-awq": "W4A16_AWQ", "w4a8-awq": "W4A8_AWQ"}[precision],
                     "kv_cache_quant_algo": None, "group_size": 64, "has_zero_point": False,
                     "pre_quant_scale": True, "exclude_modules": ["lm_head"]}
    assert result.notes and "--group-size 64" in result.notes[0] and "192" in result.notes[0]
    engine_note = [n for n in result.notes if "W4A8 GEMM takes group 128 only" in n]
    assert len(engine_note) == (precision == "w4a8-awq")
    q, f = tensors(out), tensors(wide_ckpt)
    for lin in LINEARS:
        p = f"transformer.layers.1.{lin}."
        o, i = f[p + "weight"].shape
        assert q[p + "weight"].dtype == torch.int8 and q[p + "weight"].shape == (o // 2, i)
        assert q[p + "weights_scaling_factor"].shape == (o, i // 64)
        assert q[p + "prequant_scaling_factor"].shape == (i,)
        assert (p + "weights_scaling_factor_2" in q) == (precision == "w4a8-awq")
        codes = unpack_int4(q[p + "weight"])
        assert int(codes.min()) >= -8 and int(codes.max()) <= 7
        deq = (codes.float() * q[p + "weights_scaling_factor"].repeat_interleave(64, dim=1)
               * q[p + "prequant_scaling_factor"].float()[None, :])
        rel = float((deq - f[p + "weight"]).norm() / f[p + "weight"].norm())
        assert rel < 0.2, (lin, rel)             # 4 bits of a Gaussian: ~0.1
        if precision == "w4a8-awq":          # every code x scale fits W4A8's FP8 weight grid, code -8 included
            on_grid = codes.float() * q[p + "weights_scaling_factor"].repeat_interleave(64, dim=1)
            assert float(on_grid.abs().max() / q[p + "weights_scaling_factor_2"]) <= 448.0
    assert torch.equal(q["transformer.layers.1.mlp.fc.prequant_scaling_factor"],
                       q["transformer.layers.1.mlp.gate.prequant_scaling_factor"])   # one input, one smoothing
    if precision == "w4a8-awq":        # one GEMM in the PyTorch backend: one FP8 weight scale
        assert torch.equal(q["transformer.layers.1.mlp.fc.weights_scaling_factor_2"],
                           q["transformer.layers.1.mlp.gate.weights_scaling_factor_2"])
    report = json.loads((out / "calibration" / "report.json").read_text())
    assert report["group_size"] == 64 and set(report["awq_alpha"]) == {
        f"transformer.layers.{i}.{lin}" for i in range(2) for lin in ("attention.qkv", "attention.dense", "mlp.fc",
                                                                      "mlp.proj")}
    ids = torch.tensor([[5, 300, 2000, 45, 9, 77]])
    quantized, reference = ReferenceModel.load(out).forward(ids), ReferenceModel.load(wide_ckpt).forward(ids)
    assert float((quantized - reference).norm() / reference.norm()) < 0.3     # a random model: ~0.2


def test_gptq_rounding_of_4bit_group_codes_lowers_the_layer_output_error():
    """GPTQ's objective on correlated inputs, the grid and scales the checkpoint uses: trace(E H E^T)."""
    from pipeline.calibrate.rounding import gptq_inverse, round_weight

    g = torch.Generator().manual_seed(2)
    mix = torch.randn(128, 128, generator=g) / 8 + torch.eye(128)
    x = torch.randn(2048, 128, generator=g) @ mix
    w = torch.randn(48, 128, generator=g)
    h = x.T @ x / x.shape[0]
    scales = int4.group_scales(w, torch.diagonal(h), 64)
    per_weight = scales.repeat_interleave(64, dim=1)

    def loss(codes):
        e = (w - codes * per_weight).double()
        return float(((e @ h.double()) * e).sum())

    nearest = round_weight(w, per_weight, int4.int4_codes, None)
    gptq = round_weight(w, per_weight, int4.int4_codes, gptq_inverse(h))
    assert bool((gptq.abs() <= 8).all()) and bool((gptq == gptq.round()).all())
    assert loss(gptq) < 0.85 * loss(nearest)


def test_the_4bit_checkpoint_is_gptq_rounded_unless_nearest_is_asked(wide_ckpt, text_file, int4_out, tmp_path):
    nearest = run_calibrate(wide_ckpt, tmp_path / "nearest", "int4-awq", text_file, weight_rounding="nearest")
    name = "transformer.layers.0.mlp.proj.weight"
    assert not torch.equal(tensors(nearest.path)[name], tensors(int4_out["int4-awq"].path)[name])
    assert torch.equal(tensors(nearest.path)[name.replace("weight", "weights_scaling_factor")],
                       tensors(int4_out["int4-awq"].path)[name.replace("weight", "weights_scaling_factor")])


def test_a_tp2_checkpoint_calibrates_to_the_tp1_model(smollm2_hf_dir, text_file, tmp_path):
    """Row-parallel shards are rounded over the full width with each shard's own group scales; the smoothing is one
    vector split across ranks: the tp=2 model computes the tp=1 model's logits (group 128 by default here)."""
    from pipeline.convert import convert_model
    from pipeline.runtime import ReferenceModel
    from pipeline.sources import resolve_model

    hf = make_tiny_model(tmp_path / "hf", vocab_size=49152, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, hf / name)
    logits = {}
    ids = torch.tensor([[5, 300, 2000, 45, 9]])
    for tp in (1, 2):
        ck = convert_model(resolve_model(str(hf)), tmp_path / f"ck{tp}", dtype="float32", tp=tp, progress=False).path
        result = run_calibrate(ck, tmp_path / f"q{tp}", "w4a8-awq", text_file)
        assert not result.notes and result.config["quantization"]["group_size"] == 128
        assert len(list(result.path.glob("rank*.safetensors"))) == tp
        logits[tp] = ReferenceModel.load(result.path).forward(ids)
    assert torch.allclose(logits[2], logits[1], atol=2e-3, rtol=1e-3)


def test_rerun_with_the_same_inputs_is_a_no_op(int4_out, wide_ckpt, text_file):
    again = run_calibrate(wide_ckpt, int4_out["int4-awq"].path, "int4-awq", text_file)
    assert again.skipped


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--precision", "int4-awq", "--group-size", "96"], "--group-size must be one of 128, 64"),
    (["--precision", "int4-awq", "--group-size", "128"], "does not divide transformer.layers.0.attention.dense's 192"),
    (["--precision", "fp8", "--group-size", "64"], "--group-size is for the 4-bit precisions"),
    (["--precision", "w4a8-awq", "--format", "hf", "--kv-cache", "int8"], "with an fp8 or no --kv-cache"),
])
def test_bad_4bit_options_are_one_line_and_exit_2_before_any_output(wide_ckpt, tmp_path, args, message):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["calibrate", str(wide_ckpt), "-o", str(out), "--quiet", "--seq-len", "32",
                                       *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_a_model_no_group_size_fits_is_refused_naming_the_layer(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["calibrate", str(tiny_ckpt), "-o", str(out), "--precision", "int4-awq",
                                       "--seq-len", "32"])
    assert result.exit_code == 2
    assert "no 4-bit group size fits" in result.output and "48 inputs" in result.output
    assert not out.exists()
