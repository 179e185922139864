"""Lesson 6: speculative decoding: draft, verify, accept; why greedy output is unchanged; when it pays."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Trace, Text, pct, request
from .texts import DOCUMENTS

NUMBER = 6
TITLE = "Speculative decoding"
SUMMARY = "draft k tokens cheaply, verify them in one forward pass; exact, and when it pays"

K = 3
# The target drafting for itself (every layer): every guess is right on any model, so the numbers below
# are the same on the tiny test model and on SmolLM2. It shows the mechanics; it is never faster.
PERFECT_DRAFT = {"method": "draft_model", "model": "self", "num_speculative_tokens": K}
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=64, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
                 speculative_config=PERFECT_DRAFT),
    requests=(request("r0", 1, Text(DOCUMENTS[0], 48), max_tokens=1 + 10 * (K + 1)),
              request("r1", 3, Text(DOCUMENTS[1], 32), max_tokens=1 + 6 * (K + 1))),
    variants={"perfect-draft": {}, "ngram": {"speculative_config": NGRAM}, "off": {"speculative_config": None}},
)


def _forwards(run: Run) -> int:
    """Request-forwards that produced tokens: a prefill's last chunk, a decode, a verification."""
    return sum(len(ev.new_token_ids) for ev in run.events)


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    perfect, off = runs["perfect-draft"], runs["off"]
    verified = [(ev, s) for ev in perfect.events for s in ev.scheduled if s.draft_token_ids]
    first_ev, first = verified[0]
    both = next(ev for ev in perfect.events if sum(1 for s in ev.scheduled if s.draft_token_ids) == 2)
    return {
        "k": K,
        "output_tokens": perfect.generated_tokens,
        "off_steps": off.num_steps,
        "perfect_steps": perfect.num_steps,
        "step_share": pct(perfect.num_steps, off.num_steps),
        "off_tokens_per_forward": round(off.generated_tokens / _forwards(off), 2),
        "perfect_tokens_per_forward": round(perfect.generated_tokens / _forwards(perfect), 2),
        "perfect_verifications": len(verified),
        "perfect_acceptance": pct(sum(s.num_accepted for _e, s in verified),
                                  sum(len(s.draft_token_ids) for _e, s in verified)),
        "first_verify_step": first_ev.step,
        "first_verify_request": first.request_id,
        "first_verify_tokens": first.num_new_tokens,
        "both_verify_step": both.step,
        "both_verify_budget": both.budget_used,
        "changed_tokens": sum(a != b for name in ("perfect-draft", "ngram") for rid in off.outputs
                              for a, b in zip(runs[name].outputs[rid], off.outputs[rid])),
        "perfect_same_outputs": perfect.outputs == off.outputs,
        "ngram_same_outputs": runs["ngram"].outputs == off.outputs,
    }


# ------------------------------------------------------------------------------------ checkpoints

def _drafts_scheduled(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.draft_token_ids:
            return (f"step {t.last.step}: {s.request_id} computes {s.num_new_tokens} tokens: its last token and "
                    f"{len(s.draft_token_ids)} drafts")
    return None


def _all_accepted(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.draft_token_ids and s.num_accepted == len(s.draft_token_ids):
            return (f"step {t.last.step}: {s.request_id} kept all {len(s.draft_token_ids)} drafts + a bonus token: "
                    f"{len(t.last.new_token_ids.get(s.request_id, ()))} tokens from one forward pass")
    return None


def _rejected(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.draft_token_ids and s.num_accepted < len(s.draft_token_ids):
            return (f"step {t.last.step}: {s.request_id} kept {s.num_accepted} of {len(s.draft_token_ids)} drafts; "
                    f"the target's own token replaced draft {s.num_accepted + 1}")
    return None


def _two_verified(t: Trace) -> Any:
    verified = [s.request_id for s in t.last.scheduled if s.draft_token_ids]
    return len(verified) >= 2 and f"step {t.last.step}: {' and '.join(verified)} verified in one batch"


def _fewer_forwards(t: Trace) -> Any:
    for f in t.last.finished:
        forwards = sum(1 for ev in t.events if f.request_id in ev.new_token_ids)
        if forwards < f.num_output_tokens:
            return f"{f.request_id}: {f.num_output_tokens} tokens from {forwards} forward passes"
    return None


CHECKPOINTS = [
    Checkpoint("a decode carries draft tokens beside its last token", _drafts_scheduled,
               "press n until a decode row shows coloured draft tokens", variants=("perfect-draft", "ngram")),
    Checkpoint("every draft is accepted and the target adds a bonus token", _all_accepted,
               "look for a strip of green drafts ending in a blue bonus token", variants=("perfect-draft", "ngram")),
    Checkpoint("a draft is rejected: the target's own token replaces it, later drafts are dropped", _rejected,
               "run with --speculative-method ngram --num-speculative-tokens {{measured.k}} --prompt-lookup-min 2 "
               "--prompt-lookup-max 4 and look for a red, struck-through draft", variants=("ngram",)),
    Checkpoint("two requests verify their drafts in the same forward pass", _two_verified,
               "keep going until r1 decodes too", variants=("perfect-draft",)),
    Checkpoint("a request finished with fewer forward passes than tokens", _fewer_forwards, "let the run finish",
               variants=("perfect-draft",)),
]

QUIZ = [
    QuizQuestion(
        "With greedy decoding, what does speculative decoding change in the output?",
        ("Nothing: every token is the target's own argmax", "A few tokens, the price of the speed-up",
         "Only tokens after a rejected draft", "Only the last token of each step"),
        0,
        "A draft is kept only where it equals the target's argmax, and the target supplies the next token "
        "itself. Here the outputs with speculation were the same as without: {{measured.perfect_same_outputs}} "
        "for the perfect draft and {{measured.ngram_same_outputs}} for n-gram."),
    QuizQuestion(
        "A request drafts {{measured.k}} tokens and the target accepts them all. How many tokens does it gain "
        "from that forward pass?",
        ("{{measured.k}}", "One", "{{measured.k}} plus the target's own next token (the bonus)",
         "It depends on the batch"),
        2,
        "The target's last row predicts the token after the last draft, for free. The perfect draft gained "
        "{{measured.perfect_tokens_per_forward}} tokens per forward pass on average, prefill included."),
    QuizQuestion(
        "On this CPU, when did n-gram speculation stop paying on SmolLM2?",
        ("Never: it always helps", "At larger batches and when the answer does not quote the prompt",
         "Only when temperature is above zero", "Only with a draft model"),
        1,
        "Quoting its input at batch {{smollm2.batch_1}} it was {{smollm2.grounded_b1_ngram_k3_speedup:.2f}}x "
        "as fast as without; at batch {{smollm2.batch_64}} {{smollm2.grounded_b64_ngram_k3_speedup:.2f}}x; on "
        "open questions at batch {{smollm2.batch_1}} {{smollm2.open_b1_ngram_k3_speedup:.2f}}x: a big batch "
        "already keeps the CPU busy, and guesses that are rarely right save little or nothing."),
]
