"""Scheduling, prefix caching, chunked prefill and preemption on the tiny model, checked through events.

The overarching rule: none of these features may change greedy outputs.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged import InvalidRequestError, SamplingParams
from minipaged.event_view import EngineView
from minipaged.policies import policy_names
from tests.conftest import random_prompts, step_until_done

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def shared_prefix_workload(seed: int = 0, n: int = 10) -> list[list[int]]:
    """Half the prompts share a 24-token system prefix; lengths vary so chunks and blocks split unevenly."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(24)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        prompts.append(system + tail if i % 2 == 0 else tail + system[:rng.randint(0, 10)])
    return prompts


def run_collecting(engine, prompts, params=GREEDY):
    events = []
    engine.subscribe(events.append)
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], events


@pytest.fixture(scope="module")
def baseline(tiny_engine_factory):
    engine = tiny_engine_factory(enable_prefix_caching=False, num_blocks=512)
    tokens, _ = run_collecting(engine, shared_prefix_workload())
    return tokens


VARIANTS = {
    "chunked-off": dict(enable_chunked_prefill=False),
    "budget-16": dict(max_num_batched_tokens=16),
    "budget-37": dict(max_num_batched_tokens=37),
    "budget-4096": dict(max_num_batched_tokens=4096),
    "prefix-cache-on": dict(enable_prefix_caching=True),
    "prefix-cache-evicting": dict(enable_prefix_caching=True, num_blocks=40),
    "preempt-recompute": dict(num_blocks=24, preemption_mode="recompute"),
    "preempt-swap": dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64),
    "preempt-swap-cpu-full": dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=8),
    "preempt-chunked-off-cache-off": dict(num_blocks=24, enable_chunked_prefill=False,
                                          enable_prefix_caching=False),
    "static": dict(policy="static", max_num_seqs=4),
    "preempt-swap-static": dict(policy="static", max_num_seqs=6, num_blocks=24, preemption_mode="swap",
                                num_cpu_blocks=64),
    "max-num-seqs-3": dict(max_num_seqs=3, max_num_batched_tokens=20),
    # policies (minipaged.policies): who is admitted, preempted and evicted changes timing, never tokens
    "shortest-prompt-first": dict(scheduling_policy="shortest-prompt-first", max_num_seqs=3),
    "preempt-most-blocks": dict(num_blocks=24, preemption_victim="most-blocks"),
    "preempt-priority-lowest-priority": dict(num_blocks=24, scheduling_policy="priority",
                                             preemption_victim="lowest-priority"),
    "prefix-cache-evicting-mru": dict(enable_prefix_caching=True, num_blocks=40, eviction_policy="mru"),
    # a long prompt's capped chunk and the limits on partial prefills (issue 39) change who runs when, not tokens
    "long-prefill-8": dict(long_prefill_token_threshold=8),
    "long-prefill-8-two-partial": dict(long_prefill_token_threshold=8, max_long_partial_prefills=2,
                                       max_num_partial_prefills=2, num_blocks=40),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_outputs_do_not_depend_on_engine_features(name, baseline, tiny_engine_factory):
    engine = tiny_engine_factory(**VARIANTS[name])
    tokens, events = run_collecting(engine, shared_prefix_workload())
    assert tokens == baseline
    stats = engine.stats()
    if name.startswith("preempt"):
        assert stats["preemptions_recompute"] + stats["preemptions_swap"] > 0
    if name in ("preempt-swap", "preempt-swap-cpu-full", "preempt-swap-static"):
        assert stats["preemptions_swap"] > 0 and stats["blocks_swapped_in"] > 0
    if name == "preempt-swap-cpu-full":
        assert stats["preemptions_recompute"] > 0           # fell back when the CPU pool was full
    if name.startswith("prefix-cache-evicting"):
        assert stats["blocks_evicted"] > 0 and stats["prefix_cache_hits"] > 0
    if name == "budget-16":
        assert any(s.kind == "prefill" and s.end < s.prompt_len for e in events for s in e.scheduled)
    for event in events:
        assert event.budget_used <= event.budget_limit
        assert len(event.scheduled) <= event.max_num_seqs
    # every block, GPU and CPU, is free again
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["cpu_blocks_free"] == stats["cpu_blocks_total"]
    engine.kv.check_invariants()


def test_prefill_first_never_mixes_prefills_and_decodes(tiny_engine_factory):
    engine = tiny_engine_factory(enable_chunked_prefill=False)
    _, events = run_collecting(engine, shared_prefix_workload(n=8))
    kinds = [{s.kind for s in e.scheduled} for e in events]
    assert all(len(k) <= 1 for k in kinds)
    assert {"prefill"} in kinds and {"decode"} in kinds


def test_static_batching_admits_nobody_until_the_batch_is_done(tiny_engine_factory):
    engine = tiny_engine_factory(policy="static", max_num_seqs=2)
    prompts = random_prompts(random.Random(1), 4, 5, 8)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 12, 3, 3)]
    events = []
    engine.subscribe(events.append)
    engine.generate(prompts, params)
    first_step_of = {}
    last_step_of = {}
    for e in events:
        for s in e.scheduled:
            first_step_of.setdefault(s.request_id, e.step)
            last_step_of[s.request_id] = e.step
    assert first_step_of["2"] > last_step_of["1"]        # waited for the long request of the first batch
    continuous = tiny_engine_factory(max_num_seqs=2)
    cont_events = []
    continuous.subscribe(cont_events.append)
    continuous.generate(prompts, params)
    assert len(cont_events) < len(events)                # continuous batching needs fewer steps


SPECULATION = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "self-draft": {"method": "draft_model", "model": "self", "num_draft_layers": 1, "num_speculative_tokens": 2},
}


def rng_cpu_blocks(seed: int) -> int:
    """A CPU swap pool from tiny (swap falls back to recompute) to roomy."""
    return random.Random(seed).choice([4, 16, 64])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(4, 96), seed=st.integers(0, 10_000), num_blocks=st.integers(30, 120),
       chunked=st.booleans(), max_num_seqs=st.integers(1, 8), aborts=st.integers(0, 3),
       preemption_mode=st.sampled_from(["recompute", "swap"]), policy=st.sampled_from(["continuous", "static"]),
       speculation=st.sampled_from([None, "ngram", "self-draft"]),
       scheduling_policy=st.sampled_from(policy_names("scheduling_policy")),
       preemption_victim=st.sampled_from(policy_names("preemption_victim")),
       eviction_policy=st.sampled_from(policy_names("eviction_policy")))
def test_budget_respected_and_decodes_never_starved(tiny_engine_factory, budget, seed, num_blocks, chunked,
                                                    max_num_seqs, aborts, preemption_mode, policy, speculation,
                                                    scheduling_policy, preemption_victim, eviction_policy):
    options = dict(num_blocks=num_blocks, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                   preemption_mode=preemption_mode, policy=policy, num_cpu_blocks=rng_cpu_blocks(seed),
                   scheduling_policy=scheduling_policy, preemption_victim=preemption_victim,
                   eviction_policy=eviction_policy)
    if speculation is not None:          # drafts take budget and slots, roll back, and are dropped on preemption
        options["speculative_config"] = SPECULATION[speculation]
    if chunked:
        options["max_num_batched_tokens"] = budget
    engine = tiny_engine_factory(**options)
    rng = random.Random(seed)
    ids = []
    for prompt in random_prompts(rng, 8, 1, 60):
        ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 20),
                                                             ignore_eos=True, priority=rng.randint(-2, 2))))
    view = EngineView(engine.info)
    step = 0
    while engine.has_unfinished_requests():
        if aborts and step == 3:
            for rid in rng.sample(ids, aborts):
                engine.abort(rid)
        decoders = {r.request_id for r in engine.scheduler.running if not r.is_prefill}
        waiting = {r.request_id for r in engine.scheduler.waiting}
        event = engine.step().event
        view.apply(event)
        step += 1
        assert event.budget_used <= event.budget_limit
        assert len(event.scheduled) <= max_num_seqs
        scheduled = {s.request_id for s in event.scheduled}
        preempted = {p.request_id for p in event.preempted}
        if event.num_prefill_tokens and chunked:
            assert decoders <= scheduled | preempted, "a prefill ran while a decode waited"
        if event.swapped:
            assert not scheduled & waiting, "a waiting request was admitted while another sat swapped out"
        # the observer's view, built from events alone, agrees with the block manager
        for block in engine.kv.pool.blocks:
            assert len(view.block_owners[block.block_id]) == block.ref_cnt
            assert view.block_cached[block.block_id] == (block.block_hash is not None)
        engine.kv.check_invariants()                     # kept counts (free, cached and free) equal a recount
        assert step < 2000
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


def test_prefix_aware_admission_counts_only_uncached_blocks_and_tokens(tiny_engine_factory):
    # Pool of 12 blocks of 4 tokens. A holds 8 blocks of a 32-token prompt and keeps decoding.
    engine = tiny_engine_factory(num_blocks=12)
    system = list(range(10, 42))
    engine.add_request(system, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id="A")
    engine.step()
    assert engine.kv.num_free_blocks == 4               # and A's next decode will take one of them
    # B shares A's 32 tokens and adds 6: 10 blocks in all, but only 2 are new, and 3 will be free.
    engine.add_request(system + [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=2), request_id="B")
    event = engine.step().event
    b = next(s for s in event.scheduled if s.request_id == "B")
    assert (b.num_cached_tokens, b.start, b.end) == (32, 32, 38)
    assert event.budget_used == 6 + 1                     # B's uncached tokens + A's decode
    assert any(len(owners) == 2 for owners in _owners(engine))   # blocks shared by A and B
    outs = step_until_done(engine)
    assert outs["B"].num_cached_tokens == 32

    # Without caching the same request has to wait: it needs 10 blocks.
    cold = tiny_engine_factory(num_blocks=12, enable_prefix_caching=False)
    cold.add_request(system, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id="A")
    cold.step()
    cold.add_request(system + [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=2), request_id="B")
    event = cold.step().event
    assert "B" not in {s.request_id for s in event.scheduled}
    assert step_until_done(cold)["B"].token_ids == outs["B"].token_ids


def _owners(engine):
    return [[rid for rid, table in engine.kv.req_blocks.items() if b in table] for b in range(engine.kv.num_blocks)]


def test_fully_cached_prompt_runs_one_token_of_prefill(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = list(range(50, 82))                          # 32 tokens: exactly 8 full blocks
    first = engine.generate([prompt], GREEDY)[0]
    events = []
    engine.subscribe(events.append)
    second = engine.generate([prompt], GREEDY)[0]
    admit = events[0].scheduled[0]
    assert (admit.start, admit.end, admit.num_cached_tokens) == (31, 32, 31)
    assert events[0].budget_used == 1
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == 31


def test_parallel_samples_share_prompt_blocks(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = list(range(100, 130))
    events = []
    engine.subscribe(events.append)
    out = engine.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    first = events[0]
    assert [s.num_cached_tokens for s in first.scheduled] == [0, 28, 28]    # siblings hit 7 full blocks
    assert first.budget_used == 30 + 2 + 2
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.num_cached_tokens == 28                                       # what the samples found cached
    again = tiny_engine_factory().generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                                    ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_seeded_sampling_does_not_depend_on_batch_mates(tiny_engine_factory):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny_engine_factory().generate([[1, 2, 3, 4, 5]], params)[0].token_ids
    crowd = random_prompts(random.Random(2), 5, 3, 30)
    together = tiny_engine_factory(max_num_batched_tokens=16).generate(
        crowd[:2] + [[1, 2, 3, 4, 5]] + crowd[2:], [SamplingParams(temperature=1.0, max_tokens=10)] * 2 + [params]
        + [SamplingParams(temperature=1.0, max_tokens=10)] * 3)[2].token_ids
    assert alone == together


def test_request_that_can_never_fit_is_rejected_at_once(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=10)           # 40 token slots
    with pytest.raises(InvalidRequestError, match="could never finish"):
        engine.add_request(list(range(30)), SamplingParams(max_tokens=20))
    assert not engine.has_unfinished_requests()
    assert engine.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("prompt, params, message", [
    ("", None, "empty"),
    ([], None, "empty"),
    ([1, 2, 99999], None, "outside the vocabulary"),
    ([1.5, 2], None, "integer token ids"),
    (list(range(200)) * 11, None, "max_model_len"),
])
def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(tiny_engine_factory, prompt, params,
                                                                    message):
    engine = tiny_engine_factory()
    engine.add_request([5, 6, 7], GREEDY, request_id="survivor")
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(prompt, params)
    assert list(step_until_done(engine)) == ["survivor"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-5), "top_k"), (dict(n=0), "n must"),
    (dict(stop=[""]), "stop"), (dict(top_k=True), "top_k"), (dict(temperature=float("inf")), "temperature"),
    (dict(seed=1.5), "seed"), (dict(stop_token_ids=5), "list of token ids"), (dict(stop_token_ids=[-1]), "outside the int64 range of token ids"),
    (dict(n=True), "n must"),
])
def test_invalid_sampling_values_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_stop_conditions(tiny_engine_factory):
    engine = tiny_engine_factory()
    free_run = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    target = free_run.token_ids[3]
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]))[0]
    assert out.token_ids == free_run.token_ids[:free_run.token_ids.index(target) + 1]
    assert out.finish_reason == "stop"
    # A stop string: two characters from inside the free run's text, so the run must meet it and stop there.
    stop_text = free_run.text[2:4]
    assert len(stop_text) == 2, f"the free run's text {free_run.text!r} is too short to take a stop string from"
    cut = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, stop=[stop_text]))[0]
    assert cut.finish_reason == "stop" and stop_text not in cut.text
    assert free_run.text.startswith(cut.text)
    short = tiny_engine_factory(max_model_len=8).generate([[1, 2, 3]], SamplingParams(temperature=0,
                                                                                      max_tokens=50))[0]
    assert len(short.token_ids) == 5 and short.finish_reason == "length"


def test_abort_frees_blocks_and_reports_it(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.add_request(list(range(40)), GREEDY, request_id="x")
    engine.add_request(list(range(9)), GREEDY, request_id="y")
    engine.step()
    assert engine.abort("x") and not engine.abort("nope")
    event = engine.step().event
    assert [f.finish_reason for f in event.finished if f.request_id == "x"] == ["abort"]
    assert "x" in event.kv.freed
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_preemption_logs_a_warning_in_vllm_style(tiny_engine_factory, caplog):
    engine = tiny_engine_factory(num_blocks=16)
    with caplog.at_level("WARNING", logger="minipaged.scheduler"):
        engine.generate(random_prompts(random.Random(4), 6, 10, 20), GREEDY)
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert warnings and "PreemptionMode.RECOMPUTE" in warnings[0]
    assert "max_num_seqs" in warnings[0] and f"total_cumulative_preemption_cnt={len(warnings)}" in warnings[-1]


@pytest.mark.parametrize("chunked", [True, False])
def test_swapped_requests_come_back_before_anyone_new_is_admitted(tiny_engine_factory, chunked):
    engine = tiny_engine_factory(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64,
                                 enable_chunked_prefill=chunked)
    rng = random.Random(0)
    for prompt in random_prompts(rng, 12, 10, 40):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    swaps = 0
    while engine.has_unfinished_requests():
        waiting = {r.request_id for r in engine.scheduler.waiting}
        event = engine.step().event
        swaps += len(event.swapped_in)
        admitted = {s.request_id for s in event.scheduled} & waiting
        assert not (admitted and event.swapped), f"step {event.step}: {admitted} admitted ahead of {event.swapped}"
    assert swaps > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and engine.cpu_pool.num_free_blocks == 64


def test_a_swapped_request_that_held_the_whole_pool_comes_back(tiny_engine_factory):
    """V shares R's 8-token prefix and fills all 4 blocks; swapped out, it must be able to return."""
    engine = tiny_engine_factory(num_blocks=4, preemption_mode="swap", num_cpu_blocks=16)
    prefix = list(range(10, 18))
    engine.add_request(prefix, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id="R")
    engine.add_request(prefix + list(range(30, 36)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       request_id="V")
    results = [engine.step() for _ in range(40) if engine.has_unfinished_requests()]
    assert not engine.has_unfinished_requests(), "a swapped-out request never came back"
    assert any(p.request_id == "V" and p.mode == "swap" for r in results for p in r.event.preempted)
    assert {d.request_id: d.output.finish_reason for r in results for d in r.outputs if d.finished} == \
        {"R": "length", "V": "length"}


def test_a_request_whose_sampling_fails_is_aborted_and_the_others_go_on(tiny_engine_factory, monkeypatch):
    engine = tiny_engine_factory()
    sample_row = engine.sampler._sample_row

    def flaky(logits, req):
        if req.request_id == "bad" and len(req.output_token_ids) == 2:
            raise RuntimeError("probability tensor contains nan")
        return sample_row(logits, req)

    monkeypatch.setattr(engine.sampler, "_sample_row", flaky)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    engine.add_request([1, 2, 3], sampled, request_id="bad")
    engine.add_request([4, 5, 6], sampled, request_id="good")
    engine.add_request([7, 8, 9], GREEDY, request_id="greedy")
    outs = step_until_done(engine)
    assert outs["bad"].finish_reason == "abort" and len(outs["bad"].token_ids) == 2
    assert outs["good"].finish_reason == "length" and len(outs["good"].token_ids) == 6
    assert len(outs["greedy"].token_ids) == 16
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_temperatures_near_zero_are_greedy_and_any_integer_seed_works(tiny_engine_factory):
    engine = tiny_engine_factory()
    greedy = engine.generate([[1, 2, 3]], GREEDY)[0].token_ids
    assert engine.generate([[1, 2, 3]], SamplingParams(temperature=1e-40, max_tokens=16,
                                                       ignore_eos=True))[0].token_ids == greedy
    for seed in (-3, 2**64 + 7):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        first, again = (engine.generate([[1, 2, 3]], params)[0].token_ids for _ in range(2))
        assert len(first) == 8 and first == again


def test_generate_queues_nothing_when_one_prompt_is_bad(tiny_engine_factory):
    engine = tiny_engine_factory()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([[1, 2, 3], [4, 5, 6], []], GREEDY)
    assert not engine.has_unfinished_requests()
    outs = engine.generate([[7, 8, 9]], GREEDY)
    assert len(outs) == 1 and not engine.has_unfinished_requests()     # nothing left over from the failed call


def test_generated_ids_skip_the_ones_callers_chose(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.add_request([1, 2], GREEDY, request_id="0")
    engine.add_request([1, 2], GREEDY, request_id="1")
    assert engine.add_request([1, 2], GREEDY) == "2"
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2], GREEDY, request_id="1")
    # n samples run as "<id>.0", "<id>.1": those names must be free too.
    engine.add_request([1, 2], GREEDY, request_id="3.1")
    two = SamplingParams(n=2, temperature=0, max_tokens=2)
    assert engine.add_request([1, 2], two) == "4"
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2], two, request_id="3")
    assert sorted(step_until_done(engine)) == ["0", "1", "2", "3.1", "4"]


def test_none_means_no_stop_strings_or_stop_tokens():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == () and params.stop_token_ids == ()


def test_a_stop_string_is_never_streamed(tiny_engine_factory):
    """The stream (the step's outputs, and StepEvents' new_text) and the final text agree: a stop string's first
    characters, seen before the rest of it arrives, are held back and then dropped with it."""
    engine = tiny_engine_factory()
    free = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    # three printable ASCII characters: with the byte-level test tokenizer they arrive one token at a time
    cut = next(i for i in range(1, len(free) - 3)
               if free[i:i + 3].isascii() and free[i:i + 3].isprintable() and free.find(free[i:i + 3]) == i)
    stop = free[cut:cut + 3]
    streamed = []
    engine.subscribe(lambda e: streamed.append(e.new_text.get("s", "")))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True),
                       request_id="s")
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step().outputs
    out = deltas[-1].output
    assert out.finish_reason == "stop" and out.text == free[:cut]
    assert "".join(streamed) == "".join(d.samples[0].text for d in deltas) == out.text
    # Aborted with characters held back (they could have begun the stop string): observers see them go out;
    # the caller who aborted gets nothing more.
    streamed.clear()
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=16, stop=["\x00" + stop],
                                                 ignore_eos=True), request_id="s")
    delivered = ""
    for _ in range(cut + 2):
        delivered += "".join(d.samples[0].text for d in engine.step().outputs)
    held_back = len(stop)        # "\x00" + stop is one longer: its length less one may be held back
    engine.abort("s")
    assert engine.step().outputs == ()
    total = "".join(streamed)
    assert total == free[:len(total)] and delivered == total[:len(total) - held_back] != total
