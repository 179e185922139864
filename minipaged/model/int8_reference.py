"""transformers' model with the int8 weights' dequantized values: what ``quantization="int8"`` computes,
written as an fp32 model. The tests check the int8 engine's logits against it (to float rounding), and
bench/quantization.py measures perplexity with it, where the engine gives logits only for sampled rows."""
from __future__ import annotations

import copy

import torch

from .llama import CompactLlama


def dequantized_hf_model(hf_model: torch.nn.Module, quantized: CompactLlama) -> torch.nn.Module:
    """A copy of ``hf_model`` whose projections and LM head are ``quantized``'s int8 values times their scales
    (the embedding and norms untouched, as int8 leaves them; a tied LM head is untied)."""
    hf = copy.deepcopy(hf_model)
    for layer, w in zip(hf.model.layers, quantized.layers):
        att, mlp = layer.self_attn, layer.mlp
        sizes = [att.q_proj.weight.shape[0], att.k_proj.weight.shape[0], att.v_proj.weight.shape[0]]
        for proj, part in zip((att.q_proj, att.k_proj, att.v_proj), w.qkv.dequantize().split(sizes)):
            proj.weight = torch.nn.Parameter(part.clone())
        gate, up = w.gate_up.dequantize().chunk(2)
        mlp.gate_proj.weight, mlp.up_proj.weight = torch.nn.Parameter(gate.clone()), torch.nn.Parameter(up.clone())
        att.o_proj.weight = torch.nn.Parameter(w.o.dequantize())
        mlp.down_proj.weight = torch.nn.Parameter(w.down.dequantize())
    hf.lm_head.weight = torch.nn.Parameter(quantized.lm_head.dequantize())
    hf.config.tie_word_embeddings = False
    return hf.eval()
