"""Quantized checkpoints in the reference runtime, checked against NVIDIA's own tools.

nvidia-modelopt 0.37 quantizes a model with fake-quant modules and `export_tensorrt_llm_checkpoint`
writes the TensorRT-LLM checkpoint (FP8 or W8A8_SQ_PER_CHANNEL, KV cache FP8 or INT8). Once the
fake-quant model is given exactly the values the export wrote (the export rounds some tensors to the
checkpoint dtype and merges q/k/v and gate/up scales), its logits and the runtime's must agree to
float32 rounding: same scales, same rounding, same saturation, K/V quantized after rope.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pipeline.runtime import ReferenceModel, perplexity
from pipeline.runtime.quant import fake_quant_fp8, fake_quant_int8

from support.models import make_tiny_model

QUANT_CASES = [("fp8", None, 1), ("int8-sq", None, 1), ("fp8", "fp8", 2), ("int8-sq", "int8", 2)]


def test_int8_rounds_half_to_even_and_saturates():
    x = torch.tensor([2.5, 3.5, -2.5, 126.6, 400.0, -127.6, -500.0, 0.49])
    assert fake_quant_int8(x, 1.0).tolist() == [2.0, 4.0, -2.0, 127.0, 127.0, -128.0, -128.0, 0.0]
    assert fake_quant_int8(torch.tensor([0.25, 0.75]), 0.5).tolist() == [0.0, 1.0]


def test_fp8_saturates_instead_of_overflowing_and_rounds_to_the_e4m3_grid():
    x = torch.tensor([1e6, -1e6, 448.0, 1.0625, 1.1875, 0.0])
    got = fake_quant_fp8(x, 1.0)
    assert got.tolist() == [448.0, -448.0, 448.0, 1.0, 1.25, 0.0]   # ties to even mantissa; no NaN
    assert fake_quant_fp8(torch.tensor([3.0]), 0.5).item() == 3.0


def modelopt_quantize(hf_dir: Path, precision: str, kv: str | None):
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if precision == "fp8" else mtq.INT8_SMOOTHQUANT_CFG)
    if kv == "fp8":
        cfg["quant_cfg"].update(mtq.FP8_KV_CFG["quant_cfg"])
    elif kv == "int8":
        cfg["quant_cfg"]["*[kv]_bmm_quantizer"] = {"num_bits": 8, "axis": None, "enable": True}
    data = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return mtq.quantize(model, cfg, lambda m: [m(data[i:i + 1]) for i in range(len(data))])


def give_exported_values(model, runtime: ReferenceModel) -> None:
    """Make the fake-quant model use the exact weights, smoothing and KV scales the export wrote."""
    arch = runtime.cfg.arch
    q_rows, kv_rows = arch.q_size, arch.kv_size
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(runtime.weights.embedding)
        model.model.norm.weight.copy_(runtime.weights.final_norm)
        model.lm_head.weight.copy_(runtime.weights.lm_head)
        for layer, ours in zip(model.model.layers, runtime.weights.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.weight.copy_(ours.norms["input_layernorm"])
            layer.post_attention_layernorm.weight.copy_(ours.norms["post_layernorm"])
            lin = ours.linears
            q, k, v = lin["attention.qkv"].weight.split([q_rows, kv_rows, kv_rows])
            pairs = [(attn.q_proj, lin["attention.qkv"], q), (attn.k_proj, lin["attention.qkv"], k),
                     (attn.v_proj, lin["attention.qkv"], v)]
            pairs += [(module, lin[name], lin[name].weight) for module, name in (
                (attn.o_proj, "attention.dense"), (mlp.gate_proj, "mlp.fc"), (mlp.up_proj, "mlp.gate"),
                (mlp.down_proj, "mlp.proj"))]
            for module, linear, weight in pairs:
                module.weight.copy_(weight)
                if linear.prequant is not None:
                    module.input_quantizer.pre_quant_scale = linear.prequant
            if ours.kv_quant is not None:
                bound = 448.0 if ours.kv_quant.kind == "fp8" else 127.0
                for name in ("k_bmm_quantizer", "v_bmm_quantizer"):
                    getattr(attn, name).amax = torch.tensor(ours.kv_quant.scale * bound)


@pytest.mark.parametrize("precision,kv,tp", QUANT_CASES)
def test_modelopt_exported_checkpoint_runs_exactly_as_modelopt_simulates_it(tmp_path, precision, kv, tp):
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_model(tmp_path / "hf", vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2)
    model = modelopt_quantize(hf_dir, precision, kv)
    export_tensorrt_llm_checkpoint(model, "llama", torch.float16, tmp_path / "ckpt", inference_tensor_parallel=tp)
    runtime = ReferenceModel.load(tmp_path / "ckpt")
    assert runtime.config["quantization"]["quant_algo"] == {"fp8": "FP8", "int8-sq": "W8A8_SQ_PER_CHANNEL"}[precision]
    assert runtime.config["mapping"]["tp_size"] == tp
    give_exported_values(model, runtime)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        unquantized = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
    got = runtime.forward(ids)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (got - unquantized).abs().max() > 1e-3 * scale       # the quantization really is simulated


def test_kv_cache_quantization_is_applied_in_generation(tmp_path):
    """INT8 KV: generation reads the quantized cache and agrees with a forward pass using the same scales."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from pipeline.runtime import SamplingConfig

    hf_dir = make_tiny_model(tmp_path / "hf", vocab_size=128, hidden_size=64, intermediate_size=128)
    export_tensorrt_llm_checkpoint(modelopt_quantize(hf_dir, "int8-sq", "int8"), "llama", torch.float16,
                                   tmp_path / "ckpt", inference_tensor_parallel=1)
    runtime = ReferenceModel.load(tmp_path / "ckpt")
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    out = runtime.generate([prompt], SamplingConfig(max_new_tokens=10))[0]
    logits = runtime.forward(torch.tensor([prompt + out]))[0]
    steps = logits[len(prompt) - 1:-1]
    top2 = steps.topk(2, dim=-1).values
    # Decode attends over the cached (quantized) K/V one token at a time, the forward pass all at once;
    # the order of float additions differs, which can flip an INT8 rounding, so a step may only
    # disagree with the forward pass where its two best logits are within such a flip of each other.
    agree = steps.argmax(-1) == torch.tensor(out)
    assert bool((agree | (top2[:, 0] - top2[:, 1] < 5e-3)).all()) and agree.float().mean() >= 0.8
    for layer in runtime.weights.layers:
        layer.kv_quant = None
    assert not torch.equal(runtime.forward(torch.tensor([prompt + out]))[0], logits)


@pytest.fixture(scope="session")
def smollm2_quantized(smollm2_hf_dir, smollm2_checkpoint, tmp_path_factory):
    """SmolLM2 quantized by modelopt (calibrated on the calibration split) and exported, fp16 checkpoints."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.evaluate import corpus_split

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    calib, held = corpus_split()
    calib_ids = [tok(line)["input_ids"][:128] for line in calib[:16]]
    out = {}
    for precision, cfg in (("fp8", mtq.FP8_DEFAULT_CFG), ("int8-sq", mtq.INT8_SMOOTHQUANT_CFG)):
        model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            model = mtq.quantize(model, copy.deepcopy(cfg), lambda m: [m(torch.tensor([i])) for i in calib_ids])
        path = tmp_path_factory.mktemp(f"smollm2-{precision}") / "ckpt"
        export_tensorrt_llm_checkpoint(model, "llama", torch.float16, path, inference_tensor_parallel=1)
        out[precision] = path
    return out, [tok(line)["input_ids"] for line in held[:12]]


@pytest.mark.slow
def test_smollm2_modelopt_fp8_and_int8_sq_perplexity_close_to_unquantized(smollm2_checkpoint, smollm2_quantized):
    paths, held = smollm2_quantized
    base = perplexity(ReferenceModel.load(smollm2_checkpoint), held).perplexity
    fp8 = perplexity(ReferenceModel.load(paths["fp8"]), held).perplexity
    int8 = perplexity(ReferenceModel.load(paths["int8-sq"]), held).perplexity
    print(f"SmolLM2 held-out perplexity: float32 {base:.3f}, FP8 {fp8:.3f}, INT8-SQ {int8:.3f}")
    # Measured (16 calibration lines x 128 tokens): float32 35.90, FP8 36.92, INT8-SQ 41.36; a broken
    # scale or rounding puts perplexity in the hundreds. With 32 x 256 calibration INT8-SQ reaches 38.47.
    assert abs(fp8 / base - 1) < 0.05
    assert abs(int8 / base - 1) < 0.20
    assert fp8 != base and int8 != base


def test_fp8_gate_mlp_is_fused_like_the_engine(tmp_path):
    """Different fc/gate scales: both weights are requantized with the larger weight scale and the
    shared input is quantized with the larger activation scale (TensorRT-LLM's fuse_gate_mlp)."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from safetensors.torch import load_file, save_file

    from pipeline.runtime.quant import dequantize_weight, fake_quant_fp8

    hf_dir = make_tiny_model(tmp_path / "hf", vocab_size=128, hidden_size=64, intermediate_size=128)
    export_tensorrt_llm_checkpoint(modelopt_quantize(hf_dir, "fp8", None), "llama", torch.float16,
                                   tmp_path / "ckpt", inference_tensor_parallel=1)
    path = tmp_path / "ckpt" / "rank0.safetensors"
    tensors = load_file(str(path))
    p = "transformer.layers.0.mlp."
    tensors[p + "gate.weights_scaling_factor"] = tensors[p + "gate.weights_scaling_factor"] * 3
    tensors[p + "fc.activation_scaling_factor"] = tensors[p + "fc.activation_scaling_factor"] * 2
    save_file(tensors, str(path))
    layer = ReferenceModel.load(tmp_path / "ckpt").weights.layers[0]
    ws = float(tensors[p + "gate.weights_scaling_factor"])
    fc = dequantize_weight(tensors[p + "fc.weight"], tensors[p + "fc.weights_scaling_factor"])
    gate = dequantize_weight(tensors[p + "gate.weight"], tensors[p + "gate.weights_scaling_factor"])
    ours_fc, ours_gate = layer.linears["mlp.fc"], layer.linears["mlp.gate"]
    assert torch.equal(ours_fc.weight, fake_quant_fp8(fc, ws)) and not torch.equal(ours_fc.weight, fc)
    assert torch.equal(ours_gate.weight, gate)
    act = float(tensors[p + "fc.activation_scaling_factor"])
    assert ours_fc.act_quant.scale == ours_gate.act_quant.scale == pytest.approx(act)
