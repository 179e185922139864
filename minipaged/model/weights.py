"""The model's weights: taken from transformers' module, stacked the way the forward pass multiplies them,
placed in the layout and memory the engine's backend computes with fastest, and optionally made int8.

Kept apart from the forward pass (llama.py), which only reads the tensors this file leaves in ``self.layers``,
``self.embed``, ``self.final_norm`` and ``self.lm_head``: a student reading what the model computes need not
read where each tensor came from and where it lives, and this file can change how weights are placed (huge
pages, a layout a kernel prefers, memory shared with transformers' reference module) without touching the math.
The KV pool's shape is here too: like the weights, it is memory sized by the model and allocated by the backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from minipaged.kernels import Backend, ModelShapes
from minipaged.kernels.backends import TORCH_BACKEND
from minipaged.kernels.int8 import Int8Weight, quantize_int8, stored_tensor, weight_bytes


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


class LlamaWeights:
    """The weights half of ``CompactLlama`` (llama.py holds the forward half): where its tensors come from, how
    they are laid out and placed, what they cost in memory. It reads the sizes ``CompactLlama.__init__`` sets."""

    # "int8" once quantize_int8 ran (a class attribute: shards built without __init__ have it too)
    quantization: Optional[str] = None
    # Set by CompactLlama.__init__ (or a shard's): the sizes and tensors these methods read and write.
    config: Any
    family: Any
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: Any                      # a tensor, or an Int8Weight once quantized
    layers: list[LlamaLayerWeights]
    _hf_model: Optional[torch.nn.Module]

    def take_weights(self, hf_model: torch.nn.Module) -> None:
        """Take the weights of transformers' module: shared where the forward pass reads them as they are
        (embedding, norms, o and down), stacked where one matmul replaces several (q|k|v, gate|up), and the
        optional weights the model's family declares (families.py)."""
        family = self.family
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

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device=None,
                          backend: Backend = TORCH_BACKEND) -> torch.Tensor:
        """One tensor for the whole pool: [layers, 2 (K and V), num_blocks, block_size, kv_heads, head_dim],
        in the memory ``backend`` allocates (on a Linux CPU, memory that may be backed by huge pages)."""
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return backend.allocate_kv_pool(shape, self.dtype, torch.device(device or self.device))

    def shapes(self) -> ModelShapes:
        """The sizes a backend builds and measures its code for."""
        return ModelShapes(hidden_size=self.config.hidden_size, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.layers[0].gate_up.shape[0] // 2, vocab_size=self.config.vocab_size)

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


def point_at_rows(parameters: list[torch.nn.Parameter], stacked: torch.Tensor) -> None:
    """Point each of ``parameters`` at its rows of ``stacked`` (the tensors were stacked in this order, as
    q|k|v and gate|up are), so that both share one copy."""
    start = 0
    for parameter in parameters:
        rows = parameter.shape[0]
        parameter.data = stacked[start:start + rows]
        start += rows
