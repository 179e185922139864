"""Lesson 9: weight-only int8: a quarter of the bytes per matrix, a faster decode alone, and greedy tokens that
can differ from fp32's."""
from __future__ import annotations

import statistics
from typing import Any

from .core import (Checkpoint, QuizQuestion, Run, Scenario, Text, Trace, decode_steps, decodes,
                   every_request_finished, request)
from .texts import DOCUMENTS, QUESTIONS

NUMBER = 9
TITLE = "Quantization: fewer bytes, faster decode, what it costs"
SUMMARY = "weight-only int8 vs fp32: weight bytes, decode tokens/s alone and in a batch, tokens that differ"

ALONE = "r0"
BATCH = tuple(f"r{i + 1}" for i in range(len(QUESTIONS)))       # sixteen short chat questions

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=64, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512),
    requests=(
        # Part one: one request alone, so each of its decode steps reads every weight for a single token.
        request(ALONE, 1, Text(DOCUMENTS[0], 48), max_tokens=32),
        # Part two, once r0 has finished: sixteen requests, prefilled in one step, then decoding together: one
        # read of the weights for sixteen tokens (the tiled multiply's rows, not the one-row loop: kernels/int8.py).
        *(request(rid, 100, Text(question, 16), max_tokens=24) for rid, question in zip(BATCH, QUESTIONS)),
    ),
    variants={"fp32": {}, "int8": {"quantization": "int8"}},
)


def decode_tokens_per_s(run: Run, batch: int) -> float:
    """Decode speed at ``batch`` requests: tokens a step over the median step's seconds (StepEvent.duration_s)."""
    steps = decode_steps(run.events, batch)
    return batch / statistics.median(ev.duration_s for ev in steps)


def agreement(reference: Run, other: Run) -> dict[str, int]:
    """Per request, how many of ``reference``'s greedy tokens ``other`` reproduced before its first different
    choice (a request's tokens after that follow other text, so they are not compared)."""
    out = {}
    for rid, ref in reference.outputs.items():
        toks = other.outputs.get(rid, [])
        out[rid] = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))
    return out


def schedule(run: Run) -> list[tuple]:
    """What every step computed, token ranges only: the same in both runs (quantization touches no scheduling)."""
    return [tuple((s.request_id, s.kind, s.start, s.end) for s in ev.scheduled) for ev in run.events]


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    """Numbers that do not depend on the weights (step counts, batch sizes): the same on any model. Bytes, speed
    and agreement depend on the model and the machine: measure_smollm2."""
    fp32, int8 = runs["fp32"], runs["int8"]
    return dict(
        num_requests=len(SCENARIO.requests), batch=len(BATCH),
        alone_tokens=SCENARIO.request(ALONE).max_tokens, batch_tokens=SCENARIO.request(BATCH[0]).max_tokens,
        compared_tokens=fp32.generated_tokens,
        alone_decode_steps=len(decode_steps(fp32.events, 1)), batch_decode_steps=len(decode_steps(fp32.events, len(BATCH))),
        fp32_steps=fp32.num_steps, int8_steps=int8.num_steps,
        same_schedule=schedule(fp32) == schedule(int8),
        same_kv_bytes=fp32.info.kv_bytes_per_token == int8.info.kv_bytes_per_token,
        int8_dtype=int8.info.dtype,
    )


def measure_smollm2(runs: dict[str, Run]) -> dict[str, float]:
    """Weight bytes (EngineInfo), decode speed alone and in a batch (step durations), and how much of fp32's greedy
    text int8 reproduced: SmolLM2 on this CPU."""
    fp32, int8 = runs["fp32"], runs["int8"]
    out: dict[str, float] = {}
    for name, run in runs.items():
        out[f"{name}_weights_mib"] = run.info.weight_bytes / 2**20
        out[f"{name}_alone_tok_s"] = decode_tokens_per_s(run, 1)
        out[f"{name}_batch_tok_s"] = decode_tokens_per_s(run, len(BATCH))
    agree = agreement(fp32, int8)
    out.update(
        weights_ratio=fp32.info.weight_bytes / int8.info.weight_bytes,
        alone_speedup=out["int8_alone_tok_s"] / out["fp32_alone_tok_s"],
        batch_speedup=out["int8_batch_tok_s"] / out["fp32_batch_tok_s"],
        # fp32 reads (nearly) every weight byte for one token alone: the rate its weights streamed at
        fp32_alone_gb_s=fp32.info.weight_bytes * out["fp32_alone_tok_s"] / 1e9,
        prefix_agreement_percent=100 * sum(agree.values()) / fp32.generated_tokens,
        identical_requests=sum(1 for rid, n in agree.items() if n == len(fp32.outputs[rid])),
    )
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _mib(t: Trace) -> str:
    return f"{t.info.weight_bytes / 2**20:.1f} MiB" if t.info.weight_bytes is not None else "? MiB"


def _alone(t: Trace) -> Any:
    ev = t.last
    if decodes(ev) != 1:
        return None
    return (f"step {ev.step}: {ev.scheduled[0].request_id} alone, one token in {1e3 * ev.duration_s:.1f} ms "
            f"({1 / ev.duration_s:.0f} tokens/s), reading {_mib(t)} of {t.info.quantization or t.info.dtype} weights")


def _int8_weights(t: Trace) -> Any:
    if t.info.quantization != "int8" or t.info.weight_bytes is None or t.info.dtype != "float32":
        return None
    return (f"weights {_mib(t)} (int8 matrices, fp32 embedding and norms); KV "
            f"{t.info.kv_bytes_per_token / 1024:.1f} KiB per token in {t.info.dtype}, as without int8")


def _batched(t: Trace) -> Any:
    ev, n = t.last, decodes(t.last)
    alone = decode_steps(t.events, 1)
    if n < 2 or not alone:
        return None
    per_token = 1e3 * ev.duration_s / n
    return (f"step {ev.step}: {n} tokens in {1e3 * ev.duration_s:.1f} ms, {per_token:.1f} ms a token "
            f"(alone: {1e3 * statistics.median(e.duration_s for e in alone):.1f} ms)")


CHECKPOINTS = [
    Checkpoint("one request decodes alone: every weight is read for a single token", _alone,
               "press n past r0's prefill"),
    Checkpoint("the int8 engine holds int8 weights, and its KV cache stays float32", _int8_weights,
               "run with --quantization int8 and press n once", variants=("int8",)),
    Checkpoint("several requests decode in one step: one read of the weights, several tokens", _batched,
               "run on (space) until the batch decodes together"),
    every_request_finished(SCENARIO),
]

QUIZ = [
    QuizQuestion(
        "One request decodes alone. What sets its speed on a CPU?",
        ("The attention over its few cached tokens", "Reading every weight from memory once per token",
         "The sampler", "The tokenizer"),
        1,
        "Each weight is read once and used for two flops, so the step waits on memory: fp32 SmolLM2 streamed "
        "{{smollm2.fp32_weights_mib:.0f}} MiB a token at {{smollm2.fp32_alone_gb_s:.1f}} GB/s. int8 decoded "
        "{{smollm2.alone_speedup:.1f}} times as fast alone."),
    QuizQuestion(
        "What does `--quantization int8` store for a weight matrix?",
        ("Every weight in float16", "One int8 value per weight and one fp32 scale per output row, max |row| / 127",
         "One scale for the whole model", "The KV cache in int8"),
        1,
        "Symmetric per-output-row scales: q = round(w / scale). The scale comes out of each row's dot product. "
        "Activations, norms, the embedding and the KV cache stay fp32; the weights went from "
        "{{smollm2.fp32_weights_mib:.0f}} to {{smollm2.int8_weights_mib:.0f}} MiB."),
    QuizQuestion(
        "Why can int8's greedy text differ from fp32's when the model is the same?",
        ("A bug in the scheduler", "Rounding moves every logit a little; where two tokens were nearly tied the "
         "other one can win, and the texts go their own ways from there", "int8 samples at random",
         "int8 uses a smaller vocabulary"),
        1,
        "int8 reproduced {{smollm2.prefix_agreement_percent:.0f}}% of fp32's tokens before its first different "
        "choice, and {{smollm2.identical_requests:.0f}} of {{measured.num_requests}} requests came out identical. "
        "fp32 stays exact against transformers; int8 is opt-in."),
    QuizQuestion(
        "{{measured.batch}} requests decode together. Does int8 help as much as for one alone?",
        ("More: int8 is faster per flop", "Less: one read of the weights already serves every row, so the "
         "arithmetic, which int8 does not shrink, weighs more than the bytes", "Exactly as much",
         "int8 cannot batch"),
        1,
        "Alone int8 ran {{smollm2.alone_speedup:.1f}} times as fast as fp32; at {{measured.batch}} requests "
        "{{smollm2.batch_speedup:.1f}} times."),
]
