"""The public surface: model resolution errors, configuration errors, CLI, events as JSON."""
from __future__ import annotations

import json
import re

import pytest

from minipaged import ConfigError, Engine, SamplingParams, StepEvent
from minipaged.cli import main
from minipaged.event_view import EngineView
from minipaged.model import ModelNotAvailableError, UnsupportedModelError
from minipaged.trace import read_trace, write_trace_event, write_trace_header


def test_tinyllama_offline_names_the_embedded_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))          # an empty cache
    with pytest.raises(ModelNotAvailableError, match="--model smollm2") as info:
        Engine("tinyllama")
    assert "TinyLlama/TinyLlama-1.1B-Chat-v1.0" in str(info.value)


def test_other_architectures_are_refused_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(UnsupportedModelError, match="Llama-architecture"):
        Engine(str(tmp_path))


@pytest.mark.parametrize("change, words", [(dict(hidden_act="gelu"), "hidden_act='gelu'"),
                                           (dict(attention_bias=True), "attention_bias=True")])
def test_llama_variants_we_cannot_compute_are_refused_before_loading(tmp_path, change, words):
    from minipaged.model.testing import build_tiny_llama
    folder = build_tiny_llama(tmp_path / "variant")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=words):
        Engine(str(folder))


def test_missing_folder_is_a_clear_error():
    with pytest.raises(ModelNotAvailableError, match="not a folder"):
        Engine("./no/such/folder")


@pytest.mark.parametrize("options, message", [
    (dict(block_size=0), "block_size"), (dict(block_size=12), "power of two"),
    (dict(max_num_seqs=-1), "max_num_seqs"), (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "chunked prefill"),
    (dict(max_model_len=10**6), "max_model_len"), (dict(bogus=1), "unknown engine option"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(preemption_mode="swap", swap_space=0), "swap_space > 0"), (dict(kv_cache_memory="1"), "kv_cache_memory"),
    (dict(swap_space="big"), "swap_space"), (dict(device="tpu"), "device must be"), (dict(seed="x"), "seed"),
    (dict(num_cpu_blocks=0), "num_cpu_blocks"),
])
def test_bad_engine_options_fail_at_start_with_the_fix(tiny_model, options, message):
    with pytest.raises(ConfigError, match=message):
        Engine(tiny_model, **options)


def test_pool_size_from_a_memory_budget(tiny_model):
    engine = Engine(tiny_model, kv_cache_memory=0.001, block_size=16)      # ~1 MiB
    per_block = engine.info.kv_bytes_per_token * 16
    assert engine.info.num_blocks == int(0.001 * 2**30 // per_block)


def test_events_are_json_round_trippable_and_replay_from_a_trace(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(num_blocks=20, preemption_mode="swap", num_cpu_blocks=40)
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as fp:
        write_trace_header(fp, engine.info)
        engine.subscribe(lambda e: write_trace_event(fp, e))
        engine.generate([list(range(i, i + 20)) for i in range(6)],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    info, events = read_trace(str(path))
    assert info == engine.info
    assert any(e.preempted for e in events) and any(e.kv.swapped_in for e in events)
    for event in events:
        assert StepEvent.from_dict(json.loads(event.to_json())) == event
    view = EngineView(info)
    for event in events:
        view.apply(event)
    assert view.num_free_blocks() == info.num_blocks
    assert all(r.state == "finished" for r in view.requests.values())
    assert all(owner is None for owner in view.cpu_block_owner)


def test_bad_trace_file_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "engine"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_trace(str(path))


def test_cli_generate_streams_text(tiny_model, capsys):
    assert main(["generate", "--model", tiny_model, "--max-tokens", "5", "--no-chat", "hello"]) == 0
    out = capsys.readouterr()
    assert "5 tokens" in out.err and out.out.strip()
    # the timing line: what was read, how long until the first token, how fast the rest came
    (timing,) = [line for line in out.err.splitlines() if line.startswith("timing:")]
    assert re.fullmatch(r"timing: \d+ prompt tokens, TTFT \d+\.\d{3} s, 5 output tokens in \d+\.\d\d s: "
                        r"\d+\.\d tok/s \(\d+\.\d tok/s after the first token\)", timing), timing


def test_timing_line_counts_prompts_and_tokens_of_every_request():
    from types import SimpleNamespace as Out

    from minipaged.cli import timing_line
    from minipaged.outputs import RequestMetrics
    one = Out(prompt_token_ids=[1] * 10, token_ids=[5] * 9, metrics=RequestMetrics(100.0, 100.1, 100.5, 102.5))
    assert timing_line([one]) == ("timing: 10 prompt tokens, TTFT 0.500 s, 9 output tokens in 2.50 s: 3.6 tok/s "
                                  "(4.0 tok/s after the first token)")
    other = Out(prompt_token_ids=[1] * 4, token_ids=[5], metrics=RequestMetrics(100.0, 100.1, 101.5, 101.5))
    assert timing_line([one, other]).startswith("timing: 14 prompt tokens, mean TTFT 1.000 s, 10 output tokens")


def test_cli_generate_labels_each_answer_with_its_prompt(tmp_path, capsys):
    """Several prompts through the chat template (token ids inside): each answer is labelled with the text
    the user typed."""
    from transformers import AutoTokenizer

    from minipaged.model.testing import build_tiny_llama
    folder = build_tiny_llama(tmp_path / "chatty")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    tokenizer.save_pretrained(folder)
    assert main(["generate", "--model", str(folder), "--max-tokens", "3", "Why is the sky blue?", "Hi"]) == 0
    out = capsys.readouterr().out
    assert "--- [0] Why is the sky blue?" in out and "--- [1] Hi" in out and "None" not in out


def test_cli_reports_bad_input_without_a_traceback(tiny_model, capsys, monkeypatch):
    import minipaged.cli
    loads = []
    # cmd_generate calls the build_engine that minipaged.cli imported from minipaged.options: replace it there.
    monkeypatch.setattr(minipaged.cli, "build_engine", lambda *a, **k: loads.append(1))
    assert main(["generate", "--model", tiny_model, "--max-tokens", "0", "hi"]) == 2
    assert "max_tokens must be" in capsys.readouterr().err and not loads      # before loading the model


def test_subscriber_errors_do_not_stop_the_engine(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.subscribe(lambda e: 1 / 0)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_unsubscribing_stops_the_events_and_may_be_repeated(tiny_engine_factory):
    engine = tiny_engine_factory()
    seen = []
    unsubscribe = engine.subscribe(seen.append)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    unsubscribe()
    unsubscribe()
    count = len(seen)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert count > 0 and len(seen) == count


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown where CUDA is missing")
def test_asking_for_cuda_without_it_says_so(tiny_model):
    with pytest.raises(ConfigError, match="no CUDA device"):
        Engine(tiny_model, device="cuda")


def test_prompt_previews_are_text_and_keep_the_end_of_long_prompts(tiny_engine_factory):
    """Observers see prompts only through RequestArrival.prompt: token-id prompts are decoded, and the
    TUI's preview of prompts behind a shared system prompt stays distinguishable by their ends."""
    from minipaged.tui.state import clean_preview
    engine = tiny_engine_factory()
    system = "You are a careful assistant who answers questions about geography. " * 4
    engine.add_request(system + "Where is Lima?", SamplingParams(max_tokens=1), request_id="text")
    engine.add_request(engine.tokenizer("hello world").input_ids, SamplingParams(max_tokens=1), request_id="ids")
    engine.add_request(list(engine.tokenizer(system + "Where is Quito?").input_ids), SamplingParams(max_tokens=1),
                       request_id="long-ids")
    arrivals = {a.request_id: a.prompt for a in engine.step().event.arrivals}
    assert arrivals["text"] == system + "Where is Lima?"
    previews = {rid: clean_preview(prompt, 100) for rid, prompt in arrivals.items()}
    assert previews["ids"] == "hello world"
    for rid, end in (("text", "Where is Lima?"), ("long-ids", "Where is Quito?")):
        assert previews[rid].startswith("You are a careful") and previews[rid].endswith(end)
        assert len(previews[rid]) < len(system)


def test_the_readme_library_example_runs_as_written(tiny_model, capsys):
    """The README's library example, on the tiny model instead of SmolLM2 (the only change): every call it shows
    exists and takes what it is given, and both ways of asking, completion and chat, print an answer."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    source = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert source.count('model="smollm2"') == 1 and "engine.chat(" in source and "engine.generate(" in source
    exec(compile(source.replace('model="smollm2"', f"model={tiny_model!r}"), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "steps" in out and out.count("\n") > 3
