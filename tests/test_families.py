"""Model families through the registry: Qwen2 / Qwen2.5 and dense Qwen3 next to Llama.

Checked the way Llama is (tests/test_convert.py, test_runtime.py): rank files against TensorRT-LLM's
Qwen rules written out here with plain torch ops (docs/model-families.md §2.2, §6); tensors against
nvidia-modelopt 0.37's exporter (which needs TensorRT-LLM for the Qwen config only, so its config hook
is stubbed with the keys QWenConfig writes, §2.1, §3); logits against transformers; and the later stages
(calibrate, plan, deploy, validate) run on tiny random Qwens.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.errors import UserError
from pipeline.model import ARCHITECTURES, FAMILIES, family_of
from pipeline.presets import PRESETS
from pipeline.sources import resolve_model
from support.models import save_word_tokenizer
from support.trtllm_rules import expected_rank
from pipeline.model.arch_config import parameter_count


def convert(hf_dir: Path, out: Path, **kw):
    return convert_model(resolve_model(str(hf_dir)), out, progress=False, **kw)


# ------------------------------------------------------------------------------------------ registry


def test_every_architecture_belongs_to_exactly_one_family():
    assert len(ARCHITECTURES) == len(set(ARCHITECTURES))
    for family in FAMILIES:
        for arch in family.architectures:
            assert family_of(arch) is family
        assert set(family.gguf_model_types.values()) <= set(family.architectures)
    assert family_of("GPT2LMHeadModel") is None


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="unknown architecture 'GPT2LMHeadModel'.*Qwen3ForCausalLM"):
        resolve_model(str(tmp_path))


# ------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize("variant,tp,pp", [
    ("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen2", 4, 1), ("qwen2-tied", 2, 2),
    ("qwen3", 1, 1), ("qwen3", 2, 2), ("qwen3", 4, 1), ("qwen3-mqa", 4, 1),
])
def test_qwen_rank_files_follow_trtllm_rules(tiny_qwen, tmp_path, variant, tp, pp):
    hf_dir = tiny_qwen(variant)
    result = convert(hf_dir, tmp_path / "ckpt", dtype="float32", tp=tp, pp=pp)
    hf = load_file(str(hf_dir / "model.safetensors"))
    for rank in range(tp * pp):
        got = load_file(str(result.path / f"rank{rank}.safetensors"))
        want = expected_rank(hf, result.config, tp, pp, rank)
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
    assert not any(name.endswith("attention.dense.bias") for name in got)


@pytest.mark.parametrize("variant,qwen_type,bias", [("qwen2", "qwen2", True), ("qwen3", "qwen3", False)])
def test_qwen_checkpoint_config_has_the_keys_qwenconfig_writes(tiny_qwen, tmp_path, variant, qwen_type, bias):
    config = convert(tiny_qwen(variant), tmp_path / "ckpt").config
    hf = json.loads((tiny_qwen(variant) / "config.json").read_text())
    assert config["architecture"] == hf["architectures"][0]
    assert config["qwen_type"] == qwen_type and config["attn_bias"] is bias and config["mlp_bias"] is False
    assert config["seq_length"] == 8192 and config["use_logn_attn"] is False
    assert config["moe"]["num_experts"] == 0 and config["moe"]["normalization_mode"] == 0
    assert config["head_size"] == hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    assert config["norm_epsilon"] == hf["rms_norm_eps"] and config["rotary_base"] == hf["rope_theta"]
    assert "sliding_window" not in config and "qk_layernorm" not in config


@pytest.fixture
def stub_trtllm_qwen_config(monkeypatch):
    """modelopt 0.37 asks TensorRT-LLM's QWenConfig for a Qwen's config.json; stand in for it with the keys
    docs/model-families.md §2.1 lists, so the export (whose weights never depend on it) can run here."""
    class QWenConfig:
        def __init__(self, hf, mapping, quant):
            self.hf, self.mapping, self.quant = hf, mapping, quant

        @classmethod
        def from_hugging_face(cls, hf_config_or_dir, dtype, mapping, quant_config):
            return cls(hf_config_or_dir, mapping, quant_config)

        def to_dict(self):
            qwen_type = self.hf.model_type
            return {"qwen_type": qwen_type, "attn_bias": qwen_type == "qwen2", "mapping": self.mapping,
                    "quantization": self.quant, "rotary_base": self.hf.rope_theta, "seq_length": 8192}

    models = types.ModuleType("tensorrt_llm.models")
    models.MODEL_MAP = {a: type("QWenForCausalLM", (), {"config_class": QWenConfig}) for a in
                        ("Qwen2ForCausalLM", "Qwen3ForCausalLM")}
    utils = types.ModuleType("tensorrt_llm.models.modeling_utils")
    utils.Mapping = type("Mapping", (), {"from_dict": staticmethod(dict)})
    utils.QuantConfig = type("QuantConfig", (), {"from_dict": staticmethod(dict)})
    for name, module in (("tensorrt_llm", types.ModuleType("tensorrt_llm")), ("tensorrt_llm.models", models),
                         ("tensorrt_llm.models.modeling_utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("variant,tp", [("qwen2", 1), ("qwen2-tied", 2), ("qwen3", 2), ("qwen3-mqa", 4)])
def test_qwen_matches_nvidia_modelopt_export(tiny_qwen, tmp_path, stub_trtllm_qwen_config, variant, tp):
    """Same names, shapes and values as modelopt's exporter (which shards the embedding at tp > 1, and writes
    a tied Qwen2's lm_head explicitly, as trtpipe does)."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_qwen(variant)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    export_tensorrt_llm_checkpoint(model, "qwen", torch.float16, export_dir=tmp_path / "mo",
                                   inference_tensor_parallel=tp)
    convert(hf_dir, tmp_path / "ours", dtype="float16", tp=tp)
    for rank in range(tp):
        a = load_file(str(tmp_path / "ours" / f"rank{rank}.safetensors"))
        b = load_file(str(tmp_path / "mo" / f"rank{rank}.safetensors"))
        if tp > 1:
            a.pop("transformer.vocab_embedding.weight"), b.pop("transformer.vocab_embedding.weight")
        assert set(a) == set(b), sorted(set(a) ^ set(b))
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    from pipeline.runtime import ReferenceModel    # and the runtime reads modelopt's checkpoint as ours

    ids = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ReferenceModel.load(tmp_path / "mo").forward(ids),
                          ReferenceModel.load(tmp_path / "ours").forward(ids), rtol=0, atol=1e-5)


def _rewrite(hf_dir: Path, tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    tensors = load_file(str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    save_file(edit_tensors(tensors) if edit_tensors else tensors, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    return out


def test_source_tensors_the_family_does_not_have_are_refused(tiny_qwen, tmp_path):
    """An o_proj bias on a Qwen2 would be dropped silently by the converter: say so before any work."""
    hf_dir = _rewrite(tiny_qwen("qwen2"), tmp_path,
                      edit_tensors=lambda t: {**t, "model.layers.1.self_attn.o_proj.bias": torch.zeros(48)})
    result = CliRunner().invoke(main, ["convert", str(hf_dir), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "unexpected tensor(s) model.layers.1.self_attn.o_proj.bias" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_missing_qwen3_norm_is_named(tiny_qwen, tmp_path):
    hf_dir = _rewrite(tiny_qwen("qwen3"), tmp_path, edit_tensors=lambda t: {
        k: v for k, v in t.items() if k != "model.layers.2.self_attn.k_norm.weight"})
    with pytest.raises(UserError, match="missing tensor.*model.layers.2.self_attn.k_norm.weight"):
        convert(hf_dir, tmp_path / "out")


@pytest.mark.parametrize("variant,edit,message", [
    ("qwen3", {"attention_bias": True}, "attention_bias is true, but TensorRT-LLM's Qwen3 has no attention biases"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window is true"),
])
def test_layouts_the_engine_cannot_express_are_refused(tiny_qwen, tmp_path, variant, edit, message):
    hf_dir = _rewrite(tiny_qwen(variant), tmp_path, edit_config=lambda c: {**c, **edit})
    result = CliRunner().invoke(main, ["convert", str(hf_dir), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output, result.output


# ------------------------------------------------------------------------------------------- runtime


@pytest.mark.parametrize("variant,tp,pp", [
    ("qwen2", 1, 1), ("qwen2-tied", 2, 2), ("qwen3", 1, 1), ("qwen3", 2, 1), ("qwen3-mqa", 4, 2),
])
def test_reference_runtime_matches_transformers(tiny_qwen, tmp_path, variant, tp, pp):
    from transformers import AutoModelForCausalLM

    from pipeline.runtime import ReferenceModel

    hf_dir = tiny_qwen(variant)
    ckpt = convert(hf_dir, tmp_path / "ckpt", dtype="float32", tp=tp, pp=pp).path
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
    got = ReferenceModel.load(ckpt).forward(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_dropping_the_qk_norm_or_the_bias_changes_the_logits(tiny_qwen, tmp_path):
    """The parity above is not vacuous: without Qwen3's q/k norms or Qwen2's qkv bias the runtime's
    logits move far from transformers'."""
    from pipeline.runtime import ReferenceModel

    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    for variant, drop in (("qwen3", "attention.q_layernorm.weight"), ("qwen2", "attention.qkv.bias")):
        ckpt = convert(tiny_qwen(variant), tmp_path / variant, dtype="float32").path
        good = ReferenceModel.load(ckpt).forward(ids)
        tensors = load_file(str(ckpt / "rank0.safetensors"))
        key = f"transformer.layers.0.{drop}"
        tensors[key] = torch.ones_like(tensors[key]) if "norm" in drop else torch.zeros_like(tensors[key])
        save_file(tensors, str(ckpt / "rank0.safetensors"), metadata={"format": "pt"})
        assert (ReferenceModel.load(ckpt).forward(ids) - good).abs().max() > 1e-3 * good.abs().max(), variant


# --------------------------------------------------------------------------------- calibrate and plan


@pytest.mark.parametrize("variant,precision,kv", [("qwen2", "int8-sq", "int8"), ("qwen3", "fp8", "fp8")])
def test_calibrate_quantizes_qwen_and_the_runtime_serves_it(tiny_qwen, tmp_path, variant, precision, kv):
    from pipeline.runtime import ReferenceModel

    ckpt = convert(tiny_qwen(variant), tmp_path / "ckpt", dtype="float32", tp=2).path
    (ckpt / "tokenizer").mkdir(exist_ok=True)
    save_word_tokenizer(ckpt / "tokenizer")
    result = CliRunner().invoke(main, ["calibrate", str(ckpt), "--precision", precision, "--kv-cache", kv,
                                       "--samples", "4", "--seq-len", "32", "--eval-samples", "0",
                                       "-o", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    quantized = ReferenceModel.load(tmp_path / "q")
    tensors = load_file(str(tmp_path / "q" / "rank1.safetensors"))
    if variant == "qwen2":    # the qkv bias passes through in the model dtype; there is no dense bias
        assert tensors["transformer.layers.0.attention.qkv.bias"].dtype == torch.float32
        assert "transformer.layers.0.attention.dense.bias" not in tensors
    else:                     # the q/k norms are copied, the linears around them quantized
        assert tensors["transformer.layers.0.attention.k_layernorm.weight"].dtype == torch.float32
        assert tensors["transformer.layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 101, (1, 16), generator=torch.Generator().manual_seed(5))
    full = ReferenceModel.load(ckpt).forward(ids)
    assert (quantized.forward(ids) - full).abs().max() < 0.2 * full.abs().max()


@pytest.mark.parametrize("name,published", [("qwen2.5-7b", 7.62e9), ("qwen3-8b", 8.19e9)])
def test_qwen_presets_have_the_published_parameter_counts(name, published):
    assert abs(parameter_count(PRESETS[name].arch) / published - 1) < 1e-3


def test_llama32_1b_has_its_published_parameter_count():
    """Llama 3.2 1B: 1,235,814,400 parameters (embeddings tied: 128256 x 2048, 16 layers of 60,821,504, the final
    norm) — the count its model card rounds to 1.23B."""
    assert parameter_count(PRESETS["llama-3.2-1b"].arch) == 1_235_814_400


def test_qwen25_32b_has_the_parameters_a_copy_of_its_config_gives():
    """A third-party test computes 32,763,876,352 parameters from Qwen2.5-32B's config.json (docs/model-families.md
    §5): the preset's shapes give exactly that."""
    assert parameter_count(PRESETS["qwen2.5-32b"].arch) == 32_763_876_352


def test_qwen25_fp16_weights_by_hand():
    """Qwen2.5-7B at tp=2: q/k/v weights and biases split by heads, dense and down split by columns,
    norms whole, lm_head split by vocabulary rows (bf16 = 2 bytes)."""
    from pipeline.plan.memory import weights_per_rank_by_stage

    h, i, v, layers, q, kv, tp = 3584, 18944, 152064, 28, 3584, 512, 2
    per_layer = (h * (q + 2 * kv) // tp + (q + 2 * kv) // tp     # qkv weight + bias
                 + q // tp * h                                     # dense (no bias)
                 + 3 * h * i // tp                                 # fc, gate, proj
                 + 2 * h)                                          # two RMSNorms
    expected = 2 * (layers * per_layer + v * h + v // tp * h + h)
    assert weights_per_rank_by_stage(PRESETS["qwen2.5-7b"].arch, "bf16", "bfloat16", tp, 1) == [expected]


def test_qwen3_8b_fp8_plan_for_rtx4090_fits_and_counts_the_qk_norms():
    from pipeline.plan import resolve_model_info
    from pipeline.planner import make_plan
    from pipeline.plan.memory import layer_bytes_per_rank
    from pipeline.targets import get_target

    arch = PRESETS["qwen3-8b"].arch
    plan = make_plan(resolve_model_info("qwen3-8b"), get_target("rtx4090"), "fp8")
    assert plan.max_concurrent_sequences >= 1 and plan.weights_bytes < 9.5 * 2**30
    llama_like = layer_bytes_per_rank(arch, "fp16", "bfloat16", 1) - 2 * 128 * 2   # minus q/k norms [head_dim]
    assert llama_like == 2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096)


# ------------------------------------------------------------------------------- the whole build, served


@pytest.mark.slow
def test_tiny_qwen3_builds_deploys_and_validates_on_the_cpu_target(tiny_qwen, tmp_path):
    """convert, calibrate (fp8), plan, deploy and validate against the embedded Triton, golden reference
    included: the registry is all a new family needs."""
    model = tmp_path / "qwen3"
    model.mkdir()
    for f in tiny_qwen("qwen3").iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    save_word_tokenizer(model)
    result = CliRunner().invoke(main, ["build", str(model), "--target", "cpu", "--precision", "fp8",
                                       "--samples", "4", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "build.json").read_text())
    assert summary["passed"] is True, summary["verdict"]
