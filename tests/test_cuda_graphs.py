"""CUDA graphs' bookkeeping (kernels/backends/cuda_graphs.py), without a GPU: the engine on the triton backend in
Triton's interpreter, its decode steps "replayed" by a stand-in graph that runs the captured function again on the
same persistent tensors a real graph reads. What a real graph adds (the driver issuing the recorded launches) is
checked on a GPU by bench/gpu_step.py; everything decided on the host is checked here: padding to the next captured
size, inputs copied into the static tensors in place, padding rows that write and read nothing, eager steps for
prefill, mixed and too-large batches, the start-up line, and the options that turn graphs on and off.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any import of triton (as tests/test_triton_kernel.py)

import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from minipaged import Engine, SamplingParams  # noqa: E402
from minipaged.config import ConfigError  # noqa: E402
from minipaged.kernels.backends.cuda_graphs import DecodeGraphs, default_capture_sizes  # noqa: E402

MAX_TOKENS = [2, 3, 4, 5, 6]           # one token from the prefill, then decode batches 5, 4, 3, 2, 1 ...
LATE_MAX_TOKENS = 3                    # ... but a request arriving at step 4 makes that step mixed


class RerunGraphs:
    """A stand-in for torch.cuda.CUDAGraph: ``replay`` runs the captured function again and writes its result
    into the tensor the capture returned, as a real replay overwrites its output in place."""

    def capture(self, fn):
        out = fn()
        return _Rerun(fn, out), out

    def memory_in_use(self) -> int:
        return 0


class _Rerun:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def test_default_sizes_and_padding_to_the_next_size():
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]          # the batch cap itself is captured too
    assert default_capture_sizes(256)[-3:] == [240, 248, 256] and default_capture_sizes(2) == [1, 2]
    graphs = DecodeGraphs([4, 2], 8, 32, torch.device("cpu"), forward=lambda view: None, api=RerunGraphs())
    assert [graphs.size_for(n) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    graphs.graphs = {2: (None, None), 4: (None, None)}              # "captured": replay would call None.replay()

    def step(queries_per_request, table_width=8, sampled=None, prompt_rows=()):
        starts = [0]
        for q in queries_per_request:
            starts.append(starts[-1] + q)
        meta = SimpleNamespace(host_seq_lens=[9] * len(queries_per_request), host_query_start_loc=starts,
                               block_tables=torch.zeros(len(queries_per_request), table_width, dtype=torch.int32))
        return SimpleNamespace(meta=meta, sampled_requests=[None] * (sampled or len(queries_per_request)),
                               prompt_rows=list(prompt_rows), num_logits_rows=list(queries_per_request))
    # Each of these must run eagerly (None) before touching a graph: a prefill chunk, a batch too big, a
    # verification of drafts (two rows of one request), prompt log-probabilities, a table wider than the static one.
    for model_input in (step([5]), step([1] * 5), step([1, 2]), step([1], prompt_rows=[("r", 1, 1)]),
                        step([1], table_width=9)):
        assert graphs.replay(model_input) is None
    assert graphs.eager_steps == 5 and graphs.replays == 0


def run(engine: Engine) -> tuple[list[list[int]], list[list[str]]]:
    """Greedy tokens of five requests and a sixth that arrives at the fourth step; each step's chunk kinds."""
    rng = random.Random(7)

    def add(max_tokens: int) -> str:
        prompt = [rng.randrange(256) for _ in range(rng.randint(5, 14))]
        return engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    ids = [add(n) for n in MAX_TOKENS]
    kinds, done = [], {}
    while engine.has_unfinished_requests():
        if len(kinds) == 3:
            ids.append(add(LATE_MAX_TOKENS))
        result = engine.step()
        kinds.append([chunk.kind for chunk in result.event.scheduled])
        done.update((d.request_id, d.output.token_ids) for d in result.outputs if d.finished)
    return [done[i] for i in ids], kinds


def test_decode_steps_replay_padded_graphs_and_give_the_torch_backends_tokens(tiny_model, monkeypatch):
    pytest.importorskip("triton")
    want, _ = run(Engine(tiny_model, attention_backend="torch", block_size=4, num_blocks=64))
    engine = Engine(tiny_model, attention_backend="triton", block_size=4, num_blocks=64, max_model_len=64)
    assert engine.runner.graphs is None                     # off by default until a GPU run shows them exact
    seen = []                                               # each replay's padding rows: (slots, context lengths)
    forward_static = engine.runner.forward_static

    def forward(view):
        n = len(view.host_seq_lens)
        seen.append((n, view.slot_mapping.tolist(), view.seq_lens.tolist()))
        return forward_static(view)
    monkeypatch.setattr(engine.runner, "forward_static", forward)

    line = engine.runner.capture_decode_graphs([2, 4], max_model_len=64, api=RerunGraphs())
    graphs = engine.runner.graphs
    assert graphs.static.block_tables.shape[1] == 16          # 64 tokens in blocks of 4
    assert line.startswith("CUDA graphs: 2 decode batch sizes captured (2, 4) in ") and " MiB;" in line
    assert [n for n, _, _ in seen] == [4, 2]                 # largest first (smaller ones share its memory pool)
    seen.clear()
    tokens, kinds = run(engine)
    assert tokens == want
    # Steps of 1-4 decodes replayed (here 4, 3 padded to 4, and 2); prefills, the mixed step and the batch of 5
    # ran eagerly.
    decode_only = [len(k) for k in kinds if set(k) == {"decode"}]
    assert 5 in decode_only and any(set(k) == {"decode", "prefill"} and len(k) <= 4 for k in kinds)
    assert graphs.replays == len(seen) == sum(n <= 4 for n in decode_only) >= 3 and 3 in decode_only
    assert graphs.eager_steps == len(kinds) - graphs.replays
    padded = [(slots, lens) for n, slots, lens in seen if min(lens) == 0]
    assert len(padded) == sum(n in (1, 3) for n in decode_only) >= 1
    for slots, lens in padded:                               # a padding row writes no K/V and attends to nothing
        assert slots[-1] == -1 and lens[-1] == 0 and min(slots[:-1]) >= 0 and min(lens[:-1]) > 0


def test_the_graphs_read_only_what_the_runners_model_input_has():
    """kernels/ imports nothing of the engine, so the graphs name what they read of the runner's step inputs
    (``ModelInputView``, ``AttentionMetadataView``): every name is a field of ``ModelInput`` or
    ``AttentionMetadata``, and an input the runner prepared is one."""
    from dataclasses import fields

    from minipaged.kernels.backends import TORCH_BACKEND
    from minipaged.kernels.backends.cuda_graphs import AttentionMetadataView, ModelInputView
    from minipaged.model.llama import AttentionMetadata
    from minipaged.request import Request
    from minipaged.runner.model_runner import ModelInput, ModelRunner
    from minipaged.scheduler import ScheduledChunk

    def names(view: type) -> set[str]:
        return {name for name, value in vars(view).items() if isinstance(value, property)}
    assert names(ModelInputView) <= {f.name for f in fields(ModelInput)}
    assert names(AttentionMetadataView) <= {f.name for f in fields(AttentionMetadata)}
    runner = ModelRunner(model=None, kv_cache=torch.zeros(1), block_size=4, backend=TORCH_BACKEND)
    decode = Request("d", [1, 2, 3], SamplingParams(), 0, 0.0, output_token_ids=[4])
    model_input = runner.prepare([ScheduledChunk(decode, 3, 1, block_table=(5,), samples=True)])
    assert isinstance(model_input, ModelInputView) and isinstance(model_input.meta, AttentionMetadataView)


def test_options_turn_graphs_on_and_off_with_clear_refusals(tiny_model):
    pytest.importorskip("triton")
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device.*--enforce-eager"):
        Engine(tiny_model, attention_backend="triton", num_blocks=16, cuda_graphs=True)
    with pytest.raises(ConfigError, match="plans each step's attention on the host.*attention_backend='triton'"):
        Engine(tiny_model, attention_backend="torch", num_blocks=16, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes must be positive batch sizes"):
        Engine(tiny_model, num_blocks=16, cudagraph_capture_sizes="1,two")
    eager = Engine(tiny_model, attention_backend="triton", num_blocks=16, cuda_graphs=True, enforce_eager=True)
    assert eager.runner.graphs is None                      # --enforce-eager wins, as in vLLM


def test_command_line_flags():
    import argparse

    from minipaged.options import add_engine_arguments, engine_options
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--enforce-eager", "--cuda-graphs", "--cudagraph-capture-sizes", "1,2,8"])
    assert engine_options(args) == {"enforce_eager": True, "cuda_graphs": True, "cudagraph_capture_sizes": "1,2,8"}
    from minipaged.config import EngineConfig
    assert EngineConfig(cudagraph_capture_sizes="8, 1,2").capture_sizes() == [1, 2, 8]


def test_verification_steps_replay_graphs_of_k_plus_one_rows_padded_in_front(tiny_model, monkeypatch):
    """With speculation on, steps that verify drafts replay a second set of graphs, k + 1 rows a request: a request
    with fewer drafts is padded in front, where its padding rows sit at positions already in the cache (its context
    length stays its own) and write no K/V. Greedy tokens are the torch backend's without speculation."""
    pytest.importorskip("triton")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 4))] * 4 for _ in range(5)]   # they repeat
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(engine: Engine) -> list[list[int]]:
        return [out.token_ids for out in engine.generate(prompts, params, use_tqdm=False)]
    want = tokens(Engine(tiny_model, attention_backend="torch", block_size=4, num_blocks=64))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = Engine(tiny_model, attention_backend="triton", block_size=4, num_blocks=64, max_model_len=64,
                    speculative_config=ngram)
    seen = []                                               # each verification replay's rows: (slots, lengths)
    forward_static = engine.runner.forward_static

    def forward(view):
        if len(view.input_ids) > len(view.host_seq_lens):
            seen.append((view.slot_mapping.tolist(), view.seq_lens.tolist()))
        return forward_static(view)
    monkeypatch.setattr(engine.runner, "forward_static", forward)

    line = engine.runner.capture_decode_graphs([2, 4, 8], max_model_len=64, verify_rows=4, api=RerunGraphs())
    graphs = engine.runner.graphs
    assert "and 3 for verifying 3 drafts a request (2, 4, 8)" in line
    seen.clear()
    assert tokens(engine) == want
    assert graphs.verify_replays == len(seen) >= 1 and engine.stats()["spec_decode_num_draft_tokens"] > 0
    padded_in_front = 0
    for slots, lengths in seen:
        for request in range(len(lengths)):
            rows = slots[request * 4:(request + 1) * 4]
            real = [s for s in rows if s >= 0]
            assert rows == [-1] * (4 - len(real)) + real       # padding first, then the request's own rows
            padded_in_front += 0 < len(real) < 4
    assert padded_in_front >= 1
