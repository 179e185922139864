"""The automatic k: how many drafts each request verifies next step, chosen so that speculation pays.

A draft costs a row of the next forward pass (and, for a draft model, its share of a drafting pass); it pays
only if the target accepts it. Running estimates decide:

* **acceptance**: per request, the chance ``a`` that its next first draft is accepted (an average that leans
  on recent verifications; a new request starts from the average over all requests); and over all requests,
  for each later position j, the chance ``c_j`` that draft j is accepted once draft j - 1 was (drafts come in
  runs: text that quotes its input is quoted for a while). The j-th draft is used with probability
  ``a * c_2 * ... * c_j``: its expected gain in tokens.
* **cost**: the seconds a decode step of R rows took, drafts included (a running average per row count, from
  the engine's own timings of whole steps, and a line through the counts near R: ``StepCost``). On a CPU at
  batch one a few more rows cost little (a step reads the weights once), in a batch of 64 every row costs nearly
  its share of the compute: the same rule then says no. A draft model's pass is timed apart, by the number of
  requests in it.

The choice is the one that maximises expected tokens per second for the whole step (vLLM's dynamic speculation
lengths reason alike): start from one token a request at the cost of a plain decode step, then take drafts in
the order of their gain, and stop at the first that would lower tokens per second or not beat the plain step's
by MARGIN. A request whose drafts lose gets k = 0 (speculation off for it); a batch where every draft loses runs
as plain decodes. The n-gram lookup costs little (a scan in C for the suffix's first token, in the step's
cost), so it is made first, for every request, and the choice is among the requests that have a guess, each up
to its guess's length: a request with no match is a plain row, not a draft that might be. A request that
speculates no more keeps being watched: its guess is still made and checked against the token that comes
(``observe_verification`` of one draft). A draft model's guess is not free: the k is chosen first and drafted
after, and an idle request's estimate drifts up towards certainty over the steps that follow (optimism: a draft
that lost gets another try every few dozen steps, a draft that was never tried gets its first). Where even a draft
that is certain to be accepted would lose (a big batch on a CPU, where a row costs nearly its share of the step; a
draft model whose pass costs more than a row gives), nothing is proposed, watched or drifted: the step is a plain
decode and costs what one costs. (When such a stretch ends, the batch having shrunk, a draft model first feeds
itself every token it missed, in one pass: one long drafting step, the work it would otherwise have done bit by
bit. Row costs timed at large batches say little of small ones, so a small batch may wait to speculate until a
step of its size has been timed.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

PRIOR_ACCEPTANCE = 0.5      # the chance of a first draft before anything was seen
PRIOR_RUN = 0.9             # the chance of draft j once draft j - 1 was accepted, before anything was seen
WEIGHT = 0.25               # how much one observation moves a running average
DRIFT = 0.99                # per idle step, the part of (1 - estimate) that stays (draft models)
# Before two row counts were timed: a row beyond the first costs this share of a one-row step (optimistic, so
# that speculation is tried and the timings decide).
PRIOR_ROW_COST = 0.15
# A draft is taken when its tokens per second beat the plain step's by this much, not merely at all: the
# drafts chosen are those whose estimates are highest, which are more often too high than too low (a request
# with a few lucky guesses), and a step that verifies does host work a plain decode does not. Where a row costs
# little (batch one on a CPU) the margin changes nothing; where it costs nearly its share of the step (a big batch)
# it keeps speculation to the drafts that are nearly sure.
MARGIN = 0.3


def moved(average: float, outcome: float) -> float:
    return average + WEIGHT * (outcome - average)


def pays(gain: float, extra_seconds: float, rate: float, plain_rate: float) -> bool:
    """Whether ``gain`` more tokens for ``extra_seconds`` more raise a step's tokens per second (``rate`` so far:
    (tokens + gain) / (seconds + extra) > rate), and beat the plain step's (``plain_rate``) by the margin."""
    return gain > extra_seconds * max(rate, (1 + MARGIN) * plain_rate)


class Line(NamedTuple):
    """Seconds of a step by its rows, near the rows it was read at: intercept + slope * rows."""

    intercept: float
    slope: float

    def __call__(self, rows: float) -> float:
        return max(self.intercept + self.slope * rows, 1e-9)


@dataclass
class StepCost:
    """Seconds a decode step takes by its number of rows: running averages of the counts seen, and a line through
    those near a row count (``line``) that says what one more row costs there.

    Why a line and not the two nearest counts: what decides is the slope, a millisecond on a 100 ms step at
    batch 64, and two neighbouring counts (64 and 65 rows) differ by less than their noise. A least-squares line
    through the counts seen between half and twice the rows, each weighted by how often it was timed, and
    widened to farther counts until they span an eighth of the rows, reads the slope from far-apart steps."""

    seconds: dict[int, float] = field(default_factory=dict)
    timed: dict[int, int] = field(default_factory=dict)          # how many steps each average is made of
    # the lines fitted since the last step was timed (a cache: not an argument, not compared)
    _lines: dict[int, Line] = field(default_factory=dict, init=False, repr=False, compare=False)

    def observe(self, rows: int, seconds: float) -> None:
        self._lines.clear()
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else moved(old, seconds)
        self.timed[rows] = self.timed.get(rows, 0) + 1

    def line(self, rows: int) -> Line:
        """A step of ``x`` rows near ``rows`` takes about intercept + slope * x seconds. With
        too narrow a spread of counts (or none), the slope is PRIOR_ROW_COST of a row's share of the nearest step:
        optimistic, so that drafts are tried and their steps timed."""
        if rows not in self._lines:
            self._lines[rows] = self._fit(rows)
        return self._lines[rows]

    def _fit(self, rows: int) -> Line:
        seen = self.seconds
        if not seen:
            return Line(1.0 - PRIOR_ROW_COST, PRIOR_ROW_COST)      # 1.0 at one row, in no particular unit
        wanted = max(2, rows // 8)
        near = [r for r in seen if rows // 2 <= r <= 2 * rows + 4]
        farther = sorted((r for r in seen if r not in near), key=lambda r: (abs(r - rows), r))
        while farther and (not near or max(near) - min(near) < wanted):
            near.append(farther.pop(0))
        weights = {r: min(self.timed.get(r, 1), 8) for r in near}
        total = sum(weights.values())
        mean_rows = max(sum(w * r for r, w in weights.items()) / total, 1.0)
        mean_s = sum(w * seen[r] for r, w in weights.items()) / total
        if max(near) - min(near) < wanted:
            slope = PRIOR_ROW_COST * mean_s / mean_rows
        else:
            spread = sum(w * (r - mean_rows) ** 2 for r, w in weights.items())
            slope = max(0.0, sum(w * (r - mean_rows) * (seen[r] - mean_s) for r, w in weights.items()) / spread)
        return Line(mean_s - slope * mean_rows, slope)

    def __call__(self, rows: int) -> float:
        """The expected seconds of a step of ``rows`` rows (in any unit before anything was timed)."""
        return self.line(rows)(rows)


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
    closed: bool = False          # the last choice found that even a certain draft would lose (see ``choose``)

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

    def worth_trying(self, requests: int) -> bool:
        """Whether a draft could pay at all in a step of ``requests`` decodes (sets ``closed``)."""
        return self._open(self.cost.line(max(requests, 1)), requests)

    def _open(self, cost: Line, requests: int) -> bool:
        """Even a certain draft loses where every row costs its share of the compute, or where a draft model's pass
        costs more than a row gives: then nothing is worth proposing, watching or trying again, and the step is
        plain decodes (``closed``)."""
        seconds = cost(requests)
        self.closed = not requests or not pays(1.0, cost(requests + 1) + self.drafting_s(1, 1) - seconds,
                                               requests / seconds, requests / seconds)
        return not self.closed

    def choose(self, limits: dict[str, int]) -> dict[str, int]:
        """k per request (at most its limit; one with limit 0 is a plain row of the step), maximising the step's
        expected tokens per second."""
        chosen = {rid: 0 for rid in limits}
        cost = self.cost.line(max(len(limits), 1))              # read once for the whole choice
        if not self._open(cost, len(limits)):
            return chosen
        rows = tokens = float(len(limits))
        seconds = cost(rows)                                    # the plain step
        plain_rate = tokens / seconds
        for rid in limits:
            self.acceptance.setdefault(rid, self.first)
        passes = drafting = 0                          # drafting passes, requests that draft
        # (gain, request, j): the expected tokens of the j-th draft of a request
        candidates = sorted(((gain, rid, j) for rid, k in limits.items()
                             for j, gain in enumerate(self.gains(rid, k), start=1)), key=lambda c: (-c[0], c[2]))
        for gain, rid, j in candidates:
            if j != chosen[rid] + 1:
                continue
            new_passes, new_drafting = max(passes, j), drafting + (j == 1)
            new_seconds = cost(rows + 1) + self.drafting_s(new_passes, new_drafting)
            if not pays(gain, new_seconds - seconds, tokens / seconds, plain_rate):
                break
            chosen[rid], passes, drafting, seconds = j, new_passes, new_drafting, new_seconds
            rows, tokens = rows + 1, tokens + gain
        if self.drift:
            for rid, k in chosen.items():              # an idle estimate drifts up: it will be tried again
                if k == 0 and limits[rid] > 0:
                    self.acceptance[rid] = 1.0 - DRIFT * (1.0 - self.acceptance[rid])
        return chosen
