"""One calibrated checkpoint for every server (issue 13): `trtpipe calibrate --format both` writes, next to
the TensorRT-LLM checkpoint, the same calibration as a Hugging Face FP8 checkpoint in nvidia-modelopt
0.37's unified HF layout. Oracle: modelopt's own `export_hf_checkpoint` of the same model, its activation
and KV quantizers set to the scales trtpipe calibrated; every tensor must match in name, dtype, shape and
value, and the quantization configs must say the same."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from support.models import save_word_tokenizer
from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.runtime.trtllm_reader import CheckpointReader
from pipeline.sources import resolve_model


def calibrated(hf_dir: Path, tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    ckpt = convert_model(resolve_model(str(hf_dir)), tmp_path / "ckpt", progress=False).path
    (ckpt / "tokenizer").mkdir(exist_ok=True)
    save_word_tokenizer(ckpt / "tokenizer")
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", "fp8", "--samples", "4",
                                       "--seq-len", "32", "--eval-samples", "0", "--format", "both", "--quiet",
                                       "-o", str(tmp_path / "fp8"), *extra])
    assert result.exit_code == 0, result.output
    return ckpt, tmp_path / "fp8"


def modelopt_export(hf_dir: Path, trtpipe_ckpt: Path, out: Path, kv: bool) -> None:
    """modelopt's HF export of the model, quantized with modelopt's FP8 (+KV) recipe and then given trtpipe's
    activation and KV scales (modelopt computes the weight scales itself, from the weights)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if kv:
        cfg["quant_cfg"].update(mtq.FP8_KV_CFG["quant_cfg"])
    data = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: [m(data[i:i + 1]) for i in range(len(data))])
    ours = CheckpointReader(trtpipe_ckpt)
    modules = {"self_attn.q_proj": "attention.qkv", "self_attn.k_proj": "attention.qkv",
               "self_attn.v_proj": "attention.qkv", "self_attn.o_proj": "attention.dense",
               "mlp.gate_proj": "mlp.fc", "mlp.up_proj": "mlp.gate", "mlp.down_proj": "mlp.proj"}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            theirs_layer = ours.layer(i)
            for hf_name, trt_name in modules.items():
                module = layer.get_submodule(hf_name)
                module.input_quantizer.amax = torch.tensor(theirs_layer.linears[trt_name].act_quant.scale * 448.0)
            if kv:
                rf = ours.ranks[0]
                for kind in "kv":
                    scale = float(rf.read(f"transformer.layers.{i}.attention.{kind}_cache_scaling_factor")[0])
                    getattr(layer.self_attn, f"{kind}_bmm_quantizer").amax = torch.tensor(scale * 448.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_hf_checkpoint(model, export_dir=out)


@pytest.mark.parametrize("variant,kv", [("gqa", True), ("tied", False)])
def test_hf_export_matches_modelopts_unified_layout(tiny_llama, tmp_path, variant, kv):
    hf_dir = tiny_llama(variant)
    _, fp8 = calibrated(hf_dir, tmp_path, *(["--kv-cache", "fp8"] if kv else []))
    modelopt_export(hf_dir, fp8, tmp_path / "mo", kv)
    ours = load_file(str(fp8 / "hf" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "mo" / "model.safetensors"))
    if "lm_head.weight" not in ours:              # tied: modelopt saves the shared table twice
        theirs.pop("lm_head.weight", None)
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor.float(), theirs[name].float()), name
    ours_q = json.loads((fp8 / "hf" / "hf_quant_config.json").read_text())["quantization"]
    theirs_q = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert ours_q == theirs_q
    ours_cfg = json.loads((fp8 / "hf" / "config.json").read_text())["quantization_config"]
    theirs_cfg = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in ours_cfg.items() if k != "producer"} == \
           {k: v for k, v in theirs_cfg.items() if k != "producer"}


def test_the_hf_checkpoint_loads_in_transformers_as_the_same_model(tiny_llama, tmp_path):
    """Its config.json is a complete Hugging Face config of the model (the family spec's inverse)."""
    from transformers import AutoConfig

    hf_dir = tiny_llama("gqa")
    _, fp8 = calibrated(hf_dir, tmp_path)
    ours, theirs = AutoConfig.from_pretrained(fp8 / "hf").to_dict(), AutoConfig.from_pretrained(hf_dir).to_dict()
    for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        assert ours[key] == theirs[key], key


def test_formats_the_hf_layout_cannot_hold_are_refused(tiny_llama, tmp_path):
    ckpt = convert_model(resolve_model(str(tiny_llama("gqa"))), tmp_path / "ckpt", progress=False).path
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", "int8-sq", "--format", "both",
                                       "-o", str(tmp_path / "sq")])
    assert result.exit_code == 2 and "for --precision fp8, int4-awq, w4a8-awq" in result.output
    assert not (tmp_path / "sq").exists()


def test_format_hf_writes_the_hugging_face_checkpoint_alone(tiny_llama, tmp_path):
    """`--format hf`: OUT is the Hugging Face FP8 checkpoint `--format both` puts in OUT/hf (same tensors, same
    configs), with no TensorRT-LLM copy beside it; its report's perplexity is that checkpoint's."""
    ckpt, both = calibrated(tiny_llama("gqa"), tmp_path / "both", "--kv-cache", "fp8")
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", "fp8", "--kv-cache", "fp8",
                                       "--samples", "4", "--seq-len", "32", "--eval-samples", "2", "--format", "hf",
                                       "--quiet", "--json", "-o", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = tmp_path / "hf"
    assert not list(hf.rglob("rank*.safetensors")) and not (hf / "hf").exists()
    assert not any(p.name.startswith(".trtllm") for p in hf.iterdir())
    ours, theirs = load_file(str(hf / "model.safetensors")), load_file(str(both / "hf" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("config.json", "hf_quant_config.json"):
        mine, other = json.loads((hf / name).read_text()), json.loads((both / "hf" / name).read_text())
        assert mine == other, name
    assert (hf / "tokenizer.json").is_file()
    report = json.loads(result.output)
    assert report["quantization"]["quant_algo"] == "FP8" and report["quantization"]["kv_cache_quant_algo"] == "FP8"
    from pipeline.calibrate.data import load_tokenizer
    from pipeline.calibrate.stage import EVAL_WINDOW, heldout_sequences
    from pipeline.runtime import LayerStream, perplexity

    heldout = heldout_sequences(load_tokenizer(ckpt), 2)
    scored = perplexity(LayerStream(hf, "cpu"), heldout, window=EVAL_WINDOW, progress=False)
    assert scored.perplexity == pytest.approx(report["perplexity"]["quantized"], rel=1e-12)
    trtllm = perplexity(LayerStream(both, "cpu"), heldout, window=EVAL_WINDOW, progress=False)
    assert scored.perplexity != trtllm.perplexity   # the HF checkpoint's own figure, not the engine copy's
    # up to date: a second run writes nothing and says so
    again = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", "fp8", "--kv-cache", "fp8",
                                      "--samples", "4", "--seq-len", "32", "--eval-samples", "2", "--format", "hf",
                                      "--quiet", "--json", "-o", str(hf)])
    assert again.exit_code == 0 and json.loads(again.output)["skipped"] is True
    assert json.loads(again.output)["quantization"]["quant_algo"] == "FP8"
