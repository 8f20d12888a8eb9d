"""Speculative decoding in the cpu target's runtimes (pipeline/runtime/speculative.py): drafts verified in one step,
the rejected ones forgotten, and every request's output the same as without speculation, in both runtimes, for
batched generation and in-flight serving."""

from __future__ import annotations

import pytest

from pipeline.errors import UserError
from pipeline.onnx.export import export_onnx
from pipeline.onnx.runner import OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.generate import generate_rows
from pipeline.runtime.scheduler import MAX_UTILIZATION, Scheduler, SchedulerLimits, Sequence
from pipeline.runtime.speculative import NgramDrafter, Speculation

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 6, 1, 6, 10]]
GREEDY = SamplingConfig(max_new_tokens=14)
SAMPLED = SamplingConfig(max_new_tokens=14, top_k=8, temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def runtimes(checkpoint, tmp_path_factory) -> dict:
    ckpt = checkpoint("gqa")
    onnx = export_onnx(ckpt, tmp_path_factory.mktemp("speculative") / "onnx").path
    return {"torch": ReferenceModel.load(ckpt), "onnxruntime": OrtDecoder(onnx)}


class Oracle:
    """Drafts the tokens plain decoding produces, with every `wrong`-th draft position of the output replaced by a
    token it does not produce (so steps accept some drafts and reject the rest), and nothing for the prompts in
    `silent` (plain rows in a speculating batch)."""

    def __init__(self, prompts, outputs, wrong: int = 3, silent=()):
        self.known = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.wrong, self.silent = wrong, [list(p) for p in silent]
        self.proposed: list[list[int]] = []

    def propose(self, history, limit):
        prompt, output = next((p, o) for p, o in self.known if list(history[:len(p)]) == p)
        if prompt in self.silent:
            return []
        at = len(history) - len(prompt)
        drafts = [t if (at + i) % self.wrong else (t + 1) % 64 for i, t in enumerate(output[at:at + limit])]
        self.proposed.append(drafts)
        return drafts


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_speculation_changes_no_token_of_a_batch(runtimes, runtime, sampling):
    """Greedy and seeded sampling: the same tokens with drafts as without, a row without drafts decoding beside the
    speculating ones in the same steps, and the drafted / accepted counts those of the drafts."""
    model = runtimes[runtime]
    plain = [model.generate_rows([p], sampling)[0].tokens for p in PROMPTS]
    oracle = Oracle(PROMPTS, plain, silent=[PROMPTS[1]])
    results = model.generate_rows(PROMPTS, sampling, speculation=Speculation(oracle_drafter(oracle, 4)))
    assert [r.tokens for r in results] == plain
    assert results[1].draft_tokens == 0
    drafted = [r.draft_tokens for r in results]
    assert sum(drafted) == sum(map(len, oracle.proposed)) > 0
    accepted = sum(r.accepted_draft_tokens for r in results)
    assert 0 < accepted < sum(drafted)        # some steps took drafts, some rejected one
    # fewer steps: each step outputs its accepted drafts and one token of its own
    assert all(r.accepted_draft_tokens > 0 for i, r in enumerate(results) if i != 1)


def oracle_drafter(oracle: Oracle, k: int):
    class Capped:
        def propose(self, history, limit):
            return oracle.propose(history, min(k, limit))
    return Capped()


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_rejected_drafts_leave_no_trace_in_the_cache(runtimes, runtime):
    """Every draft wrong, many steps: what the rejected drafts wrote is never read (the ONNX cache's holes are
    dropped by its rebuilds), and the output is the plain one."""
    model = runtimes[runtime]
    config = SamplingConfig(max_new_tokens=40)
    plain = [model.generate_rows([p], config)[0].tokens for p in PROMPTS]
    oracle = Oracle(PROMPTS, plain, wrong=1)
    results = model.generate_rows(PROMPTS, config, speculation=Speculation(oracle_drafter(oracle, 3)))
    assert [r.tokens for r in results] == plain
    assert sum(r.accepted_draft_tokens for r in results) == 0 and sum(r.draft_tokens for r in results) > 60


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
@pytest.mark.parametrize("limits", [SchedulerLimits(), SchedulerLimits(kv_tokens=48, tokens_per_block=4,
                                                                       policy=MAX_UTILIZATION)],
                         ids=["unbounded", "max_utilization"])
def test_in_flight_serving_speculates_and_keeps_every_request_exact(runtimes, runtime, limits):
    """Requests joining a speculating batch between steps come out as they do alone; under max_utilization no row
    drafts past the KV blocks it holds."""
    model = runtimes[runtime]
    schedule = [(PROMPTS[0], 14, 0), (PROMPTS[1], 6, 0), (PROMPTS[2], 10, 3)]
    alone = [model.generate([p], SamplingConfig(max_new_tokens=n))[0] for p, n, _ in schedule]
    oracle = Oracle([p for p, _, _ in schedule], alone, wrong=4)
    scheduler, tokens, steps = Scheduler(limits), {}, [0]
    held = []

    def poll():
        for i, (prompt, n, at) in enumerate(schedule):
            if at == steps[0]:
                scheduler.submit([Sequence(i, prompt, SamplingConfig(max_new_tokens=n))])
        steps[0] += 1

    class Bounded:
        def propose(self, history, limit):
            held.append(limit)
            return oracle.propose(history, min(3, limit))

    model.serve_rows(scheduler, poll, lambda key, result: tokens.__setitem__(key, list(result.tokens)),
                     lambda key: None, Speculation(Bounded()))
    assert [tokens[i] for i in range(len(schedule))] == alone
    assert sum(map(len, oracle.proposed)) > 0
    if limits.blocks is not None:
        assert min(held) < 3          # a row near the end of its blocks was offered fewer drafts


def test_ngram_drafts_follow_the_latest_longest_match():
    drafter = NgramDrafter(3)
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert drafter.propose(history, 10) == [7, 8, 5]       # "1 2 3" last seen before the tail at 5
    assert drafter.propose(history, 2) == [7, 8]           # never more than the limit
    assert drafter.propose([4, 5, 6, 5], 3) == [6, 5]       # no 3- or 2-gram match: the 1-gram "5"
    assert drafter.propose([4, 5, 6], 3) == []              # nothing repeats
    assert NgramDrafter(3, min_ngram=2).propose([4, 5, 6, 5], 3) == []
    assert drafter.propose([1, 2, 1, 2], 0) == []
    with pytest.raises(UserError, match="draft length"):
        NgramDrafter(0)


def test_a_decoder_that_cannot_verify_refuses_speculation(runtimes):
    class Plain:
        def prefill(self, rows):
            raise AssertionError("not reached")

        def decode(self, rows, tokens):
            raise AssertionError("not reached")

    with pytest.raises(UserError, match="cannot verify draft tokens"):
        generate_rows(Plain(), [GREEDY], speculation=Speculation(NgramDrafter(2)), prompts=[[1, 2]])
