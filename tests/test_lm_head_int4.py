"""`calibrate --precision int4-awq --quantize-lm-head`: lm_head in 4 bits (AWQ smoothing, group scales, GPTQ) in the
layout nvidia-modelopt 0.37's exporter writes for a quantized lm_head, with the exclude_modules TensorRT-LLM reads as
"quantize lm_head"; the runtime, its row-range reads, tp sharding and the ONNX export (MatMulNBits) agree on it."""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, quantized_checkpoint, resolve_recipe
from pipeline.checkpoint import LM_HEAD, TRTLLM_DEFAULT_EXCLUDE, CheckpointConfig
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.runtime.int4 import dequantize_groupwise, unpack_int4
from pipeline.runtime.trtllm_reader import CheckpointReader

from support.models import make_tiny_model
from test_onnx import assert_matches_through_cache, random_ids
from support.modelopt_int4 import GROUP, dequantized_float_checkpoint, tensors, tiny_int4_llama

HEAD = ("lm_head.weight", "lm_head.weights_scaling_factor", "lm_head.prequant_scaling_factor")


@pytest.fixture(scope="module")
def modelopt_head_exports(tmp_path_factory):
    """modelopt 0.37's TensorRT-LLM export (float16, group 64) of a tiny Llama after INT4_AWQ_CFG with lm_head's
    quantizer left on (its preset turns "*lm_head*" off), tp 1 and 2."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("modelopt-head")
    hf = tiny_int4_llama(root / "hf")
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    weight = cfg["quant_cfg"]["*weight_quantizer"]
    (weight[0] if isinstance(weight, list) else weight)["block_sizes"][-1] = GROUP
    del cfg["quant_cfg"]["*lm_head*"]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    data = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mtq.quantize(model, cfg, lambda m: [m(data[i:i + 1]) for i in range(len(data))])
        out = {}
        for tp in (1, 2):
            export_tensorrt_llm_checkpoint(model, "llama", torch.float16, root / f"tp{tp}",
                                           inference_tensor_parallel=tp)
            out[tp] = root / f"tp{tp}"
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_writer_rewrites_modelopts_quantized_lm_head_bit_for_bit(modelopt_head_exports, tp, tmp_path, monkeypatch):
    """Given modelopt's choices (smoothing and group scales, lm_head's included), the writer writes every tensor of
    modelopt's export with the same name, dtype, shape and bytes: lm_head's packing, scales and tp split are
    modelopt's. The one difference is deliberate: exclude_modules (modelopt writes [], which TensorRT-LLM's
    quantize_layers reads as its default list, lm_head included, and then expects a float lm_head)."""
    exported = modelopt_head_exports[tp]
    float_ckpt = quantized_checkpoint.open_float_checkpoint(dequantized_float_checkpoint(exported, tmp_path / "f"))
    prequant, scales = {}, {}
    for rf in float_ckpt.ranks:
        q = tensors(exported, rf.rank)
        for name in q:
            if name.endswith(".weights_scaling_factor"):
                local = name[: -len(".weights_scaling_factor")]
                module = float_ckpt.linear_of(rf.global_name(local + ".weight")) or LM_HEAD
                scales[module, rf.tp_rank] = q[name]
                prequant.setdefault(module, {})[rf.tp_rank] = q[local + ".prequant_scaling_factor"]
    full = {m: torch.cat([p[r] for r in sorted(p)]) if float_ckpt.is_row_parallel(m) else p[0]
            for m, p in prequant.items()}
    original = quantized_checkpoint._rounding_input

    def modelopts_scales(plan, module, row, tensor, tp_rank, tp_size):
        return original(plan, module, row, tensor, tp_rank, tp_size)[0], scales[module, tp_rank]

    monkeypatch.setattr(quantized_checkpoint, "_rounding_input", modelopts_scales)
    (tmp_path / "q").mkdir()
    writer = quantized_checkpoint.QuantizedCheckpointWriter(float_ckpt, "int4-awq", None, (), None, tmp_path / "q",
                                                            GROUP, quantize_lm_head=True)

    def plan(modules):
        return quantized_checkpoint.QuantPlan(
            precision="int4-awq", kv_cache=None, activation_amax={}, weight_amax={},
            prequant={m: full[m] for m in modules}, kv_amax={}, exclude=(), group_size=GROUP,
            input_moments={m: torch.ones_like(full[m]).float() for m in modules})

    for layer in range(float_ckpt.num_layers):
        writer.write_layer(layer, plan(float_ckpt.layer_modules(layer)))
    writer.write_lm_head(plan([LM_HEAD]))
    config = writer.close()
    for rank in range(tp):
        ours, theirs = tensors(tmp_path / "q", rank), tensors(exported, rank)
        assert set(ours) == set(theirs) and set(HEAD) <= set(ours)
        for name in theirs:
            assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
            assert torch.equal(ours[name].view(torch.uint8), theirs[name].view(torch.uint8)), name
    modelopts = json.loads((exported / "config.json").read_text())["quantization"]
    assert modelopts["exclude_modules"] == []
    assert config["quantization"] == {**modelopts, "exclude_modules": config["quantization"]["exclude_modules"]}
    written = CheckpointConfig.read(tmp_path / "q")
    assert written.exclude_modules and written.quantized_lm_head
    assert CheckpointReader(tmp_path / "q").lm_head().shape == (128, 128)


def test_an_empty_exclude_list_keeps_lm_head_float_as_tensorrt_llm_reads_it(modelopt_head_exports):
    """TensorRT-LLM's quantize_layers takes `exclude_modules or [default list]`: modelopt's [] means lm_head float, so
    its quantized lm_head does not match its own config there, and trtpipe's reader says so by tensor."""
    cfg = CheckpointConfig.read(modelopt_head_exports[1])
    assert cfg.exclude_modules == TRTLLM_DEFAULT_EXCLUDE
    assert not cfg.quantizes(LM_HEAD) and not cfg.quantized_lm_head
    assert cfg.quantizes("transformer.layers.0.attention.qkv")
    with pytest.raises(UserError, match=r"lm_head\.weight has dtype I8"):
        CheckpointReader(modelopt_head_exports[1])


# --- calibrate, end to end --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory, smollm2_hf_dir) -> Path:
    """A random Llama with a tied embedding (as SmolLM2's), widths that take groups of 64, SmolLM2's tokenizer."""
    d = make_tiny_model(tmp_path_factory.mktemp("head-hf"), vocab_size=49152, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf_dir / name, d / name)
    return d


@pytest.fixture(scope="module")
def head_ckpts(tied_hf, text_file, tmp_path_factory):
    """The tied model converted at tp 1 and 2 and calibrated int4-awq group 64 with --quantize-lm-head."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    root = tmp_path_factory.mktemp("head")
    recipe = resolve_recipe(str(text_file), samples=6, seq_len=48)
    out = {}
    for tp in (1, 2):
        ck = convert_model(resolve_model(str(tied_hf)), root / f"ck{tp}", dtype="float32", tp=tp, progress=False).path
        out[tp] = calibrate_checkpoint(ck, root / f"q{tp}", CalibrateOptions(
            "int4-awq", recipe, group_size=GROUP, quantize_lm_head=True, eval_samples=2, progress=False))
    out["float"] = root / "ck1"
    return out


def test_calibrate_quantizes_lm_head_and_the_runtime_reads_it(head_ckpts):
    result = head_ckpts[1]
    quant = result.config["quantization"]
    assert quant["quant_algo"] == "W4A16_AWQ" and "lm_head" not in quant["exclude_modules"] and quant["exclude_modules"]
    q = tensors(result.path)
    assert q["lm_head.weight"].dtype == torch.int8 and q["lm_head.weight"].shape == (49152 // 2, 128)
    assert q["lm_head.weights_scaling_factor"].shape == (49152, 128 // GROUP)
    assert q["transformer.vocab_embedding.weight"].dtype == torch.float32   # the embedding stays float, untied
    reader = CheckpointReader(result.path)
    expected = (dequantize_groupwise(unpack_int4(q["lm_head.weight"]), q["lm_head.weights_scaling_factor"])
                * q["lm_head.prequant_scaling_factor"].float()[None, :])
    head = reader.lm_head()
    assert torch.equal(head, expected) and not reader.tied_lm_head
    for rows in ((0, 1), (3, 1001), (4, 8), (49150, 49152)):     # odd starts and stops cut a packed pair
        assert torch.equal(reader.lm_head(rows), head[rows[0]:rows[1]])
    assert not torch.equal(head, CheckpointReader(head_ckpts["float"]).lm_head())
    assert result.perplexity["quantized"] > 0 and json.loads(
        (result.path / "calibration" / "report.json").read_text())["awq_alpha"][LM_HEAD] >= 0


def test_a_tp2_calibration_quantizes_lm_head_as_tp1_does(head_ckpts):
    """lm_head is split by vocabulary rows; every row is rounded on its own, so the shards join into tp 1's head."""
    assert torch.equal(CheckpointReader(head_ckpts[2].path).lm_head(), CheckpointReader(head_ckpts[1].path).lm_head())
    assert tensors(head_ckpts[2].path, 1)["lm_head.weight"].shape == (49152 // 4, 128)


def test_onnx_export_computes_the_4bit_lm_head_with_matmulnbits(head_ckpts, tmp_path):
    """The export's MatMulNBits on lm_head's own codes and scales (after its smoothing Mul) gives the runtime's
    logits."""
    import onnx

    from pipeline.onnx.export import ExportOptions, export_onnx
    from pipeline.onnx.runner import OrtDecoder
    from pipeline.runtime import ReferenceModel

    out = export_onnx(head_ckpts[1].path, tmp_path / "onnx", ExportOptions()).path
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert [n.input[1] for n in graph.node if n.op_type == "MatMulNBits"][-1] == "lm_head.weight"
    assert not any(n.op_type == "MatMul" and "lm_head" in "".join(n.input) for n in graph.node)
    assert_matches_through_cache(OrtDecoder(out), ReferenceModel.load(head_ckpts[1].path),
                                 random_ids(49152, 2, 12), prefill=8)


# --- bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--precision", "fp8"], "--quantize-lm-head is for --precision int4-awq"),
    (["--precision", "int4-awq", "--format", "vllm"], "writes TensorRT-LLM's checkpoint only"),
    (["--precision", "int4-awq", "--exclude", "*head"], "contradicts --exclude *head, which matches lm_head"),
])
def test_quantize_lm_head_refusals(head_ckpts, tmp_path, args, message):
    result = CliRunner().invoke(main, ["calibrate", str(head_ckpts["float"]), "-o", str(tmp_path / "out"),
                                       "--quantize-lm-head", "--seq-len", "64", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# --- plan and build -----------------------------------------------------------------------------------------------

def test_the_plan_holds_and_reads_a_4bit_lm_head(tmp_path):
    """A checkpoint whose lm_head is 4-bit: the engine plan's weights hold it in 4 bits (untied), so a step reads
    fewer bytes and more KV cache fits; the float head's plan is unchanged."""
    from pipeline.checkpoint import written_exclude_modules
    from pipeline.plan.memory import weights_per_rank_by_stage, weights_read_per_step
    from pipeline.presets import PRESETS
    from pipeline.plan.schema import ModelInfo
    from pipeline.planner import make_plan
    from pipeline.targets import get_target

    arch = PRESETS["qwen2.5-14b"].arch
    h, v = arch.hidden_size, arch.vocab_size
    float_head, int4_head = (weights_per_rank_by_stage(arch, "int4-awq", "float16", 1, 1, q)[0] for q in (False, True))
    assert float_head - int4_head == v * h * 2 - (v * h // 2 + v * (h // 128) * 4 + h * 2)
    assert weights_read_per_step(arch, "int4-awq", "float16", 1, 1, True) < \
        weights_read_per_step(arch, "int4-awq", "float16", 1, 1)

    def plan(head: bool):
        quant = {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": 128,
                 "exclude_modules": written_exclude_modules(head)}
        model = ModelInfo(name="ckpt", source="checkpoint", path=str(tmp_path), arch=arch,
                          checkpoint_quantization=quant, checkpoint_tp_size=1, checkpoint_pp_size=1)
        assert model.quantized_lm_head == head
        return make_plan(model, get_target("rtx4090"), "int4-awq")

    plain, quantized = plan(False), plan(True)
    assert plain.weights_bytes - quantized.weights_bytes == float_head - int4_head
    assert quantized.memory.kv_cache_tokens > plain.memory.kv_cache_tokens


def test_build_refuses_quantize_lm_head_where_nothing_would_hold_it(tmp_path):
    for args, message in ((["--precision", "fp8"], "--quantize-lm-head is for --precision int4-awq"),
                          (["--precision", "int4-awq", "--target", "rtx4090", "--backend", "pytorch", "--dry-run"],
                           "serves a Hugging Face checkpoint")):
        result = CliRunner().invoke(main, ["build", "smollm2-135m", "--quantize-lm-head", "-o", str(tmp_path / "b"),
                                           *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
        assert not (tmp_path / "b").exists()


def test_build_dry_run_calibrates_lm_head_too(tmp_path):
    result = CliRunner().invoke(main, ["build", "qwen2.5-14b", "--target", "rtx4090", "--precision", "int4-awq",
                                       "--quantize-lm-head", "--dry-run", "-o", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "--quantize-lm-head" in next(line for line in result.output.splitlines() if "trtpipe calibrate" in line)


def test_an_odd_vocabulary_keeps_its_lm_head_16bit(tmp_path, text_file):
    """4-bit codes pack two output rows a byte; an odd number of rows per rank is refused before anything is written."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    hf = make_tiny_model(tmp_path / "hf", vocab_size=101, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=1)
    ck = convert_model(resolve_model(str(hf)), tmp_path / "ck", dtype="float32", progress=False).path
    with pytest.raises(UserError, match="lm_head has 101 rows per tp rank .* an odd count"):
        calibrate_checkpoint(ck, tmp_path / "q", CalibrateOptions(
            "int4-awq", resolve_recipe(str(text_file), samples=2, seq_len=16), quantize_lm_head=True, progress=False))
    assert not (tmp_path / "q").exists()
