"""trtpipe export-onnx, proven with ONNX Runtime (CPU): the exported decoder computes the reference runtime's
logits through its KV cache, for every family, tp/pp layout and precision; the calibration cache names its
tensors; bad input stops with exit 2 and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from pipeline.calibrate.trtcache import read_calibration_cache, version_tag
from pipeline.cli import main
from pipeline.onnx.export import ExportOptions, export_onnx
from pipeline.onnx.runner import OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig, perplexity

from test_calibrate import run_calibrate

REL = 1e-4


def convert(hf_dir: Path, out: Path, **kw) -> Path:
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    return convert_model(resolve_model(str(hf_dir)), out, dtype="float32", progress=False, **kw).path


def rel_err(got, want) -> float:
    got, want = torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(want))
    return float((got - want).abs().max() / want.abs().max())


def assert_matches_through_cache(decoder: OrtDecoder, ref: ReferenceModel, ids: torch.Tensor, prefill: int,
                                 rel: float = REL) -> None:
    """Prefill `prefill` tokens, then feed the rest one at a time through the ORT cache; every step's logits
    equal the runtime's full-sequence logits at that position."""
    want = ref.forward(ids)
    logits, cache = decoder.step(ids[:, :prefill].numpy(), decoder.empty_cache(ids.shape[0]))
    assert rel_err(logits, want[:, :prefill]) <= rel
    for t in range(prefill, ids.shape[1]):
        logits, cache = decoder.step(ids[:, t:t + 1].numpy(), cache)
        assert rel_err(logits[:, 0], want[:, t]) <= rel, f"decode step at position {t}"
    assert cache.length == ids.shape[1]


def assert_prompt_group_equals_its_own_run(decoder: OrtDecoder, ids: torch.Tensor, prompt: list[int],
                                           rel: float = 1e-5) -> None:
    """A decode step of the rows `ids` (all but the last token cached) with `prompt` as the graph's prompt group: the
    rows' logits and cache are the step's alone, the prompt's last logits and cache its own prefill's."""
    ids = ids.numpy()
    _, cache = decoder.step(ids[:, :-1], decoder.empty_cache(ids.shape[0]))
    want, want_cache = decoder.step(ids[:, -1:], cache)
    alone, alone_cache = decoder.step(np.array([prompt]), decoder.empty_cache(1))
    logits, grown, prompt_logits, prompt_cache = decoder.step_with_prompt(ids[:, -1:], cache, prompt)
    assert decoder.mixes_prompts and logits.shape == want.shape and prompt_logits.shape == alone.shape[2:]
    assert rel_err(logits, want) <= rel and rel_err(prompt_logits, alone[0, -1]) <= rel
    assert np.array_equal(grown.mask, want_cache.mask) and prompt_cache.mask.tolist() == [[1] * len(prompt)]
    for name, tensor in want_cache.tensors.items():
        assert rel_err(grown.tensors[name], tensor) <= rel
        assert rel_err(prompt_cache.tensors[name], alone_cache.tensors[name]) <= rel


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


FLOAT_CASES = [("llama", "gqa"), ("llama", "mqa"), ("llama", "tied"), ("llama", "llama3-rope"), ("llama", "mistral"),
               ("qwen", "qwen2"), ("qwen", "qwen2-tied"), ("qwen", "qwen3"), ("qwen", "qwen3-mqa")]


@pytest.mark.parametrize("family,variant", FLOAT_CASES)
def test_float_export_equals_runtime_through_kv_cache_and_in_greedy_generation(family, variant, tiny_llama,
                                                                               tiny_qwen, tmp_path):
    hf = (tiny_llama if family == "llama" else tiny_qwen)(variant)
    ckpt = convert(hf, tmp_path / "ckpt")
    result = export_onnx(ckpt, tmp_path / "onnx")
    assert result.precision == "fp32" and not result.external_data
    model = onnx.load(tmp_path / "onnx" / "model.onnx")
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert [d.dim_param or d.dim_value for d in inferred.graph.output[0].type.tensor_type.shape.dim] == \
        ["batch_size", "kept_sequence_length", 101]      # the last logits_to_keep positions (default: all)
    decoder, ref = OrtDecoder(tmp_path / "onnx"), ReferenceModel.load(ckpt)
    assert_matches_through_cache(decoder, ref, random_ids(101, 2, 14), prefill=9)
    assert_prompt_group_equals_its_own_run(decoder, random_ids(101, 3, 12, seed=1),
                                           random_ids(101, 1, 9, seed=2)[0].tolist())
    prompt = random_ids(101, 1, 7, seed=3)[0].tolist()
    greedy = SamplingConfig(max_new_tokens=12)
    assert decoder.generate([prompt], greedy) == ref.generate([prompt], greedy)


def test_batched_generation_of_prompts_of_different_lengths_equals_the_runtime(checkpoint, tmp_path):
    """Left-padded prefill, rows leaving the cache as they end (max tokens, end_id, a stop word), and seeded
    sampling: the same tokens, streamed in the same order, as the torch runtime."""
    ckpt = checkpoint("gqa")
    export_onnx(ckpt, tmp_path / "onnx")
    decoder, ref = OrtDecoder(tmp_path / "onnx"), ReferenceModel.load(ckpt)
    prompts = [random_ids(101, 1, n, seed=n)[0].tolist() for n in (3, 11, 6, 8)]
    free = ref.generate(prompts, SamplingConfig(max_new_tokens=10))
    configs = [SamplingConfig(max_new_tokens=4), SamplingConfig(max_new_tokens=10, end_id=free[1][5]),
               SamplingConfig(max_new_tokens=10, stop_words=[free[2][2:4]]),
               SamplingConfig(max_new_tokens=10, top_k=20, temperature=0.7, seed=5)]
    streams = ([], [])
    got = decoder.generate(prompts, configs, on_token=lambda r, t: streams[0].append((r, t)))
    want = ref.generate(prompts, configs, on_token=lambda r, t: streams[1].append((r, t)))
    assert got == want and streams[0] == streams[1]
    stop_at = next(i + 2 for i in range(9) if free[2][i:i + 2] == free[2][2:4])
    assert [len(out) for out in got[:3]] == [4, free[1].index(free[1][5]), stop_at]


def test_io_names_and_genai_config_follow_onnxruntime_genai(checkpoint, tmp_path):
    export_onnx(checkpoint("gqa"), tmp_path / "onnx")
    model = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs[3:5] == ["past_key_values.0.key", "past_key_values.0.value"] and len(inputs) == 3 + 2 * 4 + 2
    assert inputs[-2:] == ["logits_to_keep", "prompt_ids"]          # the optional inputs, with their defaults
    assert {"logits_to_keep", "prompt_ids"} <= {t.name for t in model.graph.initializer}
    assert outputs[:3] == ["logits", "present.0.key", "present.0.value"] and len(outputs) == 2 * (1 + 2 * 4)
    assert outputs[9:12] == ["prompt_logits", "prompt_present.0.key", "prompt_present.0.value"]
    past = [d.dim_param or d.dim_value for d in model.graph.input[3].type.tensor_type.shape.dim]
    assert past == ["batch_size", 2, "past_sequence_length", 6]
    cfg = json.loads((tmp_path / "onnx" / "genai_config.json").read_text())["model"]["decoder"]
    assert cfg["inputs"]["past_key_names"] % 3 == "past_key_values.3.key"
    assert cfg["outputs"]["present_value_names"] % 1 == "present.1.value"
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_size"]) == (4, 2, 6)


def test_padded_batch_attends_only_to_unmasked_keys(checkpoint, tmp_path):
    """A left-padded row (attention_mask 0 on the pads) gives the logits of the unpadded sequence."""
    ckpt = checkpoint("gqa")
    export_onnx(ckpt, tmp_path / "onnx")
    decoder, ref = OrtDecoder(tmp_path / "onnx"), ReferenceModel.load(ckpt)
    ids = random_ids(101, 1, 6, seed=5)
    padded = np.concatenate([np.zeros((1, 3), np.int64), ids.numpy()], axis=1)
    mask = np.concatenate([np.zeros((1, 3), np.int64), np.ones((1, 6), np.int64)], axis=1)
    feeds = {"input_ids": padded, "attention_mask": mask,
             "position_ids": np.array([[0, 0, 0, 0, 1, 2, 3, 4, 5]], np.int64),
             **decoder.empty_cache(1).tensors}
    logits = decoder.session.run(["logits"], feeds)[0]
    assert rel_err(logits[:, 3:], ref.forward(ids)) <= REL


def test_a_prefill_keeps_only_its_last_logits_and_an_older_export_still_serves(checkpoint, tmp_path, monkeypatch):
    """logits_to_keep N gives the last N positions' logits of the full computation, and its default (the input not
    fed) every position; a runner on an export without the input slices the full logits instead."""
    export_onnx(checkpoint("gqa"), tmp_path / "onnx")
    decoder = OrtDecoder(tmp_path / "onnx")
    ids, cache = random_ids(101, 2, 7, seed=3).numpy(), decoder.empty_cache(2)
    full, _ = decoder.step(ids, cache)
    assert decoder.keeps_logits and full.shape[1] == 7
    feeds = {"input_ids": ids, "attention_mask": np.ones((2, 7), np.int64),
             "position_ids": np.tile(np.arange(7), (2, 1)), **cache.tensors}
    for keep, width in ((3, 3), (1, 1), (0, 7), (9, 7)):
        kept = decoder.session.run(["logits"], {**feeds, "logits_to_keep": np.array(keep, np.int64)})[0]
        assert kept.shape[1] == width and np.allclose(kept, full[:, 7 - width:], rtol=1e-5, atol=1e-5)
    last, grown = decoder.step(ids, cache, last_only=True)
    assert last.shape[1] == 1 and np.allclose(last, full[:, -1:], rtol=1e-5, atol=1e-5) and grown.length == 7
    monkeypatch.setattr(decoder, "keeps_logits", False)
    old, _ = decoder.step(ids, cache, last_only=True)
    assert old.shape[1] == 1 and np.allclose(old, full[:, -1:], rtol=1e-5, atol=1e-5)


def test_onnxruntime_fuses_every_rms_norm_into_one_kernel(checkpoint, tmp_path):
    """x^2 written as Pow(x, 2) is the pattern ONNX Runtime's SimplifiedLayerNormalization fusion matches (Mul(x, x)
    is not): each of the 2 norms per layer and ln_f is one kernel in the optimized graph, no ReduceMean left."""
    import onnxruntime as ort

    from pipeline.onnx.runner import session_options

    export_onnx(checkpoint("gqa"), tmp_path / "onnx")
    options = session_options(ort, "fp32", threads=None)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert ops.count("SimplifiedLayerNormalization") + ops.count("SkipSimplifiedLayerNormalization") == 2 * 4 + 1
    assert "ReduceMean" not in ops


def test_tp_pp_checkpoint_exports_the_same_model(checkpoint, tmp_path):
    export_onnx(checkpoint("gqa"), tmp_path / "one")
    export_onnx(checkpoint("gqa", tp=2, pp=2), tmp_path / "sharded")
    ids = random_ids(101, 2, 10)
    one, sharded = OrtDecoder(tmp_path / "one").forward(ids), OrtDecoder(tmp_path / "sharded").forward(ids)
    assert rel_err(sharded, one) <= 1e-6


def test_external_data_and_fp16_weights(checkpoint, tmp_path):
    ckpt = checkpoint("gqa")
    result = export_onnx(ckpt, tmp_path / "ext", ExportOptions(external_data_over=0))
    assert result.external_data and (tmp_path / "ext" / "model.onnx.data").stat().st_size > 100_000
    assert (tmp_path / "ext" / "model.onnx").stat().st_size < 100_000
    ref = ReferenceModel.load(ckpt)
    ids = random_ids(101, 1, 8)
    assert rel_err(OrtDecoder(tmp_path / "ext").forward(ids), ref.forward(ids)) <= REL
    export_onnx(ckpt, tmp_path / "half", ExportOptions(precision="fp16"))
    model = onnx.load(tmp_path / "half" / "model.onnx")
    weight = next(t for t in model.graph.initializer if t.name == "transformer.layers.0.attention.qkv.weight")
    assert weight.data_type == onnx.TensorProto.FLOAT16
    err = rel_err(OrtDecoder(tmp_path / "half").forward(ids), ref.forward(ids))
    assert 0 < err <= 1e-2          # half-precision weights: close, not equal


@pytest.fixture(scope="session")
def quantized(tiny_ckpt, text_file, tmp_path_factory):  # noqa: F811
    """precision -> (calibrated checkpoint, its export), with a quantized KV cache as well."""
    made = {}
    for precision, kw in (("fp8", dict(kv_cache="fp8")), ("int8-sq", dict(kv_cache="int8", alpha=0.6,
                                                                            weight_rounding="nearest"))):
        root = tmp_path_factory.mktemp(f"onnx-{precision}")
        ckpt = run_calibrate(tiny_ckpt, root / "ckpt", precision, text_file, **kw).path
        made[precision] = (ckpt, export_onnx(ckpt, root / "onnx").path)
    return made


def held_out(tokenizer_dir: Path, count: int = 8) -> list[list[int]]:
    from transformers import AutoTokenizer

    from pipeline.evaluate import corpus_split

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tok(t)["input_ids"][:48] for t in corpus_split(seed=0)[1] if t.strip()][:count]


@pytest.mark.parametrize("precision,fmt", [("fp8", onnx.TensorProto.FLOAT8E4M3FN), ("int8-sq", onnx.TensorProto.INT8)])
def test_quantized_export_has_qdq_and_equals_the_runtime_simulation(precision, fmt, quantized, tiny_hf):  # noqa: F811
    ckpt, onnx_dir = quantized[precision]
    model = onnx.load(onnx_dir / "model.onnx")
    ops = [n.op_type for n in model.graph.node]
    # 4 layers x (qkv, dense, fc, gate, proj activations + K and V) quantize/dequantize pairs
    assert ops.count("QuantizeLinear") == 4 * 7
    weights = {t.name: t for t in model.graph.initializer}
    for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        assert weights[f"transformer.layers.2.{name}.weight"].data_type == fmt
    assert ("transformer.layers.0.mlp.fc.prequant_scaling_factor" in weights) == (precision == "int8-sq")
    ref, decoder = ReferenceModel.load(ckpt), OrtDecoder(onnx_dir)
    assert_matches_through_cache(decoder, ref, random_ids(49152, 2, 12), prefill=8)
    assert_prompt_group_equals_its_own_run(decoder, random_ids(49152, 2, 10, seed=1),
                                           random_ids(49152, 1, 6, seed=2)[0].tolist())
    seqs = held_out(tiny_hf)
    ppl_ref, ppl_ort = perplexity(ref, seqs, window=48), perplexity(decoder, seqs, window=48)
    assert ppl_ort.tokens == ppl_ref.tokens > 200
    assert abs(ppl_ort.perplexity / ppl_ref.perplexity - 1) <= 0.005


@pytest.mark.parametrize("precision", ["int8-sq", "fp8"])
def test_onnxruntime_never_dequantizes_a_weight_at_run_time(precision, quantized, tmp_path, monkeypatch):
    """What makes a quantized export fast on the CPU, in ONNX Runtime's optimized graph as the runner opens it: each
    INT8-SQ linear is one integer GEMM (a QuantizeLinear shared by fc and gate kept both in float32), FP8 weights
    (no FP8 GEMM on the CPU) are dequantized once at load; no DequantizeLinear reads a weight on every step."""
    import onnxruntime as ort

    from pipeline.onnx.runner import session_options

    _, onnx_dir = quantized[precision]
    monkeypatch.setattr("pipeline.onnx.runner.int8_gemm_saturates", lambda: False)     # a VNNI processor
    options = session_options(ort, precision, threads=None)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(onnx_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    graph = onnx.load(tmp_path / "optimized.onnx").graph
    quantized_types = (onnx.TensorProto.INT8, onnx.TensorProto.FLOAT8E4M3FN)
    weights = {t.name for t in graph.initializer if t.data_type in quantized_types and len(t.dims) == 2}
    assert [n.input[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights] == []
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulIntegerToFloat") == (4 * 5 if precision == "int8-sq" else 0)


def test_calibration_cache_names_the_tensors_the_graph_quantizes(quantized):
    ckpt, onnx_dir = quantized["int8-sq"]
    cache = read_calibration_cache(ckpt / "calibration" / "calibration.cache")
    model = onnx.load(onnx_dir / "model.onnx")
    scales = {t.name: float(onnx.numpy_helper.to_array(t)) for t in model.graph.initializer if t.dims == []
              and t.data_type == onnx.TensorProto.FLOAT}
    quantizes = {n.input[0]: n.input[1] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    produced = {o for n in model.graph.node for o in n.output}
    assert len(cache) == 4 * 4          # the linears' inputs (mlp.gate shares mlp.fc's); K/V are not in the cache
    for name, amax in cache.items():
        assert name in produced, name
        # the graph quantizes exactly that tensor, with the scale the cache records
        assert scales[quantizes[name]] == pytest.approx(amax / 127.0, rel=1e-6), name


def test_calibration_cache_header_per_tensorrt_version():
    assert version_tag((10, 14, 1)) == 101401
    assert version_tag((10, 3, 0)) == 100300
    assert version_tag((8, 6, 1)) == 8601


def test_cli_exports_and_refuses_bad_input_without_writing(checkpoint, tmp_path):
    ckpt, runner = checkpoint("gqa"), CliRunner()
    ok = runner.invoke(main, ["export-onnx", str(ckpt), "-o", str(tmp_path / "onnx"), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["precision"] == "fp32"
    again = runner.invoke(main, ["export-onnx", str(ckpt), "-o", str(tmp_path / "onnx"), "--json"])
    assert json.loads(again.output)["skipped"] is True
    for args, message in ((["--precision", "int8-sq"], "trtpipe calibrate"), (["--opset", "13"], "--opset 13"),
                          (["--precision", "fp8"], "is not quantized")):
        bad = runner.invoke(main, ["export-onnx", str(ckpt), "-o", str(tmp_path / "bad"), *args])
        assert bad.exit_code == 2 and message in bad.output, bad.output
        assert not (tmp_path / "bad").exists()
    missing = runner.invoke(main, ["export-onnx", str(tmp_path / "nothing"), "-o", str(tmp_path / "bad")])
    assert missing.exit_code == 2 and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_smollm2_export_equals_runtime(smollm2_checkpoint, tmp_path):
    export_onnx(smollm2_checkpoint, tmp_path / "onnx")
    decoder, ref = OrtDecoder(tmp_path / "onnx"), ReferenceModel.load(smollm2_checkpoint)
    assert_matches_through_cache(decoder, ref, random_ids(49152, 1, 24), prefill=16)
    prompt = random_ids(49152, 1, 10, seed=1)[0].tolist()
    greedy = SamplingConfig(max_new_tokens=16)
    assert decoder.generate([prompt], greedy) == ref.generate([prompt], greedy)


def test_trtexec_command_shapes_come_from_the_plan():
    from pipeline.onnx.trtexec import trtexec_command
    from pipeline.plan import resolve_model_info
    from pipeline.planner import make_plan
    from pipeline.targets import get_target

    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")
    argv = trtexec_command(plan, "onnx/model.onnx", "model.plan", "fp8", layers=32, kv_heads=8, head_size=128)
    flags = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    assert argv[0] == "trtexec" and flags["--onnx"] == "onnx/model.onnx" and argv[-2:] == ["--fp16", "--fp8"]
    batch, build = plan.optimization_profiles[0].batch_size_beam_width, plan.build_config
    for k, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
        shapes = dict(s.split(":") for s in flags[flag].split(","))
        assert len(shapes) == 3 + 2 * 32
        b, t = map(int, shapes["input_ids"].split("x"))
        assert b == batch[k] and t == (1, 1, build.max_input_len)[k]
        _, heads, past, d = map(int, shapes["past_key_values.31.value"].split("x"))
        assert (heads, d) == (8, 128) and shapes["attention_mask"] == f"{b}x{past + t}"


@pytest.fixture(scope="session")
def int8_sq_tp2(tiny_hf, text_file, tmp_path_factory):  # noqa: F811
    """An INT8-SQ checkpoint calibrated on a tp=2 conversion, and its export."""
    root = tmp_path_factory.mktemp("onnx-int8-tp2")
    ckpt = run_calibrate(convert(tiny_hf, root / "float", tp=2), root / "ckpt", "int8-sq", text_file,
                         alpha=0.6, weight_rounding="nearest").path
    return ckpt, export_onnx(ckpt, root / "onnx").path


def test_int8_sq_tp2_export_computes_each_ranks_slice_with_its_own_scales(int8_sq_tp2, tmp_path, monkeypatch):
    """Row-parallel layers of a tp=2 INT8-SQ checkpoint carry one per-channel scale vector per rank (issue 29: the
    export refused them): one integer GEMM per rank's slice of the input, summed; logits equal the runtime's."""
    import onnxruntime as ort

    from pipeline.onnx.runner import session_options

    ckpt, onnx_dir = int8_sq_tp2
    model = onnx.load(onnx_dir / "model.onnx")
    weights = {t.name for t in model.graph.initializer}
    for name in ("attention.dense", "mlp.proj"):
        assert {f"transformer.layers.1.{name}.rank{r}.weight" for r in (0, 1)} <= weights, name
        assert f"transformer.layers.1.{name}.weight" not in weights
    assert "transformer.layers.1.mlp.fc.weight" in weights    # column-parallel: one weight, scales concatenated
    ref, decoder = ReferenceModel.load(ckpt), OrtDecoder(onnx_dir)
    assert_matches_through_cache(decoder, ref, random_ids(49152, 2, 12), prefill=8)
    monkeypatch.setattr("pipeline.onnx.runner.int8_gemm_saturates", lambda: False)     # a VNNI processor
    options = session_options(ort, "int8-sq", threads=None)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(onnx_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert ops.count("MatMulIntegerToFloat") == 4 * 7   # qkv, fc, gate, and two slices each of dense and proj


def test_a_saturating_processor_computes_int8_linears_in_float32(quantized, tmp_path, monkeypatch):
    """Without VNNI ONNX Runtime's u8 x s8 GEMM clamps its pairwise sums to 16 bits (11% off the runtime's logits
    measured on an AVX2 EPYC): there the weights are dequantized once at load and no integer GEMM is left."""
    import onnxruntime as ort

    from pipeline.onnx.runner import session_options

    ckpt, onnx_dir = quantized["int8-sq"]
    monkeypatch.setattr("pipeline.onnx.runner.int8_gemm_saturates", lambda: True)
    options = session_options(ort, "int8-sq", threads=None)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(onnx_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert "MatMulIntegerToFloat" not in ops and "QuantizeLinear" in ops
    assert_matches_through_cache(OrtDecoder(onnx_dir), ReferenceModel.load(ckpt), random_ids(49152, 2, 12), prefill=8)


@pytest.mark.parametrize("machine,flags,saturates", [
    ("x86_64", "fpu avx2 fma", True), ("x86_64", "avx2 avx512f avx512_vnni", False), ("x86_64", "avx2 avx_vnni", False),
    ("aarch64", "fp asimd", False)])
def test_int8_gemm_saturation_is_read_off_the_processor(machine, flags, saturates, tmp_path, monkeypatch):
    from pipeline import host

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n")
    monkeypatch.setattr(host.platform, "machine", lambda: machine)
    assert host.int8_gemm_saturates(cpuinfo) is saturates
    assert host.int8_gemm_saturates(tmp_path / "missing") is (machine == "x86_64")
