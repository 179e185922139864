"""Speculative decoding: guess several next tokens cheaply, check them all in one target forward pass.

* ``config``: ``SpeculativeConfig`` (vLLM's ``speculative_config`` names), checked before anything loads.
* ``proposer``: the one interface every drafter implements (``Draft``, ``Proposer``).
* ``ngram``: prompt lookup, no model. ``draft_model``: a smaller Llama, or the target's first layers.
* ``rejection_sampler``: keeps exactly the guesses the target agrees with (greedy or sampled).
* ``speculator``: the engine's side: ``propose`` after a step, ``verify`` in the next.

The engine asks the proposer for drafts after each step; the scheduler schedules them as extra tokens of
the next decode; the rejection sampler decides; ``Scheduler.update_from_output`` appends and rolls back.
"""
from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
