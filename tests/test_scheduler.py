"""The in-flight scheduler's decisions (pipeline/runtime/scheduler.py), without a runtime: the block pool, both
batch_scheduler_policy values, priority levels, the token budget of a step and the rows of a batch."""

from __future__ import annotations

import pytest

from pipeline.runtime import SamplingConfig
from pipeline.runtime.generate import RowResult
from pipeline.runtime.scheduler import MAX_UTILIZATION, Scheduler, SchedulerLimits, Sequence


def sequence(key, prompt_len: int, new: int) -> Sequence:
    return Sequence(key, [1] * prompt_len, SamplingConfig(max_new_tokens=new))


def produce(s: Sequence, tokens: int) -> None:
    """As serve_rows records a sequence's output."""
    if s.result is None:
        s.result = RowResult()
    s.result.tokens.extend([2] * tokens)


def keys(sequences) -> list:
    return [s.key for s in sequences]


def test_guaranteed_no_evict_reserves_the_whole_output_and_holds_back_what_does_not_fit():
    scheduler = Scheduler(SchedulerLimits(kv_tokens=64, tokens_per_block=8))      # 8 blocks
    a, b = sequence("a", 10, 20), sequence("b", 4, 4)                              # 4 blocks, 1 block
    c = sequence("c", 8, 24)                                                       # 4 blocks
    for s in (a, b, c):
        scheduler.submit([s])
    assert keys(scheduler.admit()) == ["a", "b"]
    assert (len(a.blocks), len(b.blocks), len(scheduler.free_blocks)) == (4, 1, 3)
    produce(a, 19)
    assert scheduler.make_room([a]) == [] and len(a.blocks) == 4       # reserved already: never grows, never pauses
    scheduler.finish(b)
    assert keys(scheduler.admit()) == ["c"] and scheduler.free_blocks == []


def test_max_utilization_grows_block_by_block_and_pauses_the_latest_started():
    scheduler = Scheduler(SchedulerLimits(kv_tokens=32, tokens_per_block=4, policy=MAX_UTILIZATION))   # 8 blocks
    a, b, c = sequence("a", 8, 16), sequence("b", 8, 16), sequence("c", 3, 16)
    for s in (a, b, c):
        scheduler.submit([s])
    assert keys(scheduler.admit()) == ["a", "b", "c"]                  # 2 + 2 + 1 blocks: only their prompts
    for s in (a, b, c):
        produce(s, 1)
    assert scheduler.make_room([a, b, c]) == []                        # a, b: a 3rd block each; c fits in its 1st
    assert len(scheduler.free_blocks) == 1
    for s in (a, b, c):
        produce(s, 4)
    paused = scheduler.make_room([a, b, c])                            # a takes the last free one; b needs one more
    assert keys(paused) == ["c"] and c.paused == 1 and c.blocks == []  # c, started last, gives its 1 back
    assert keys(scheduler.running) == ["a", "b"] and scheduler.free_blocks == []
    assert keys(g.sequences[0] for g in scheduler.waiting) == ["c"]
    assert c.context() == [1] * 3 + [2] * 5                            # restarted with what it produced
    scheduler.finish(a)
    assert keys(scheduler.admit()) == ["c"] and len(c.blocks) == 2 and c.allocated == 3


def test_a_running_sequence_that_alone_lacks_a_block_pauses_itself():
    scheduler = Scheduler(SchedulerLimits(kv_tokens=8, tokens_per_block=4, policy=MAX_UTILIZATION))
    a, b = sequence("a", 4, 4), sequence("b", 4, 4)
    scheduler.submit([a])
    scheduler.submit([b])
    scheduler.admit()
    produce(a, 1)
    produce(b, 1)
    assert keys(scheduler.make_room([b, a])) == ["b"]     # b needs one, the pool is empty: the latest (b) pauses
    assert len(a.blocks) == 2


def test_priority_levels_start_the_highest_first_and_keep_arrival_order_within_a_level():
    scheduler = Scheduler(SchedulerLimits(max_rows=1, priority_levels=3, default_priority_level=2))
    for key, priority in (("low-1", 3), ("default", 0), ("low-2", 3), ("high", 1), ("mid", 2)):
        scheduler.submit([sequence(key, 2, 2)], priority)
    order = []
    while scheduler.waiting:
        started = scheduler.admit()
        order += keys(started)
        scheduler.finish(started[0])
    assert order == ["high", "default", "mid", "low-1", "low-2"]


def test_a_paused_sequence_waits_ahead_of_later_arrivals_of_its_level():
    scheduler = Scheduler(SchedulerLimits(kv_tokens=8, tokens_per_block=4, policy=MAX_UTILIZATION,
                                          priority_levels=2, default_priority_level=2))
    a, b, late = sequence("a", 4, 4), sequence("b", 4, 4), sequence("late", 1, 1)
    scheduler.submit([a])
    scheduler.submit([b])
    scheduler.admit()
    scheduler.submit([late])
    produce(a, 1)
    produce(b, 1)
    scheduler.make_room([a, b])
    assert keys(g.sequences[0] for g in scheduler.waiting) == ["b", "late"]


def test_the_token_budget_of_a_step_counts_prompts_and_the_running_rows_decode_tokens():
    scheduler = Scheduler(SchedulerLimits(max_num_tokens=10))
    a, b, c = sequence("a", 5, 4), sequence("b", 5, 4), sequence("c", 9, 4)
    for s in (a, b, c):
        scheduler.submit([s])
    assert keys(scheduler.admit()) == ["a", "b"]          # 10 of 10 tokens
    assert keys(scheduler.admit()) == []                  # a and b decode 2: c's 9 exceed the 8 left
    scheduler.finish(a)
    assert keys(scheduler.admit()) == ["c"]               # 1 + 9


def test_max_rows_bounds_the_batch_but_a_larger_request_runs_alone():
    scheduler = Scheduler(SchedulerLimits(max_rows=2))
    scheduler.submit([sequence("a", 1, 1)])
    scheduler.submit([sequence(f"big{i}", 1, 1) for i in range(3)])
    assert keys(scheduler.admit()) == ["a"]
    scheduler.finish(scheduler.running[0])
    assert keys(scheduler.admit()) == ["big0", "big1", "big2"]


@pytest.mark.parametrize("limits, sequences, priority, expected", [
    (SchedulerLimits(kv_tokens=16, tokens_per_block=8), [sequence("a", 10, 10)], None,
     "needs 3 KV-cache blocks of 8 tokens for its prompt and output; the pool (max_tokens_in_paged_kv_cache 16) "
     "holds 2"),
    (SchedulerLimits(max_num_tokens=8), [sequence("a", 9, 1)], None, "the prompt's 9 tokens exceed max_num_tokens 8"),
    (SchedulerLimits(priority_levels=2, default_priority_level=1), [sequence("a", 1, 1)], 3,
     "priority 3 is outside the model's priority levels 1..2"),
    (SchedulerLimits(), [sequence("a", 1, 1)], 1, "priority 1: the model has no priority levels"),
])
def test_what_can_never_run_is_refused_with_the_reason(limits, sequences, priority, expected):
    assert expected in Scheduler(limits).refusal(sequences, priority)


def test_withdraw_takes_a_stopped_request_out_of_the_queue():
    scheduler = Scheduler()
    scheduler.submit([sequence("a", 1, 1)])
    scheduler.submit([sequence("b", 1, 1), sequence("b", 1, 1)])
    taken = scheduler.withdraw(lambda key: key == "b")
    assert [keys(g.sequences) for g in taken] == [["b", "b"]] and keys(scheduler.admit()) == ["a"]


@pytest.mark.parametrize("bad, message", [
    ({"policy": "fcfs"}, "batch_scheduler_policy 'fcfs' is not one of guaranteed_no_evict, max_utilization"),
    ({"kv_tokens": 10, "tokens_per_block": 64}, "holds no block of 64 tokens"),
    ({"priority_levels": 2, "default_priority_level": 3}, "default_priority_level 3 must be in [1, priority_levels 2]"),
])
def test_limits_that_make_no_sense_are_refused(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SchedulerLimits(**bad)
