"""4-bit Hugging Face checkpoints (`calibrate --precision int4-awq|w4a8-awq --format both|hf`) in nvidia-modelopt
0.37's unified layout, the one TensorRT-LLM's PyTorch backend loads (`hf_quant_config.json`). Oracle: modelopt's own
`export_hf_checkpoint` after INT4_AWQ_CFG / W4A8_AWQ_BETA_CFG (group 64): trtpipe's exporter, given a TensorRT-LLM
checkpoint with modelopt's codes and scales, writes every tensor of it with the same name, dtype, shape and bytes;
the reference runtime reads it as the model the TensorRT-LLM checkpoint is."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.calibrate import quantized_checkpoint
from pipeline.calibrate.hf_export import write_hf_checkpoint
from pipeline.cli import main
from pipeline.runtime import ReferenceModel
from pipeline.runtime.int4 import dequantize_groupwise, unpack_int4

from support.models import make_tiny_model
from support.modelopt_int4 import ALGOS, GROUP, modelopt_int4, tiny_int4_llama

PRECISION = {"W4A16_AWQ": "int4-awq", "W4A8_AWQ": "w4a8-awq"}
#: TensorRT-LLM linear -> its Hugging Face parts, and whether the smoothing is folded into the norm before it
LINEARS = {"attention.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True),
           "attention.dense": (("self_attn.o_proj",), False), "mlp.fc": (("mlp.gate_proj",), True),
           "mlp.gate": (("mlp.up_proj",), True), "mlp.proj": (("mlp.down_proj",), False)}


@pytest.fixture(scope="module")
def modelopt_hf(tmp_path_factory):
    """modelopt 0.37's unified HF export (float16, group 64) of a tiny Llama after its own AWQ, per algorithm."""
    from modelopt.torch.export import export_hf_checkpoint

    root = tmp_path_factory.mktemp("modelopt-hf-int4")
    hf = tiny_int4_llama(root / "hf")
    out = {}
    for algo in ALGOS:
        model = modelopt_int4(hf, algo).half()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_hf_checkpoint(model, dtype=torch.float16, export_dir=root / algo)
        out[algo] = root / algo
    return out


def dequantized_hf(exported: Path, out: Path) -> Path:
    """A float16 Hugging Face model whose linears are the export's dequantized ones (code x scale x own smoothing)
    and whose norms are the export's (the folded smoothing included)."""
    t = load_file(str(exported / "model.safetensors"))
    plain = {}
    for name, tensor in t.items():
        if name.endswith(".weight") and tensor.dtype in (torch.uint8, torch.int8):
            module = name[: -len(".weight")]
            w = dequantize_groupwise(unpack_int4(tensor.view(torch.int8)), t[module + ".weight_scale"])
            if module + ".pre_quant_scale" in t:
                w = w * t[module + ".pre_quant_scale"].float()[None, :]
            plain[name] = w.half()
        elif not name.endswith(("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")):
            plain[name] = tensor
    out.mkdir()
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((exported / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return out


def trtllm_twin(exported: Path, algo: str, tmp_path: Path) -> tuple[Path, Path]:
    """(float, 4-bit) TensorRT-LLM checkpoints holding the export's model: trtpipe's writer given modelopt's codes,
    group scales and W4A8 scalars, and the smoothing each linear keeps (none where the norm holds it)."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    t = load_file(str(exported / "model.safetensors"))
    float_dir = convert_model(resolve_model(str(dequantized_hf(exported, tmp_path / "deq"))), tmp_path / "float",
                              dtype="float16", progress=False).path
    float_ckpt = quantized_checkpoint.open_float_checkpoint(float_dir)
    scales, act, wsf2, prequant = {}, {}, {}, {}
    for layer in range(float_ckpt.num_layers):
        for lin, (parts, folded) in LINEARS.items():
            module, hf = f"transformer.layers.{layer}.{lin}", [f"model.layers.{layer}.{p}" for p in parts]
            scales[module] = torch.cat([t[p + ".weight_scale"] for p in hf]).float()
            width = scales[module].shape[1] * GROUP
            prequant[module] = (torch.ones(width, dtype=torch.float16) if folded
                                else t[hf[0] + ".pre_quant_scale"])
            if algo == "W4A8_AWQ":
                act[module] = float(t[hf[0] + ".input_scale"]) * 448.0
                wsf2[module] = t[hf[0] + ".weight_scale_2"].float().reshape(1)
    original = quantized_checkpoint._rounding_input

    def modelopts_scales(plan, module, row, tensor, tp_rank, tp_size):
        return original(plan, module, row, tensor, tp_rank, tp_size)[0], scales[module]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantized_checkpoint, "_rounding_input", modelopts_scales)
        mp.setattr(quantized_checkpoint, "_fp8_weight_scale", lambda rf, name, module, ckpt, plan: wsf2[module])
        precision = PRECISION[algo]
        (tmp_path / "q").mkdir()
        writer = quantized_checkpoint.QuantizedCheckpointWriter(float_ckpt, precision, None, (), None,
                                                                tmp_path / "q", GROUP)
        for layer in range(float_ckpt.num_layers):
            modules = float_ckpt.layer_modules(layer)
            writer.write_layer(layer, quantized_checkpoint.QuantPlan(
                precision=precision, kv_cache=None, activation_amax={m: act.get(m) for m in modules},
                weight_amax={}, prequant={m: prequant[m] for m in modules}, kv_amax={}, exclude=(),
                group_size=GROUP, input_moments={m: torch.ones(prequant[m].shape) for m in modules}))
        writer.close()
    return float_dir, tmp_path / "q"


@pytest.mark.parametrize("algo", list(ALGOS))
def test_hf_export_rewrites_modelopts_unified_4bit_export_bit_for_bit(modelopt_hf, algo, tmp_path):
    exported = modelopt_hf[algo]
    float_dir, q = trtllm_twin(exported, algo, tmp_path)
    write_hf_checkpoint(float_dir, q, tmp_path / "ours")
    ours, theirs = load_file(str(tmp_path / "ours" / "model.safetensors")), load_file(str(exported /
                                                                                          "model.safetensors"))
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name
    for name in ("hf_quant_config.json",):
        mine, other = (json.loads((d / name).read_text())["quantization"] for d in (tmp_path / "ours", exported))
        assert mine == other
    mine, other = (json.loads((d / "config.json").read_text())["quantization_config"]
                   for d in (tmp_path / "ours", exported))
    assert {k: v for k, v in mine.items() if k != "producer"} == {k: v for k, v in other.items() if k != "producer"}


@pytest.mark.parametrize("algo", list(ALGOS))
def test_the_runtime_reads_modelopts_4bit_hf_export_as_its_tensorrt_llm_twin(modelopt_hf, algo, tmp_path):
    """The same codes and scales in both layouts compute the same logits; the folded smoothing is in the norms."""
    exported = modelopt_hf[algo]
    _, q = trtllm_twin(exported, algo, tmp_path)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    hf_logits, trt_logits = ReferenceModel.load(exported).forward(ids), ReferenceModel.load(q).forward(ids)
    scale = trt_logits.abs().max()
    assert (hf_logits - trt_logits).abs().max() <= 1e-5 * scale
    runtime = ReferenceModel.load(exported)
    dense = runtime.weights.layers[0].linears["attention.dense"]
    assert dense.prequant is not None and runtime.weights.layers[0].linears["attention.qkv"].prequant is None
    assert (dense.act_quant is not None) == (algo == "W4A8_AWQ")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, text_file, smollm2_hf_dir):
    """(float checkpoint, {precision: `calibrate --format both` result}) of a random Llama whose linears take group
    64 (hidden 192), with SmolLM2's tokenizer."""
    from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    root = tmp_path_factory.mktemp("hf-int4")
    hf = make_tiny_model(root / "hf", vocab_size=49152, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, hf / name)
    ckpt = convert_model(resolve_model(str(hf)), root / "ckpt", dtype="float32", progress=False).path
    recipe = resolve_recipe(str(text_file), samples=4, seq_len=32)
    return ckpt, {p: calibrate_checkpoint(ckpt, root / p, CalibrateOptions(p, recipe, eval_samples=0, progress=False,
                                                                            format="both"))
                  for p in PRECISION.values()}


@pytest.mark.parametrize("precision", list(PRECISION.values()))
def test_format_both_writes_the_same_4bit_model_in_both_layouts(calibrated, precision):
    """OUT/hf holds OUT's codes and scales per Hugging Face part, the smoothing of q/k/v and gate/up folded into the
    norm before them and that of o_proj and down_proj kept: both compute the same logits."""
    ckpt, results = calibrated
    out = results[precision].path
    hf = load_file(str(out / "hf" / "model.safetensors"))
    trt = load_file(str(out / "rank0.safetensors"))
    p = "transformer.layers.1."
    q_rows = 192
    assert torch.equal(hf["model.layers.1.self_attn.q_proj.weight"],
                       trt[p + "attention.qkv.weight"][:q_rows // 2].view(torch.uint8))
    assert torch.equal(hf["model.layers.1.self_attn.v_proj.weight_scale"],
                       trt[p + "attention.qkv.weights_scaling_factor"][q_rows + 96:])
    assert torch.equal(hf["model.layers.1.input_layernorm.weight"],
                       trt[p + "input_layernorm.weight"] * trt[p + "attention.qkv.prequant_scaling_factor"])
    assert torch.equal(hf["model.layers.1.post_attention_layernorm.weight"],
                       trt[p + "post_layernorm.weight"] * trt[p + "mlp.fc.prequant_scaling_factor"])
    assert torch.equal(hf["model.layers.1.mlp.down_proj.pre_quant_scale"], trt[p + "mlp.proj.prequant_scaling_factor"])
    assert "model.layers.1.self_attn.q_proj.pre_quant_scale" not in hf
    quant = json.loads((out / "hf" / "hf_quant_config.json").read_text())["quantization"]
    assert quant == {**json.loads((out / "config.json").read_text())["quantization"], "exclude_modules": ["lm_head"]}
    ids = torch.tensor([[5, 300, 2000, 45, 9, 77, 123, 4000]])
    a, b = ReferenceModel.load(out / "hf").forward(ids), ReferenceModel.load(out).forward(ids)
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_format_hf_scores_the_4bit_hugging_face_checkpoint(calibrated, text_file, tmp_path):
    ckpt, _ = calibrated
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "-o", str(tmp_path / "hf"), "--precision", "int4-awq",
                                       "--format", "hf", "--dataset", str(text_file), "--samples", "4", "--seq-len",
                                       "32", "--eval-samples", "2", "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["quantization"]["quant_algo"] == "W4A16_AWQ" and report["quantization"]["group_size"] == 64
    assert (tmp_path / "hf" / "hf_quant_config.json").is_file() and not list((tmp_path / "hf").glob("rank*"))
    from pipeline.calibrate.data import load_tokenizer
    from pipeline.calibrate.stage import EVAL_WINDOW, heldout_sequences
    from pipeline.runtime import LayerStream, perplexity

    heldout = heldout_sequences(load_tokenizer(ckpt), 2)
    scored = perplexity(LayerStream(tmp_path / "hf", "cpu"), heldout, window=EVAL_WINDOW, progress=False)
    assert scored.perplexity == pytest.approx(report["perplexity"]["quantized"], rel=1e-12)
    evaluated = CliRunner().invoke(main, ["eval", str(tmp_path / "hf"), "--eval-samples", "1", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    assert 1.0 < json.loads(evaluated.output)["perplexity"] < float("inf")


def nan_scale(t: dict) -> str:
    t["model.layers.0.mlp.down_proj.weight_scale"][3, 1] = float("nan")
    return "model.layers.0.mlp.down_proj.weight_scale holds 1 value(s) that are not positive finite scales"


def short_weight(t: dict) -> str:
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:, :-64].contiguous()
    return "model.layers.1.self_attn.k_proj.weight has shape [48, 128], expected [48, 192]"


def missing_smoothing(t: dict) -> str:
    del t["model.layers.1.self_attn.o_proj.pre_quant_scale"]
    return "model.layers.1.self_attn.o_proj.pre_quant_scale"


@pytest.mark.parametrize("breakage", [nan_scale, short_weight, missing_smoothing])
def test_a_broken_4bit_hf_checkpoint_is_refused_by_tensor_name(calibrated, tmp_path, breakage):
    _, results = calibrated
    broken = tmp_path / "broken"
    shutil.copytree(results["int4-awq"].path / "hf", broken)
    t = load_file(str(broken / "model.safetensors"))
    message = breakage(t)
    save_file(t, broken / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["eval", str(broken), "--eval-samples", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in result.output, result.output
