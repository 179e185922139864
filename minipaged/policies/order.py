"""Request order: which waiting request is admitted next (``--scheduling-policy``).

A policy gives each request a sort key; the smallest key is admitted first. Admission stays strict: when the
first request in this order does not fit (budget, blocks), nobody behind it jumps the queue, as in vLLM. The
one exception is fairness between prompts (minipaged/scheduler.py): a long prompt over the limit of long
prefills, or a sample whose sibling is still prefilling their prompt, lets those behind it go first.
A request preempted by recompute goes back to the waiting queue and is ordered by the same key.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from ..request import Request


class RequestOrder(ABC):
    """Subclass it and give ``key``; ``first`` picks the waiting request with the smallest key."""

    name = "custom"

    @abstractmethod
    def key(self, request: Request) -> Any:
        """A sortable key: smaller is admitted first. ``request.params.priority``, ``request.arrival_index``
        and ``request.num_prompt_tokens`` are the usual ingredients."""

    def first(self, waiting: Sequence[Request]) -> Request:
        """The request to admit next (``waiting`` is never empty)."""
        return min(waiting, key=self.key)


class FCFS(RequestOrder):
    """First come, first served (vLLM's default). Preempted requests keep their place: oldest first."""

    name = "fcfs"

    def key(self, request: Request) -> Any:
        return request.arrival_index

    def first(self, waiting: Sequence[Request]) -> Request:
        # The queue is already in this order (arrivals are appended, preempted requests go back to its head),
        # so the head is the answer without a scan.
        return waiting[0]


class PriorityOrder(RequestOrder):
    """vLLM's ``--scheduling-policy priority``: lower ``priority`` value first, then earlier arrival."""

    name = "priority"

    def key(self, request: Request) -> Any:
        return (request.params.priority, request.arrival_index)


class ShortestPromptFirst(RequestOrder):
    """Fewest prompt tokens first (then arrival): short jobs finish sooner, long prompts can starve."""

    name = "shortest-prompt-first"

    def key(self, request: Request) -> Any:
        return (request.num_prompt_tokens, request.arrival_index)
