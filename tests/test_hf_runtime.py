"""The reference runtime reads a Hugging Face FP8 checkpoint (modelopt's unified layout, `calibrate --format
both`) as TensorRT-LLM's PyTorch backend loads it, and `trtpipe eval` scores one (issue 13).

Oracle: the TensorRT-LLM FP8 checkpoint of the same calibration, read by the engine-checkpoint reader.
- Given the engine's own scales (one per fused q/k/v and gate/up group), the Hugging Face checkpoint is the
  same model: every weight bitwise equal, the same perplexity (the same float32 computation on the same
  weights: equal to 1e-12 relative).
- As calibrate exports it (modelopt's per-projection weight scales), the parts whose own scale is below
  their group's are quantized twice (the server re-quantizes them with the shared scale), so those differ
  by at most one FP8 step; everything else is bitwise equal, and the perplexity is within 2% (measured:
  0.2-0.8% on these tiny random models; docs/pytorch-backend.md).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from support.models import save_word_tokenizer
from pipeline.checkpoint import CheckpointConfig
from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.evaluate import evaluate
from pipeline.model.spec import HF_LAYER, dims
from pipeline.runtime.trtllm_reader import CheckpointReader
from pipeline.runtime.hf_checkpoint import HfCheckpointReader, fused_groups
from pipeline.sources import resolve_model

E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def calibrated(tiny_llama, tmp_path_factory):
    """(TensorRT-LLM FP8 checkpoint, its Hugging Face export, a text file): nearest rounding, FP8 KV cache."""
    tmp = tmp_path_factory.mktemp("hf-runtime")
    ckpt = convert_model(resolve_model(str(tiny_llama("gqa"))), tmp / "ckpt", progress=False).path
    save_word_tokenizer(ckpt / "tokenizer")
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", "fp8", "--kv-cache", "fp8",
                                       "--weight-rounding", "nearest", "--samples", "4", "--seq-len", "32",
                                       "--eval-samples", "0", "--format", "both", "--quiet", "-o", str(tmp / "fp8")])
    assert result.exit_code == 0, result.output
    rng = random.Random(0)
    text = tmp / "text.txt"
    text.write_text("\n".join(" ".join(f"w{rng.randrange(101)}" for _ in range(48)) for _ in range(12)))
    return tmp / "fp8", tmp / "fp8" / "hf", text


def perplexity(directory: Path, text: Path) -> float:
    result = evaluate(directory, str(text), device="cpu", progress=False)
    assert result.kind == "checkpoint"          # the reference runtime, not transformers
    return result.perplexity


def with_the_engines_scales(trt: Path, hf: Path, out: Path) -> Path:
    """The Hugging Face checkpoint `hf` with the engine checkpoint's FP8 weights and its one scale per linear."""
    shutil.copytree(hf, out)
    tensors = load_file(str(out / "model.safetensors"))
    rank = load_file(str(trt / "rank0.safetensors"))
    cfg = CheckpointConfig.read(trt)
    sizes = dims(cfg.arch)
    for i in range(cfg.arch.num_hidden_layers):
        for lin in cfg.family.linears:
            trt_name = f"transformer.layers.{i}.{lin.name}"
            pieces = rank[trt_name + ".weight"].split([sizes[p.rows] for p in lin.parts])
            for part, piece in zip(lin.parts, pieces):
                tensors[HF_LAYER.format(i) + part.hf + ".weight"] = piece.contiguous()
                tensors[HF_LAYER.format(i) + part.hf + ".weight_scale"] = rank[
                    trt_name + ".weights_scaling_factor"].reshape(()).clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_with_the_engines_scales_the_hf_checkpoint_is_the_same_model(calibrated, tmp_path):
    trt, hf, text = calibrated
    same = with_the_engines_scales(trt, hf, tmp_path / "hf-shared")
    a, b = CheckpointReader(trt), HfCheckpointReader(same)
    assert torch.equal(a.embedding(), b.embedding()) and torch.equal(a.lm_head(), b.lm_head())
    for i in range(a.num_layers):
        ours, theirs = b.layer(i), a.layer(i)
        assert ours.kv_quant == theirs.kv_quant and ours.kv_quant is not None
        assert all(torch.equal(ours.norms[n], theirs.norms[n]) for n in theirs.norms)
        for name, lin in theirs.linears.items():
            assert torch.equal(ours.linears[name].weight, lin.weight), (i, name)
            assert ours.linears[name].act_quant == lin.act_quant, (i, name)
    assert perplexity(same, text) == pytest.approx(perplexity(trt, text), rel=1e-12)


def test_calibrates_hf_export_evaluates_as_the_trtllm_checkpoint(calibrated):
    trt, hf, text = calibrated
    a, b = CheckpointReader(trt), HfCheckpointReader(hf)
    stored = load_file(str(hf / "model.safetensors"))
    double_rounded = 0
    for i in range(a.num_layers):
        ours, theirs = b.layer(i), a.layer(i)
        assert ours.kv_quant == theirs.kv_quant
        for group in fused_groups(a.cfg.family.linears):
            scales = {lin.name: [float(stored[HF_LAYER.format(i) + p.hf + ".weight_scale"]) for p in lin.parts]
                      for lin in group}
            shared = max(s for parts in scales.values() for s in parts)
            for lin in group:
                assert ours.linears[lin.name].act_quant == theirs.linears[lin.name].act_quant
                rows = [dims(a.cfg.arch)[p.rows] for p in lin.parts]
                pairs = zip(ours.linears[lin.name].weight.split(rows), theirs.linears[lin.name].weight.split(rows))
                for scale, (mine, engine) in zip(scales[lin.name], pairs):
                    if scale == shared:      # quantized once, with the scale the engine used: the same values
                        assert torch.equal(mine, engine), (i, lin.name)
                        continue
                    # quantized again with the shared scale (as the server does): on that scale's FP8 grid ...
                    on_grid = (mine / shared).to(torch.float8_e4m3fn).float() * shared
                    assert torch.equal(on_grid, mine), (i, lin.name)
                    # ... and at most one FP8 step of it from the engine's value, element by element
                    step = 2.0 ** (torch.floor(torch.log2(engine.abs().clamp(min=1e-30) / shared)) - 3) * shared
                    assert bool(((mine - engine).abs() <= step * 1.0001 + 1e-12).all()), (i, lin.name)
                    double_rounded += int((mine != engine).sum())
    assert double_rounded > 0          # this model has parts below their group's scale: the case is exercised
    ppl_hf, ppl_trt = perplexity(hf, text), perplexity(trt, text)
    assert ppl_hf == pytest.approx(ppl_trt, rel=0.02)


def rewrite(directory: Path, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


SCALE = "model.layers.1.self_attn.k_proj.weight_scale"
BREAKAGES = {
    "missing weight_scale": (lambda d: rewrite(d, lambda t: t.pop(SCALE)), f"missing tensor {SCALE}"),
    "zero input_scale": (lambda d: rewrite(d, lambda t: t.__setitem__(
        "model.layers.0.mlp.up_proj.input_scale", torch.tensor(0.0))),
        "model.layers.0.mlp.up_proj.input_scale is 0.0, not a positive finite scale"),
    "float weight where FP8 is recorded": (lambda d: rewrite(d, lambda t: t.__setitem__(
        "model.layers.2.mlp.down_proj.weight", t["model.layers.2.mlp.down_proj.weight"].float())),
        "tensor model.layers.2.mlp.down_proj.weight has dtype F32, expected float8_e4m3fn"),
    "missing KV scale": (lambda d: rewrite(d, lambda t: t.pop("model.layers.3.self_attn.v_proj.v_scale")),
                         "missing tensor model.layers.3.self_attn.v_proj.v_scale"),
    "another quantization method": (lambda d: edit_json(d / "config.json", lambda c: c["quantization_config"].update(
        quant_method="gptq")), "quant_method 'gptq' is not supported"),
    "records that disagree": (lambda d: edit_json(d / "hf_quant_config.json", lambda c: c["quantization"].update(
        kv_cache_quant_algo=None)), "hf_quant_config.json says FP8 with KV cache None"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_hf_fp8_checkpoint_is_one_clear_error(calibrated, tmp_path, breakage):
    _, hf, text = calibrated
    broken = tmp_path / "hf"
    shutil.copytree(hf, broken)
    damage, message = BREAKAGES[breakage]
    damage(broken)
    result = CliRunner().invoke(main, ["eval", str(broken), "--dataset", str(text), "--json"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
