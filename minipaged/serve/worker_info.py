"""What a router asks a worker about itself: ``/server_info``, ``/model_info`` and ``/get_load``.

sglang-router (and SGLang's own gateway) registers a worker by calling ``GET /health``, then asks
``/server_info`` (or ``/get_server_info``) and ``/model_info`` (or ``/get_model_info``) what it serves, and
its ``power_of_two`` policy polls ``/get_load`` to pick the less loaded of two workers. The shapes are SGLang's
(``model_path``, ``served_model_name``, ``is_generation``; one ``dp_rank`` record per data-parallel rank), so
a router built for SGLang workers reads minipaged's without a special case. Plain functions of the engine's
gauges: the routes in ``api_server`` only call them.
"""
from __future__ import annotations

from typing import Any


def server_info(served_model_name: str, model: str, info: Any, max_model_len: int) -> dict[str, Any]:
    """The server's settings that a router or a dashboard reads (SGLang's names where they exist)."""
    return {"served_model_name": served_model_name, "model_path": model, "tokenizer_path": model,
            "max_model_len": max_model_len, "context_length": max_model_len,
            "block_size": info.block_size, "page_size": info.block_size, "num_blocks": info.num_blocks,
            "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens,
            "enable_prefix_caching": info.enable_prefix_caching, "device": info.device, "dtype": info.dtype,
            "dp_size": 1, "tp_size": 1, "engine": "minipaged"}


def model_info(served_model_name: str, model: str) -> dict[str, Any]:
    """SGLang's ``/get_model_info``: what the worker serves, and that it generates text."""
    return {"model_path": model, "tokenizer_path": model, "served_model_name": served_model_name,
            "is_generation": True, "model_type": "generation", "weight_version": "default"}


def load(stats: dict[str, float], num_waiting: int, block_size: int) -> list[dict[str, int]]:
    """SGLang's ``/get_load``: one record per data-parallel rank (minipaged has one). ``num_reqs`` counts running
    and waiting requests, ``num_waiting_reqs`` those not admitted yet (the server's queue included), and
    ``num_tokens`` the KV cache in use, in tokens (blocks held times the block size)."""
    running = int(stats.get("requests_running", 0)) + int(stats.get("requests_swapped", 0))
    used_blocks = int(stats.get("blocks_total", 0)) - int(stats.get("blocks_free", 0))
    return [{"dp_rank": 0, "num_reqs": running + num_waiting, "num_waiting_reqs": num_waiting,
             "num_tokens": used_blocks * block_size}]
