"""`trtpipe distill`: the student's network is the runtime's computation, a 2:4 student learns toward its teacher
and keeps its zeros, a quantized one trains through its quantizers and comes back in its own format, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe
from pipeline.calibrate.stage import heldout_sequences
from pipeline.checkpoint import CheckpointConfig
from pipeline.cli import main
from pipeline.distill.network import StraightThrough, kl_to_teacher, load_network, teacher_log_probs
from pipeline.distill.stage import FINAL_LR, WARMUP_STEPS, learning_rate, training_windows
from pipeline.runtime import LayerStream, perplexity
from pipeline.runtime.quant import TensorQuant
from support.models import make_tiny_model

STEPS, BATCH, SEQ = 24, 2, 32


def cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def distill(student: Path, out: Path, teacher: Path, data: Path, *extra):
    return cli("distill", student, "-o", out, "--teacher", teacher, "--dataset", data, "--seq-len", SEQ,
               "--batch", BATCH, "--quiet", *extra)


def calibrate(ckpt: Path, out: Path, data: Path, precision: str, *extra) -> Path:
    result = cli("calibrate", ckpt, "-o", out, "--precision", precision, "--dataset", data, "--samples", "4",
                 "--seq-len", "32", "--eval-samples", "0", "--quiet", *extra)
    assert result.exit_code == 0, result.output
    return out


def heldout_kl(student: Path, teacher: Path, count: int = 3, seqs: list[list[int]] | None = None) -> float:
    """Mean KL(teacher || student) per token over the first held-out documents (or `seqs`)."""
    seqs = seqs or heldout_sequences(load_tokenizer(student), count)
    s, t = load_network(student, trainable=False), load_network(teacher, trainable=False)
    total = tokens = 0
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            hidden = s.hidden(ids).reshape(len(seq), -1)
            total += float(kl_to_teacher(hidden, s.lm_head, teacher_log_probs(t, ids))) * len(seq)
            tokens += len(seq)
    return total / tokens


@pytest.fixture(scope="module")
def sharp_ckpt(smollm2_hf_dir, tmp_path_factory) -> Path:
    """A tiny random Llama with weights ten times HF's initial scale, so its next-token distributions are peaked
    and pruning half its weights costs something to recover (tiny_hf's are near uniform)."""
    hf = make_tiny_model(tmp_path_factory.mktemp("sharp-hf"), vocab_size=49152, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hf / name).write_bytes((smollm2_hf_dir / name).read_bytes())
    out = tmp_path_factory.mktemp("sharp") / "ckpt"
    assert cli("convert", hf, "-o", out, "--precision", "fp32").exit_code == 0
    return out


@pytest.fixture(scope="module")
def sharp_sparse(sharp_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharp-24") / "ckpt-24"
    result = cli("sparsify", sharp_ckpt, "-o", out, "--method", "magnitude", "--eval-samples", "0", "--quiet")
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def distilled(sharp_sparse, sharp_ckpt, text_file, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("kd") / "ckpt-24-kd"
    result = distill(sharp_sparse, out, sharp_ckpt, text_file, "--tokens", STEPS * BATCH * SEQ, "--lr", "1e-2",
                     "--eval-samples", "3", "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output)


def test_the_network_computes_what_the_runtime_computes(tiny_ckpt, text_file, tmp_path):
    """The student trains on the reference runtime's own computation: the same perplexity, float and through an
    FP8 checkpoint's quantizers (weights, activations, K/V)."""
    fp8 = calibrate(tiny_ckpt, tmp_path / "fp8", text_file, "fp8", "--kv-cache", "fp8")
    seq = heldout_sequences(load_tokenizer(tiny_ckpt), 1)[0][:64]
    for ckpt in (tiny_ckpt, fp8):
        net = load_network(ckpt, trainable=True)
        ids = torch.tensor([seq])
        with torch.no_grad():
            logits = F.linear(net.hidden(ids)[0, :-1], net.lm_head)
        nll = float(F.cross_entropy(logits, ids[0, 1:]))
        runtime = perplexity(LayerStream(ckpt), [seq], window=64)
        assert nll == pytest.approx(runtime.nll, rel=1e-4), ckpt.name


def test_the_straight_through_quantizer_rounds_forward_and_passes_the_gradient_back():
    quant = TensorQuant("int8", 0.1)
    x = torch.linspace(-1.0, 1.0, 23, requires_grad=True)
    y = StraightThrough(quant)(x)
    assert torch.equal(y.detach(), quant(x.detach()))
    (y * torch.arange(23.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(23.0))


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    peak = 1e-3
    assert learning_rate(peak, 0, 0.0) == pytest.approx(peak / WARMUP_STEPS)
    assert learning_rate(peak, WARMUP_STEPS, 0.0) == pytest.approx(peak)
    assert learning_rate(peak, 100, 0.5) == pytest.approx(peak * (FINAL_LR + (1 - FINAL_LR) / 2))
    assert learning_rate(peak, 100, 1.0) == pytest.approx(peak * FINAL_LR)


def test_a_sparse_student_learns_toward_its_teacher_and_keeps_its_zeros(distilled, sharp_sparse, sharp_ckpt):
    out, result = distilled
    assert (result["steps"], result["tokens_seen"]) == (STEPS, STEPS * BATCH * SEQ)
    assert result["quantization_aware"] is False
    assert heldout_kl(out, sharp_ckpt) < 0.95 * heldout_kl(sharp_sparse, sharp_ckpt)
    before, after = load_file(sharp_sparse / "rank0.safetensors"), load_file(out / "rank0.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in before.items()} == {k: (v.dtype, v.shape) for k, v in after.items()}
    for name, w in after.items():
        if name.startswith("transformer.layers.") and w.dim() == 2:
            assert torch.equal(w == 0, before[name] == 0), name
            assert not torch.equal(w, before[name]), f"{name} did not train"
        elif not name.startswith("transformer.layers."):
            assert torch.equal(w, before[name]), f"{name} is not the student's"
    assert CheckpointConfig.read(out).sparsity == CheckpointConfig.read(sharp_sparse).sparsity


def test_the_report_holds_the_curve_and_the_three_perplexities(distilled):
    out, result = distilled
    report = json.loads((out / "distill" / "report.json").read_text())
    curve = report["loss_curve"]
    assert curve["tokens"] == [BATCH * SEQ * (i + 1) for i in range(STEPS)] and len(curve["kl"]) == STEPS
    assert all(math.isfinite(k) and k > 0 for k in curve["kl"])
    assert all(math.isfinite(report["perplexity"][k]) for k in ("teacher", "before", "after"))
    assert report["perplexity"] == result["perplexity"] and report["bf16"] is True
    assert (out / "distill" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["distill"]["steps"] == STEPS


def test_the_same_request_again_is_up_to_date(distilled, sharp_sparse, sharp_ckpt, text_file):
    out, _ = distilled
    result = distill(sharp_sparse, out, sharp_ckpt, text_file, "--tokens", STEPS * BATCH * SEQ, "--lr", "1e-2",
                     "--eval-samples", "3")
    assert result.exit_code == 0 and "up to date" in result.output, result.output


@pytest.mark.parametrize("precision, kv", [("fp8", "fp8"), ("int8-sq", "int8")])
def test_a_quantized_student_trains_through_its_quantizers_and_keeps_its_format(precision, kv, sharp_ckpt, text_file,
                                                                                 tmp_path):
    student = calibrate(sharp_ckpt, tmp_path / precision, text_file, precision, "--kv-cache", kv)
    out = tmp_path / f"{precision}-qat"
    result = distill(student, out, sharp_ckpt, text_file, "--tokens", STEPS * BATCH * SEQ, "--lr", "1e-4",
                     "--samples", "2", "--eval-samples", "0", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["quantization_aware"] is True
    before, after = load_file(student / "rank0.safetensors"), load_file(out / "rank0.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in before.items()} == {k: (v.dtype, v.shape) for k, v in after.items()}
    changed = [k for k in before if k.endswith(".weight") and k.startswith("transformer.layers.")
               and not torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))]
    assert changed, "no quantized weight moved"
    for name in before:
        if "scaling_factor" in name or "smoother" in name:
            assert torch.equal(before[name], after[name]), f"{name}: the scales must stay fixed"
    cfg_in, cfg_out = CheckpointConfig.read(student), CheckpointConfig.read(out)
    assert (cfg_out.quant_algo, cfg_out.kv_cache_quant_algo) == (cfg_in.quant_algo, cfg_in.kv_cache_quant_algo)
    # the windows it trained on (2, seen 6 times each): what the straight-through gradient must have lowered
    windows = training_windows(load_texts(resolve_recipe(str(text_file), samples=2, seq_len=SEQ)),
                               load_tokenizer(student), resolve_recipe(str(text_file), samples=2, seq_len=SEQ))
    assert heldout_kl(out, sharp_ckpt, seqs=windows) < heldout_kl(student, sharp_ckpt, seqs=windows)


@pytest.mark.parametrize("case", ["no-budget", "both-budgets", "zero-tokens", "dense-student", "compressed-teacher",
                                  "self-teacher", "other-architecture", "lr"])
def test_bad_input_exits_2_and_writes_nothing(case, tiny_sparse_ckpt, tiny_ckpt, text_file, smollm2_hf_dir,
                                              tmp_path):
    out = tmp_path / "out"
    student, teacher, budget, extra = tiny_sparse_ckpt, tiny_ckpt, ["--tokens", "64"], []
    expect = {"no-budget": "one of --tokens N or --minutes M", "both-budgets": "one of --tokens N or --minutes M",
              "zero-tokens": "--tokens must be positive", "dense-student": "is dense and float",
              "compressed-teacher": "is compressed (2:4)", "self-teacher": "is the student itself",
              "other-architecture": "another architecture", "lr": "--lr must be positive"}[case]
    if case == "no-budget":
        budget = []
    elif case == "both-budgets":
        budget += ["--minutes", "1"]
    elif case == "zero-tokens":
        budget = ["--tokens", "0"]
    elif case == "dense-student":
        student = tiny_ckpt
    elif case == "compressed-teacher":
        teacher = tiny_sparse_ckpt
        student = calibrate(tiny_ckpt, tmp_path / "fp8", text_file, "fp8")
    elif case == "self-teacher":
        teacher = student
    elif case == "other-architecture":
        hf = make_tiny_model(tmp_path / "hf-deep", vocab_size=49152, num_hidden_layers=2, max_position_embeddings=128)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (hf / name).write_bytes((smollm2_hf_dir / name).read_bytes())
        teacher = tmp_path / "ck-2"
        assert cli("convert", hf, "-o", teacher, "--precision", "fp32").exit_code == 0
    elif case == "lr":
        extra = ["--lr", "0"]
    result = distill(student, out, teacher, text_file, *budget, *extra)
    assert result.exit_code == 2, result.output
    assert expect in result.output and "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))
