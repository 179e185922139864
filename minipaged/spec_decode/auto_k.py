"""The automatic k: how many drafts each request verifies next step, chosen so that speculation pays.

A draft costs a row of the next forward pass (and, for a draft model, its share of a drafting pass); it pays
only if the target accepts it. Running estimates decide:

* **acceptance**: per request, the chance ``a`` that its next first draft is accepted (an average that leans
  on recent verifications; a new request starts from the average over all requests); and over all requests,
  for each later position j, the chance ``c_j`` that draft j is accepted once draft j - 1 was (drafts come in
  runs: text that quotes its input is quoted for a while). The j-th draft is used with probability
  ``a * c_2 * ... * c_j``: its expected gain in tokens.
* **cost**: the seconds a decode step of R rows took (a running average per row count, from the engine's own
  timings; between the counts it has seen, the line through the nearest two). On a CPU at batch one a few more
  rows cost little (a step reads the weights once), in a batch of 64 every row costs its share of the compute:
  the same rule then says no. A draft model's pass is timed the same way, by the number of requests in it.

The choice is the one that maximises expected tokens per second for the whole step (vLLM's dynamic speculation
lengths reason alike): start from one token a request at the cost of a plain decode step, then take drafts in
the order of their gain, and stop at the first that would lower tokens per second. A request whose drafts lose
gets k = 0 (speculation off for it); a batch where every draft loses runs as plain decodes. A request that
speculates no more keeps being watched: the n-gram lookup's guess costs nothing, so it is still made and
checked against the token that comes (``observe_verification`` of one draft); a draft model's is not free, so
instead the request's estimate drifts up towards certainty over the steps that follow (optimism: a draft that
lost gets another try every few dozen steps, a draft that was never tried gets its first).
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.5      # the chance of a first draft before anything was seen
PRIOR_RUN = 0.9             # the chance of draft j once draft j - 1 was accepted, before anything was seen
WEIGHT = 0.25               # how much one observation moves a running average
DRIFT = 0.99                # per idle step, the part of (1 - estimate) that stays (draft models)
# Before two row counts were timed: a row beyond the first costs this share of a one-row step (optimistic, so
# that speculation is tried and the timings decide).
PRIOR_ROW_COST = 0.15


def moved(average: float, outcome: float) -> float:
    return average + WEIGHT * (outcome - average)


@dataclass
class StepCost:
    """Seconds a decode step takes by its number of rows: running averages of the counts seen."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else moved(old, seconds)

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
    """The acceptance estimates, the step cost and a drafting pass's cost; ``choose`` gives each request its k.
    ``drift``: whether idle requests' estimates drift up (draft models; the n-gram lookup is watched instead)."""

    cost: StepCost = field(default_factory=StepCost)
    acceptance: dict[str, float] = field(default_factory=dict)    # per request: its next first draft's chance
    first: float = PRIOR_ACCEPTANCE                               # the same over every request: where new ones start
    runs: list[float] = field(default_factory=list)               # c_j for j = 2, 3, ...
    # a draft model's pass by the requests in it (none timed: free, as the n-gram lookup is)
    draft_pass: StepCost = field(default_factory=StepCost)
    drift: bool = True

    def observe_verification(self, request_id: str, num_accepted: int, num_drafts: int) -> None:
        """The verdict on a request's drafts: the first draft's, then each later one's after an accepted one."""
        if num_drafts < 1:
            return
        outcome = 1.0 if num_accepted >= 1 else 0.0
        self.acceptance[request_id] = moved(self.acceptance.get(request_id, self.first), outcome)
        self.first = moved(self.first, outcome)
        for j in range(2, min(num_accepted + 1, num_drafts) + 1):       # draft j, seen once j - 1 was accepted
            while len(self.runs) < j - 1:
                self.runs.append(PRIOR_RUN)
            self.runs[j - 2] = moved(self.runs[j - 2], 1.0 if num_accepted >= j else 0.0)

    def observe_drafting(self, passes: list[tuple[int, float]]) -> None:
        """A draft model's passes of the last proposal: (requests in it, seconds) each."""
        for requests, seconds in passes:
            self.draft_pass.observe(requests, seconds)

    def drafting_s(self, passes: int, requests: int) -> float:
        """Seconds of ``passes`` drafting passes of ``requests`` requests (0 before any pass was timed; fewer
        requests than any timed pass: in proportion, an optimistic guess that gets them tried, and timed)."""
        seen = self.draft_pass.seconds
        if not passes or not seen:
            return 0.0
        fewest = min(seen)
        return passes * (self.draft_pass(requests) if requests >= fewest else seen[fewest] * requests / fewest)

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def gains(self, request_id: str, k: int) -> list[float]:
        """The expected tokens each of a request's first k drafts adds."""
        gain, out = self.acceptance.get(request_id, self.first), []
        for j in range(1, k + 1):
            if j > 1:
                gain *= self.runs[j - 2] if j - 2 < len(self.runs) else PRIOR_RUN
            out.append(gain)
        return out

    def choose(self, limits: dict[str, int]) -> dict[str, int]:
        """k per request (at most its limit), maximising the step's expected tokens per second."""
        chosen = {rid: 0 for rid in limits}
        for rid in limits:
            self.acceptance.setdefault(rid, self.first)
        rows = tokens = float(len(limits))
        passes = drafting = 0                          # drafting passes, requests that draft
        seconds = self.cost(int(rows))
        # (gain, request, j): the expected tokens of the j-th draft of a request
        candidates = sorted(((gain, rid, j) for rid, k in limits.items()
                             for j, gain in enumerate(self.gains(rid, k), start=1)), key=lambda c: (-c[0], c[2]))
        for gain, rid, j in candidates:
            if j != chosen[rid] + 1:
                continue
            new_passes, new_drafting = max(passes, j), drafting + (j == 1)
            new_seconds = self.cost(int(rows) + 1) + self.drafting_s(new_passes, new_drafting)
            if (tokens + gain) / new_seconds <= tokens / seconds:
                break
            chosen[rid], passes, drafting, seconds = j, new_passes, new_drafting, new_seconds
            rows, tokens = rows + 1, tokens + gain
        if self.drift:
            for rid, k in chosen.items():              # an idle estimate drifts up: it will be tried again
                if k == 0 and limits[rid] > 0:
                    self.acceptance[rid] = 1.0 - DRIFT * (1.0 - self.acceptance[rid])
        return chosen
