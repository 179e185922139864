"""What a step looks like on the wire: rank 0's ``ModelInput``, its tensors moved to the CPU for pickling.

The walk is generic over dataclass fields, so a field added to ``ModelInput`` or ``AttentionMetadata`` (by
speculative decoding, say) reaches the workers without touching this file. Only fields that hold rank 0's
own bookkeeping (``Request`` objects) stay behind: workers compute, they never sample.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable

import torch


# What stays on rank 0, and what workers get instead: its Request objects.
LOCAL_ONLY_FIELDS: dict[str, Callable[[], Any]] = {"sampled_requests": list}


def _map_tensors(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: LOCAL_ONLY_FIELDS[f.name]() if f.name in LOCAL_ONLY_FIELDS
                                 else _map_tensors(getattr(value, f.name), move) for f in fields(value) if f.init})
    return value


def to_wire(model_input: Any) -> Any:
    return _map_tensors(model_input, lambda t: t.cpu())


def from_wire(model_input: Any, device: torch.device) -> Any:
    return _map_tensors(model_input, lambda t: t.to(device))
