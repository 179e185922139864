"""Every cache miss explained: an admitted request's event says how many of its full blocks hit the prefix cache
and why the first one that did not missed (never computed, evicted at step S for request R, a cache reset, or
its tokens differ from the cached ones from position P).

The engine runs record a trace (a file, read back as a watcher would) and the reasons are checked against what
the same trace says happened to the blocks, not against numbers written here.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import SamplingParams
from minipaged.block_pool import ROOT_HASH, hash_block_tokens
from minipaged.event_view import EngineView
from minipaged.events import PrefixLookup, StepEvent, describe_prefix_lookup
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.kv_recorder import KVRecorder
from minipaged.policies import LRUFreeBlockQueue
from minipaged.prefix_misses import MissRecord, common_prefix
from minipaged.request import Request, SamplingParams as Params
from minipaged.trace import read_trace, write_trace_event, write_trace_header

BS = 4
needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def run_one_at_a_time(engine, prompts: dict[str, list[int]], path) -> tuple[list[StepEvent], EngineView]:
    """Each prompt runs alone to its end, in order; the run is recorded to ``path`` and read back."""
    with open(path, "w", encoding="utf-8") as fp:
        write_trace_header(fp, engine.info)
        engine.subscribe(lambda ev: write_trace_event(fp, ev))
        for name, prompt in prompts.items():
            engine.add_request(prompt, GREEDY, request_id=name)
            while engine.has_unfinished_requests():
                engine.step()
    info, events = read_trace(str(path))
    view = EngineView(info)
    for ev in events:
        view.apply(ev)
    return events, view


def admission(events: list[StepEvent], rid: str):
    return next((ev, s) for ev in events for s in ev.scheduled if s.request_id == rid and s.prefix_lookup)


@pytest.fixture(scope="module")
def three_misses(tiny_engine_factory, tmp_path_factory):
    """A recorded run: a never-seen prompt, the same with one token changed, a filler that evicts, the first again."""
    rng = random.Random(0)
    a = [rng.randrange(256) for _ in range(14)]                      # 3 full blocks of 4, and 2 tokens
    a_changed = a[:6] + [(a[6] + 1) % 256] + a[7:]                    # one token differs, at position 6
    filler = [rng.randrange(256) for _ in range(4 * 9)]              # needs every free block: evicts a's
    engine = tiny_engine_factory(num_blocks=12)
    path = tmp_path_factory.mktemp("misses") / "trace.jsonl"
    events, view = run_one_at_a_time(engine, {"a": a, "b": a_changed, "fill": filler, "again": a}, path)
    return path, events, view


def test_a_trace_explains_a_never_seen_prefix_a_one_token_difference_and_an_eviction(three_misses):
    _path, events, view = three_misses

    assert view.requests["a"].prefix_lookup == PrefixLookup(3, 0, "never")
    # b shares a's first block, and the second up to the token that differs.
    assert view.requests["b"].prefix_lookup == PrefixLookup(3, 1, "differs", differs_at=6)
    assert describe_prefix_lookup(view.requests["b"].prefix_lookup) == \
        "1/3 blocks hit; block 1 missed: tokens differ at position 6"

    # "again" repeats a: its first miss is the block of a's chain evicted first, and the trace shows which step
    # took that block, and for whom.
    ev, s = admission(events, "again")
    lookup = s.prefix_lookup
    assert lookup.reason == "evicted" and lookup.num_hit_blocks < 3
    a_blocks = admission(events, "a")[0].kv.allocated["a"]
    missed_block = a_blocks[lookup.num_hit_blocks]
    taker = next(e for e in events if missed_block in e.kv.evicted)
    assert (lookup.evicted_step, lookup.evicted_for) == (taker.step, "fill")
    assert missed_block in taker.kv.allocated["fill"]
    assert s.num_cached_tokens == lookup.num_hit_blocks * BS
    assert f"evicted at step {taker.step} for fill" in describe_prefix_lookup(lookup)


def test_the_tui_says_why_the_selected_request_missed(three_misses, tmp_path):
    """The output panel of ``watch --replay`` shows the selected request's lookup, between prompt and output."""
    from minipaged.tui.app import WatchApp
    from minipaged.tui.widgets.output import OutputPanel
    path, events, view = three_misses
    app = WatchApp(replay=read_trace(str(path)), paused=True)
    shown = {}

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            app.go_to(len(events))
            for rid in ("a", "b", "again"):
                app.select(rid)
                await pilot.pause()
                shown[rid] = " ".join(str(app.query_one(OutputPanel).render()).split())   # unwrapped
            app.save_screenshot(str(tmp_path / "again.svg"))

    asyncio.run(run())
    for rid in ("a", "b", "again"):
        line = "prefix cache: " + describe_prefix_lookup(view.requests[rid].prefix_lookup)
        assert shown[rid].startswith(line), shown[rid]          # first, above the prompt and output


@needs_chromium
def test_the_page_says_why_the_selected_request_missed(three_misses, tmp_path):
    """The exported page (offline, the page's own fold) shows the selected request's lookup in the TUI's words."""
    from minipaged.cli import main
    path, _events, view = three_misses
    page_file = tmp_path / "run.html"
    assert main(["export-html", str(path), "-o", str(page_file)]) == 0

    async def run() -> dict[str, str]:
        async with open_page(page_file.as_uri(), offline=True) as page:
            deadline = time.monotonic() + 30
            while not await evaluate(page, "!!(window.minipaged && window.minipaged.state)"):
                assert time.monotonic() < deadline, "the exported page never drew"
                await asyncio.sleep(0.2)
            await evaluate(page, """(() => { const s = document.getElementById('slider');
                s.value = s.max; s.dispatchEvent(new Event('input')); })()""")
            shown = {}
            for rid in ("b", "again"):
                await asyncio.sleep(0.3)
                await evaluate(page, f"document.querySelector('tr[data-request=\"{rid}\"]').click()")
                await asyncio.sleep(0.3)
                shown[rid] = await evaluate(page, "document.getElementById('output-cache').textContent")
            return shown

    shown = asyncio.run(run())
    for rid in ("b", "again"):
        assert shown[rid] == "prefix cache: " + describe_prefix_lookup(view.requests[rid].prefix_lookup), shown


def test_a_fully_cached_prompt_and_a_preempted_recompute_are_explained_again(tiny_engine_factory, tmp_path):
    prompt = list(range(10, 22))                                     # exactly 3 full blocks
    engine = tiny_engine_factory()
    events, view = run_one_at_a_time(engine, {"first": prompt, "second": prompt}, tmp_path / "trace.jsonl")
    assert view.requests["second"].prefix_lookup == PrefixLookup(3, 3, "all_hit")
    assert describe_prefix_lookup(view.requests["second"].prefix_lookup) == "3/3 blocks hit"
    # Only admissions carry a lookup: decodes and later chunks do not.
    assert sum(1 for ev in events for s in ev.scheduled if s.prefix_lookup) == 2


def test_no_lookup_no_explanation(tiny_engine_factory, tmp_path):
    """With prefix caching off nothing is looked up, so nothing is explained (and nothing is claimed)."""
    engine = tiny_engine_factory(enable_prefix_caching=False)
    events, view = run_one_at_a_time(engine, {"a": list(range(9))}, tmp_path / "trace.jsonl")
    assert view.requests["a"].prefix_lookup is None
    assert all(s.prefix_lookup is None for ev in events for s in ev.scheduled)


def test_traces_recorded_before_lookups_still_load():
    from pathlib import Path
    info, events = read_trace(str(Path(__file__).parent / "data" / "watch_trace.jsonl"))
    assert events and all(s.prefix_lookup is None for ev in events for s in ev.scheduled)


# ------------------------------------------------------------------------------------ the block manager

def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), Params(max_tokens=1), 0, 0.0)


def admit(kv: KVCacheManager, recorder: KVRecorder, req: Request) -> PrefixLookup:
    """The scheduler's order: look up, then allocate (which publishes the request's own blocks); the recorder
    reads the change log in order, so it explains the lookup against the cache as it was before the allocation.
    Each call is one engine step (one fold of the log)."""
    hits, num_cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, num_cached, hits)
    _changes, lookups = recorder.fold(kv.take_log())
    return lookups[req.request_id]


def test_a_reset_is_named_and_a_forgotten_eviction_is_not_called_never(monkeypatch):
    kv = KVCacheManager(num_blocks=4, block_size=2, free_queue=LRUFreeBlockQueue)
    recorder = KVRecorder(kv.num_blocks, kv.block_size)
    a = request("a", [1, 2, 3, 4])
    admit(kv, recorder, a)                                           # step 1
    kv.free(a)
    kv.reset_prefix_cache()                                          # in step 2
    assert admit(kv, recorder, request("a2", [1, 2, 3, 4])) == PrefixLookup(2, 0, "reset", evicted_step=2)

    monkeypatch.setattr("minipaged.prefix_misses.MIN_EVICTIONS_KEPT", 2)
    kv = KVCacheManager(num_blocks=2, block_size=2, free_queue=LRUFreeBlockQueue)
    recorder = KVRecorder(kv.num_blocks, kv.block_size)
    assert recorder.misses.capacity == 2
    for i, tokens in enumerate(([1, 2], [3, 4], [5, 6], [7, 8])):    # three evictions: the first is forgotten
        r = request(f"r{i}", tokens + [9])
        admit(kv, recorder, r)
        kv.free(r)
    assert kv.stats.evictions == 3 and recorder.misses.forgot_an_eviction
    assert admit(kv, recorder, request("new", [11, 12])) == PrefixLookup(1, 0, "unrecorded")
    assert admit(kv, recorder, request("old", [1, 2])) == PrefixLookup(1, 0, "unrecorded")   # evicted long ago


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=4), min_size=1, max_size=12, unique_by=tuple),
       st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_the_divergence_point_is_the_longest_prefix_shared_with_any_cached_sibling(cached, query):
    """One bisect finds what comparing with every cached continuation would (the record's claim of exactness)."""
    record = MissRecord(num_blocks=16)
    parent = hash_block_tokens(ROOT_HASH, [9, 9, 9, 9])
    for tokens in cached:
        record.cached(hash_block_tokens(parent, tokens), parent, (), tokens)
    hashes = [parent, hash_block_tokens(parent, query)]
    if query in cached:
        return
    lookup = record.explain(hashes, 1, parent, (), query, 4)
    assert lookup.reason == "differs"
    assert lookup.differs_at == 4 + max(common_prefix(query, c) for c in cached)


def test_an_evicted_block_stops_being_a_sibling():
    record = MissRecord(num_blocks=4)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    record.cached(h, ROOT_HASH, (), [1, 2])
    query = [1, 3]
    assert record.explain([hash_block_tokens(ROOT_HASH, query)], 0, ROOT_HASH, (), query, 2).reason == "differs"
    record.dropped(h, 7, "x")
    assert record.explain([hash_block_tokens(ROOT_HASH, query)], 0, ROOT_HASH, (), query, 2).reason == "never"
    assert record.explain([h], 0, ROOT_HASH, (), [1, 2], 2) == PrefixLookup(1, 0, "evicted", 7, "x")
    record.cached(h, ROOT_HASH, (), [1, 2])                          # cached again: no longer "evicted"
    assert h not in record.evictions


@pytest.mark.parametrize("reason", ["never", "evicted", "reset", "differs", "unrecorded"])
def test_every_reason_is_said_in_a_short_line(reason):
    text = describe_prefix_lookup(PrefixLookup(13, 6, reason, 31, "r6", 100))
    assert text.startswith("6/13 blocks hit; block 6 missed: ") and "None" not in text
    # Two lines of the output panel in a 100x30 terminal (about 45 columns), so it stays in view there.
    assert len("prefix cache: " + text) <= 80
