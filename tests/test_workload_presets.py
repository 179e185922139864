"""Every workload preset does what its description (shown in the TUI) says it does.

Each preset runs to the end on a tiny random model with the preset's own engine options, and its
description's claims are checked against the StepEvents. The tiny model's tokenizer is byte-level, so its
prompts are longer in tokens than SmolLM2's; the presets are sized so that the claims hold for both.
"""
from __future__ import annotations

from typing import Callable

import pytest

from minipaged import Engine
from minipaged.event_view import EngineView
from minipaged.events import StepEvent
from minipaged.model.testing import build_tiny_llama
from minipaged.tui.driver import LiveRun
from minipaged.workloads import PRESETS, make_workload


@pytest.fixture(scope="module")
def long_context_tiny_model(tmp_path_factory) -> str:
    """The tiny model with room for long-prompts' documents (about 2,000 bytes, so 2,000 tokens here)."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096))


def run_preset(model: str, name: str) -> tuple[EngineView, list[StepEvent]]:
    workload = make_workload(name)
    run = LiveRun(lambda progress: Engine(model, **workload.engine_options), workload)
    info = run.load()
    view, events = EngineView(info), []
    while (event := run.step()) is not None:
        view.apply(event)
        events.append(event)
        assert len(events) < 5000, f"{name} does not finish"
    assert not run.engine.has_unfinished_requests()
    return view, events


def arrival_index(request_id: str) -> int:
    return int(request_id.lstrip("r"))        # LiveRun names requests r0, r1 ... in arrival order


def check_shared_system_prompt(view: EngineView, events: list[StepEvent]) -> None:
    """'watch its blocks become shared (x2, x3 ...) and later prompts hit the prefix cache'"""
    max_shared = 0
    replay = EngineView(view.info)
    for event in events:
        replay.apply(event)
        max_shared = max(max_shared, max(len(owners) for owners in replay.block_owners))
    assert max_shared >= 3, "no block was ever held by three requests at once"
    finished = sorted((f for e in events for f in e.finished), key=lambda f: arrival_index(f.request_id))
    later = finished[1:]
    hit = [f for f in later if f.num_cached_tokens > 0]
    assert len(hit) >= 0.9 * len(later), f"only {len(hit)} of {len(later)} later prompts hit the prefix cache"


def check_chat(view: EngineView, events: list[StepEvent]) -> None:
    """'Short independent questions arriving one by one: continuous batching admits each as soon as it comes.'"""
    arrived = {a.request_id: e.step for e in events for a in e.arrivals}
    assert all(len(e.arrivals) <= 1 for e in events), "questions arrive together"
    first_scheduled: dict[str, int] = {}
    for e in events:
        for s in e.scheduled:
            first_scheduled.setdefault(s.request_id, e.step)
    assert first_scheduled == arrived, "a request waited after it arrived"
    assert max(len(e.running) for e in events) >= 3, "no batch formed: nothing for continuous batching to show"


def check_long_prompts(view: EngineView, events: list[StepEvent]) -> None:
    """'prompts are prefilled in chunks, mixed with other requests' decodes'"""
    prefill_steps: dict[str, int] = {}
    for e in events:
        for s in e.scheduled:
            if s.kind == "prefill":
                prefill_steps[s.request_id] = prefill_steps.get(s.request_id, 0) + 1
    assert all(n > 1 for n in prefill_steps.values()), "a prompt was prefilled in one step"
    mixed = [e for e in events if e.num_prefill_tokens and e.num_decode_tokens]
    assert len(mixed) >= 5, "chunks were rarely mixed with decodes"


def check_burst(view: EngineView, events: list[StepEvent]) -> None:
    """'Many requests at once into a small pool: only a few fit, most wait in the queue for blocks, and
    running ones that outgrow the pool are preempted.'"""
    first = events[0]
    num_requests = len(first.arrivals)
    assert num_requests >= 16, "not a burst: the requests did not all arrive at step 1"
    assert len(first.waiting) > num_requests / 2, f"only {len(first.waiting)} of {num_requests} wait at step 1"
    assert first.budget_used < first.budget_limit, "the token budget, not the pool, held them back"
    assert first.num_free_blocks < 4, "the pool still had room at step 1"
    assert sum(len(e.preempted) for e in events) > 0, "nobody was preempted"


def check_oversubscribed(view: EngineView, events: list[StepEvent]) -> None:
    """'the newest running request is preempted'"""
    preemptions = 0
    running_before: set[str] = set()
    for e in events:
        for p in e.preempted:
            preemptions += 1
            candidates = running_before | {a.request_id for a in e.arrivals}
            assert arrival_index(p.request_id) == max(arrival_index(r) for r in candidates), \
                f"step {e.step}: {p.request_id} was preempted, not the newest running request"
            candidates.discard(p.request_id)
            running_before = candidates
        running_before = set(e.running)
    assert preemptions >= 3


CLAIMS: dict[str, Callable[[EngineView, list[StepEvent]], None]] = {
    "shared-system-prompt": check_shared_system_prompt,
    "chat": check_chat,
    "long-prompts": check_long_prompts,
    "burst": check_burst,
    "oversubscribed": check_oversubscribed,
}


def test_every_preset_has_its_claims_checked():
    assert set(CLAIMS) == set(PRESETS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_does_what_its_description_says(long_context_tiny_model, name):
    view, events = run_preset(long_context_tiny_model, name)
    CLAIMS[name](view, events)
