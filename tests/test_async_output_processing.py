"""Async output processing (``async_output_processing=True``, minipaged/engine_core.py; vLLM v0's name for
it, not v1's async scheduling): step N's forward pass runs in the model thread while the engine thread processes
step N-1's outputs.

It must change nothing a client can see but the timing: greedy tokens, text and finish reasons are the engine's
own without it, under chunked prefill, prefix caching and both preemption modes; a stop string found a step late
drops the token computed meanwhile and frees its blocks; the block map folded from events equals the block
manager's after every event; and the overlap really happens.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged import SamplingParams
from minipaged.event_view import EngineView
from minipaged.validation import ConfigError
from tests.conftest import random_prompts, step_until_done
from tests.test_scheduling import GREEDY, shared_prefix_workload

VARIANTS = {
    "default": {},
    "chunked-off": dict(enable_chunked_prefill=False),
    "budget-16": dict(max_num_batched_tokens=16),
    "prefix-cache-evicting": dict(enable_prefix_caching=True, num_blocks=40),
    "preempt-recompute": dict(num_blocks=24, preemption_mode="recompute"),
    "preempt-swap": dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64),
    "preempt-swap-cpu-full": dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=8),
    "static": dict(policy="static", max_num_seqs=4),
}


def outputs_of(engine, prompts, params):
    """Each request's (tokens, text, finish reason, stop reason), and the events of the run."""
    events = []
    engine.subscribe(events.append)
    outs = engine.generate(prompts, params)
    return [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in outs], events


def assert_all_free(engine):
    stats = engine.stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["cpu_blocks_free"] == stats["cpu_blocks_total"]
    engine.kv.check_invariants()


@pytest.fixture(scope="module")
def stop_strings(tiny_engine_factory):
    """Per prompt of the shared-prefix workload, a stop string from inside its own greedy text (so every request
    meets one mid-run), and the run without them."""
    plain, _ = outputs_of(tiny_engine_factory(num_blocks=512), shared_prefix_workload(), GREEDY)
    return [text[3 + i % 5: 5 + i % 5] for i, (_t, text, _f, _s) in enumerate(plain)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_outputs_and_stop_strings_are_the_same_with_async_output_processing(name, tiny_engine_factory,
                                                                            stop_strings):
    prompts = shared_prefix_workload()
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop] if i % 2 else None)
              for i, stop in enumerate(stop_strings)]
    expected, _ = outputs_of(tiny_engine_factory(**VARIANTS[name]), prompts, params)
    engine = tiny_engine_factory(async_output_processing=True, **VARIANTS[name])
    got, events = outputs_of(engine, prompts, params)
    assert got == expected
    assert sum(reason == "stop" for _t, _x, reason, _s in got) >= 3        # stop strings did end requests
    if name.startswith("preempt"):
        assert engine.stats()["preemptions_recompute"] + engine.stats()["preemptions_swap"] > 0
    assert [e.step for e in events] == list(range(1, len(events) + 1))      # events in step order
    # A stop string found a step late: its request was scheduled again (its token computed meanwhile, then
    # dropped); the engine's books still balance.
    finished_at = {f.request_id: e.step for e in events for f in e.finished}
    computed_after = {s.request_id for e in events for s in e.scheduled if e.step > finished_at[s.request_id]}
    assert computed_after, "no request was computed after its stop string: the late-stop case was not exercised"
    assert not engine.has_unfinished_requests()
    assert_all_free(engine)


def test_events_build_the_block_managers_map_after_every_step(tiny_engine_factory):
    """The property test of test_scheduling.py with async output processing on: aborts between steps (while a forward
    pass is in flight), stop strings found late, preemption of both kinds, chunked prefill and prefix caching."""
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(budget=st.integers(4, 64), seed=st.integers(0, 10_000), num_blocks=st.integers(30, 100),
           chunked=st.booleans(), max_num_seqs=st.integers(1, 8), aborts=st.integers(0, 3),
           preemption_mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans())
    def check(budget, seed, num_blocks, chunked, max_num_seqs, aborts, preemption_mode, caching):
        options = dict(num_blocks=num_blocks, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                       preemption_mode=preemption_mode, num_cpu_blocks=random.Random(seed).choice([4, 64]),
                       enable_prefix_caching=caching, async_output_processing=True)
        if chunked:
            options["max_num_batched_tokens"] = budget
        engine = tiny_engine_factory(**options)
        rng = random.Random(seed)
        ids = []
        system = [rng.randrange(256) for _ in range(12)]
        for prompt in random_prompts(rng, 8, 1, 48):
            stop = [chr(rng.randrange(32, 127))] if rng.random() < 0.5 else None    # one character: often hit
            ids.append(engine.add_request(system + prompt if rng.random() < 0.5 else prompt, SamplingParams(
                temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 20), ignore_eos=True, stop=stop)))
        view = EngineView(engine.info)
        step = 0
        while engine.has_unfinished_requests():
            if aborts and step == 3:
                for rid in rng.sample(ids, aborts):
                    engine.abort(rid)
            event = engine.step().event
            view.apply(event)
            step += 1
            assert event.step == step
            for block in engine.kv.pool.blocks:
                assert len(view.block_owners[block.block_id]) == block.ref_cnt
                assert view.block_cached[block.block_id] == (block.block_hash is not None)
            engine.kv.check_invariants()
            assert step < 2000
        assert_all_free(engine)
        # Idle at last: the ended requests' state is dropped then, not at a next step that may not come.
        assert not engine.sampler._generators and not engine.logits._processors
        assert not engine.scheduler.finished_req_ids
    check()


def test_outputs_are_processed_while_the_next_forward_pass_runs(tiny_engine_factory):
    """Processing a step's new tokens waits (up to half a second) for a forward pass to be running, and a
    forward pass waits for the processing before it returns: with async output processing, step N-1's outputs are
    processed in the engine thread while step N's forward pass runs in the model thread."""
    engine = tiny_engine_factory(async_output_processing=True)
    running, processed = threading.Event(), threading.Event()
    seen: list[tuple[bool, str]] = []                    # per step with new tokens: (a forward running?, thread)
    forward_threads: set[str] = set()
    execute, process_tokens = engine.runner.execute, engine.outputs.process_tokens

    def noted_execute(model_input):
        forward_threads.add(threading.current_thread().name)
        running.set()
        processed.wait(timeout=0.5)
        processed.clear()
        running.clear()
        return execute(model_input)

    def noted_process_tokens(new_token_ids, *args, **kwargs):
        if new_token_ids:
            seen.append((running.wait(timeout=0.5), threading.current_thread().name))
            processed.set()
        return process_tokens(new_token_ids, *args, **kwargs)

    engine.runner.execute, engine.outputs.process_tokens = noted_execute, noted_process_tokens
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    step_until_done(engine)
    # tokens 1-3 are processed while the next forward pass runs; the 4th is the last: nothing runs beside it
    assert seen == [(True, threading.current_thread().name)] * 3 + [(False, threading.current_thread().name)]
    assert [name.startswith("minipaged-model") for name in forward_threads] == [True]


def test_an_abort_while_its_token_is_computed_drops_that_token(tiny_engine_factory):
    engine = tiny_engine_factory(async_output_processing=True)
    engine.add_request([1, 2, 3], GREEDY, request_id="a")
    engine.add_request([4, 5, 6], GREEDY, request_id="b")
    engine.step()                                       # nothing done yet: step 1 (both prompts) computes
    delivered = [t for d in engine.step().outputs if d.request_id == "a" for s in d.samples for t in s.token_ids]
    assert len(delivered) == 1                          # a's first token; its second is being computed
    assert engine.abort("a")
    events, later = [], []
    engine.subscribe(events.append)
    while engine.has_unfinished_requests():
        later += [d.request_id for d in engine.step().outputs]
    assert "a" not in later
    assert [f.finish_reason for e in events for f in e.finished if f.request_id == "a"] == ["abort"]
    assert "a" in events[0].kv.freed                     # freed at once, before the next step's allocations
    assert not any("a" in e.new_token_ids for e in events)
    assert engine.counters["generation_tokens"] == len(delivered) + GREEDY.max_tokens
    assert_all_free(engine)


def test_an_id_used_again_while_its_last_owner_is_in_flight_starts_afresh(tiny_engine_factory):
    """Aborting a request whose token is being computed, then adding another under the same id: the new one
    gets its own random stream and processors (the old one's are forgotten before, not after, it arrives)."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logit_bias={42: 4.0, 17: 4.0})
    fresh = tiny_engine_factory().generate([[9, 8, 7, 6]], params)[0].token_ids
    engine = tiny_engine_factory(async_output_processing=True)
    engine.add_request([1, 2, 3], params, request_id="r")
    engine.step()
    engine.step()                                       # r's second token is being computed now
    assert engine.abort("r")
    engine.add_request([9, 8, 7, 6], params, request_id="r")
    assert step_until_done(engine)["r"].token_ids == fresh
    assert_all_free(engine)


def test_log_probabilities_and_seeded_samples_are_the_same_with_async_output_processing(tiny_engine_factory):
    prompts = random_prompts(random.Random(3), 4, 5, 30)
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)

    def run(**options):
        outs = tiny_engine_factory(max_num_batched_tokens=16, **options).generate(prompts, params)
        return [(o.prompt_logprobs, [(s.token_ids, s.logprobs) for s in o.outputs]) for o in outs]
    assert run(async_output_processing=True) == run()


def test_structured_outputs_and_their_masks_are_the_same_with_async_output_processing(tiny_engine_factory):
    """A grammar's matcher follows the request's tokens (``GrammarMask.sync``), which step N's forward pass has
    up to N-1's, as without async output processing; the masks' sizes reach the events in the same order."""
    from tests.test_logits import SCHEMA
    prompt = "Answer in JSON about the weather today, please: "
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs={"json": SCHEMA})
              for s in range(6)]

    def run(**options):
        engine = tiny_engine_factory(num_blocks=40, max_num_batched_tokens=16, **options)
        masks: dict[str, list[int]] = {}
        engine.subscribe(lambda ev: [masks.setdefault(rid, []).append(allowed)
                                     for rid, (allowed, _vocab) in ev.constrained.items()])
        outs = engine.generate([prompt] * len(params), params)
        assert engine.counters["preemptions_recompute"] >= 1, "no preemption happened: shrink num_blocks"
        return [(o.text, o.finish_reason) for o in outs], masks
    expected = run()
    assert sum(reason == "stop" for _text, reason in expected[0]) >= 3 and expected[1]
    assert run(async_output_processing=True) == expected


@pytest.mark.parametrize("options, message", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(tensor_parallel_size=2), "parallelism"),
])
def test_combinations_it_cannot_make_exact_are_refused_naming_the_flag(tiny_engine_factory, options, message):
    with pytest.raises(ConfigError, match=rf"--async-output-processing\) does not combine with .*{message}"):
        tiny_engine_factory(async_output_processing=True, **options)


def test_both_flags_parse_and_turn_back_into_flags():
    from minipaged.cli import make_parser
    from minipaged.options import as_command_line, engine_options
    for on in (True, False):
        words = as_command_line({"async_output_processing": on})
        assert words == ["--async-output-processing" if on else "--no-async-output-processing"]
        assert engine_options(make_parser().parse_args(["generate", *words])) == {"async_output_processing": on}


def test_the_start_up_line_says_whether_it_is_on(tiny_model):
    from minipaged import Engine
    for on in (False, True):
        lines: list[str] = []
        Engine(tiny_model, num_blocks=16, block_size=4, async_output_processing=on, load_progress=lines.append)
        said = [line for line in lines if line.startswith("Async output processing:")]
        assert len(said) == 1 and said[0].startswith(f"Async output processing: {'on' if on else 'off'} (")


# ------------------------------------------------------------------------------------ the server

def test_a_server_with_async_output_processing_streams_the_engines_own_outputs(tiny_model, tiny_engine_factory,
                                                                              tmp_path):
    """A real ``minipaged serve --async-output-processing``: concurrent streams (stop strings among them) get the text
    the engine gives without it, a client that hangs up is aborted, and every block comes back."""
    import asyncio

    import httpx
    import openai
    from tests.serve_util import running_server, wait_until_idle
    from tests.test_serve import metric_samples

    prompts = random_prompts(random.Random(5), 8, 3, 20, vocab=200)
    plain = tiny_engine_factory().generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = [[o.text[4:6]] if i % 2 else None for i, o in enumerate(plain)]
    expected = tiny_engine_factory().generate(prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                       stop=stop) for stop in stops])
    log = tmp_path / "server.log"
    with running_server(tiny_model, "--async-output-processing", "--block-size", "4", "--num-blocks", "512",
                        "--max-num-seqs", "4", log_path=str(log)) as url:
        async def run_all() -> list[tuple[str, str]]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
            model = (await client.models.list()).data[0].id

            async def one(prompt: list[int], stop) -> tuple[str, str]:
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
                chunks = [c async for c in stream]
                return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            try:
                return await asyncio.gather(*[one(p, s) for p, s in zip(prompts, stops)])
            finally:
                await client.close()
        got = asyncio.run(run_all())
        assert got == [(o.text, o.finish_reason) for o in expected]
        body = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True,
                "model": tiny_model}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            assert len([line for line, _ in zip(response.iter_lines(), range(6))]) == 6
        health = wait_until_idle(url, timeout=10.0)
        assert health["blocks_free"] == health["blocks_total"]
        aborted = metric_samples(url).get(("minipaged:request_success_total", (("finished_reason", "abort"),)))
        assert aborted == 1
    assert "Async output processing: on" in log.read_text()


def test_the_model_thread_is_put_on_the_engines_device(tiny_engine_factory, monkeypatch):
    """CUDA keeps the current device per thread (a new one starts on device 0, where Triton would launch): the
    model thread is set to the engine's device before its first forward pass."""
    seen = []
    monkeypatch.setattr("minipaged.engine_builder.use_in_this_thread",
                        lambda device: seen.append((device, threading.current_thread().name)))
    engine = tiny_engine_factory(async_output_processing=True)
    engine.generate([[1, 2, 3]], GREEDY)
    engine.generate([[4, 5, 6]], GREEDY)
    assert len(seen) == 1 and seen[0][0] == engine.device and seen[0][1].startswith("minipaged-model")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_greedy_tokens_on_cuda_are_the_same_with_async_output_processing(tiny_model):
    from minipaged import Engine
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(**options):
        engine = Engine(tiny_model, device="cuda", dtype="float32", block_size=16, num_blocks=12,
                        max_num_batched_tokens=32, preemption_mode="swap", num_cpu_blocks=32, **options)
        return [o.token_ids for o in engine.generate(prompts, params)]
    assert run(async_output_processing=True) == run()


def test_a_header_recorded_under_the_old_name_still_loads(tmp_path):
    """Traces and servers from before the rename wrote ``async_scheduling`` (the option was named after vLLM v1's
    async scheduling, which it is not): ``read_trace`` and the attach client read that key under its new name."""
    import json
    from pathlib import Path
    from minipaged.trace import read_trace
    from minipaged.tui.attach import parse_record
    lines = (Path(__file__).parent / "data" / "watch_trace.jsonl").read_text(encoding="utf-8").splitlines()
    header = {**json.loads(lines[0]), "async_scheduling": True}
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n", encoding="utf-8")
    info, events = read_trace(str(old))
    assert info.async_output_processing and len(events) == len(lines) - 1
    assert parse_record(json.dumps(header)) == info


# ------------------------------------------------------------------ found in review of the engine-core boundary
def test_prefix_lookups_reach_the_event_that_shows_the_admission_with_and_without_async(tiny_engine_factory):
    """With async output processing an admission's event is built a step after its lookup was logged: the
    recorder keeps the explanation until that event takes it, so both modes show the same lookups."""
    shown = {}
    for on in (False, True):
        engine = tiny_engine_factory(async_output_processing=on)
        events: list = []
        engine.subscribe(events.append)
        prompt = list(range(10, 24))
        for name in ("a", "b"):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                               request_id=name)
            while engine.has_unfinished_requests():
                engine.step()
        shown[on] = {s.request_id: s.prefix_lookup for ev in events for s in ev.scheduled if s.prefix_lookup}
        engine.close()
    assert shown[False]["a"].reason == "never" and shown[False]["b"].reason == "all_hit"
    assert shown[True] == shown[False]


def test_an_id_used_again_while_its_last_owners_prompt_is_scored_in_flight(tiny_engine_factory):
    """The old owner's prompt log-probabilities arrive after it was aborted and its id taken again: they are
    dropped, never written into the new owner's state."""
    engine = tiny_engine_factory(async_output_processing=True)
    engine.add_request(list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1),
                       request_id="x")
    engine.step()                                          # its prefill (and prompt scoring) is in flight
    engine.abort("x")
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), request_id="x")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [d.output for d in engine.step().outputs if d.output is not None]
    assert [len(o.token_ids) for o in outputs] == [2] and outputs[0].prompt_logprobs is None


def test_an_idle_engine_keeps_no_ended_requests_state(tiny_engine_factory):
    """Seeded sampling, logit biases and log-probabilities keep state per request; once the engine has nothing
    left to do it holds none of it (without async output processing too)."""
    engine = tiny_engine_factory()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True, logit_bias={5: 1.0}, logprobs=1)
    engine.generate([list(range(10, 24)), list(range(30, 40))], params)
    assert not engine.sampler._generators and not engine.logits._processors and not engine.logits._users
    assert not engine.scheduler.finished_req_ids and not engine.has_unfinished_requests()
    assert engine.counters["requests_finished"] == 2
