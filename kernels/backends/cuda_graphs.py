"""CUDA graphs for decode steps: the whole forward pass of a batch of decodes recorded once, replayed as one launch.

Why: a decode step of a 1B model on a GPU is hundreds of small kernel launches (measured: 707 a step before the
fused layer ops), and Python issues them slower than the GPU runs them: the GPU waited nine tenths of each step
(issue 37). A CUDA graph records the launches of one forward pass, with every pointer and grid size it used, and
``replay()`` issues all of them at once from the driver: no Python, no per-kernel launch cost.

What a graph needs, and how this module provides it (vLLM's ``cudagraph_capture_sizes`` idea, simplified):

- **Fixed sizes.** A graph replays exactly the shapes it recorded, so one graph is captured per batch size in a
  list (``default_capture_sizes``: 1, 2, 4, then every 8, as vLLM does); a step of ``n`` decodes replays the
  smallest captured size >= n, with the spare rows padded (slot -1: no K/V write; context length 0: attention
  reads nothing and writes zeros; their logits are ignored).
- **Fixed addresses.** A graph reads its inputs from the memory it was captured with. ``StaticBatch`` holds
  persistent tensors (input ids, positions, slot mapping, block tables, context lengths, query offsets, logit
  rows) for the largest size; each size's graph reads the first rows of them, and ``replay`` copies a step's
  values into them *in place* before replaying. (The KV pool and the weights never move anyway.)
- **Nothing decided on the host inside the graph.** Whatever Python computed while capturing is baked in. So the
  capture runs with host-side hints that hold for *every* later step: the attention's plan is made for the
  longest context the engine allows (the Triton kernel's split count, its grid, fixed per size; splits that find
  no keys weigh zero), and the model's RoPE tables are built up to that length before capture.
  Only backends whose attention reads everything else from device tensors can be captured (``Backend.
  cuda_graphs_problem`` says which): the triton backend; the torch backend builds masks from Python lists.
- **Decodes, and verifications of drafts.** Prefill chunks and mixed steps vary in every dimension: they stay
  eager, as do batches larger than the largest size and a block table wider than the static one (speculative
  decoding's lookahead may reserve blocks past max_model_len). A step that verifies speculative drafts has up to
  k + 1 query rows per request; with speculation on, a second set of graphs is captured with exactly k + 1 rows
  for every request (vLLM's "uniform decode" graphs), and a request with fewer drafts is padded *in front*: its
  padding rows sit at positions already in the cache, so the request's context length stays its own, every key
  they read is one it owns, and its real rows keep their positions (the causal offset is ``seq_len - q_len``).
  Padding rows write no K/V and their logits are dropped.

The graph itself is behind a small interface (``GraphApi``), so the bookkeeping above is tested on a CPU with a
stand-in that "replays" by running the captured function again on the static tensors (tests/test_cuda_graphs.py);
``CudaGraphApi`` is the real one. The model runner owns its graphs (``ModelRunner.capture_decode_graphs``); what
they read of its step inputs is named here (``ModelInputView``), since kernels/ imports nothing of the engine.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Sized, runtime_checkable

import torch

MAX_CAPTURE_SIZE = 512          # vLLM's default cap on the largest captured batch


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's list: 1, 2, 4, then every multiple of 8, up to the engine's batch cap (itself captured too, so
    that a full batch never falls back to eager)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sorted(set(sizes + [top]))


@dataclass
class StaticBatch:
    """The persistent input tensors every captured graph reads, sized for the largest captured batch."""

    input_ids: torch.Tensor         # [size] int64
    positions: torch.Tensor         # [size] int64
    slot_mapping: torch.Tensor      # [size] int64; -1 for padding rows
    block_tables: torch.Tensor      # [size, max_blocks_per_seq] int32
    seq_lens: torch.Tensor          # [size] int32; 0 for padding rows
    query_start_loc: torch.Tensor   # [size + 1] int32: 0, q, 2q, ... (q query rows a request), set once
    logits_indices: torch.Tensor    # [size * q] int64: 0, 1, 2, ... (every row's logits), set once
    max_model_len: int
    rows_per_request: int = 1       # q: 1 for decodes, k + 1 for verifications

    @classmethod
    def allocate(cls, size: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device,
                 rows_per_request: int = 1) -> "StaticBatch":
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        q = rows_per_request
        return cls(zeros(size * q), zeros(size * q), torch.full((size * q,), -1, dtype=torch.int64, device=device),
                   zeros(size, max_blocks_per_seq, dtype=torch.int32), zeros(size, dtype=torch.int32),
                   torch.arange(0, (size + 1) * q, q, dtype=torch.int32, device=device),
                   torch.arange(size * q, dtype=torch.int64, device=device), max_model_len, q)

    def rows(self, size: int) -> "BatchView":
        """The first ``size`` requests' rows: views, so a graph captured on them reads this memory."""
        q = self.rows_per_request
        return BatchView(self.input_ids[:size * q], self.positions[:size * q], self.slot_mapping[:size * q],
                         self.block_tables[:size], self.seq_lens[:size], self.query_start_loc[:size + 1],
                         self.logits_indices[:size * q], host_seq_lens=[self.max_model_len] * size,
                         host_query_start_loc=list(range(0, (size + 1) * q, q)))


@dataclass
class BatchView:
    """One captured size's inputs, as the model runner's forward pass takes them. ``host_*`` are the host-side
    hints the capture plans with: the longest context allowed for every row, one query a row."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    host_seq_lens: list[int]
    host_query_start_loc: list[int]


@runtime_checkable
class AttentionMetadataView(Protocol):
    """What a graph reads of a step's ``AttentionMetadata`` (minipaged/model/llama.py)."""

    @property
    def slot_mapping(self) -> torch.Tensor: ...
    @property
    def block_tables(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def host_seq_lens(self) -> Sequence[int]: ...
    @property
    def host_query_start_loc(self) -> Sequence[int]: ...


@runtime_checkable
class ModelInputView(Protocol):
    """What a graph reads of the model runner's ``ModelInput`` (minipaged/runner/model_runner.py), which has
    these fields: a step's token rows, its attention metadata, and which rows are sampled (a graph replays
    only steps that sample every row and score no prompt rows)."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def meta(self) -> AttentionMetadataView: ...
    @property
    def sampled_requests(self) -> Sized: ...
    @property
    def num_logits_rows(self) -> Sequence[int]: ...
    @property
    def prompt_rows(self) -> Sized: ...


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphApi(Protocol):
    """How graphs are made: ``capture(fn)`` records ``fn()`` and returns (the graph, the tensor ``fn`` returned,
    which every replay overwrites); ``memory_in_use()`` lets the start-up line say what capturing cost."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]: ...

    def memory_in_use(self) -> int: ...


class CudaGraphApi:
    """torch.cuda.CUDAGraph, as torch's documentation uses it: warm-up runs on a side stream before the capture
    (Triton compiles its kernels, cuBLAS sets up its workspace; neither may happen inside a capture), then the
    capture, every size sharing one memory pool."""

    WARMUP_RUNS = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph, out

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


class DecodeGraphs:
    """One graph per batch size over ``StaticBatch``; ``replay`` runs a decode-only step through the smallest
    graph that holds it, or returns None (the caller runs the step eagerly). With ``verify_rows`` = k + 1 > 1
    (speculative decoding), a second graph per size takes the steps that verify drafts, k + 1 rows a request.

    ``forward(view)`` is the model runner's forward pass over a ``BatchView`` (logits [rows, vocab])."""

    def __init__(self, sizes: list[int], max_blocks_per_seq: int, max_model_len: int, device: torch.device,
                 forward: Callable[[BatchView], torch.Tensor], api: GraphApi, verify_rows: int = 1) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"CUDA graph capture sizes must be positive batch sizes; got {sizes}")
        self.sizes = sorted(set(sizes))
        self.forward = forward
        self.api = api
        self.verify_rows = verify_rows
        # Verification graphs hold size * (k + 1) token rows: sizes up to MAX_CAPTURE_SIZE rows, as vLLM counts
        # its capture sizes in tokens (each graph's logits are [rows, vocab]: memory grows with the rows).
        self.verify_sizes = [s for s in self.sizes if s * verify_rows <= MAX_CAPTURE_SIZE] if verify_rows > 1 else []
        with torch.inference_mode():             # the model runs in inference mode: so do its inputs
            self.static = StaticBatch.allocate(self.sizes[-1], max_blocks_per_seq, max_model_len, device)
            self.verify_static = (StaticBatch.allocate(self.verify_sizes[-1], max_blocks_per_seq, max_model_len,
                                                       device, verify_rows) if self.verify_sizes else None)
        self.graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.verify_graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.replays = 0                         # steps replayed (for tests and benchmarks)
        self.verify_replays = 0                  # of which steps that verified drafts
        self.eager_steps = 0                     # steps this could not take (prefill, mixed, too big)

    def capture(self) -> str:
        """Capture every size, largest first (smaller graphs then reuse its pool's memory); the start-up line."""
        start, memory_before = time.perf_counter(), self.api.memory_in_use()
        for size in reversed(self.sizes):
            view = self.static.rows(size)
            self.graphs[size] = self.api.capture(lambda view=view: self.forward(view))
        for size in reversed(self.verify_sizes):
            view = self.verify_static.rows(size)
            self.verify_graphs[size] = self.api.capture(lambda view=view: self.forward(view))
        seconds, mib = time.perf_counter() - start, (self.api.memory_in_use() - memory_before) / 2**20
        verify = (f" and {len(self.verify_sizes)} for verifying {self.verify_rows - 1} drafts a request "
                  f"({describe_sizes(self.verify_sizes)})" if self.verify_sizes else "")
        return (f"CUDA graphs: {len(self.sizes)} decode batch sizes captured ({describe_sizes(self.sizes)}){verify} "
                f"in {seconds:.1f} s, {mib:.0f} MiB; prefill and mixed steps run eagerly (--enforce-eager: none)")

    def size_for(self, num_reqs: int, sizes: Optional[list[int]] = None) -> Optional[int]:
        """The smallest captured size that holds ``num_reqs`` requests (None: more than the largest)."""
        sizes = self.sizes if sizes is None else sizes
        i = bisect.bisect_left(sizes, num_reqs)
        return sizes[i] if i < len(sizes) else None

    def replay(self, model_input: ModelInputView) -> Optional[torch.Tensor]:
        """The logits of a decode-only or verifying step [rows, vocab] (for a decode step a view of the graph's
        output, valid until the next replay), or None when the step is not one a graph can run."""
        meta = model_input.meta
        n = len(meta.host_seq_lens)
        starts = meta.host_query_start_loc
        every_row_sampled = (len(model_input.sampled_requests) == n and not model_input.prompt_rows
                             and sum(model_input.num_logits_rows) == starts[-1])
        if every_row_sampled and starts[-1] > n and self.verify_graphs:
            return self._replay_verification(model_input)
        size = self.size_for(n)
        decode_only = starts[-1] == n and every_row_sampled
        fits = size is not None and meta.block_tables.shape[1] <= self.static.block_tables.shape[1]
        if not (fits and decode_only and self.graphs):
            self.eager_steps += 1
            return None
        s = self.static
        with torch.inference_mode():
            s.input_ids[:n].copy_(model_input.input_ids)
            s.positions[:n].copy_(model_input.positions)
            s.slot_mapping[:n].copy_(meta.slot_mapping)
            s.slot_mapping[n:size].fill_(-1)                   # padding rows write no K/V ...
            s.seq_lens[:n].copy_(meta.seq_lens)
            s.seq_lens[n:size].fill_(0)                        # ... and attend to nothing
            s.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
            graph, logits = self.graphs[size]
            graph.replay()
        self.replays += 1
        return logits[:n]

    def _replay_verification(self, model_input: ModelInputView) -> Optional[torch.Tensor]:
        """A step whose requests verify up to k drafts each, through the graph of k + 1 rows a request: each
        request's rows at the end of its k + 1, padding in front (see the module's docstring)."""
        meta = model_input.meta
        n, q = len(meta.host_seq_lens), self.verify_rows
        starts = meta.host_query_start_loc
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        size = self.size_for(n, self.verify_sizes)
        s = self.verify_static
        if (size is None or max(lengths) > q or min(meta.host_seq_lens) < q
                or meta.block_tables.shape[1] > s.block_tables.shape[1]):
            self.eager_steps += 1                # (a context shorter than k + 1 has no room in front to pad)
            return None
        rows = [i * q + q - length + j for i, length in enumerate(lengths) for j in range(length)]
        with torch.inference_mode():
            where = torch.tensor(rows, dtype=torch.int64, device=s.input_ids.device)
            s.slot_mapping[:size * q].fill_(-1)                # padding rows write no K/V ...
            s.input_ids.index_copy_(0, where, model_input.input_ids)
            s.positions.index_copy_(0, where, model_input.positions)
            s.slot_mapping.index_copy_(0, where, meta.slot_mapping)
            s.seq_lens[:n].copy_(meta.seq_lens)
            s.seq_lens[n:size].fill_(q)                        # ... padding requests read block 0's first keys
            s.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
            s.block_tables[n:size].zero_()
            graph, logits = self.verify_graphs[size]
            graph.replay()
            out = logits.index_select(0, where)
        self.replays += 1
        self.verify_replays += 1
        return out


def describe_sizes(sizes: list[int]) -> str:
    """1, 2, 4, 8, 16 ... 256: a long list shortened for one line."""
    shown = sizes if len(sizes) <= 6 else sizes[:5] + ["...", sizes[-1]]
    return ", ".join(str(s) for s in shown)

