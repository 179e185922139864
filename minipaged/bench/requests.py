"""The requests a benchmark sends: token-id prompts with a fixed number of output tokens each.

Benchmarks send token ids, not text, so the engine and its baseline get exactly the same work and every token
count is exact: a request asks for ``output_len`` tokens with ``ignore_eos``, so it produces exactly that many.
Three sources, as ``vllm bench`` has them:

* ``random``: random token ids (specials avoided); content does not matter for speed.
* ``shared-prefix``: every prompt starts with the same random prefix (half of the shortest prompt), so the
  prefix cache has something to find; the rest is random per prompt.
* a JSON-lines file of prompts: one ``{"prompt": "..."}`` object (or a JSON string) per line, tokenized with
  the model's tokenizer and cycled until ``--num-prompts`` are taken (``bench serve`` sends the text and
  lets the server tokenize it).
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

DATASETS = ("random", "shared-prefix")
NUM_SPECIAL_IDS = 3          # ids 0..2 are specials (pad, bos, eos) in the models minipaged loads


class BenchError(Exception):
    """A benchmark input the user must fix; printed without a traceback, exit status 2."""


@dataclass(frozen=True)
class LengthRange:
    """A length, or a range ``lo:hi`` (inclusive) that each request draws from uniformly."""

    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


def parse_length(text: str) -> LengthRange:
    """argparse type for ``--input-len 128`` or ``--input-len 40:400``."""
    try:
        lo, _, hi = text.partition(":")
        length = LengthRange(int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length: give N or a range LO:HI, e.g. 40:400") from None
    if length.lo < 1 or length.hi < length.lo:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be at least 1 and LO <= HI, e.g. 40:400")
    return length


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    text: Optional[str] = None        # a prompts file's text, sent as text when no tokenizer is at hand


def read_jsonl_prompts(path: str) -> list[str]:
    """Prompts from a JSON-lines file: each line ``{"prompt": "..."}`` or a JSON string."""
    file = Path(path)
    if not file.is_file():
        raise BenchError(f"--dataset {path!r}: no such file; give 'random', 'shared-prefix' or a JSON-lines file "
                         f"with one {{\"prompt\": ...}} per line")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}:{number}: not JSON ({exc.msg}); each line must be {{\"prompt\": ...}}") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str) or not prompt:
            raise BenchError(f"{path}:{number}: no prompt; each line must be {{\"prompt\": \"some text\"}}")
        prompts.append(prompt)
    if not prompts:
        raise BenchError(f"{path}: the file has no prompts")
    return prompts


def make_requests(dataset: str, num_prompts: int, input_len: LengthRange, output_len: LengthRange, *,
                  vocab_size: int, seed: int = 0,
                  tokenize: Optional[Callable[[str], list[int]]] = None) -> list[BenchRequest]:
    """``num_prompts`` requests from ``dataset``; the same arguments give the same requests."""
    rng = random.Random(seed)

    def random_ids(n: int) -> list[int]:
        return [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(n)]

    if dataset == "random":
        prompts = [random_ids(input_len.draw(rng)) for _ in range(num_prompts)]
    elif dataset == "shared-prefix":
        prefix = random_ids(max(1, input_len.lo // 2))
        prompts = [prefix + random_ids(input_len.draw(rng) - len(prefix)) for _ in range(num_prompts)]
    else:
        texts = read_jsonl_prompts(dataset)
        chosen = [texts[i % len(texts)] for i in range(num_prompts)]
        if tokenize is None:                  # bench serve: the server tokenizes, and reports the count
            return [BenchRequest([], output_len.draw(rng), text) for text in chosen]
        prompts = [tokenize(text) for text in chosen]
    return [BenchRequest(p, output_len.draw(rng)) for p in prompts]


def random_token_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """``n`` random token-id prompts of ``lo``-``hi`` tokens: those of the ``random`` dataset with this seed."""
    return [r.prompt_token_ids for r in make_requests("random", n, LengthRange(lo, hi), LengthRange(1, 1),
                                                      vocab_size=vocab, seed=seed)]


def describe(args: Any) -> dict[str, Any]:
    """The workload as the JSON result records it."""
    return {"dataset": args.dataset, "input_len": str(args.input_len), "output_len": str(args.output_len),
            "dataset_seed": args.dataset_seed}
