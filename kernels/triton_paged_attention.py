"""PagedAttention in Triton: one kernel that serves a whole mixed batch (prefill chunks and decodes).

The math is exactly ``paged_attention_reference`` (see ``reference.py`` for shapes); this file is about *how*
to do it fast on a GPU. Four ideas, each explained where the code uses it:

1. **Block tables.** A request's K/V is not contiguous: token ``t`` lives in physical block
   ``block_tables[req, t // block_size]`` at row ``t % block_size``. The kernel does this lookup per key
   token while loading, so a tile of ``TILE_N`` keys may span several blocks (or part of one) and the
   engine can place blocks anywhere in the pool.
2. **Online softmax** (FlashAttention). We never build the ``[q, seq_len]`` score matrix. Keys are visited
   one tile at a time while keeping, per query row, the running max ``m``, the running sum of
   exponentials ``l`` and the running (unnormalised) output ``acc``, all in fp32. When a new tile raises the
   max, the old ``l`` and ``acc`` are rescaled by ``exp(m_old - m_new)``. Divide ``acc`` by ``l`` at the end.
3. **GQA grouping.** ``num_heads // num_kv_heads`` query heads share one KV head. A program owns one KV
   head and *all* query heads of its group, so every K/V tile is loaded once and used by the whole group
   (for a decode that is the difference between reading the cache once or ``group`` times).
4. **Split-K / flash-decoding.** A decode has one query: with a small batch there are only
   ``batch * num_kv_heads`` programs, far fewer than an H100 has SMs (132), and each walks a long
   context alone. So the context is cut into ``num_splits`` slices handled by different programs; each
   writes a partial output plus its log-sum-exp, and a second small kernel merges the slices.

How programs map to work (grid axis 0):
- decode-only batch: one program per request (``BLOCK_Q == 1``).
- mixed batch: the queries of each request are cut into tiles of ``BLOCK_Q`` tokens. Tile slots are
  numbered so that request ``i``'s first tile is ``query_start_loc[i] // BLOCK_Q + i``; that formula needs
  no host-side bookkeeping (no device->host sync), leaves at least ``cdiv(q_len, BLOCK_Q)`` slots per
  request, and a program finds its request by binary search over ``query_start_loc``. Spare slots exit at
  once. (The same trick is used by vLLM's unified attention kernel.)

Running on CPU: tensors on the CPU run through Triton's interpreter (slow, for tests), which is allowed
only when ``TRITON_INTERPRET=1`` is set. CUDA tensors always run the compiled kernel, even when that
variable is set, so interpreter tests and GPU tests can share one pytest process.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = ["paged_attention_triton", "write_kv_cache_triton", "choose_num_splits", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_DTYPES"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256     # a split shorter than this costs more in the reduce than it saves
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------------
# Kernel 1: attention over the paged cache (optionally one slice of the context per program).
# These are plain functions; they are wrapped below as compiled (CUDA) and interpreted (CPU) kernels.
# --------------------------------------------------------------------------------------------------------
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    lse_ws_ptr, out_ws_ptr,                      # split-K workspace; unused when NUM_SPLITS == 1
    scale_log2,                                  # softmax scale * log2(e): we use exp2, which is cheaper
    num_reqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_btr, stride_btc,
    GROUP: tl.constexpr,          # query heads per KV head
    GROUP_PAD: tl.constexpr,      # GROUP rounded up to a power of two (tl.arange needs one)
    BLOCK_Q: tl.constexpr,        # query tokens per program
    BLOCK_M: tl.constexpr,        # rows per program = BLOCK_Q * GROUP_PAD, at least 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,     # tokens per KV-cache block
    TILE_N: tl.constexpr,         # key tokens per loop iteration (may span several blocks)
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,    # every request has q_len <= 1: program id == request id
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), else "tf32" (ignored for 16-bit)
    UPCAST: tl.constexpr,         # interpreter + bf16 only: its tl.dot cannot multiply bf16, so use fp32
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    # ---- which request and which tile of its queries is ours? ------------------------------------------
    if DECODE_ONLY:
        req = tile_id
        q_tile = 0
    else:
        # Largest req with first_tile(req) = query_start_loc[req] // BLOCK_Q + req <= tile_id.
        lo = tile_id * 0
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            if first_tile <= tile_id:
                lo = mid
            else:
                hi = mid - 1
        req = lo
        q_tile = tile_id - (tl.load(query_start_loc_ptr + req).to(tl.int32) // BLOCK_Q + req)

    q_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return                                  # a spare tile slot (or a request with no queries)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context_len = seq_len - q_len               # tokens already cached before this request's queries

    # ---- load our queries: rows are (query token, head in group) pairs -----------------------------------
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD          # query index within the request
    head_in_group = rows % GROUP_PAD
    row_valid = (rows // GROUP_PAD < BLOCK_Q) & (q_idx < q_len) & (head_in_group < GROUP)
    q_pos = context_len + q_idx                           # absolute position: attends to keys 0..q_pos
    token = (q_start + q_idx).to(tl.int64)                # row of q / out
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # ---- which keys: everything up to our last query (causal), or one slice of that for split-K -----------
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end, TILE_N), NUM_SPLITS)
        kv_lo = split * tiles_per_split * TILE_N
        kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * TILE_N)
    else:
        kv_lo = 0
        kv_hi = kv_end

    # ---- online softmax over key tiles (state in fp32; scores in log2 units) ------------------------------
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max of scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)       # running sum of exp2(score - m_i) * v
    block_table = block_tables_ptr + req.to(tl.int64) * stride_btr
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + offs_n                              # absolute key positions of this tile
        in_range = pos < kv_hi
        # The block-table lookup: logical position -> (physical block, row inside it).
        block_id = tl.load(block_table + (pos // BLOCK_SIZE) * stride_btc, mask=in_range, other=0).to(tl.int64)
        row_in_block = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block_id[:, None] * stride_kb + row_in_block[:, None] * stride_ko
                    + kv_head * stride_kh + dims[None, :] * stride_kd, mask=in_range[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2     # [BLOCK_M, TILE_N]
        s = tl.where((pos[None, :] <= q_pos[:, None]) & in_range[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no allowed key in this tile (or this whole split): keep it finite so that
        # exp2(-inf - -inf) never produces NaN. Its p and alpha are then exactly 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)                     # rescales what we summed under the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block_id[:, None] * stride_vb + row_in_block[:, None] * stride_vo
                    + kv_head * stride_vh + dims[None, :] * stride_vd, mask=in_range[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if NUM_SPLITS == 1:
        o = acc / l_safe[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Partial result of this slice: normalised output and log2-sum-exp2 of its scores. An empty slice
        # reports lse = -inf, which gives it weight 0 in the reduce.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        ws_row = (token * num_heads + head) * NUM_SPLITS + split               # [num_tokens, heads, splits]
        tl.store(lse_ws_ptr + ws_row, lse, mask=row_valid)
        tl.store(out_ws_ptr + ws_row[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None],
                 mask=row_valid[:, None])


# --------------------------------------------------------------------------------------------------------
# Kernel 2: merge the split-K slices.
# Slice s computed o_s = softmax over its keys, and lse_s = log2(sum of exp2(scores) over its keys).
# The full softmax weights slice s by exp2(lse_s) / sum_t exp2(lse_t); subtract the max lse first so that
# nothing overflows: out = sum_s w_s * o_s / sum_s w_s with w_s = exp2(lse_s - max lse).
# --------------------------------------------------------------------------------------------------------
def _split_reduce_kernel(
    out_ptr, lse_ws_ptr, out_ws_ptr,
    stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * tl.num_programs(1) + head
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(lse_ws_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    o = tl.load(out_ws_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                mask=split_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    merged = tl.sum(w[:, None] * o, 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
             merged.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------------------
# Kernel 3: write new K/V into their cache slots.
# --------------------------------------------------------------------------------------------------------
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)                     # one program per new token, all its KV heads
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return                                            # already in a shared cached block: skip
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < num_kv_heads)[:, None]
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kco + heads[:, None] * stride_kch
             + dims[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vco + heads[:, None] * stride_vch
             + dims[None, :] * stride_vcd, v, mask=mask)


# --------------------------------------------------------------------------------------------------------
# Compiled vs interpreted kernels.
# ``@triton.jit`` decides once, at import, from TRITON_INTERPRET. We instead build both flavours lazily and
# pick per call from the tensors' device, so one process can run CPU (interpreter) and CUDA (compiled) calls.
# --------------------------------------------------------------------------------------------------------
# Scalars that change every step: don't let Triton compile a special variant when one happens to equal 1.
_DO_NOT_SPECIALIZE = {"_paged_attention_kernel": ["num_reqs"], "_write_kv_kernel": ["num_kv_heads"]}


@functools.lru_cache(maxsize=None)
def _kernel(fn: Callable[..., Any], interpreted: bool) -> Any:
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(fn)
    return JITFunction(fn, do_not_specialize=_DO_NOT_SPECIALIZE.get(fn.__name__))


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(*tensors: torch.Tensor) -> bool:
    """Return True when the call must use the interpreter (CPU tensors); raise on unusable devices."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; got {device} and {t.device}")
    if device.type == "cuda":
        return False
    if device.type == "cpu" and _interpreter_enabled():
        return True
    raise ValueError(
        f"the Triton kernels need CUDA tensors (got {device.type}); CPU tensors work only in Triton's "
        "interpreter (set TRITON_INTERPRET=1, slow, for tests). Use backend='torch' for the CPU path.")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, max_query_len: int,
                      num_sms: int) -> int:
    """How many context slices each (request, KV head) gets.

    Only decode batches split: a prefill chunk already brings many query tiles (programs) of its own.
    Aim for about two programs per SM, but never cut slices shorter than MIN_TOKENS_PER_SPLIT tokens
    (short slices make the second kernel's merge cost more than the extra parallelism saves).
    """
    if max_query_len > 1:
        return 1
    programs = max(1, num_reqs * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms, programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(wanted, by_length, MAX_SPLITS)))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _validate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim]; got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    head_dim = q.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton kernel; supported: "
                         f"{SUPPORTED_HEAD_DIMS} (use backend='torch' for others)")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the KV cache has {k_cache.shape[3]}")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) "
                         "(grouped-query attention)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; supported: float16, bfloat16, float32")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q is {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; "
                         "all three must match")
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,) or block_tables.dim() != 2 \
            or block_tables.shape[0] != num_reqs:
        raise ValueError("expected seq_lens [num_reqs], query_start_loc [num_reqs + 1] and block_tables "
                         f"[num_reqs, max_blocks]; got {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}, "
                         f"{tuple(block_tables.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, *, max_query_len: int | None = None, max_seq_len: int | None = None,
                           num_splits: int | None = None, tile_n: int | None = None) -> torch.Tensor:
    """Attention of every query token in ``q`` over its request's paged K/V (same result as the reference).

    ``max_query_len`` / ``max_seq_len`` are the largest q_len / seq_len in the batch. The engine knows them
    on the host; pass them to avoid a device->host sync (without them they are read from the tensors).
    ``num_splits`` forces the split-K factor (default: ``choose_num_splits``; decode batches only).
    ``tile_n`` overrides how many key tokens one loop iteration handles (a power of two, >= 16).
    """
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    interpreted = _check_device(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_reqs == 0:
        return out

    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    decode_only = max_query_len == 1
    fp32 = q.dtype == torch.float32
    if decode_only:
        block_q = 1
    else:
        # ~64 rows per program (fp32: 32, its exact "ieee" dots need more registers): with group 8 that is
        # 8 query tokens x 8 heads. Short chunks (e.g. 2-4 tokens) get smaller tiles, wasting fewer rows.
        rows_target = 32 if fp32 else 64
        block_q = max(1, min(rows_target // group_pad, _next_pow2(max_query_len)))
    block_m = max(16, block_q * group_pad)
    if tile_n is None:
        # Register budget: the [BLOCK_M, TILE_N] scores and the [BLOCK_M, HEAD_DIM] accumulator live in
        # registers. Decodes (16 rows) afford wide key tiles, which keep more loads in flight.
        # (Checked by compiling for sm_90 with Triton 3.9: these sizes do not spill.)
        if block_m <= 16:
            tile_n = 64
        elif fp32:
            tile_n = 16 if head_dim > 64 else 32
        else:
            tile_n = 32 if head_dim > 64 else 64
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16; got {tile_n}")

    if num_splits is None:
        if decode_only:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            sms = 4 if interpreted else _num_sms(q.device.index if q.device.index is not None
                                                  else torch.cuda.current_device())
            num_splits = choose_num_splits(num_reqs, num_kv_heads, max_seq_len, max_query_len, sms)
        else:
            num_splits = 1
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in 1..1024; got {num_splits}")

    if decode_only:
        num_q_tiles = num_reqs
    else:
        num_q_tiles = num_tokens // block_q + num_reqs
    if num_splits > 1:
        lse_ws = torch.empty((num_tokens, num_heads, num_splits), device=q.device, dtype=torch.float32)
        out_ws = torch.empty((num_tokens, num_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
    else:
        lse_ws = out_ws = out                     # never touched; any pointer will do

    grid = (num_q_tiles, num_kv_heads, num_splits)
    _kernel(_paged_attention_kernel, interpreted)[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, lse_ws, out_ws,
        float(scale) * LOG2E, num_reqs,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits, DECODE_ONLY=decode_only,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        # Triton's interpreter stores bf16 as raw uint16 and its tl.dot multiplies those bit patterns
        # (triton-lang/triton#11584): compute the dots in fp32 there. Compiled kernels use bf16 tensor cores.
        UPCAST=interpreted and q.dtype == torch.bfloat16,
        # Decodes are pure memory streaming: a deeper cp.async pipeline keeps more K/V bytes in flight.
        num_warps=4, num_stages=3 if decode_only else 2,
    )
    if num_splits > 1:
        _kernel(_split_reduce_kernel, interpreted)[(num_tokens, num_heads)](
            out, lse_ws, out_ws, *out.stride(),
            NUM_SPLITS=num_splits, SPLITS_PAD=_next_pow2(num_splits), HEAD_DIM=head_dim, num_warps=4,
        )
    return out


def write_kv_cache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V in its slot (slot = block_id * block_size + offset; -1 = skip).

    Same semantics as ``reference.write_kv_cache``; one program per token copies all its KV heads.
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    expected = (key.shape[0], num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(f"key and value must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}]; "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not supported; it must be a power of two, e.g. "
                         f"{SUPPORTED_HEAD_DIMS}")
    if len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"dtype mismatch: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}; all four must match")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0] \
            or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [num_tokens={key.shape[0]}]; "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    interpreted = _check_device(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    _kernel(_write_kv_kernel, interpreted)[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_SIZE=block_size, HEADS_PAD=_next_pow2(num_kv_heads), HEAD_DIM=head_dim, num_warps=1,
    )
