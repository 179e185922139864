"""`minipaged bench throughput` and `bench latency` on the tiny model: exact token counts, clear errors, PNGs."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from minipaged.bench.report import check_plot_possible
from minipaged.bench.requests import BenchError, LengthRange, make_requests
from minipaged.cli import main
from minipaged.trace import read_trace

TINY = ["--block-size", "4", "--num-blocks", "256"]


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's header; fails if the file is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_throughput_json_counts_every_token_and_baseline_gets_the_same_requests(tiny_model, tmp_path, capsys):
    out, picture = tmp_path / "t.json", tmp_path / "t.png"
    code = main(["bench", "throughput", "--model", tiny_model, "--num-prompts", "6", "--input-len", "8:20",
                 "--output-len", "7", "--dataset-seed", "3", "--baseline", "transformers",
                 "--baseline-batch-size", "4", "--output-json", str(out), "--plot", str(picture), *TINY])
    assert code == 0
    record = json.loads(out.read_text())
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    expected_in = sum(len(r.prompt_token_ids) for r in make_requests(
        "random", 6, LengthRange(8, 20), LengthRange(7, 7), vocab_size=vocab, seed=3))
    for system in ("minipaged", "transformers"):
        assert record[system]["num_requests"] == 6
        assert record[system]["output_tokens"] == 6 * 7
        assert record[system]["input_tokens"] == expected_in
    m = record["minipaged"]
    assert m["output_tokens_per_s"] == pytest.approx(42 / m["seconds"])
    assert m["total_tokens_per_s"] == pytest.approx((expected_in + 42) / m["seconds"])
    assert record["ratio_output_tokens_per_s"] == pytest.approx(
        m["output_tokens_per_s"] / record["transformers"]["output_tokens_per_s"])
    assert record["engine_options"] == {"block_size": 4, "num_blocks": 256}
    printed = capsys.readouterr()
    assert "requests/s" in printed.out and "ratio minipaged / transformers" in printed.out
    assert png_size(picture) == (1000, 400)
    # progress on stderr, also without a terminal: each system's last line counts every request and useful token
    assert "minipaged: 6/6 requests, 42 output tokens" in printed.err
    assert "transformers: 6/6 requests, 42 output tokens" in printed.err


def test_bench_progress_without_a_terminal_prints_requests_and_tokens_per_second_so_far(monkeypatch, capsys):
    from minipaged.bench import report
    monkeypatch.setattr(report, "PLAIN_EVERY_S", 0.0)            # a line at every update, not every 10 s
    with report.progress_bar("minipaged", 3) as advance:
        advance(0, 5)
        advance(2, 5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("minipaged: 0/3 requests, 5 output tokens, ") and "tok/s so far" in lines[0]
    assert lines[1].startswith("minipaged: 2/3 requests, 10 output tokens, ")
    assert lines[-1].startswith("minipaged: 2/3 requests, 10 output tokens, ") and "tok/s in all" in lines[-1]


def test_throughput_records_its_steps_as_a_trace_that_plot_draws(tiny_model, tmp_path):
    """--record saves the run's steps: every prompt and output token is in them, and `minipaged plot` draws them."""
    trace, picture = tmp_path / "run.jsonl", tmp_path / "run.png"
    assert main(["bench", "throughput", "--model", tiny_model, "--num-prompts", "5", "--input-len", "8:20",
                 "--output-len", "6", "--record", str(trace), *TINY]) == 0
    info, events = read_trace(str(trace))
    assert info.num_blocks == 256 and events and sum(len(ev.finished) for ev in events) == 5
    assert sum(len(tokens) for ev in events for tokens in ev.new_token_ids.values()) == 5 * 6
    assert main(["plot", str(trace), "-o", str(picture)]) == 0 and png_size(picture) == (1600, 1000)
    assert main(["bench", "throughput", "--model", tiny_model, "--num-prompts", "1",
                 "--record", str(tmp_path / "no-such-dir" / "x.jsonl"), *TINY]) == 2


def test_throughput_reads_a_jsonl_prompts_file(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n\n"a plain JSON string"\n')
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", tiny_model, "--dataset", str(prompts), "--num-prompts", "3",
                 "--output-len", "4", "--output-json", str(out), *TINY]) == 0
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lengths = [len(tokenizer.encode(t)) for t in ("hello there", "a plain JSON string", "hello there")]
    record = json.loads(out.read_text())["minipaged"]
    assert (record["input_tokens"], record["output_tokens"]) == (sum(lengths), 12)


def test_latency_sweep_splits_prefill_and_decode_exactly(tiny_model, tmp_path):
    out, picture = tmp_path / "l.json", tmp_path / "l.png"
    assert main(["bench", "latency", "--model", tiny_model, "--batch-sizes", "1", "3", "--input-len", "9",
                 "--output-len", "5", "--output-json", str(out), "--plot", str(picture), "--no-prefix-caching",
                 *TINY]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["batch_size"] for r in sweep] == [1, 3]
    for r in sweep:
        b = r["batch_size"]
        assert (r["input_tokens"], r["output_tokens"]) == (9 * b, 5 * b)
        assert r["prefill_tokens"] == 9 * b            # every prompt token computed once (no cache, no preemption)
        assert r["decode_tokens"] == 4 * b             # the first token comes from the prefill step
        assert r["prefill_steps"] + r["decode_steps"] == r["steps"]
        assert r["decode_steps"] == 4                  # the whole batch decodes together, one token a step
        assert r["prefill_s"] + r["decode_s"] == pytest.approx(r["mean_step_s"] * r["steps"])
    assert png_size(picture) == (1000, 400)


def test_shared_prefix_requests_start_alike_and_are_reproducible():
    made = make_requests("shared-prefix", 5, LengthRange(10, 30), LengthRange(4, 4), vocab_size=100, seed=1)
    prefix = made[0].prompt_token_ids[:5]
    assert all(r.prompt_token_ids[:5] == prefix for r in made)
    assert len({tuple(r.prompt_token_ids) for r in made}) == 5
    assert made == make_requests("shared-prefix", 5, LengthRange(10, 30), LengthRange(4, 4), vocab_size=100, seed=1)
    assert all(10 <= len(r.prompt_token_ids) <= 30 and min(r.prompt_token_ids) >= 3 for r in made)


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--input-len", "0"], "at least 1"),
    (["throughput", "--output-len", "40:x"], "LO:HI"),
    (["throughput", "--input-len", "400:40"], "LO <= HI"),
    (["throughput", "--num-prompts", "0"], "at least 1"),
    (["throughput", "--baseline", "vllm"], "invalid choice"),
    (["latency", "--batch-sizes", "two"], "whole number"),
])
def test_bad_flags_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_dataset_and_plot_name_exit_2_before_any_work(tiny_model, tmp_path, capsys):
    assert main(["bench", "throughput", "--model", tiny_model, "--dataset", str(tmp_path / "nope.jsonl"),
                 *TINY]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "wrong key"}\n')
    assert main(["bench", "throughput", "--model", tiny_model, "--dataset", str(bad), *TINY]) == 2
    assert "bad.jsonl:1: no prompt" in capsys.readouterr().err
    assert main(["bench", "latency", "--model", "/no/such/model", "--plot", str(tmp_path / "x.jpg")]) == 2
    assert "ending in .png" in capsys.readouterr().err        # found before the model is even looked for


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib now raises ImportError
    with pytest.raises(BenchError, match="pip install matplotlib"):
        check_plot_possible("run.png")
    check_plot_possible(None)                                 # no picture asked for: nothing to check


def test_compare_sets_two_tuning_runs_side_by_side(tiny_model, tmp_path, capsys):
    """The tuning loop: a baseline, a change of one flag, and the comparison (table with ratios, and a PNG)."""
    runs = []
    for max_num_seqs in (1, 8):
        runs.append(tmp_path / f"seqs{max_num_seqs}.json")
        assert main(["bench", "throughput", "--model", tiny_model, "--num-prompts", "8", "--input-len", "8",
                     "--output-len", "4", "--max-num-seqs", str(max_num_seqs), "--output-json", str(runs[-1]),
                     *TINY]) == 0
    capsys.readouterr()
    picture = tmp_path / "compare.png"
    assert main(["bench", "compare", *map(str, runs), "--plot", str(picture)]) == 0
    table = capsys.readouterr().out
    records = [json.loads(r.read_text())["minipaged"] for r in runs]
    ratio = records[1]["output_tokens_per_s"] / records[0]["output_tokens_per_s"]
    assert "seqs1" in table and "seqs8" in table and f"({ratio:.2f}x)" in table
    assert png_size(picture) == (1500, 400)                   # one panel per headline number, three of them


def test_compare_refuses_mixed_or_missing_results(tmp_path, capsys):
    throughput = tmp_path / "t.json"
    throughput.write_text(json.dumps({"bench": "throughput", "minipaged": {}}))
    latency = tmp_path / "l.json"
    latency.write_text(json.dumps({"bench": "latency", "sweep": []}))
    assert main(["bench", "compare", str(throughput), str(latency)]) == 2
    assert "different benches" in capsys.readouterr().err
    assert main(["bench", "compare", str(throughput), str(tmp_path / "gone.json")]) == 2
    assert "gone.json: no such file" in capsys.readouterr().err


def test_a_prompt_too_long_for_the_model_is_a_clear_error(tiny_model, capsys):
    assert main(["bench", "throughput", "--model", tiny_model, "--input-len", "100", "--num-prompts", "2",
                 "--max-model-len", "64", *TINY]) == 2
    assert "minipaged: error:" in capsys.readouterr().err


def test_a_refused_request_leaves_no_blocks_behind(tiny_engine_factory):
    from minipaged.bench.requests import BenchRequest
    from minipaged.bench.run import run_requests
    from minipaged.request import InvalidRequestError
    engine = tiny_engine_factory(max_model_len=64)
    free = engine.kv.num_free_blocks
    with pytest.raises(InvalidRequestError):
        run_requests(engine, [BenchRequest([5] * 10, 4), BenchRequest([5] * 100, 4)])
    assert not engine.has_unfinished_requests()          # the first, already queued, was aborted
    assert run_requests(engine, [BenchRequest([5] * 10, 4)]).num_output_tokens == 4     # still usable
    assert engine.kv.num_free_blocks == free


def test_decode_floor_measures_floor_and_engine_steps_in_turns_and_leaves_nothing_behind(tiny_model, monkeypatch):
    """bench/decode_floor.py's efficiency is a ratio of two timings: they must be taken in turns (floor
    pass, engine step, floor pass, ...), so that a machine whose speed drifts slows both alike, and the
    requests it decoded must be gone afterwards, their blocks free for the next batch size."""
    from minipaged import Engine
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import decode_floor
    engine = Engine(tiny_model, block_size=4, num_blocks=64, max_num_seqs=3, enable_prefix_caching=False)
    order: list[str] = []
    run_floor = decode_floor.matmul_pass(engine.model, 3)
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (order.append("step"), step())[1])

    def floor_pass() -> float:
        order.append("floor")
        return run_floor()
    floor_ms, step_ms = decode_floor.side_by_side_ms([floor_pass], [engine], batch=3, context=6, steps=5)
    assert floor_ms > 0 and step_ms > 0
    decodes = order[order.index("floor"):]              # from the first floor pass on: prefills are done
    assert decodes == ["floor"] + ["floor", "step"] * 5   # a warm-up pass, then 5 turns
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_floor_profile_counts_every_compiled_matmul_as_a_matmul(tiny_model, monkeypatch, quantization):
    """The profile split puts the compiled matmul loops (one-row and tiled, fp32 and int8) under "matmul": a
    batch of 9 decodes runs the tiled multiply, 1 the one-row loop, and neither may hide as Python time."""
    from minipaged import Engine
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import decode_floor
    engine = Engine(tiny_model, block_size=4, num_blocks=128, max_num_seqs=9, enable_prefix_caching=False,
                    quantization=quantization)
    for batch in (9, 1):
        profile = decode_floor.profile_step(engine, batch, context=6, steps=2)
        assert profile["ms"]["matmul"] > 0, (batch, profile["table"])
        names = profile["table"]
        assert ("tiled" in names) == (batch == 9), names


def test_one_request_table_shows_the_paths_the_run_measured():
    """bench/one_request.py --paths serve (or in-process) alone: its table has that path's columns, not a KeyError
    for the other's."""
    from minipaged.bench.docs import one_request_table

    def tree(commit: str, **paths: float) -> dict:
        out: dict = {"commit": commit}
        for path, best in paths.items():
            entry = {"best": best, "median": best, "best_over_working_tree": best / 40.0}
            out.update(entry) if path == "in_process" else out.setdefault(path, entry)
        return out

    serve_only = one_request_table({"trees": {"working tree": tree("working tree", serve=40.0),
                                              "abc1234": tree("abc1234 old", serve=30.0)}})
    assert "serve best tok/s" in serve_only and "in-process" not in serve_only and "| 30.00 |" in serve_only
    both = one_request_table({"trees": {"working tree": {**tree("working tree", in_process=41.0, serve=40.0),
                                                         "serve_over_in_process": 40.0 / 41.0}}})
    assert "in-process best tok/s" in both and "serve / in-process" in both and "| 0.98 |" in both
