"""What a speculative verification step costs beside a plain decode step, part by part (SmolLM2, one thread).

A verification of k drafts is a step of k + 1 token rows; a decode step has one. Issue 40 asks that the first
cost at most 1.2x the second on a CPU, where a decode step is bound by reading the weights once. This script
says where the difference goes, with the engine thread's CPU time (``time.thread_time``, one torch thread, so
that every kernel runs on that thread and other jobs on a shared machine disturb the count little):

  * kernels, 1 row against k + 1 rows of one request at a given context (interleaved repetitions, medians):
    the layers' matmuls (the compiled few-row loop), the LM head, the layers' attention, the layer ops
    (norms, RoPE with the K/V write, SiLU), the whole layer loop as the one compiled call the engine makes, and
    the forward pass (embedding, the loop, final norm, LM head);
  * the engine's step, on the input-grounded prompts of bench/spec_decode.py at batch one, n-gram k on and
    off in the same run: each part of a step (scheduling, preparing the inputs, the forward pass and its parts,
    the logits stage, argmax, the rejection sampler, the scheduler's update, the output processor, the event,
    the proposer), the median over the verify steps of the n-gram run beside that over the decode steps of the
    run without speculation.

    python bench/spec_verify_cost.py [--k 3] [--context 150] [--prompts 4] [--repeats 21]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Callable

import torch

from minipaged import Engine, SamplingParams
from minipaged.bench.docs import spec_verify_cost_table
from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged.model.llama import AttentionMetadata
from minipaged.workloads import INSTRUCTIONS, PASSAGES


def interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each call's median thread CPU time in ms, the calls taken in turn so that a busy moment hits them all."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()                                                     # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            begin = time.thread_time()
            call()
            times[name].append(time.thread_time() - begin)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def kernel_parts(engine: Engine, rows: int, context: int) -> dict[str, Callable[[], object]]:
    """The forward pass's parts for ``rows`` rows of one request that has ``context`` tokens before them."""
    model, backend, kv = engine.runner.model, engine.runner.backend, engine.runner.kv_cache
    bs = engine.runner.block_size
    table_ = list(range(1, (context + rows + bs - 1) // bs + 1))
    seq = context + rows
    slots = torch.tensor([table_[p // bs] * bs + p % bs for p in range(context, seq)])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.tensor([table_], dtype=torch.int32),
                             seq_lens=torch.tensor([seq], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, rows], dtype=torch.int32), host_seq_lens=[seq],
                             host_query_start_loc=[0, rows], backend=backend, all_slots_new=True)
    ids, positions = torch.randint(0, model.embed.shape[0], (rows,)), torch.arange(context, seq)
    hidden, heads, kv_heads, dim = model.embed.shape[1], model.num_heads, model.num_kv_heads, model.head_dim
    inter = model.layers[0].gate_up.shape[0] // 2
    x, attn_in, act = torch.randn(rows, hidden), torch.randn(rows, heads * dim), torch.randn(rows, inter)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    gate_up, q = torch.randn(rows, 2 * inter), torch.randn(rows, heads, dim)
    cos_t, sin_t = model._rope_tables(seq)
    cos, sin = cos_t[positions], sin_t[positions]

    def plan():
        return backend.plan(meta.block_tables, bs, meta.host_seq_lens, meta.host_query_start_loc)

    def matmuls():
        for w in model.layers:
            backend.linear(x, w.qkv), backend.linear(attn_in, w.o)
            backend.linear(x, w.gate_up), backend.linear(act, w.down)

    def attention():
        p = plan()
        for i in range(len(model.layers)):
            backend.attention(q, kv[i, 0], kv[i, 1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              model.scale, p)

    def layer_ops():
        ops = backend.layer_ops
        for i, w in enumerate(model.layers):
            h = x.clone()
            ops.add_rms_norm(h, None, w.input_norm, model.eps)
            ops.rope_and_write_kv(qkv.clone(), cos, sin, kv[i, 0], kv[i, 1], slots, heads, kv_heads,
                                  all_slots_new=True)
            ops.add_rms_norm(h, x, w.post_norm, model.eps)
            ops.silu_and_mul(gate_up)

    def layer_loop():
        done = backend.decode_layers(model, model.embed[ids], cos, sin, meta, kv, plan())
        assert done is not None, "the compiled layer loop did not take this step"

    return {"matmuls": matmuls, "lm_head": lambda: backend.lm_head(x, model.lm_head), "attention": attention,
            "layer_ops": layer_ops, "layer_loop": layer_loop,
            "forward": lambda: model.forward(ids, positions, meta, kv, torch.arange(rows))}



# (owner, method, key): each part of a step that is timed, and its key in the JSON (STEP_LABELS: in words)
STEP_PARTS = (("scheduler", "schedule", "schedule"), ("runner", "prepare", "prepare"),
              ("runner", "execute", "forward"), ("backend", "decode_layers", "layer_loop"),
              ("backend", "lm_head", "lm_head"), ("backend", "plan", "attention_plan"),
              ("sampler", "argmax", "argmax"), ("sampler", "sample", "sample"),
              ("speculator", "verify", "rejection_sampler"), ("speculator", "propose", "proposer"),
              ("scheduler", "update_from_output", "update"), ("outputs", "process_tokens", "outputs"),
              ("engine", "_emit", "event"))



def instrument(engine: Engine) -> list[tuple[str, float, dict[str, float]]]:
    """Time each part of every step (the methods of STEP_PARTS wrapped on the instances); returns the list
    the steps' (kind, CPU seconds, seconds by part) go to."""
    parts: dict[str, float] = collections.defaultdict(float)
    owners = {"engine": engine, "scheduler": engine.scheduler, "runner": engine.runner, "backend": engine.backend,
              "sampler": engine.sampler, "speculator": engine.speculator, "outputs": engine.outputs}
    for owner, method, label in STEP_PARTS:
        target = owners[owner]
        if target is None:
            continue

        def timed(*args, _call=getattr(target, method), _label=label, **kwargs):
            begin = time.thread_time()
            try:
                return _call(*args, **kwargs)
            finally:
                parts[_label] += time.thread_time() - begin
        setattr(target, method, timed)
    steps: list[tuple[str, float, dict[str, float]]] = []
    step = engine.step

    def timed_step():
        parts.clear()
        begin = time.thread_time()
        result = step()
        seconds = time.thread_time() - begin
        scheduled = result.event.scheduled
        kind = ("prefill" if any(s.kind == "prefill" for s in scheduled)
                else "verify" if any(s.draft_token_ids for s in scheduled) else "decode")
        steps.append((kind, seconds, dict(parts)))
        return result
    engine.step = timed_step
    return steps


def step_medians(steps: list[tuple[str, float, dict[str, float]]], kind: str) -> dict[str, float]:
    chosen = [s for s in steps if s[0] == kind]
    medians = {"step": 1000 * statistics.median(s[1] for s in chosen)}
    for _owner, _method, label in STEP_PARTS:
        medians[label] = 1000 * statistics.median(s[2].get(label, 0.0) for s in chosen)
    medians["steps"] = len(chosen)
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=150, help="tokens before the rows (the bench's prompts are "
                    "about 95 tokens and grow to about 190)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engines = {"off": Engine(args.model), "ngram": Engine(args.model, speculative_config=spec)}
    off = engines["off"]
    rows = args.k + 1
    one, many = kernel_parts(off, 1, args.context), kernel_parts(off, rows, args.context)
    kernels = interleaved_medians({**{(name, 1): call for name, call in one.items()},
                                   **{(name, rows): call for name, call in many.items()}}, args.repeats)
    chat = off.inputs.chat_prompt
    prompts = [chat([{"role": "user", "content": INSTRUCTIONS[i % 2].format(PASSAGES[i % len(PASSAGES)])}])
               for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for engine in engines.values():
        engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    steps = {name: instrument(engine) for name, engine in engines.items()}
    for prompt in prompts:                                       # the two engines in turn
        for engine in engines.values():
            engine.generate([prompt], params, use_tqdm=False)
    decode, verify = step_medians(steps["off"], "decode"), step_medians(steps["ngram"], "verify")
    record = {"args": vars(args), "rows": rows, "num_layers": len(off.runner.model.layers),
              "kernels_ms": {name: {"decode": kernels[(name, 1)], "verify": kernels[(name, rows)]} for name in one},
              "steps_ms": {name: {"decode": decode[name], "verify": verify[name]}
                           for name in decode if name != "steps"},
              "num_steps": {"decode": decode["steps"], "verify": verify["steps"]}}
    markdown = (f"A verification of k = {args.k} drafts ({rows} rows) beside a decode (1 row), SmolLM2, one torch "
                f"thread, the engine thread's CPU time in ms, medians ({machine_line()})\n\n"
                + spec_verify_cost_table(record))
    save("spec_verify_cost", record, markdown)


if __name__ == "__main__":
    main()
