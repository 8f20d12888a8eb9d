"""The layer stream: the whole-model runtime's results, one decoder layer in memory at a time."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from pipeline.errors import UserError
from pipeline.runtime import LayerStream, ReferenceModel, perplexity, resolve_device
from pipeline.runtime import trtllm_reader
from pipeline.runtime import stream as stream_module
from pipeline.runtime.trtllm_reader import Layer

SEQUENCES = [[1, 5, 7, 9, 3, 2, 8], [4, 4, 4], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100], [7]]
LAYOUTS = [("gqa", 1, 1), ("gqa", 2, 2), ("mqa", 4, 1), ("tied", 1, 1), ("llama3-rope", 1, 2)]


def recorder(calls: dict):
    return lambda name, x: calls.setdefault(name, []).append(x.clone())


@pytest.mark.parametrize("variant,tp,pp", LAYOUTS)
def test_observed_inputs_are_bit_identical_to_the_whole_model(checkpoint, variant, tp, pp):
    """Calibration statistics see exactly what a whole-model forward of each sequence shows them."""
    ckpt = checkpoint(variant, tp, pp)
    whole, streamed = {}, {}
    model = ReferenceModel.load(ckpt)
    for seq in SEQUENCES:
        model.forward(torch.tensor([seq]), observer=recorder(whole))
    LayerStream(ckpt).run_layers(SEQUENCES, passes=lambda loaded: [recorder(streamed)])
    assert list(whole) == list(streamed)
    for name in whole:
        assert len(whole[name]) == len(streamed[name]) == len(SEQUENCES)
        assert all(torch.equal(a, b) for a, b in zip(whole[name], streamed[name])), name


@pytest.mark.parametrize("variant,tp,pp", LAYOUTS)
def test_scores_match_whole_model_logits_across_vocabulary_chunks(checkpoint, variant, tp, pp, monkeypatch):
    ckpt = checkpoint(variant, tp, pp)
    model = ReferenceModel.load(ckpt)
    monkeypatch.setattr(stream_module, "VOCAB_CHUNK_BYTES", 4 * 48 * 13)   # 13 rows: 8 chunks of a 101 vocab
    stream = LayerStream(ckpt)
    assert len(list(stream.vocab_ranges())) == 8
    for seq, scores in zip(SEQUENCES, stream.token_scores(SEQUENCES)):
        logits = model.forward(torch.tensor([seq]))[0, :-1]
        nll = F.cross_entropy(logits, torch.tensor(seq[1:], dtype=torch.long), reduction="none")
        assert scores.nll.shape == scores.argmax.shape == (len(seq) - 1,)
        assert torch.allclose(scores.nll, nll, rtol=1e-5, atol=1e-5)
        assert torch.equal(scores.argmax, logits.argmax(-1))
    whole, streamed = perplexity(model, SEQUENCES, window=4), perplexity(stream, SEQUENCES, window=4)
    assert whole.tokens == streamed.tokens
    assert streamed.perplexity == pytest.approx(whole.perplexity, rel=1e-6)


def test_argmax_ties_resolve_to_the_first_token_like_torch(checkpoint, monkeypatch):
    """Equal logits in different vocabulary chunks: the lower id wins, as torch.argmax over the whole row."""
    ckpt = checkpoint("gqa")
    monkeypatch.setattr(stream_module, "VOCAB_CHUNK_BYTES", 4 * 48 * 10)
    stream = LayerStream(ckpt)
    real = stream.reader.lm_head

    def duplicated_head(rows):
        head = real(rows)
        full = real((0, stream.cfg.arch.vocab_size))
        for r in range(*rows):
            if r >= 50:
                head[r - rows[0]] = full[r - 50]      # token 50 + k has the logits of token k
        return head

    monkeypatch.setattr(stream.reader, "lm_head", duplicated_head)
    for scores in stream.token_scores(SEQUENCES):
        assert (scores.argmax < 50).all()


def test_only_one_layer_is_alive_at_a_time(checkpoint, monkeypatch):
    refs: list[weakref.ref[Layer]] = []
    real = trtllm_reader.CheckpointReader.layer

    def tracked(self, index):
        layer = real(self, index)
        refs.append(weakref.ref(layer))
        return layer

    monkeypatch.setattr(trtllm_reader.CheckpointReader, "layer", tracked)
    seen = []

    def after_layer(i):
        gc.collect()
        seen.append(sum(r() is not None for r in refs))

    LayerStream(checkpoint("gqa", 1, 2)).run_layers(SEQUENCES, after_layer=after_layer)
    assert seen == [0, 0, 0, 0]     # every layer released before the next is read


def test_each_pass_sees_every_sequence_and_later_passes_are_built_after_earlier_ones(checkpoint):
    order = []

    def passes(loaded):
        first = []
        yield lambda name, x: first.append(name)
        order.append((loaded.index, len(first)))          # the first pass has finished when the second is requested
        yield None

    LayerStream(checkpoint("gqa")).run_layers(SEQUENCES, passes=passes)
    per_sequence = 6                             # qkv, k, v, dense, fc, gate... as the observer reports them
    assert [i for i, _ in order] == [0, 1, 2, 3]
    assert all(n >= per_sequence * len(SEQUENCES) for _, n in order)


def test_bad_token_ids_and_empty_sequences_are_user_errors(checkpoint):
    stream = LayerStream(checkpoint("gqa"))
    with pytest.raises(UserError, match=r"token ids must be in \[0, 101\)"):
        stream.run_layers([[1, 2, 101]])
    with pytest.raises(UserError, match="at least one token"):
        stream.run_layers([[1, 2], []])


@pytest.mark.parametrize("name,cuda,expected", [("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"),
                                                ("cuda", True, "cuda")])
def test_device_choice(monkeypatch, name, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device(name).type == expected


def test_cuda_without_a_gpu_and_unknown_devices_are_user_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="torch sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="--device must be one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_layers_move_every_tensor_to_the_device(checkpoint):
    """The CUDA path moves weights, biases, norms and smoothing vectors; checked on the meta device (no GPU here)."""
    from pipeline.runtime.trtllm_reader import CheckpointReader

    layer = CheckpointReader(checkpoint("gqa")).layer(0)
    qkv, fc = layer.linears["attention.qkv"], layer.linears["mlp.fc"]
    qkv.bias = torch.zeros(qkv.weight.shape[0])
    fc.prequant = torch.ones(fc.weight.shape[1])
    moved = stream_module._to_device(layer, torch.device("meta"))
    tensors = list(moved.norms.values())
    for value in moved.linears.values():
        tensors += [t for t in (value.weight, value.bias, value.prequant) if t is not None]
    assert len(tensors) == 2 + 5 + 2 and all(t.device.type == "meta" for t in tensors)
    assert qkv.weight.device.type == "cpu"        # the source layer is left as it was


@pytest.mark.parametrize("command", ["eval", "calibrate"])
def test_cli_device_cuda_without_a_gpu_exits_2_with_one_line(checkpoint, command, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from pipeline.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = {"eval": ["eval", str(checkpoint("gqa")), "--device", "cuda"],
            "calibrate": ["calibrate", str(checkpoint("gqa")), "-o", str(tmp_path / "q"), "--precision", "fp8",
                          "--device", "cuda", "--quiet"]}[command]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "torch sees no CUDA GPU" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "q").exists()
