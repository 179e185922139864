"""What a backend is: everything specific to a device or a kernel set, behind one object per engine.

vLLM splits this into a Platform (the device) and an AttentionBackend (the kernels); minipaged keeps one
``Backend`` per engine, chosen once at start-up (``select_backend``), and the model, runner, sampler and engine
only call it. A new device (Apple's MPS, say) is one more file here, and the shared conformance tests
(tests/test_backend_conformance.py) check it against kernels/reference.py.

A backend owns:
  plan / attention / write_kv   a step's attention: what every layer shares (``plan``, once a step), the
                                attention over the paged cache, and writing new keys and values into it;
  linear / lm_head              the projections (any number of token rows) and the LM head, and
                                ``prepare_weight``: the layout a weight is stored in (once, at start-up);
  layer_ops                     a layer's norms, RoPE with the K/V write, SiLU (``TorchLayerOps``' interface);
  argmax                        greedy sampling;
  allocate_kv_pool              the KV pool's memory;
  quantization_problem          whether it multiplies quantized weights (``Int8Weight``, kernels/int8.py) in
                                ``linear`` and ``lm_head``; ``use_quantization`` notes that it does;
  describe                      its one start-up line;
  cuda_graphs_problem           whether its decode steps can be captured as CUDA graphs (cuda_graphs.py);
  forward_timer                 how a forward pass is timed: the host's clock, and CUDA events on CUDA
                                (forward_timer.py: the device's time is what StepEvent.device_s reports).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .forward_timer import ForwardTimer, forward_timer_for

@dataclass(frozen=True)
class ModelShapes:
    """The sizes a backend builds and measures its code for (from the model's config)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def matrices(self) -> dict[str, tuple[int, int]]:
        """Each layer's weight matrices, [out, in], as the model stores them (q|k|v and gate|up stacked)."""
        return {"qkv": ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim, self.hidden_size),
                "o": (self.hidden_size, self.num_heads * self.head_dim),
                "gate_up": (2 * self.intermediate_size, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size)}


class Backend(ABC):
    """The interface; ``TorchBackend`` (torch_backend.py) is the specification every other one refines."""

    name: str
    layer_ops: Any          # add_rms_norm, rope_and_write_kv, silu_and_mul (see kernels/torch_ops.py)
    quantization: Optional[str] = None       # "int8" once the engine quantized the weights it multiplies

    @abstractmethod
    def plan(self, block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
             host_query_start_loc: list[int]) -> Any:
        """What attention needs to know about a step that is the same for every layer: worked out once."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, plan: Any) -> torch.Tensor:
        """Every request's queries attending to its paged keys and values (prefill chunks and decodes mixed)."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, all_slots_new: bool = False) -> None:
        """Store new tokens' keys and values in their slots (-1: skip)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for a weight of shape [out, in] (stored in the layout ``prepare_weight`` chose)."""

    @abstractmethod
    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's product (the vocabulary's rows are many: it may need its own code)."""

    @abstractmethod
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling: the first index of each row's maximum."""

    def decode_layers(self, model: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any,
                      kv_cache: torch.Tensor, plan: Any) -> Optional[torch.Tensor]:
        """The model's whole layer loop for this step as one call, where this backend has one for the step (the cpu
        backend: decodes only, a few rows; kernels/cpu_decode_layers.c): ``h`` after the layers. None (the
        default): the model runs its own loop, which is the specification such a call must equal."""
        return None

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as this backend wants it stored: the same [out, in] shape, in the memory layout its
        ``linear`` is fastest with. Called once per weight at start-up; the model keeps only what it returns."""
        return weight

    def weight_placer(self, sizes: list[int], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """For weights of these byte sizes on ``device`` (as ``prepare_weight`` laid them out), a function that
        returns each one, in turn, in the memory this backend reads it fastest from: the same values, shapes and
        strides. The model keeps what it returns and lets the original go. By default, the weight itself."""
        return lambda weight: weight

    def quantization_problem(self, quantization: str) -> Optional[str]:
        """None when ``linear`` and ``lm_head`` take ``quantization``'s weights (kernels/int8.py), else why not and
        what to do instead (one sentence)."""
        return None

    def use_quantization(self, quantization: str) -> None:
        """The engine quantized the weights this backend multiplies (its start-up line says which code runs them)."""
        self.quantization = quantization

    def cuda_graphs_problem(self, device: torch.device) -> Optional[str]:
        """None when a decode step on ``device`` can be captured as a CUDA graph (kernels/backends/cuda_graphs.py):
        every host-side decision of the step holds for any later step of its batch size. Else why not, and what
        to do instead (one sentence). By default, not: the torch backend plans its attention from Python lists."""
        return (f"the {self.name} backend plans each step's attention on the host, which a CUDA graph cannot "
                "replay: use attention_backend='triton' on CUDA, or leave cuda_graphs off")

    def forward_timer(self, device: torch.device) -> ForwardTimer:
        """A timer for this engine's forward passes on ``device``: the host's clock, plus CUDA events on a CUDA
        device, where kernels run after the call that launched them returns (forward_timer.py)."""
        return forward_timer_for(device)

    @abstractmethod
    def allocate_kv_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-filled KV pool."""

    @abstractmethod
    def describe(self, why: bool = True) -> str:
        """One line for the start-up messages: which code runs (and, with ``why``, where that choice came
        from: a measurement and its cache file, or why compiled code is missing)."""

    def for_shapes(self, shapes: ModelShapes) -> "Backend":
        """This backend for another model (a draft model): itself, unless its code is built per shape."""
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
