"""The automatic k: how many drafts each request verifies next step, chosen so that speculation pays.

A draft costs a row of the next forward pass (and, for a draft model, its share of a drafting pass); it pays
only if the target accepts it. Two running estimates decide:

* **acceptance**, per request: the chance ``a`` that its next draft is accepted, an average that leans on recent
  verifications. Under that estimate the j-th draft of a request is used with probability ``a ** j`` (every
  draft before it accepted too): its expected gain in tokens.
* **cost**, per step: the seconds a decode step of R rows took (a running average per row count, from the
  engine's own timings; between the counts it has seen, the line through the nearest two). On a CPU at batch
  one a few more rows cost little (a step reads the weights once, tests/test_decode_layers.py's verifications),
  in a batch of 64 every row costs its share of the compute: the same rule then says no.

The choice is the one that maximises expected tokens per second for the whole step (vLLM's dynamic speculation
lengths reason alike): start from one token a request at the cost of a plain decode step, then take drafts in
the order of their gain, and stop at the first that would lower tokens per second. A request whose drafts lose
gets k = 0 (speculation off for it); a batch where every draft loses runs as plain decodes. A request that
speculates no more has its estimate drift back to an even chance over the steps that follow, so that a text
that starts to repeat its input gets another try once the cost allows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.5      # a request's chance before it was seen, and where an idle one drifts back to
WEIGHT = 0.25               # how much one observation moves a running average
DRIFT = 0.99                # per idle step, the part of (estimate - prior) that stays
# Before two row counts were timed: a row beyond the first costs this share of a one-row step (optimistic, so
# that speculation is tried and the timings decide).
PRIOR_ROW_COST = 0.15


@dataclass
class StepCost:
    """Seconds a decode step takes by its number of rows: running averages of the counts seen."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + WEIGHT * (seconds - old)

    def __call__(self, rows: int) -> float:
        """The expected seconds of a step of ``rows`` rows (in any unit before anything was timed)."""
        if rows in self.seconds:
            return self.seconds[rows]
        seen = sorted(self.seconds, key=lambda n: (abs(n - rows), n))[:2]
        if len(seen) < 2:
            r0 = seen[0] if seen else 1
            t0 = self.seconds[r0] if seen else 1.0
            return t0 * (1 + PRIOR_ROW_COST * (rows - r0) / r0)
        (r0, r1) = sorted(seen)
        slope = max(0.0, (self.seconds[r1] - self.seconds[r0]) / (r1 - r0))
        return max(self.seconds[r0] + slope * (rows - r0), 1e-9)


@dataclass
class AutoK:
    """Per-request acceptance, the step cost, a drafting pass's cost; ``choose`` gives each request its k."""

    cost: StepCost = field(default_factory=StepCost)
    acceptance: dict[str, float] = field(default_factory=dict)
    draft_pass_s: float = 0.0              # a draft model's pass (0: the n-gram lookup, which costs no pass)

    def observe_verification(self, request_id: str, num_accepted: int, num_drafts: int) -> None:
        """The verdict on a request's drafts: each draft up to the first rejection is one observation."""
        a = self.acceptance.get(request_id, PRIOR_ACCEPTANCE)
        for j in range(min(num_accepted + 1, num_drafts)):
            a += WEIGHT * ((1.0 if j < num_accepted else 0.0) - a)
        self.acceptance[request_id] = a

    def observe_drafting(self, pass_seconds: list[float]) -> None:
        """A draft model's passes of the last proposal, each."""
        for seconds in pass_seconds:
            self.draft_pass_s = seconds if not self.draft_pass_s else (
                self.draft_pass_s + WEIGHT * (seconds - self.draft_pass_s))

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def choose(self, limits: dict[str, int]) -> dict[str, int]:
        """k per request (at most its limit), maximising the step's expected tokens per second."""
        chosen = {rid: 0 for rid in limits}
        rows = tokens = float(len(limits))
        passes = 0
        seconds = self.cost(int(rows))
        # (gain, request, j): the j-th draft of a request is used with probability a ** j
        candidates = sorted(((self.acceptance.get(rid, PRIOR_ACCEPTANCE) ** j, rid, j)
                             for rid, k in limits.items() for j in range(1, k + 1)), key=lambda c: (-c[0], c[2]))
        for gain, rid, j in candidates:
            if j != chosen[rid] + 1:
                continue
            new_passes = max(passes, j)
            new_seconds = self.cost(int(rows) + 1) + new_passes * self.draft_pass_s
            if (tokens + gain) / new_seconds <= tokens / seconds:
                break
            chosen[rid], passes, seconds = j, new_passes, new_seconds
            rows, tokens = rows + 1, tokens + gain
        for rid, k in chosen.items():                  # an idle estimate drifts back towards the prior
            if k == 0 and rid in self.acceptance:
                self.acceptance[rid] = PRIOR_ACCEPTANCE + DRIFT * (self.acceptance[rid] - PRIOR_ACCEPTANCE)
        return chosen
