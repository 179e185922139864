"""The teacher's controls as students and the teacher see them in the page (headless Chromium, real servers):
prompts off disables the box and says why; with others' text hidden a student reads their own answer and
nobody else's; the presenter view (``?presenter``, with the key) selects the teacher's newest request."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page
from browser_util import wait_for as wait_for_page
from serve_util import running_server

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
KEY = "teacher-key"
SERVER = ("--block-size", "4", "--num-blocks", "64", "--api-key", KEY, "--open-page")


def wait_for(page, expression: str, what: str):
    """``browser_util.wait_for``, while the page may still be loading (its elements may be missing)."""
    return wait_for_page(page, expression, what, tolerate_errors=True)


@needs_chromium
def test_with_prompts_off_a_students_box_is_disabled_and_says_why(tiny_model, tmp_path):
    with running_server(tiny_model, *SERVER, "--page-prompts", "off", "--page-prompt-rate", "3",
                        log_path=str(tmp_path / "server.log")) as url:
        async def run() -> dict:
            async with open_page(url + "/") as page:
                await wait_for(page, "document.getElementById('prompt').disabled", "the box was never disabled")
                return await evaluate(page, """(() => ({
                    connected: window.minipaged.view.connected, asked: !document.getElementById('key-form').hidden,
                    send: document.getElementById('send').disabled,
                    placeholder: document.getElementById('prompt').placeholder,
                    status: document.getElementById('prompt-status').textContent,
                    settings: document.getElementById('teacher-settings').textContent}))()""")
        seen = asyncio.run(run())
    assert seen["connected"] and not seen["asked"]          # --open-page: a student watches without the key
    assert seen["send"] and "turned student prompts off" in seen["placeholder"]
    assert "student prompts are off" in seen["status"]
    assert "student prompts off" in seen["settings"] and "at most 3 a minute" in seen["settings"]
    assert "up to 64 tokens" in seen["settings"] and "shown" in seen["settings"]


def send_as_teacher(url: str, prompt: str) -> str:
    answer = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"prompt": prompt, "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


@needs_chromium
def test_hidden_text_shows_a_student_only_their_own_and_the_presenter_follows_the_teacher(tiny_model, tmp_path):
    with running_server(tiny_model, *SERVER, "--hide-others-text", log_path=str(tmp_path / "server.log")) as url:
        async def student() -> dict:
            async with open_page(url + "/") as page:
                await wait_for(page, "window.minipaged.view.settings", "the page never got the teacher's settings")
                teacher_id = send_as_teacher(url, "teacher secret words")
                await evaluate(page, "document.getElementById('prompt').focus()")
                await page.call("Input.insertText", text="my own words")
                await evaluate(page, "document.getElementById('prompt-form').requestSubmit()")
                mine = await wait_for(page, """(() => { const m = window.minipaged, [id] = [...m.view.mine];
                    const r = id && m.head.requests.get(id);
                    return r && r.state === 'finished' && id; })()""", "the student's request never finished")
                await evaluate(page, "window.minipaged.draw()")
                return await evaluate(page, f"""(() => {{ const m = window.minipaged;
                    const row = (id) => document.querySelector(`tr[data-request="${{id}}"] td.prompt`).textContent;
                    return {{own: m.view.own.get("{mine}").text, output: document.getElementById('output').textContent,
                            title: document.getElementById('output-title').textContent, mine_row: row("{mine}"),
                            their_row: row("{teacher_id}"), body: document.body.innerText,
                            settings: document.getElementById('teacher-settings').textContent}}; }})()""")

        async def presenter() -> dict:
            async with open_page(url + "/?presenter=1") as page:
                await wait_for(page, "!document.getElementById('key-form').hidden", "the presenter never asked the key")
                await evaluate(page, f"""(() => {{ document.getElementById('key').value = '{KEY}';
                    document.getElementById('key-form').requestSubmit(); }})()""")
                await wait_for(page, "window.minipaged.view.settings && window.minipaged.view.settings.teacher",
                               "the key did not make the page the teacher's")
                # The keyless stream is closed when the key is given: a second one would fold its steps, text
                # hidden, over the keyed one's (the teacher's prompt came and went, once in a CI run).
                await wait_for(page, "window.minipaged.view.streams === 1 && window.minipaged.view.connected",
                               "the keyless stream stayed open beside the keyed one")
                first = send_as_teacher(url, "the first lesson prompt")
                await wait_for(page, f"window.minipaged.view.selected === '{first}'", "not following the first")
                second = send_as_teacher(url, "the second lesson prompt")
                await wait_for(page, f"window.minipaged.view.selected === '{second}'", "not following the second")
                # (selected before the next frame draws it: the text shows a frame later)
                await wait_for(page, "document.body.innerText.includes('the second lesson prompt')",
                               "the teacher's page never showed the teacher's prompt")
                return {"second": second, "title": await evaluate(
                    page, "document.getElementById('output-title').title"),
                    "body": await evaluate(page, "document.body.innerText")}

        seen = asyncio.run(student())
        shown = asyncio.run(presenter())
    assert seen["output"] == seen["own"] and "★ mine" in seen["title"]      # the student's own answer, in full
    assert "my own words" in seen["mine_row"] and "hidden" in seen["their_row"]
    assert "teacher secret" not in seen["body"] and "others' prompts and outputs hidden" in seen["settings"]
    assert shown["second"] in shown["title"] and "the second lesson prompt" in shown["body"]   # the teacher sees


async def type_and_send(page, text: str) -> None:
    await evaluate(page, "document.getElementById('prompt').focus()")
    await page.call("Input.insertText", text=text)
    await evaluate(page, "document.getElementById('prompt-form').requestSubmit()")


@needs_chromium
def test_a_429s_wait_counts_down_in_the_page(tiny_model, tmp_path):
    """A class trial's page said "try again in 48 s" and never changed it: the wait counts down each second."""
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--page-prompt-rate", "1",
                        log_path=str(tmp_path / "server.log")) as url:
        async def run() -> list[str]:
            async with open_page(url + "/") as page:
                await wait_for(page, "window.minipaged.view.settings", "the page never got the teacher's settings")
                await type_and_send(page, "the first prompt")
                await wait_for(page, "document.getElementById('prompt-status').textContent.includes('finished')",
                               "the first prompt never finished")
                await type_and_send(page, "one too many")
                first = await wait_for(page, """(() => { const t = document.getElementById('prompt-status')
                    .textContent; return t.includes('refused (429)') && t; })()""", "the second prompt was not refused")
                await asyncio.sleep(2.5)
                return [first, await evaluate(page, "document.getElementById('prompt-status').textContent")]
        first, later = asyncio.run(run())

    waits = [int(re.search(r"try again in (\d+) s", text).group(1)) for text in (first, later)]
    assert 50 <= waits[0] <= 60 and waits[0] - waits[1] >= 2, (first, later)


@needs_chromium
def test_with_others_text_hidden_a_student_reads_where_their_own_prompt_missed(tiny_model, tmp_path):
    """Everyone's copy of a step leaves out where a prompt first differs from a cached one; the student's own
    page says it for their own prompt (a class trial's page lost it)."""
    with running_server(tiny_model, *SERVER, "--hide-others-text", log_path=str(tmp_path / "server.log")) as url:
        async def run() -> str:
            async with open_page(url + "/") as page:
                await wait_for(page, "window.minipaged.view.settings", "the page never got the teacher's settings")
                for k, prompt in enumerate(["the blocks of a paged cache hold keys and values of every token",
                                            "the blocks of a paged cache hold nothing else at all, said the class"]):
                    await type_and_send(page, prompt)
                    await wait_for(page, f"""(() => {{ const m = window.minipaged, ids = [...m.view.mine];
                        const r = ids.length === {k + 1} && m.head.requests.get(ids[{k}]);
                        return r && r.state === 'finished'; }})()""", f"prompt {k} never finished")
                await evaluate(page, "window.minipaged.view.selected = [...window.minipaged.view.mine][1]")
                await evaluate(page, "window.minipaged.draw()")
                return await evaluate(page, "document.getElementById('output-cache').textContent")
        said = asyncio.run(run())
    assert re.search(r"block \d+ missed: tokens differ at position \d+", said), said
