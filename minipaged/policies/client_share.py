"""Fair share by client (``--fair-share``): the scheduler shares the engine between clients before requests.

vLLM shares a step's token budget and the KV pool between *requests*, so a client's share grows with what it
sends: 16 prompts at once, n=128 samples, a long cached prefix. A workshop server has thirty students and one
engine; here each client (``SamplingParams.client``: the server's API key or address, ``None`` one anonymous
client) gets its turn first, and only then its requests share it:

  * **Admission takes turns.** Waiting requests are admitted round robin across clients (the client admitted
    longest ago first, the turns kept from step to step), in the scheduling policy's order within a client:
    one client's 128 samples do not queue ahead of another's one request.
  * **Preemption takes from the heaviest.** When blocks run out, the victim comes from the client holding the
    most KV blocks (the victim policy then picks within that client: by default its newest request). A client
    holding more than its fair share (the pool divided by the clients with requests) never preempts another
    client's requests: it preempts its own, or waits. The running requests of the lightest clients are
    scheduled first, so the heaviest client's requests are still there to be preempted when others need room.
  * **A newcomer takes its share back.** vLLM's admission never preempts: a request that does not fit waits
    for blocks. Here, before a step schedules anything, the next waiting request of each client that stays
    within its fair share with it gets room kept for its first chunk: the client holding the most beyond its
    share has requests preempted until the free blocks cover it, and no client over its share takes the kept
    blocks in that step (its waiting requests are passed over, the others' admitted). A student who arrives
    while another client's samples fill the pool starts now, not when they end. Not covered: a request that
    was swapped out (``--preemption-mode swap``) waits for blocks as before, and a long prompt's later chunks
    get no kept room (a chunk that finds no block preempts a request as any running request does).
  * **A step's work is bounded, and shared by client.** While two or more clients have requests, one step
    does at most ``long_prefill_token_threshold`` tokens of work (the per-prompt cap becomes the step's):
    every client's first running decode gets its row, whatever the rest; then the clients' other decodes take
    turns, one row per client a turn, up to half of the allowance; the step's prefill chunks get what is left
    (at least one token). So one client's n=128 samples decode a few dozen rows a step beside thirty students' one
    each, not 128: the step, which is every student's pause between two tokens, stays short. A client's own
    decodes take turns too (the fewest output tokens first), so its samples advance together.
  * **Context is counted.** A token over a cached context costs more than its own pass through the layers
    (its query attends to the whole context), so the allowance charges each token, a prefill's or a
    decode's, ``1 + context / attention_context_per_token`` (``attention_context_per_token``: how many
    context positions one query attends to for the cost of its own linear layers, from the model's shape).

One client alone (the library, a benchmark) meets none of this: the scheduler takes its plain paths. Nor does
an accelerator, where the threshold is 0: a step of 2,048 tokens takes milliseconds there.
A client over its fair share still grows into free blocks while no one else needs them: they come back when a
newcomer does.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

from ..request import Request

if TYPE_CHECKING:
    from ..kv_cache_manager import KVCacheManager

ANONYMOUS = ""                        # the client of requests that name none


def client_of(request: Request) -> str:
    return request.params.client or ANONYMOUS


def attention_context_per_token(model_config: Any) -> int:
    """Context positions one query token attends to for as many FLOPs as its own pass through the linear
    layers of a layer (q, k, v, o and a gated MLP); layers cancel out. SmolLM2-135M: about 3,000; TinyLlama:
    about 12,000. (A first approximation: on a CPU attention runs at a lower FLOP rate than matmuls.)"""
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    linear = hidden * (2 * q_width + 2 * kv_width) + 3 * hidden * model_config.intermediate_size
    return max(1, linear // (2 * q_width))       # per (query, key): QK^T and PV, 2 FLOPs each per q element


class ClientShare:
    """Fair share's state across steps (the scheduler holds one when ``fair_share`` is on): the turns of
    admission, an idle client's entry dropped. ``begin_step`` gives the step's view, which decides."""

    def __init__(self, attention_context_per_token: int = 0) -> None:
        self.context_per_token = attention_context_per_token      # 0: context is not charged
        self.last_turn: dict[str, int] = {}                       # client -> when it was last admitted
        self.num_admitted = 0                                     # admissions counted, the clock of turns

    def begin_step(self, queues: Iterable[Iterable[Request]], threshold: int) -> StepShare:
        """This step's view: the clients with requests in ``queues``; ``threshold`` (0: none) bounds the step's
        work while two or more of them have requests."""
        clients = {client_of(r) for queue in queues for r in queue}
        for gone in self.last_turn.keys() - clients:
            del self.last_turn[gone]
        return StepShare(self, clients, threshold if threshold > 0 and len(clients) > 1 else None)


@dataclass
class StepShare:
    """One step's view of the clients (who has requests, the prefill left to grant) and its decisions."""

    owner: ClientShare
    clients: set[str]
    allowance_left: Optional[int]     # tokens (context-weighted) the step may still do; None: no cap
    any_prefill: bool = False         # a prefill chunk was granted this step
    reserved: int = 0                 # free blocks kept for newcomers of the clients in kept_for ...
    kept_for: set[str] = field(default_factory=set)
    over_share: set[str] = field(default_factory=set)     # ... that these clients (over their share) may not take

    @property
    def contended(self) -> bool:
        return len(self.clients) > 1

    # ------------------------------------------------------------------ the step's work
    def cost(self, num_tokens: int, context: int) -> float:
        """What ``num_tokens`` after ``context`` computed tokens take from the step's allowance."""
        per = self.owner.context_per_token
        return num_tokens * (per + context) / per if per else float(num_tokens)

    def decode_rows(self, decodes: Sequence[Request]) -> set[int]:
        """Which of the step's running decodes (``id``s of ``decodes``) get their row: all of them without a cap;
        under one, every client's first, then one more per client a turn while their cost stays within half of
        the allowance. The rest of the allowance is the step's prefills'. Within a client the decodes with the
        fewest output tokens go first, so that its samples take turns."""
        if self.allowance_left is None:
            return {id(r) for r in decodes}
        queues: dict[str, deque[Request]] = {}
        for req in sorted(decodes, key=lambda r: (len(r.output_token_ids), r.arrival_index)):
            queues.setdefault(client_of(req), deque()).append(req)
        granted: set[int] = set()
        first_rows = [queue.popleft() for queue in queues.values()]    # never waits behind another client
        spent = sum(self.cost(1 + len(r.spec_token_ids), r.num_computed_tokens) for r in first_rows)
        granted.update(id(r) for r in first_rows)
        turn = deque(client for client, queue in queues.items() if queue)
        spare = self.allowance_left / 2 - spent
        while turn:
            client = turn.popleft()
            req = queues[client][0]
            row = self.cost(1 + len(req.spec_token_ids), req.num_computed_tokens)
            if row > spare:
                continue                                  # this client's turns are over for this step
            spare -= row
            spent += row
            granted.add(id(queues[client].popleft()))
            if queues[client]:
                turn.append(client)
        self.allowance_left = max(0, self.allowance_left - math.ceil(spent))
        return granted

    def within(self, wanted: int, context: int) -> int:
        """How many of ``wanted`` prefill tokens after ``context`` fit what is left of the step's allowance (at
        least one for the step's first prefill, so that a long context never stalls)."""
        if self.allowance_left is None:
            return wanted
        per = self.owner.context_per_token
        fits = self.allowance_left * per // (per + context) if per else self.allowance_left
        return min(wanted, max(fits, 0 if self.any_prefill else 1))

    def charge(self, num_tokens: int, context: int) -> None:
        """A prefill chunk of ``num_tokens`` after ``context`` was granted."""
        self.any_prefill = True
        if self.allowance_left is not None:
            self.allowance_left = max(0, self.allowance_left - math.ceil(self.cost(num_tokens, context)))

    # ------------------------------------------------------------------ blocks held
    @staticmethod
    def holdings(running: Iterable[Request], blocks_of: Callable[[str], Sequence[int]]) -> dict[str, int]:
        """Blocks each client holds, a block shared by its requests (n samples of one prompt) counted once."""
        held: dict[str, set[int]] = {}
        for req in running:
            held.setdefault(client_of(req), set()).update(blocks_of(req.request_id))
        return {client: len(blocks) for client, blocks in held.items()}

    def running_order(self, running: Sequence[Request], blocks_of: Callable[[str], Sequence[int]]) -> list[Request]:
        """The running requests this step may schedule: the decodes that get a row (``decode_rows``), then the
        prefills; within each, the clients holding fewest blocks first (then the running order), so that the
        heaviest client's requests are scheduled last and can still be preempted."""
        held = self.holdings(running, blocks_of)
        rows = self.decode_rows([r for r in running if not r.is_prefill])
        return sorted((r for r in running if r.is_prefill or id(r) in rows),
                      key=lambda r: (r.is_prefill, held.get(client_of(r), 0)))

    def victims(self, candidates: Sequence[Request], needs_room: Request, running: Iterable[Request],
                blocks_of: Callable[[str], Sequence[int]], num_blocks: int) -> list[Request]:
        """The candidates the victim policy may choose from: the requester's own while its client holds more
        than its fair share (the pool over the clients), else the heaviest client's (the newest among equals)."""
        held = self.holdings(running, blocks_of)
        own = client_of(needs_room)
        by_client = self.by_client(candidates)
        if held.get(own, 0) > num_blocks / len(self.clients) and own in by_client:
            return by_client[own]
        heaviest = max(by_client, key=lambda c: (held.get(c, 0), max(r.arrival_index for r in by_client[c])))
        return by_client[heaviest]

    def share_back(self, waiting: Sequence[Request], running: list[Request], kv: KVCacheManager,
                   first: Callable[[Sequence[Request]], Request], chunk_cap: Callable[[int], int]
                   ) -> Iterator[list[Request]]:
        """Before a step schedules anything: room is kept (``reserved``) for the next waiting request of each
        client that stays within its fair share of the pool with it (its first chunk, counted as if nothing of
        it were cached; a client that would pass its share waits, or two clients near their shares would take
        blocks from each other in turn). While the free blocks fall short, yields the running requests of the
        client holding the most beyond its share: the caller preempts one of them (out of ``running``) each
        time. (vLLM's admission never preempts: a newcomer waits for blocks.)"""
        if not waiting:
            return
        held = self.holdings(running, kv.blocks_of)
        share = kv.num_blocks / len(self.clients)
        self.over_share = {client for client, n in held.items() if n > share}
        try:
            for client, reqs in self.by_client(waiting).items():
                need = kv.blocks_needed(min((req := first(reqs)).num_tokens, chunk_cap(req.num_tokens)))
                if held.get(client, 0) + need <= share:
                    self.kept_for.add(client)
                    self.reserved += need
        except Exception:
            return                                         # admission fails the requests the order cannot take
        while self.reserved > kv.num_free_blocks and \
                (candidates := self.heaviest_over_share(running, kv.blocks_of, kv.num_blocks)):
            yield candidates

    def heaviest_over_share(self, running: Sequence[Request], blocks_of: Callable[[str], Sequence[int]],
                            num_blocks: int) -> list[Request]:
        """The running requests of the client holding the most beyond its fair share (none if no client does)."""
        held = self.holdings(running, blocks_of)
        over = [c for c, n in held.items() if n > num_blocks / len(self.clients)]
        if not over:
            return []
        heaviest = max(over, key=lambda c: held[c])
        return [r for r in running if client_of(r) == heaviest]

    def reserved_against(self, request: Request) -> int:
        """Free blocks ``request`` may not take: those kept for newcomers, when its client is over its share."""
        return self.reserved if client_of(request) in self.over_share else 0

    @staticmethod
    def by_client(requests: Iterable[Request]) -> dict[str, list[Request]]:
        grouped: dict[str, list[Request]] = {}
        for req in requests:
            grouped.setdefault(client_of(req), []).append(req)
        return grouped

    # ------------------------------------------------------------------ admission
    def turns(self, waiting: Iterable[Request], first: Callable[[Sequence[Request]], Request],
              clients: Optional[set[str]] = None) -> Iterator[Request]:
        """The waiting requests in turn (those of ``clients`` only, when given): the client admitted longest ago
        (never: first, in queue order) gives its first request in the policy's order (``first``), then the next
        client; a client whose request was offered goes to the back of the turn."""
        queues: dict[str, deque[Request]] = {}
        for req in waiting:
            if clients is None or client_of(req) in clients:
                queues.setdefault(client_of(req), deque()).append(req)
        turn = deque(sorted(queues, key=lambda c: self.owner.last_turn.get(c, -1)))
        while turn:
            client = turn.popleft()
            queue = queues[client]
            req = first(queue)
            if queue[0] is req:
                queue.popleft()
            else:
                queue.remove(req)
            if queue:
                turn.append(client)
            yield req

    def admitted(self, request: Request, num_tokens: int, context: int) -> None:
        """``request`` was admitted with a chunk of ``num_tokens`` after ``context`` cached ones: its client's
        turn comes after every other waiting client's."""
        self.owner.num_admitted += 1
        self.owner.last_turn[client_of(request)] = self.owner.num_admitted
        self.charge(num_tokens, context)
