"""A lesson whose variants are ways of serving one engine: in-process, or behind ``minipaged serve`` with one
process or two. Its scenario, and the headless run that measures each way.

The other lessons' variants change engine options; lesson 12's change where the engine runs, and what shares
its Python with it. The ``in-process`` variant calls ``Engine.generate`` on every prompt at once (the baseline
of ``bench/serve.py``); the served ones start ``minipaged serve`` as a subprocess with the scenario's options as
flags (``--core-in-thread`` for one process), stream every prompt through ``/v1/completions`` at once with real
HTTP clients (``minipaged.bench.streams``, what ``bench/serve.py`` runs), and record the server's own StepEvents
from its ``/v1/events``. So its numbers, like every lesson's, come from StepEvents, plus what only a clock can
say: wall seconds, and the CPU seconds each process spent (``/proc``, by process id).

Which request arrives in which step of a served run depends on timing (HTTP connections come in one by one),
so only the in-process run's schedule is repeatable: ``measure`` keeps the times out of ``measured.json``, and
``measure_smollm2`` (the machine's numbers, on the lessons' tiny model) writes them to measured_smollm2.json.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from minipaged.events import StepEvent
from minipaged.request import SamplingParams

from .core import Run, Scenario

SERVED_NAME = "lesson"


@dataclass(frozen=True)
class ServedScenario(Scenario):
    """A Scenario whose variants are ways of serving it: ``served`` maps a variant to its extra ``minipaged
    serve`` flags; a variant not in it runs in-process. Every request arrives at step 1 (all at once, as
    ``bench/serve.py`` sends them), and the engine options are the same in every variant."""

    served: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def run_headless(self, model: str, variant: Optional[str] = None) -> "ServedRun":
        variant = variant or self.main_variant
        self.engine_options(variant)                        # a KeyError names the variants
        if variant in self.served:
            return run_served(self, model, variant)
        return run_in_process(self, model, variant)

    def serve_command(self, variant: str) -> str:
        """The ``minipaged serve`` line a learner types to start this variant's server."""
        import shlex

        from minipaged.options import as_command_line
        return shlex.join(["minipaged", "serve", "--model", "smollm2", *as_command_line(self.engine_options(variant)),
                           *self.served.get(variant, ())])

    def variant_command(self, number: int, variant: str) -> Optional[str]:
        """What opens a served variant (``minipaged watch`` runs the engine in its own process: in-process)."""
        if variant not in self.served:
            return None
        return (f"{self.serve_command(variant)}  (then: minipaged watch --attach http://127.0.0.1:8000 and "
                f"python -m minipaged.lessons {number} --send http://127.0.0.1:8000)")


@dataclass
class ServedRun(Run):
    """One way of serving the scenario: the engine's StepEvents (the server's own, from /v1/events) and what
    only a clock says. ``cpu_s`` names each process's CPU seconds (``engine`` in-process; ``core`` and
    ``api_server`` under ``minipaged serve``, ``core`` 0 when both share one process) and ``clients``."""

    wall_s: float = 0.0
    mean_ttft_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    request_ids: dict[str, str] = field(default_factory=dict)     # the lesson's id -> the engine's

    def outputs_by_request(self) -> dict[str, list[int]]:
        """Generated token ids per request of the scenario, by the lesson's own ids (comparable across runs)."""
        outputs = self.outputs
        return {rid: outputs.get(engine_id, []) for rid, engine_id in self.request_ids.items()}

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


def run_in_process(scenario: ServedScenario, model: str, variant: str) -> ServedRun:
    """``Engine.generate`` on every prompt at once, after a two-token warm-up (as ``bench/serve.py`` does);
    wall and CPU seconds around the call alone."""
    from minipaged.engine import Engine

    with Engine(model, **scenario.engine_options(variant)) as engine:
        prompts = [spec.token_ids(engine.tokenizer) for spec in scenario.requests]
        engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)      # warm-up
        events: list[StepEvent] = []
        engine.subscribe(events.append)
        start, cpu = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, [spec.params for spec in scenario.requests], use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        info = engine.info
    return ServedRun(variant, info, events, wall_s=wall, mean_ttft_s=sum(o.metrics.ttft for o in outs) / len(outs),
                     cpu_s={"engine": cpu}, request_ids={spec.request_id: o.request_id
                                                         for spec, o in zip(scenario.requests, outs)})


def run_served(scenario: ServedScenario, model: str, variant: str) -> ServedRun:
    """Start ``minipaged serve`` (the variant's flags), stream every prompt at once, stop the server, and
    return what its event stream said, the warm-up request's steps left out."""
    from transformers import AutoTokenizer

    from minipaged.bench.servers import free_port, minipaged_serve_command, running
    from minipaged.bench.streams import pid_of_server, stream_all
    from minipaged.options import as_command_line
    from minipaged.tui.attach import AttachRun

    from .fleet import _drain, model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    prompts = [spec.token_ids(tokenizer) for spec in scenario.requests]
    max_tokens = {spec.max_tokens for spec in scenario.requests}
    if len(max_tokens) != 1:
        raise ValueError("a served lesson's requests share one max_tokens (the clients send one)")
    port = free_port()
    flags = [*as_command_line(scenario.engine_options(variant)), *scenario.served[variant],
             "--served-model-name", SERVED_NAME]
    with tempfile.TemporaryDirectory(prefix=f"minipaged-lesson-{variant}-") as tmp:
        with running(minipaged_serve_command(model, port, flags), port, what=f"minipaged serve ({variant})",
                     log_path=os.path.join(tmp, "serve.log")) as url:
            stream = AttachRun(url)
            try:
                info = stream.load()
                served = stream_all(url, SERVED_NAME, prompts, max_tokens.pop(), pid_of_server(port))
            except BaseException:
                stream.close()
                raise
        events = _drain(stream)                 # the server drained and said goodbye: every event is here
    events = after_request(events, served.warm_up_id)
    ids = {spec.request_id: r.request_id for spec, r in zip(scenario.requests, served.results)}
    return ServedRun(variant, info, events, wall_s=served.seconds, mean_ttft_s=served.mean_ttft_s,
                     cpu_s={"core": served.core_cpu_s, "api_server": served.api_server_cpu_s,
                            "clients": served.clients_cpu_s}, request_ids=ids)


def after_request(events: list[StepEvent], request_id: str) -> list[StepEvent]:
    """The events after the one in which ``request_id`` (a warm-up) finished."""
    for i, ev in enumerate(events):
        if any(f.request_id == request_id for f in ev.finished):
            return events[i + 1:]
    raise RuntimeError(f"the server's events never finished the warm-up request {request_id}")


def send_streams(scenario: ServedScenario, url: str, model: str) -> int:
    """``python -m minipaged.lessons 12 --send URL``: the scenario's streams, all at once, to a server the learner
    started (prompts cut in ``model``'s tokens); returns the tokens the clients got."""
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    from minipaged.bench.streams import one_client, run_to_the_end

    from .fleet import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    served = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def all_at_once() -> list[Any]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(scenario.requests))) as http:
            return await asyncio.gather(*[one_client(http, url.rstrip("/"), served, spec.token_ids(tokenizer),
                                                     spec.max_tokens) for spec in scenario.requests])
    return sum(r.tokens for r in run_to_the_end(all_at_once()))
