"""Per-client limits: no one client may hold more than its share of the engine's queue.

``--max-waiting-requests`` bounds the queue as a whole, so one student with a loop (or one n=128 request with
a long prompt) could fill it and leave everyone else with 503. Here each client (its address: a class shares one
API key) may have at most ``max_samples`` samples and ``max_prompt_tokens`` prompt tokens in the engine at
once. Clients on the server's own machine (127.0.0.1 or ::1, where a local client's connections come from: the
teacher, a benchmark, a proxy, whose forwarded headers are not believed) have no share to keep to; the rest of
127.0.0.0/8 is reached only by binding it on purpose, and counts as a client (the tests act as students so). A sample's prompt counts once per sample: each is prefilled on its
own unless the prefix cache already holds it. Over the limit because of its own earlier requests, a client
gets 429 with Retry-After, as OpenAI's rate limits answer; a request that could never fit gets 400 naming the
flag.

Samples are counted on the event loop when a request is submitted, and its prompt tokens once its prompt is
tokenised. A ``Ticket`` released before its tokens were counted takes no tokens afterwards (the client left
early).
"""
from __future__ import annotations

import ipaddress
import threading
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

from .protocol import ServerError

RETRY = {"Retry-After": "1"}
CLIENT: ContextVar[Optional[str]] = ContextVar("minipaged_client", default=None)   # set by http_guards.ClientAddress


@dataclass
class Ticket:
    """What one submitted request holds of its client's share."""

    client: str
    samples: int
    tokens: int = 0
    released: bool = False


def on_this_machine(client: str) -> bool:
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client == "local"                     # no HTTP request: the process itself
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address in THIS_MACHINE


THIS_MACHINE = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


class ClientQuotas:
    def __init__(self, max_samples: Optional[int] = None, max_prompt_tokens: Optional[int] = None) -> None:
        self.max_samples, self.max_prompt_tokens = max_samples, max_prompt_tokens
        self.samples: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def take_samples(self, client: str, samples: int) -> Optional[Ticket]:
        """On the event loop, when a request is submitted (None: this client keeps to no share)."""
        if on_this_machine(client):
            return None
        limit = self.max_samples
        with self._lock:
            if limit is not None:
                if samples > limit:
                    raise ServerError(400, f"this request asks for {samples} samples, more than one client may have "
                                           f"in the engine at once (--max-client-samples {limit}): lower n.", "n")
                if self.samples[client] + samples > limit:
                    raise ServerError(429, f"too many samples from {client}: {self.samples[client]} are in the "
                                           f"engine and {samples} more would pass the per-client limit "
                                           f"(--max-client-samples) of {limit}; wait for your requests to finish "
                                           f"and retry.", headers=RETRY)
            self.samples[client] += samples
            return Ticket(client, samples)

    def take_tokens(self, ticket: Ticket, prompt_tokens: int) -> None:
        """Once the prompt is tokenised: its tokens, once per sample."""
        limit, tokens = self.max_prompt_tokens, prompt_tokens * ticket.samples
        with self._lock:
            if ticket.released:
                return
            client = ticket.client
            if limit is not None:
                if tokens > limit:
                    raise ServerError(400, f"this request's prompt is {prompt_tokens} tokens x {ticket.samples} "
                                           f"samples = {tokens} prompt tokens, more than one client may have in the "
                                           f"engine at once (--max-client-prompt-tokens {limit}): shorten the "
                                           f"prompt or lower n.", "prompt")
                if self.tokens[client] + tokens > limit:
                    raise ServerError(429, f"too many prompt tokens from {client}: {self.tokens[client]} are in the "
                                           f"engine and {tokens} more would pass the per-client limit "
                                           f"(--max-client-prompt-tokens) of {limit}; wait for your requests to "
                                           f"finish and retry.", headers=RETRY)
            self.tokens[client] += tokens
            ticket.tokens = tokens

    def release(self, ticket: Optional[Ticket]) -> None:
        """When the request ends, however it ends."""
        if ticket is None:
            return
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            for counts, amount in ((self.samples, ticket.samples), (self.tokens, ticket.tokens)):
                counts[ticket.client] -= amount
                if counts[ticket.client] <= 0:
                    del counts[ticket.client]          # an idle client costs no memory
