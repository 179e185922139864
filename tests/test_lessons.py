"""The guided lessons: each scenario runs headless on a tiny random model and the lesson's claims hold.

Scheduling claims (blocks, hits, chunks, preemptions, tokens per step) do not depend on the model's weights:
prompts are token ids of fixed lengths and every request decodes greedily with ignore_eos. So the numbers
measured here are the numbers in the lesson text (``lessons/measured.json``) and the numbers a learner
sees with SmolLM2 in ``minipaged watch --lesson N``.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import types
from pathlib import Path

import pytest

from minipaged.lessons import get_lesson, list_lessons, run_scenario
from minipaged.lessons.core import MEASURED_FILE, build_lesson_model, fill
from minipaged.lessons.fleet import FleetScenario, repeatable
from minipaged.lessons.serving import ServedScenario
from minipaged.placeholders import hand_written_numbers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lesson_model(tmp_path_factory) -> str:
    return build_lesson_model(str(tmp_path_factory.mktemp("lesson-model")))


NUMBERS = [lesson.number for lesson in list_lessons()]
HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None
NO_ROUTER = ("sglang-router is not installed, and lesson 11 runs through it: pip install -e '.[fleet]' (CI "
             "installs it)")


def is_fleet(lesson) -> bool:
    return isinstance(lesson.scenario, FleetScenario)


def is_served(lesson) -> bool:
    """Lesson 12: its variants are ways of serving one engine (real `minipaged serve` subprocesses)."""
    return isinstance(lesson.scenario, ServedScenario)


def splits_the_model(lesson) -> bool:
    return any(lesson.scenario.engine_options(v).get("tensor_parallel_size", 1) > 1 for v in lesson.scenario.variants)


@pytest.fixture(scope="module")
def results(tiny_model, lesson_model):
    """Every variant of every lesson's scenario, run once (a few seconds in all; lesson 7 starts workers).

    The parallel lesson needs SmolLM2's head layout (tensor parallel 3); the others run on the shared tiny
    model, whose greedy text repeats itself, which lesson 6's n-gram checkpoints need to tick. The numbers
    are the same on either (test_measured_json_is_what_the_scenarios_give_now). The fleet lesson (11) starts
    replicas and sglang-router (about 40 s), and is left out where sglang-router is not installed."""
    logging.getLogger("minipaged").setLevel(logging.ERROR)     # preemption warnings are the point of lesson 5
    return {lesson.number: run_scenario(lesson, lesson_model if splits_the_model(lesson) else tiny_model)
            for lesson in list_lessons() if HAS_ROUTER or not is_fleet(lesson)}


# ----------------------------------------------------------------------------------------------- API

def test_lessons_are_listed_in_order_with_titles():
    lessons = list_lessons()
    assert [l.number for l in lessons] == sorted(NUMBERS) and {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11} <= set(NUMBERS)
    assert all(l.title and l.markdown.startswith(f"# Lesson {l.number}: ") for l in lessons)
    assert get_lesson(3).title == "Prefix caching" and get_lesson("4").number == 4
    with pytest.raises(ValueError, match="no lesson 99"):
        get_lesson(99)


def test_cli_lists_the_lessons(capsys):
    from minipaged.cli import main
    assert main(["lessons"]) == 0
    out = capsys.readouterr().out
    for lesson in list_lessons():
        assert f"{lesson.number}. {lesson.title}: {lesson.summary}" in out and f"--lesson {lesson.number}" in out
    assert main(["lessons", "3"]) == 0
    assert capsys.readouterr().out.strip() == get_lesson(3).markdown.strip()
    assert main(["lessons", "99"]) == 2 and "no lesson 99" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- text

def _texts(lesson):
    quiz = [part for q in lesson.quiz for part in (q.question, *q.choices, q.explanation)]
    checkpoints = [part for cp in lesson.checkpoints for part in (cp.text, cp.hint)]
    return [lesson.template, *quiz, *checkpoints]


@pytest.mark.parametrize("number", NUMBERS)
def test_every_placeholder_is_filled_from_the_measured_run(number):
    lesson = get_lesson(number)
    measured = json.loads(MEASURED_FILE.read_text(encoding="utf-8"))[str(number)]
    options = lesson.scenario.engine_options()
    for text in _texts(lesson):
        filled = fill(text, measured, options, lesson.smollm2)  # KeyError if a placeholder is unknown
        assert "{{" not in filled and "}}" not in filled
    rendered = lesson.render_quiz()
    assert all(0 <= q.answer < len(q.choices) and len(set(q.choices)) == len(q.choices) for q in rendered)
    assert len(lesson.quiz) >= 3 and len(lesson.checkpoints) >= 4


# Numbers that may stand in the text without being measured: list markers, request ids, share labels (x3),
# the lesson's own number and other lessons' numbers, and anything quoted, in code, or in a diagram.
ALLOWED = [r"^\s*\d+\. ", r"\br\d+\b", r"\bx\d\b", r"^# Lesson \d+", r"\blesson \d+\b", r"SmolLM2", r"\bv[01]\b",
           r"et al\.,? (?:[A-Z]+ )?\d{4}",                          # a citation's year: Kwon et al., SOSP 2023
           r"\b(?:int8|fp32)\b"]                                     # names of number formats (lesson 9)


@pytest.mark.parametrize("number", NUMBERS)
def test_no_number_in_the_text_is_written_by_hand(number):
    # Skipped: diagrams (their numbers are illustrative), code and commands, placeholders, link targets and
    # quotations from vLLM's docs (the docs' templates are checked the same way, without quotations).
    leftovers = hand_written_numbers(get_lesson(number).template, ALLOWED, quotations=True)
    assert not leftovers, f"lesson {number} states numbers that are not measured: {leftovers}"


@pytest.mark.parametrize("number", NUMBERS)
def test_a_quoted_claim_with_a_number_stands_beside_our_measurement(number):
    """Lessons quote vLLM's documents to test their claims: a quoted number never stands alone."""
    text = re.sub(r"```.*?```", "", get_lesson(number).template, flags=re.S)
    for paragraph in re.split(r"\n\s*\n", text):
        if any(re.search(r"\d", q) for q in re.findall(r'"([^"]*)"', paragraph, flags=re.S)):
            assert "{{measured." in paragraph or "{{smollm2." in paragraph, \
                f"lesson {number}: a quoted number without ours: {paragraph[:80]}"


@pytest.mark.parametrize("number", NUMBERS)
def test_links_point_at_files_that_exist(number):
    lesson = get_lesson(number)
    links = re.findall(r"\]\(([^)#]+)\)", lesson.template)
    assert links, "a lesson links to the code that implements its mechanism"
    for link in links:
        assert lesson.source_path(link).exists(), link
        assert (lesson.markdown_path.parent / link).resolve() == lesson.source_path(link)   # the repo layout


def test_links_resolve_in_an_installed_wheel_too(monkeypatch, tmp_path):
    """In a wheel the lessons sit in minipaged/lessons/, so '../minipaged/x.py' must not be taken literally."""
    from minipaged.lessons import Lesson

    root = tmp_path / "site-packages" / "minipaged"
    for name, folder in (("minipaged", root), ("minipaged.kernels", root / "kernels")):
        installed = types.ModuleType(name)
        installed.__file__ = str(folder / "__init__.py")
        monkeypatch.setitem(sys.modules, name, installed)
    assert Lesson.source_path("../minipaged/scheduler.py") == root / "scheduler.py"
    assert Lesson.source_path("../kernels/reference.py") == root / "kernels" / "reference.py"


@pytest.mark.parametrize("number", NUMBERS)
def test_lesson_text_is_short_paragraphs_with_a_diagram(number):
    text = get_lesson(number).template
    assert "```" in text, "a diagram where it helps"
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for paragraph in re.split(r"\n\s*\n", prose):
        if paragraph.lstrip().startswith(("|", "-", "1.", "#")):
            continue
        assert len(paragraph.split()) <= 80, f"lesson {number}: a long paragraph: {paragraph[:60]}..."
    assert "minipaged watch --lesson" in text and "**n**" in text     # what to press in the TUI


# ----------------------------------------------------------------------------------------------- numbers

def test_measured_json_is_what_the_scenarios_give_now(results):
    """The numbers in the lesson text are kept true: rerun, compare. (Fix: python -m minipaged.lessons --update)"""
    stored = json.loads(MEASURED_FILE.read_text(encoding="utf-8"))
    for number, result in results.items():
        if is_fleet(result.lesson):
            # Requests in flight together land where timing takes them: the same numbers, not the same digits.
            # The workload's own numbers must agree; the claims are checked in test_lesson11_*.
            assert set(result.values) == set(stored[str(number)])
            fixed = repeatable(result.values, result.lesson.scenario)
            assert fixed == {k: stored[str(number)][k] for k in fixed} and len(fixed) >= 8
            assert not any(k.startswith(("round_robin", "cache_aware")) for k in fixed)
            continue
        assert result.values == stored[str(number)], f"lesson {number}: rerun `python -m minipaged.lessons --update`"


def test_lesson1_paged_waste_is_small_and_max_length_reservation_is_not(results):
    v = results[1].values
    run = results[1].runs["main"]
    assert v["paged_waste"] < 0.05
    assert v["max_len_waste"] > 0.50
    assert v["exact_waste"] > v["paged_waste"]
    assert v["worst_tail"] < run.info.block_size                  # only the last block is ever part empty
    assert v["peak_running"] > v["contiguous_fit"]
    assert run.num_preemptions == 0 and v["peak_blocks"] <= run.info.num_blocks


def test_lesson2_continuous_batching_doubles_tokens_per_step(results):
    v = results[2].values
    runs = results[2].runs
    assert v["continuous_tokens_per_step"] >= 2 * v["static_tokens_per_step"]
    assert v["outputs_equal"] and runs["static"].outputs == runs["continuous"].outputs
    assert runs["static"].info.policy == "static" and runs["continuous"].info.policy == "continuous"
    assert v["static_second_batch"] > v["continuous_r4_start"]
    assert v["static_idle"] > 0.5 > v["continuous_idle"]


def test_lesson3_hits_shared_blocks_and_lru_eviction(results):
    v = results[3].values
    assert v["hit_tokens"] == v["prefill_saved"] > 0
    assert v["hit_rate"] == round(v["hit_tokens"] / v["prompt_tokens"], 4) > 0.4
    assert v["prefill_off"] == v["prompt_tokens"]
    # vLLM's prefix-aware admission example, reproduced: 16 blocks, 12 cached, only 4 needed.
    assert (v["r2_blocks"], v["r2_hit_blocks"], v["r2_new_blocks"]) == (16, 12, 4)
    assert v["r2_new_blocks"] <= v["r2_free_before"] < v["r2_blocks"] and v["r2_step"] == 3
    assert v["r2_waited_off"] > 0
    assert v["sys_blocks"] == 12 and v["max_share"] >= 3           # the diagram shows sys 0..11; x3 in the text
    assert v["r5_cached"] == v["sys_tokens"]                       # hits on blocks nobody held
    assert v["r6_evicted"] > 0 and v["r7_cached"] == v["sys_tokens"]   # LRU kept the hot prefix


def test_lesson4_smaller_budget_lower_itl_higher_ttft(results):
    v = results[4].values
    assert v["budget_64_itl_tokens"] < v["budget_512_itl_tokens"]
    assert v["budget_64_ttft_steps"] > v["budget_512_ttft_steps"]
    assert v["prefill_first_itl_steps"] > v["budget_64_itl_steps"] == 1   # decodes stall without chunking
    assert v["budget_64_chunks"] > 1 and v["budget_512_chunks"] == 1
    assert v["outputs_equal"]
    assert results[4].runs["budget-64"].info.max_num_batched_tokens == 64
    assert v["big_budget"] == 512


def test_lesson5_preemption_in_both_modes_and_outputs_unchanged(results):
    v = results[5].values
    runs = results[5].runs
    assert runs["recompute"].preemptions("recompute") > 0
    assert runs["swap"].preemptions("swap") > 0 and v["swap_blocks_in"] > 0
    for name, run in runs.items():
        assert run.outputs == runs["roomy"].outputs, name
        assert all(len(toks) == spec.max_tokens for spec, toks in
                   zip(get_lesson(5).scenario.requests, (run.outputs[r.request_id] for r in
                                                         get_lesson(5).scenario.requests)))
    assert v["recompute_extra_tokens"] > 0 and v["swap_extra_tokens"] == 0
    assert v["roomy_preemptions"] == 0 and v["fewer_seqs_preemptions"] == 0
    assert v["fewer_seqs_steps"] > v["recompute_steps"]
    assert v["demand_blocks"] > runs["recompute"].info.num_blocks
    assert v["first_victim"] == "r5" and v["first_victim_running"] == 6   # the diagram in the text


# ----------------------------------------------------------------------------------------------- checkpoints

def test_lesson7_split_model_holds_more_blocks_per_rank_and_stops_preempting(results):
    v, runs = results[7].values, results[7].runs
    one, tp3, pp2 = runs["tp1"], runs["tp3"], runs["pp2"]
    assert tp3.info.parallel == "tp=3: 3 heads, 1 KV head per rank" and pp2.info.parallel.startswith("pp=2")
    # The engine's own bytes per token per rank: a third (tensor parallel), a half (pipeline parallel).
    assert tp3.info.kv_bytes_per_token * 3 == one.info.kv_bytes_per_token
    assert pp2.info.kv_bytes_per_token * 2 == one.info.kv_bytes_per_token
    assert tp3.info.num_blocks == 3 * one.info.num_blocks and pp2.info.num_blocks == 2 * one.info.num_blocks
    assert v["demand_blocks"] > one.info.num_blocks                # one rank is oversubscribed ...
    assert one.num_preemptions > 0 and v["tp1_extra_prefill"] > 0
    assert tp3.num_preemptions == 0 and pp2.num_preemptions == 0   # ... the split ones are not
    assert v["tp3_peak_blocks"] <= v["demand_blocks"] and v["tp3_steps"] < v["tp1_steps"]
    for run in (tp3, pp2):                                         # and nobody's tokens changed
        assert run.outputs == one.outputs
    assert all(len(toks) == spec.max_tokens for spec in get_lesson(7).scenario.requests
               for toks in [one.outputs[spec.request_id]])


def test_lesson8_priority_overtakes_victims_differ_and_lru_keeps_the_alternating_prompts(results):
    v, runs = results[8].values, results[8].runs
    assert all(v[f"{name}_same_outputs"] for name in ("fcfs", "priority", "most_blocks", "mru"))  # tokens unchanged
    assert runs["priority"].info.scheduling_policy == "priority" and runs["mru"].info.eviction_policy == "mru"
    # FCFS admits in arrival order; priority lets the late r4 (-1) overtake and r0 (5) starve until the end
    assert v["fcfs_order"] == "r0 r1 r2 r3 r4" and v["priority_order"].split()[-1] == "r0"
    assert v["priority_order"].index("r4") < v["priority_order"].index("r0")
    assert v["r4_wait_priority"] < v["r4_wait_fcfs"] and v["r0_wait_priority"] > v["r0_wait_fcfs"]
    # newest-first and most-blocks preempt different requests; most-blocks' victim held more blocks
    assert v["fcfs_victim"] == "r2" and v["most_blocks_victim"] != v["fcfs_victim"]
    assert v["most_blocks_victim_blocks"] > v["fcfs_victim_blocks"]
    assert v["most_blocks_recomputed"] > v["fcfs_recomputed"] and v["most_blocks_steps"] > v["fcfs_steps"]
    # alternating two system prompts: LRU keeps each prompt's first blocks, MRU gives block 0 away first
    assert 0 < v["lru_hit_per_repeat"] < v["sys_tokens"] and v["mru_hit_per_repeat"] == 0
    assert v["fcfs_repeat_hit_rate"] > v["mru_repeat_hit_rate"] == 0 and v["mru_evictions"] > v["lru_evictions"]


def test_lesson8_fair_share_admits_the_lone_client_before_the_greedy_clients_queue(results):
    """The text's fair-share claims: client B's one request (r4) goes before client A's waiting r3, A pays with
    r3's wait, the preemption takes an A request, and part two (no client named: one client) runs as FCFS."""
    v, runs = results[8].values, results[8].runs
    assert runs["fair-share"].info.fair_share and not runs["fcfs"].info.fair_share
    assert v["fair_share_same_outputs"] and v["fair_share_order"] == "r0 r1 r2 r4 r3"
    assert v["r4_wait_fair_share"] < v["r4_wait_fcfs"] and v["r3_wait_fair_share"] > v["r3_wait_fcfs"]
    assert v["r4_first_token_fair_share"] < v["r4_first_token_fcfs"]
    assert v["fair_share_victim_client"] == "A" and v["r4_preempted_fair_share"] == 0
    assert v["fair_share_recomputed"] > v["fcfs_recomputed"] and v["fair_share_steps"] > v["fcfs_steps"]
    assert v["fair_share_part_two_same"] and v["fair_share_repeat_hit_rate"] == v["fcfs_repeat_hit_rate"]


def test_lesson8_fair_share_variant_opens_from_its_flag():
    """`minipaged watch --lesson 8 --fair-share` opens the fair-share variant, and the variant's command says so."""
    lesson = get_lesson(8)
    assert lesson.options_for({"fair_share": True})[0] == "fair-share"
    assert lesson.variant_command("fair-share") == "minipaged watch --lesson 8 --fair-share"


def test_lesson9_int8_shrinks_the_weights_and_changes_no_scheduling(results):
    v, runs = results[9].values, results[9].runs
    fp32, int8 = runs["fp32"], runs["int8"]
    assert fp32.info.quantization is None and int8.info.quantization == "int8"
    # The matrices take a quarter of their bytes (plus a scale a row); the embedding stays fp32: so the whole
    # lies between a quarter and a half of fp32's (the docs measure SmolLM2's ratio; the tiny model's is alike).
    assert 0.25 * fp32.info.weight_bytes < int8.info.weight_bytes < 0.5 * fp32.info.weight_bytes
    assert v["same_schedule"] and v["same_kv_bytes"] and v["int8_dtype"] == "float32"
    assert v["fp32_steps"] == v["int8_steps"] == fp32.num_steps
    # r0's first token comes from its prefill, the others one decode step each, alone; then the batch together
    assert v["alone_decode_steps"] == v["alone_tokens"] - 1 and v["batch_decode_steps"] == v["batch_tokens"] - 1
    assert v["compared_tokens"] == v["alone_tokens"] + v["batch"] * v["batch_tokens"] == int8.generated_tokens


@pytest.mark.skipif(not HAS_ROUTER, reason=NO_ROUTER)
def test_lesson11_cache_aware_keeps_each_tenant_on_one_replica_and_hits_more(results):
    """Through the real router, the same requests on fresh replicas: cache_aware's fleet hit rate beats
    round_robin's, because it sends each tenant to one replica and round_robin to all. (Not each replica's: the
    first four requests arrive together, so which tenants share a replica, and whether two or three of them do,
    follows from the order the router sees them in, as the lesson says; on a loaded machine a replica given
    three tenants' prefixes thrashes its pool, and its own rate can fall below round_robin's.)"""
    from minipaged.lessons import lesson11_fleet_routing as lesson11

    v, runs = results[11].values, results[11].runs
    rr, ca = runs["round_robin"], runs["cache_aware"]
    assert v["cache_aware_hit_rate"] > v["round_robin_hit_rate"]        # (by how much moves with load)
    assert v["prefill_saved"] > 0 and v["cache_aware_prefill"] < v["round_robin_prefill"]
    # where the requests went, as the replicas' own events say
    tenants = lambda fleet, i: {lesson11.SCENARIO.request(rid).tenant for rid in fleet.served(i)}
    assert tenants(ca, 0).isdisjoint(tenants(ca, 1)) and tenants(ca, 0) | tenants(ca, 1) == set(lesson11.TENANTS)
    assert tenants(rr, 0) == tenants(rr, 1) == set(lesson11.TENANTS)
    # a repeat can arrive while its tenant's first request is still in flight (not cached yet): hence not all
    assert v["repeats"] >= v["cache_aware_whole_hits"] > v["round_robin_whole_hits"]
    # round_robin's pools must evict (every replica is sent all four tenants). Not compared with cache_aware's:
    # a replica that cache_aware gives three tenants (3-1 rather than 2-2, as above) evicts more than either
    # round_robin replica, and the lesson claims no such comparison.
    assert v["round_robin_evicted"] > 0
    for fleet in (rr, ca):                      # every request ran once, on one replica, with all its tokens
        assert sorted(fleet.routed) == sorted(r.request_id for r in lesson11.SCENARIO.requests)
        served = [sid for run in fleet.replicas for sid, toks in run.outputs.items() if len(toks) == lesson11.MAX_TOKENS]
        assert sorted(served) == sorted(fleet.server_ids.values())
    # the hit rate is the replicas' own counters: hits over queries, summed
    hits = sum(r.events[-1].counters["prefix_cache_hits"] for r in ca.replicas)
    assert v["cache_aware_hit_rate"] == round(hits / sum(r.events[-1].counters["prefix_cache_queries"]
                                                         for r in ca.replicas), 4)


def test_lesson11_stored_numbers_back_the_text():
    """The text's claims hold for the numbers it shows (measured.json, the last --update run)."""
    v = json.loads(MEASURED_FILE.read_text(encoding="utf-8"))["11"]
    assert v["cache_aware_hit_rate"] > v["round_robin_hit_rate"] and v["prefill_saved"] > 0
    assert v["repeats"] >= v["cache_aware_whole_hits"] > v["round_robin_whole_hits"]
    assert set(v["cache_aware_r0_tenants"]).isdisjoint(v["cache_aware_r1_tenants"])
    assert v["round_robin_r0_tenants"] == v["round_robin_r1_tenants"] == "ABCD"
    assert v["pool_tenants"] < v["num_tenants"]                   # the pool cannot hold every tenant's prefix


def test_lesson11_watch_says_what_to_run_and_the_commands_parse(capsys):
    """watch draws one engine: for the fleet lesson it names the fleet command (which parses) and exits 2."""
    import shlex

    from minipaged.cli import main, make_parser

    assert main(["watch", "--lesson", "11"]) == 2
    err = capsys.readouterr().err
    assert "minipaged fleet --replicas 2 --policy cache_aware" in err and "--send http://127.0.0.1:30000" in err
    fleet_line = next(line.strip() for line in err.splitlines() if line.strip().startswith("minipaged fleet"))
    args = make_parser().parse_args(shlex.split(fleet_line)[1:])
    shown = " ".join(args.serve_args.split())          # the lessons' defaults, then the scenario's own options
    assert "--long-prefill-token-threshold 0" in shown and "--block-size 16 --num-blocks 48" in shown, shown
    assert main(["watch", "--lesson", "11", "--compare"]) == 2 and "fleet page" in capsys.readouterr().err


def test_update_of_one_lesson_keeps_the_others(monkeypatch, tmp_path):
    """`python -m minipaged.lessons 11 --update` replaces lesson 11's entry only (another lesson's stays)."""
    from minipaged.lessons import __main__ as lessons_main

    stored = tmp_path / "measured.json"
    stored.write_text(json.dumps({"3": {"hit_rate": 0.5}, "11": {"old": 1}}), encoding="utf-8")
    monkeypatch.setattr(lessons_main, "MEASURED_FILE", stored)
    lessons_main.write_measured({"11": {"new": 2}}, merge=True)
    assert json.loads(stored.read_text(encoding="utf-8")) == {"3": {"hit_rate": 0.5}, "11": {"new": 2}}
    lessons_main.write_measured({"11": {"new": 2}})
    assert json.loads(stored.read_text(encoding="utf-8")) == {"11": {"new": 2}}


def test_check_of_one_lesson_measures_that_lesson_only(monkeypatch, capsys):
    """`python -m minipaged.lessons 3 --check` runs lesson 3's scenario alone and compares its numbers."""
    from minipaged.lessons import __main__ as lessons_main

    measured = []
    real = lessons_main.run_scenario
    monkeypatch.setattr(lessons_main, "run_scenario",
                        lambda lesson, model: measured.append(lesson.number) or real(lesson, model))
    assert lessons_main.main(["3", "--check"]) == 0
    assert measured == [3] and "all lesson numbers reproduced" in capsys.readouterr().out


def test_send_refuses_a_one_engine_lesson(capsys):
    from minipaged.lessons.__main__ import main as lessons_main

    assert lessons_main(["3", "--send", "http://127.0.0.1:9"]) == 2
    assert "minipaged watch --lesson 3" in capsys.readouterr().err
    assert lessons_main(["11", "--send", "http://127.0.0.1:9"]) == 2    # nothing listens there
    assert "start a fleet first" in capsys.readouterr().err


def _with_token_changed(run, request_id: str, index: int):
    """A copy of ``run`` in which the ``index``-th generated token of ``request_id`` is another one."""
    from dataclasses import replace
    from minipaged.lessons.core import Run

    events, seen = [], 0
    for ev in run.events:
        toks = ev.new_token_ids.get(request_id, [])
        if seen <= index < seen + len(toks):
            changed = list(toks)
            changed[index - seen] += 1
            ev = replace(ev, new_token_ids={**ev.new_token_ids, request_id: changed})
        seen += len(toks)
        events.append(ev)
    return Run(run.variant, run.info, events)


def test_lesson9_speed_and_agreement_are_computed_from_the_events(results):
    """measure_smollm2 is the code behind the lesson's SmolLM2 figures: on the tiny model its values differ,
    but they are computed, and a token changed by hand moves the agreement exactly where it was changed."""
    from minipaged.lessons import lesson9_quantization as lesson9

    v, runs = results[9].values, results[9].runs
    fp32, int8 = runs["fp32"], runs["int8"]
    m = lesson9.measure_smollm2(runs)
    assert m["weights_ratio"] == fp32.info.weight_bytes / int8.info.weight_bytes > 2
    assert m["fp32_weights_mib"] == fp32.info.weight_bytes / 2**20
    for key in ("fp32_alone_tok_s", "int8_alone_tok_s", "fp32_batch_tok_s", "int8_batch_tok_s"):
        assert 0 < m[key] < float("inf"), key
    alone = lesson9.decode_steps(fp32.events, 1)
    assert len(alone) == v["alone_decode_steps"] and all(len(ev.scheduled) == 1 for ev in alone)
    assert m["fp32_alone_tok_s"] == 1 / sorted(ev.duration_s for ev in alone)[len(alone) // 2]
    agree = lesson9.agreement(fp32, int8)
    assert set(agree) == set(fp32.outputs) and all(0 <= n <= len(fp32.outputs[r]) for r, n in agree.items())
    assert 0 <= m["prefix_agreement_percent"] <= 100
    assert m["prefix_agreement_percent"] == 100 * sum(agree.values()) / v["compared_tokens"]
    # a run against itself agrees everywhere; one token changed by hand is found where it was changed
    assert lesson9.agreement(fp32, fp32) == {r: len(t) for r, t in fp32.outputs.items()}
    doctored = _with_token_changed(fp32, "r2", 5)
    assert lesson9.agreement(fp32, doctored) == {**lesson9.agreement(fp32, fp32), "r2": 5}
    both = lesson9.measure_smollm2({"fp32": fp32, "int8": doctored})
    assert both["identical_requests"] == v["num_requests"] - 1
    assert both["prefix_agreement_percent"] == 100 * (v["compared_tokens"] - (v["batch_tokens"] - 5)) / v["compared_tokens"]


def test_lesson9_checkpoints_tick_where_the_runs_show_them(results):
    from minipaged.lessons import lesson9_quantization as lesson9
    from minipaged.lessons.core import Trace

    lesson, runs = get_lesson(9), results[9].runs
    assert lesson.options_for({"quantization": "int8"})[0] == "int8" and lesson.options_for({})[0] == "fp32"
    text = {i: cp.text for i, cp in enumerate(lesson.checkpoints)}
    by_words = lambda words: next(i for i, t in text.items() if words in t)
    for name, run in runs.items():
        tracker = lesson.tracker(run.info)
        for event in run.events:
            tracker.feed(event)
        assert tracker.ticked[by_words("decodes alone")][0] == run.first_scheduled_step("r0") + 1
        assert tracker.ticked[by_words("several requests")][0] == run.first_scheduled_step("r1") + 1
        assert "alone:" in tracker.ticked[by_words("several requests")][1]
    # The int8 checkpoint reads the engine's header: the fp32 run never shows it, even fed every event.
    trace = Trace(runs["fp32"].info)
    for event in runs["fp32"].events:
        trace.apply(event)
        assert not lesson9._int8_weights(trace)
        assert bool(lesson9._alone(trace)) == (lesson9.decodes(event) == 1)
        assert bool(lesson9._batched(trace)) == (lesson9.decodes(event) == len(lesson9.BATCH))


def test_lesson9_stored_smollm2_figures_back_the_text():
    """The text says int8 is faster alone, helps a batch less, and shrinks the whole weights less than the
    matrices' four times; measured_smollm2.json must say so too, and be consistent with itself."""
    from minipaged.lessons.core import SMOLLM2_FILE

    s = json.loads(SMOLLM2_FILE.read_text(encoding="utf-8"))["9"]
    assert s["_source"].startswith("python -m minipaged.lessons --measure-smollm2")
    assert 1 < s["alone_speedup"] and s["batch_speedup"] < s["alone_speedup"]
    assert 2 < s["weights_ratio"] < 4 and s["int8_weights_mib"] < s["fp32_weights_mib"]
    assert s["weights_ratio"] == pytest.approx(s["fp32_weights_mib"] / s["int8_weights_mib"], abs=0.1)
    assert s["alone_speedup"] == pytest.approx(s["int8_alone_tok_s"] / s["fp32_alone_tok_s"], abs=0.1)
    assert 0 <= s["prefix_agreement_percent"] <= 100
    assert 0 <= s["identical_requests"] <= get_lesson(9).measured["num_requests"]


def test_lesson7_pool_from_a_memory_budget_grows_with_the_ranks(lesson_model):
    """What the lesson's "Try it" says: without --num-blocks, each rank's pool comes from --kv-cache-memory
    per rank, so three tensor-parallel ranks get three times the blocks."""
    from minipaged import Engine

    budget = dict(num_blocks=None, kv_cache_memory=0.0005, block_size=16, num_threads=1)
    with Engine(lesson_model, **budget) as one, Engine(lesson_model, tensor_parallel_size=3, **budget) as three:
        assert one.info.num_blocks > 0
        assert 3 * one.info.num_blocks <= three.info.num_blocks < 3 * (one.info.num_blocks + 1)   # whole blocks
        assert three.info.kv_bytes_per_token * 3 == one.info.kv_bytes_per_token


def test_every_checkpoint_ticks_in_its_own_run(results):
    """Fed a headless run event by event, each checkpoint ticks in the variant(s) it belongs to."""
    for number, result in results.items():
        lesson = result.lesson
        ticked_somewhere = set()
        for name, run in result.runs.items():
            # A fleet lesson's checkpoints read one replica's stream: each must tick on one of its replicas.
            ticked_here = set()
            for one in (run.replicas if is_fleet(lesson) else [run]):
                tracker = lesson.tracker(one.info)
                if is_fleet(lesson) or is_served(lesson):
                    tracker.variant = name                     # the router's policy, or how it was served: not in
                    #                                            the engine's header
                assert tracker.variant == name
                for event in one.events:
                    tracker.feed(event)
                ticked_here |= set(tracker.ticked)
            for i, cp in enumerate(lesson.checkpoints):
                if cp.variants is None or name in cp.variants:
                    assert i in ticked_here, f"lesson {number}, {name}: never ticked: {cp.text}"
            ticked_somewhere |= ticked_here
        assert ticked_somewhere == set(range(len(lesson.checkpoints)))


def test_lesson3_checkpoints_tick_when_the_text_says(results):
    """Ticking at all is not enough: each checkpoint ticks at the moment the lesson's steps point at."""
    lesson, run, v = get_lesson(3), results[3].runs["cache-on"], results[3].values
    tracker = lesson.tracker(run.info)
    for event in run.events:
        tracker.feed(event)
    step_of = {lesson.checkpoints[i].text: step for i, (step, _) in tracker.ticked.items()}
    by_words = lambda words: next(step for text, step in step_of.items() if words in text)
    assert by_words("cache hit") == v["r2_step"] == run.first_scheduled_step("r2")
    assert by_words("three requests") == run.first_scheduled_step("r3")
    assert by_words("nobody was using") == run.first_scheduled_step("r5")
    assert by_words("evicts cached blocks") == v["r6_step"]
    assert by_words("r7 still finds") == run.first_scheduled_step("r7")


def test_a_checkpoint_ticks_once_and_replayed_events_do_not_count_twice(results):
    lesson = get_lesson(3)
    run = results[3].runs["cache-on"]
    tracker = lesson.tracker(run.info)
    hit = next(i for i, cp in enumerate(lesson.checkpoints) if "cache hit" in cp.text)
    for event in run.events[:2]:
        tracker.feed(event)
    assert hit not in tracker.ticked                      # r2 arrives before step 3
    assert tracker.feed(run.events[2]) and tracker.ticked[hit][0] == 3
    assert "12 blocks reused" in tracker.ticked[hit][1]
    assert tracker.feed(run.events[1]) == []              # shown again after stepping back: ignored


def test_user_flags_pick_the_variant_they_name():
    lesson2, lesson4, lesson5 = get_lesson(2), get_lesson(4), get_lesson(5)
    assert lesson2.options_for({})[0] == "continuous"
    assert lesson2.options_for({"policy": "static"})[0] == "static"
    variant, options = lesson4.options_for({"enable_chunked_prefill": False})
    assert variant == "prefill-first" and options["max_num_batched_tokens"] >= options["max_model_len"]
    assert lesson4.options_for({"max_num_batched_tokens": 512})[0] == "budget-512"
    assert lesson5.options_for({"preemption_mode": "swap"})[0] == "swap"
    variant, options = lesson5.options_for({"num_blocks": 40})
    assert variant is None and options["num_blocks"] == 40      # a run of the learner's own
    variant, options = lesson5.options_for({"kv_cache_memory": 0.01})
    assert variant is None and "num_blocks" not in options      # the typed budget sizes the pool


def test_options_that_change_no_number_the_lesson_shows_keep_its_variant():
    """--num-threads makes steps faster or slower, nothing else a lesson shows: no "your own options" warning
    (a class trial got one), and the threads still reach the engine."""
    lesson2 = get_lesson(2)
    variant, options = lesson2.options_for({"num_threads": 4})
    assert variant == "continuous" and options["num_threads"] == 4
    assert lesson2.options_for({"policy": "static", "num_threads": 1})[0] == "static"
    assert lesson2.options_for({"num_threads": 4, "num_blocks": 7})[0] is None     # a real change still warns


def smollm2_values(number: int) -> dict:
    """Lesson ``number``'s measured values on SmolLM2 (run in a worker process of the test below)."""
    return run_scenario(get_lesson(number), "smollm2").values


@pytest.mark.slow
@pytest.mark.alongside
def test_smollm2_gives_the_same_numbers():
    """What a learner sees in ``minipaged watch --lesson N`` (SmolLM2) is what the text says. The lessons run in
    worker processes with the scenario's one thread, two at a time when run alone (the same values as one after
    another: none depends on time, in half the wall time), one at a time in ``make test``'s alongside lane, which
    has one core to itself (tests/conftest.py)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    stored = json.loads(MEASURED_FILE.read_text(encoding="utf-8"))
    lessons = list_lessons()
    # The served lesson is the tiny model's (a cheap forward pass): its numbers are the workload's and the greedy
    # tokens', checked on the tiny model; SmolLM2 servers cost minutes. The fleet lesson starts servers itself.
    alone = [lesson.number for lesson in lessons if not is_served(lesson) and not is_fleet(lesson)]
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2          # (under xdist: the alongside lane)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for number, values in zip(alone, pool.map(smollm2_values, alone)):
            assert values == stored[str(number)], number
    for lesson in lessons:
        if is_fleet(lesson) and HAS_ROUTER:     # its prompts are cut in SmolLM2's tokens; its results move with timing
            values = repeatable(run_scenario(lesson, "smollm2").values, lesson.scenario)
            assert values == {k: stored[str(lesson.number)][k] for k in values}, lesson.number


# ----------------------------------------------------------------------------------------------- lesson 12

def test_lesson12_both_servers_stream_the_in_process_greedy_tokens(results):
    """The same prompts through `minipaged serve --core-in-thread` and `minipaged serve` (real subprocesses, real
    streaming clients): every stream gets exactly the in-process greedy tokens, and the events say so too."""
    from minipaged.lessons import lesson12_engine_process as lesson12

    v, runs = results[12].values, results[12].runs
    local = runs[lesson12.IN_PROCESS].outputs_by_request()
    assert len(local) == lesson12.NUM_STREAMS and all(len(t) == lesson12.MAX_TOKENS for t in local.values())
    for name in (lesson12.ONE, lesson12.TWO):
        served = runs[name]
        assert served.outputs_by_request() == local, name
        assert served.generated_tokens == v["total_tokens"] and served.wall_s > 0
        assert set(served.cpu_s) == {"core", "api_server", "clients"} and served.cpu_s["api_server"] > 0
        arrived = {a.request_id for ev in served.events for a in ev.arrivals}
        assert arrived == set(served.request_ids.values())         # the warm-up request's steps were left out
    assert runs[lesson12.ONE].cpu_s["core"] == 0 < runs[lesson12.TWO].cpu_s["core"]   # one process, or two
    assert v["one_process_same_tokens"] is True and v["two_processes_same_tokens"] is True
    assert v["in_process_full_steps"] == v["max_tokens"] - 1    # every decode step carries all the streams


def test_lesson12_timings_come_from_the_runs(results):
    """measure_smollm2's numbers are computed from the runs (the clock's and the events'), not typed."""
    from minipaged.lessons import lesson12_engine_process as lesson12

    runs = results[12].runs
    t = lesson12.timings(runs)
    two = runs[lesson12.TWO]
    assert t["two_processes_tok_s"] == two.generated_tokens / two.wall_s
    assert t["two_processes_pct"] == 100 * t["two_processes_tok_s"] / t["in_process_tok_s"]
    assert t["two_processes_core_cpu_us"] == 1e6 * two.cpu_s["core"] / two.generated_tokens
    host = sum(ev.host_s for ev in two.events)
    assert t["two_processes_host_us"] == 1e6 * host / two.generated_tokens
    assert 0 < t["two_processes_host_pct"] < 100 and t["two_processes_steps"] == len(two.events)
    assert t["in_process_batch"] > t["two_processes_batch"]     # served requests arrive over several steps


def test_lesson12_stored_timings_back_the_text():
    """What the text says of this machine's numbers holds for measured_smollm2.json (the last measured run)."""
    from minipaged.lessons.core import SMOLLM2_FILE

    s = json.loads(SMOLLM2_FILE.read_text(encoding="utf-8"))["12"]
    assert "tiny model" in s["_source"]
    assert s["two_processes_cpu_pct"] > 100                      # the split costs CPU per token
    assert s["two_processes_core_cpu_us"] + s["two_processes_api_cpu_us"] == pytest.approx(
        s["two_processes_cpu_us"], abs=0.2)
    assert s["in_process_batch"] > s["two_processes_batch"]


def test_lesson12_served_variants_say_how_to_start_them(capsys):
    """watch draws the in-process run; a served variant's command is the server to start, and --compare says so."""
    import shlex

    from minipaged.cli import main, make_parser

    lesson = get_lesson(12)
    assert lesson.options_for({})[0] == "in-process"
    one = lesson.variant_command("one-process")
    assert "--core-in-thread" in one and "--send http://127.0.0.1:8000" in one
    serve = shlex.split(one.split("  (")[0])
    args = make_parser().parse_args(serve[1:])                 # the command parses as `minipaged serve`
    assert args.core_in_thread and args.num_blocks == lesson.scenario.options["num_blocks"]
    assert main(["watch", "--lesson", "12", "--compare"]) == 2
    assert "Its other runs are servers" in capsys.readouterr().err
