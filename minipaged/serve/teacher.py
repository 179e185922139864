"""The teacher's controls over the page: who is the teacher, what a student's page prompt may ask, how often,
and what other clients' text a student's page is sent.

A projected page shows whatever anyone types and whatever a 135M model answers (issue 41). So the page's prompt
box has its own route, ``POST /v1/page/prompt``, with the teacher's limits (``limits.PageSettings``: on or off, a
rate per client, caps on ``max_tokens`` and ``temperature``); the OpenAI API keeps its key and its own limits.

Who is the teacher: whoever sends the server's ``--api-key`` (``http_guards.ApiKeyCheck`` sets ``TEACHER``). With
``--open-page`` the page's own routes (the event stream, page prompts, the settings, whole prompts) answer
students without the key; everything else still wants it. A server without a key has no teacher: every page is a
student's, and the teacher's controls apply to all of them.

Who is a student: a client address (``fair_share.CLIENT``), as the per-client quotas count them (a class shares
one network, not one key). Addresses are not forwarded headers (``serve.NO_FORWARDED_HEADERS``): a proxy in
front of the server makes every student one client. Loopback addresses are clients like any other here (unlike
the API quotas, where 127.0.0.1 and ::1 keep to no share): 127.0.0.2 and 127.0.0.3 are two students, which is
how the tests act as two.

Hidden text: with ``--hide-others-text`` a student's event stream is a redacted copy (``redacted``: no prompt
previews, no output text or its log-probabilities, token ids replaced by -1 so that counts still add up),
serialised once per step for every such watcher, and whole prompts are refused. The page shows its own requests'
text from what it sent and what its own response streamed back, so a student still reads their own answer. The
redacted copy leaves out where a prompt first differs from a cached one (it would tell others' prompts a token at
a time); a student's own requests' positions reach that student's streams alone, as ``own_lookup`` messages
(``PageControls.own_lookups``), late ones included.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import OrderedDict, deque
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Optional

from ..events import StepEvent
from .event_hub import Watcher
from .limits import PageSettings, ServerLimits
from .protocol import ServerError

TEACHER: ContextVar[bool] = ContextVar("minipaged_teacher", default=False)   # set by http_guards.ApiKeyCheck
JSON_SEPARATORS = (",", ":")             # as StepEvent.to_json writes events
WINDOW_S = 60.0                          # --page-prompt-rate counts prompts in the last minute
RECENT_TEACHER_REQUESTS = 64             # a presenter page that connects late still finds these
STUDENT_STREAMS = ServerLimits().max_client_event_streams   # event streams one student may hold open (tabs)
RECENT_OWNERS = 1024                     # requests whose client is remembered (their own prefix-miss positions)
RECENT_OWN_LOOKUPS = 16                  # a student's page that connects late is told these of its own
# Under /v1 (behind the key) unless --open-page: the page's own routes.
PAGE_ROUTES = ("/v1/events", "/v1/page/prompt", "/v1/page/settings")
PAGE_ROUTE_PREFIXES = ("/v1/events/prompts/",)


def is_page_route(path: str) -> bool:
    return path in PAGE_ROUTES or path.startswith(PAGE_ROUTE_PREFIXES)


class PromptRate:
    """At most ``per_minute`` page prompts from one client in any 60 s (a sliding window: each client keeps the
    times of its last ``per_minute`` prompts, and an idle client is forgotten)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self.clock = per_minute, clock
        self.sent: dict[str, deque[float]] = {}

    def take(self, client: str) -> None:
        now = self.clock()
        for other in [c for c, times in self.sent.items() if not times or now - times[-1] >= WINDOW_S]:
            del self.sent[other]                         # memory stays bounded by the clients of the last minute
        times = self.sent.setdefault(client, deque())
        while times and now - times[0] >= WINDOW_S:
            times.popleft()
        if len(times) >= self.per_minute:
            wait = max(1, math.ceil(WINDOW_S - (now - times[0])))
            raise ServerError(429, f"too many page prompts from {client}: the teacher allows {self.per_minute} a "
                                   f"minute per student (minipaged serve --page-prompt-rate); try again in "
                                   f"{wait} s.", headers={"Retry-After": str(wait)})
        times.append(now)

    def give_back(self, client: str) -> None:
        """The prompt just taken was refused for another reason (too long, the server busy): it does not count."""
        times = self.sent.get(client)
        if times:
            times.pop()


class PageControls:
    """``PageSettings`` applied: refusals for page prompts, the settings a page shows, the teacher's requests."""

    def __init__(self, settings: PageSettings) -> None:
        self.settings = settings
        self.rate = PromptRate(settings.prompt_rate) if settings.prompt_rate else None
        self.teacher_requests: deque[str] = deque(maxlen=RECENT_TEACHER_REQUESTS)
        self.teacher_watchers: set[Watcher] = set()     # event streams opened with the key (on the event loop)
        # --hide-others-text: whose each recent request is, each student's streams without others' text, and the
        # prefix-cache answers of each student's recent requests, position included (all on the event loop)
        self.owners: OrderedDict[str, str] = OrderedDict()
        self.student_watchers: dict[str, set[Watcher]] = {}
        self.client_of: dict[Watcher, str] = {}
        self.recent_lookups: dict[str, deque[str]] = {}

    def admit(self, client: str, teacher: bool, max_tokens: Optional[int], temperature: Optional[float]) -> None:
        """Refuse a page prompt the teacher's settings do not allow (403 off, 429 over the rate, 400 over a cap).

        Caps refuse rather than clamp: the page's box never asks for more, so a request over a cap was written by
        hand, and its writer learns the limit and the flag instead of silently getting less than asked."""
        s = self.settings
        if teacher:
            return                                      # the teacher's own prompts keep to the API's limits only
        if not s.prompts:
            raise ServerError(403, "the teacher has turned student prompts off (minipaged serve --page-prompts "
                                   "off): this page still shows the engine; ask the teacher to send your prompt.")
        if max_tokens is not None and max_tokens > s.max_tokens:
            raise ServerError(400, f"a page prompt may ask for at most {s.max_tokens} new tokens (the teacher's "
                                   f"--page-max-tokens); ask for {s.max_tokens} or fewer.", "max_tokens")
        if temperature is not None and temperature > s.max_temperature:
            raise ServerError(400, f"a page prompt may ask for a temperature of at most {s.max_temperature:g} (the "
                                   f"teacher's --page-max-temperature); ask for {s.max_temperature:g} or less.",
                              "temperature")
        if self.rate is not None:
            self.rate.take(client)

    def refused(self, client: str, teacher: bool) -> None:
        """A page prompt that ``admit`` let through was refused further on: it takes none of the client's rate."""
        if self.rate is not None and not teacher:
            self.rate.give_back(client)

    def hides_text_from(self, teacher: bool) -> bool:
        return self.settings.hide_others_text and not teacher

    def describe(self, teacher: bool, has_key: bool) -> dict[str, Any]:
        """What ``GET /v1/page/settings`` answers: the settings, for the page to show students."""
        s = self.settings
        return {"page_prompts": "on" if s.prompts else "off", "prompt_rate_per_minute": s.prompt_rate,
                "max_tokens": s.max_tokens, "max_temperature": s.max_temperature,
                "others_text": "hidden" if s.hide_others_text else "shown", "teacher": teacher,
                "presenter_available": has_key}

    def watch(self, watcher: Watcher, teacher: bool, client: str = "local") -> None:
        """A new event stream: the teacher's is told the teacher's recent requests (a presenter page that comes
        late), and each new one as it is accepted (``sent_by_teacher``); a student's without others' text is told
        the prefix-cache answers of the student's own recent requests (``own_lookups``). How many streams a
        student may hold is ``event_hub.StreamLimits``' to say, keyed server or not."""
        if teacher:
            self.teacher_watchers.add(watcher)
            for request_id in self.teacher_requests:
                watcher.say(teacher_event(request_id))
        if self.hides_text_from(teacher):
            self.client_of[watcher] = client
            self.student_watchers.setdefault(client, set()).add(watcher)
            for message in self.recent_lookups.get(client, ()):
                watcher.say(message)

    def unwatch(self, watcher: Watcher) -> None:
        self.teacher_watchers.discard(watcher)
        client = self.client_of.pop(watcher, None)
        if client is not None and client in self.student_watchers:
            self.student_watchers[client].discard(watcher)
            if not self.student_watchers[client]:
                del self.student_watchers[client]

    def sent(self, request_id: str, client: str) -> None:
        """A request is sent from ``client`` (before the core answers): its own prefix-miss positions go to that
        client's streams."""
        if not self.settings.hide_others_text:
            return
        self.owners[request_id] = client
        while len(self.owners) > RECENT_OWNERS:
            self.owners.popitem(last=False)

    def own_lookups(self, event: StepEvent) -> None:
        """Each prefix-cache answer in ``event`` that says where a prompt first differs goes, whole, to the streams
        of the client who sent it (the redacted copy everyone else gets leaves the position out: ``_coarse``).
        Called on the event loop before the step's payload is queued; the page keeps them by request id."""
        for request_id, lookup in _lookups(event):
            client = next((self.owners[i] for i in _accepted_ids(request_id) if i in self.owners), None)
            if client is None or lookup.differs_at is None:
                continue
            message = own_lookup_event(request_id, dataclasses.asdict(lookup))
            recent = self.recent_lookups.setdefault(client, deque(maxlen=RECENT_OWN_LOOKUPS))
            recent.append(message)
            for watcher in self.student_watchers.get(client, ()):
                watcher.say(message)
        while len(self.recent_lookups) > RECENT_OWNERS:    # clients long gone: the oldest first
            del self.recent_lookups[next(iter(self.recent_lookups))]

    def sent_by_teacher(self, request_id: str) -> None:
        """The teacher's request was accepted: the presenter view follows it."""
        self.teacher_requests.append(request_id)
        for watcher in self.teacher_watchers:
            watcher.say(teacher_event(request_id))


def teacher_event(request_id: str) -> str:
    """An SSE message for the teacher's watchers (never a student's): a request the teacher sent."""
    return f"event: teacher\ndata: {json.dumps({'request_id': request_id})}\n\n"


def own_lookup_event(request_id: str, lookup: dict[str, Any]) -> str:
    """An SSE message for one student's streams: the prefix-cache answer of one of their own requests, whole."""
    return f"event: own_lookup\ndata: {json.dumps({'request_id': request_id, 'prefix_lookup': lookup})}\n\n"


def _lookups(event: StepEvent) -> Iterable[tuple[str, Any]]:
    for record in (*event.arrivals, *event.scheduled):
        if record.prefix_lookup is not None:
            yield record.request_id, record.prefix_lookup


def _accepted_ids(request_id: str) -> Iterable[str]:
    """The ids a request may have been accepted under: its own, a sample's request's (``id.3``), and that of a
    request of several prompts (``id-2``), in that order."""
    yield request_id
    base, dot, sample = request_id.rpartition(".")
    if dot and sample.isdigit():
        yield base
        request_id = base
    head, dash, index = request_id.rpartition("-")
    if dash and index.isdigit():
        yield head


def settings_line(page: PageSettings, has_key: bool) -> str:
    """The teacher's settings in one line, printed when ``serve`` starts: the teacher sees what the class will get
    (as the page shows students) without opening the page, and a mistyped flag shows before the lesson, not
    in it."""
    access = ("the page needs no key (--open-page)" if page.open_page else "every page needs --api-key") if has_key \
        else "no --api-key: anyone may use the page and the API"
    return (f"teacher's settings: student prompts {'on' if page.prompts else 'off'}"
            + (f", at most {page.prompt_rate} a minute each" if page.prompt_rate else ", no rate limit")
            + f"; answers up to {page.max_tokens} tokens, greedy (temperature up to {page.max_temperature} if asked)"
            + f"; others' prompts and outputs {'hidden' if page.hide_others_text else 'shown'}; {access}")


def setting_notes(page: PageSettings, has_key: bool) -> list[str]:
    """What ``serve`` tells the teacher at start when the page's settings will not do what they seem to."""
    notes = []
    changed = page != dataclasses.replace(PageSettings(), open_page=page.open_page)
    if has_key and not page.open_page and changed:
        notes.append("every page needs --api-key, so whoever opens it holds the key and is the teacher: the page's "
                     "limits and hidden text apply to students only with --open-page.")
    if page.hide_others_text and not has_key:
        notes.append("--hide-others-text without --api-key: no page holds a key, so every page (the teacher's too) "
                     "shows only its own text, and the presenter view is not available.")
    if not has_key and (not page.prompts or page.prompt_rate):
        notes.append("without --api-key anyone can send prompts to the OpenAI API directly; the page's limits bind "
                     "only the page.")
    return notes


def step_payloads(event: StepEvent, hide_text: bool) -> tuple[str, Optional[str]]:
    """The event's JSON for the watchers who see text, and (with ``hide_text``) its copy without any text a client
    wrote or the model generated, for the others: prompt previews empty, no output text nor its log-probabilities,
    token ids as -1 (their number stays: the page counts tokens by them), no draft pieces. Both from one ``asdict``, the costly part
    (about a millisecond at 64 decodes)."""
    if not hide_text:
        return event.to_json(), None
    d = {"type": "step", **dataclasses.asdict(event)}
    return json.dumps(d, separators=JSON_SEPARATORS), json.dumps(without_text(d), separators=JSON_SEPARATORS)


def without_text(d: dict[str, Any]) -> dict[str, Any]:
    """A step event's dict (as ``StepEvent.to_json`` writes it) with its text taken out (a new dict; ``d`` stays).

    A prefix-cache miss keeps its reason but not the position where a prompt's tokens first differ from a cached
    one: told to the token, it would let a student guess another's prompt a token at a time. (Whole blocks still
    hit or miss: a guess that fills a block shows as a hit, as its faster first token would show anyway.)"""
    return {**d, "arrivals": [{**a, "prompt": "", "prefix_lookup": _coarse(a.get("prefix_lookup"))}
                              for a in d["arrivals"]],
            "scheduled": [{**s, "draft_token_ids": [-1] * len(s["draft_token_ids"]), "draft_pieces": [],
                           "target_piece": "", "prefix_lookup": _coarse(s.get("prefix_lookup"))}
                          for s in d["scheduled"]],
            "new_text": {}, "new_token_ids": {rid: [-1] * len(ids) for rid, ids in d["new_token_ids"].items()},
            "new_logprobs": {}}       # each token's log-probability fingerprints the token: none of them either


def _coarse(lookup: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return None if lookup is None else {**lookup, "differs_at": None}
