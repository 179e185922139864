"""``minipaged serve``: the OpenAI-compatible HTTP API over one engine (FastAPI + uvicorn, as vLLM does).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as server-sent events when
asked), ``GET /v1/models``, ``GET /v1/events`` (every StepEvent, for ``minipaged watch --attach``),
``GET /health`` and ``GET /metrics`` (Prometheus: vLLM's ``vllm:`` names, and ``minipaged:`` copies), vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (``tokenization``: the API server's own),
and ``GET /``: the live view, a page each browser draws from ``/v1/events`` (``minipaged.web``).

How a request flows: the handler checks the body (pydantic, then the engine's own ``SamplingParams``
checks), tokenises the prompt on a worker thread of its own (``tokenization``: a text too long for the context
is refused by its length first), then sends the token ids and sampling parameters to the engine core
(``async_engine``; under ``minipaged serve`` the core runs in a process of its own: ``core_client``), which
queues them (a bad grammar is refused there); from then on the handler relays what each step produced. A streamed choice gets ``finish_reason`` only in its last chunk; with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries the usage; ``data: [DONE]`` ends the
stream, as OpenAI's and vLLM's servers do. Errors are OpenAI's ``{"error": {...}}`` JSON, parse errors, unknown
paths and wrong methods included.

Staying healthy under abuse: each request is bounded (``protocol.ServerLimits``, bodies by ``http_guards``),
admission counts samples, ``/health`` answers 503 with the reason while the queue is full, the engine core
is stuck or gone, or the server drains, and ``drain`` (on SIGTERM, see ``shutdown``) lets running requests finish for
a while before ending the rest with an error event. Connections are bounded (``connections``: a cap, a header
timeout, ``/health`` always answered) and so are event streams (``event_hub.StreamLimits``). There are no
``/docs``: Swagger's page would load its scripts from a CDN; ``/openapi.json`` describes the API (behind the key
when one is set).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import web
from ..metrics import EngineMetrics
from ..outputs import RequestDelta
from ..request import InvalidRequestError, check_token_ids
from . import protocol as p
from .async_engine import RECENT_PROMPTS, Accepted, AsyncEngine
from .event_hub import StreamLimits, Watcher, WatcherResponse
from .fair_share import CLIENT, ClientQuotas
from .host_check import HostCheck, allowed_hosts
from .header_limit import HeaderLimit
from .http_guards import ApiKeyCheck, BodyLimit, ClientAddress, HeadAsGet, JsonBodies
from .limits import ServerSettings
from .teacher import TEACHER, PageControls
from .tokenization import Tokenization
from .worker_info import load, model_info, server_info

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The live view: its own scripts and styles only, its own server only, in no other site's frame (clickjacking),
# and files taken for what they are said to be.
PAGE_HEADERS = {"Cache-Control": "no-cache",
                "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
ROUTER_NO_MODEL = "unknown"       # the model name sglang-router forwards when its client gave none
PYDANTIC_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})   # union branches in a loc


def sse(data: Union[dict[str, Any], str]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """vLLM's (and OpenAI's) wording for a request that does not fit the context: the limit and what was asked."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise p.ServerError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                 f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                                 f"messages, {max_tokens} in the completion). Please reduce the length of the "
                                 f"messages or completion.", "max_tokens")


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine``: a ``core_client.ProcessCore`` (the engine core in its own process, as
    ``minipaged serve`` runs it) or an ``Engine`` object (its core then runs in a thread). The core runs while
    the app does."""
    async_engine = AsyncEngine(engine, settings.max_waiting_requests,
                               ClientQuotas(settings.max_client_samples, settings.max_client_prompt_tokens),
                               settings.limits.max_stream_backlog)
    served = async_engine.served
    # Folded on the event loop, each step before its tokens reach their requests: a client that got its answer
    # finds it counted.
    metrics = EngineMetrics(subscribe=async_engine.subscribe_in_loop, model_name=settings.served_model_name,
                            since=async_engine.stats)
    controls = PageControls(settings.page)             # the teacher's controls over the page (teacher.py)
    limits = settings.limits                           # event streams never hold more than half the connections
    streams = StreamLimits(limits.max_client_event_streams,
                           min(limits.max_event_streams, max(1, limits.max_connections // 2)))
    async_engine.hide_text = settings.page.hide_others_text
    if settings.page.hide_others_text:                 # a student's own prefix-miss positions, to that student
        async_engine.subscribe_in_loop(controls.own_lookups)
    # The tokenizer routes take their own copy of the tokenizer (tokenization.py) ...
    tokenization = Tokenization(served.tokenizer, settings.served_model_name, served.vocab_size,
                                served.max_model_len)
    # ... and generation's prompts another (its own thread: a long /tokenize does not hold up a chat's prompt)
    prompts = Tokenization(served.tokenizer, settings.served_model_name, served.vocab_size,
                           served.max_model_len, thread_name="minipaged-prompts")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        yield
        async_engine.stop()
        tokenization.close()
        prompts.close()

    app = FastAPI(title="minipaged", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    goodbye = asyncio.Event()                # set when the server drains: every event stream says goodbye
    app.state.drain = lambda: drain(async_engine, goodbye, settings.shutdown_timeout_s)
    app.state.metrics = metrics
    max_model_len = served.max_model_len

    # ---------------------------------------------------------------- errors and the API key
    @app.exception_handler(p.ServerError)
    async def server_error(_request: Request, exc: p.ServerError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(p.error_body(400, str(exc), exc.param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":           # its loc is a character offset, not a field
            offset = next((x for x in first.get("loc", ()) if isinstance(x, int)), None)
            detail = (first.get("ctx") or {}).get("error", "JSON decode error")
            where = f" at character {offset}" if offset is not None else ""
            return JSONResponse(p.error_body(400, f"the body is not valid JSON ({detail}{where}): send a JSON "
                                                  f"object."), status_code=400)
        where = field_path(first.get("loc", ()))
        message = f"invalid '{where}': {first.get('msg', 'invalid value')}" if where else str(first.get("msg", exc))
        return JSONResponse(p.error_body(400, message, where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404 and 405 as OpenAI's JSON (FastAPI's own is ``{"detail": ...}``)."""
        if exc.status_code == 404:
            routes = [f"{method} {route.path}" for route in app.routes if isinstance(route, APIRoute)
                      for method in sorted(route.methods)]
            message = (f"{request.method} {request.url.path} does not exist on this server; its routes: "
                       f"{', '.join(routes)}, GET /openapi.json.")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}."
        else:
            message = str(exc.detail)
        return JSONResponse(p.error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=exc.headers)

    # Added innermost first: a request meets the header limit, the Host check, then the key, the client's address,
    # HEAD, the content type, and the body limit.
    app.add_middleware(BodyLimit, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(JsonBodies)
    app.add_middleware(HeadAsGet, endless=("/v1/events",))   # inside the key check below: added before it
    app.add_middleware(ClientAddress)
    if settings.api_key:
        app.add_middleware(ApiKeyCheck, api_key=settings.api_key,      # before any body is read
                           open_page=settings.page.open_page)
    if settings.host is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts(settings.host, settings.allowed_hosts))
    app.add_middleware(HeaderLimit)                                     # outermost: 431 before anything reads them

    def check_model(name: Optional[str]) -> None:
        """vLLM's rule: no model (or an empty one) means the one served. sglang-router forwards ``"unknown"``
        when its client sent none (it cannot name a worker's model it did not learn), so with one model
        served that name means the same."""
        if name and name != settings.served_model_name and name != ROUTER_NO_MODEL:
            raise p.ServerError(404, f"The model `{name}` does not exist. This server serves "
                                     f"`{settings.served_model_name}` (GET /v1/models lists it).", "model")

    # ---------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when the server can take a request; 503 with the reason when a load balancer should look
        elsewhere (the queue is full, the engine core is stuck or gone, the server is draining)."""
        s = async_engine.stats
        reason = not_ready_reason(async_engine, settings)
        return JSONResponse({"status": "ok" if reason is None else "unavailable", "reason": reason,
                             "num_requests_running": int(s.get("requests_running", 0)),
                             "num_requests_waiting": async_engine.num_waiting,
                             "blocks_total": int(s.get("blocks_total", 0)), "blocks_free": int(s.get("blocks_free", 0)),
                             "steps": int(s.get("steps", 0))}, status_code=200 if reason is None else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model", "created": p.now_s(),
                                            "owned_by": "minipaged", "root": served.model,
                                            "max_model_len": max_model_len}]}

    # ---------------------------------------------------------------- what a router asks (worker_info)
    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def get_server_info() -> dict[str, Any]:
        return server_info(settings.served_model_name, served.model, served.info, max_model_len)

    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def get_model_info() -> dict[str, Any]:
        return model_info(settings.served_model_name, served.model)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return load(async_engine.stats, async_engine.num_waiting, served.info.block_size)

    # ---------------------------------------------------------------- vLLM's tokenizer routes (tokenization.py)
    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        return await tokenization.detokenize(body)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return tokenization.info

    @app.get("/v1/events")
    async def events(request: Request) -> WatcherResponse:
        teacher = TEACHER.get()
        watcher = Watcher(gzip="gzip" in request.headers.get("accept-encoding", ""),
                          limit_bytes=settings.event_buffer_bytes, sees_text=not controls.hides_text_from(teacher))
        streams.admit(watcher, CLIENT.get() or "local", exempt=teacher)    # may refuse: 429 or 503
        controls.watch(watcher, teacher, CLIENT.get() or "local")
        async_engine.watch(watcher)

        def unwatch() -> None:
            streams.release(watcher)
            controls.unwatch(watcher)
            async_engine.unwatch(watcher)
        return WatcherResponse(watcher, SSE_HEADERS, on_end=unwatch,
                               heartbeat_s=settings.event_heartbeat_s, goodbye=goodbye,
                               reason=lambda: async_engine.draining or "the server is shutting down")

    @app.get("/v1/events/prompts/{request_id}")
    async def event_prompt(request_id: str) -> JSONResponse:
        """The whole prompt of a request in the engine, or among the last finished: events carry a bounded
        preview (behind the key, as the event stream is). With --hide-others-text only the teacher gets them."""
        if controls.hides_text_from(TEACHER.get()):
            raise p.ServerError(403, "the teacher hides other clients' text on this server (minipaged serve "
                                     "--hide-others-text): whole prompts are for the API key's holder; your page "
                                     "shows your own prompts itself.", "request_id")
        text = await async_engine.prompt_text(request_id, prompts.decode)
        if text is None:
            raise p.ServerError(404, f"no request {request_id!r} runs or waits in the engine, or finished lately: a "
                                     f"prompt can be fetched while its request is in the engine and for the last "
                                     f"{RECENT_PROMPTS} requests after.", "request_id")
        return JSONResponse({"request_id": request_id, "prompt": text})

    # ---------------------------------------------------------------- the page's own routes (teacher.py)
    @app.get("/v1/page/settings")
    async def page_settings() -> dict[str, Any]:
        """The teacher's settings, for the page to show (and to disable its box when prompts are off)."""
        return controls.describe(TEACHER.get(), settings.api_key is not None)

    @app.post("/v1/page/prompt")
    async def page_prompt(body: p.PagePrompt, request: Request) -> Response:
        """A prompt typed in the page: one user message, within the teacher's limits, answered like a chat
        completion (greedy and ``--page-max-tokens`` long unless it asks for less)."""
        client, teacher = CLIENT.get() or "local", TEACHER.get()
        controls.admit(client, teacher, body.max_tokens, body.temperature)
        chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": body.prompt}], stream=body.stream,
                                       max_tokens=settings.page.max_tokens if body.max_tokens is None
                                       else body.max_tokens,
                                       temperature=0.0 if body.temperature is None else body.temperature)
        try:
            return await chat_completions(chat, request)
        except p.ServerError as exc:
            # Only "the server is busy or draining" gives the prompt back: a prompt refused for itself (too long
            # for the context) cost its tokenising, and given back it could be sent again without end (issue 48).
            if exc.status == 503:
                controls.refused(client, teacher)
            raise

    # ---------------------------------------------------------------- the live view (static files)
    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(web.index_html(), headers=PAGE_HEADERS)

    @app.get("/web/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        found = web.static_file(name)
        if found is None:
            raise p.ServerError(404, f"no file {name!r} in the live view; open / for the page.")
        return Response(found[0], media_type=found[1], headers=PAGE_HEADERS)

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        body.refuse_unsupported(settings.limits)
        check_model(body.model)
        asked = p.OPENAI_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        # echo with max_tokens=0 (how evaluation harnesses score a text): one token is generated and dropped
        echo_only = body.echo and asked == 0
        max_tokens = 1 if echo_only else asked
        params = body.sampling_params(max_tokens)         # bad values fail here (a bad grammar: in the core)
        if body.echo and body.logprobs is not None:       # echo scores the prompt's tokens too
            params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, body.prompt_logprobs or 0))
        echo = Echo(echo_only) if body.echo else None

        async def prompt_ids(index: int, prompt: Union[str, list[int]]) -> list[int]:
            """One prompt's token ids and checks, off the event loop (tokenising and echo's decoding on the
            ``prompts`` worker)."""
            if isinstance(prompt, str):
                token_ids = await prompts.encode(prompt)
            else:
                check_context(len(prompt), max_tokens, max_model_len)   # the length first, then each id
                check_token_ids("prompt", prompt, served.vocab_size)
                token_ids = list(prompt)
            check_context(len(token_ids), max_tokens, max_model_len)
            body.check_prompt_logprobs(params, len(token_ids), settings.limits)
            body.check_output_logprobs(params, settings.limits)
            if echo is not None:
                echo.prompts[index] = (token_ids, prompt if isinstance(prompt, str) else await prompts.decode(
                    token_ids))
            return token_ids

        async_engine.check_admission(body.num_samples())  # a busy server says so before it tokenises
        all_ids = [await prompt_ids(i, pr) for i, pr in enumerate(body.prompts())]
        return await respond("completion", body, [(ids, params) for ids in all_ids], request, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        body.refuse_unsupported(settings.limits)
        check_model(body.model)
        messages = [m.as_template_dict() for m in body.messages]
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        body.sampling_params(asked or max(1, body.min_tokens))   # bad values fail here (a bad grammar: in the core)
        async_engine.check_admission(body.num_samples())  # a busy server says so before it tokenises
        try:                                              # the template and the tokenizer, off the event loop
            token_ids = await prompts.chat(messages, body.continue_final_message)
        except InvalidRequestError:                       # no template at all: its own message says what to send
            raise
        except (TemplateError, ValueError) as exc:        # e.g. roles that the template does not take, or
            # continue_final_message with a last message the template leaves out
            raise p.ServerError(400, f"the model's chat template refused these messages: {exc}",
                                "messages") from None

        if asked is None:           # vLLM: whatever room the context leaves (here also: what the KV pool holds)
            if len(token_ids) >= max_model_len:
                raise p.ServerError(400, f"This model's maximum context length is {max_model_len} tokens. "
                                         f"However, your messages resulted in {len(token_ids)} tokens. Please "
                                         f"reduce the length of the messages.", "messages")
            room = min(max_model_len, served.info.num_blocks * served.info.block_size) - len(token_ids)
            max_tokens = max(room, 1)
            if body.num_logprobs is not None:   # and no more than --max-output-logprobs allows (not a 400: the
                # client asked for no length)
                per_token = body.n * (body.num_logprobs + 1)
                max_tokens = min(max_tokens, max(1, settings.limits.max_output_logprobs // per_token))
        else:
            max_tokens = asked
            check_context(len(token_ids), max_tokens, max_model_len)
        params = body.sampling_params(max_tokens)
        body.check_prompt_logprobs(params, len(token_ids), settings.limits)
        body.check_output_logprobs(params, settings.limits)
        return await respond("chat", body, [(token_ids, params)], request)

    async def respond(kind: p.Kind, body: p.SamplingFields, prompts_params: list[tuple[list[int], Any]],
                      request: Request,
                      echo: Optional[Echo] = None) -> Response:
        """Queue one engine request per prompt (all accepted, or none), then answer: choice i * n + j is prompt
        i's sample j, as OpenAI numbers them."""
        request_id = p.new_id(p.ID_PREFIX[kind])
        async_engine.check_admission(body.num_samples())  # all the prompts' samples, or none of them
        # Whose it is, before the core can answer: its own miss positions (in the core's first step with it,
        # which may reach this process with the acceptance) go to that client.
        controls.sent(request_id, CLIENT.get() or "local")
        all_updates = [async_engine.generate(request_id if len(prompts_params) == 1 else f"{request_id}-{i}", ids,
                                             params, body.n) for i, (ids, params) in enumerate(prompts_params)]
        try:
            accepted = [await updates.__anext__() for updates in all_updates]   # a refusal raises (400/503) here
        except BaseException:
            for updates in all_updates:                   # the ones already queued are aborted
                await updates.aclose()
            raise
        if TEACHER.get():                                 # the presenter view follows the teacher's requests
            controls.sent_by_teacher(request_id)
        if body.stream:
            return StreamingResponse(stream(kind, request_id, body, accepted[0], all_updates, echo),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        collect = asyncio.ensure_future(asyncio.gather(*[final_output(updates) for updates in all_updates]))
        gone = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():                            # the client left: cancelling aborts the request
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return Response(status_code=499)
        gone.cancel()
        outputs = collect.result()
        failed = request_error(outputs)
        if failed is not None:                            # serving it failed (the others were not touched)
            raise p.ServerError(500, failed)
        n = accepted[0].params.n
        choices = [choice_json(kind, body, i * n + c.index, c, echo and echo.prompts.get(i), out.prompt_logprobs,
                               echo.only if echo else False)
                   for i, out in enumerate(outputs) for c in out.outputs]
        response = {"id": request_id, "object": p.OBJECT[kind], "created": p.now_s(),
                    "model": settings.served_model_name, "choices": choices,
                    "usage": outputs_usage(outputs, echo is not None and echo.only)}
        if kind == "chat" and body.prompt_logprobs is not None:
            response["prompt_logprobs"] = p.prompt_logprobs_json(outputs[0].prompt_logprobs,
                                                                 body.return_tokens_as_token_ids)
        return JSONResponse(response)

    async def stream(kind: p.Kind, request_id: str, body: p.SamplingFields, accepted: Accepted,
                     all_updates: list[AsyncIterator[Any]], echo: Optional[Echo]) -> AsyncIterator[str]:
        created, include_usage = p.now_s(), body.include_usage
        n, as_ids = accepted.params.n, body.return_tokens_as_token_ids
        text_offsets: dict[int, int] = {}                 # completions' text_offset runs on per choice

        def chunk(choices: list[dict[str, Any]]) -> str:
            data = {"id": request_id, "object": p.CHUNK_OBJECT[kind], "created": created,
                    "model": settings.served_model_name, "choices": choices}
            if include_usage:
                data["usage"] = None
            return sse(data)

        def completion_logprobs(index: int, positions: list[p.Position]) -> dict[str, Any]:
            out = p.completion_logprobs(positions, body.logprobs or 0, as_ids, text_offsets.get(index, 0))
            text_offsets[index] = text_offsets.get(index, 0) + sum(len(t) for t in out["tokens"])
            return out

        if kind == "chat":                                # the role first, as OpenAI sends it
            for i in range(n):
                yield chunk([p.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)])
        outputs: dict[int, Any] = {}
        echoed: set[int] = set()
        try:
            async for prompt_index, update in merged(all_updates):
                assert isinstance(update, RequestDelta)
                if echo is not None and prompt_index not in echoed:   # the prompt first, with its log-probabilities
                    echoed.add(prompt_index)
                    token_ids, text = echo.prompts[prompt_index]
                    for j in range(n):
                        scored = list(zip(token_ids, update.prompt_logprobs or [None] * len(token_ids)))
                        logprobs = None if body.logprobs is None else completion_logprobs(prompt_index * n + j, scored)
                        yield chunk([p.completion_choice(prompt_index * n + j, text, None, logprobs=logprobs)])
                for d in update.samples:
                    index = prompt_index * n + d.index
                    text = "" if echo is not None and echo.only else d.text
                    with_logprobs = bool(d.logprobs) and not (echo is not None and echo.only)
                    if not text and d.finish_reason is None and not with_logprobs:
                        continue                              # a token that is not text yet (held back, half a char)
                    positions = list(zip(d.token_ids, d.logprobs)) if with_logprobs else []
                    if kind == "chat":
                        yield chunk([p.chat_chunk_choice(index, {"content": text} if text else {}, d.finish_reason,
                                                         p.chat_logprobs(positions, body.num_logprobs or 0, as_ids)
                                                         if with_logprobs else None)])
                    else:
                        yield chunk([p.completion_choice(index, text, d.finish_reason, logprobs=completion_logprobs(
                            index, positions) if with_logprobs else None)])
                if update.output is not None:
                    outputs[prompt_index] = update.output
                    failed = request_error([update.output])
                    if failed is not None:                # serving it failed: an error event, as vLLM sends
                        raise p.ServerError(500, failed)
        except p.ServerError as exc:                      # the server ended it (shutdown): say so, as vLLM does
            yield sse(exc.body())
            yield sse("[DONE]")
            return
        if include_usage and len(outputs) == len(all_updates):
            yield sse({"id": request_id, "object": p.CHUNK_OBJECT[kind], "created": created,
                       "model": settings.served_model_name, "choices": [],
                       "usage": outputs_usage([outputs[i] for i in sorted(outputs)], echo is not None and echo.only)})
        yield sse("[DONE]")

    def choice_json(kind: p.Kind, body: p.SamplingFields, index: int, c: Any, echoed: Optional[tuple[list[int], str]],
                    prompt_logprobs: Optional[list], echo_only: bool) -> dict[str, Any]:
        """One non-streamed choice, with the echoed prompt and the log-probabilities the request asked for."""
        as_ids = body.return_tokens_as_token_ids
        generated = [] if echo_only else list(zip(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
        if kind == "chat":
            logprobs = None if c.logprobs is None else p.chat_logprobs(generated, body.num_logprobs or 0, as_ids)
            return p.chat_choice(index, c.text, c.finish_reason, c.stop_reason, logprobs)
        text = ("" if echo_only else c.text) if echoed is None else echoed[1] + ("" if echo_only else c.text)
        logprobs = None
        if body.logprobs is not None:
            prompt_positions = [] if echoed is None else list(zip(echoed[0],
                                                                  prompt_logprobs or [None] * len(echoed[0])))
            logprobs = p.completion_logprobs(prompt_positions + generated, body.logprobs, as_ids)
        choice = p.completion_choice(index, text, c.finish_reason, c.stop_reason, logprobs)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = p.prompt_logprobs_json(prompt_logprobs, as_ids)
        return choice

    return app


def field_path(loc: Any) -> str:
    """pydantic's error location as a field path: ("body", "messages", 0, "role") -> "messages[0].role"
    (pydantic's names of union branches, such as "list[int]", are left out)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not str(part).isidentifier() or part in PYDANTIC_TYPE_TAGS:
            break
        else:
            path += f".{part}" if path else str(part)
    return path


def not_ready_reason(async_engine: AsyncEngine, settings: ServerSettings) -> Optional[str]:
    """Why the server should not be sent requests now (None: it should)."""
    if async_engine.draining:
        return f"draining: {async_engine.draining}"
    if not async_engine.core_alive:
        return async_engine.dead or async_engine.core.exit_reason()
    silent_s = time.monotonic() - async_engine.last_alive
    if silent_s > settings.engine_stall_s:
        return (f"the engine core has been busy for {silent_s:.0f} s without finishing a step or command "
                f"(more than {settings.engine_stall_s:g} s)")
    limit = settings.max_waiting_requests
    if limit is not None and async_engine.num_waiting >= limit:
        return (f"the queue is full: {async_engine.num_waiting} samples wait for admission, the limit "
                f"(--max-waiting-requests) is {limit}")
    return None


async def drain(async_engine: AsyncEngine, goodbye: asyncio.Event, timeout_s: float) -> None:
    """A graceful shutdown: refuse new requests (503), let those in flight finish for up to ``timeout_s``, then
    end the rest with an error (an error event in a stream), and say goodbye on every event stream."""
    async_engine.draining = "the server is shutting down"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while async_engine.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    goodbye.set()
    if async_engine.num_in_flight:
        async_engine.fail_all(p.ServerError(503, f"the server shut down before this request finished (it waited "
                                                 f"{timeout_s:g} s: minipaged serve --shutdown-timeout)."))
        deadline = loop.time() + 5.0
        while async_engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)                              # the last events and error chunks go out


@dataclass
class Echo:
    """Completions' ``echo``: each prompt's token ids and text (filled in by the routes), and whether the
    request generates nothing (``max_tokens=0``)."""

    only: bool
    prompts: dict[int, tuple[list[int], str]] = field(default_factory=dict)


async def merged(all_updates: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The updates of several requests as they come, each with its request's position; leaving early (or one
    failing) cancels the rest, which aborts them."""
    if len(all_updates) == 1:
        async for update in all_updates[0]:
            yield 0, update
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, updates: AsyncIterator[Any]) -> None:
        try:
            async for update in updates:
                await queue.put((index, update))
        except Exception as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, updates)) for i, updates in enumerate(all_updates)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def request_error(outputs: list[Any]) -> Optional[str]:
    """Why serving a request failed (a logits processor, the sampler, a policy or its grammar), if it did."""
    return next((f"this request failed while it was served: {c.error}" for out in outputs for c in out.outputs
                 if c.error), None)


async def final_output(updates: AsyncIterator[Any]) -> Any:
    async for update in updates:
        if isinstance(update, RequestDelta) and update.output is not None:
            return update.output
    raise p.ServerError(500, "the request ended without an output.")


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def outputs_usage(outputs: list[Any], echo_only: bool = False) -> dict[str, int]:
    """Usage over every prompt of a request; echo with max_tokens=0 generated nothing the caller sees."""
    return p.usage(sum(len(o.prompt_token_ids) for o in outputs),
                   0 if echo_only else sum(c.num_tokens for o in outputs for c in o.outputs))
