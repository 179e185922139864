"""The one request that ``bench/one_request.py`` and ``bench/one_request_profile.py`` time (issue 51): its
prompt, the name a server serves the model under, and one streamed greedy answer read to its end."""
from __future__ import annotations

import json
import time
from typing import Any

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

SERVED_NAME = "smollm2"


def stream_one(url: str, max_tokens: int, model: str = SERVED_NAME) -> dict[str, Any]:
    """One streamed greedy completion alone: tokens over the seconds from sending it to its last event, the time
    to its first text, and its decode rate after that (the same count as in-process: ``max_tokens`` tokens,
    ``ignore_eos`` keeping every answer that long)."""
    import httpx
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    start, first, text, chunks = time.perf_counter(), None, "", 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            chunks += bool(piece)
            if piece and first is None:
                first = time.perf_counter()
            text += piece
    seconds = time.perf_counter() - start
    first = first if first is not None else start + seconds
    return {"tok_s": max_tokens / seconds, "ttft_s": first - start,
            "decode_tok_s": (max_tokens - 1) / max(seconds - (first - start), 1e-9), "text": text,
            "num_chunks": chunks}
