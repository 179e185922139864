"""The model runner's persistent batch: block tables kept from step to step, rows rewritten only when they change.

A decode step at batch 256 changes little: each request's position moves by one, it has one new input token,
and one request in ``block_size`` gets a new block. Rebuilding every input from Python lists each step (the
runner's general path) costs per token and per block; vLLM's ``InputBatch`` keeps the tensors instead and
writes only what changed. This one does the same for steps where every chunk is a plain decode (one known
token, no drafts, nothing cached under it):

  * block tables live in one array, a row per request (kept while the request keeps being scheduled). A row
    is written when its request arrives, and after that only its new blocks (the table grew) or all of it
    when the table is not the one written (a preempted request got new blocks);
  * token ids, positions and sequence lengths are one list comprehension each, one tensor each;
  * the cache slot of each token is computed on the arrays: ``table[row, pos // block_size] * block_size +
    pos % block_size``.

The result is the same ``ModelInput`` the general path builds, value for value (tests/test_input_batch.py
checks it), so the model cannot tell which path laid out its inputs.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..request import Request
from ..scheduler import ScheduledChunk


def plain_decodes(chunks: Sequence[ScheduledChunk]) -> bool:
    """True when every chunk computes one token of its request's output and samples the next: no prompt
    rows, no draft tokens, no slot under a cached prefix (what the persistent path handles)."""
    return all(c.num_new_tokens == 1 and c.samples and not c.spec_token_ids and c.cached_prefix_end <= c.start
               and c.start >= len(c.request.prompt_token_ids) for c in chunks)


class PersistentBlockTables:
    """Block tables of the requests being scheduled, one row each, kept between steps in a numpy array (host
    memory; vLLM's ``InputBatch`` keeps its host side in numpy too: writing a few entries costs a fraction of a
    microsecond there, against microseconds for a torch tensor from Python)."""

    def __init__(self, num_rows: int = 64, num_cols: int = 16) -> None:
        self.tables = np.zeros((num_rows, num_cols), dtype=np.int32)
        self._row_of: dict[Request, int] = {}          # keyed by the request object: ids may be reused later
        self._written: list[tuple[int, ...]] = [()] * num_rows     # what each row holds
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def rows_for(self, requests: Sequence[Request], tables: Sequence[tuple[int, ...]]) -> list[int]:
        """The row of each request, after writing whatever changed in its table; rows of requests not in
        this step are given back (a request that comes back later is written again)."""
        row_of = self._row_of
        if len(row_of) > len(requests) or any(r not in row_of for r in requests):
            self._keep_only(requests)
        rows = [row_of[r] for r in requests]
        written = self._written
        for row, table in zip(rows, tables):
            if written[row] != table:
                self._write(row, table)
        return rows

    def _keep_only(self, requests: Sequence[Request]) -> None:
        present = set(requests)
        for req in [r for r in self._row_of if r not in present]:
            row = self._row_of.pop(req)
            self._write(row, ())                       # zeros, as the general path pads: rows stay exact
            self._free_rows.append(row)
        for req in requests:
            if req not in self._row_of:
                if not self._free_rows:
                    self._grow(rows=len(self._written) * 2)
                self._row_of[req] = self._free_rows.pop()

    def _write(self, row: int, table: tuple[int, ...]) -> None:
        old = self._written[row]
        if len(table) > self.tables.shape[1]:
            self._grow(cols=max(len(table), 2 * self.tables.shape[1]))
        start = len(old) if table[:len(old)] == old else 0          # grown: only the new blocks
        self.tables[row, start:len(table)] = table[start:]
        if len(old) > len(table):
            self.tables[row, len(table):len(old)] = 0                # a shorter table than the row held
        self._written[row] = table

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        old = self.tables
        new = np.zeros((max(rows, old.shape[0]), max(cols, old.shape[1])), dtype=np.int32)
        new[:old.shape[0], :old.shape[1]] = old
        self._free_rows.extend(range(new.shape[0] - 1, old.shape[0] - 1, -1))
        self._written.extend([()] * (new.shape[0] - old.shape[0]))
        self.tables = new


class DecodeInputs:
    """The host tensors of a decode-only step, built from the persistent block tables."""

    def __init__(self) -> None:
        self.block_tables = PersistentBlockTables()

    def build(self, chunks: Sequence[ScheduledChunk], block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
        """input ids, positions, slot mapping, block tables [n, widest table], seq lens and query starts."""
        requests = [c.request for c in chunks]
        positions = [c.start for c in chunks]
        tables = [c.block_table for c in chunks]
        input_ids = [r.output_token_ids[p - len(r.prompt_token_ids)] for r, p in zip(requests, positions)]
        rows = np.array(self.block_tables.rows_for(requests, tables))
        pos = np.array(positions, dtype=np.int64)
        all_tables = self.block_tables.tables
        slots = all_tables[rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
        block_tables = all_tables[rows, :max(map(len, tables))]
        seq_lens = [p + 1 for p in positions]
        return (torch.tensor(input_ids, dtype=torch.int64), torch.from_numpy(pos), torch.from_numpy(slots),
                torch.from_numpy(block_tables), seq_lens, list(range(len(chunks) + 1)))
