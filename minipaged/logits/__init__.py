"""The logits stage: everything that changes a request's next-token distribution between the forward pass
and sampling (penalties, biases, masks, structured outputs), and the log-probabilities a request asks for.

This package's ``__init__`` stays free of torch: ``params`` is imported by ``SamplingParams`` (and so by the
server's protocol module). The torch parts are ``processors``, ``structured``, ``logprobs`` and ``stage``.
See docs/logits.md for where a new processor goes.
"""
from .params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
