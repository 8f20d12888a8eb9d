"""int4-awq checkpoints exported to ONNX as 4-bit: every quantized linear is ONNX Runtime's `com.microsoft` MatMulNBits
on the checkpoint's own codes and group scales (no float copy of the weight, no second quantization), and ONNX Runtime
computes the reference runtime's logits through its KV cache."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.cli import main
from pipeline.onnx.export import ExportOptions, export_onnx
from pipeline.onnx.runner import OrtDecoder
from pipeline.runtime import ReferenceModel, perplexity
from pipeline.runtime.int4 import unpack_int4

from support.models import make_tiny_model
from test_calibrate import run_calibrate
from test_onnx import assert_matches_through_cache, assert_prompt_group_equals_its_own_run, held_out, random_ids

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@pytest.fixture(scope="module")
def int4_ckpts(tmp_path_factory, smollm2_hf_dir, text_file):
    """tp -> (hf dir, int4-awq checkpoint at group 64) of a random grouped-query Llama (hidden 256, 4 query heads on
    2 K/V heads) with SmolLM2's tokenizer."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    root = tmp_path_factory.mktemp("onnx-int4")
    hf = make_tiny_model(root / "hf", vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, hf / name)
    made = {}
    for tp in (1, 2):
        ckpt = convert_model(resolve_model(str(hf)), root / f"ckpt-tp{tp}", dtype="float32", tp=tp,
                             progress=False).path
        made[tp] = hf, run_calibrate(ckpt, root / f"int4-tp{tp}", "int4-awq", text_file, group_size=64).path
    return made


def test_int4_export_is_matmulnbits_on_the_checkpoints_codes_and_scales(int4_ckpts, tmp_path):
    _, ckpt = int4_ckpts[1]
    onnx_dir = export_onnx(ckpt, tmp_path / "onnx").path
    model = onnx.load(onnx_dir / "model.onnx")
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * len(LINEARS) and {n.domain for n in nbits} == {"com.microsoft"}
    assert ("com.microsoft", 1) in {(o.domain, o.version) for o in model.opset_import}
    weights = {t.name: t for t in model.graph.initializer}
    assert not [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    rank = load_file(str(ckpt / "rank0.safetensors"))
    for name in LINEARS:
        prefix = f"transformer.layers.1.{name}"
        packed = onnx.numpy_helper.to_array(weights[prefix + ".weight"])       # [out, in / 64, 32] uint8
        codes = unpack_int4(rank[prefix + ".weight"])                            # [out, in] int8
        assert packed.dtype == np.uint8 and packed.shape == (codes.shape[0], codes.shape[1] // 64, 32)
        nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(codes.shape).astype(np.int16) - 8
        assert np.array_equal(nibbles, codes.numpy())
        assert np.array_equal(onnx.numpy_helper.to_array(weights[prefix + ".weight_scale"]),
                              rank[prefix + ".weights_scaling_factor"].float().numpy())
        node = next(n for n in nbits if n.input[1] == prefix + ".weight")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"K": codes.shape[1], "N": codes.shape[0], "bits": 4, "block_size": 64, "accuracy_level": 0}
        # AWQ's smoothing, a Mul before the GEMM (gate reads fc's smoothed input: they share one)
        assert (prefix + ".prequant_scaling_factor" in weights) == (name != "mlp.gate")


@pytest.mark.parametrize("tp", [1, 2])
def test_int4_export_computes_the_runtimes_logits_through_its_cache(int4_ckpts, tp, tmp_path):
    hf, ckpt = int4_ckpts[tp]
    onnx_dir = export_onnx(ckpt, tmp_path / "onnx").path
    ref, decoder = ReferenceModel.load(ckpt), OrtDecoder(onnx_dir)
    assert_matches_through_cache(decoder, ref, random_ids(49152, 2, 12), prefill=8)
    assert_prompt_group_equals_its_own_run(decoder, random_ids(49152, 2, 10, seed=1),
                                           random_ids(49152, 1, 6, seed=2)[0].tolist())
    seqs = held_out(hf)
    ppl_ref, ppl_ort = perplexity(ref, seqs, window=48), perplexity(decoder, seqs, window=48)
    assert ppl_ort.tokens == ppl_ref.tokens > 200
    assert abs(ppl_ort.perplexity / ppl_ref.perplexity - 1) <= 1e-4


def test_int8_compute_accuracy_level_stays_close_and_is_recorded(int4_ckpts, tmp_path):
    hf, ckpt = int4_ckpts[1]
    onnx_dir = export_onnx(ckpt, tmp_path / "onnx", ExportOptions(int4_accuracy=4)).path
    node = next(n for n in onnx.load(onnx_dir / "model.onnx").graph.node if n.op_type == "MatMulNBits")
    assert {a.name: a.i for a in node.attribute}["accuracy_level"] == 4
    seqs = held_out(hf)
    ppl_ref, ppl_ort = perplexity(ReferenceModel.load(ckpt), seqs, window=48), perplexity(OrtDecoder(onnx_dir), seqs,
                                                                                          window=48)
    assert abs(ppl_ort.perplexity / ppl_ref.perplexity - 1) <= 0.01


def test_w4a8_and_a_wrong_precision_are_refused_without_writing(int4_ckpts, text_file, tmp_path):
    _, ckpt = int4_ckpts[1]
    result = CliRunner().invoke(main, ["export-onnx", str(ckpt), "-o", str(tmp_path / "fp8"), "--precision", "fp8"])
    assert result.exit_code == 2 and "is quantized as W4A16_AWQ" in result.output
    w4a8 = run_calibrate(ckpt.parent / "ckpt-tp1", tmp_path / "w4a8", "w4a8-awq", text_file, group_size=64).path
    result = CliRunner().invoke(main, ["export-onnx", str(w4a8), "-o", str(tmp_path / "onnx")])
    assert result.exit_code == 2 and "W4A8_AWQ's FP8 activations have no 4-bit ONNX Runtime kernel" in result.output
    assert not (tmp_path / "onnx").exists() and not (tmp_path / "fp8").exists()


def test_an_onnxruntime_without_matmulnbits_is_one_clear_line(int4_ckpts, tmp_path, monkeypatch):
    """The served model opens its export with the server's onnxruntime: one without the 4-bit kernel (an older or
    minimal build) is named with what to do, not a stack of ONNX Runtime internals."""
    import onnxruntime as ort

    from pipeline.errors import UserError

    _, ckpt = int4_ckpts[1]
    onnx_dir = export_onnx(ckpt, tmp_path / "onnx").path

    def no_kernel(*args, **kwargs):
        raise ort.capi.onnxruntime_pybind11_state.NotImplemented(
            "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for MatMulNBits(1) node "
            "with name '/MatMulNBits_3/MatMulNBits'")

    monkeypatch.setattr(ort, "InferenceSession", no_kernel)
    with pytest.raises(UserError, match=r"has no MatMulNBits kernel.*--runtime torch"):
        OrtDecoder(onnx_dir)
