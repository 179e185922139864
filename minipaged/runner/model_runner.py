"""The model runner: lays the step's scheduled tokens end to end and runs the model once.

For each scheduled chunk it emits the chunk's token ids and positions, the cache slot each new token's K/V
goes to (block id * block_size + offset, looked up in the block table the chunk carries), and, if the chunk
reaches the end of the request's known tokens, the rows whose logits are sampled: the last token's, and one
more per draft token a speculative decode carries (the target's verdict on each guess). A chunk in the
middle of a long prompt samples nothing: its job is only to fill the cache. A request that asks for prompt
log-probabilities also gets the logits of its prompt rows, placed after all the sampled rows.

Everything it needs arrives with the chunks (vLLM's ``SchedulerOutput`` -> model runner): the runner never
reads the block manager, so the same runner could sit in another process (tensor parallelism).

A step of plain decodes (the steady state of a busy server) takes a shorter path: block tables kept from step
to step, only what changed written (``input_batch.py``, vLLM's persistent batch); the inputs are the same.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from ..kernels import Backend
from ..kernels.backends.cuda_graphs import BatchView, CudaGraphApi, DecodeGraphs, GraphApi
from ..model.llama import AttentionMetadata, CompactLlama
from ..request import Request
from ..scheduler import ScheduledChunk
from .input_batch import DecodeInputs, plain_decodes


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_requests: list[Request]
    num_logits_rows: list[int]          # rows per sampled request, in order: 1 + its draft tokens
    # Prompt log-probabilities: (request, first prompt token scored, rows), whose logits follow the sampled rows.
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CompactLlama, kv_cache: torch.Tensor, block_size: int, backend: Backend) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = kv_cache
        self.backend = backend            # the engine's Backend: every step's metadata carries it to the model
        self.device = kv_cache.device
        # Captured decode steps (kernels/backends/cuda_graphs.py), once capture_decode_graphs ran: None, eager.
        self.graphs: Optional[DecodeGraphs] = None
        self.decode_inputs = DecodeInputs()
        # Times each step's forward pass (executor.py): the host's clock, and the device's on CUDA.
        self.forward_timer = backend.forward_timer(self.device)

    def prepare(self, chunks: list[ScheduledChunk], with_prompt_rows: bool = True) -> ModelInput:
        """``with_prompt_rows``: also compute the prompt rows of requests that ask for prompt log-probabilities
        (a draft model's forward pass does not need them)."""
        if chunks and plain_decodes(chunks):
            return self._prepare_decodes(chunks)
        return self._prepare_any(chunks, with_prompt_rows)

    def _prepare_any(self, chunks: list[ScheduledChunk], with_prompt_rows: bool = True) -> ModelInput:
        """Any mix of prefill chunks, decodes and drafts, built token by token from the chunks."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampled: list[Request] = []
        num_rows: list[int] = []
        prompt_indices: list[int] = []
        prompt_rows: list[tuple[Request, int, int]] = []
        for chunk in chunks:
            req = chunk.request
            table = list(chunk.block_table)
            input_ids.extend(req.token_ids_between(chunk.start, chunk.start + chunk.num_known_tokens))
            input_ids.extend(chunk.spec_token_ids)
            for pos in range(chunk.start, chunk.end):
                positions.append(pos)
                slots.append(-1 if pos < chunk.cached_prefix_end else table[pos // bs] * bs + pos % bs)
            if with_prompt_rows and req.params.prompt_logprobs is not None and chunk.start < req.num_prompt_tokens - 1:
                # every prompt position's logits score the prompt token after it (the last one samples)
                first = query_start_loc[-1]
                count = min(chunk.end, req.num_prompt_tokens - 1) - chunk.start
                prompt_indices.extend(range(first, first + count))
                prompt_rows.append((req, chunk.start + 1, count))
            query_start_loc.append(len(input_ids))
            seq_lens.append(chunk.end)
            tables.append(table)
            if chunk.samples:                        # every known token has KV now: sample what comes next
                rows = chunk.end - max(chunk.start, req.num_tokens - 1)   # the last known token and each draft
                logits_indices.extend(range(len(input_ids) - rows, len(input_ids)))
                sampled.append(req)
                num_rows.append(rows)
        width = max(len(t) for t in tables)
        block_tables = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values: list, dtype=torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots), block_tables=tensor(block_tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32), query_start_loc=tensor(query_start_loc, torch.int32),
            host_seq_lens=seq_lens, host_query_start_loc=query_start_loc, backend=self.backend,
            all_slots_new=min(slots, default=0) >= 0)
        return ModelInput(tensor(input_ids), tensor(positions), meta, tensor(logits_indices + prompt_indices), sampled,
                          num_rows, prompt_rows)

    def _prepare_decodes(self, chunks: list[ScheduledChunk]) -> ModelInput:
        """One token per request, each sampled: the persistent batch's tensors, moved to the device."""
        input_ids, positions, slots, block_tables, seq_lens, query_start_loc = self.decode_inputs.build(
            chunks, self.block_size)
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(device), block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            host_seq_lens=seq_lens, host_query_start_loc=query_start_loc, backend=self.backend, all_slots_new=True)
        return ModelInput(input_ids.to(device), positions.to(device), meta,
                          torch.arange(len(chunks), device=device), [c.request for c in chunks], [1] * len(chunks))

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        if self.graphs is not None:                  # a decode-only step that fits a captured size: one replay
            logits = self.graphs.replay(model_input)
            if logits is not None:
                return logits
        return self.model.forward(model_input.input_ids, model_input.positions, model_input.meta,
                                  self.kv_cache, model_input.logits_indices)

    def capture_decode_graphs(self, sizes: list[int], max_model_len: int, verify_rows: int = 1,
                              api: Optional[GraphApi] = None) -> str:
        """Capture the CUDA graphs of decode steps of ``sizes`` requests (and, with ``verify_rows`` = k + 1 > 1,
        of steps verifying k drafts a request) that ``execute`` replays from now on; returns the start-up line
        that says what capturing took. ``api``: how graphs are made, CUDA's unless a test brings a CPU stand-in."""
        graphs = DecodeGraphs(sizes, max_blocks_per_seq=-(-max_model_len // self.block_size),
                              max_model_len=max_model_len, device=self.device, forward=self.forward_static,
                              api=api if api is not None else CudaGraphApi(self.device), verify_rows=verify_rows)
        line = graphs.capture()
        self.graphs = graphs
        return line

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Steps inside run eagerly, the captured graphs kept but not replayed (to compare the two)."""
        graphs, self.graphs = self.graphs, None
        try:
            yield
        finally:
            self.graphs = graphs

    def forward_static(self, batch: BatchView) -> torch.Tensor:
        """The forward pass over a captured size's persistent inputs: what ``DecodeGraphs`` records."""
        meta = AttentionMetadata(batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                 batch.host_seq_lens, batch.host_query_start_loc, self.backend)
        return self.model.forward(batch.input_ids, batch.positions, meta, self.kv_cache, batch.logits_indices)

    def close(self) -> None:
        """Nothing to stop in this process (a parallel runner stops its workers)."""

    def swap_blocks(self, cpu_kv_cache: Optional[torch.Tensor], swap_out: list[tuple[int, int]],
                    swap_in: list[tuple[int, int]]) -> None:
        """The data movement of a step's swapping, before the forward pass reads the cache."""
        if swap_out:
            self.copy_blocks(self.kv_cache, cpu_kv_cache, swap_out)
        if swap_in:
            self.copy_blocks(cpu_kv_cache, self.kv_cache, swap_in)

    def copy_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) between pools: the data movement of swapping."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=src_cache.device)
        dst = torch.tensor([d for _, d in pairs], device=dst_cache.device)
        dst_cache[:, :, dst] = src_cache[:, :, src].to(dst_cache.device)
