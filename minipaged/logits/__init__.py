"""The logits stage: everything that changes a request's next-token distribution between the forward pass
and sampling (penalties, biases, masks, structured outputs), and the log-probabilities a request asks for.

``processors`` (one class per change), ``structured`` (xgrammar), ``logprobs`` and ``stage`` (what the engine
calls). What a request asks for lives in ``SamplingParams`` and ``StructuredOutputsParams`` (``request.py``).
See docs/logits.md for where a new processor goes.
"""
