"""A lesson about several engines: its scenario, and the headless run that measures it through a real router.

The other lessons run one in-process ``Engine``. Routing needs more than one, and the thing routed through
is not ours: lesson 11 starts ``minipaged serve`` replicas and sglang-router in front of them (the same
pieces ``minipaged fleet`` and ``bench/fleet.py`` use, ``minipaged.fleet``), sends the scenario's requests
through the router, and records each replica's own StepEvents from its ``/v1/events``. So its numbers, like
every lesson's, are computed from StepEvents alone: a ``FleetRun`` is one ``Run`` per replica.

Requests are sent ``in_flight`` at a time, in list order, as several users would send them. Where each one
lands then depends on timing as well as on text (which request the router sees first, the replicas' loads),
so unlike the other lessons' numbers these change a little from run to run: ``measured.json`` holds the last
``--update`` run, and the tests check what the lesson claims (the ordering), not the digits. (One request
at a time would be repeatable, but sglang-router 0.3's cache_aware then sent every request to one replica:
``bench/fleet.py --concurrency 1`` did so too, while this lesson was written.) Replicas are numbered in the
order they first served a request, never by their port.
"""
from __future__ import annotations

import shlex
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from minipaged.events import EngineInfo, StepEvent

from .core import LESSON_DEFAULTS, Run, Text

REQUEST_TIMEOUT_S = 120.0
SERVED_NAME = "lesson"


@dataclass(frozen=True)
class FleetRequest:
    """One request of a fleet scenario: a tenant's system prompt and a user's question, sent in list order."""

    request_id: str                      # the lesson's name for it (the server gives it an id of its own)
    tenant: str
    system: Text
    question: Text
    max_tokens: int

    @property
    def text_tokens(self) -> int:
        """Tokens of the two messages' text (the chat template adds its own around them)."""
        return self.system.num_tokens + self.question.num_tokens

    def messages(self, tokenizer: Any) -> list[dict[str, str]]:
        """The chat messages, as text (the router matches text): each piece cut to its exact number of tokens
        by the model's own tokenizer, then decoded, so the replicas see the token counts the lesson names."""
        def text(piece: Text) -> str:
            return tokenizer.decode(piece.token_ids(tokenizer))
        return [{"role": "system", "content": text(self.system)}, {"role": "user", "content": text(self.question)}]


@dataclass(frozen=True)
class FleetScenario:
    """Replicas with the same engine options behind one router; each variant is a router policy.

    ``options`` are the replicas' engine options (``{{config.key}}`` in the text), given to each replica as
    ``minipaged serve`` flags."""

    options: dict[str, Any]
    requests: tuple[FleetRequest, ...]
    replicas: int = 2
    in_flight: int = 1                   # requests sent at once (in list order), as several users would
    variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"cache_aware": {}, "round_robin": {}})

    @property
    def main_variant(self) -> str:
        return next(iter(self.variants))

    def engine_options(self, variant: Optional[str] = None) -> dict[str, Any]:
        if variant is not None and variant not in self.variants:
            raise KeyError(f"no variant {variant!r}; choose one of {list(self.variants)}")
        return {**LESSON_DEFAULTS, **self.options}     # (as every lesson's: each shows its one mechanism)

    def serve_args(self) -> str:
        from minipaged.options import as_command_line
        return shlex.join(as_command_line(self.engine_options()))

    def run_headless(self, model: str, variant: Optional[str] = None) -> "FleetRun":
        """One variant (a router policy) on replicas of its own: ``run_fleet``."""
        return run_fleet(self, model, variant)

    def watch_elsewhere(self, number: int) -> Optional[str]:
        """``minipaged watch`` draws one engine: what to run instead (``how_to_watch``)."""
        return how_to_watch(number, self)

    def request(self, request_id: str) -> FleetRequest:
        return next(r for r in self.requests if r.request_id == request_id)


@dataclass
class FleetRun:
    """One policy's run: each replica's StepEvents (numbered by first use) and where each request went."""

    variant: str                         # the router policy
    replicas: list[Run]
    routed: dict[str, int]               # the lesson's request id -> replica index
    server_ids: dict[str, str]           # the lesson's request id -> the id the replica's events carry

    def served(self, replica: int) -> list[str]:
        return [rid for rid, r in self.routed.items() if r == replica]


def repeatable(values: dict[str, Any], scenario: FleetScenario) -> dict[str, Any]:
    """The measured values that timing cannot move (the workload's own: tenants, lengths, pool), for
    ``--check`` and the tests; a policy's results (``round_robin_*``, ``prefill_*``) are left out."""
    return {k: v for k, v in values.items() if not k.startswith((*scenario.variants, "prefill_"))}


def how_to_watch(number: int, scenario: FleetScenario) -> str:
    """What to run instead of ``minipaged watch --lesson N`` for a fleet lesson (watch draws one engine)."""
    from minipaged.fleet import DEFAULT_PORT, DEFAULT_VIEW_PORT
    fleet = (f"minipaged fleet --replicas {scenario.replicas} --policy {scenario.main_variant} "
             f"--serve-args {shlex.quote(scenario.serve_args())}")
    return (f"lesson {number} runs {scenario.replicas} engines behind a router, and `minipaged watch` draws one "
            f"engine. See it live on the fleet page instead:\n"
            f"  {fleet}\n"
            f"  (open the fleet view it prints, http://127.0.0.1:{DEFAULT_VIEW_PORT}/, then in another terminal:)\n"
            f"  python -m minipaged.lessons {number} --send http://127.0.0.1:{DEFAULT_PORT}\n"
            f"Then stop the fleet (Ctrl-C) and start it again with --policy round_robin. The lesson's text: "
            f"minipaged lessons {number}")


def run_fleet(scenario: FleetScenario, model: str, variant: Optional[str] = None) -> FleetRun:
    """Start the replicas and sglang-router (policy ``variant``), send every request, stop everything, and
    return what each replica's event stream said. RouterMissing if sglang-router is not installed."""
    from transformers import AutoTokenizer

    from minipaged.fleet.processes import ChildProcesses
    from minipaged.fleet.replicas import start_replicas
    from minipaged.fleet.router import check_installed, start_router
    from minipaged.bench.servers import free_port
    from minipaged.tui.attach import AttachRun

    variant = variant or scenario.main_variant
    scenario.engine_options(variant)                         # a KeyError names the variants
    check_installed()
    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    children = ChildProcesses(Path(tempfile.mkdtemp(prefix=f"minipaged-lesson-fleet-{variant}-")))
    streams: list[AttachRun] = []
    server_ids: dict[str, str] = {}
    try:
        replicas = start_replicas(children, scenario.replicas, model,
                                  f"{scenario.serve_args()} --served-model-name {SERVED_NAME}")
        streams = [AttachRun(r.url) for r in replicas]
        infos = [s.load() for s in streams]
        port = free_port()
        start_router(children, "127.0.0.1", port, [r.url for r in replicas], variant)
        server_ids = send_workload(scenario, f"http://127.0.0.1:{port}", tokenizer)
    finally:
        children.stop_all()              # the replicas drain and say goodbye: every event is in the streams
    per_replica = [(info, _drain(stream)) for info, stream in zip(infos, streams)]
    return _assemble(variant, per_replica, server_ids)


def send_workload(scenario: FleetScenario, url: str, tokenizer: Any, model_name: str = SERVED_NAME) -> dict[str, str]:
    """Send the scenario's requests through the router at ``url``, ``in_flight`` at a time, in list order;
    returns the id each got (the lesson's id -> the replica's). Also what ``--send URL`` does to a fleet the
    student started, so the fleet page shows the lesson's workload land."""
    import httpx

    import threading

    # Each request leaves only once the one before it has its answer's headers, i.e. the router has chosen its
    # replica: ``in_flight`` threads alone would race to the router, and round_robin's choices would follow the
    # race instead of the list (a tenant could land on one replica only).
    routed = [threading.Event() for _ in scenario.requests]

    def user(i: int) -> str:
        if i:
            routed[i - 1].wait()
        spec = scenario.requests[i]
        return _send(client, spec.messages(tokenizer), spec.max_tokens, spec.request_id, model_name, routed[i])

    with httpx.Client(base_url=url.rstrip("/"), timeout=REQUEST_TIMEOUT_S) as client, \
            ThreadPoolExecutor(scenario.in_flight) as users:          # taken up in list order
        sent = list(users.map(user, range(len(scenario.requests))))
        return dict(zip((spec.request_id for spec in scenario.requests), sent))


def _send(client: Any, messages: list[dict[str, str]], max_tokens: int, name: str, model_name: str,
          routed: Any) -> str:
    """One streamed chat request through the router, read to its end; the id the replica gave it. Sets
    ``routed`` once the answer's headers are in (or the request failed), so the next request may leave."""
    import json

    body = {"model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    server_id = None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            routed.set()
            if answer.status_code != 200:
                raise RuntimeError(f"{name} through the router: {answer.status_code} {answer.read()[:300]!r}")
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    server_id = server_id or json.loads(line[len("data: "):])["id"]
    finally:
        routed.set()
    if server_id is None:
        raise RuntimeError(f"{name} through the router: the stream carried no chunk")
    return server_id


def _drain(stream: Any) -> list[StepEvent]:
    events = []
    try:
        while (item := stream.step()) is not None:
            if isinstance(item, StepEvent):
                events.append(item)
    finally:
        stream.close()
    return events


def _assemble(variant: str, per_replica: list[tuple[EngineInfo, list[StepEvent]]],
              server_ids: dict[str, str]) -> FleetRun:
    """Number the replicas by the first request each served, and find where each request went."""
    home = {a.request_id: i for i, (_info, events) in enumerate(per_replica) for ev in events for a in ev.arrivals}
    missing = [rid for rid, sid in server_ids.items() if sid not in home]
    if missing:
        raise RuntimeError(f"no replica's events show {missing[:3]}: the event streams lost records")
    order: list[int] = []
    for rid in server_ids:
        if home[server_ids[rid]] not in order:
            order.append(home[server_ids[rid]])
    order += [i for i in range(len(per_replica)) if i not in order]          # a replica that served nothing
    runs = [Run(variant, *per_replica[i]) for i in order]
    return FleetRun(variant, runs, {rid: order.index(home[sid]) for rid, sid in server_ids.items()}, server_ids)


def model_path(model: str) -> str:
    """A model name as ``minipaged serve --model`` takes it -> the folder its tokenizer is in."""
    from minipaged.model.loader import resolve_model_path
    return str(resolve_model_path(model)[0])
