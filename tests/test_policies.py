"""Policies on the engine: admission order, preemption victim and free-block eviction, by name or from a file.

Each policy's behaviour is read from the StepEvents (who was first scheduled, who was preempted), as an
observer would; a user's class is loaded from a file; a misfit or raising class gets a clear error and the
engine goes on serving everyone else.
"""
from __future__ import annotations

import logging
import textwrap

import pytest

from minipaged import SamplingParams
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.kv_recorder import KVRecorder
from minipaged.config import ConfigError
from minipaged.policies import LRUFreeBlockQueue, MRUFreeBlockQueue, PolicyError, load_policy
from minipaged.request import Request

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def first_scheduled_order(engine, prompts, params) -> list[str]:
    """Request ids in the order they were first scheduled (all are queued before the first step)."""
    order: list[str] = []
    engine.subscribe(lambda e: order.extend(s.request_id for s in e.scheduled if s.request_id not in order))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    assert sorted(order) == sorted(ids)
    return order


PROMPTS = [[5] * 12, [6] * 4, [7] * 8, [8] * 6]
PRIORITIES = [1, 1, 0, -3]


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["0", "1", "2", "3"]),                        # arrival order, priorities ignored
    ("priority", ["3", "2", "0", "1"]),                    # lower value first, then arrival
    ("shortest-prompt-first", ["1", "3", "2", "0"]),       # 4, 6, 8, 12 prompt tokens
])
def test_admission_order_of_each_scheduling_policy(tiny_engine_factory, policy, expected):
    engine = tiny_engine_factory(scheduling_policy=policy, max_num_seqs=1)
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=p) for p in PRIORITIES]
    assert first_scheduled_order(engine, PROMPTS, params) == expected


def test_a_late_high_priority_request_overtakes_the_queue(tiny_engine_factory):
    engine = tiny_engine_factory(scheduling_policy="priority", max_num_seqs=1)
    order: list[str] = []
    engine.subscribe(lambda e: order.extend(s.request_id for s in e.scheduled if s.request_id not in order))
    for i in range(4):
        engine.add_request([10 + i] * 6, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()                                          # "0" runs; 1, 2, 3 wait
    late = engine.add_request([20] * 6, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, priority=-1))
    while engine.has_unfinished_requests():
        engine.step()
    assert order == ["0", late, "1", "2", "3"]


def preempted_first(engine, prompts, params) -> str:
    events = []
    engine.subscribe(events.append)
    engine.generate(prompts, params)
    victims = [p.request_id for e in events for p in e.preempted]
    assert victims, "the pool was meant to run dry"
    return victims[0]


@pytest.mark.parametrize("victim_policy, expected", [
    ("newest", "2"),                 # the last to arrive
    ("lowest-priority", "0"),        # priority 5 is the lowest
    ("most-blocks", "1"),            # the longest prompt holds the most blocks
])
def test_preemption_victim_of_each_policy(tiny_engine_factory, victim_policy, expected):
    # 3 requests of 12-20 prompt tokens growing by 24 tokens each cannot all fit 20 blocks of 4 tokens.
    engine = tiny_engine_factory(num_blocks=20, preemption_victim=victim_policy, enable_prefix_caching=False)
    prompts = [[1] * 12, [2] * 20, [3] * 12]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, priority=p) for p in (5, 0, 0)]
    assert preempted_first(engine, prompts, params) == expected
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_lru_evicts_the_block_freed_longest_ago_and_mru_the_newest():
    def evicted_after(queue) -> list[int]:
        kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True, free_queue=queue)
        old, new = (Request(r, toks, GREEDY, i, 0.0) for i, (r, toks) in enumerate((("old", [1, 2]), ("new", [3, 4]))))
        for req in (old, new):
            assert kv.allocate_slots(req, 2, 0)
        kv.free(old)
        kv.free(new)                                       # both blocks free and cached; "old" freed first
        taker = Request("t", [9] * 8, GREEDY, 2, 0.0)
        assert kv.allocate_slots(taker, 6, 0)              # 3 blocks: the 2 uncached ones, then one cached
        kv.check_invariants()
        return KVRecorder(kv.num_blocks, kv.block_size).fold(kv.take_log())[0].evicted

    lru, mru = evicted_after(LRUFreeBlockQueue), evicted_after(MRUFreeBlockQueue)
    assert len(lru) == len(mru) == 1
    assert lru == [0] and mru == [1]                       # "old" held block 0, "new" block 1


@pytest.mark.parametrize("policy, words", [("lru", "(least recently used)"), ("mru", "(most recently freed first)")])
def test_the_event_log_names_the_eviction_order_the_engine_used(tiny_engine_factory, policy, words):
    from minipaged.tui.state import WatchState

    engine = tiny_engine_factory(eviction_policy=policy, num_blocks=8, block_size=4)
    state = WatchState(engine.info)
    engine.subscribe(state.apply)
    for seed in range(4):                                  # distinct prompts: each one's blocks evict the last's
        engine.generate([[seed * 10 + i + 1 for i in range(16)]], GREEDY)
    evictions = [line.text for line in state.log if line.kind == "evict"]
    assert evictions and all(words in text for text in evictions), evictions


def test_greedy_tokens_do_not_depend_on_priorities(tiny_engine_factory):
    prompts = [[i + 1] * (3 + 2 * i) for i in range(6)]
    plain = tiny_engine_factory().generate(prompts, GREEDY)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, priority=p) for p in (3, -1, 0, 2, -5, 1)]
    engine = tiny_engine_factory(scheduling_policy="priority", preemption_victim="lowest-priority", num_blocks=12,
                                 max_num_seqs=3)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]


# ---------------------------------------------------------------------------------------- a user's class
USER_POLICIES = '''
from minipaged.policies import RequestOrder


class LongestPromptFirst(RequestOrder):
    def key(self, request):
        return (-request.num_prompt_tokens, request.arrival_index)


class Duck:                                    # no base class: the methods are what count
    def key(self, request):
        return -request.arrival_index

    def first(self, waiting):
        return min(waiting, key=self.key)


class NoKey:
    def first(self, waiting, extra):
        return waiting[0]


class Explodes(RequestOrder):
    def key(self, request):
        if request.num_prompt_tokens == 9:
            raise RuntimeError("I do not like nine")
        return request.arrival_index


class BadVictim:
    def choose(self, candidates, num_blocks):
        raise KeyError("no victim today")
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_policies.py"
    path.write_text(textwrap.dedent(USER_POLICIES))
    return path


@pytest.mark.parametrize("cls, expected", [("LongestPromptFirst", ["0", "2", "3", "1"]),
                                           ("Duck", ["3", "2", "1", "0"])])
def test_a_user_class_from_a_file_orders_admission(tiny_engine_factory, user_file, cls, expected):
    engine = tiny_engine_factory(scheduling_policy=f"{user_file}:{cls}", max_num_seqs=1)
    assert first_scheduled_order(engine, PROMPTS, [GREEDY] * 4) == expected


@pytest.mark.parametrize("option, value, words", [
    ("scheduling_policy", "{file}:NoKey", "has no method key"),
    ("scheduling_policy", "{file}:Missing", "has no class 'Missing'"),
    ("scheduling_policy", "nowhere.py:X", "no file 'nowhere.py'"),
    ("scheduling_policy", "lottery", "neither a policy (fcfs, priority, shortest-prompt-first)"),
    ("preemption_victim", "{file}:BadVictim", "a trial run of BadVictim failed"),
    ("eviction_policy", "{file}:LongestPromptFirst", "has no method __len__"),
])
def test_a_policy_that_does_not_fit_is_refused_with_the_fix(user_file, option, value, words):
    with pytest.raises(PolicyError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        load_policy(option, value.format(file=user_file))
    assert isinstance(info.value, ConfigError)
    assert "--" + option.replace("_", "-") in str(info.value)


def test_a_wrong_signature_is_refused_when_the_engine_starts(tiny_engine_factory, user_file):
    (user_file.parent / "sig.py").write_text(textwrap.dedent('''
        class TwoArgs:
            def key(self, request, extra):
                return 0
            def first(self, waiting):
                return waiting[0]
    '''))
    with pytest.raises(ConfigError, match=r"TwoArgs.key\(self, request, extra\) does not take the arguments"):
        tiny_engine_factory(scheduling_policy=f"{user_file.parent / 'sig.py'}:TwoArgs")


def test_a_policy_that_raises_fails_its_request_and_the_engine_serves_the_others(tiny_engine_factory, user_file,
                                                                                 caplog):
    engine = tiny_engine_factory(scheduling_policy=f"{user_file}:Explodes", max_num_seqs=2)
    prompts = [[1] * 5, [2] * 9, [3] * 6]
    with caplog.at_level(logging.ERROR, logger="minipaged.scheduler"):
        outputs = engine.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outputs] == ["length", "abort", "length"]
    assert "scheduling_policy Explodes raised RuntimeError: I do not like nine" in caplog.text
    assert "Explodes raised RuntimeError: I do not like nine" in outputs[1].outputs[0].error   # for its client
    assert outputs[0].outputs[0].error is None
    plain = tiny_engine_factory().generate([prompts[0], prompts[2]], GREEDY)
    assert [outputs[0].token_ids, outputs[2].token_ids] == [o.token_ids for o in plain]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


def test_a_victim_policy_that_raises_fails_the_request_that_needed_room(tiny_engine_factory, user_file, caplog,
                                                                        monkeypatch):
    engine = tiny_engine_factory(num_blocks=20, enable_prefix_caching=False)
    # The trial run at start-up passes; from now on the policy raises, as a buggy one would under load.
    monkeypatch.setattr(type(engine.scheduler.victim_policy), "choose",
                        lambda self, candidates, num_blocks: 1 / 0)
    prompts = [[1] * 12, [2] * 20, [3] * 12]
    with caplog.at_level(logging.ERROR, logger="minipaged.scheduler"):
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    reasons = [o.finish_reason for o in outputs]
    assert "abort" in reasons and "length" in reasons
    assert "preemption_victim Newest raised ZeroDivisionError" in caplog.text
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


def test_priority_must_be_an_integer():
    from minipaged import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        SamplingParams(priority=0.5)
