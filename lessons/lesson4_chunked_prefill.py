"""Lesson 4: chunked prefill: a long prompt arriving among decodes, under different token budgets."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Trace, Text, request
from .texts import DOCUMENTS, QUESTIONS

NUMBER = 4
TITLE = "Chunked prefill"
SUMMARY = "a long prompt arriving among decodes; budget sizes vs TTFT and ITL"

LONG = "long"
LONG_PROMPT = Text(" ".join(DOCUMENTS[2:5]), 480)

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=96, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64),
    requests=(
        request("r0", 1, Text(QUESTIONS[6], 20), max_tokens=28),
        request("r1", 1, Text(QUESTIONS[7], 24), max_tokens=28),
        request("r2", 2, Text(QUESTIONS[8], 18), max_tokens=26),
        request(LONG, 5, LONG_PROMPT, max_tokens=8),
    ),
    variants={"budget-64": {}, "budget-512": {"max_num_batched_tokens": 512},
              # vLLM's old default: whole prompts, never in the same step as decodes (the budget must hold
              # a whole prompt, hence max_model_len).
              "prefill-first": {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024}},
)
DECODERS = ("r0", "r1", "r2")


def itl_gaps(run: Run, request_id: str) -> list[tuple[int, int]]:
    """For each gap between two tokens of a request: (steps it lasted, tokens the model computed in it).

    A step's time grows with the tokens it computes (and every step pays a fixed cost for reading the
    weights), so "tokens computed" is a model-independent stand-in for the time the user waited.
    """
    steps = run.token_steps(request_id)
    return [(b - a, sum(run.event(s).budget_used for s in range(a + 1, b + 1))) for a, b in zip(steps, steps[1:])]


def ttft(run: Run, request_id: str) -> tuple[int, int]:
    """(steps from arrival to first token, inclusive; tokens computed in those steps)."""
    first, arrived = run.token_steps(request_id)[0], run.arrival_step(request_id)
    return first - arrived + 1, sum(run.event(s).budget_used for s in range(arrived, first + 1))


def wall_clock(run: Run, request_id: str = LONG) -> dict[str, float]:
    """Wall-clock extras (not stable from run to run, so never written into the lesson text)."""
    ends = {ev.step: ev.time_s for ev in run.events}
    starts = {ev.step: ev.time_s - ev.duration_s for ev in run.events}
    gaps = [ends[b] - ends[a] for r in DECODERS for a, b in zip(run.token_steps(r), run.token_steps(r)[1:])]
    first = run.token_steps(request_id)[0]
    return {"max_itl_ms": 1e3 * max(gaps), "ttft_ms": 1e3 * (ends[first] - starts[run.arrival_step(request_id)])}


def measure_smollm2(runs: dict[str, Run]) -> dict[str, float]:
    """The long prompt's TTFT and the decoders' worst gap in milliseconds, per variant (SmolLM2, this CPU)."""
    out: dict[str, float] = {}
    for name, run in runs.items():
        wall = wall_clock(run)
        key = name.replace("-", "_")
        out[f"{key}_ttft_ms"], out[f"{key}_max_itl_ms"] = wall["ttft_ms"], wall["max_itl_ms"]
    return out


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    out: dict[str, Any] = {"long_prompt": LONG_PROMPT.num_tokens, "decoders": len(DECODERS),
                           "big_budget": runs["budget-512"].info.max_num_batched_tokens}
    for name, run in runs.items():
        key = name.replace("-", "_")
        gaps = [g for r in DECODERS for g in itl_gaps(run, r)]
        out[f"{key}_itl_steps"] = max(steps for steps, _ in gaps)
        out[f"{key}_itl_tokens"] = max(tokens for _, tokens in gaps)
        out[f"{key}_ttft_steps"], out[f"{key}_ttft_tokens"] = ttft(run, LONG)
        out[f"{key}_chunks"] = sum(1 for ev in run.events for s in ev.scheduled
                                   if s.request_id == LONG and s.kind == "prefill")
        out[f"{key}_steps"] = run.num_steps
        out[f"{key}_biggest_step"] = max(ev.budget_used for ev in run.events)
    first_chunk = next(s for ev in runs["budget-64"].events for s in ev.scheduled if s.request_id == LONG)
    out["first_chunk"] = first_chunk.num_new_tokens
    out["outputs_equal"] = all(r.outputs == runs["budget-64"].outputs for r in runs.values())
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _chunk_beside_decodes(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.request_id == LONG and s.kind == "prefill" and s.end < s.prompt_len and t.last.num_decode_tokens:
            return (f"step {t.last.step}: long {s.start}→{s.end} of {s.prompt_len} beside "
                    f"{t.last.num_decode_tokens} decodes, {t.last.budget_used}/{t.last.budget_limit} tokens")
    return None


def _first_token(t: Trace) -> Any:
    req = t.view.requests.get(LONG)
    if LONG not in t.last.new_token_ids or req is None or req.num_output_tokens != 1:
        return None
    arrived = next(ev for ev in t.events if any(a.request_id == LONG for a in ev.arrivals))
    ms = 1e3 * (t.last.time_s - (arrived.time_s - arrived.duration_s))
    return f"TTFT of long: {t.last.step - arrived.step + 1} step(s), {ms:.0f} ms on your machine"


def _whole_prompt_with_decodes(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.request_id == LONG and s.kind == "prefill" and s.start == 0 and s.end == s.prompt_len:
            if t.last.num_decode_tokens:
                return (f"step {t.last.step}: {t.last.budget_used} tokens in one step, "
                        f"{1e3 * t.last.duration_s:.0f} ms")
    return None


def _decodes_stall(t: Trace) -> Any:
    kinds = {s.kind for s in t.last.scheduled}
    if kinds == {"prefill"} and any(s.request_id == LONG for s in t.last.scheduled) and t.last.running:
        idle = [r for r in t.last.running if r != LONG]
        return idle and f"step {t.last.step}: {', '.join(idle)} got no token while long's prompt ran"
    return None


def _max_itl(t: Trace) -> Any:
    if len(t.view.requests) < len(SCENARIO.requests) or any(r.state != "finished" for r in
                                                             t.view.requests.values()):
        return None
    run = Run("live", t.info, t.events)
    gaps = [g for r in DECODERS for g in itl_gaps(run, r)]
    wall = wall_clock(run)
    return (f"your run: max ITL {max(g[1] for g in gaps)} tokens computed ({wall['max_itl_ms']:.0f} ms); "
            f"long's TTFT {ttft(run, LONG)[0]} steps ({wall['ttft_ms']:.0f} ms)")


CHECKPOINTS = [
    Checkpoint("long's prompt is cut into chunks that run beside the decodes", _chunk_beside_decodes,
               "press n until long is admitted (step 5); look at the Batch panel", variants=("budget-64",)),
    Checkpoint("long produces its first token (its TTFT)", _first_token,
               "keep pressing n until long's prompt KV is complete"),
    Checkpoint("long's whole prompt runs in one step, beside the decodes", _whole_prompt_with_decodes,
               "press n until long is admitted; compare that step's time with the others",
               variants=("budget-512",)),
    Checkpoint("decodes stall: a step runs long's prompt and nothing else", _decodes_stall,
               "press n until long is admitted; r0-r2 get no token in that step", variants=("prefill-first",)),
    Checkpoint("every request finished; the panel shows your run's max ITL and TTFT", _max_itl,
               "let the run finish"),
]

QUIZ = [
    QuizQuestion(
        "Users of a chat service complain that answers freeze for a moment whenever someone pastes a long "
        "document. Which change helps them?",
        ("A larger max_num_batched_tokens", "A smaller max_num_batched_tokens",
         "Turning prefix caching off", "A larger block size"),
        1,
        "A smaller budget cuts the long prompt into smaller chunks, so no step grows big and decodes keep "
        "their pace: max ITL here fell from {{measured.budget_512_itl_tokens}} to "
        "{{measured.budget_64_itl_tokens}} tokens computed per gap."),
    QuizQuestion(
        "What does the smaller budget cost?",
        ("Wrong outputs", "More KV memory", "A later first token for the long prompt (higher TTFT)",
         "Nothing at all"),
        2,
        "The prompt now needs {{measured.budget_64_ttft_steps}} steps instead of "
        "{{measured.budget_512_ttft_steps}} before its first token, and every step pays a fixed cost. Outputs "
        "are identical either way."),
    QuizQuestion(
        "With chunked prefill on, in what order does the scheduler fill a step's token budget?",
        ("Prefills first, then decodes", "Decodes first, then prefill chunks with what is left",
         "Whichever request arrived first", "Longest prompt first"),
        1,
        "Decode-first: every running decode gets its one token, then waiting prompts fill the rest; the last "
        "one that does not fit is chunked. Here the first chunk was {{measured.first_chunk}} tokens: "
        "{{config.max_num_batched_tokens}} minus {{measured.decoders}} decodes."),
]
