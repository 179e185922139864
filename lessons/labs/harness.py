"""What the engine-facing labs (5, 6, 7) share: a scheduler driven with made-up tokens, and a tiny model.

``MadeUpEngine`` is the engine's real ``Scheduler`` and ``KVCacheManager`` with no model: each step's sampled
token is a function of the request's length, so a run is fast, deterministic, and a request that loses or
repeats tokens shows. ``tiny_model`` writes a tiny random Llama once per process, so that ``lab check``
compares with transformers on real weights without a download.
"""
from __future__ import annotations

import logging
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from minipaged.config import EngineConfig
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.policies import FCFS, LRUFreeBlockQueue, Newest
from minipaged.request import Request, SamplingParams
from minipaged.scheduler import Scheduler, SchedulerOutput
from minipaged.swap import CpuBlockPool

from .core import LabFailure, check_title

MAX_STEPS = 2000        # a run that has not finished by then is stuck (a request that never gets its tokens)


@contextmanager
def quiet_preemptions() -> Iterator[None]:
    """The scheduler's warning on each preemption (meant for an operator) would bury the checks' own report."""
    logger = logging.getLogger("minipaged.scheduler")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def made_up_token(req: Request) -> int:
    """The token a request "samples" next: decided by its arrival and its length, as a greedy model's would be."""
    return 1 + (req.arrival_index * 31 + req.num_tokens * 7) % 250


class MadeUpEngine:
    """The engine's Scheduler over a small pool, with tokens made up instead of a model's."""

    def __init__(self, *, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, enable_caching: bool = False) -> None:
        config = EngineConfig(model="lab", num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=0,
                              enable_prefix_caching=enable_caching)
        config.finalize(model_max_len=1024)
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching, free_queue=LRUFreeBlockQueue)
        self.scheduler = Scheduler(config, self.kv, CpuBlockPool(0), order=FCFS(), victim_policy=Newest())
        self.requests: list[Request] = []
        self.steps = 0

    def add(self, prompt_len: int, max_tokens: int) -> Request:
        index = len(self.requests)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        req = Request(str(index), [1 + (index + t) % 200 for t in range(prompt_len)], params, index, 0.0)
        self.requests.append(req)
        self.scheduler.add(req)
        return req

    def step(self, after_schedule: Optional[Callable[[SchedulerOutput], None]] = None) -> SchedulerOutput:
        with quiet_preemptions():
            out = self.scheduler.schedule()
        if after_schedule is not None:
            after_schedule(out)
        self.scheduler.update_from_output(out, {c.request.request_id: [made_up_token(c.request)]
                                                for c in out.chunks if c.samples})
        self.steps += 1
        return out

    def run(self, after_schedule: Optional[Callable[[SchedulerOutput], None]] = None) -> None:
        while self.scheduler.has_unfinished():
            if self.steps >= MAX_STEPS:
                raise LabFailure(f"after {MAX_STEPS} steps requests are still unfinished "
                                 f"({len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting): "
                                 f"some request never gets its tokens scheduled.")
            self.step(after_schedule)


def expected_tokens(prompt_len: int, index: int, max_tokens: int) -> list[int]:
    """What ``MadeUpEngine`` gives a request that is never disturbed (nor is one that is preempted correctly)."""
    req = Request("x", [0] * prompt_len, SamplingParams(max_tokens=max_tokens), index, 0.0)
    tokens = []
    for _ in range(max_tokens):
        token = made_up_token(req)
        tokens.append(token)
        req.output_token_ids.append(token)
    return tokens


@lru_cache(maxsize=1)
def tiny_model() -> str:
    """A tiny random Llama (GQA: 4 query heads over 2 KV heads), written once per process to a temporary
    folder: ``lab check`` needs no download and loads in a second."""
    from minipaged.model.testing import build_tiny_llama
    folder = Path(tempfile.mkdtemp(prefix="minipaged-lab-"))
    return str(build_tiny_llama(folder, num_heads=4, num_kv_heads=2))


def greedy_run(install: Optional[Callable[[Any], None]], prompts: Sequence[Sequence[int]], max_tokens: int,
               **options: Any) -> tuple[Any, list[list[int]], list[Any]]:
    """An engine on the tiny model (``install`` puts the student's code into it; None: the engine's own), the
    greedy tokens of each prompt, and the step events."""
    from minipaged import Engine
    engine = Engine(tiny_model(), **{"block_size": 4, **options})
    if install is not None:
        install(engine)
    events: list[Any] = []
    engine.subscribe(events.append)
    with quiet_preemptions():
        outs = engine.generate([list(p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return engine, [list(out.token_ids) for out in outs], events


def require(fn: Any, *checks: Callable[[Any], None]) -> None:
    """Run the quick checks before a model run: with their mistake in it (a leak, say) the run might never end."""
    for check in checks:
        try:
            check(fn)
        except LabFailure:
            raise LabFailure(f"not run on the model until the checks above pass (this one fails: "
                             f"{check_title(check)}).") from None
