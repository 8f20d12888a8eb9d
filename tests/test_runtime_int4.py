"""NVIDIA's 4-bit checkpoints (W4A16_AWQ, W4A8_AWQ) in the reference runtime, checked against nvidia-modelopt 0.37.

modelopt quantizes a tiny Llama with AWQ (int4 groups of 64, its `awq_lite` search) and its TensorRT-LLM exporter
writes the checkpoint. Once the fake-quant model is given exactly the values the export wrote (the export rounds
the smoothing to float16 and re-smooths q/k/v onto one shared scale), its logits and the runtime's must agree to
float32 rounding. The test unpacks the int4 codes itself, from modelopt's packing, not with the runtime's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.runtime import ReferenceModel

from support.models import save_word_tokenizer
from support.modelopt_int4 import ALGOS, GROUP, modelopt_int4, tiny_int4_llama

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """algo -> (modelopt's fake-quant model, its exported float16 checkpoint, the float HF directory); the same
    model exported tp=2 beside it (ALGO-tp2)."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    root = tmp_path_factory.mktemp("int4")
    hf_dir = tiny_int4_llama(root / "hf")
    out = {}
    for algo in ALGOS:
        model = modelopt_int4(hf_dir, algo)
        export_tensorrt_llm_checkpoint(model, "llama", torch.float16, root / algo, inference_tensor_parallel=1)
        export_tensorrt_llm_checkpoint(model, "llama", torch.float16, root / f"{algo}-tp2", inference_tensor_parallel=2)
        out[algo] = (model, root / algo, hf_dir)
    return out


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes [out, in] from modelopt's bytes [out/2, in] (low nibble: row 2j), by arithmetic shifts."""
    low = (packed.view(torch.int8) << 4) >> 4
    high = packed.view(torch.int8) >> 4
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])


def test_int4_unpacking_inverts_modelopts_packing():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    from pipeline.runtime.int4 import unpack_int4

    codes = torch.randint(-8, 8, (6, 8), generator=torch.Generator().manual_seed(0)).float()
    packed = pack_int4_in_uint8(codes, torch.ones(6, 2)).view(torch.int8)
    assert packed.shape == (3, 8)
    assert torch.equal(unpack_int4(packed).float(), codes)
    assert torch.equal(codes_of(packed).float(), codes)


def give_exported_values(model, ckpt: Path, algo: str) -> None:
    """Make modelopt's fake-quant model compute with exactly the tensors the export wrote."""
    from safetensors.torch import load_file

    t = {k: v.float() if v.dtype != torch.int8 else v for k, v in load_file(str(ckpt / "rank0.safetensors")).items()}
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    split = [cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(t["transformer.vocab_embedding.weight"])
        model.model.norm.weight.copy_(t["transformer.ln_f.weight"])
        model.lm_head.weight.copy_(t["lm_head.weight"])
        for i, layer in enumerate(model.model.layers):
            p = f"transformer.layers.{i}."
            layer.input_layernorm.weight.copy_(t[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(t[p + "post_layernorm.weight"])
            attn, mlp = layer.self_attn, layer.mlp
            modules = {"attention.qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "attention.dense": [attn.o_proj],
                       "mlp.fc": [mlp.gate_proj], "mlp.gate": [mlp.up_proj], "mlp.proj": [mlp.down_proj]}
            for name, targets in modules.items():
                n = p + name
                scale = t[n + ".weights_scaling_factor"]
                parts = [len(targets[0].weight)] if len(targets) == 1 else split
                for module, codes, s in zip(targets, codes_of(t[n + ".weight"]).split(parts),
                                            scale.split(parts)):
                    module.weight.copy_(codes.float() * s.repeat_interleave(GROUP, dim=1))
                    module.input_quantizer.pre_quant_scale = t[n + ".prequant_scaling_factor"]
                    if algo == "W4A8_AWQ":
                        module.weight_quantizer[0].amax = (s * 7).reshape(module.weight_quantizer[0].amax.shape)
                        module.weight_quantizer[1].amax = t[n + ".weights_scaling_factor_2"].reshape(()) * 448
                        module.input_quantizer.amax = t[n + ".activation_scaling_factor"].reshape(()) * 448
                    else:
                        module.weight_quantizer.amax = (s * 7).reshape(module.weight_quantizer.amax.shape)


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_modelopt_int4_checkpoint_runs_as_modelopt_simulates_it(exported, algo):
    from transformers import AutoModelForCausalLM

    model, ckpt, hf_dir = exported[algo]
    config = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (config["quant_algo"], config["group_size"], config["has_zero_point"]) == (algo, GROUP, False)
    runtime = ReferenceModel.load(ckpt)
    give_exported_values(model, ckpt, algo)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        unquantized = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
    got = runtime.forward(ids)
    scale = want.abs().max()
    err, scale = (got - want).abs(), want.abs().max()
    print(f"{algo}: max |runtime - modelopt| {float(err.max()):.3g} of max |logit| {float(scale):.3g}")
    # The same codes, scales and FP8 grid computed in another order (modelopt multiplies by 7/amax and 448/amax where
    # the runtime multiplies by the scale; its attention and norms are transformers'): float32 rounding, a few ulp of
    # the largest logit. W4A8 quantizes activations to FP8, a step function, so a 1-ulp difference upstream can move
    # one input across a rounding boundary (one E4M3 step, 1/8 of it) and change its token's logits by ~2e-5 of the
    # largest (measured: one of 48 positions). Leaving out either FP8 rounding, or misreading a nibble, a group or a
    # scale, costs ~5e-2 of it.
    tolerance = 2e-6 * scale
    if algo == "W4A16_AWQ":
        assert err.max() <= tolerance
    else:
        assert err.max() <= 1e-4 * scale
        assert (err > tolerance).any(-1).float().mean() <= 0.1
    assert (got - unquantized).abs().max() > 1e-3 * scale       # the quantization really is simulated
    if algo == "W4A8_AWQ":
        layer = runtime.weights.layers[0].linears["mlp.proj"]
        assert layer.act_quant is not None and layer.act_quant.kind == "fp8"
    else:
        assert all(lin.act_quant is None for lin in runtime.weights.layers[0].linears.values())


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_a_tp2_int4_export_runs_like_the_tp1_one(exported, algo):
    """Column-parallel shares split the packed rows and keep the prequant scale, row-parallel ones split the inputs,
    their groups and the prequant scale: merged, the two layouts are the same model."""
    ckpt = exported[algo][1]
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    tp2 = ReferenceModel.load(ckpt.with_name(f"{algo}-tp2"))
    assert tp2.config["mapping"]["tp_size"] == 2
    assert torch.allclose(tp2.forward(ids), ReferenceModel.load(ckpt).forward(ids), rtol=0, atol=1e-6)


def edit(ckpt: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "rank0.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "rank0.safetensors"))


def edit_config(ckpt: Path, **quantization) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"].update(quantization)
    (ckpt / "config.json").write_text(json.dumps(config))


L0 = "transformer.layers.0."


def replace(name: str, new):
    """Damage: tensor NAME replaced by new(old) (None: removed)."""
    def change(t):
        value = new(t.pop(L0 + name))
        if value is not None:
            t[L0 + name] = value.contiguous()
    return lambda d: edit(d, change)


def set_first(name: str, value: float):
    def first(old):
        old = old.clone()
        old.view(-1)[0] = value
        return old
    return replace(name, first)


NAN, INF = float("nan"), float("inf")
BREAKAGES = {
    "codes not packed": (replace("mlp.fc.weight", lambda w: torch.zeros(256, 128, dtype=torch.int8)),
                         "mlp.fc.weight has shape [256, 128], expected [128, 128] (two int4 codes per byte"),
    "codes as floats": (replace("mlp.gate.weight", lambda w: w.half()), "mlp.gate.weight has dtype F16, expected int8"),
    "a group too few": (replace("mlp.proj.weights_scaling_factor", lambda s: s[:, :3]),
                        "mlp.proj.weights_scaling_factor has shape [128, 3], expected [128, 4] (one scale per group "
                        "of 64 inputs"),
    "prequant scale cut": (replace("attention.qkv.prequant_scaling_factor", lambda s: s[:64]),
                           "attention.qkv.prequant_scaling_factor has shape [64], expected [128]"),
    "NaN group scale": (set_first("attention.dense.weights_scaling_factor", NAN),
                        "attention.dense.weights_scaling_factor holds 1 value(s) that are not positive and finite"),
    "infinite prequant scale": (set_first("mlp.fc.prequant_scaling_factor", INF),
                                "mlp.fc.prequant_scaling_factor holds 1 value(s) that are not positive"),
    "zero point": (lambda d: edit_config(d, has_zero_point=True), "quantization.has_zero_point true"),
    "group size not dividing": (lambda d: edit_config(d, group_size=48),
                                "128 inputs are not a multiple of quantization.group_size 48"),
    "no group size": (lambda d: edit_config(d, group_size=None), "quantization.group_size None must be a positive"),
}
W4A8_BREAKAGES = {
    "infinite activation scale": (set_first("mlp.proj.activation_scaling_factor", INF),
                                  "mlp.proj.activation_scaling_factor holds 1 value(s) that are not positive"),
    "no second weight scale": (replace("mlp.gate.weights_scaling_factor_2", lambda s: None),
                               "missing tensor " + L0 + "mlp.gate.weights_scaling_factor_2"),
    "negative second weight scale": (set_first("attention.qkv.weights_scaling_factor_2", -1.0),
                                     "attention.qkv.weights_scaling_factor_2 holds 1 value(s) that are not"),
}
ALL_BREAKAGES = {**BREAKAGES, **W4A8_BREAKAGES}
CASES = [("W4A16_AWQ", b) for b in sorted(BREAKAGES)] + [("W4A8_AWQ", b) for b in sorted(ALL_BREAKAGES)]


@pytest.mark.parametrize("algo,breakage", CASES)
def test_a_broken_int4_checkpoint_is_refused_by_tensor_name(exported, tmp_path, algo, breakage):
    broken = tmp_path / "ckpt"
    shutil.copytree(exported[algo][1], broken)
    damage, message = ALL_BREAKAGES[breakage]
    damage(broken)
    with pytest.raises(UserError) as err:
        ReferenceModel.load(broken)
    assert message in str(err.value)


def test_eval_scores_an_int4_checkpoint_and_refuses_a_broken_one_with_exit_2(exported, tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    save_word_tokenizer(tokenizer)
    text = tmp_path / "sample.txt"
    words = torch.randint(3, 101, (3, 40), generator=torch.Generator().manual_seed(3)).tolist()
    text.write_text("\n".join(" ".join(f"w{w}" for w in line) for line in words) + "\n")
    runner = CliRunner()
    args = ["--tokenizer", str(tokenizer), "--dataset", str(text), "--eval-samples", "2", "--json"]
    scores = {}
    for algo in ALGOS:
        result = runner.invoke(main, ["eval", str(exported[algo][1]), *args])
        assert result.exit_code == 0, result.output
        scores[algo] = json.loads(result.stdout)
        assert scores[algo]["tokens"] == 78 and 1.0 < scores[algo]["perplexity"] < 1000.0
    assert scores["W4A16_AWQ"]["perplexity"] != scores["W4A8_AWQ"]["perplexity"]
    broken = tmp_path / "broken"
    shutil.copytree(exported["W4A8_AWQ"][1], broken)
    set_first("mlp.fc.weights_scaling_factor", NAN)(broken)
    result = runner.invoke(main, ["eval", str(broken), *args])
    assert result.exit_code == 2 and "mlp.fc.weights_scaling_factor" in result.output
    assert "Traceback" not in result.output


def test_stages_that_cannot_take_an_int4_checkpoint_refuse_it_by_name(exported, tmp_path):
    """export-onnx writes W4A16 (MatMulNBits) but not W4A8, and distill trains only float, FP8 and INT8-SmoothQuant
    checkpoints: a 4-bit checkpoint they cannot take is one line and exit 2, not a KeyError or a wrong
    requantization."""
    from pipeline.distill.network import load_network

    ckpt = exported["W4A16_AWQ"][1]
    result = CliRunner().invoke(main, ["export-onnx", str(exported["W4A8_AWQ"][1]), "-o", str(tmp_path / "onnx")])
    assert result.exit_code == 2 and "quantized as W4A8_AWQ" in result.output, result.output
    assert not (tmp_path / "onnx").exists()
    with pytest.raises(UserError, match="quantized as W4A16_AWQ; distill trains"):
        load_network(ckpt, trainable=True)
