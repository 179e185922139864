"""A compact Llama forward pass over a flattened batch, reading and writing the paged KV cache.

There is no batch dimension and no padding: the step's scheduled tokens of all requests are laid end to
end (``input_ids[num_tokens]``, ``positions[num_tokens]``). Per-token work (norms, projections, MLP) runs
on the whole flat batch at once; only attention needs to know where one request ends and the next begins,
and it learns that from ``AttentionMetadata`` (block tables, sequence lengths, query offsets).

The weights are the tensors transformers loaded (shared, not copied), so the math is the same model; where
they come from and where they live (stacked, placed for the backend, int8) is weights.py, which
``CompactLlama`` inherits: this file is what the model computes with them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from minipaged.kernels import Backend
from minipaged.kernels.backends import TORCH_BACKEND
# The small ops' torch specification lives beside the kernels that replace it; re-exported for the model's readers.
from minipaged.kernels.torch_ops import (TORCH_LAYER_OPS, TorchLayerOps,  # noqa: F401
                                         apply_rope, rms_norm, vocab_sliced_linear)

from .families import family_of
from .weights import LlamaWeights


@dataclass
class AttentionMetadata:
    """Where each request's tokens are: built by the runner once per step, shared by every layer."""

    slot_mapping: torch.Tensor        # [num_tokens] cache slot of each new token (-1: already cached)
    block_tables: torch.Tensor        # [num_reqs, max_blocks]
    seq_lens: torch.Tensor            # [num_reqs] context length after this step
    query_start_loc: torch.Tensor     # [num_reqs + 1]
    host_seq_lens: list[int]
    host_query_start_loc: list[int]
    backend: Backend = TORCH_BACKEND  # the engine's: attention, linear layers and small ops all come from it
    all_slots_new: bool = False       # no slot is -1: nothing to skip when writing K/V


class CompactLlama(LlamaWeights):
    """Llama: embeddings, N x (RMSNorm, attention with RoPE + GQA, RMSNorm, SwiGLU MLP), RMSNorm, LM head.

    Mistral, Qwen2 and Qwen3 too: what their layers add (q/k/v biases, a q/k norm) is declared in
    ``families.py`` and collected as optional weights (weights.py) that the one layer loop applies when present."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        self.config = cfg
        self.family = family_of(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.take_weights(hf_model)         # weights.py: embedding, stacked layer matrices, norms, LM head
        # RoPE tables from transformers' own rotary module, so every rope_type (default, llama3, ...) matches.
        rotary = hf_model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self._cos: Optional[torch.Tensor] = None
        self._sin: Optional[torch.Tensor] = None          # signed: [-sin, sin] (see apply_rope)

    def _rope_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for every position up to ``max_position`` (grown by doubling, kept)."""
        if self._cos is None or self._cos.shape[0] < max_position:
            n = max(max_position, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            positions = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq.to(self.device)[None, :]
            self._cos = (torch.cat((freqs, freqs), dim=-1).cos() * self.rope_scaling).to(self.dtype)
            sin = freqs.sin() * self.rope_scaling
            self._sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return self._cos, self._sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Compute logits for the rows in ``logits_indices`` (the last token of each finished prefill/decode)."""
        h = self.run_layers(self.embed[input_ids], positions, meta, kv_cache)
        return self.final_logits(h[logits_indices], self.lm_head, meta.backend)

    def final_logits(self, h: torch.Tensor, lm_head: torch.Tensor, backend: Backend = TORCH_BACKEND) -> torch.Tensor:
        """The last norm and the LM head (or, under tensor parallelism, this rank's slice of its rows)."""
        x = rms_norm(h, self.final_norm, self.eps)
        return backend.lm_head(x, lm_head).float()

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                   all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Run the hidden states ``h`` through ``self.layers``; ``kv_cache`` holds exactly those layers.

        Under tensor parallelism (``minipaged.parallel``) each rank holds some of the heads and some of the MLP's
        columns, so ``o_proj`` and ``down`` produce partial sums: ``all_reduce`` adds them up over the ranks.
        With one rank it is None: the layer is whole and its output needs nothing.

        The residual stream is added to in place, so ``h`` becomes the output: callers pass a tensor made for
        this step and nothing else (an embedding lookup, or the hidden states a pipeline stage received).
        """
        # Every position is below its request's context length, known on the host: no device sync to size the
        # tables (a CUDA graph capture allows none, kernels/backends/cuda_graphs.py).
        cos_table, sin_table = self._rope_tables(max(meta.host_seq_lens, default=1))
        cos, sin = cos_table[positions], sin_table[positions]           # [T, head_dim]: this step's rows
        num_tokens = h.shape[0]
        reduce = all_reduce or (lambda partial: partial)
        # What attention needs to know about the step (which rows are decodes, their blocks, masks) is the
        # same for every layer: work it out once here, not 30 times.
        backend = meta.backend
        attention_plan = backend.plan(meta.block_tables, kv_cache.shape[3], meta.host_seq_lens,
                                      meta.host_query_start_loc)
        if all_reduce is None:
            # A step of a few decodes may run this whole loop as one compiled call (the cpu backend's
            # cpu_decode_layers.c, the CPU's CUDA graph: the same kernels, in this order): at batch 1 the loop's
            # ten calls a layer cost more than the math between them. Everything else runs the loop below.
            done = backend.decode_layers(self, h, cos, sin, meta, kv_cache, attention_plan)
            if done is not None:
                return done
        linear = backend.linear           # F.linear, or the compiled loop for a few rows where it is faster
        ops = backend.layer_ops           # norms, RoPE, SiLU: torch's, or compiled
        mlp_out = None              # each sublayer's output joins the residual stream inside the next norm
        for i, w in enumerate(self.layers):
            x = ops.add_rms_norm(h, mlp_out, w.input_norm, self.eps)
            qkv = linear(x, w.qkv)
            if w.qkv_bias is not None:                       # Qwen2
                qkv += w.qkv_bias
            if w.q_norm is not None:                         # Qwen3: each head normalised before RoPE
                norm_heads_(qkv, w.q_norm, w.k_norm, self.num_heads, self.num_kv_heads, self.head_dim, self.eps)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            # Write first, then read: a request may attend to blocks another request fills in this step.
            q = ops.rope_and_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                      self.num_kv_heads, all_slots_new=meta.all_slots_new)
            attn = backend.attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     self.scale, attention_plan)
            attn_out = reduce(linear(attn.reshape(num_tokens, self.num_heads * self.head_dim), w.o))
            x = ops.add_rms_norm(h, attn_out, w.post_norm, self.eps)
            mlp_out = reduce(linear(ops.silu_and_mul(linear(x, w.gate_up)), w.down))
        if mlp_out is not None:
            h += mlp_out
        return h


def norm_heads_(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                head_dim: int, eps: float) -> None:
    """Qwen3's per-head RMSNorm of the queries and keys, in place in ``qkv``, before RoPE rotates them.

    In place, so that what comes next (``rope_and_write_kv``, the torch one or the compiled one) reads the
    normalised q and k from ``qkv`` as if the projection had produced them: the layer ops need no variant."""
    tokens, q_width, k_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].view(tokens, num_heads, head_dim)
    k = qkv[:, q_width:q_width + k_width].view(tokens, num_kv_heads, head_dim)
    q.copy_(rms_norm(q, q_norm, eps))
    k.copy_(rms_norm(k, k_norm, eps))


CompactModel = CompactLlama      # every family in families.py runs through this one class
