"""A compact Llama forward pass over a flattened batch, reading and writing the paged KV cache.

There is no batch dimension and no padding: the step's scheduled tokens of all requests are laid end to
end (``input_ids[num_tokens]``, ``positions[num_tokens]``). Per-token work (norms, projections, MLP) runs
on the whole flat batch at once; only attention needs to know where one request ends and the next begins,
and it learns that from ``AttentionMetadata`` (block tables, sequence lengths, query offsets).

The weights are the tensors transformers loaded (shared, not copied), so the math is the same model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from minipaged.kernels import Backend, ModelShapes
from minipaged.kernels.backends import TORCH_BACKEND
from minipaged.kernels.int8 import Int8Weight, quantize_int8, stored_tensor, weight_bytes
# The small ops' torch specification lives beside the kernels that replace it; re-exported for the model's readers.
from minipaged.kernels.torch_ops import (TORCH_LAYER_OPS, TorchLayerOps,  # noqa: F401
                                         apply_rope, rms_norm, vocab_sliced_linear)

from .families import family_of


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
    # The engine's model-call hook (``Engine.before_model_call``): a backend whose step spends most of its time
    # in one call without Python's GIL runs it just before that call (see kernels/backends/base.py).
    before_model_call: Callable[[], None] = lambda: None


@dataclass
class LlamaLayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor                 # q, k and v projections stacked: one matmul instead of three
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor             # gate and up projections stacked
    down: torch.Tensor
    qkv_bias: Optional[torch.Tensor] = None   # q, k and v biases stacked like qkv (Qwen2)
    q_norm: Optional[torch.Tensor] = None     # [head_dim] RMSNorm weight of every query head (Qwen3)
    k_norm: Optional[torch.Tensor] = None     # [head_dim] the same for every key head


MATRICES = ("qkv", "o", "gate_up", "down")              # a layer's weight matrices, [out, in]


class CompactLlama:
    """Llama: embeddings, N x (RMSNorm, attention with RoPE + GQA, RMSNorm, SwiGLU MLP), RMSNorm, LM head.

    Mistral, Qwen2 and Qwen3 too: what their layers add (q/k/v biases, a q/k norm) is declared in
    ``families.py`` and collected here as optional weights that the one layer loop applies when present."""

    # "int8" once quantize_int8 ran (a class attribute: shards built without __init__ have it too)
    quantization: Optional[str] = None

    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        self.config = cfg
        self.family = family = family_of(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight.data
        self.final_norm = inner.norm.weight.data
        self.lm_head = hf_model.lm_head.weight.data       # the embedding itself when embeddings are tied
        self._hf_model = hf_model           # (pointed at the engine's weights by store_weights_for)
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            if any(getattr(proj, "bias", None) is not None for proj in (att.o_proj, mlp.gate_proj, mlp.down_proj)
                   + (() if family.qkv_bias else (att.q_proj,))):
                raise NotImplementedError(f"{family.model_type} with biases this family does not declare "
                                          "(families.py) is not supported yet.")
            self.layers.append(LlamaLayerWeights(
                input_norm=layer.input_layernorm.weight.data,
                qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach(),
                o=att.o_proj.weight.data,
                post_norm=layer.post_attention_layernorm.weight.data,
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                down=mlp.down_proj.weight.data,
                qkv_bias=torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]).detach()
                if family.qkv_bias else None,
                q_norm=att.q_norm.weight.data if family.qk_norm else None,
                k_norm=att.k_norm.weight.data if family.qk_norm else None))
        # RoPE tables from transformers' own rotary module, so every rope_type (default, llama3, ...) matches.
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self._cos: Optional[torch.Tensor] = None
        self._sin: Optional[torch.Tensor] = None          # signed: [-sin, sin] (see apply_rope)

    def quantize_int8(self) -> None:
        """Weight-only int8 (kernels/int8.py): every layer's matrices and the LM head become ``Int8Weight``; the
        embedding (a lookup of a few rows, not a matmul) and the norms stay fp32, as do activations and KV."""
        for w in self.layers:
            for name in MATRICES:
                setattr(w, name, quantize_int8(getattr(w, name)))
        self.lm_head = quantize_int8(self.lm_head)
        # The fp32 tensors kept become copies of their own: transformers' may be views into one storage over the
        # whole checkpoint file (memory-mapped), which would stay resident as long as any view of it lives.
        self.embed, self.final_norm = self.embed.clone(), self.final_norm.clone()
        for w in self.layers:
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):      # (qkv_bias is a new tensor already)
                if getattr(w, name) is not None:
                    setattr(w, name, getattr(w, name).clone())
        self._hf_model = None          # transformers' module holds the fp32 matrices: let them go with it
        self.quantization = "int8"

    def _is_the_embedding(self, weight: object) -> bool:
        """Whether ``weight`` is the embedding's memory: a tied LM head (or its placed copy) is."""
        return (isinstance(weight, torch.Tensor) and self.embed is not None
                and weight.data_ptr() == self.embed.data_ptr())

    def weight_bytes(self) -> int:
        """Bytes of the weights this model computes with (a tied LM head counted once)."""
        lm_head = getattr(self, "lm_head", None)
        if lm_head is None:                                   # a tensor-parallel shard holds its rows of it
            lm_head = getattr(self, "lm_head_rows", None)
        tensors = [self.embed, self.final_norm] + ([] if self._is_the_embedding(lm_head) else [lm_head])
        tensors += [t for w in self.layers for t in (w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down,
                                                      w.qkv_bias, w.q_norm, w.k_norm)]
        return sum(weight_bytes(t) for t in tensors if t is not None)

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

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device=None,
                          backend: Backend = TORCH_BACKEND) -> torch.Tensor:
        """One tensor for the whole pool: [layers, 2 (K and V), num_blocks, block_size, kv_heads, head_dim],
        in the memory ``backend`` allocates (on a Linux CPU, memory that may be backed by huge pages)."""
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return backend.allocate_kv_pool(shape, self.dtype, torch.device(device or self.device))

    def shapes(self) -> ModelShapes:
        """The sizes a backend builds and measures its code for."""
        return ModelShapes(hidden_size=self.config.hidden_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, intermediate_size=self.layers[0].gate_up.shape[0] // 2,
                           vocab_size=self.config.vocab_size)

    def store_weights_for(self, backend: Backend) -> None:
        """Keep each layer's matrices and the LM head in the layout and the memory ``backend`` computes with
        fastest: laid out by ``prepare_weight``, then placed by its ``weight_placer`` (on a CPU, one buffer on
        huge pages), int8 values included. One weight at a time, transformers' module pointed at each copy as it
        is made (``_share_with_transformers``), so that the original can go at once: no weight is held twice,
        not even while they are being placed."""
        head_name = "lm_head" if getattr(self, "lm_head", None) is not None else "lm_head_rows"  # (a TP shard's)
        slots = [(w, name) for w in self.layers for name in MATRICES]
        if getattr(self, head_name, None) is not None:          # (a pipeline stage before the last has none)
            slots.append((self, head_name))
        place = backend.weight_placer([stored_tensor(getattr(owner, name)).nbytes for owner, name in slots],
                                      self.device)
        hf = getattr(self, "_hf_model", None)
        hf_layers = dict(zip(map(id, self.layers), hf.model.layers)) if hf is not None else {}
        for owner, name in slots:
            original = getattr(owner, name)
            laid_out = original if owner is self else backend.prepare_weight(original)
            new = place(stored_tensor(laid_out))
            if isinstance(original, Int8Weight):
                new = Int8Weight(new, original.scale)
            elif owner is self and self._is_the_embedding(original):
                self.embed = new                                 # tied embeddings: the lookup reads it too
            setattr(owner, name, new)
            if hf is not None and not isinstance(new, Int8Weight):
                self._share_with_transformers(hf, hf_layers.get(id(owner)), name, new)
            del original, laid_out
        if hf is not None:
            self._share_norms_with_transformers(hf)

    def _share_with_transformers(self, hf_model: torch.nn.Module, hf_layer: Optional[torch.nn.Module], name: str,
                                 weight: torch.Tensor) -> None:
        """Point transformers' parameters (kept beside the engine as the reference it is checked against) at the
        engine's copy of one weight: q, k and v at rows of the stacked q|k|v, gate and up at rows of gate|up.

        Why: transformers' tensors are views of the checkpoint file, memory-mapped (or copies of their own,
        from a GGUF file); with every view gone the file is unmapped, and the process holds each weight once.
        Measured on the CI machine (SmolLM2, fp32, a 0.25 GiB KV pool, after one request): resident 1,492 MiB
        (813 anonymous, 679 of mapped files) before the weights moved to one buffer and transformers was
        pointed at it, 1,252 MiB after (1,086 anonymous, 166 mapped: the libraries)."""
        if hf_layer is None:                                     # the LM head (and the embedding, when tied)
            hf_model.lm_head.weight.data = weight
            if self._is_the_embedding(weight):
                hf_model.model.embed_tokens.weight.data = weight
            return
        att, mlp = hf_layer.self_attn, hf_layer.mlp
        if name in ("o", "down"):
            (att.o_proj if name == "o" else mlp.down_proj).weight.data = weight
        else:
            projections = (att.q_proj, att.k_proj, att.v_proj) if name == "qkv" else (mlp.gate_proj, mlp.up_proj)
            point_at_rows([proj.weight for proj in projections], weight)

    def _share_norms_with_transformers(self, hf_model: torch.nn.Module) -> None:
        """The small tensors last: norms (and Qwen2's q/k/v biases) become copies both share, and an untied
        embedding a copy of its own, so that nothing of transformers' still views the checkpoint file."""
        inner = hf_model.model
        for w, layer in zip(self.layers, inner.layers):
            att = layer.self_attn
            pairs = [("input_norm", layer.input_layernorm), ("post_norm", layer.post_attention_layernorm)]
            if w.q_norm is not None:
                pairs += [("q_norm", att.q_norm), ("k_norm", att.k_norm)]
            for name, module in pairs:
                setattr(w, name, getattr(w, name).clone())
                module.weight.data = getattr(w, name)
            if w.qkv_bias is not None:
                point_at_rows([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias], w.qkv_bias)
        self.final_norm = self.final_norm.clone()
        inner.norm.weight.data = self.final_norm
        if not self._is_the_embedding(self.lm_head):                  # untied: the embedding becomes a copy
            self.embed = self.embed.clone()
            inner.embed_tokens.weight.data = self.embed

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

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


def point_at_rows(parameters: list[torch.nn.Parameter], stacked: torch.Tensor) -> None:
    """Point each of ``parameters`` at its rows of ``stacked`` (the tensors were stacked in this order, as
    q|k|v and gate|up are), so that both share one copy."""
    start = 0
    for parameter in parameters:
        rows = parameter.shape[0]
        parameter.data = stacked[start:start + rows]
        start += rows


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
