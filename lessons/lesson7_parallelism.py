"""Lesson 7: tensor and pipeline parallelism as the cure for preemption: more KV blocks per rank."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Trace, Text, request
from .texts import DOCUMENTS

NUMBER = 7
TITLE = "Parallelism: more ranks, more KV blocks"
SUMMARY = "the oversubscribed pool again; tp=3 and pp=2 split the model, so each rank's memory holds more blocks"

LENGTHS = ((40, 40), (56, 32), (36, 44), (48, 36), (30, 40), (44, 28))   # (prompt, max_tokens): lesson 5's
BLOCKS_ONE_RANK = 20

# Each variant gives every rank the same memory. A rank holds 1/tp of each token's KV heads (tensor
# parallelism) or 1/pp of its layers (pipeline parallelism), so that memory holds tp or pp times the blocks:
# the pools below are that arithmetic, pinned so the lesson's numbers are the same on every model (the
# measured bytes per token per rank, in ``measure``, show it is the engine's arithmetic too).
SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=BLOCKS_ONE_RANK, max_model_len=1024, max_num_seqs=8,
                 max_num_batched_tokens=256, enable_prefix_caching=False),
    requests=tuple(request(f"r{i}", 1 + 2 * i, Text(DOCUMENTS[i], n), max_tokens=m)
                   for i, (n, m) in enumerate(LENGTHS)),
    variants={"tp1": {},
              "tp3": {"tensor_parallel_size": 3, "num_blocks": 3 * BLOCKS_ONE_RANK},
              "pp2": {"pipeline_parallel_size": 2, "num_blocks": 2 * BLOCKS_ONE_RANK}},
)


def peak_blocks(run: Run) -> int:
    return max(sum(len(r.blocks) for r in view.requests.values()) for _e, view in run.views())


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    one = runs["tp1"]
    out: dict[str, Any] = {
        "num_requests": len(LENGTHS),
        "demand_blocks": sum(-(-(n + m) // one.info.block_size) for n, m in LENGTHS),
        "tp3_layout": runs["tp3"].info.parallel,
    }
    for name, run in runs.items():
        out[f"{name}_blocks"] = run.info.num_blocks
        out[f"{name}_preemptions"] = run.num_preemptions
        out[f"{name}_steps"] = run.num_steps
        out[f"{name}_prefill"] = run.prefill_tokens
        out[f"{name}_peak_blocks"] = peak_blocks(run)
        out[f"{name}_same_outputs"] = run.outputs == one.outputs
        # How much of each token's KV one rank stores, measured from the engine's own header: 1/3, 1/2.
        out[f"{name}_kv_share"] = round(run.info.kv_bytes_per_token / one.info.kv_bytes_per_token, 4)
    out["tp1_extra_prefill"] = one.prefill_tokens - runs["tp3"].prefill_tokens
    return out


def measure_smollm2(runs: dict[str, Run]) -> dict[str, float]:
    """What communication costs on this machine (SmolLM2): share of step time rank 0 spent sending and
    waiting, and the mean step, per variant. Machine-dependent, so never in measured.json."""
    out: dict[str, float] = {}
    for name, run in runs.items():
        steps_s = sum(ev.duration_s for ev in run.events)
        comm_s = run.events[-1].counters.get("communication_seconds", 0.0)
        out[f"{name}_comm_share"] = round(100 * comm_s / steps_s, 1)
        out[f"{name}_step_ms"] = round(1000 * steps_s / len(run.events), 1)
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _preempted(t: Trace) -> Any:
    p = t.last.preempted
    return bool(p) and (f"step {t.last.step}: {p[0].request_id} gave up {p[0].num_blocks} blocks "
                        f"in a pool of {t.info.num_blocks}")


def _layout_in_header(t: Trace) -> Any:
    return t.info.parallel is not None and f"{t.info.parallel}; {t.info.num_blocks} KV blocks on every rank"


def _all_done(t: Trace) -> Any:
    return t.all_complete(SCENARIO) and f"{len(t.events)} steps, every request got all its tokens"


def _roomy(t: Trace) -> Any:
    if len(t.view.requests) < len(SCENARIO.requests) or any(r.state != "finished"
                                                            for r in t.view.requests.values()):
        return None
    if any(ev.preempted for ev in t.events):
        return None
    return f"{len(t.events)} steps, not a single preemption, {t.info.num_blocks} blocks per rank"


CHECKPOINTS = [
    Checkpoint("one rank: the pool runs dry and a request is preempted", _preempted,
               "press n (or space) until ⚠ preempted shows in the event log", variants=("tp1",)),
    Checkpoint("the header shows how the model is split over the ranks", _layout_in_header,
               "run with --tensor-parallel-size 3 (or --pipeline-parallel-size 2)", variants=("tp3", "pp2")),
    Checkpoint("every request finished with all its tokens", _all_done, "let the run finish"),
    Checkpoint("with the model split, every request finishes without a preemption", _roomy,
               "let the run finish", variants=("tp3", "pp2")),
]

QUIZ = [
    QuizQuestion(
        "Three ranks, each with the memory that held {{config.num_blocks}} blocks on one device. With tensor "
        "parallelism, how many blocks does each rank's pool hold?",
        ("{{config.num_blocks}}: the memory per rank did not change", "{{measured.tp3_blocks}}: each rank "
         "stores a third of every token's KV", "A third as many: the blocks are split over the ranks",
         "It depends on the batch"),
        1,
        "Each rank keeps only its own KV heads ({{measured.tp3_layout}}), so a token costs it "
        "{{measured.tp3_kv_share:.0%}} of the bytes, and the same memory holds {{measured.tp3_blocks}} blocks. "
        "Block ids are the same on every rank: one block manager on rank 0 decides for all."),
    QuizQuestion(
        "Which split talks more per step?",
        ("Tensor parallelism: two all-reduces in every layer", "Pipeline parallelism: one hand-off per layer",
         "They talk the same", "Neither talks: each rank works alone"),
        0,
        "Tensor parallelism sums partial results after o_proj and after down_proj in every layer; pipeline "
        "parallelism sends the hidden states once per stage boundary. Pipeline parallelism pays instead in "
        "idle ranks: with one step in flight, each stage waits for the one before it."),
    QuizQuestion(
        "The seed guide's warning says to increase tensor_parallel_size when preemptions are frequent. What "
        "did it change here?",
        ("Nothing: preemptions depend only on max_num_seqs", "Fewer preemptions but different outputs",
         "No preemptions and the same outputs", "More steps, because ranks must talk"),
        2,
        "One rank: {{measured.tp1_preemptions}} preemptions and {{measured.tp1_steps}} steps; tp=3: "
        "{{measured.tp3_preemptions}} preemptions and {{measured.tp3_steps}} steps, and every request got the "
        "same tokens as on one rank."),
]
