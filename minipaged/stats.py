"""The engine's running totals: what ``Engine.stats()`` returns and every StepEvent carries.

Totals only grow; gauges (free blocks, queue lengths, the prefix cache's hit rate) are read fresh from
the block manager and the scheduler each time. ``minipaged.metrics`` exports both under vLLM's names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManager
    from .scheduler import Scheduler, SchedulerOutput
    from .spec_decode.rejection_sampler import Verified
    from .swap import CpuBlockPool


class EngineCounters:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {
            "steps": 0, "prompt_tokens_computed": 0, "generation_tokens": 0, "preemptions_recompute": 0,
            "preemptions_swap": 0, "blocks_swapped_out": 0, "blocks_swapped_in": 0,
            "forward_seconds": 0.0, "step_seconds": 0.0,
            # speculative decoding, as vLLM counts it: verifications with drafts, drafts, accepted drafts
            "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0}

    def count_step(self, plan: Optional[SchedulerOutput], num_generated: int, model_s: float, step_s: float,
                   verified: Mapping[str, Verified] = {}) -> None:
        t = self.totals
        t["steps"] += 1
        t["forward_seconds"] += model_s
        t["step_seconds"] += step_s
        if plan is None:                 # (async output processing's first step: nothing had run yet)
            return
        t["prompt_tokens_computed"] += sum(c.num_new_tokens for c in plan.chunks if c.kind == "prefill")
        t["generation_tokens"] += num_generated
        for p in plan.preempted:
            t[f"preemptions_{p.mode}"] += 1
        t["blocks_swapped_out"] += len(plan.swap_out)
        t["blocks_swapped_in"] += len(plan.swap_in)
        for verdict in verified.values():
            t["spec_decode_num_drafts"] += 1
            t["spec_decode_num_draft_tokens"] += verdict.num_draft_tokens
            t["spec_decode_num_accepted_tokens"] += verdict.num_accepted
            for position in range(verdict.num_accepted):    # acceptance by draft position (0: the first guess)
                key = f"spec_decode_num_accepted_tokens_pos_{position}"
                t[key] = t.get(key, 0) + 1

    def add_step_seconds(self, seconds: float) -> float:
        """A step's time, known only once its event is built (after ``count_step``); returns the new total."""
        self.totals["step_seconds"] += seconds
        return self.totals["step_seconds"]

    def snapshot(self, kv: KVCacheManager, cpu_pool: CpuBlockPool, scheduler: Scheduler) -> dict[str, float]:
        """Gauges read now, then the totals."""
        st = kv.stats
        return {
            "blocks_total": kv.num_blocks, "blocks_free": kv.num_free_blocks,
            "blocks_cached_free": kv.num_cached_free_blocks, "blocks_used": kv.num_blocks - kv.num_free_blocks,
            "cpu_blocks_total": cpu_pool.num_blocks, "cpu_blocks_free": cpu_pool.num_free_blocks,
            "requests_waiting": len(scheduler.waiting), "requests_running": len(scheduler.running),
            "requests_swapped": len(scheduler.swapped),
            "prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits,
            "prefix_cache_hit_rate": st.hits / st.queries if st.queries else 0.0, "blocks_evicted": st.evictions,
            "requests_finished": scheduler.num_finished, **self.totals}
