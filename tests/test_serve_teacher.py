"""The teacher's controls over the page (minipaged/serve/teacher.py), against real ``minipaged serve`` processes.

Two students are two client addresses: 127.0.0.2 and 127.0.0.3 are both loopback on Linux, and a test binds its
connection's source address to one of them (httpx's ``local_address``), so the server sees two clients on real
TCP connections without trusting any forwarded header.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from minipaged.serve.teacher import STUDENT_STREAMS
from serve_util import openai_client, running_server

KEY = "teacher-key"
TEACHER = {"Authorization": f"Bearer {KEY}"}


def student(address: str) -> httpx.Client:
    """An HTTP client whose connections come from ``address`` (a student's machine, as the server sees it)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and all(w in error["message"] for w in words), error
    return error["message"]


def test_prompts_off_refuses_students_on_the_page_route_while_the_key_still_works(tiny_model, tmp_path):
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--api-key", KEY, "--open-page",
                        "--page-prompts", "off", log_path=str(tmp_path / "server.log")) as url, \
            student("127.0.0.2") as alice:
        shown = alice.get(url + "/v1/page/settings").json()      # no key: --open-page lets the page in
        assert shown["page_prompts"] == "off" and shown["teacher"] is False
        refused = alice.post(url + "/v1/page/prompt", json={"prompt": "hello"})
        assert_openai_error(refused, 403, "turned student prompts off", "--page-prompts off")
        # The OpenAI API keeps its key: a student without it gets 401, not a way around the teacher's switch.
        assert_openai_error(alice.post(url + "/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                            401, "--api-key")
        client = openai_client(url)
        client.api_key = KEY
        answer = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert answer.usage.completion_tokens == 3
        teacher_on_page = alice.post(url + "/v1/page/prompt", headers=TEACHER, json={"prompt": "hi", "stream": False})
        assert teacher_on_page.status_code == 200, teacher_on_page.text
        assert alice.get(url + "/v1/page/settings", headers=TEACHER).json()["teacher"] is True

        # Event streams without the key are counted per student (each holds a backlog and costs a snapshot).
        with contextlib.ExitStack() as streams, student("127.0.0.3") as bob:
            def open_stream(who: httpx.Client, headers: dict = {}) -> httpx.Response:
                return streams.enter_context(who.stream("GET", url + "/v1/events", headers=headers))
            tabs = [open_stream(alice) for _ in range(STUDENT_STREAMS)]
            assert [tab.status_code for tab in tabs] == [200] * STUDENT_STREAMS
            extra = open_stream(alice)
            extra.read()
            assert_openai_error(extra, 429, f"{STUDENT_STREAMS} event streams", "close another tab")
            assert open_stream(bob).status_code == 200 and open_stream(alice, TEACHER).status_code == 200
            tabs[0].close()                                  # a closed tab gives its place back
            deadline = time.monotonic() + 10
            while True:
                again = open_stream(alice)
                if again.status_code == 200 or time.monotonic() > deadline:
                    break
                again.close()
                time.sleep(0.1)
            assert again.status_code == 200, again.read()


def test_rate_limit_refuses_one_students_extra_prompts_not_anothers_and_caps_refuse_over_asks(tiny_model, tmp_path):
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--page-prompt-rate", "2",
                        "--page-max-tokens", "6", log_path=str(tmp_path / "server.log")) as url, \
            student("127.0.0.2") as alice, student("127.0.0.3") as bob:
        ask = {"prompt": "tell me", "stream": False}
        too_long = alice.post(url + "/v1/page/prompt", json={**ask, "prompt": "word " * 3000})
        # refused, and counted against the rate all the same: given back, it could be sent again without end
        assert_openai_error(too_long, 400, "maximum context length")
        answer = alice.post(url + "/v1/page/prompt", json=ask)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] <= 6            # --page-max-tokens is also the default
        refused = alice.post(url + "/v1/page/prompt", json=ask)
        assert_openai_error(refused, 429, "127.0.0.2", "2 a minute", "--page-prompt-rate")
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert bob.post(url + "/v1/page/prompt", json=ask).status_code == 200     # another student is not held
        started = (tmp_path / "server.log").read_text()      # the teacher reads the settings at start
        assert "minipaged serve: teacher's settings: student prompts on, at most 2 a minute each; answers up to 6 " \
               "tokens" in started, started
        # The OpenAI API keeps its own limits: the rate is the page's.
        api = alice.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert api.status_code == 200, api.text
        # Over a cap: refused with the flag named (and not counted against the rate).
        with student("127.0.0.4") as carol:
            assert_openai_error(carol.post(url + "/v1/page/prompt", json={**ask, "max_tokens": 7}), 400,
                                "at most 6 new tokens", "--page-max-tokens")
            assert_openai_error(carol.post(url + "/v1/page/prompt", json={**ask, "temperature": 0.9}), 400,
                                "at most 0.7", "--page-max-temperature")
            assert_openai_error(carol.post(url + "/v1/page/prompt", json={**ask, "top_p": 0.5}), 400, "top_p")
            for _ in range(2):
                assert carol.post(url + "/v1/page/prompt", json={**ask, "temperature": 0.5}).status_code == 200


def test_a_forwarded_header_from_this_machine_is_not_another_student(tiny_model, tmp_path):
    """uvicorn believes X-Forwarded-For from 127.0.0.1 by default: a script on the teacher's machine could name a
    fresh client on each request and send page prompts without bound. The server counts the connection's address."""
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--page-prompt-rate", "1",
                        "--page-max-tokens", "2", log_path=str(tmp_path / "server.log")) as url, \
            student("127.0.0.1") as script:
        ask = {"prompt": "tell me", "stream": False}
        first = script.post(url + "/v1/page/prompt", json=ask, headers={"X-Forwarded-For": "10.9.9.9"})
        assert first.status_code == 200, first.text
        again = script.post(url + "/v1/page/prompt", json=ask, headers={"X-Forwarded-For": "10.9.9.8"})
        message = assert_openai_error(again, 429, "from 127.0.0.1", "--page-prompt-rate")
        assert "10.9.9" not in message


def read_events(url: str, headers: dict, seen: list, stop: threading.Event) -> None:
    """Collect the SSE messages of /v1/events (event name, data) until ``stop``."""
    with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as http:
        with http.stream("GET", url + "/v1/events", headers=headers) as response:
            assert response.status_code == 200
            name = "message"
            lines = response.iter_lines()
            while not stop.is_set():
                try:
                    line = next(lines)
                except httpx.ReadTimeout:
                    continue
                except StopIteration:
                    return
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    seen.append((name, line[6:]))
                    name = "message"


def test_hidden_text_never_reaches_a_students_stream_but_the_teacher_sees_all(tiny_model, tmp_path):
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--api-key", KEY, "--open-page",
                        "--hide-others-text", log_path=str(tmp_path / "server.log")) as url, \
            student("127.0.0.2") as alice:
        streams = {"student": [], "teacher": []}
        stop = threading.Event()
        readers = [threading.Thread(target=read_events, args=(url, headers, streams[who], stop), daemon=True)
                   for who, headers in (("student", {}), ("teacher", TEACHER))]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 30
        while not all(any(json.loads(d).get("type") == "engine" for _, d in s) for s in streams.values()):
            assert time.monotonic() < deadline, "the watchers never got the engine header"
            time.sleep(0.05)
        mine = alice.post(url + "/v1/page/prompt", json={"prompt": "zebras in the student prompt", "stream": False})
        assert mine.status_code == 200, mine.text
        theirs = httpx.post(url + "/v1/completions", headers=TEACHER, timeout=60,
                            json={"prompt": "giraffes in the teacher prompt", "max_tokens": 4, "logprobs": 1}).json()
        ids = {mine.json()["id"], theirs["id"]}
        while not all(ids <= {f["request_id"] for _, d in s if json.loads(d).get("type") == "step"
                              for f in json.loads(d)["finished"]} for s in streams.values()):
            assert time.monotonic() < deadline, "the watchers did not see both requests finish"
            time.sleep(0.05)
        # whole prompts: for the teacher only
        assert_openai_error(alice.get(url + f"/v1/events/prompts/{theirs['id']}"), 403, "--hide-others-text")
        whole = alice.get(url + f"/v1/events/prompts/{mine.json()['id']}", headers=TEACHER)
        assert whole.status_code == 200 and "zebras" in whole.json()["prompt"]
        stop.set()
        for reader in readers:
            reader.join(5)
    student_steps = [json.loads(d) for name, d in streams["student"] if name == "message"]
    student_raw = "".join(d for _, d in streams["student"])
    assert "zebras" not in student_raw and "giraffes" not in student_raw
    steps = [s for s in student_steps if s.get("type") == "step"]
    assert any(s["arrivals"] for s in steps) and all(a["prompt"] == "" for s in steps for a in s["arrivals"])
    assert all(not s["new_text"] for s in steps)
    generated = [ids for s in steps for ids in s["new_token_ids"].values()]
    assert generated and all(t == -1 for ids in generated for t in ids)      # counted, not readable
    assert not any(s.get("new_logprobs") for s in steps)                     # nor guessed from logprobs
    teacher_raw = "".join(d for _, d in streams["teacher"])
    assert "zebras" in teacher_raw and "giraffes" in teacher_raw
    assert any(json.loads(d).get("new_logprobs") for name, d in streams["teacher"] if name == "message")
    told = [json.loads(d)["request_id"] for name, d in streams["teacher"] if name == "teacher"]
    assert told == [theirs["id"]]                          # the presenter view follows the teacher's request
    assert not [1 for name, _ in streams["student"] if name == "teacher"]


def test_events_without_text_keep_counts_and_the_rate_window_slides():
    from minipaged.events import PrefixLookup, RequestArrival, ScheduledRequest, StepEvent, describe_prefix_lookup
    from minipaged.serve.protocol import ServerError
    from minipaged.serve.teacher import PromptRate, step_payloads

    # (a miss told to the token would let a student guess another's prompt a token at a time)
    lookup = PrefixLookup(num_blocks=3, num_hit_blocks=1, reason="differs", differs_at=21)
    event = StepEvent(step=3, time_s=0.1, duration_s=0.01, schedule_s=0.0, model_s=0.01, budget_limit=16,
                      budget_used=3, max_num_seqs=4,
                      arrivals=(RequestArrival("r0", 5, 8, "secret words", prefix_lookup=lookup),),
                      scheduled=(ScheduledRequest("r0", "decode", 5, 8, 5, 0, 2, draft_token_ids=(7, 8),
                                                  num_accepted=1, draft_pieces=("a", "b"), target_piece="c",
                                                  prefix_lookup=lookup),),
                      new_token_ids={"r0": [7, 9]}, new_text={"r0": "secret out"}, new_logprobs={"r0": [-0.25, -3.5]})
    assert step_payloads(event, hide_text=False) == (event.to_json(), None)
    full, without_text = step_payloads(event, hide_text=True)
    assert full == event.to_json() and "secret" in full
    assert "secret" not in without_text and '"a"' not in without_text
    assert "-3.5" in full and "-3.5" not in without_text      # a token's log-probability fingerprints the token
    hidden = StepEvent.from_dict(json.loads(without_text))             # still an event a page can fold
    assert hidden.new_token_ids == {"r0": [-1, -1]} and hidden.scheduled[0].draft_token_ids == (-1, -1)
    assert hidden.new_logprobs == {}
    assert hidden.scheduled[0].num_accepted == 1 and hidden.arrivals[0].prompt_len == 5 and hidden.budget_used == 3
    for shown in (hidden.arrivals[0].prefix_lookup, hidden.scheduled[0].prefix_lookup):
        assert shown.reason == "differs" and shown.num_hit_blocks == 1 and shown.differs_at is None
        assert describe_prefix_lookup(shown) == "1/3 blocks hit; block 1 missed: tokens differ from the cached ones"

    now = [0.0]
    rate = PromptRate(2, clock=lambda: now[0])
    rate.take("a"), rate.give_back("a"), rate.take("b"), rate.take("a"), rate.take("a")
    now[0] = 59.0
    with pytest.raises(ServerError) as refused:
        rate.take("a")
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    rate.take("b")
    now[0] = 60.0                                       # the first prompt has left the window
    rate.take("a")
    now[0] = 200.0
    rate.take("c")
    assert set(rate.sent) == {"c"}                     # idle students are forgotten


def test_serve_says_when_the_teachers_settings_will_not_do_what_they_seem_to():
    from minipaged.serve.limits import PageSettings
    from minipaged.serve.teacher import setting_notes

    assert setting_notes(PageSettings(), has_key=False) == setting_notes(PageSettings(), has_key=True) == []
    assert setting_notes(PageSettings(prompts=False, open_page=True), has_key=True) == []
    forgot_open = setting_notes(PageSettings(hide_others_text=True), has_key=True)
    assert len(forgot_open) == 1 and "--open-page" in forgot_open[0]
    no_key = " ".join(setting_notes(PageSettings(hide_others_text=True, prompt_rate=3), has_key=False))
    assert "every page (the teacher's too)" in no_key and "OpenAI API directly" in no_key


def test_serve_prints_the_teachers_settings_as_the_page_shows_them():
    """A class trial's teacher could not see at start what the page would allow; the line names every setting."""
    from minipaged.serve.limits import PageSettings
    from minipaged.serve.teacher import settings_line

    default = settings_line(PageSettings(), has_key=False)
    assert default == ("teacher's settings: student prompts on, no rate limit; answers up to 64 tokens, greedy "
                       "(temperature up to 0.7 if asked); others' prompts and outputs shown; no --api-key: anyone "
                       "may use the page and the API")
    class_room = settings_line(PageSettings(prompts=False, prompt_rate=3, max_tokens=32, max_temperature=0.0,
                                            hide_others_text=True, open_page=True), has_key=True)
    for words in ("prompts off", "at most 3 a minute", "up to 32 tokens", "temperature up to 0.0",
                  "outputs hidden", "no key (--open-page)"):
        assert words in class_room, (words, class_room)
    assert "every page needs --api-key" in settings_line(PageSettings(), has_key=True)


@pytest.mark.parametrize("flags, problem", [(["--open-page"], "--open-page opens the page's routes"),
                                            (["--page-prompt-rate", "0"], "--page-prompt-rate must be at least 1"),
                                            (["--page-max-temperature", "-1"], "--page-max-temperature must be")])
def test_teacher_flags_that_cannot_work_are_refused_before_the_model_loads(flags, problem, capsys):
    from minipaged.cli import main

    assert main(["serve", *flags]) == 2
    assert problem in capsys.readouterr().err


def test_page_prompt_without_stream_answers_one_json_body_as_openai_does(tiny_engine_factory):
    """OpenAI's routes stream only when asked (``stream`` absent means false); the page's route is answered like a
    chat completion, so a script that leaves ``stream`` out gets one JSON body, and ``stream: true`` (what the
    page sends) still gets server-sent events. In process: the default is the server's, not the transport's."""
    from fastapi.testclient import TestClient

    from minipaged.serve.api_server import ServerSettings, build_app

    with TestClient(build_app(tiny_engine_factory(), ServerSettings("tiny"))) as http:
        plain = http.post("/v1/page/prompt", json={"prompt": "hi", "max_tokens": 2})
        assert plain.status_code == 200, plain.text
        assert plain.headers["content-type"].startswith("application/json")
        assert plain.json()["object"] == "chat.completion" and plain.json()["usage"]["completion_tokens"] == 2
        streamed = http.post("/v1/page/prompt", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")


def test_the_page_asks_for_a_stream_explicitly():
    """The page reads its answer as server-sent events, so it must say ``stream: true``: the route's default is
    OpenAI's (no stream)."""
    from minipaged.web import static_file

    app = static_file("app.mjs")[0]
    app = app.decode() if isinstance(app, bytes) else app
    call = app[app.index('fetch("v1/page/prompt"'):]
    assert "stream: true" in call[:call.index("});")]


def test_a_students_own_miss_position_reaches_that_student_alone_late_pages_included():
    """Under --hide-others-text everyone's copy of a step leaves out where a prompt first differs from a cached one;
    a class trial's student lost it for their own prompt too. The position of a student's own request goes to that
    student's streams (an own_lookup message), to a page of theirs that opens later, and to nobody else's."""
    from minipaged.events import PrefixLookup, RequestArrival, ScheduledRequest, StepEvent
    from minipaged.serve.limits import PageSettings
    from minipaged.serve.teacher import PageControls

    class Stream:                                       # what PageControls needs of an event_hub.Watcher
        def __init__(self) -> None:
            self.said: list[str] = []

        def say(self, text: str) -> None:
            self.said.append(text)

    def told(stream: Stream) -> list[dict]:
        return [json.loads(m.split("data: ", 1)[1]) for m in stream.said if m.startswith("event: own_lookup\n")]

    controls = PageControls(PageSettings(hide_others_text=True, open_page=True))
    alice, bob, teacher = Stream(), Stream(), Stream()
    controls.watch(alice, teacher=False, client="10.0.0.2")
    controls.watch(bob, teacher=False, client="10.0.0.3")
    controls.watch(teacher, teacher=True, client="10.0.0.1")
    controls.sent("chatcmpl-alice", "10.0.0.2")
    controls.sent("cmpl-bob", "10.0.0.3")
    lookup = PrefixLookup(num_blocks=5, num_hit_blocks=2, reason="differs", differs_at=9)
    event = StepEvent(step=3, time_s=0.1, duration_s=0.01, schedule_s=0.0, model_s=0.01, budget_limit=16,
                      budget_used=8, max_num_seqs=4,
                      arrivals=(RequestArrival("chatcmpl-alice", 20, 8, "", prefix_lookup=lookup),),
                      scheduled=(ScheduledRequest("chatcmpl-alice", "prefill", 8, 16, 20, 8, 0, prefix_lookup=lookup),
                                 ScheduledRequest("cmpl-bob-1.2", "prefill", 0, 8, 20, 0, 0,
                                                  prefix_lookup=PrefixLookup(5, 1, "differs", differs_at=6))))
    controls.own_lookups(event)
    assert [t["request_id"] for t in told(alice)] == ["chatcmpl-alice", "chatcmpl-alice"]
    assert told(alice)[0]["prefix_lookup"]["differs_at"] == 9 and told(alice)[0]["prefix_lookup"]["reason"] == "differs"
    # Bob's second prompt's third sample is his request's; the teacher's stream has every position already
    assert [(t["request_id"], t["prefix_lookup"]["differs_at"]) for t in told(bob)] == [("cmpl-bob-1.2", 6)]
    assert not told(teacher)
    later = Stream()                                     # Alice's page reopened: told again
    controls.watch(later, teacher=False, client="10.0.0.2")
    assert told(later) and told(later)[-1]["prefix_lookup"]["differs_at"] == 9
    controls.unwatch(alice), controls.unwatch(later)
    controls.own_lookups(event)
    assert len(told(alice)) == 2 and "10.0.0.2" not in controls.student_watchers
