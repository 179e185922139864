"""The engine's parts talk through plain data, each owning one job.

* The runner builds a batch from the scheduler's output alone (block tables travel with the chunks).
* The scheduler alone advances ``num_computed_tokens`` (``update_from_output``): one place to roll back.
* Block changes are recorded once, as the event's own ``KVChanges``, and drained once per step.
* With prefix caching off, no prefix-cache lookups are counted.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import torch

from minipaged.block_pool import Released, Taken
from minipaged import SamplingParams
from minipaged.events import KVChanges
from minipaged.kernels.backends import TORCH_BACKEND
from minipaged.request import Request
from minipaged.runner.model_runner import ModelRunner
from minipaged.scheduler import ScheduledChunk

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "minipaged"


def test_the_runner_builds_slots_and_tables_from_the_chunks_alone():
    """No block manager in sight: a runner built on a model and a cache reads everything from the chunks."""
    runner = ModelRunner(model=None, kv_cache=torch.zeros(1), block_size=4, backend=TORCH_BACKEND)
    prefill = Request("p", list(range(10, 16)), SamplingParams(), 0, 0.0)              # 6 prompt tokens
    decode = Request("d", [1, 2, 3, 4, 5], SamplingParams(), 1, 0.0, output_token_ids=[6, 7])
    decode.num_computed_tokens = 6
    chunks = [ScheduledChunk(decode, 6, 1, block_table=(9, 3), samples=True),
              ScheduledChunk(prefill, 0, 5, block_table=(7, 2))]       # a chunk that stops short: no sample
    batch = runner.prepare(chunks)
    assert batch.input_ids.tolist() == [7, 10, 11, 12, 13, 14]
    assert batch.positions.tolist() == [6, 0, 1, 2, 3, 4]
    # token 6 of "d" sits in its block 1 (id 3) at offset 2; "p"'s tokens fill block 7, then block 2
    assert batch.meta.slot_mapping.tolist() == [3 * 4 + 2, 28, 29, 30, 31, 8]
    assert batch.meta.block_tables.tolist() == [[9, 3], [7, 2]]
    assert batch.meta.host_seq_lens == [7, 5] and batch.meta.host_query_start_loc == [0, 1, 6]
    assert batch.logits_indices.tolist() == [0] and batch.sampled_requests == [decode]


def test_the_runner_module_does_not_import_the_kv_cache_manager():
    tree = ast.parse((PACKAGE / "runner" / "model_runner.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(m and ("kv_cache_manager" in m or "block_pool" in m) for m in imported)


def test_only_the_scheduler_writes_num_computed_tokens():
    """Speculative decoding rolls rejected tokens back: that must be one place to change."""
    writers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == "num_computed_tokens":
                        writers.add(path.name)
    assert writers == {"scheduler.py"}


MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault"}


def request_field_writes(path: pathlib.Path) -> list[str]:
    """Every place in ``path`` that writes a ``Request`` field: assigned, augmented, deleted (whole or a
    slice), or changed by a mutating method (``req.output_token_ids.append``)."""
    fields = {f.name for f in dataclasses.fields(Request)}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Attribute)):
            targets = [node.func.value]
        else:
            continue
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, (ast.Subscript, ast.Starred)):
                targets.append(t.value)               # what is written into, not the index (d[req.request_id])
            elif isinstance(t, ast.Attribute) and t.attr in fields and not (
                    isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append(f"{path.name}:{t.lineno} {t.attr}")
    return found


def test_the_engine_writes_no_request_field():
    """Token bookkeeping (appending, finishing) is the scheduler's: the engine, its core, the front end's output
    processor, the observers' recorder and the builder only read requests. The check itself catches each kind
    of write."""
    for name in ("engine.py", "engine_builder.py", "engine_core.py", "runner/executor.py", "step_recorder.py",
                 "output_processor.py", "kv_recorder.py"):
        assert request_field_writes(PACKAGE / name) == []
    scheduler_writes = " ".join(request_field_writes(PACKAGE / "scheduler.py"))
    for write in ("status", "stop_reason", "output_token_ids", "num_computed_tokens"):
        assert write in scheduler_writes


def test_each_step_folds_the_block_pools_change_log_once_into_the_event(tiny_engine_factory):
    """The core writes one append-only log; the recorder (outside the core) reads it once a step, whole."""
    engine = tiny_engine_factory(num_blocks=64)
    folded = []
    original = engine.recorder.kv.fold

    def counting_fold(log):
        folded.append(list(log))
        result = original(log)
        return result
    engine.recorder.kv.fold = counting_fold
    engine.add_request(list(range(30)), SamplingParams(temperature=0, max_tokens=3))
    events = []
    while engine.has_unfinished_requests():
        events.append(engine.step().event)
        assert engine.kv.pool.log == []                      # taken whole: nothing left behind for the next step
    assert len(events) == 3 and len(folded) == 3             # a prefill, then two decodes
    assert all(isinstance(ev.kv, KVChanges) for ev in events)
    assert events[0].kv.allocated and events[-1].kv.freed_on_finish       # taken at step 1, let go at the end
    assert any(isinstance(entry, Taken) for entry in folded[0]) and any(isinstance(e, Released) for e in folded[-1])


def test_prefix_cache_queries_are_counted_only_when_caching_is_on(tiny_engine_factory):
    prompt = list(range(40))
    for caching, queried in ((True, 2 * len(prompt)), (False, 0)):
        engine = tiny_engine_factory(enable_prefix_caching=caching)
        engine.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=2))
        stats = engine.stats()
        assert stats["prefix_cache_queries"] == queried
        assert (stats["prefix_cache_hits"] > 0) == caching


def test_a_steps_duration_includes_building_its_event(tiny_engine_factory):
    """The block counts and records an event carries cost time too (a large pool's stats): the step's
    duration_s, and the counters' step_seconds, include them."""
    import time
    engine = tiny_engine_factory(num_blocks=64)
    stats = engine.core.stats

    def slow_stats():
        time.sleep(0.05)
        return stats()
    engine.core.stats = slow_stats
    engine.add_request(list(range(10)), SamplingParams(temperature=0, max_tokens=2))
    event = engine.step().event
    assert event.duration_s >= 0.05 and event.counters["step_seconds"] >= 0.05
    assert engine.counters["step_seconds"] == event.counters["step_seconds"]


# ------------------------------------------------------------------ the output boundary
CLIENT_MODULES = ["engine.py", "cli.py", "bench/run.py", *(f"serve/{p.name}" for p in (PACKAGE / "serve").glob("*.py"))]
PER_REQUEST_EVENT_FIELDS = {"new_text", "new_token_ids", "new_logprobs"}


def attribute_reads(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(the attribute, what it is read from as written, line) for every ``x.attr`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            found.append((node.attr, ast.unparse(node.value), node.lineno))
    return found


def test_clients_read_tokens_from_the_steps_outputs_never_from_its_event():
    """The server, the CLI, ``Engine.generate`` and the benchmarks' driver get tokens, text, log-probabilities
    and finished outputs from ``StepResult.outputs``; events only observe. Nobody reaches into the output
    processor (``engine.outputs``) from outside the engine, and the old side doors are gone."""
    for name in CLIENT_MODULES:
        reads = attribute_reads(PACKAGE / name)
        # (the engine reads the core's EngineCoreOutputs.new_token_ids: that is where tokens come from)
        assert not [r for r in reads if r[0] in PER_REQUEST_EVENT_FIELDS and r[1] != "core_out"], name
        if name != "engine.py":
            assert not [r for r in reads if r[0] == "outputs" and r[1].endswith("engine")], name
    everything = [r for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tui").rglob("*.py"),
                                 *(PACKAGE.parent / "lessons").rglob("*.py")] for r in attribute_reads(path)]
    assert not [r for r in everything if r[0] in {"step_logprobs", "pop_finished", "prompt_logprobs_of",
                                                  "drain_text", "hand_off", "before_model_call",
                                                  "model_call_hooks"}]


def test_the_sample_id_scheme_is_spelled_once():
    """``id.0`` ... ``id.n-1``: only the output processor writes that format (the input processor asks it)."""
    spellers = [path.name for path in PACKAGE.rglob("*.py")
                if any(isinstance(node, ast.JoinedStr) and ast.unparse(node).startswith("f'{request_id}.{")
                       for node in ast.walk(ast.parse(path.read_text())))]
    assert spellers == ["output_processor.py"]


def test_nothing_assigns_to_the_backends_methods():
    """Nothing changes what a step runs by replacing a backend's method: the backend is chosen once and the model
    only calls it (tests may patch what they study; the code may not)."""
    from minipaged.kernels import Backend
    methods = {name for name, value in vars(Backend).items() if callable(value)}
    roots = [PACKAGE, *(PACKAGE.parent / folder for folder in ("kernels", "tui", "lessons", "bench"))]
    for path in (p for root in roots for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                assert not (isinstance(t, ast.Attribute) and t.attr in methods and isinstance(t.value, ast.Attribute)
                            and t.value.attr == "backend"), f"{path}:{node.lineno}: {ast.unparse(t)}"


def test_a_steps_outputs_carry_each_samples_tokens_text_and_logprobs_and_the_output_once(tiny_engine_factory):
    """n samples come back as one request's deltas: choice indices, the same tokens and text the final output
    holds, log-probabilities per token, the prompt's log-probabilities in the first delta, the output once."""
    engine = tiny_engine_factory()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    rid = engine.add_request([5, 6, 7, 8], params)
    deltas = []
    while engine.has_unfinished_requests():
        result = engine.step()
        deltas += result.outputs
        assert all(d.request_id == rid for d in result.outputs)     # never a sample's own id
        assert len({d.request_id for d in result.outputs}) == len(result.outputs)   # one delta per request
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    out = deltas[-1].output
    assert deltas[0].prompt_logprobs == out.prompt_logprobs and out.prompt_logprobs[0] is None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for completion in out.outputs:
        mine = [s for d in deltas for s in d.samples if s.index == completion.index]
        assert [t for s in mine for t in s.token_ids] == completion.token_ids
        assert "".join(s.text for s in mine) == completion.text
        assert [lp for s in mine for lp in s.logprobs] == completion.logprobs
        assert [s.finish_reason for s in mine][-1] == "length" and {s.finish_reason for s in mine[:-1]} <= {None}


def test_plain_requests_stream_their_whole_text_and_observers_see_the_same(tiny_engine_factory):
    """No stop strings, no log-probabilities (the output processor's short way): every character goes out in the
    step that made it, the joined deltas are the final text, and the events show the same text."""
    engine = tiny_engine_factory()
    shown: dict[str, str] = {}
    engine.subscribe(lambda event: [shown.__setitem__(sid, shown.get(sid, "") + text)
                                    for sid, text in event.new_text.items()])
    ids = [engine.add_request([5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True))
           for i in range(3)]
    sent: dict[str, str] = {}
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step().outputs:
            sent[delta.request_id] = sent.get(delta.request_id, "") + delta.samples[0].text
            if delta.finished:
                outputs[delta.request_id] = delta.output
    for rid in ids:
        assert outputs[rid].text and sent[rid] == outputs[rid].text == shown[rid]
