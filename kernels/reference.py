"""PagedAttention in plain torch: the specification the Triton kernel must match, and the CPU path.

Shapes (one layer):
    q            [num_tokens, num_heads, head_dim]    all scheduled query tokens of all requests, flattened
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
    block_tables [num_reqs, max_blocks_per_req] int32  block ids of each request, in order (padding: any id)
    seq_lens     [num_reqs] int32                       context length of each request *including* its queries
    query_start_loc [num_reqs + 1] int32                request i owns q rows query_start_loc[i]:query_start_loc[i+1]

Request i's queries are the *last* ``q_len`` tokens of its ``seq_len`` tokens, so query j (0-based within the
request) sits at position ``seq_len - q_len + j`` and may attend to keys 0..that position (causal). A decode
is the case q_len == 1; a prefill chunk has q_len > 1 and attends to its cached context plus itself.

Token t of a request lives in block ``block_tables[i, t // block_size]`` at offset ``t % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, all_slots_new: bool = False) -> None:
    """Store each new token's K and V in its slot (slot = block_id * block_size + offset; -1 = skip).

    A skipped slot is a token whose K/V is already in a shared cached block (a fully cached prompt
    recomputing its last token): it must not be written again. ``all_slots_new`` says there is none.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = None if all_slots_new else slot_mapping >= 0
    if keep is not None and not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), value)


def gather_request_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy one request's keys and values out of its blocks into contiguous [seq_len, kv_heads, dim] tensors."""
    block_size = k_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks]
    return gather_blocks(k_cache, blocks)[:seq_len], gather_blocks(v_cache, blocks)[:seq_len]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The tokens of ``block_ids`` (any shape) laid end to end: [*block_ids.shape[:-1], n * block_size, ...].

    ``index_select`` on the block dimension copies whole blocks with one memcpy each; the same gather
    written ``cache[block_ids]`` (advanced indexing) is about 3x slower on a CPU, and on a decode step it
    runs twice per layer.
    """
    picked = cache.index_select(0, block_ids.reshape(-1).long())          # [N, block_size, kv_heads, dim]
    return picked.view(*block_ids.shape[:-1], block_ids.shape[-1] * cache.shape[1], *cache.shape[2:])


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """The readable specification: one request at a time, softmax in fp32, explicit causal mask."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = starts[i], starts[i + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        keys, values = gather_request_kv(k_cache, v_cache, block_tables[i], seq_len)
        keys = keys.repeat_interleave(group, dim=1).float()        # [seq, heads, dim]
        values = values.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
    return out


# (queries [num_decodes, heads, dim], k_cache, v_cache, block_tables, seq_lens, scale) -> [num_decodes, heads, dim]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                           torch.Tensor]


@dataclass
class PrefillChunkPlan:
    """One request's multi-token chunk: its query rows, its context length, its blocks and its causal mask."""

    query_start: int
    query_end: int
    seq_len: int
    blocks: torch.Tensor                    # the block ids holding its seq_len tokens
    mask: Optional[torch.Tensor]            # [q_len, seq_len] True = may attend; None: a whole prompt (is_causal)


@dataclass
class TorchAttentionPlan:
    """Everything ``paged_attention_torch`` derives from the step's metadata alone.

    It is the same for every layer, so the model works it out once per step (``plan_torch_attention``) and
    hands it to all of them: per layer only the gathers and the attention itself remain. For SmolLM2 that
    is 30 times fewer small tensors built from Python lists on every decode step.
    """

    num_decodes: int                        # decode rows (a verification's few rows count one each)
    decode_rows: Optional[torch.Tensor]     # q rows of the decodes; None: every row is a decode, in order
    decode_tables: Optional[torch.Tensor]   # [num_decodes, blocks of the longest]
    decode_len: int                         # the longest decode context: keys are padded to it
    decode_mask: Optional[torch.Tensor]     # [num_decodes, 1, 1, decode_len]; None: every context that long
    prefills: list[PrefillChunkPlan]
    decode_seq_lens: Optional[torch.Tensor] = None   # [num_decodes] int64: each decode's own context length
    decode_indices_checked: bool = False    # a kernel that trusts its indices has checked them (first layer)


def plan_torch_attention(block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
                         host_query_start_loc: list[int], few_row_chunks: int = 1) -> TorchAttentionPlan:
    """Split the step into decodes (one query each, batched into one padded attention call) and prefill
    chunks (attended one by one: padding a 2000-token prefill together with decodes would waste most of the
    work), and build the index tensors and masks each part needs.

    ``few_row_chunks``: a request with up to this many query rows (a speculative verification's k + 1: the last
    token and its drafts) is attended as that many decodes, row j seeing its context up to its own position
    (``seq_len - q_len + j + 1`` keys: the causal mask, row by row). The keys of the rows before it are already
    in the cache (every layer writes the step's K/V before it attends), so a kernel made for one query a row
    verifies at a decode's cost, and a step of nothing but such rows is a decode step (the cpu backend's
    compiled layer loop). 1: only true decodes (the torch backend's plan)."""
    device = block_tables.device
    seq_list, starts = host_seq_lens, host_query_start_loc
    # Each decode row, in row order: (its request, its row in the step, its own context length).
    decodes = [(i, starts[i] + j, seq_list[i] - (starts[i + 1] - starts[i]) + j + 1)
               for i in range(len(seq_list)) if 1 <= starts[i + 1] - starts[i] <= few_row_chunks
               for j in range(starts[i + 1] - starts[i])]
    rows = tables = mask = decode_seq_lens = None
    decode_len = max((n for _i, _row, n in decodes), default=0)
    if decodes:
        owners, lens = [i for i, _row, _n in decodes], [n for _i, _row, n in decodes]
        if len(decodes) != starts[-1]:                 # not every row is a decode: say which ones are
            rows = torch.tensor([row for _i, row, _n in decodes], device=device)
        max_blocks = (decode_len + block_size - 1) // block_size
        one_each = owners == list(range(len(seq_list)))     # row r is request r's query (the usual decode step)
        picked = block_tables if one_each else block_tables[torch.tensor(owners, device=device)]
        blocks_owned = [(n + block_size - 1) // block_size for n in lens]
        tables = picked[:, :max_blocks].long()                             # int64: index_select's own type
        if min(blocks_owned) < max_blocks:
            # A shorter context's table ends in padding, which may be any id (-1, say): read block 0 there
            # instead; the mask hides it. (One request alone, the usual decode on a laptop, has none.)
            owned = torch.tensor(blocks_owned, device=device)
            tables = tables.masked_fill(torch.arange(max_blocks, device=device) >= owned[:, None], 0)
        decode_seq_lens = torch.tensor(lens, device=device)
        if min(lens) < decode_len:                      # shorter contexts must not see the padding
            valid = torch.arange(decode_len, device=device)[None, :] < decode_seq_lens[:, None]
            mask = valid[:, None, None, :]
    prefills = []
    for i, seq_len in enumerate(seq_list):
        qs, qe = starts[i], starts[i + 1]
        q_len = qe - qs
        if q_len <= max(1, few_row_chunks):
            continue
        chunk_mask = None                               # a whole prompt: plain causal attention
        if q_len != seq_len:                            # a later chunk also sees the cached tokens before it
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
            chunk_mask = torch.arange(seq_len, device=device)[None, :] <= query_pos
        num_blocks = (seq_len + block_size - 1) // block_size
        prefills.append(PrefillChunkPlan(qs, qe, seq_len, block_tables[i, :num_blocks].long(), chunk_mask))
    return TorchAttentionPlan(len(decodes), rows, tables, decode_len, mask, prefills, decode_seq_lens)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, *,
                          host_seq_lens: list[int] | None = None,
                          host_query_start_loc: list[int] | None = None,
                          plan: TorchAttentionPlan | None = None,
                          decode_attention: Optional[DecodeAttention] = None) -> torch.Tensor:
    """The same math, fast enough to serve on a CPU.

    Decodes (one query each) are batched: their blocks are gathered into one padded [batch, max_len] tensor
    and attended in a single ``scaled_dot_product_attention`` call. Each prefill chunk is attended on its own.
    ``host_*`` are the same numbers as Python lists, passed by the runner to avoid device->host syncs;
    ``plan`` is what ``plan_torch_attention`` makes of them (the model makes it once per step).
    ``decode_attention``: a kernel that attends the decodes straight from their blocks (the compiled CPU
    kernel) instead of the gather and ``scaled_dot_product_attention``.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    if plan is None:
        seq_list = host_seq_lens if host_seq_lens is not None else seq_lens.tolist()
        starts = host_query_start_loc if host_query_start_loc is not None else query_start_loc.tolist()
        plan = plan_torch_attention(block_tables, k_cache.shape[1], seq_list, starts)
    out = torch.empty_like(q)
    if plan.num_decodes and decode_attention is not None:
        queries = q if plan.decode_rows is None else q[plan.decode_rows]
        attn = decode_attention(queries, k_cache, v_cache, plan.decode_tables, plan.decode_seq_lens, scale)
        if plan.decode_rows is None:
            out = attn
        else:
            out[plan.decode_rows] = attn
    elif plan.num_decodes:
        keys = gather_blocks(k_cache, plan.decode_tables)[:, :plan.decode_len]      # [B, L, kvh, d]
        values = gather_blocks(v_cache, plan.decode_tables)[:, :plan.decode_len]
        queries = q if plan.decode_rows is None else q[plan.decode_rows]
        attn = F.scaled_dot_product_attention(
            queries.unsqueeze(2),                                   # [B, H, 1, d]
            keys.transpose(1, 2), values.transpose(1, 2),           # [B, kvh, L, d]
            attn_mask=plan.decode_mask, scale=scale, enable_gqa=gqa).squeeze(2)
        if plan.decode_rows is None:
            out = attn
        else:
            out[plan.decode_rows] = attn
    for chunk in plan.prefills:
        keys = gather_blocks(k_cache, chunk.blocks)[:chunk.seq_len]
        values = gather_blocks(v_cache, chunk.blocks)[:chunk.seq_len]
        # 4-D inputs (a batch of one): with 3-D ones torch falls back from its flash kernel to the math path,
        # which builds the whole [heads, q_len, seq_len] score matrix.
        attn = F.scaled_dot_product_attention(
            q[chunk.query_start:chunk.query_end].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=gqa)
        out[chunk.query_start:chunk.query_end] = attn.squeeze(0).transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------------------------
# A layer's small operations, written as transformers writes them (LlamaRMSNorm, rotate_half, LlamaMLP's act):
# the specification of the fused kernels (kernels/triton_layer_ops.py) and of TorchLayerOps' shorter spellings
# (kernels/torch_ops.py: RoPE through ``roll`` with the sign kept in the sine table). Slow and plain on purpose.
# ---------------------------------------------------------------------------------------------------------------
def add_rms_norm_reference(residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual stream after adding ``delta``, its RMSNorm): LlamaRMSNorm in fp32, cast back, times weight."""
    residual = residual if delta is None else residual + delta
    x = residual.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return residual, weight * normed.to(residual.dtype)


def rope_and_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                                num_kv_heads: int) -> torch.Tensor:
    """Rotary embedding in transformers' rotate-half form on the queries and keys of ``qkv`` ([tokens,
    (heads + 2 kv_heads) * head_dim]); keys and values written to their slots (-1: skip); the queries returned.
    ``cos`` is [tokens, head_dim]; ``sin`` the *signed* table minipaged keeps ([-sin, sin] halves, as
    ``apply_rope`` takes it): the plain sine is its second half, twice."""
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    half = head_dim // 2
    plain_sin = torch.cat([sin[:, half:], sin[:, half:]], dim=-1)[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def rope(x: torch.Tensor) -> torch.Tensor:
        return x * cos[:, None, :] + rotate_half(x) * plain_sin

    q_width, k_width = num_heads * head_dim, num_kv_heads * head_dim
    q = rope(qkv[:, :q_width].reshape(tokens, num_heads, head_dim))
    k = rope(qkv[:, q_width:q_width + k_width].reshape(tokens, num_kv_heads, head_dim))
    v = qkv[:, q_width + k_width:].reshape(tokens, num_kv_heads, head_dim)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's act_fn(gate) * up, from the stacked gate|up projection's output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: each row's first index of its maximum."""
    return torch.argmax(logits, dim=-1)
