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

import torch
import torch.nn.functional as F


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V in its slot (slot = block_id * block_size + offset; -1 = skip).

    A skipped slot is a token whose K/V is already in a shared cached block (a fully cached prompt
    recomputing its last token): it must not be written again.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), value)


def gather_request_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy one request's keys and values out of its blocks into contiguous [seq_len, kv_heads, dim] tensors."""
    block_size = k_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    keys = k_cache[blocks].flatten(0, 1)[:seq_len]
    values = v_cache[blocks].flatten(0, 1)[:seq_len]
    return keys, values


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


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, *,
                          host_seq_lens: list[int] | None = None,
                          host_query_start_loc: list[int] | None = None) -> torch.Tensor:
    """The same math, fast enough to serve on a CPU.

    Decodes (one query each) are batched: their blocks are gathered into one padded [batch, max_len] tensor
    and attended in a single ``scaled_dot_product_attention`` call. Each prefill chunk is attended on its own
    (padding a 2000-token prefill together with decodes would waste most of the work).
    ``host_*`` are the same numbers as Python lists, passed by the runner to avoid device->host syncs.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    seq_list = host_seq_lens if host_seq_lens is not None else seq_lens.tolist()
    starts = host_query_start_loc if host_query_start_loc is not None else query_start_loc.tolist()
    out = torch.empty_like(q)
    decodes = [i for i in range(len(seq_list)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        idx = torch.tensor(decodes, device=q.device)
        max_len = max(seq_list[i] for i in decodes)
        max_blocks = (max_len + block_size - 1) // block_size
        tables = block_tables[idx, :max_blocks].long()                        # [B, nb]
        keys = k_cache[tables].flatten(1, 2)[:, :max_len]                     # [B, L, kvh, d]
        values = v_cache[tables].flatten(1, 2)[:, :max_len]
        lens = torch.tensor([seq_list[i] for i in decodes], device=q.device)
        valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]   # [B, L]
        rows = torch.tensor([starts[i] for i in decodes], device=q.device)
        attn = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2),                                   # [B, H, 1, d]
            keys.transpose(1, 2), values.transpose(1, 2),           # [B, kvh, L, d]
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[rows] = attn.squeeze(2)
    for i, seq_len in enumerate(seq_list):
        qs, qe = starts[i], starts[i + 1]
        q_len = qe - qs
        if q_len <= 1:
            continue
        keys, values = gather_request_kv(k_cache, v_cache, block_tables[i], seq_len)
        if q_len == seq_len:
            mask = None                                             # a whole prompt: plain causal attention
        else:
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos
        attn = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[qs:qe] = attn.transpose(0, 1)
    return out
