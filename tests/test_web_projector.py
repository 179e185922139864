"""Issue 50's class trial, the page on a projector: at 1366x768 it scrolled once requests finished, and at
1920x1080 it left about 45% of the screen empty with 13-15 px text. In projector mode the page fits the screen at
both sizes (no scrolling, every panel in view), the KV map fills its part of it, and every text is big enough to
read from the back of a room. And the token budget bar, a sliver on serve's defaults (2-13 of 2,048 tokens), is
drawn on a scale its steps fill. Headless Chromium against a real server; screenshots go to each test's tmp dir."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page, screenshot, wait_for
from serve_util import running_server

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
SCREENS = {"1366x768": (1366, 768), "1920x1080": (1920, 1080)}
POOL = 1456                                   # serve's default pool on the embedded model
READABLE_PX = 18                              # the smallest text a projected page shows (the trial's was 13)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("web-projector") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", str(POOL), log_path=str(log)) as url:
        # Requests that finished before the page looks: a class's earlier work (the finished queue is full)
        for i in range(14):
            answer = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": f"student {i} asks " + "about paged attention " * 4, "max_tokens": 24, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
        yield url


# Measured in the page: scrolling, panels out of view, how much of the screen the map's cells and the panels
# cover, and the size of every visible text.
MEASURE = """(() => {
  const se = document.scrollingElement, box = (e) => e.getBoundingClientRect();
  const shown = (e) => e.offsetParent !== null && getComputedStyle(e).visibility !== 'hidden' && box(e).width > 0;
  const panels = [...document.querySelectorAll('main > .panel')].filter(shown);
  const cells = [...document.querySelectorAll('#map .cell')];
  const cellArea = cells.reduce((a, c) => a + box(c).width * box(c).height, 0);
  const texts = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const e = n.parentElement;
    if (!n.textContent.trim() || !e || !shown(e) || e.closest('[hidden]')) continue;
    const r = box(e);
    if (r.bottom <= 0 || r.top >= innerHeight) continue;          // scrolled away inside its panel
    texts.push([parseFloat(getComputedStyle(e).fontSize), e.id || e.className || e.tagName,
                n.textContent.slice(0, 30)]);
  }
  const columns = {};
  for (const p of panels) {
    const left = Math.round(box(p).left);
    columns[left] = Math.max(columns[left] || 0, box(p).bottom);
  }
  return {
    scroll_height: se.scrollHeight, client_height: se.clientHeight, scroll_width: se.scrollWidth,
    client_width: se.clientWidth, width: innerWidth, height: innerHeight,
    out_of_view: panels.filter((p) => box(p).bottom > innerHeight + 1 || box(p).right > innerWidth + 1)
      .map((p) => p.id),
    cell_share: cellArea / (innerWidth * innerHeight), cells: cells.length,
    column_bottoms: Object.values(columns).map((b) => b / innerHeight),
    smallest_text: texts.reduce((a, t) => (t[0] < a[0] ? t : a), [1e9, '', '']),
    median_text: texts.map((t) => t[0]).sort((a, b) => a - b)[Math.floor(texts.length / 2)],
  };
})()"""


def save(tmp_path: Path, name: str, png: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(png)
    print(f"screenshot: {path}")
    return str(path)


async def type_a_prompt(page, text: str) -> None:
    await evaluate(page, "document.getElementById('prompt').focus()")
    await page.call("Input.insertText", text=text)
    await evaluate(page, "document.getElementById('prompt-form').requestSubmit()")


@needs_chromium
@pytest.mark.parametrize("screen", list(SCREENS))
def test_projector_mode_fits_the_screen_and_reads_from_the_back_of_the_room(server, screen, tmp_path):
    async def run() -> list[dict]:
        async with open_page(server + "/?projector=1", size=SCREENS[screen]) as page:
            await wait_for(page, "window.minipaged && window.minipaged.view.connected && !!window.minipaged.state",
                           "the page never connected to /v1/events")
            await type_a_prompt(page, "hello from the back row of the room")
            await wait_for(page, """(() => { const m = window.minipaged, mine = [...m.view.mine];
                const r = mine.length && m.head.requests.get(mine[0]);
                return !!r && r.state === 'finished'; })()""", "the typed prompt never finished")
            for i in range(30):                                # the finished queue fills while the page looks
                answer = await asyncio.to_thread(httpx.post, server + "/v1/completions", timeout=60, json={
                    "prompt": f"later student {i} asks", "max_tokens": 2})
                assert answer.status_code == 200, answer.text
            await wait_for(page, "window.minipaged.head.finishedOrder.length >= 31", "the queue never filled")
            seen = []
            for when in ("finished", "running"):
                if when == "running":                          # back to a step at which the own request ran
                    index = await evaluate(page, """(() => { const m = window.minipaged, mine = [...m.view.mine][0];
                        return m.view.events.findIndex((e) => (e.running || []).includes(mine)); })()""")
                    assert index >= 0
                    await evaluate(page, f"window.minipaged.goto({index})")
                await asyncio.sleep(0.5)
                measured = await evaluate(page, MEASURE)
                measured["png"] = save(tmp_path, f"projector-{screen}-{when}.png", await screenshot(page))
                seen.append(measured)
            return seen

    for seen in asyncio.run(run()):
        assert seen["scroll_height"] <= seen["client_height"] + 1, ("the page scrolls", seen)
        assert seen["scroll_width"] <= seen["client_width"] + 1 and not seen["out_of_view"], seen
        # The map's cells cover a good part of the screen, and both columns of panels reach its foot.
        assert seen["cell_share"] >= 0.22, ("the map is small on this screen", seen)   # 0.12 at 1920 before
        assert min(seen["column_bottoms"]) >= 0.9, ("a column leaves the screen's foot empty", seen)
        assert seen["smallest_text"][0] >= READABLE_PX, ("text too small for a room", seen["smallest_text"], seen)
        if seen["width"] >= 1920:                              # a bigger screen: bigger text, not more blank
            assert seen["median_text"] >= 24, seen


@needs_chromium
def test_the_budget_bar_shows_a_small_step_on_a_scale_it_fills(server, tmp_path):
    async def run() -> dict:
        async with open_page(server + "/", size=SCREENS["1366x768"]) as page:
            await wait_for(page, "window.minipaged && window.minipaged.view.connected && !!window.minipaged.state",
                           "the page never connected to /v1/events")
            await type_a_prompt(page, "a short question")
            await wait_for(page, """(() => { const m = window.minipaged, mine = [...m.view.mine];
                const r = mine.length && m.head.requests.get(mine[0]);
                return !!r && r.state === 'finished'; })()""", "the typed prompt never finished")
            index = await evaluate(page, """window.minipaged.view.events.findIndex((e) => e.budget_used > 0
                && e.budget_used <= 13)""")
            assert index >= 0, "no step used 1-13 tokens"
            await evaluate(page, f"window.minipaged.goto({index})")
            await asyncio.sleep(0.5)
            seen = await evaluate(page, """(() => {
              const bar = document.getElementById('batch-bar'), ev = window.minipaged.state.lastEvent;
              const used = [...bar.children].reduce((a, s) => a + s.getBoundingClientRect().width, 0);
              return {share: used / bar.getBoundingClientRect().width, used: ev.budget_used, limit: ev.budget_limit,
                      scale: document.getElementById('budget-scale').textContent,
                      title: document.getElementById('batch-title').textContent}; })()""")
            seen["png"] = save(tmp_path, "budget.png", await screenshot(page))
            return seen

    seen = asyncio.run(run())
    assert seen["limit"] == 2048 and 1 <= seen["used"] <= 13, seen       # serve's default budget
    assert seen["share"] >= 0.12, ("the step is a sliver of the bar", seen)
    assert "zoomed" in seen["scale"] and f"{seen['used']} of the 2,048-token budget" in seen["scale"], seen
    assert f"{seen['used']}/2048 tokens of the budget" in seen["title"], seen
