"""The in-place KV cache export (`export-onnx --in-place-kv`, what the cpu target serves): ONNX Runtime's
GroupQueryAttention writes each row's keys and values into buffers bound as both past and present. It computes what
the concat export and the reference runtime compute, in generation, in the server's loop with joining prompts, and
with speculation's rewinds; what ONNX Runtime's kernel refuses is refused before a build."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.onnx.export import ExportOptions, export_onnx
from pipeline.onnx.inplace import InPlaceBatch
from pipeline.onnx.runner import OrtBatch, OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.scheduler import Scheduler, Sequence
from pipeline.runtime.speculative import NgramDrafter, Speculation

from test_onnx import assert_matches_through_cache, convert, random_ids

#: (family, variant, GroupQueryAttention rotates): head size 16 lets it rotate; 8 and Qwen3's q/k norms do not
CASES = [("llama", "head-dim", True), ("llama", "head8", False), ("qwen", "qwen3", False)]


@pytest.fixture(scope="module")
def exports(tiny_llama, tiny_qwen, tmp_path_factory):
    """(family, variant) -> (checkpoint, concat export, in-place export), made once."""
    made = {}

    def get(family: str, variant: str):
        if (family, variant) not in made:
            work = tmp_path_factory.mktemp(f"inplace-{variant}")
            ckpt = convert((tiny_llama if family == "llama" else tiny_qwen)(variant), work / "ckpt")
            in_place = export_onnx(ckpt, work / "inplace", ExportOptions(in_place_kv=True)).path
            made[family, variant] = ckpt, export_onnx(ckpt, work / "concat").path, in_place
        return made[family, variant]
    return get


def serve(decoder: OrtDecoder, prompts: list[list[int]], configs: list[SamplingConfig], concurrency: int,
          speculation: Speculation | None = None) -> dict[int, list[int]]:
    """The cpu server's loop (serve_rows) with `concurrency` requests in flight: each request's tokens."""
    scheduler, out, sent, ended = Scheduler(), {}, [0], [0]

    def poll() -> None:
        while sent[0] < len(prompts) and sent[0] - ended[0] < concurrency:
            key, sent[0] = sent[0], sent[0] + 1
            out[key] = []
            scheduler.submit([Sequence(key, prompts[key], configs[key])])

    def on_end(key) -> None:
        ended[0] += 1

    decoder.serve_rows(scheduler, poll, lambda key, result: out[key].append(result.tokens[-1]), on_end, speculation)
    return out


@pytest.mark.parametrize("family,variant,rotates", CASES)
def test_in_place_export_computes_what_the_runtime_and_the_concat_export_compute(family, variant, rotates, exports):
    ckpt, concat, in_place = exports(family, variant)
    graph = onnx.load(in_place / "model.onnx").graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 4 and "Concat" not in {n.op_type for n in graph.node if n.output[0].startswith("present")}
    assert {a.i for n in attention for a in n.attribute if a.name == "do_rotary"} == ({1} if rotates else set())
    assert json.loads((in_place / "genai_config.json").read_text())["trtpipe"]["kv_cache"] == "in-place"
    decoder, ref = OrtDecoder(in_place), ReferenceModel.load(ckpt)
    assert decoder.in_place and decoder.mixes_prompts and isinstance(decoder.inflight_decoder(), InPlaceBatch)
    assert_matches_through_cache(decoder, ref, random_ids(101, 2, 14), prefill=9)
    prompts = [random_ids(101, 1, n, seed=n)[0].tolist() for n in (3, 11, 6, 8, 5)]
    free = ref.generate(prompts, SamplingConfig(max_new_tokens=10))
    configs = [SamplingConfig(max_new_tokens=4), SamplingConfig(max_new_tokens=10, end_id=free[1][5]),
               SamplingConfig(max_new_tokens=10, stop_words=[free[2][2:4]]),
               SamplingConfig(max_new_tokens=10, top_k=20, temperature=0.7, seed=5), SamplingConfig(max_new_tokens=7)]
    assert decoder.generate(prompts, configs) == ref.generate(prompts, configs)
    # the server's loop: prompts joining running rows in their decode step, rows leaving in any order
    want = serve(OrtDecoder(concat), prompts, configs, concurrency=3)
    assert serve(decoder, prompts, configs, concurrency=3) == want


def test_speculation_rewinds_a_row_by_its_length_and_drafts_at_one_row(exports):
    """Prompt lookup over the in-place batch: the same tokens as without it, rejected drafts forgotten by shortening
    the row (no hole, no rebuild), drafts only in steps of one row (ONNX Runtime verifies several tokens after a
    cache one row at a time); a batch verifying several rows' drafts anyway runs a row at a time and is exact."""
    _, concat, in_place = exports("llama", "head-dim")
    decoder = OrtDecoder(in_place)
    base = random_ids(101, 1, 12, seed=7)[0].tolist()
    prompts = [base + base[:5] + [n] for n in range(4)]          # the prompt repeats itself: lookup finds matches
    configs = [SamplingConfig(max_new_tokens=16)] * 4
    plain = serve(decoder, prompts, configs, concurrency=1)
    rows_drafted = []

    class Counted(NgramDrafter):
        def draft(self, requests):
            rows_drafted.append(len(requests))
            return super().draft(requests)

    fed = serve(decoder, prompts, configs, concurrency=3, speculation=Speculation(Counted(4), adaptive=False))
    assert fed == plain == serve(OrtDecoder(concat), prompts, configs, concurrency=3)
    assert rows_drafted and set(rows_drafted) == {1}
    batch, ref = InPlaceBatch(decoder, prompts[:2]), OrtBatch(OrtDecoder(concat), prompts[:2])
    for b in (batch, ref):
        b.prefill([0, 1])
    feeds = [[plain[0][0], *plain[0][1:4]], [plain[1][0], 3, 5]]
    got, want = batch.verify([0, 1], feeds), ref.verify([0, 1], feeds)
    assert all(np.allclose(g.numpy(), w.numpy(), atol=1e-4) for g, w in zip(got, want))
    batch.rewind(0, 2)
    assert batch.lengths.tolist() == [len(prompts[0]) + 2, len(prompts[1]) + 3]
    batch.release([0])
    assert batch.slots == [1] and batch.lengths.tolist() == [len(prompts[1]) + 3]


def test_onnx_runtime_verifies_several_tokens_after_a_cache_for_one_row_only(exports):
    """The kernel fact `InPlaceBatch.verify_rows` rests on (contrib_ops/cpu/bert/group_query_attention_helper.h):
    two rows of two tokens after their caches are refused, one row of two is computed."""
    _, _, in_place = exports("llama", "head-dim")
    decoder = OrtDecoder(in_place)
    _, cache = decoder.step(random_ids(101, 2, 5).numpy(), decoder.empty_cache(2))
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1"):
        decoder.step(random_ids(101, 2, 2).numpy(), cache)
    one = type(cache)({name: t[:1] for name, t in cache.tensors.items()}, cache.mask[:1])
    assert decoder.step(random_ids(101, 1, 2).numpy(), one)[0].shape == (1, 2, 101)


def test_in_place_export_refuses_a_head_size_the_kernel_does_not_take(checkpoint, tmp_path):
    result = CliRunner().invoke(main, ["export-onnx", str(checkpoint("gqa")), "-o", str(tmp_path / "onnx"),
                                       "--in-place-kv"])
    assert result.exit_code == 2 and "multiples of 8 (this model's: 6)" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "onnx").exists()
