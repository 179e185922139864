"""The current step's batch: which requests ran, and how many tokens each computed.

Continuous batching in one picture: prefill chunks and single decode tokens of different requests share
one forward pass. The bar is the step's token budget (``max_num_batched_tokens``); tokens served from the
prefix cache cost nothing, so they are listed but take no room in the bar.
"""
from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual.widget import Widget

from minipaged.events import ScheduledRequest

from ..state import WatchState, budget_scale, prefill_span, printable

DECODE_COLOUR = "#c9c9c9"
EMPTY = "#3a3a3a"
# Speculative decoding: a draft the target accepted, one it rejected (and every later one, unchecked), and
# the target's own token: a bonus when every draft was accepted, else the token that replaced the rejected one.
ACCEPTED = "#0b0b0b on #59a14f"
REJECTED = "strike #e15759"
BONUS = "bold #0b0b0b on #76b7b2"
RECOVERED = "bold #0b0b0b on #edc948"


def draft_strip(s: ScheduledRequest) -> Text:
    """One verified decode's drafts, each coloured by the verdict, then the target's own token."""
    text = Text()
    for i, piece in enumerate(s.draft_pieces):
        text.append(token_cell(piece), ACCEPTED if i < s.num_accepted else REJECTED)
        text.append(" ")
    text.append(token_cell(s.target_piece), BONUS if s.num_accepted == len(s.draft_token_ids) else RECOVERED)
    return text


def auto_k_note(s: ScheduledRequest) -> str:
    """The automatic k's choice for the request's next step and its acceptance estimate ('' for a fixed k)."""
    if s.spec_k is None:
        return ""
    estimate = "" if s.spec_acceptance is None else f", {s.spec_acceptance:.0%} kept"
    return f"  next k={s.spec_k}{estimate}" if s.spec_k else f"  next k=0 (speculation off{estimate})"


def token_cell(piece: str) -> str:
    """A token's text, drawable and visible: spaces as '␣', newlines as '⏎', nothing as '∅'."""
    shown = printable(piece).replace("\n", "⏎").replace(" ", "␣")
    return shown[:12] if shown else "∅"


def budget_bar(state: WatchState, width: int) -> Text:
    """The token budget as a bar: one coloured run per prefill, one run for all decodes, then what is left.

    Every non-empty run gets at least one column so nothing that ran is invisible; the numbers beside the
    bar are exact. A step that used under an eighth of the budget is drawn on a smaller scale (``budget_scale``;
    ``budget_label`` says which).
    """
    ev = state.last_event
    text = Text()
    if ev is None or width <= 0:
        return text.append("░" * max(width, 0), EMPTY)
    limit = budget_scale(ev.budget_used, ev.budget_limit)
    runs: list[tuple[int, str, str]] = [(s.num_new_tokens, "█", state.colour(s.request_id))
                                         for s in ev.scheduled if s.kind == "prefill" and s.num_new_tokens]
    if ev.num_decode_tokens:
        runs.append((ev.num_decode_tokens, "▌", DECODE_COLOUR))
    used_cols = 0
    for tokens, glyph, colour in runs:
        cols = max(1, round(tokens / limit * width))
        cols = min(cols, width - used_cols)
        text.append(glyph * cols, colour)
        used_cols += cols
    return text.append("░" * (width - used_cols), EMPTY)


def budget_label(used: int, limit: int) -> str:
    """What is written after the bar: the tokens used of the budget, and the bar's scale when it is zoomed."""
    scale = budget_scale(used, limit)
    return f" {used}/{limit} tok" + (f" (bar: {scale})" if scale < max(limit, used) else "")


class BatchPanel(Widget):
    """Budget bar, sequence count and one line per scheduled request."""

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id)
        self.state: Optional[WatchState] = None
        self.border_title = "This step's batch"

    def show(self, state: Optional[WatchState]) -> None:
        self.state = state
        self.refresh()

    def render(self) -> Text:
        state = self.state
        width = max(self.content_size.width, 10)
        if state is None or state.last_event is None:
            self.border_title = "This step's batch"
            return Text("no step yet", style="dim")
        ev = state.last_event
        self.border_title = f"Step {ev.step} batch: {ev.duration_s * 1e3:.1f} ms (model {ev.model_s * 1e3:.1f} ms)"
        label = budget_label(ev.budget_used, ev.budget_limit)
        text = Text(no_wrap=True, overflow="ellipsis")     # one line per row: a wrapped line would push rows out
        text.append("budget ")
        text.append_text(budget_bar(state, max(4, width - 7 - len(label))))
        text.append(label + "\n")
        seqs = len(ev.scheduled)
        cached = sum(s.num_cached_tokens for s in ev.scheduled)
        text.append(f"seqs {seqs}/{ev.max_num_seqs}   ", style="bold")
        text.append(f"prefill {ev.num_prefill_tokens}", style="bold")
        text.append(f" + decode {ev.num_decode_tokens} tok")
        if cached:
            text.append(f"   {cached} cached", style="#7d8fa3")
        rows = max(0, self.content_size.height - 2)
        listed = sorted(ev.scheduled, key=lambda s: (s.kind != "prefill", -s.num_new_tokens))
        for i, s in enumerate(listed):
            if i == rows - 1 and len(listed) > rows:
                text.append(f"\n+{len(listed) - i} more", style="dim")
                break
            text.append("\n")
            text.append("██", state.colour(s.request_id))
            text.append(f" {state.short_name(s.request_id):<5}")
            if s.kind == "prefill":
                text.append(f"prefill {s.num_new_tokens:>4}", style="bold")
                text.append(f"  {prefill_span(s, ev)}", style="dim")
                if s.num_cached_tokens:
                    text.append(f"  +{s.num_cached_tokens} cached", style="#7d8fa3")
            elif s.draft_token_ids:
                text.append(f"decode 1+{len(s.draft_token_ids)}")
                text.append(f"  +{s.num_accepted + 1} ", style="dim")
                text.append_text(draft_strip(s))
                text.append(auto_k_note(s), style="dim")
            else:
                text.append(f"decode  {s.num_new_tokens:>4}")
                text.append(f"  token {s.num_output_tokens}", style="dim")
                text.append(auto_k_note(s), style="dim")
        return fit_lines(text, width)


def fit_lines(text: Text, width: int) -> Text:
    """Cut every line to the panel's width: Textual wraps a long line whatever the Text's no_wrap says, and
    a wrapped line pushes the last rows (the "+N more") out of the panel (issue 16, defect 9)."""
    lines = text.split("\n")
    for line in lines:
        line.truncate(width, overflow="ellipsis")
    return Text("\n").join(lines)
