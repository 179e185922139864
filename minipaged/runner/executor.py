"""One step's forward pass and its new tokens, returned as one ``ModelRunnerOutput`` (vLLM v1's
``execute_model``): the model over every scheduled token, the prompt rows' log-probabilities, the logits
stage, then a sample from each request's last row or the rejection sampler's verdict on its drafts.

The ``ModelExecutor`` owns the parts that keep per-request state for the forward pass (the sampler's seeded
generators, the logits stage's processors, the speculator's drafts). It drops a request's state when the
scheduler's output names it finished (``finished_req_ids``), at the start of the next step, in the thread that
runs the forward pass; the core calls ``forget`` itself only when no forward pass is in flight (an idle engine,
an id used again). Nothing a step computes stays behind for someone to drain afterwards: it all travels in the
output.

It also says where the time went (``StepTimes``): building the batch's tensors, the forward pass itself (timed by
the backend's ``ForwardTimer``: the host's clock, and CUDA events on CUDA), and the logits stage and sampling
after it. A StepEvent carries them, so that the TUI and the web page can show how much of a step the device
(or, on a CPU, the forward pass) was busy, and how much was the host's own work (lessons/lesson10_gpu_waits.md).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from ..logits.logprobs import StageResult, prompt_logprobs, sampled_logprobs
from .outputs import ModelRunnerOutput, StepTimes

if TYPE_CHECKING:
    import torch

    from ..kernels.backends.forward_timer import ForwardTimer
    from ..logits.stage import LogitsStage
    from ..request import Request
    from ..sampling import Sampler
    from ..scheduler import SchedulerOutput
    from ..spec_decode.rejection_sampler import Verified
    from ..spec_decode.speculator import Speculator
    from .model_runner import ModelInput, ModelRunner


class ModelExecutor:
    """Runs a ``SchedulerOutput`` through the model and picks the new tokens."""

    def __init__(self, runner: ModelRunner, logits_stage: LogitsStage, sampler: Sampler,
                 speculator: Optional[Speculator]) -> None:
        self.runner, self.logits_stage, self.sampler, self.speculator = runner, logits_stage, sampler, speculator

    def forget(self, request_ids: set[str]) -> None:
        """Drop the per-request state of requests that ended (the scheduler output's ``finished_req_ids``)."""
        for rid in request_ids:
            self.sampler.forget(rid)
            self.logits_stage.forget(rid)
            if self.speculator is not None:
                self.speculator.forget(rid)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model on every scheduled token and pick the new tokens (a sample from a last row, or the
        rejection sampler's verdict on a decode's drafts)."""
        self.forget(plan.finished_req_ids)
        if self.speculator is not None:                    # a preempted request's KV is gone: so are its drafts
            for p in plan.preempted:
                self.speculator.forget(p.request.request_id)
        if not plan.chunks:
            return ModelRunnerOutput()
        begin = time.perf_counter()
        model_input = self.runner.prepare(plan.chunks)
        forward_start = time.perf_counter()
        timer = self.runner.forward_timer
        timer.start()
        logits = self.runner.execute(model_input)
        timer.stop()
        drafts = {c.request.request_id: c.spec_token_ids for c in plan.chunks if c.spec_token_ids} \
            if self.speculator is not None else {}
        out = ModelRunnerOutput()
        logits, stage = self._logits_stage(model_input, logits, drafts, out)
        out.sampled = self._sample(model_input, logits, drafts, out.verified)
        out.logprobs = sampled_logprobs(stage.raw_logprobs, out.sampled) if stage.raw_logprobs else {}
        out.constrained = stage.constrained
        out.times = _times(begin, forward_start, timer)
        return out

    def _sample(self, model_input: ModelInput, logits: torch.Tensor, drafts: dict[str, tuple[int, ...]],
                verified: dict[str, Verified]) -> dict[str, Optional[list[int]]]:
        requests = model_input.sampled_requests
        if not drafts:
            # One row a request (the usual case): the rows are the logits themselves, sampled at once; no per-row
            # views, no copy of [requests, vocab] (12 MB at batch 64 with SmolLM2's vocabulary).
            tokens = self.sampler.sample(logits, requests)
            return {req.request_id: None if t is None else [t] for req, t in zip(requests, tokens)}
        sampled: dict[str, Optional[list[int]]] = {}
        plain: list[tuple[Request, int]] = []                  # a request without drafts, and its one row
        # Greedy verifications need only each row's argmax: one call for the step (the backend's), not one a request.
        argmax = self.sampler.argmax(logits).tolist() if any(r.params.greedy for r in requests) else None
        first = 0
        for req, rows in zip(requests, logits.split(model_input.num_logits_rows)):
            first += len(rows)
            if req.error is not None and req.request_id in drafts:    # the logits stage failed it: it is aborted
                sampled[req.request_id] = None
                continue
            if req.request_id not in drafts:
                plain.append((req, first - 1))
                continue
            verdict = self.speculator.verify(req, rows, drafts[req.request_id],
                                             None if argmax is None else argmax[first - len(rows):first])
            sampled[req.request_id] = None if verdict is None else verdict.token_ids
            if verdict is not None:
                verified[req.request_id] = verdict
        if plain:
            tokens = self.sampler.sample(logits, [req for req, _row in plain], rows=[row for _req, row in plain],
                                         argmax=argmax)
            sampled.update({req.request_id: None if t is None else [t] for (req, _row), t in zip(plain, tokens)})
        return sampled

    def _logits_stage(self, model_input: ModelInput, logits: torch.Tensor, drafts: dict[str, tuple[int, ...]],
                      out: ModelRunnerOutput) -> tuple[torch.Tensor, StageResult]:
        """Score the prompt rows a request asked log-probabilities for, then let the logits stage process the
        sampled rows in place (penalties, biases, masks; raw log-probabilities taken first). A step where no
        request has anything for the stage skips it."""
        num_sampled_rows = sum(model_input.num_logits_rows)
        if len(logits) > num_sampled_rows:
            start = num_sampled_rows
            for req, first, count in model_input.prompt_rows:
                out.prompt_logprobs.append((req, first, prompt_logprobs(
                    logits[start:start + count], req.prompt_token_ids, first, req.params.prompt_logprobs)))
                start += count
            logits = logits[:num_sampled_rows]
        requests = model_input.sampled_requests
        if not self.logits_stage.needed_by(requests):
            return logits, StageResult()
        return logits, self.logits_stage.process(requests, logits.split(model_input.num_logits_rows), drafts)


def _times(begin: float, forward_start: float, timer: ForwardTimer) -> StepTimes:
    """The step's times once its tokens are sampled (so the device is done: reading its clock waits for nothing)."""
    return StepTimes(forward_start - begin, timer.host_s, timer.device_seconds(), time.perf_counter() - forward_start)
