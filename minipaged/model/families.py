"""The model families minipaged runs, as data: what each one adds to the Llama layer, looked up by
``config.model_type``.

Llama, Mistral, Qwen2 and Qwen3 are one architecture with small differences (RMSNorm, rotary positions,
grouped-query attention, a SwiGLU MLP). Each difference is a field of ``ModelFamily`` that the one compact
forward pass (``CompactLlama`` in llama.py) reads; none of them is a second copy of the forward:

* ``qkv_bias``: the q, k and v projections carry biases (Qwen2 and Qwen2.5), added after the fused qkv matmul.
* ``qk_norm``: an RMSNorm over each head of q and of k, before RoPE (Qwen3); one weight of ``head_dim``
  numbers shared by all heads, so tensor parallelism replicates it.
* ``sliding_window``: the config may declare a window of attention (Mistral; Qwen only with
  ``use_sliding_window``). minipaged attends to the whole context, which is exact only while every sequence
  fits the window, so the engine refuses a window shorter than its ``max_model_len`` (``check_sliding_window``).

What is not per family but per checkpoint comes from the checkpoint's own config: tied embeddings (the LM head
is then the embedding tensor itself), head_dim, and RoPE with its scaling (Llama 3's ``llama3``, ``linear``,
``yarn``: the tables come from transformers' own rotary module, so every static rope_type matches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ModelFamily:
    """What one family adds to the Llama layer (all False: Llama itself)."""

    model_type: str               # config.model_type
    examples: str                 # models of this family, for messages and docs
    qkv_bias: bool = False        # biases on the q, k and v projections (not on o)
    qk_norm: bool = False         # per-head RMSNorm on q and k before RoPE
    sliding_window: bool = False  # the config may declare a sliding window (checked against max_model_len)


FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (
    ModelFamily("llama", "Llama 2/3/3.x, TinyLlama, SmolLM2"),
    ModelFamily("mistral", "Mistral 7B", sliding_window=True),
    ModelFamily("qwen2", "Qwen2, Qwen2.5", qkv_bias=True, sliding_window=True),
    ModelFamily("qwen3", "Qwen3", qk_norm=True, sliding_window=True),
)}

# Config fields that no family's compact forward pass computes: name -> is this value fine?
UNSUPPORTED_VARIANTS = {
    "hidden_act": lambda v: v in (None, "silu"),
    "attention_bias": lambda v: not v,        # biases on o as well (Llama/Qwen3 variants); Qwen2 needs no flag
    "mlp_bias": lambda v: not v,
}
# RoPE types whose tables change with the sequence length at run time; minipaged builds its tables once.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class UnsupportedModelError(ValueError):
    """The model exists but is not an architecture minipaged implements."""


def supported_families_sentence() -> str:
    """'llama (Llama 2/3/3.x, ...), mistral (Mistral 7B), ...': the families, for one sentence."""
    return ", ".join(f"{f.model_type} ({f.examples})" for f in FAMILIES.values())


def rope_type(config: Any) -> str:
    """The config's RoPE type (transformers 5 keeps it in ``rope_parameters``, older configs in ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type") or params.get("type") or "default"


def family_of(config: Any, model: str = "the model") -> ModelFamily:
    """The family of ``config``, or an UnsupportedModelError that says what minipaged runs instead."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedModelError(
            f"minipaged runs Llama-architecture model families, {supported_families_sentence()}; "
            f"{model} is '{config.model_type}'.")
    unsupported = [f"{name}={getattr(config, name)!r}" for name, ok in UNSUPPORTED_VARIANTS.items()
                   if not ok(getattr(config, name, None))]
    if rope_type(config) in DYNAMIC_ROPE_TYPES:
        unsupported.append(f"rope_type={rope_type(config)!r}")
    if unsupported:
        raise UnsupportedModelError(
            f"{model} is a {family.model_type} variant that minipaged's compact forward pass does not implement "
            f"({', '.join(unsupported)}); it runs SiLU MLPs without o or MLP biases and RoPE with fixed tables, as "
            f"in {supported_families_sentence()}.")
    return family


def sliding_window_problem(config: Any, max_model_len: int, model: str = "the model") -> Optional[str]:
    """Why ``config``'s sliding window does not allow sequences of ``max_model_len`` tokens, or None.

    A token attends to the last ``sliding_window`` tokens, itself included (transformers' and vLLM's rule),
    so a window at least ``max_model_len`` long never cuts anything off: attending to the whole context is then
    exactly the model. A shorter window would need attention that forgets old tokens, which minipaged does
    not implement: refused, with the setting that makes it exact."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= max_model_len:
        return None
    return (f"{model} attends within a sliding window of {window} tokens, which minipaged does not implement, "
            f"and max_model_len is {max_model_len}; use max_model_len <= {window} (--max-model-len {window}), "
            f"where the window covers every sequence and full attention is exact.")
