"""What a StepEvent says about the step's chunks and preemptions: plain records built from the scheduler's plan
(the event must never hold a live ``Request`` or chunk: it is frozen, serialised and replayed)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from .events import Preemption, ScheduledRequest
from .scheduler import ScheduledChunk, SchedulerOutput
from .spec_decode.rejection_sampler import Verified


def scheduled_record(chunk: ScheduledChunk, verdict: Optional[Verified],
                     decode: Callable[[list[int]], str]) -> ScheduledRequest:
    """The event's record of one chunk; a verified decode also says what was guessed and kept, as text."""
    req = chunk.request
    record = ScheduledRequest(req.request_id, chunk.kind, chunk.start, chunk.end, req.num_prompt_tokens,
                              chunk.num_cached_tokens, len(req.output_token_ids), prefix_lookup=chunk.prefix_lookup,
                              spec_k=req.spec_k, spec_acceptance=req.spec_acceptance)
    if verdict is None:
        return record
    return dataclasses.replace(record, draft_token_ids=chunk.spec_token_ids, num_accepted=verdict.num_accepted,
                               draft_pieces=tuple(decode([t]) for t in chunk.spec_token_ids),
                               target_piece=decode(verdict.token_ids[-1:]))


def preemption_records(plan: SchedulerOutput) -> tuple[Preemption, ...]:
    return tuple(Preemption(p.request.request_id, p.mode, p.num_blocks,
                            "not enough free KV blocks for a running request") for p in plan.preempted)
