"""The notebook widget's cost to the engine: lesson workloads run in a real Jupyter kernel (ipykernel, driven
headless by nbclient, which receives every comm message the widget sends), alternating runs without and with
``minipaged.notebook.watch(engine)`` on the same engine (prefix cache reset before each run), in ABBA order so a
drift on a busy machine falls on both sides. Throughput is generated tokens per second of the stepping loop
(the engine's load is outside it). Target: the widget costs <= 5%.

    python bench/notebook_widget.py                  # the lessons' tiny random Llama: ~1 ms steps, the worst case
    python bench/notebook_widget.py --model smollm2  # the embedded model: the steps a workshop runs

Writes bench/out/notebook_widget[_MODEL].json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CELL = r'''
import json, time, logging
logging.getLogger("minipaged").setLevel(logging.ERROR)
from IPython.display import display
from minipaged import Engine
from minipaged.lessons.core import ScenarioFeed, get_lesson
from minipaged.notebook import watch

def one_run(lesson, engine, widget):
    view = watch(engine) if widget else None
    if view is not None:
        display(view)
    time.sleep(0.3)              # the widget's comm opens (its ES module goes out) before the clock starts; both ways
    steps, tokens, seconds = 0, 0, 0.0
    for _ in range(REPEAT):      # the workload again on a fresh cache: the steady cost, not the display's
        engine.reset_prefix_cache()
        feed, done = ScenarioFeed(lesson.scenario, engine.tokenizer), 0
        start = time.perf_counter()
        while True:
            feed.add_due(engine, done)
            if not engine.has_unfinished_requests():
                break
            event = engine.step().event
            done += 1
            tokens += sum(len(t) for t in event.new_token_ids.values())
        seconds += time.perf_counter() - start
        steps += done
    sent = None
    if view is not None:
        view.stop()
        sent = {"messages": view.source.messages, "steps_sent": view.source.steps_sent,
                "steps_coalesced": view.source.steps_coalesced}
        view.close()
    return {"widget": widget, "steps": steps, "tokens": tokens, "seconds": seconds, "sent": sent}

results = {}
for number in LESSONS:
    lesson = get_lesson(number)
    engine = Engine(MODEL, **lesson.scenario.engine_options())
    one_run(lesson, engine, False)                       # warm-up (kernels chosen, caches filled)
    runs = []
    for r in range(ROUNDS):
        order = (False, True) if r % 2 == 0 else (True, False)
        runs += [one_run(lesson, engine, w) for w in order]
    # The feed's own work per step (serialising and folding; the engine's thread only appends), timed alone on
    # one run's events: what the widget can cost at most, beside the engine's median step.
    events = []
    unsubscribe = engine.subscribe(events.append)
    one_run(lesson, engine, False)
    unsubscribe()
    from minipaged.notebook.feed import EventFeed
    feed = EventFeed(lambda message: None, engine.info, max_steps_per_message=10 ** 9)
    start = time.perf_counter()
    for event in events:
        feed.push(event)
        feed.flush(force=True)
    feed_s = (time.perf_counter() - start) / len(events)
    step_s = sorted(e.duration_s for e in events)[len(events) // 2]
    results[number] = {"runs": runs, "feed_us_per_step": feed_s * 1e6, "median_step_ms": step_s * 1e3}
print("RESULTS" + json.dumps(results))
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model name or folder (default: the lessons' tiny Llama)")
    parser.add_argument("--lessons", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--rounds", type=int, default=6, help="pairs of runs (without, with) per lesson")
    parser.add_argument("--repeat", type=int, default=4, help="the lesson's workload this many times a run")
    args = parser.parse_args()

    import nbformat.v4 as v4
    from nbclient import NotebookClient

    from minipaged.bench.report import save
    from minipaged.lessons.core import build_lesson_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_lesson_model(os.path.join(tmp, "tiny"))
        code = f"MODEL = {model!r}\nLESSONS = {args.lessons!r}\nROUNDS = {args.rounds}\nREPEAT = {args.repeat}\n" + CELL
        nb = v4.new_notebook(cells=[v4.new_code_cell(code)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        env_before = dict(os.environ)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            NotebookClient(nb, timeout=3600, kernel_name="python3").execute()
        finally:
            os.environ.clear()
            os.environ.update(env_before)
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.output_type == "stream")
    results = json.loads(text.split("RESULTS", 1)[1].strip().splitlines()[0])

    rows, record = [], {"model": args.model or "tiny lesson Llama (hidden 72, 9 heads over 3 KV heads)",
                        "rounds": args.rounds, "repeat": args.repeat, "lessons": {},
                        "lesson_list": ", ".join(str(n) for n in args.lessons)}
    for number, result in results.items():
        runs = result["runs"]
        rate = lambda w: [r["tokens"] / r["seconds"] for r in runs if r["widget"] == w]
        off, on = statistics.median(rate(False)), statistics.median(rate(True))
        cost = 1 - on / off
        sent = [r["sent"] for r in runs if r["sent"]]
        steps = runs[0]["steps"]
        record["lessons"][number] = {"steps": steps, "tokens": runs[0]["tokens"], "tok_s_without": round(off, 1),
                                     "tok_s_with": round(on, 1), "cost": round(cost, 4),
                                     "messages_per_run": statistics.median(s["messages"] for s in sent),
                                     "feed_us_per_step": round(result["feed_us_per_step"], 1),
                                     "median_step_ms": round(result["median_step_ms"], 3),
                                     "feed_share": round(result["feed_us_per_step"] / 1e3 / result["median_step_ms"], 4),
                                     "runs": runs}
        rows.append(f"| {number} | {steps} | {off:.1f} | {on:.1f} | {cost:+.1%} | "
                    f"{statistics.median(s['messages'] for s in sent):.0f} | {result['feed_us_per_step']:.0f} | "
                    f"{result['median_step_ms']:.2f} |")
    worst = max(v["cost"] for v in record["lessons"].values())
    record["worst_cost"] = worst
    record["median_cost"] = statistics.median(v["cost"] for v in record["lessons"].values())
    record["worst_feed_share"] = max(v["feed_share"] for v in record["lessons"].values())
    record["target"] = 0.05
    md = (f"The notebook widget's cost to the engine ({record['model']}; median of {args.rounds} alternating runs "
          f"each way, each the lesson's workload {args.repeat} times, in a real ipykernel driven by nbclient)\n\n"
          "| lesson | steps | tok/s without | tok/s with widget | cost | comm messages a run | feed µs a step | "
          "median step ms |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
          + f"\n\nworst cost {worst:+.1%}, median {record['median_cost']:+.1%} (target <= 5%); the feed's own work "
          f"is at most {record['worst_feed_share']:.1%} of a median step")
    name = "notebook_widget" + ("" if args.model is None else "_" + Path(args.model).name.replace(".", "_"))
    save(name, record, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
