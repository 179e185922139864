"""Policies: the three choices serving systems disagree on, as small classes behind interfaces.

  * ``RequestOrder`` (``--scheduling-policy``): which waiting request is admitted next.
    ``fcfs`` (vLLM's default), ``priority`` (vLLM's rule: lower ``priority`` first, then arrival),
    ``shortest-prompt-first``.
  * ``VictimPolicy`` (``--preemption-victim``): which running request gives its blocks up when the pool runs dry.
    ``newest`` (vLLM's), ``lowest-priority``, ``most-blocks``.
  * ``FreeBlockQueue`` (``--eviction-policy``): the order in which free blocks are taken, so which cached
    prefix is evicted first. ``lru`` (vLLM's), ``mru`` (Hugging Face transformers' continuous batching).

  * ``ClientShare`` (``--fair-share``, ``client_share``): not a choice by name but a layer over the others,
    sharing admission turns, a step's prefill and the KV pool between clients before requests.

Each option takes a name from ``REGISTRY`` or ``path/to/file.py:ClassName``, a user's class (``loading``).
The scheduler and the block manager each call one method of one object; they never compare policy names.
"""
from .eviction import FreeBlockQueue, LRUFreeBlockQueue, MRUFreeBlockQueue
from .loading import PolicyError, load_policy, policy_names, REGISTRY
from .order import FCFS, PriorityOrder, RequestOrder, ShortestPromptFirst
from .victim import LowestPriority, MostBlocks, Newest, VictimPolicy

__all__ = ["FreeBlockQueue", "LRUFreeBlockQueue", "MRUFreeBlockQueue", "RequestOrder", "FCFS", "PriorityOrder",
           "ShortestPromptFirst", "VictimPolicy", "Newest", "LowestPriority", "MostBlocks", "PolicyError",
           "load_policy", "policy_names", "REGISTRY"]
