"""The TUI's model: everything on screen folded from StepEvents (no Textual app needed), the block-map
layout, the workload presets, the live driver's arrival logic and the --no-tui printer."""
from __future__ import annotations

import argparse
import io
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from minipaged.events import (EngineInfo, KVChanges, Preemption, RequestArrival, RequestFinish, ScheduledRequest,
                              StepEvent)
from minipaged.outputs import StepResult
from minipaged.request import InvalidRequestError, SamplingParams
from minipaged.trace import read_trace
from minipaged.tui.driver import LiveRun
from minipaged.tui.plain import print_run
from minipaged.tui.state import PALETTE, WatchState, clean_preview, describe_event, printable
from minipaged.tui.widgets.block_map import choose_layout, cpu_cells, gpu_cells
from minipaged.workloads import PRESETS, Arrival, Workload, arrival_steps, format_prompt, make_workload

TRACE = Path(__file__).parent / "data" / "watch_trace.jsonl"


def info(num_blocks: int = 8, num_cpu_blocks: int = 4) -> EngineInfo:
    return EngineInfo(model="synthetic", num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_size=4,
                      max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=True,
                      enable_prefix_caching=True, policy="continuous", preemption_mode="swap",
                      kv_bytes_per_token=64, device="cpu", dtype="float32", attention_backend="torch")


def step(n: int, **kw) -> StepEvent:
    base = dict(step=n, time_s=n * 0.1, duration_s=0.1, schedule_s=0.01, model_s=0.09, budget_limit=8,
                budget_used=0, max_num_seqs=4, num_total_blocks=8, num_free_blocks=8, num_total_cpu_blocks=4,
                num_free_cpu_blocks=4)
    base.update(kw)
    return StepEvent(**base)


def synthetic_events() -> list[StepEvent]:
    """A: 8-token prompt in two chunks; B shares A's first block; B is swapped out and back; both finish."""
    return [
        step(1, arrivals=(RequestArrival("A", 8, 2, "Hello there"),),
             scheduled=(ScheduledRequest("A", "prefill", 0, 4, 8, 0, 0),), budget_used=4,
             kv=KVChanges(allocated={"A": [0]}, cached=[0]), running=("A",), num_free_blocks=7),
        step(2, arrivals=(RequestArrival("B", 6, 2, "Hello you"),),
             scheduled=(ScheduledRequest("A", "prefill", 4, 8, 8, 0, 1), ScheduledRequest("B", "prefill", 4, 6, 6, 4, 1)),
             budget_used=6, new_token_ids={"A": [1], "B": [2]}, new_text={"A": "x", "B": "y"},
             kv=KVChanges(allocated={"A": [1, 2], "B": [0, 3]}, cache_hits={"B": [0]}, cached=[1]),
             running=("A", "B"), num_free_blocks=4, counters={"prefix_cache_hit_rate": 0.5}),
        step(3, preempted=(Preemption("B", "swap", 2, "no room"),), scheduled=(ScheduledRequest("A", "decode", 8, 9, 8, 0, 2),),
             budget_used=1, new_token_ids={"A": [3]}, new_text={"A": "z"},
             kv=KVChanges(freed={"B": [0, 3], "A": [0, 1, 2]}, swapped_out={"B": [(0, 0), (3, 1)]}),
             finished=(RequestFinish("A", "length", 8, 2, 0, 0.2, 0.3, 0.1),),
             running=(), swapped=("B",), num_free_blocks=8, num_free_cpu_blocks=2),
        step(4, swapped_in=("B",), scheduled=(ScheduledRequest("B", "decode", 6, 7, 6, 0, 2),), budget_used=1,
             new_token_ids={"B": [4]}, kv=KVChanges(swapped_in={"B": [(0, 5), (1, 6)]}),
             finished=(RequestFinish("B", "length", 6, 2, 4, 0.1, 0.3, 0.1),), running=(), num_free_blocks=8),
    ]


def test_fold_matches_the_events():
    evs = synthetic_events()
    state = WatchState.from_events(info(), evs[:2])
    assert state.view.block_owners[0] == ["A", "B"]             # shared by a prefix-cache hit
    assert state.view.block_state(0) == "shared"
    assert state.colour("A") == PALETTE[0] and state.colour("B") == PALETTE[1]
    assert state.view.requests["A"].text == "x"
    assert state.queues()["running"] == ["A", "B"]
    kinds = [line.kind for line in state.log]
    assert kinds == ["arrive", "admit", "chunk", "arrive", "chunk", "admit", "hit", "chunk"]
    assert "prefill chunk 0→4 of 8" in state.log[2].text
    assert "(last chunk)" in state.log[4].text
    state.apply(evs[2])
    assert state.view.cpu_block_owner[:2] == ["B", "B"]
    assert state.view.requests["B"].state == "swapped"
    assert any(line.kind == "preempt" and "swap" in line.text for line in state.log)
    # Latencies on the engine clock (steps of 0.1 s): A arrived before step 1 and B before step 2, and
    # both got their first token in step 2; A's next token came one step later, B's (swapped) two.
    assert list(state.ttft_ms.history) == pytest.approx([200, 100])
    assert state.itl_ms.last == pytest.approx(100)
    state.apply(evs[3])
    assert state.itl_ms.last == pytest.approx(200)
    assert state.view.requests["B"].blocks == [5, 6] and state.view.cpu_block_owner[:2] == [None, None]
    assert state.queues()["finished"] == ["B", "A"]
    assert state.tokens_per_s.last == pytest.approx(4 / 0.4)


def test_going_back_is_refolding():
    evs = synthetic_events()
    forward = WatchState.from_events(info(), evs)
    back = WatchState.from_events(info(), evs[:2])
    again = WatchState.from_events(info(), evs[:2])
    assert back.view.block_owners == again.view.block_owners
    assert forward.view.block_owners != back.view.block_owners


def test_describe_event_names_recompute_and_eviction():
    i = info()
    state = WatchState.from_events(i, synthetic_events()[:2])
    ev = step(3, preempted=(Preemption("B", "recompute", 2, "no room"),), kv=KVChanges(evicted=[7]))
    lines = describe_event(ev, state.view)
    assert [line.kind for line in lines] == ["preempt", "evict"]
    assert "recompute" in lines[0].text


@pytest.mark.parametrize("num_blocks", [64, 500, 2048, 8192, 20000])
def test_block_map_layout_fits_any_pool(num_blocks):
    for width, height in [(60, 15), (120, 40), (30, 6)]:
        g = choose_layout(num_blocks, width, height)
        cells = -(-num_blocks // g.group)
        assert g.cols * g.cell_width <= width
        rows = -(-cells // g.cols)
        assert rows * g.pitch - g.row_gap <= height
        assert g.group & (g.group - 1) == 0                      # a power of two: "1 cell = 8 blocks"
    assert choose_layout(64, 120, 40).group == 1


def test_grouped_cells_summarise_their_blocks():
    state = WatchState.from_events(info(), synthetic_events()[:2])
    cells = gpu_cells(state, 4, "B")
    assert [c.size for c in cells] == [4, 4]
    assert cells[0].used == 4 and cells[0].kind == "shared" and cells[0].selected and cells[0].owner == "B"
    assert cells[1].kind == "free"
    # Drawn: a grouped cell with shared blocks carries a "+" (no room for "x2"); a single block its count.
    from minipaged.tui.widgets.block_map import cell_look
    assert cell_look(cells[0], 1, PALETTE[0], False)[0] == "+"
    one = gpu_cells(state, 1, None)
    assert cell_look(one[0], 3, PALETTE[0], False)[0].strip() == "x2"
    crowded = replace(one[0], ref_count=13)
    assert cell_look(crowded, 5, PALETTE[0], False)[0].strip() == "x13"          # room for the x
    assert cell_look(crowded, 2, PALETTE[0], False)[0].strip() == "13"           # no room: the count alone
    assert [c.kind for c in one[:5]] == ["shared", "used", "used", "used", "free"]
    state.apply(synthetic_events()[2])
    assert [c.kind for c in cpu_cells(state, 1, None)] == ["swapped", "swapped", "free", "free"]
    assert gpu_cells(state, 1, None)[1].kind == "cached"       # A's freed block keeps its cached prefix


def test_text_is_made_safe_to_draw():
    assert printable("a\x11b\nc") == "a·b\nc"
    assert clean_preview("<|im_start|>system\nYou are <|im_end|>") == "You are"


def test_workloads_are_deterministic_and_shaped():
    for name in PRESETS:
        a, b = make_workload(name, seed=3), make_workload(name, seed=3)
        assert a == b and a.arrivals
        assert all(x.step >= 1 for x in a.arrivals)
    shared = make_workload("shared-system-prompt")
    assert len({x.system for x in shared.arrivals}) == 1
    assert make_workload("burst").arrivals[-1].step == 1                  # everyone at once
    assert make_workload("oversubscribed").engine_options["num_blocks"] < 100
    custom = make_workload("chat", num_requests=5, rate=2, max_tokens=7, prompts=["p1", "p2"])
    assert [x.prompt for x in custom.arrivals] == ["p1", "p2", "p1", "p2", "p1"]
    assert [x.step for x in custom.arrivals] == [1, 1, 2, 2, 3]
    assert all(x.params.max_tokens == 7 for x in custom.arrivals)
    assert arrival_steps(3, 0.5) == [1, 3, 5]
    with pytest.raises(ValueError):
        make_workload("nope")
    assert format_prompt(None, Arrival(1, "q", SamplingParams(), system="s")) == "s\n\nq"


class FakeEngine:
    """Finishes each request two steps after it is added; records what the driver did."""

    def __init__(self) -> None:
        self.added: list[tuple[int, str]] = []
        self.age: dict[str, int] = {}
        self.steps = 0
        self.info = info()
        self.tokenizer = None

    def validate_request(self, prompt, params):
        if prompt == "too long":
            raise InvalidRequestError("the prompt has 2101 tokens but max_model_len is 2048")

    def add_request(self, prompt, params, request_id=None):
        self.added.append((self.steps + 1, request_id))
        self.age[request_id] = 0
        return request_id

    def has_unfinished_requests(self):
        return bool(self.age)

    def step(self):
        self.steps += 1
        for rid in list(self.age):
            self.age[rid] += 1
            if self.age[rid] >= 2:
                del self.age[rid]
        return StepResult((), step(self.steps))


def test_live_run_adds_requests_on_their_step_and_skips_idle_gaps(tmp_path):
    arrivals = tuple(Arrival(s, f"p{i}", SamplingParams()) for i, s in enumerate([1, 1, 2, 10]))
    engine = FakeEngine()
    run = LiveRun(lambda progress: engine, Workload("t", "", arrivals), record=str(tmp_path / "t.jsonl"))
    run.load()
    events = list(iter(run.step, None))
    run.close()
    # r3 was due at step 10, but the engine fell idle after step 3: the gap is skipped.
    assert engine.added == [(1, "r0"), (1, "r1"), (2, "r2"), (4, "r3")]
    assert run.done and len(events) == 5
    trace_info, trace_events = read_trace(str(tmp_path / "t.jsonl"))
    assert trace_info == engine.info and trace_events == events


def test_closing_a_live_run_stops_its_engines_model_thread(tiny_engine_factory):
    """Quitting ``watch`` closes the engine: with async output processing its model thread must not outlive
    the app (the console command exits hard and hid it; a notebook or a library user's process goes on)."""
    import threading

    def model_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("minipaged-model") and t.is_alive()]

    before = model_threads()
    engine = tiny_engine_factory(async_output_processing=True)
    arrivals = tuple(Arrival(1, f"p{i}", SamplingParams(max_tokens=4)) for i in range(2))
    run = LiveRun(lambda progress: engine, Workload("t", "", arrivals))
    run.load()
    for _ in range(3):
        run.step()
    assert len(model_threads()) > len(before)          # the run really had its model thread
    run.close()
    assert model_threads() == before


def test_a_workload_prompt_the_engine_would_refuse_stops_the_run_before_it_starts():
    arrivals = (Arrival(1, "fine", SamplingParams()), Arrival(5, "too long", SamplingParams()))
    engine = FakeEngine()
    run = LiveRun(lambda progress: engine, Workload("t", "", arrivals))
    with pytest.raises(InvalidRequestError, match="request r1 of the workload cannot run.*max_model_len"):
        run.load()
    assert engine.added == []


def test_no_tui_prints_one_block_per_step():
    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None)
    print_run(console, info(), synthetic_events())
    out = buf.getvalue()
    assert out.count("step ") >= 4
    for words in ["prefill chunk 0→4 of 8", "cache hit", "preempted (swap)", "swapped in", "finished (length)",
                  "done: 4 steps"]:
        assert words in out
    # What the TUI's other panels show: latencies, the CPU pool, each request's progress, the output text.
    assert "TTFT 100 ms" in out and "ITL 100.0 ms" in out
    assert "  host   ██··" in out                                # 4 CPU blocks: one character each
    assert "B ⇄ 1/2" in out and "A 1/2" in out
    assert "A said: xz" in out


def test_no_tui_block_strips_fit_the_line_however_big_the_pools():
    big = info(num_blocks=5000, num_cpu_blocks=65536)
    buf = io.StringIO()
    print_run(Console(file=buf, width=120, color_system=None), big, [step(1, num_total_blocks=5000,
                                                                          num_free_blocks=5000)])
    lines = buf.getvalue().splitlines()
    for label in ("  blocks ", "  host   "):
        strip = next(line for line in lines if line.startswith(label))
        assert len(strip) <= 120, label


@pytest.mark.parametrize("flags, words", [
    (["--speed", "-2"], "--speed must be"),
    (["--replay", str(TRACE), "--num-blocks", "5", "--workload", "burst"], "--num-blocks, --workload cannot"),
    (["--record", "/no/such/folder/run.jsonl"], "does not exist"),
])
def test_watch_refuses_flags_that_cannot_work_before_loading_anything(flags, words, capsys):
    from minipaged.cli import make_parser
    from minipaged.tui import run_watch

    assert run_watch(make_parser().parse_args(["watch", "--model", "/no/model/needed", *flags])) == 2
    assert words in capsys.readouterr().err


def test_no_tui_replay_through_run_watch(capsys):
    from minipaged.tui import run_watch

    args = argparse.Namespace(replay=str(TRACE), record=None, tui=False)
    assert run_watch(args) == 0
    out = capsys.readouterr().out
    assert "minipaged watch" in out and "done:" in out


def test_workload_suggestions_yield_to_the_users_flags():
    from minipaged.cli import make_parser
    from minipaged.tui import engine_options_for

    suggested = {"num_blocks": 48, "max_num_batched_tokens": 256}
    parse = make_parser().parse_args
    assert engine_options_for(parse(["watch"]), suggested)["num_blocks"] == 48
    assert engine_options_for(parse(["watch", "--num-blocks", "7"]), suggested)["num_blocks"] == 7
    # Without chunking every prompt must fit one step, so a small suggested budget is not applied.
    options = engine_options_for(parse(["watch", "--no-chunked-prefill"]), suggested)
    assert "max_num_batched_tokens" not in options and options["enable_chunked_prefill"] is False
    # A flag typed with the engine's default value still wins: "left unset" is not "equal to the default".
    assert engine_options_for(parse(["watch"]), {"max_num_seqs": 8})["max_num_seqs"] == 8
    assert engine_options_for(parse(["watch", "--max-num-seqs", "256"]), {"max_num_seqs": 8})["max_num_seqs"] == 256
    # A typed budget also beats a suggested count that would size the same pool another way.
    options = engine_options_for(parse(["watch", "--kv-cache-memory", "0.5", "--swap-space", "1"]),
                                 {"num_blocks": 48, "num_cpu_blocks": 64, "max_num_batched_tokens": 256})
    assert "num_blocks" not in options and "num_cpu_blocks" not in options
    assert options["kv_cache_memory"] == 0.5 and options["max_num_batched_tokens"] == 256


def test_a_preview_the_engine_shortened_is_cut_once():
    preview = "<|im_start|>system\nYou are a patient teaching assistant at a workshop … in a few words. " \
              "<|im_start|>user\nWhat does a compiler do?"
    short = clean_preview(preview, 40)
    assert short.count("…") == 1 and short.startswith("You are") and short.endswith("What does a compiler do?")
    assert len(short) == 40


def test_long_previews_keep_their_distinct_end():
    preview = "<|im_start|>system\nYou are a helpful assistant. " * 3 + "<|im_start|>user\nWhy is the sky blue?"
    short = clean_preview(preview, 40)
    assert len(short) == 40 and short.startswith("You are") and short.endswith("Why is the sky blue?")


def test_a_recompute_says_how_many_prompt_and_generated_tokens_it_recomputes(tiny_engine_factory):
    """After a recompute preemption the prefill covers the prompt and the answer so far: 'prefill 57 0→57 of
    44' and '(whole prompt)' used to say otherwise."""
    from minipaged import SamplingParams
    from minipaged.tui.state import prefill_span

    engine = tiny_engine_factory(num_blocks=12, max_num_batched_tokens=64)
    for i in range(3):
        engine.add_request(list(range(10 + i, 30 + i)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    state = WatchState(engine.info)
    recomputes = []
    while engine.has_unfinished_requests():
        ev = engine.step().event
        before = {rid: r.num_preemptions for rid, r in state.view.requests.items()}
        state.apply(ev)
        recomputes += [(s, ev) for s in ev.scheduled
                       if s.kind == "prefill" and before.get(s.request_id) and s.end > s.prompt_len]
    assert recomputes, "the pool was meant to be small enough for a recompute preemption"
    s, ev = recomputes[0]
    generated = s.end - s.prompt_len
    assert prefill_span(s, ev) == f"{s.start}→{s.end} of {s.prompt_len} prompt + {generated} generated"
    log = [line.text for line in state.log if line.step == ev.step and line.request_id == s.request_id]
    rest = "the rest of " if s.start else ""
    assert (f"{s.request_id} prefill {s.start}→{s.end} (recomputes {rest}{s.prompt_len} prompt + {generated} "
            f"generated tokens)") in log


def test_the_automatic_k_is_shown_beside_each_decode():
    """A decode's record from an engine with auto_k says the k chosen for its next step and the acceptance
    estimate (speculation off when 0); a fixed k's record (or an older trace's) adds nothing."""
    from minipaged.tui.widgets.batch import auto_k_note
    s = ScheduledRequest("r1", "decode", 10, 14, 6, 0, 5, draft_token_ids=(1, 2, 3), num_accepted=2)
    assert auto_k_note(s) == ""
    assert auto_k_note(replace(s, spec_k=2, spec_acceptance=0.613)) == "  next k=2, 61% kept"
    assert auto_k_note(replace(s, spec_k=0, spec_acceptance=0.05)) == "  next k=0 (speculation off, 5% kept)"


def test_a_small_step_fills_a_visible_share_of_the_budget_bar_and_says_its_scale():
    """On serve's defaults a step uses 2-13 of 2,048 tokens: a class trial saw a sliver. Under an eighth of the
    budget the bar is drawn on 8, 16, 32 ... tokens (budget_scale), which the label says; a full step keeps the
    budget's scale."""
    from minipaged.tui.state import budget_scale
    from minipaged.tui.widgets.batch import budget_bar, budget_label

    assert [budget_scale(used, 2048) for used in (0, 2, 8, 13, 40, 255, 256, 2048)] == [8, 8, 16, 32, 128, 512,
                                                                                          2048, 2048]
    assert budget_scale(3, 8) == 8 and budget_scale(9, 8) == 9            # a small budget is its own scale
    wide = dict(budget_limit=2048, max_num_seqs=256)
    for used in (2, 13):
        state = WatchState(replace(info(), max_num_batched_tokens=2048, max_num_seqs=256))
        arrivals = tuple(RequestArrival(f"r{i}", 8, 4, "hi") for i in range(used))
        state.apply(step(1, arrivals=arrivals, **wide))
        state.apply(step(2, scheduled=tuple(ScheduledRequest(f"r{i}", "decode", 8, 9, 8, 0, 1) for i in range(used)),
                         budget_used=used, **wide))
        bar = budget_bar(state, 64).plain
        assert len(bar) == 64 and bar.count("░") <= 64 - 64 * used // budget_scale(used, 2048), (used, bar)
        assert 64 - bar.count("░") >= 8, (used, bar)                      # an eighth of the bar at least
    assert budget_label(2, 2048) == " 2/2048 tok (bar: 8)" and budget_label(1024, 2048) == " 1024/2048 tok"
