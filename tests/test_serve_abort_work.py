"""issue 30, defect 1: aborting a request with many samples costs work in proportion to its samples.

Aborting an n=20,000 request once kept the engine thread busy for 135 s (every other request got 503 meanwhile):
each sample's abort scanned the queues (comparing requests field by field) and every sample of its parent.
The test counts the work instead of timing it: Python calls (function calls and generator resumptions, as
``sys.setprofile`` sees them) made by ``Engine.abort``, for 500 and 1,000 samples. Linear work doubles;
the quadratic code made 538,567 calls for 1,000 samples (144,317 for 500), now 35,072 (17,572).
"""
from __future__ import annotations

import sys

from minipaged import SamplingParams
from tests.conftest import step_until_done


def calls_during(fn) -> int:
    count = 0

    def profile(_frame, event, _arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def abort_calls(engine, n: int, tag: str) -> int:
    """Queue a request with n samples beside a small one, step twice, abort the big one; the small one must
    then finish normally and every block come back."""
    engine.add_request("other", SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"{tag}-other")
    engine.add_request("many", SamplingParams(n=n, max_tokens=50, ignore_eos=True, temperature=1.0, seed=1),
                       request_id=f"{tag}-many")
    engine.step()
    engine.step()
    calls = calls_during(lambda: engine.abort(f"{tag}-many"))
    finishes = []
    engine.subscribe(lambda event: finishes.extend(event.finished))
    outputs = step_until_done(engine)
    assert outputs[f"{tag}-other"].outputs[0].finish_reason == "length"
    assert len(outputs[f"{tag}-other"].outputs[0].token_ids) == 6
    assert f"{tag}-many" not in outputs                       # the caller who aborted it gets nothing more
    assert sorted(f.finish_reason for f in finishes if f.request_id.startswith(f"{tag}-many.")) == ["abort"] * n
    assert engine.kv.num_free_blocks == engine.info.num_blocks
    return calls


def test_aborting_a_thousand_samples_is_linear_work(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=512, max_num_seqs=8)
    small, big = abort_calls(engine, 500, "a"), abort_calls(engine, 1000, "b")
    print(f"calls made by abort: {small} for 500 samples, {big} for 1000")
    assert big < 60 * 1000, f"{big} calls to abort 1000 samples: more than linear work"
    assert big < 2.5 * small, f"doubling the samples took {big / small:.1f}x the calls: not linear"
