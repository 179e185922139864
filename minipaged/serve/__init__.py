"""``minipaged serve``: an OpenAI-compatible server over one engine, with /metrics and a live event stream.

Two processes: the engine core (``core_process``: the scheduler, the KV cache, the model; ``core_loop`` is its
busy loop) and this one, the API server. Pieces of the API server: ``protocol`` (the OpenAI request and response
shapes, the limits), ``core_client`` (how it reaches the core), ``async_engine`` (a queue per request, the
watchers, the metrics), ``api_server`` (the FastAPI routes), ``http_guards`` (body limit, HEAD),
``liveness`` (heartbeat and goodbye on the event stream), ``shutdown`` (drain on SIGTERM), ``header_limit``
(431 for headers too large), ``connections`` (open connections bounded, slow headers timed out), ``teacher``
(the teacher's controls over the page). FastAPI and uvicorn are imported only when the server runs, so other
commands do not pay for them.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Optional

from minipaged.options import add_engine_arguments, build_engine, engine_options

from .limits import DEFAULTS, PageSettings, ServerLimits, ServerSettings, limit_names

DEFAULT_HOST = "127.0.0.1"        # reachable from this machine only, unless --host says otherwise
DEFAULT_PORT = 8000
# uvicorn's default believes X-Forwarded-For from 127.0.0.1, so any script on the server's machine could name
# itself a fresh client on every request (past --page-prompt-rate and the per-student stream cap). A client is
# the address of its TCP connection, nothing it says about itself; behind a proxy every student is one client.
NO_FORWARDED_HEADERS = {"proxy_headers": False, "forwarded_allow_ips": ""}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /tokenize, /detokenize, /tokenizer_info "
                        "(default: no key)%(default).0s")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)%(default).0s")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULTS.max_waiting_requests,
                   help="answer 503 with Retry-After when this many samples (n counts) already wait for admission")
    for limit in fields(ServerLimits):
        g.add_argument(ServerLimits.flag(limit.name), dest=limit.name, type=type(limit.default),
                       default=limit.default, help=limit.metadata["help"])
    g.add_argument("--max-client-samples", type=int, default=None,
                   help="the most samples (n counts) one client (address) may have in the engine at once; more get "
                        "429 with Retry-After (default: half of --max-waiting-requests, at least --max-n)")
    g.add_argument("--max-client-prompt-tokens", type=int, default=DEFAULTS.max_client_prompt_tokens,
                   help="the most prompt tokens (once per sample) one client may have in the engine at once")
    g.add_argument("--allowed-hosts", default="",
                   help="more Host header names to answer to, comma-separated (a DNS name the class uses); the "
                        "server answers its own names and addresses only, against DNS rebinding; '*': any")
    g.add_argument("--event-heartbeat-s", type=float, default=DEFAULTS.event_heartbeat_s,
                   help="/v1/events sends a ': heartbeat' comment after this many seconds without an event")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULTS.shutdown_timeout_s,
                   help="on SIGTERM, how many seconds running requests may go on before they are ended with an "
                        "error (new requests get 503 meanwhile)")
    g.add_argument("--event-buffer-mb", type=float, default=DEFAULTS.event_buffer_bytes / 2**20,
                   help="a /v1/events watcher (a browser, watch --attach) with this much unsent is dropped; it "
                        "reconnects from a fresh snapshot")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events over ZMQ as vLLM does, for routers and indexers that follow the "
                        "cache: vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}' "
                        "(binds tcp://127.0.0.1:5557; they carry every client's prompt tokens to whoever reaches "
                        "the endpoint; needs the [kv-events] extra; default: off)%(default).0s")
    g.add_argument("--core-in-thread", action="store_true",
                   help="run the engine core in a thread of the API server's process instead of a process of its "
                        "own (they then share one GIL: slower where steps are cheap; for measuring what the second "
                        "process is worth, bench/serve.py)")
    add_page_arguments(parser)
    add_engine_arguments(parser)


def add_page_arguments(parser: argparse.ArgumentParser) -> None:
    """The teacher's controls over the page (teacher.py); the page shows them to the students."""
    page = DEFAULTS.page
    g = parser.add_argument_group("teacher's controls (the page's prompt box, POST /v1/page/prompt)")
    g.add_argument("--page-prompts", choices=("on", "off"), default="on" if page.prompts else "off",
                   help="whether students may send prompts from the page (off: its box is disabled, saying why; "
                        "the API key's holder still may)")
    g.add_argument("--page-prompt-rate", type=int, default=page.prompt_rate, metavar="N",
                   help="the most page prompts one client (address) may send a minute; more get 429 with "
                        "Retry-After (default: no bound)%(default).0s")
    g.add_argument("--page-max-tokens", type=int, default=page.max_tokens, metavar="N",
                   help="the most new tokens a page prompt may ask for, and what it gets when it does not say")
    g.add_argument("--page-max-temperature", type=float, default=page.max_temperature, metavar="T",
                   help="the highest temperature a page prompt may ask for (the page asks for none: greedy)")
    text = g.add_mutually_exclusive_group()
    text.add_argument("--hide-others-text", dest="hide_others_text", action="store_true",
                      default=page.hide_others_text,
                      help="send a student's page no other client's prompt or output text (the event stream and "
                           "whole prompts); the API key's holder still sees everything%(default).0s")
    text.add_argument("--show-others-text", dest="hide_others_text", action="store_false",
                      help="send every page everyone's text (the default)%(default).0s")
    g.add_argument("--open-page", action="store_true", default=page.open_page,
                   help="with --api-key: the page's own routes (its event stream, page prompts, its settings) "
                        "answer students without the key; the OpenAI API still wants it%(default).0s")


def page_settings(args: argparse.Namespace) -> PageSettings:
    return PageSettings(prompts=args.page_prompts == "on", prompt_rate=args.page_prompt_rate,
                        max_tokens=args.page_max_tokens, max_temperature=args.page_max_temperature,
                        hide_others_text=args.hide_others_text, open_page=args.open_page)


def flag_problem(args: argparse.Namespace) -> Optional[str]:
    """Server flags that cannot work, caught before the model loads."""
    for name in ("max_waiting_requests", "max_client_samples", "max_client_prompt_tokens", *limit_names()):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            flag = ServerLimits.flag(name)         # (every server flag here is its name with dashes)
            return f"{flag} must be {'positive' if isinstance(value, float) else 'at least 1'}, not {value}."
    for name in ("page_prompt_rate", "page_max_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, not {value}."
    if getattr(args, "page_max_temperature", 0.0) < 0:
        return f"--page-max-temperature must be 0 or more, not {args.page_max_temperature}."
    if getattr(args, "open_page", False) and not args.api_key:
        return "--open-page opens the page's routes to students without the API key: it needs --api-key."
    for name in ("event_heartbeat_s", "shutdown_timeout", "event_buffer_mb"):
        if getattr(args, name) <= 0 and not (name == "shutdown_timeout" and args.shutdown_timeout == 0):
            return f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}."
    from .kv_publisher import KVEventsConfig, KVEventsConfigError, check_installed
    try:
        if KVEventsConfig.parse(getattr(args, "kv_events_config", None)).enabled:
            check_installed()
    except KVEventsConfigError as exc:
        return str(exc)
    return None


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from its flags (flags left alone give ``ServerSettings``' own defaults)."""
    limits = ServerLimits(**{name: getattr(args, name) for name in limit_names()})
    return ServerSettings(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests, limits=limits,
                          event_heartbeat_s=args.event_heartbeat_s, shutdown_timeout_s=args.shutdown_timeout,
                          event_buffer_bytes=max(1, int(args.event_buffer_mb * (1 << 20))), host=args.host,
                          allowed_hosts=tuple(h for h in args.allowed_hosts.split(",") if h.strip()),
                          max_client_samples=client_samples(args),
                          max_client_prompt_tokens=args.max_client_prompt_tokens, page=page_settings(args))


def client_samples(args: argparse.Namespace) -> int:
    """--max-client-samples, or its default: no client may fill more than half the queue, and any one request
    that --max-n allows fits."""
    if args.max_client_samples is not None:
        return args.max_client_samples
    return max(args.max_n, (args.max_waiting_requests or 0) // 2)


def start_core(args: argparse.Namespace, options: dict) -> Optional[object]:
    """The engine core: in a process of its own (it loads the model there, and says when it is ready), or with
    --core-in-thread in a thread of this process, as minipaged served before it had two processes (to measure
    what the second process is worth: bench/serve.py). None if it could not start (the reason is printed)."""
    from .core_client import ProcessCore, ThreadCore
    from .core_process import CoreStartError, start_kv_events

    progress = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    if args.core_in_thread:
        try:
            engine = build_engine(args.model, options, progress=progress)
            start_kv_events(engine, args.kv_events_config)
        except Exception as exc:
            print(f"minipaged serve: the engine could not start: {exc}", file=sys.stderr)
            return None
        return ThreadCore(engine)
    try:
        return ProcessCore(args.model, options, args.kv_events_config, progress=progress)
    except CoreStartError as exc:
        print(f"minipaged serve: the engine core could not start: {exc}", file=sys.stderr)
        return None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api_server import build_app
    from .shutdown import DrainingServer

    problem = flag_problem(args)
    if problem:
        print(f"minipaged serve: {problem}", file=sys.stderr)
        return 2
    # A shared server shares the engine by client (--no-fair-share turns it off; the library leaves it off).
    options = {"fair_share": True, **engine_options(args)}
    core = start_core(args, options)
    if core is None:
        return 1
    settings = server_settings(args)
    app = build_app(core, settings)
    from .kv_publisher import KVEventsConfig
    kv_events = KVEventsConfig.parse(args.kv_events_config)
    print(f"minipaged serve: {settings.served_model_name} on http://{args.host}:{args.port} "
          f"(OpenAI API under /v1, metrics at /metrics, events at /v1/events, "
          f"the live view at /)" + (f"; KV cache events on {kv_events.endpoint}" if kv_events.enabled else ""),
          file=sys.stderr, flush=True)
    from .kv_publisher import exposure_note
    from .teacher import setting_notes, settings_line
    print(f"minipaged serve: {settings_line(settings.page, settings.api_key is not None)}", file=sys.stderr,
          flush=True)
    notes = setting_notes(settings.page, settings.api_key is not None)
    for note in notes + ([exposure_note(kv_events)] if kv_events.enabled else []):
        print(f"minipaged serve: note: {note}", file=sys.stderr, flush=True)
    from .connections import connection_settings
    from .header_limit import MAX_HEADER_BYTES
    protocol, connections_line = connection_settings(args.max_connections, args.header_timeout,
                                                       args.max_client_connections)
    print(f"minipaged serve: {connections_line}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                            timeout_graceful_shutdown=2, http=protocol,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, **NO_FORWARDED_HEADERS)
    server = DrainingServer(config, drain=app.state.drain)
    core_gone: list[str] = []

    def stop_serving(why: str) -> None:                  # the core died: nothing can be served any more
        core_gone.append(why)
        server.should_exit = True
    app.state.async_engine.on_core_exit = stop_serving
    try:
        server.run()
    finally:
        core.close()
    if core_gone:
        print(f"minipaged serve: {core_gone[0]}; stopped (the requests in flight got an error)", file=sys.stderr,
              flush=True)
        return 1
    print("minipaged serve: stopped", file=sys.stderr, flush=True)
    return 0


__all__ = ["add_serve_arguments", "run_serve"]
