"""One step's forward pass and its new tokens: the model over every scheduled token, the logits stage, then a
sample from each request's last row or the rejection sampler's verdict on its drafts (what vLLM's model
runner does after its forward pass). ``Engine.step`` calls ``execute_and_sample`` once a step.

It also says where that time went (``StepTimes``): building the batch's tensors, the forward pass itself (timed by
the backend's ``ForwardTimer``: the host's clock, and CUDA events on CUDA), and the logits stage and sampling
after it. A StepEvent carries them, so that the TUI and the web page can show how much of a step the device
(or, on a CPU, the forward pass) was busy, and how much was the host's own work (lessons/lesson10_gpu_waits.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from .kernels.backends.forward_timer import ForwardTimer
from .logits.stage import LogitsStage, prompt_logprobs
from .logits.logprobs import TokenLogprobs
from .request import Request
from .runner import ModelInput, ModelRunner
from .sampling import Sampler
from .scheduler import SchedulerOutput
from .spec_decode.rejection_sampler import Verified
from .spec_decode.speculator import Speculator


@dataclass(frozen=True)
class StepTimes:
    """Where the forward-pass part of a step went, in seconds. The host's work outside the forward pass is
    ``prepare_s + model_s - forward_s`` (and, around it, the engine's scheduling and output processing)."""

    prepare_s: float = 0.0               # the batch's input tensors (runner.prepare)
    forward_s: float = 0.0               # the model's forward call, on the host's clock, in the calling thread
    device_s: Optional[float] = None     # CUDA: the device's time for that forward (CUDA events); None: host-computed
    model_s: float = 0.0                 # from the forward's start: forward, logits stage and sampling


class PromptLogprobsSink(Protocol):
    """Where the prompt log-probabilities a forward pass scores go: the OutputProcessor, or (async output processing)
    a buffer the engine thread replays into it after the join."""

    def record_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprobs]) -> None: ...


def execute_and_sample(plan: SchedulerOutput, runner: ModelRunner, logits_stage: LogitsStage, sampler: Sampler,
                       outputs: PromptLogprobsSink, speculator: Optional[Speculator],
                       before_model_call: Callable[[], None] = lambda: None,
                       ) -> tuple[dict[str, Optional[list[int]]], dict[str, Verified], StepTimes]:
    """Run the model on every scheduled token and pick the new tokens (a sample from a last row, or the
    rejection sampler's verdict on a decode's drafts): the tokens, the verdicts and where the time went.
    ``before_model_call`` is the engine's hook, run by the backend just before its long call."""
    if not plan.chunks:
        return {}, {}, StepTimes()
    begin = time.perf_counter()
    model_input = runner.prepare(plan.chunks, before_model_call=before_model_call)
    forward_start = time.perf_counter()
    timer = runner.forward_timer
    timer.start()
    logits = runner.execute(model_input)
    timer.stop()
    drafts = {c.request.request_id: c.spec_token_ids for c in plan.chunks if c.spec_token_ids} \
        if speculator is not None else {}
    logits = run_logits_stage(model_input, logits, drafts, logits_stage, outputs)
    requests = model_input.sampled_requests
    if not drafts:
        # One row a request (the usual case): the rows are the logits themselves, sampled at once; no per-row
        # views, no copy of [requests, vocab] (12 MB at batch 64 with SmolLM2's vocabulary).
        tokens = sampler.sample(logits, requests)
        return {req.request_id: None if t is None else [t] for req, t in zip(requests, tokens)}, {}, \
            _times(begin, forward_start, timer)
    sampled: dict[str, Optional[list[int]]] = {}
    verified: dict[str, Verified] = {}
    plain: list[tuple[Request, int]] = []                  # a request without drafts, and its one row
    # Greedy verifications need only each row's argmax: one call for the step (the backend's), not one a request.
    argmax = sampler.argmax(logits).tolist() if any(r.params.greedy for r in requests) else None
    first = 0
    for req, rows in zip(requests, logits.split(model_input.num_logits_rows)):
        first += len(rows)
        if req.error is not None and req.request_id in drafts:    # the logits stage failed it: it is aborted
            sampled[req.request_id] = None
            continue
        if req.request_id not in drafts:
            plain.append((req, first - 1))
            continue
        verdict = speculator.verify(req, rows, drafts[req.request_id],
                                    None if argmax is None else argmax[first - len(rows):first])
        sampled[req.request_id] = None if verdict is None else verdict.token_ids
        if verdict is not None:
            verified[req.request_id] = verdict
    if plain:
        tokens = sampler.sample(logits, [req for req, _row in plain], rows=[row for _req, row in plain],
                                argmax=argmax)
        sampled.update({req.request_id: None if t is None else [t] for (req, _row), t in zip(plain, tokens)})
    return sampled, verified, _times(begin, forward_start, timer)


def _times(begin: float, forward_start: float, timer: ForwardTimer) -> StepTimes:
    """The step's times once its tokens are sampled (so the device is done: reading its clock waits for nothing)."""
    return StepTimes(forward_start - begin, timer.host_s, timer.device_seconds(), time.perf_counter() - forward_start)


def run_logits_stage(model_input: ModelInput, logits: torch.Tensor, drafts: dict[str, Sequence[int]],
                     logits_stage: LogitsStage, outputs: PromptLogprobsSink) -> torch.Tensor:
    """Score the prompt rows a request asked log-probabilities for, then let the logits stage process the
    sampled rows in place (penalties, biases, masks; raw log-probabilities kept first). A step where no
    request has anything for the stage skips it."""
    num_sampled_rows = sum(model_input.num_logits_rows)
    if len(logits) > num_sampled_rows:
        start = num_sampled_rows
        for req, first, count in model_input.prompt_rows:
            outputs.record_prompt_logprobs(req, first, prompt_logprobs(
                logits[start:start + count], req.prompt_token_ids, first, req.params.prompt_logprobs))
            start += count
        logits = logits[:num_sampled_rows]
    requests = model_input.sampled_requests
    if logits_stage.needed_by(requests):
        logits_stage.process(requests, logits.split(model_input.num_logits_rows), drafts)
    return logits
