"""Speculative decoding in the cpu target's runtimes (pipeline/runtime/speculative.py): drafts verified in one step,
the rejected ones forgotten, and every request's output the same as without speculation, in both runtimes, for
batched generation and in-flight serving."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from click.testing import CliRunner

from support.models import make_tiny_model
from support.triton_stubs import StubRequest, load_cpu_model
from pipeline.cli import main
from pipeline.deploy import deploy_repository

from pipeline.errors import UserError
from pipeline.host import INTRA_OP_SPINNING
from pipeline.onnx.export import export_onnx
from pipeline.onnx.runner import OrtDecoder
from pipeline.plan import Plan, Workload, resolve_model_info
from pipeline.plan.memory import weights_per_rank_by_stage
from pipeline.plan.schema import SpeculativePlan
from pipeline.plan.speculative import SpeculativeRequest, describe
from pipeline.planner import make_plan, replan
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.draft_model import ModelDrafter
from pipeline.runtime.generate import generate_rows
from pipeline.runtime.scheduler import MAX_UTILIZATION, Scheduler, SchedulerLimits, Sequence
from pipeline.runtime.speculative import (DRAFT_DIR, MARGIN, MAX_DRAFT_LEN, MAX_MATCHING_NGRAM_SIZE, MULTI_ROW_DRAFTS,
                                         PROBE_EVERY,
                                         SINGLE_ROW_MARGIN, SPECULATIVE_DECODING_MODE, SPECULATIVE_MAX_ROWS,
                                         DraftRequest, NgramDrafter, Speculation, leading_matches)
from pipeline.targets import get_target
from pipeline.validate import validate_repository
from pipeline.validate.report import ValidateOptions
from pipeline.validate.speculative import check_speculation
from pipeline.triton_names import ACCEPTANCE_RATE, TOTAL_ACCEPTED_DRAFT_TOKENS, TOTAL_DRAFT_TOKENS

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
    results = model.generate_rows(PROMPTS, sampling, speculation=Speculation(oracle_drafter(oracle, 4), adaptive=False))
    assert [r.tokens for r in results] == plain
    assert results[1].draft_tokens == 0
    drafted = [r.draft_tokens for r in results]
    # a step of several rows feeds each at most MULTI_ROW_DRAFTS of its drafts (here every step has 3 rows)
    assert sum(drafted) == sum(min(len(p), MULTI_ROW_DRAFTS) for p in oracle.proposed) > 0
    assert MULTI_ROW_DRAFTS < 4
    accepted = sum(r.accepted_draft_tokens for r in results)
    assert 0 < accepted < sum(drafted)        # some steps took drafts, some rejected one
    # fewer steps: each step outputs its accepted drafts and one token of its own
    assert all(r.accepted_draft_tokens > 0 for i, r in enumerate(results) if i != 1)


@pytest.fixture(scope="module")
def other_runtimes(checkpoint, tmp_path_factory) -> dict:
    """Another model of the same vocabulary (other heads, other weights): a draft model that is often wrong."""
    ckpt = checkpoint("mha")
    onnx = export_onnx(ckpt, tmp_path_factory.mktemp("speculative-draft") / "onnx").path
    return {"torch": ReferenceModel.load(ckpt), "onnxruntime": OrtDecoder(onnx)}


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_draft_model_changes_no_token_and_a_perfect_one_is_always_accepted(runtimes, other_runtimes, runtime,
                                                                              sampling):
    """Draft-target: the target's tokens whatever drafts; the target drafting for itself greedily has every draft
    accepted (its drafts are plain decoding's tokens), another model some and not others."""
    model = runtimes[runtime]
    plain = [model.generate_rows([p], sampling)[0].tokens for p in PROMPTS]
    for draft, perfect in ((model, sampling is GREEDY), (other_runtimes[runtime], False)):
        speculation = Speculation(ModelDrafter(draft.inflight_decoder(), 3), adaptive=False)
        results = model.generate_rows(PROMPTS, sampling, speculation=speculation)
        assert [r.tokens for r in results] == plain
        drafted, accepted = (sum(getattr(r, n) for r in results) for n in ("draft_tokens", "accepted_draft_tokens"))
        assert drafted > 0
        if perfect:
            assert accepted == drafted
        elif draft is not model:
            assert accepted < drafted


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_a_draft_model_follows_requests_joining_and_leaving_a_serving_batch(runtimes, other_runtimes, runtime):
    """In flight, under max_utilization's pauses: every request as it comes out alone, the draft model's cache rows
    freed as the target's rows end (none held once the batch is empty)."""
    model = runtimes[runtime]
    schedule = [(PROMPTS[0], 14, 0), (PROMPTS[1], 6, 0), (PROMPTS[2], 10, 3), (PROMPTS[0][:3], 9, 5)]
    alone = [model.generate([p], SamplingConfig(max_new_tokens=n))[0] for p, n, _ in schedule]
    drafter = ModelDrafter(other_runtimes[runtime].inflight_decoder(), 2)
    limits = SchedulerLimits(kv_tokens=48, tokens_per_block=4, policy=MAX_UTILIZATION)
    assert serve_schedule(model, schedule, limits, Speculation(drafter, adaptive=False)) == alone
    drafter.draft([])
    assert drafter.fed == {}


def serve_schedule(model, schedule, limits: SchedulerLimits, speculation: Speculation) -> list[list[int]]:
    """Each (prompt, max_new_tokens, step it arrives at) of `schedule` served in flight: its output tokens."""
    scheduler, tokens, steps = Scheduler(limits), {}, [0]

    def poll():
        for i, (prompt, n, at) in enumerate(schedule):
            if at == steps[0]:
                scheduler.submit([Sequence(i, prompt, SamplingConfig(max_new_tokens=n))])
        steps[0] += 1

    model.serve_rows(scheduler, poll, lambda key, result: tokens.__setitem__(key, list(result.tokens)),
                     lambda key: None, speculation)
    return [tokens[i] for i in range(len(schedule))]


def oracle_drafter(oracle: Oracle, k: int, limits: list | None = None):
    """A Drafter of the oracle's drafts, at most k a row (`limits` records the limit each row was offered)."""
    class Capped:
        free = False

        def draft(self, requests):
            if limits is not None:
                limits.extend(r.limit for r in requests)
            return [oracle.propose(r.history, min(k, r.limit)) for r in requests]
    return Capped()


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_rejected_drafts_leave_no_trace_in_the_cache(runtimes, runtime):
    """Every draft wrong, many steps: what the rejected drafts wrote is never read (the ONNX cache's holes are
    dropped by its rebuilds), and the output is the plain one."""
    model = runtimes[runtime]
    config = SamplingConfig(max_new_tokens=40)
    plain = [model.generate_rows([p], config)[0].tokens for p in PROMPTS]
    oracle = Oracle(PROMPTS, plain, wrong=1)
    results = model.generate_rows(PROMPTS, config, speculation=Speculation(oracle_drafter(oracle, 3), adaptive=False))
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
    held = []
    assert serve_schedule(model, schedule, limits, Speculation(oracle_drafter(oracle, 3, held), adaptive=False)) \
        == alone
    assert sum(map(len, oracle.proposed)) > 0
    if limits.blocks is not None:
        assert min(held) < 3          # a row near the end of its blocks was offered fewer drafts


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafts_a_request_brings_are_verified_by_its_prefill(runtimes, runtime, sampling):
    """Draft tokens a request brings (NVIDIA's draft_input_ids) are fed with its prompt: all right, some right or
    none, the output is the plain one, the drafts are counted as drafted and the leading right ones as accepted, in
    batched generation and in-flight serving alike; a row whose KV blocks hold fewer verifies fewer; context logits
    stay the prompt's."""
    model = runtimes[runtime]
    plain = [r.tokens for r in model.generate_rows(PROMPTS, sampling)]
    cases = [plain[0][:5], [*plain[1][:2], (plain[1][2] + 1) % 64, plain[1][3]], [(plain[2][0] + 1) % 64, 4]]
    configs = [replace(sampling, drafts=d, context_logits=True) for d in cases]
    results = model.generate_rows(PROMPTS, configs)
    assert [r.tokens for r in results] == plain
    assert [(r.draft_tokens, r.accepted_draft_tokens) for r in results] == [(5, 5), (4, 2), (2, 0)]
    assert [len(r.context_logits) for r in results] == list(map(len, PROMPTS))
    for limits, counts in ((SchedulerLimits(), [(5, 5), (4, 2), (2, 0)]),
                           (SchedulerLimits(kv_tokens=64, tokens_per_block=4, policy=MAX_UTILIZATION),
                            [(3, 3), (1, 1), (0, 0)])):   # room after the prompts of 5, 3 and 8 tokens: 3, 1, 0
        scheduler, served = Scheduler(limits), {}
        scheduler.submit([Sequence(i, p, c) for i, (p, c) in enumerate(zip(PROMPTS, configs))])
        model.serve_rows(scheduler, lambda: None, lambda key, result: served.__setitem__(key, result),
                         lambda key: None)
        assert [served[i].tokens for i in range(3)] == plain
        assert [(served[i].draft_tokens, served[i].accepted_draft_tokens) for i in range(3)] == counts
    with pytest.raises(UserError, match="draft tokens need max_new_tokens of at least 15"):
        replace(sampling, drafts=list(range(14)))
    with pytest.raises(UserError, match="draft tokens must be in"):
        model.generate_rows(PROMPTS[:1], replace(sampling, drafts=[model.vocab_size]))


def test_ngram_drafts_follow_the_latest_longest_match():
    drafter = NgramDrafter(3)
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert drafter.propose(history, 10) == [7, 8, 5]       # "1 2 3" last seen before the tail at 5
    assert drafter.propose(history, 2) == [7, 8]           # never more than the limit
    assert drafter.propose([4, 5, 6, 5], 3) == [6]          # no 3- or 2-gram match: the 1-gram "5", 3 >> 2 -> 1
    assert drafter.propose([4, 5, 6], 3) == []              # nothing repeats
    # K after a match of max_ngram tokens, half as many for each token shorter, at least one
    long = NgramDrafter(8)
    run = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert long.propose([*run, 99, 10, 11, 12], 20) == run[3:11]          # 3-gram: 8
    assert long.propose([*run, 99, 98, 11, 12], 20) == run[3:7]           # 2-gram: 4
    assert long.propose([*run, 99, 98, 97, 12], 20) == run[3:5]           # 1-gram: 2
    assert [long.drafts_after(n) for n in (3, 2, 1)] == [8, 4, 2]
    assert [NgramDrafter(5).drafts_after(n) for n in (3, 2, 1)] == [5, 2, 1]
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


def test_the_server_drafts_only_while_drafting_steps_pay():
    """The choice of each step follows what was observed at that number of rows: drafting while (1 + accepted drafts
    per row) x the plain step >= the drafting step, with a step of the other kind every PROBE_EVERY; never above the
    plan's max_rows."""
    spec = Speculation(NgramDrafter(3), max_rows=4)
    assert spec.drafting(1)                              # nothing seen yet: draft
    spec.observe(1, True, 0.012, 2)                      # 1 row, 2 drafts accepted, 12 ms
    assert not spec.drafting(1)                          # then once plainly, for the plain step's cost
    spec.observe(1, False, 0.010, 0)

    def steps(drafting_s: float, accepted: int, n: int = 2 * PROBE_EVERY) -> list[bool]:
        choices = []
        for _ in range(n):
            choices.append(spec.drafting(1))
            spec.observe(1, choices[-1], drafting_s if choices[-1] else 0.010, accepted if choices[-1] else 0)
        return choices

    assert steps(0.012, 2).count(False) == 2             # (1 + 2) x 10 ms >= 12 ms: drafts, but for the probes
    for _ in range(10):
        spec.observe(1, True, 0.040, 0)                  # drafts stop being accepted and the step grows
    assert not spec.gains(1)
    assert steps(0.040, 0).count(True) == 2              # plain, but for the probes
    # a drafting probe in which no row had a draft measured nothing: it stays due until a step drafts
    while not spec.drafting(1):
        spec.observe(1, False, 0.010, 0)
    spec.observe(1, False, 0.010, 0)                     # chosen to draft, but the drafter found nothing
    assert spec.drafting(1) and spec.drafting(1)
    spec.observe(1, True, 0.040, 0)
    assert not spec.drafting(1)
    assert not spec.drafting(5)                          # above the plan's break-even: never
    assert Speculation(NgramDrafter(3), adaptive=False).drafting(64)


def test_one_row_drafts_on_its_own_times_while_several_rows_keep_a_margin():
    """A drafting step that pays by its own time by less than MARGIN drafts on at one row (its holes cost only its own
    attention) and stops at two (every row reads them and a rebuild copies every row)."""
    spec = Speculation(NgramDrafter(3))
    for rows in (1, 2):
        spec.observe(rows, True, 0.0125, rows)           # a verify step 1.25x the plain one, a draft a row accepted
        spec.observe(rows, False, 0.0100, 0)
    assert spec.gains(1) and spec.gains(2)               # 2 x 10 ms against 12.5 ms: 1.6x, above either margin
    for rows in (1, 2):
        spec.verify_s[rows] = 0.0190                     # now 2 x 10 ms against 19 ms: 1.05x, under MARGIN
    assert spec.gains(1) and not spec.gains(2)
    assert SINGLE_ROW_MARGIN <= 2 * 0.0100 / 0.0190 < MARGIN


def test_prompt_lookup_keeps_its_acceptance_current_while_the_gate_steps_plainly():
    """A free drafter drafts unfed at plain steps, and the drafts the row then chooses move the accepted figure: once
    the output starts repeating, the gate drafts again at once instead of at its next probe. A drafter that costs a
    model step is not asked at plain steps; the shadows of rows that left are dropped."""
    cycle = [1, 2, 3, 4, 5] * 60

    def choices(drafter, steps: int) -> list[bool]:
        spec = Speculation(drafter)
        spec.verify_s[1], spec.plain_s[1], spec.gain[1] = 0.015, 0.010, 0.0     # drafting lost so far
        history, kinds = cycle[:10], []
        for _ in range(steps):
            drafts = spec.drafts([DraftRequest("a", list(history), 10, len(cycle))])[0]
            chosen = cycle[len(history):len(history) + len(drafts) + 1]       # every draft right: the cycle goes on
            kinds.append(bool(drafts))
            spec.observe(1, bool(drafts), 0.015 if drafts else 0.010, leading_matches(chosen, drafts))
            history += chosen
        return kinds

    class Costly(NgramDrafter):
        free = False

    free = choices(NgramDrafter(3), PROBE_EVERY - 2)
    assert not any(free[:4])                        # its first shadow settles after 3 drafts and one token more
    assert all(free[PROBE_EVERY // 2:])             # a few shadows later it drafts, long before the probe
    assert not any(choices(Costly(3), PROBE_EVERY - 1))
    spec = Speculation(NgramDrafter(3))
    spec.verify_s[1] = spec.verify_s[2] = spec.plain_s[1] = spec.plain_s[2] = 0.010
    spec.gain[1] = spec.gain[2] = -1.0
    spec.drafts([DraftRequest("a", cycle[:10], 3, 100), DraftRequest("b", cycle[:7], 3, 100)])
    assert set(spec.shadows) == {"a", "b"}
    spec.drafts([DraftRequest("a", cycle[:11], 3, 100)])
    assert set(spec.shadows) == {"a"}


def cpu_model(monkeypatch, ckpt, **parameters):
    module = load_cpu_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({
        "model_transaction_policy": {"decoupled": True},
        "parameters": {name: {"string_value": str(value)} for name, value in
                       {"checkpoint_dir": ckpt, **parameters}.items()}})})
    return model


class Collect(StubRequest):
    def __init__(self, *args, log, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def send(self, response, flags=0):
        assert response.error is None, response.error.message
        self.log.append(response.outputs())


def served_once(model, prompt: list[int]) -> dict:
    """The cpu model's last response to one non-streaming request of 20 tokens with its perf metrics."""
    log = []
    model.execute([Collect("r", prompt, 20, log=log, return_perf_metrics=True, streaming=False)])
    model.queue.join()
    return log[-1]


def test_the_deployed_model_speculates_as_deployed_and_reports_nvidias_draft_counts(checkpoint, monkeypatch):
    """The cpu model deployed with --speculative ngram: the same tokens as without, and its perf metrics carry the
    drafts verified and accepted and TensorRT-LLM's acceptance rate (accepted / drafted)."""
    ckpt = checkpoint("gqa")
    prompt = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    answers = {}
    for name, parameters in (("plain", {}), ("ngram", {SPECULATIVE_DECODING_MODE: "ngram", MAX_DRAFT_LEN: 4,
                                                       MAX_MATCHING_NGRAM_SIZE: 2})):
        out = served_once(cpu_model(monkeypatch, ckpt, **parameters), prompt)
        answers[name] = out["output_ids"][0, 0, :out["sequence_length"][0, 0]].tolist()
        drafted, accepted = int(out[TOTAL_DRAFT_TOKENS][0, 0]), int(out[TOTAL_ACCEPTED_DRAFT_TOKENS][0, 0])
        rate = float(out[ACCEPTANCE_RATE][0, 0])
        if name == "plain":
            assert drafted == accepted == 0 and rate == 0.0
        else:
            assert drafted > 0 and rate == pytest.approx(accepted / drafted)
    assert answers["ngram"] == answers["plain"]


def test_the_deployed_model_drafts_with_its_draft_model_and_stays_exact(checkpoint, monkeypatch):
    """--speculative draft:CHECKPOINT as deployed (draft_dir): the target's tokens, drafts counted; a draft whose
    vocabulary differs does not load."""
    ckpt, prompt = checkpoint("gqa"), [3, 14, 15, 9, 2, 6, 5, 3]
    answers = {}
    drafting = {SPECULATIVE_DECODING_MODE: "draft", MAX_DRAFT_LEN: 3, DRAFT_DIR: checkpoint("mha")}
    for name, parameters in (("plain", {}), ("draft", drafting), ("off", {**drafting, SPECULATIVE_MAX_ROWS: 0})):
        model = cpu_model(monkeypatch, ckpt, **parameters)
        out = served_once(model, prompt)
        answers[name] = out["output_ids"][0, 0, :out["sequence_length"][0, 0]].tolist()
        drafted = int(out[TOTAL_DRAFT_TOKENS][0, 0])
        assert (drafted > 0) == (name == "draft")         # off: the plan's break-even was 0 rows
        assert (model.speculation is None) == (name != "draft")   # off holds no draft model
    assert answers["draft"] == answers["off"] == answers["plain"]


def test_the_deployed_model_verifies_the_draft_tokens_a_request_brings(checkpoint, monkeypatch):
    """draft_input_ids (what NVIDIA's BLS sends the target with its draft model's tokens) are honoured: the output is
    the plain one, drafted and accepted counted as TensorRT-LLM reports them; more drafts than request_output_len - 1
    is one clear refusal."""
    import numpy as np

    model, prompt = cpu_model(monkeypatch, checkpoint("gqa")), [3, 14, 15, 9, 2, 6, 5, 3]
    plain = served_once(model, prompt)
    tokens = plain["output_ids"][0, 0, len(prompt):plain["sequence_length"][0, 0]].tolist()
    for drafts, accepted in ((tokens[:4], 4), ([*tokens[:2], (tokens[2] + 1) % 64], 2)):
        log = []
        model.execute([Collect("d", prompt, len(drafts) + 1, log=log, return_perf_metrics=True, streaming=False,
                               draft_input_ids=np.array([drafts], np.int32))])
        model.queue.join()
        out = log[-1]
        assert out["output_ids"][0, 0, len(prompt):out["sequence_length"][0, 0]].tolist() == tokens[:len(drafts) + 1]
        assert (int(out[TOTAL_DRAFT_TOKENS][0, 0]), int(out[TOTAL_ACCEPTED_DRAFT_TOKENS][0, 0])) == (len(drafts),
                                                                                                     accepted)
    refused = StubRequest("x", prompt, 3, draft_input_ids=np.array([[1, 2, 3]], np.int32))
    errors = []
    refused.send = lambda response=None, flags=0: errors.append(response and response.error)
    model.execute([refused])
    model.queue.join()
    assert "3 draft tokens need max_new_tokens of at least 4" in errors[0].message


def test_an_onnx_runtime_draft_sleeps_between_its_runs_while_the_target_spins(checkpoint, monkeypatch, tmp_path):
    """Served with ONNX Runtime, the draft's session does not spin (its threads held the cores the target's next run
    needs: 0.90x plain against 1.04x, docs/speculative.md); the target keeps the deployment's setting
    (`intra_op_spinning`, spinning unless it says false)."""
    from pipeline.onnx.export import export_onnx

    ckpt = checkpoint("gqa")
    export_onnx(ckpt, tmp_path / "onnx")
    export_onnx(checkpoint("mha"), tmp_path / "draft")
    model = cpu_model(monkeypatch, ckpt, runtime="onnxruntime", onnx_dir=tmp_path / "onnx",
                      **{SPECULATIVE_DECODING_MODE: "draft", MAX_DRAFT_LEN: 3, DRAFT_DIR: tmp_path / "draft"})
    def spinning(decoder) -> str:      # ONNX Runtime spins unless the entry says "0"
        try:
            return decoder.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:           # "SessionOptions does not have configuration with key": the default
            return "1"

    assert spinning(model.model) == "1" and spinning(model.speculation.drafter.decoder.decoder) == "0"
    asleep = cpu_model(monkeypatch, ckpt, runtime="onnxruntime", onnx_dir=tmp_path / "onnx",
                       **{INTRA_OP_SPINNING: "false"})      # as a 4-bit deployment's plan writes it
    assert spinning(asleep.model) == "0"


def test_a_draft_of_another_vocabulary_does_not_load(checkpoint, tiny_ckpt, monkeypatch):
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        cpu_model(monkeypatch, checkpoint("gqa"), **{SPECULATIVE_DECODING_MODE: "draft", MAX_DRAFT_LEN: 3,
                                                     DRAFT_DIR: tiny_ckpt})


@pytest.mark.parametrize("parameters,message", [
    ({SPECULATIVE_DECODING_MODE: "medusa", MAX_DRAFT_LEN: 3}, "ngram or draft only"),
    ({SPECULATIVE_DECODING_MODE: "draft", MAX_DRAFT_LEN: 3}, "needs draft_dir"),
    ({SPECULATIVE_DECODING_MODE: "draft", MAX_DRAFT_LEN: 0, DRAFT_DIR: "."}, "draft length"),
    ({SPECULATIVE_DECODING_MODE: "ngram", MAX_DRAFT_LEN: 0}, "draft length"),
    ({SPECULATIVE_DECODING_MODE: "ngram", MAX_DRAFT_LEN: "three"}, "must be integers"),
])
def test_a_speculative_setting_the_cpu_model_cannot_honour_stops_it_loading(checkpoint, monkeypatch, parameters,
                                                                            message):
    with pytest.raises(ValueError, match=message):
        cpu_model(monkeypatch, checkpoint("gqa"), **parameters)


def plan_of(ckpt, speculative=None, **workload):
    return make_plan(resolve_model_info(str(ckpt)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=32, output_len=16, **workload), speculative=speculative)


def test_onnx_runtimes_in_place_cache_drafts_at_one_row(checkpoint, monkeypatch):
    """The same timings on the reference-onnx backend: a model whose export's cache is written in place (head size
    16) drafts at one row only, as its server does (ONNX Runtime verifies several tokens a row one row per run); one
    on the concat cache (head size 6) and the torch runtime keep the timings' break-even."""
    from pipeline.backends.reference import with_runtime
    from pipeline.plan import speculative as planned

    costs = {1: (0.010, 0.012), 2: (0.012, 0.015), 4: (0.015, 0.030), 8: (0.020, 0.050)}
    monkeypatch.setattr(planned, "step_timings", lambda arch, rows, k, context: [costs[r] for r in rows])
    request = SpeculativeRequest("ngram", None, 4, 0.25, 4.0)

    def planned_with(variant: str, backend: str):
        return make_plan(resolve_model_info(str(checkpoint(variant))), get_target("cpu"), "fp32", backend=backend,
                         workload=Workload(input_len=32, output_len=16), speculative=request)

    in_place = planned_with("head-dim", "reference-onnx").speculative
    assert in_place.max_rows == 1 and "drafts at one row only" in in_place.basis
    torch_plan = planned_with("head-dim", "reference")
    assert planned_with("gqa", "reference-onnx").speculative.max_rows == torch_plan.speculative.max_rows == 4
    assert with_runtime(torch_plan, "onnxruntime").speculative == in_place      # deploy --runtime onnxruntime


def test_the_plan_predicts_each_concurrency_and_stops_where_drafting_loses(checkpoint, monkeypatch, tmp_path,
                                                                          smollm2_hf_dir):
    """speedup = (1 + a K) x plain step / drafting step at each concurrency timed; the server drafts up to the first
    concurrency that loses, and the deployment carries it (monkeypatched timings, both ways)."""
    from pipeline.plan import speculative as planned

    costs = {1: (0.010, 0.012), 2: (0.012, 0.015), 4: (0.015, 0.030), 8: (0.020, 0.050)}
    monkeypatch.setattr(planned, "step_timings", lambda arch, rows, k, context: [costs[r] for r in rows])
    request = SpeculativeRequest("ngram", None, 4, 0.25, 4.0)         # every step drafts K: (1 + a K) p / v
    plan = plan_of(checkpoint("gqa"), request)
    spec = plan.speculative
    assert spec.rows == [1, 2, 4, 8] and spec.draft_len == 4 and spec.acceptance == 0.25
    assert spec.speedup == [pytest.approx(2 * p / v, abs=1e-3) for p, v in costs.values()]
    # prompt lookup's default: D = 2.2 drafts a step, which cost their share of the K + 1 token step over a plain one
    sparse = plan_of(checkpoint("gqa"), SpeculativeRequest("ngram", None, 4, 0.25)).speculative
    d = planned.NGRAM_DRAFTS_PER_STEP
    assert sparse.drafts_per_step == d == 2.2
    assert sparse.speedup == [pytest.approx((1 + 0.25 * d) * p / (p + (v - p) * d / 4), abs=1e-3)
                              for p, v in costs.values()]
    assert spec.max_rows == 4 and "--acceptance" in spec.acceptance_basis
    assert Plan.from_dict(plan.to_dict()).speculative == spec
    repo = deploy_repository(plan, tmp_path / "repo", checkpoint=checkpoint("gqa"), tokenizer=smollm2_hf_dir).path
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    for name, value in ((SPECULATIVE_DECODING_MODE, "ngram"), (MAX_DRAFT_LEN, "4"), (SPECULATIVE_MAX_ROWS, "4")):
        assert f'key: "{name}"\n  value {{\n    string_value: "{value}"' in config
    assert replan(plan).speculative == spec                      # tune's replanning keeps it

    costs.update({1: (0.010, 0.030)})
    slow = plan_of(checkpoint("gqa"), SpeculativeRequest("ngram", None, 4, 0.25), max_context=64)
    assert slow.speculative.max_rows == 0 and any("the server will not draft" in w for w in slow.warnings)
    plain = deploy_repository(plan_of(checkpoint("gqa")), tmp_path / "plain", checkpoint=checkpoint("gqa"),
                              tokenizer=smollm2_hf_dir).path
    assert SPECULATIVE_DECODING_MODE not in (plain / "tensorrt_llm" / "config.pbtxt").read_text()


def test_a_draft_model_plan_adds_k_draft_steps_and_its_memory_and_deploys_it(checkpoint, monkeypatch, tmp_path,
                                                                              smollm2_hf_dir):
    """speedup = (1 + a K) x plain / (K + 1 token step + K draft steps); the draft's weights and KV per token in the
    plan; deploy puts the draft beside the target, as each runtime serves it (monkeypatched timings)."""
    from pipeline.plan import speculative as planned

    target, draft = checkpoint("gqa"), checkpoint("mha")
    def steps(arch, rows, k, context):      # the target (2 KV heads) and the draft (4): plain and K + 1 steps
        scale = 1.0 if arch.num_key_value_heads == 2 else 0.4
        return [(scale * (0.010 + 0.002 * r), scale * (0.012 + 0.006 * r)) for r in rows]

    monkeypatch.setattr(planned, "step_timings", steps)
    plan = plan_of(target, SpeculativeRequest("draft", str(draft), 2, None), max_context=64)
    spec = plan.speculative
    assert spec.method == "draft" and spec.acceptance == planned.DEFAULT_ACCEPTANCE["draft"] == 0.7
    target_steps, draft_steps = steps(plan.model.arch, spec.rows, 2, 0), [0.4 * (0.010 + 0.002 * r) for r in spec.rows]
    assert spec.draft_step_s == pytest.approx(draft_steps, abs=1e-6)
    expected = [2.4 * p / (v + 2 * d) for (p, v), d in zip(target_steps, draft_steps)]
    assert spec.speedup == pytest.approx(expected, abs=1e-3) and expected[0] > 1 > expected[-1]
    assert spec.max_rows == max(r for r, e in zip(spec.rows, expected) if e >= 1) and spec.max_ngram is None
    # the draft's weights as the target's are counted (float32) and its float32 KV cache for as many tokens, off the
    # host's memory before the KV cache is sized
    draft_arch = resolve_model_info(str(draft)).arch
    assert spec.draft_weights_bytes == weights_per_rank_by_stage(draft_arch, "fp32", "float32", 1, 1)[0]
    assert spec.draft_kv_bytes_per_token == 2 * 4 * 4 * 12 * 4          # K and V, 4 layers x 4 heads x 12, float32
    plain, mem = plan_of(target, max_context=64).memory, plan.memory
    assert mem.free_bytes == plain.free_bytes - spec.draft_weights_bytes
    assert mem.draft_bytes == spec.draft_weights_bytes + mem.kv_cache_tokens * spec.draft_kv_bytes_per_token
    per_token = plan.kv_bytes_per_token + spec.draft_kv_bytes_per_token
    assert mem.free_bytes - per_token * 32 < mem.kv_cache_tokens * per_token <= mem.free_bytes
    assert Plan.from_dict(plan.to_dict()).speculative == spec
    assert replan(plan).speculative.draft_checkpoint == str(draft)
    for runtime, made in (("torch", "config.json"), ("onnxruntime", "model.onnx")):
        repo = deploy_repository(plan, tmp_path / runtime, checkpoint=target, tokenizer=smollm2_hf_dir,
                                 runtime=runtime).path
        config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
        assert f'key: "{DRAFT_DIR}"\n  value {{\n    string_value: "draft"' in config
        assert MAX_MATCHING_NGRAM_SIZE not in config
        assert (repo / "tensorrt_llm" / "1" / "draft" / made).is_file(), list((repo / "tensorrt_llm" / "1").iterdir())


def test_tune_searches_the_draft_length_of_a_speculative_plan(checkpoint, monkeypatch, tmp_path, smollm2_hf_dir):
    """A speculative cpu plan's tuning space has K; a candidate's K is planned again (its speedup and break-even) and
    deployed; a plan that does not speculate has no K to search."""
    from pipeline.plan import speculative as planned
    from pipeline.tune.slo import parse_slo
    from pipeline.tune.space import build_space, candidate_plan

    monkeypatch.setattr(planned, "step_timings",
                        lambda arch, rows, k, context: [(0.010, 0.010 + 0.002 * k) for _ in rows])
    plan = plan_of(checkpoint("gqa"), SpeculativeRequest("ngram", None, 3, 0.5))
    space = build_space(plan, parse_slo("itl_p99<=500ms"), (1, 4))
    assert space.default.draft_len == 3 and any(p.name == "draft_len" and p.high == 8 for p in space.params)
    assert candidate_plan(plan, space.default).speculative == plan.speculative
    longer = candidate_plan(plan, replace(space.default, draft_len=6)).speculative
    d = planned.NGRAM_DRAFTS_PER_STEP
    assert longer.draft_len == 6 and longer.acceptance == 0.5 and longer.drafts_per_step == d
    assert longer.speedup[0] == pytest.approx((1 + 0.5 * d) * 0.010 / (0.010 + 0.012 * d / 6), abs=1e-3)
    repo = deploy_repository(candidate_plan(plan, replace(space.default, draft_len=6)), tmp_path / "repo",
                             checkpoint=checkpoint("gqa"), tokenizer=smollm2_hf_dir).path
    assert f'key: "{MAX_DRAFT_LEN}"\n  value {{\n    string_value: "6"' in (repo / "tensorrt_llm" /
                                                                         "config.pbtxt").read_text()
    plain = build_space(plan_of(checkpoint("gqa")), parse_slo("itl_p99<=500ms"), (1, 4))
    assert plain.default.draft_len is None and not any(p.name == "draft_len" for p in plain.params)


def test_a_draft_that_cannot_draft_for_the_target_is_one_line_and_exit_2(checkpoint, tiny_hf, tiny_ckpt, tmp_path):
    """Another vocabulary; the same vocabulary with other token ids (the tokenizer compared, not only its size);
    a model that is not a checkpoint."""
    small = ["--target", "cpu", "--precision", "fp32", "--input-len", "16", "--output-len", "16"]
    other_vocab = CliRunner().invoke(main, ["plan", str(checkpoint("gqa")), *small, "--speculative",
                                            f"draft:{tiny_ckpt}"])
    assert other_vocab.exit_code == 2 and "vocabulary has 49152 tokens, the target's 101" in other_vocab.output
    shuffled = tmp_path / "shuffled"
    shutil.copytree(tiny_ckpt, shuffled)
    tokenizer = json.loads((shuffled / "tokenizer" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (shuffled / "tokenizer" / "tokenizer.json").write_text(json.dumps(tokenizer))
    for draft, message in ((shuffled, "other token ids than the target's"),
                           (tiny_hf, "drafts with a TensorRT-LLM checkpoint")):
        result = CliRunner().invoke(main, ["plan", str(tiny_ckpt), *small, "--speculative", f"draft:{draft}"])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize("args,message", [
    (["--speculative", "draft:smollm2-135m"], "drafts with a TensorRT-LLM checkpoint"),
    (["--speculative", "lookahead"], "lookahead and EAGLE are not implemented"),
    (["--speculative", "draft"], "needs the model that drafts"),
    (["--speculative", "medusa"], "must be one of ngram"),
    (["--speculative", "ngram", "--draft-len", "0"], "between 1 and 16"),
    (["--speculative", "ngram", "--draft-len", "17"], "between 1 and 16"),
    (["--speculative", "ngram", "--acceptance", "1.5"], "between 0 and 1"),
    (["--speculative", "ngram", "--drafts-per-step", "9"], "at most --draft-len 8"),
    (["--speculative", "ngram", "--drafts-per-step", "0"], "above 0"),
    (["--drafts-per-step", "1"], "go with --speculative"),
    (["--draft-len", "3"], "go with --speculative"),
    (["--speculative", "ngram", "--backend", "reference-llmapi"], "does not speculate"),
])
def test_speculation_the_cpu_target_cannot_run_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["plan", "smollm2-135m", "--target", "cpu", "--precision", "fp32", *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


class FakeClient:
    """An ensemble client whose generate answers with the perf metrics given (what check_speculation reads)."""

    def __init__(self, answers):
        self.answers, self.bodies = list(answers), []

    def body(self, prompt, max_tokens):
        return {"text_input": prompt, "max_tokens": max_tokens}

    def post_generate(self, body):
        self.bodies.append(body)
        response = requests.Response()
        response.status_code, response._content = 200, json.dumps(self.answers.pop(0)).encode()
        return response


def test_validate_measures_the_acceptance_the_plan_should_assume():
    spec = SpeculativePlan("ngram", 3, 3, 0.35, "default", [1], [0.01], [0.012], [1.7], 8, "")
    options = ValidateOptions(prompts=("a", "b"))
    client = FakeClient([{TOTAL_DRAFT_TOKENS: 9, TOTAL_ACCEPTED_DRAFT_TOKENS: 3},
                         {TOTAL_DRAFT_TOKENS: 3, TOTAL_ACCEPTED_DRAFT_TOKENS: 3}])
    result = check_speculation(client, options, spec)
    assert result.passed and result.data["acceptance"] == 0.5 and "--acceptance 0.50" in result.detail
    steps = 2 * (options.max_tokens - 1) - 6          # each request's decode steps: N - 1 - its accepted drafts
    assert result.data["drafts_per_step"] == round(12 / steps, 3)
    assert f"--drafts-per-step {round(12 / steps, 2):g}" in result.detail
    assert all(body["return_perf_metrics"] is True and body["min_tokens"] == options.max_tokens
               for body in client.bodies)
    silent = check_speculation(FakeClient([{TOTAL_DRAFT_TOKENS: 0}] * 2), options, spec)
    assert not silent.passed and "drafted nothing" in silent.detail
    off = replace(spec, max_rows=0)
    assert check_speculation(FakeClient([{TOTAL_DRAFT_TOKENS: 0}] * 2), options, off).passed
    # what build says of the plan
    assert describe(spec).endswith("x1.70 predicted at 1 row; drafts while at most 8 rows run")
    assert describe(off).endswith("the server will not draft")


@pytest.fixture(scope="module")
def tiny_draft(tiny_hf, tmp_path_factory) -> Path:
    """A smaller random model with tiny_hf's vocabulary and tokenizer, converted: a draft for tiny_ckpt."""
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    hf = make_tiny_model(tmp_path_factory.mktemp("tiny-draft-hf"), seed=1, vocab_size=49152, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_hf / name, hf / name)
    return convert_model(resolve_model(str(hf)), tmp_path_factory.mktemp("tiny-draft") / "ckpt", dtype="float32",
                         progress=False).path


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_speculating_deployment_validates_with_its_acceptance_measured(tiny_ckpt, tiny_hf, tiny_draft, tmp_path,
                                                                         method):
    """convert -> plan --speculative (prompt lookup; a draft checkpoint) -> deploy -> validate: every check passes,
    the speculation one with the acceptance the deployment measured on the validation prompts."""
    request = SpeculativeRequest(method, str(tiny_draft) if method == "draft" else None, 3, 0.5)
    plan = make_plan(resolve_model_info(str(tiny_ckpt)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=32, output_len=32, max_context=96), speculative=request)
    plan = replace(plan, speculative=replace(plan.speculative, max_rows=8))     # whatever this host timed
    repo = deploy_repository(plan, tmp_path / "repo", checkpoint=tiny_ckpt, tokenizer=tiny_hf).path
    report = validate_repository(repo, tmp_path / "validation", ValidateOptions(
        max_tokens=48, load_test=True, concurrencies=(1, 2), requests_per_client=1))
    checks = {c.name: c for c in report.checks}
    assert not [c.name for c in report.checks if c.failed], [c.detail for c in report.checks if c.failed]
    spec = checks["speculation"]
    assert spec.passed and spec.data["drafted"] > 0 and spec.data["planned_acceptance"] == 0.5
    assert f"--speculative {request.to_flags()} --acceptance" in spec.detail
    # --load-test: the acceptance and drafts a step at each level, from the streamed requests' perf metrics
    levels = checks["load_test"].data["levels"]
    assert [lv["speculation"]["requests"] for lv in levels] == [1, 2]
    assert sum(lv["speculation"]["drafted"] for lv in levels) > 0
    assert "speculation per level: c=1 acceptance" in checks["load_test"].detail


def test_a_level_s_speculation_sums_its_requests_perf_metrics():
    from pipeline.validate.client import StreamResult
    from pipeline.validate.load_test import speculation_of

    results = [StreamResult(0.0, pieces=["a"] * 10, drafted=6, accepted=3),
               StreamResult(0.0, pieces=["a"] * 5, drafted=2, accepted=0)]
    assert speculation_of(results) == {"requests": 2, "drafted": 8, "accepted": 3, "acceptance": 0.375,
                                       "drafts_per_step": round(8 / ((10 - 1 - 3) + (5 - 1 - 0)), 3)}
    assert speculation_of([StreamResult(0.0, pieces=["a"])]) is None     # a plain deployment reports none


def test_compare_reports_a_speculating_builds_acceptance_and_drafts_a_step(tiny_ckpt, tiny_hf, tmp_path):
    """compare's served side of a speculating build measures its acceptance and drafts a step on the comparison's
    prompts (validate's check), and the report has a row for each; a plain build has none to measure."""
    from pipeline.compare.report import speculation_rows
    from pipeline.compare.serving import ServeOptions, serve_and_measure

    plan = make_plan(resolve_model_info(str(tiny_ckpt)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=32, output_len=32, max_context=96),
                     speculative=SpeculativeRequest("ngram", None, 8, 0.5))
    plan = replace(plan, speculative=replace(plan.speculative, max_rows=8))     # whatever this host timed
    repo = deploy_repository(plan, tmp_path / "repo", checkpoint=tiny_ckpt, tokenizer=tiny_hf).path
    served = serve_and_measure(repo, None, ["the cat sat on the mat and the cat sat", "one two one two one"],
                               ServeOptions(max_tokens=40), speculative=plan.speculative)
    spec = served.speculation
    assert spec["method"] == "ngram" and spec["draft_len"] == 8 and spec["drafted"] > 0
    assert spec["acceptance"] == pytest.approx(spec["accepted"] / spec["drafted"], abs=1e-4)
    assert 0 < spec["drafts_per_step"] <= 8 and len(served.completions) == 2
    rows = speculation_rows(None, spec)
    assert rows[0] == "| speculative decoding | no speculation | ngram | |"
    assert f"{spec['acceptance']:.3f}" in rows[2] and f"{spec['drafts_per_step']:.2f}" in rows[3]
    assert speculation_rows(None, None) == []


def test_the_engine_paths_draft_target_repository_drafts_through_the_bls_exactly(tiny_ckpt, tiny_hf, tiny_draft,
                                                                                 tmp_path, triton_pool,
                                                                                 tiny_cpu_server):
    """The repository deploy writes for an engine draft-target plan (tensorrt_llm_draft beside tensorrt_llm, the
    BLS naming it, nothing decoupled), run on the real Triton server with the cpu target's tensorrt_llm models in
    the two engines' places: a request with num_draft_tokens loops draft -> target through the BLS and answers the
    text plain decoding answers (the ensemble's), with the drafted and accepted tokens of all its steps; streaming
    with drafts, and drafts where no draft model is named, are refused by name."""
    from pipeline.plan import Overrides
    from pipeline.triton_names import TENSORRT_LLM, TENSORRT_LLM_BLS, TENSORRT_LLM_DRAFT
    from pipeline.tritonconfig import parse_pbtxt, to_pbtxt

    workload, batch = Workload(input_len=32, output_len=32, max_context=96), Overrides(max_batch_size=4)
    plan = make_plan(resolve_model_info(str(tiny_hf)), get_target("rtx4090"), "fp16", workload=workload,
                     overrides=batch, speculative=SpeculativeRequest("draft", str(tiny_draft), 3))
    assert not plan.triton.decoupled_mode
    repo = deploy_repository(plan, tmp_path / "repo", engine=tmp_path / "engine",
                             draft_engine=tmp_path / "draft-engine", tokenizer=tiny_hf).path
    for name, ckpt in ((TENSORRT_LLM, tiny_ckpt), (TENSORRT_LLM_DRAFT, tiny_draft)):
        cpu_plan = make_plan(resolve_model_info(str(ckpt)), get_target("cpu"), "fp32", workload=workload,
                             overrides=batch)
        cpu = deploy_repository(cpu_plan, tmp_path / f"cpu-{name}", checkpoint=ckpt, tokenizer=tiny_hf).path
        shutil.rmtree(repo / name)
        shutil.copytree(cpu / TENSORRT_LLM, repo / name)
        config = parse_pbtxt((repo / name / "config.pbtxt").read_text())
        config.name, config.model_transaction_policy.decoupled = name, False
        (repo / name / "config.pbtxt").write_text(to_pbtxt(config))
    server = triton_pool.get(repo)
    url = server.http_url
    prompt = "the cat sat on the mat and then the cat"

    def generate(model: str, **body) -> dict:
        response = requests.post(f"{url}/v2/models/{model}/generate", timeout=120,
                                 json={"text_input": prompt, "max_tokens": 20, **body})
        assert response.status_code == 200, response.text
        return response.json()

    plain = generate("ensemble")["text_output"]
    drafted = generate(TENSORRT_LLM_BLS, num_draft_tokens=3, return_perf_metrics=True)
    assert drafted["text_output"] == plain
    assert drafted[TOTAL_DRAFT_TOKENS] >= 3 * 4 and 0 <= drafted[TOTAL_ACCEPTED_DRAFT_TOKENS] <= drafted[
        TOTAL_DRAFT_TOKENS]
    assert generate(TENSORRT_LLM_BLS)["text_output"] == plain
    report = validate_repository(repo, tmp_path / "validation", ValidateOptions(max_tokens=12, load_test=True),
                                 url=url, grpc_url=server.endpoints.grpc_url,
                                 metrics_url=server.endpoints.metrics_url)
    checks = {c.name: c for c in report.checks}
    assert report.passed and checks["speculation"].passed, [(c.name, c.detail) for c in report.checks]
    assert checks["speculation"].data["drafted"] > 0 and not checks["speculation"].data["differ"]
    assert "--speculative draft:" in checks["speculation"].detail
    assert {name for name, c in checks.items() if c.skipped} >= {"streaming", "load_test"}
    assert "does not stream: draft-target through tensorrt_llm_bls" in checks["streaming"].detail
    import openai
    from pipeline.openai_front.app import OpenAIFront

    def drafts_run() -> int:
        stats = requests.get(f"{url}/v2/models/{TENSORRT_LLM_DRAFT}/stats", timeout=10).json()
        return stats["model_stats"][0]["inference_count"]

    with OpenAIFront(repo, url, port=0) as front:    # the BLS model drafts, nothing streams
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)
        before = drafts_run()
        texts = {model: client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
                 .choices[0].text for model in ("ensemble", TENSORRT_LLM_BLS)}
        assert texts["ensemble"] == texts[TENSORRT_LLM_BLS] == plain and drafts_run() > before
        with pytest.raises(openai.BadRequestError, match="does not stream"):
            client.completions.create(model="ensemble", prompt=prompt, max_tokens=4, stream=True)
    for server, body, says in ((url, {"stream": True}, "only supported if model is deployed using decoupled mode"),
                               (tiny_cpu_server.http_url, {}, "this deployment has no draft model")):
        refused = requests.post(f"{server}/v2/models/{TENSORRT_LLM_BLS}/generate", timeout=60,
                                json={"text_input": prompt, "max_tokens": 8, "num_draft_tokens": 3, **body})
        assert refused.status_code == 400 and says in refused.text, refused.text


def test_the_bls_drafting_loop_ends_as_plain_decoding_does(monkeypatch):
    """trtpipe's BLS loop against stand-in draft and target models (the target continues each token t with t + 1 and
    ends before END; the draft proposes the same, wrong every third draft): the tokens plain decoding gives, cut at a
    stop word that spans two steps and at the target's end, the draft asked for min_tokens = its drafts, each step
    its own seed, the steps' drafted and accepted tokens summed."""
    import numpy as np

    bls = load_cpu_model(monkeypatch, "tensorrt_llm_bls")
    END, calls = 12, []

    def continuation(last: int, count: int) -> list[int]:
        out = []
        while len(out) < count and last + 1 != END:
            last += 1
            out.append(last)
        return out

    def call(model, inputs, outputs):
        sequence = inputs["input_ids"][0].tolist()
        count = int(inputs["request_output_len"][0, 0])
        calls.append((model, len(sequence), count, int(inputs["min_tokens"][0, 0]), int(inputs["seed"][0, 0])))
        new = continuation(sequence[-1], count)
        drafts = inputs["draft_input_ids"][0].tolist() if "draft_input_ids" in inputs else []
        if model == "draft":
            new = [t if (len(calls) + i) % 3 else t + 20 for i, t in enumerate(new)]
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, new)) if d != t), min(len(drafts), len(new)))
        return {"output_ids": np.array([[new]], np.int32), "sequence_length": np.array([[len(new)]], np.int32),
                "total_draft_tokens": np.array([[len(drafts)]], np.int32),
                "total_accepted_draft_tokens": np.array([[accepted]], np.int32)}

    monkeypatch.setattr(bls, "call", call)
    monkeypatch.setattr(bls, "outputs_of", lambda response, names: {k: v for k, v in response.items() if k in names})
    model = bls.TritonPythonModel()
    model.llm, model.draft_llm, model.exclude_input = "target", "draft", True
    model.wiring = {"tensorrt_llm": {"output_map": {name: name for name in bls.STEP_OUTPUTS + (
        "acceptance_rate",)}}}

    def run(prompt, wanted, stops=(), **extra) -> tuple[list, dict]:
        calls.clear()
        flat = [t for s in stops for t in s] or [0]
        ends = np.cumsum([len(s) for s in stops]).tolist() if stops else []
        base = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
                "request_output_len": np.array([[wanted]], np.int32),
                "stop_words_list": np.array([[flat, ends + [-1] * (len(flat) - len(ends))]], np.int32), **extra}
        out = model.speculate(base, 3, {})
        return out["output_ids"][0, 0].tolist(), out

    tokens, out = run([1, 2, 3], 6)
    assert tokens == [4, 5, 6, 7, 8, 9]                                   # max_tokens
    assert [c[0] for c in calls] == ["draft", "target", "draft", "target"]
    assert [(c[2], c[3]) for c in calls if c[0] == "draft"] == [(3, 3), (1, 1)]   # the last step drafts 6 - 4 - 1
    assert [c[4] for c in calls] == [0, 0, 1, 1]                          # each step its own seed
    # step 1 drafts 4, 5, 26 (the third wrong): 2 accepted; step 2 drafts 28 for 8: none
    assert (int(out["total_draft_tokens"][0, 0]), int(out["total_accepted_draft_tokens"][0, 0])) == (4, 2)
    assert float(out["acceptance_rate"][0, 0]) == 0.5
    assert run([1, 2, 3], 6, stops=[[7, 8]])[0] == [4, 5, 6, 7, 8]       # the stop word spans steps 1 and 2
    assert run([5, 6], 20)[0] == [7, 8, 9, 10, 11]                         # the target ended before END
    assert all(c[3] == 0 for c in calls if c[0] == "target")
    run([1, 2, 3], 6, min_tokens=np.array([[5]], np.int32))
    assert [c[3] for c in calls if c[0] == "target"] == [5, 1]            # min_tokens less what was output
