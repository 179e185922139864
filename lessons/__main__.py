"""``python -m minipaged.lessons``: list the lessons, print one, or measure them again.

    python -m minipaged.lessons              # list
    python -m minipaged.lessons 3            # lesson 3's text, numbers filled in
    python -m minipaged.lessons --update     # rerun every scenario headless, rewrite measured.json
    python -m minipaged.lessons 11 --update  # rerun lesson 11 only, replace its entry in measured.json
    python -m minipaged.lessons 11 --send http://127.0.0.1:30000   # lesson 11's requests, to your fleet
    python -m minipaged.lessons --check      # rerun and compare with measured.json (exit 1 if different)

Scenarios are measured on a tiny random Llama written to a temporary folder (seconds); ``--model smollm2``
measures on the embedded model instead and must give the same numbers (they depend on scheduling only).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

from .core import MEASURED_FILE, SMOLLM2_FILE, build_lesson_model, get_lesson, list_lessons, run_scenario
from .fleet import FleetScenario, repeatable
from .serving import ServedScenario


def measure_all(model: Optional[str] = None, only: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """Every lesson's numbers (or lesson ``only``'s)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("minipaged").setLevel(logging.ERROR)      # preemption warnings are expected here
    lessons = [get_lesson(only)] if only is not None else list_lessons()
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            model = build_lesson_model(os.path.join(tmp, "tiny"))
        return {str(lesson.number): run_scenario(lesson, model).values for lesson in lessons}


def measure_smollm2(repeats: int = 3, only: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """Each lesson's machine-dependent numbers on SmolLM2 (or lesson ``only``'s): the median of ``repeats``
    headless runs."""
    import platform
    import statistics
    logging.getLogger("minipaged").setLevel(logging.ERROR)
    values: dict[str, dict[str, Any]] = {}
    tmp = tempfile.TemporaryDirectory()
    for lesson in list_lessons():
        if lesson.measure_smollm2 is None or (only is not None and str(lesson.number) != str(only).strip()):
            continue
        model = "smollm2" if lesson.timed_on == "smollm2" else build_lesson_model(os.path.join(tmp.name, "tiny"))
        samples = [lesson.measure_smollm2(run_scenario(lesson, model).runs) for _ in range(repeats)]
        values[str(lesson.number)] = {key: round(statistics.median(s[key] for s in samples), 1) for key in samples[0]}
        values[str(lesson.number)]["_source"] = (f"python -m minipaged.lessons --measure-smollm2, median of {repeats}, "
                                                 f"{platform.machine()} {os.cpu_count()} cores"
                                                 + ("" if model == "smollm2" else ", the lessons' tiny model"))
    tmp.cleanup()
    return values


def write_smollm2(values: dict[str, dict[str, Any]]) -> None:
    """Merge into measured_smollm2.json (other lessons' entries, e.g. lesson 6's from its benchmark, stay)."""
    stored = json.loads(SMOLLM2_FILE.read_text(encoding="utf-8")) if SMOLLM2_FILE.exists() else {}
    stored.update(values)
    SMOLLM2_FILE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def write_measured(values: dict[str, dict[str, Any]], merge: bool = False) -> None:
    """Rewrite measured.json with ``values``; ``merge``: replace only the lessons in ``values``."""
    stored = json.loads(MEASURED_FILE.read_text(encoding="utf-8")) if merge and MEASURED_FILE.exists() else {}
    stored.update(values)
    MEASURED_FILE.write_text(json.dumps(stored, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def send_to_fleet(number: str, url: str, model: str) -> int:
    """A fleet lesson's requests, sent through the router of a fleet the learner started (``minipaged fleet``),
    so its page shows them land; the tokenizer is the replicas' model's (prompts are cut in its tokens)."""
    import httpx
    from transformers import AutoTokenizer

    from .fleet import model_path, send_workload

    lesson = get_lesson(number)
    if isinstance(lesson.scenario, ServedScenario):
        return send_streams_to(lesson, url, model)
    if not isinstance(lesson.scenario, FleetScenario):
        print(f"lesson {lesson.number} runs one engine: open it with `minipaged watch --lesson {lesson.number}`; "
              f"--send is for a lesson that runs a fleet.", file=sys.stderr)
        return 2
    try:
        served = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        print(f"cannot ask {url} for its model ({exc!r}); start a fleet first: minipaged fleet --replicas 2",
              file=sys.stderr)
        return 2
    ids = send_workload(lesson.scenario, url, AutoTokenizer.from_pretrained(model_path(model)), served)
    print(f"sent lesson {lesson.number}'s {len(ids)} requests through {url} "
          f"({lesson.scenario.in_flight} at a time); the fleet page shows where each landed")
    return 0


def send_streams_to(lesson: Any, url: str, model: str) -> int:
    """A served lesson's streams (lesson 12), all at once, to a server the learner started, so `minipaged watch
    --attach` on it shows them arrive."""
    import httpx

    from .serving import send_streams
    try:
        tokens = send_streams(lesson.scenario, url, model)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        print(f"cannot stream to {url} ({exc!r}); start a server first: "
              f"{lesson.scenario.serve_command(lesson.scenario.main_variant)}", file=sys.stderr)
        return 2
    print(f"sent lesson {lesson.number}'s {len(lesson.scenario.requests)} streams to {url} at once: {tokens} tokens")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.lessons", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lesson", nargs="?", help="print this lesson's text")
    parser.add_argument("--update", action="store_true",
                        help="measure every scenario (only lesson N's when one is given), rewrite measured.json")
    parser.add_argument("--check", action="store_true",
                        help="measure every scenario (only lesson N's when one is given), compare with measured.json")
    parser.add_argument("--model", default=None, help="model to measure on (default: a tiny random Llama)")
    parser.add_argument("--measure-smollm2", action="store_true",
                        help="run the lessons that quote milliseconds on SmolLM2 (3 runs, medians; only lesson N "
                             "when one is given) and update measured_smollm2.json")
    parser.add_argument("--send", metavar="URL", default=None,
                        help="send lesson N's requests through the router at URL (a fleet lesson: lesson 11), or "
                             "its streams to the server at URL (a served lesson: lesson 12); "
                             "prompts are cut in --model's tokens (default smollm2, as `minipaged fleet`)")
    args = parser.parse_args(argv)
    if args.send:
        if not args.lesson:
            parser.error("--send needs the lesson's number: python -m minipaged.lessons 11 --send URL")
        return send_to_fleet(args.lesson, args.send, args.model or "smollm2")
    if args.measure_smollm2:
        write_smollm2(measure_smollm2(only=args.lesson))
        print(f"wrote {SMOLLM2_FILE}")
        return 0
    if args.update or args.check:
        values = measure_all(args.model, only=args.lesson)
        if args.update:
            write_measured(values, merge=args.lesson is not None)
            print(f"wrote {MEASURED_FILE}")
            return 0
        stored = json.loads(MEASURED_FILE.read_text(encoding="utf-8"))
        for lesson in list_lessons():                # a fleet's results move with timing: its claims are tested
            if isinstance(lesson.scenario, FleetScenario) and str(lesson.number) in values:
                values[str(lesson.number)] = repeatable(values[str(lesson.number)], lesson.scenario)
        diffs = [(n, k, stored.get(n, {}).get(k), v) for n, vals in values.items() for k, v in vals.items()
                 if stored.get(n, {}).get(k) != v]
        for n, k, old, new in diffs:
            print(f"lesson {n}: {k}: measured.json has {old!r}, this run gives {new!r}")
        print("all lesson numbers reproduced" if not diffs else f"{len(diffs)} number(s) differ")
        return 1 if diffs else 0
    if args.lesson:
        try:
            print(get_lesson(args.lesson).markdown)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    for lesson in list_lessons():
        print(f"{lesson.number}. {lesson.title}: {lesson.summary}  -  minipaged watch --lesson {lesson.number}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
