"""``minipaged watch --no-tui``: the same information as the TUI, printed with Rich, one block per step.

For logs, CI and terminals where a full-screen app is unwelcome. It folds the same ``WatchState`` and
prints the same event-log lines, so the words match what the TUI shows.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from rich.console import Console
from rich.text import Text

from minipaged.events import EngineInfo, StepEvent

from .state import WatchState, printable
from .widgets.batch import auto_k_note, budget_bar, draft_strip
from .widgets.event_log import ICONS


def block_strip(state: WatchState, width: int, cpu: bool = False) -> Text:
    """A block pool as one line: each character is a group of blocks, coloured by its main owner."""
    view = state.view
    owners_of = [[o] if o else [] for o in view.cpu_block_owner] if cpu else view.block_owners
    cached = [False] * len(owners_of) if cpu else view.block_cached
    n = len(owners_of)
    group = max(1, -(-n // width))
    text = Text()
    for start in range(0, n, group):
        blocks = range(start, min(start + group, n))
        owners = [rid for b in blocks for rid in owners_of[b]]
        if owners:
            rid = max(set(owners), key=owners.count)
            shared = any(len(owners_of[b]) > 1 for b in blocks)
            text.append("▓" if shared else "█", state.colour(rid))
        elif any(cached[b] for b in blocks):
            text.append("░", "#7d8fa3")
        else:
            text.append("·", "#4a4a4a")
    return text


def progress_line(state: WatchState, q: dict[str, list[str]]) -> Text:
    """Each running or swapped request: tokens generated of its maximum (⇄: swapped to CPU)."""
    text = Text("  reqs   ")
    for rid in q["running"] + q["swapped"]:
        req = state.view.requests[rid]
        text.append(state.short_name(rid), state.colour(rid))
        text.append(f"{' ⇄' if rid in q['swapped'] else ''} {req.num_output_tokens}/{req.max_tokens}  ")
    return text


def gauge_line(state: WatchState) -> str:
    def last(metric, fmt: str) -> str:
        return "-" if metric.last is None else format(metric.last, fmt)
    line = (f"  {last(state.tokens_per_s, '.1f')} tok/s, TTFT {last(state.ttft_ms, '.0f')} ms, "
            f"ITL {last(state.itl_ms, '.1f')} ms")
    if state.info.speculative and state.acceptance_rate.last is not None:
        line += (f", drafts accepted {state.acceptance_rate.last:.0%}, "
                 f"{state.acceptance_length.last:.2f} tokens per verification")
    return line


def print_header(console: Console, info: EngineInfo, description: str = "") -> None:
    console.print(f"[bold]minipaged watch[/] {info.model}: {info.num_blocks} KV blocks x {info.block_size} tokens\n"
                  f"budget {info.max_num_batched_tokens} tokens, max {info.max_num_seqs} seqs, chunked prefill "
                  f"{'on' if info.enable_chunked_prefill else 'off'}, prefix caching "
                  f"{'on' if info.enable_prefix_caching else 'off'}, preemption {info.preemption_mode}"
                  + (f", speculative {info.speculative}" if info.speculative else ""))
    if description:
        console.print(f"[italic]{description}[/]")


def print_step(console: Console, state: WatchState) -> None:
    """One compact block: numbers, budget bar, block strip, the step's log lines."""
    ev = state.last_event
    assert ev is not None
    q = state.queues()
    width = min(80, max(20, console.width - 30))
    head = Text()
    head.append(f"step {ev.step:>4}", style="bold")
    head.append(f"  {ev.duration_s * 1e3:6.1f} ms  tokens {ev.budget_used:>4}/{ev.budget_limit} (prefill "
                f"{ev.num_prefill_tokens}, decode {ev.num_decode_tokens})  seqs {len(ev.scheduled)}/{ev.max_num_seqs}\n")
    head.append(f"  KV {ev.num_total_blocks - ev.num_free_blocks}/{ev.num_total_blocks} used "
                f"({ev.num_cached_free_blocks} free cached), hit rate "
                f"{ev.counters.get('prefix_cache_hit_rate', 0.0):.0%}  ")
    head.append(f"run {len(q['running'])} wait {len(q['waiting'])} swap {len(q['swapped'])} "
                f"done {len(q['finished'])}", style="dim")
    console.print(head)
    console.print(gauge_line(state), style="dim", highlight=False)
    console.print(Text("  budget ").append_text(budget_bar(state, width)))
    console.print(Text("  blocks ").append_text(block_strip(state, width)))
    if state.view.cpu_block_owner:
        console.print(Text("  host   ").append_text(block_strip(state, width, cpu=True)))
    if q["running"] or q["swapped"]:
        console.print(progress_line(state, q), highlight=False)
    for s in ev.scheduled:                       # the batch panel's draft strips
        if s.draft_token_ids:
            console.print(Text("  ⚡ ").append(state.short_name(s.request_id), state.colour(s.request_id)).append("  ")
                          .append_text(draft_strip(s)).append(auto_k_note(s)), highlight=False)
    for line in state.log:
        if line.step == ev.step:
            icon, colour = ICONS.get(line.kind, ("·", "white"))
            console.print(Text("  ").append(icon, colour).append(" " + state.named(line)), highlight=False)
    for f in ev.finished:                       # the TUI's output panel, for each request as it ends
        text = " ".join(printable(state.view.requests[f.request_id].text).split())
        name = state.short_name(f.request_id)
        console.print(Text("  ").append(name, state.colour(f.request_id)).append(f" said: {text}"), highlight=False)


def print_run(console: Console, info: EngineInfo, events: Iterable[Optional[StepEvent]],
              description: str = "", lesson: Any = None) -> WatchState:
    """Print every event as it comes (``events`` may be a live generator); returns the final state.

    With a ``lesson``, each checkpoint is printed in the step that ticks it, and the quiz at the end."""
    print_header(console, info, description)
    state = WatchState(info)
    tracker = lesson.tracker(info) if lesson is not None else None
    for ev in events:
        if ev is None:
            break
        if isinstance(ev, EngineInfo):           # an attached client reconnected: a fresh snapshot follows
            console.print("[bold]reconnected[/]: the picture starts again from the server's snapshot")
            state = WatchState(ev)
            continue
        state.apply(ev)
        print_step(console, state)
        for index in tracker.feed(ev) if tracker is not None else ():
            text, _hint = lesson.render_checkpoint(index)
            detail = tracker.ticked[index][1]
            console.print(Text("  ✔ checkpoint: ", style="bold #59a14f").append(text + (f" ({detail})" if detail
                                                                                        else "")), highlight=False)
    stats = state.last_event.counters if state.last_event else {}
    console.print(f"[bold]done[/]: {state.num_events} steps, {int(stats.get('requests_finished', 0))} requests "
                  f"finished, prefix-cache hit rate {stats.get('prefix_cache_hit_rate', 0.0):.0%}, preemptions "
                  f"{int(stats.get('preemptions_recompute', 0) + stats.get('preemptions_swap', 0))}")
    if tracker is not None:
        print_lesson_summary(console, lesson, tracker)
    return state


def print_lesson_summary(console: Console, lesson: Any, tracker: Any) -> None:
    """Checkpoints seen in this run, then the quiz: questions first, answers after, for a projected class."""
    console.print(f"[bold]checkpoints[/]: {len(tracker.ticked)} of {tracker.num_active} seen in this run")
    if not lesson.asks_quiz(tracker.variant):
        main = lesson.scenario.main_variant
        console.print(f"[bold]quiz[/]: asked in the {main} run ({lesson.variant_command(main)})", highlight=False)
        return
    quiz = lesson.render_quiz()
    console.print("[bold]quiz[/]")
    for number, q in enumerate(quiz, 1):
        console.print(f"  Q{number}. {q.question}", highlight=False)
        for choice_number, choice in enumerate(q.choices, 1):
            console.print(f"      {choice_number}) {choice}", highlight=False)
    console.print("[bold]answers[/]")
    for number, q in enumerate(quiz, 1):
        console.print(f"  Q{number}: {q.answer + 1}) {q.choices[q.answer]}. {q.explanation}", highlight=False)
