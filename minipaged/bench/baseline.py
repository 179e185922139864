"""The baseline every throughput number is compared with: transformers' own batched ``generate``.

Static batching as most people first write it: requests are cut into batches in arrival order, each batch is
left-padded to its longest prompt and runs until its longest request is done. Only the tokens each request
asked for count as useful output, so the padding and the over-generation are what continuous batching saves.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional


def hf_padded_generate(hf_model: Any, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
                       pad_id: int = 0, on_progress: Optional[Callable[[int, int], None]] = None) -> tuple[float, int]:
    """transformers' generate, left-padded batches in arrival order. Returns (seconds, useful output tokens).

    ``on_progress(requests, tokens)`` hears each step's useful tokens (through a stopping criterion that never
    stops: generate has no other per-step hook) and each finished batch's requests, for a progress display.
    """
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Progress(StoppingCriteria):
        def __init__(self, wants: list[int]) -> None:
            self.wants, self.step = wants, 0

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.step += 1
            on_progress(0, sum(w >= self.step for w in self.wants))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    start = time.perf_counter()
    useful = 0
    device = getattr(hf_model, "device", "cpu")
    for i in range(0, len(prompts), batch_size):
        batch, wants = prompts[i:i + batch_size], max_tokens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        watch = StoppingCriteriaList([Progress(wants)] if on_progress is not None else [])
        with torch.inference_mode():
            hf_model.generate(ids, attention_mask=mask, max_new_tokens=max(wants), min_new_tokens=max(wants),
                              do_sample=False, pad_token_id=pad_id, stopping_criteria=watch)
        useful += sum(wants)
        if on_progress is not None:
            on_progress(len(batch), 0)
    return time.perf_counter() - start, useful
