"""One rank's share of the model, cut Megatron-style, and its forward pass.

Tensor parallelism (``tp`` ranks per stage) cuts every layer so that each rank needs only two sums per layer:

* ``qkv`` (q|k|v stacked) is **column-parallel by KV-head group**: rank r keeps the rows of its query heads
  and of the KV heads they read, so attention runs on each rank with no communication at all, and each
  rank's paged KV cache holds only its own KV heads (same block ids everywhere).
* ``o_proj`` is **row-parallel**: rank r keeps the columns that read its heads' outputs, so its matmul gives
  a partial sum of the full output; an all-reduce adds the partial sums.
* Biases on q, k and v (Qwen2) are cut with their rows, exactly as ``qkv``; a per-head q/k norm (Qwen3) is
  one weight of ``head_dim`` numbers that every head uses, so every rank keeps all of it.
* ``gate|up`` is column-parallel (each rank some of the MLP's columns, gate and up alike), ``down``
  row-parallel: one more all-reduce.
* The LM head is **vocab-parallel**: rank r computes the logits of its slice of the vocabulary; they are
  gathered to the stage's first rank. (The embedding is simply replicated on the first stage.)

Pipeline parallelism (``pp`` stages) gives each stage consecutive layers: the first stage embeds, the last
applies the final norm and the LM head, and hidden states travel stage to stage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..model.llama import AttentionMetadata, CompactLlama
from ..model.weights import LlamaLayerWeights

if TYPE_CHECKING:
    from ..model import LoadedModel
from .layout import ParallelLayout


def shard_rows(weight: torch.Tensor, num_parts: int, part: int) -> torch.Tensor:
    return weight.chunk(num_parts, dim=0)[part].clone()


def shard_columns(weight: torch.Tensor, num_parts: int, part: int) -> torch.Tensor:
    return weight.chunk(num_parts, dim=1)[part].clone()


def vocab_slice(vocab_size: int, num_parts: int, part: int) -> range:
    """Rows of the LM head for ``part``; the last parts are one row shorter when the vocabulary does not divide."""
    base, extra = divmod(vocab_size, num_parts)
    start = part * base + min(part, extra)
    return range(start, start + base + (1 if part < extra else 0))


def shard_qkv(qkv: torch.Tensor, full: CompactLlama, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s rows of stacked q|k|v weights (or biases): its query heads, then its KV heads' keys
    and values. Its query heads are exactly those that read its KV heads: heads come in contiguous groups."""
    d = full.head_dim
    q, k, v = qkv.split([full.num_heads * d, full.num_kv_heads * d, full.num_kv_heads * d])
    return torch.cat([shard_rows(q, tp, tp_rank), shard_rows(k, tp, tp_rank), shard_rows(v, tp, tp_rank)])


def shard_layer(w: LlamaLayerWeights, full: CompactLlama, tp: int, tp_rank: int) -> LlamaLayerWeights:
    gate, up = w.gate_up.chunk(2)
    return LlamaLayerWeights(
        input_norm=w.input_norm,
        qkv=shard_qkv(w.qkv, full, tp, tp_rank),
        o=shard_columns(w.o, tp, tp_rank),
        post_norm=w.post_norm,
        gate_up=torch.cat([shard_rows(gate, tp, tp_rank), shard_rows(up, tp, tp_rank)]),
        down=shard_columns(w.down, tp, tp_rank),
        qkv_bias=None if w.qkv_bias is None else shard_qkv(w.qkv_bias, full, tp, tp_rank),
        q_norm=w.q_norm, k_norm=w.k_norm)


class ShardedLlama(CompactLlama):
    """The slice of ``CompactLlama`` one rank holds. It reuses the whole model's layer loop (``run_layers``)
    with its own, smaller head counts and layers, and an all-reduce for the row-parallel sums."""

    def __init__(self, full: CompactLlama, layout: ParallelLayout, rank: int) -> None:   # noqa: super not called
        self.layout, self.rank = layout, rank
        self.stage, self.tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
        self.is_first_stage, self.is_last_stage = self.stage == 0, self.stage == layout.pp - 1
        tp = layout.tp
        self.config, self.eps, self.scale, self.head_dim = full.config, full.eps, full.scale, full.head_dim
        self.full_num_heads, self.full_num_kv_heads = full.num_heads, full.num_kv_heads
        self.num_heads, self.num_kv_heads = full.num_heads // tp, full.num_kv_heads // tp
        self.layer_ids = layout.layer_range(full.num_layers, self.stage)
        self.num_layers = len(self.layer_ids)
        self.layers = [shard_layer(full.layers[i], full, tp, self.tp_rank) for i in self.layer_ids]
        self.hidden_size = full.embed.shape[1]
        self.vocab_size = full.lm_head.shape[0]
        # Rank 0's embedding also tells the input processor the vocabulary size, so stage 0 keeps it.
        self.embed = full.embed if self.is_first_stage else None
        self.final_norm = full.final_norm
        self.vocab_rows = vocab_slice(self.vocab_size, tp, self.tp_rank)
        self.lm_head_rows = (full.lm_head[self.vocab_rows.start:self.vocab_rows.stop].clone()
                             if self.is_last_stage else None)
        self.inv_freq, self.rope_scaling = full.inv_freq, full.rope_scaling
        self.device, self.dtype = full.device, full.dtype
        self._cos: Optional[torch.Tensor] = None
        self._sin: Optional[torch.Tensor] = None

    def to_device(self, device: torch.device) -> "ShardedLlama":
        """Move this rank's weights, and only these, to ``device``. The whole model is loaded and cut on the
        CPU (``load_shard``), so a GPU never holds more than its rank's shard, even for a moment: that is what
        lets a model bigger than one device run split over several."""
        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device)

        self.layers = [LlamaLayerWeights(**{name: move(getattr(w, name)) for name in w.__dataclass_fields__})
                       for w in self.layers]
        self.embed, self.final_norm = move(self.embed), move(self.final_norm)
        self.lm_head_rows, self.inv_freq = move(self.lm_head_rows), move(self.inv_freq)
        self.device = torch.device(device)
        self._cos = self._sin = None
        return self

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_cache: torch.Tensor, logits_indices: torch.Tensor, hidden_in: Optional[torch.Tensor],
                      all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """This rank's part of one step: the hidden states for the next stage, or (last stage) this rank's
        slice of the logits, ``[len(logits_indices), len(vocab_rows)]``."""
        with torch.inference_mode():
            h = self.embed[input_ids] if self.is_first_stage else hidden_in
            h = self.run_layers(h, positions, meta, kv_cache, all_reduce)
            if not self.is_last_stage:
                return h
            return self.final_logits(h[logits_indices], self.lm_head_rows, meta.backend)


def load_shard(model: str, layout: ParallelLayout, rank: int, dtype: torch.dtype, device: torch.device,
               progress: Optional[Callable[[str], None]] = None) -> tuple[ShardedLlama, "LoadedModel"]:
    """Load the checkpoint on the CPU, cut out ``rank``'s shard, move only the shard to ``device``.

    Returns the shard and the loaded model's description with its weights dropped (``hf_model`` None), so
    nothing keeps the whole model alive once this returns."""
    from dataclasses import replace

    from ..model import CompactLlama, load_model

    loaded = load_model(model, dtype=dtype, device="cpu", progress=progress)
    full = CompactLlama(loaded.hf_model)
    layout.check(full.num_heads, full.num_kv_heads, full.layers[0].gate_up.shape[0] // 2, full.num_layers)
    shard = ShardedLlama(full, layout, rank).to_device(device)
    return shard, replace(loaded, hf_model=None)
