"""Issue 41 item 2: the web page read by a room, in headless Chromium at 1366x768 and in projector mode.

No sideways scrolling and one header line; the student's own request (typed in the page's box) selected, named
r0, r1 ... as the TUI names requests (its id on hover), marked with a white ring and a ★, and its output in view
without scrolling; a KV map of a pool the size of serve's default (1,456 blocks) drawn as a window that holds the requests' blocks,
with a legend for grouped and "+" cells; a computed column in words; a replay without live-only controls.
Screenshots are written to each test's tmp dir (their paths are printed).
"""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page, screenshot, wait_for
from serve_util import running_server

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
ROOM = (1366, 768)
POOL = 1456                                   # serve's default pool on the embedded model
CELLS_JS = "[...document.querySelectorAll('#map .cell')]"
NODE = shutil.which("node")
HERE = Path(__file__).parent


@pytest.mark.skipif(NODE is None, reason="node (20 or later) is not installed: apt-get install nodejs")
def test_the_map_window_holds_the_blocks_in_use_and_follows_them():
    result = subprocess.run([NODE, "--test", str(HERE / "web" / "mapwindow.test.mjs")], capture_output=True,
                            text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 6" in result.stdout and "# fail 0" in result.stdout, result.stdout[-2000:]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("web-room") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", str(POOL), log_path=str(log)) as url:
        # Earlier work: ten distinct prompts take and free ~450 blocks. The free queue hands out its front and
        # takes freed blocks at its back, so what runs next holds blocks past the first 256: the map's window
        # has to follow them.
        for i in range(10):
            answer = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": f"earlier student {i} " + "asks about blocks " * 8, "max_tokens": 40, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
        yield url


def keep_busy(url: str, enough: threading.Event, who: int) -> None:
    """Streaming requests one after another until ``enough``: other students' requests around the page's own."""
    for k in range(30):
        if enough.is_set():
            return
        # Lengths differ, so that the classmates do not finish in step and leave the own request alone.
        body = {"prompt": f"classmate {who} request {k} " + "fills the pool " * 6, "max_tokens": 300 + 70 * who,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                if enough.is_set():       # hang up: the steps that show the own request stay in the page's buffer
                    return


# What the page shows, measured in the page: sideways scrolling, the header's lines, the own output's box, every
# block in use at the shown step found in a map cell inside the viewport, cut table cells.
MEASURE = """(() => {
  const m = window.minipaged, st = m.state, se = document.scrollingElement;
  const box = (e) => e.getBoundingClientRect();
  const inView = (r) => r.width > 0 && r.top >= 0 && r.left >= 0 && r.bottom <= innerHeight && r.right <= innerWidth;
  const map = document.getElementById('map'), group = Number(map.dataset.group);
  const cells = [...map.children];
  const cellOf = (b) => cells.find((c) => Number(c.dataset.first) <= b && b < Number(c.dataset.first) + group);
  const used = [];
  st.blockOwners.forEach((o, b) => { if (o.length) used.push(b); });
  const mine = [...m.view.mine];
  const mineBlocks = mine.length && st.requests.has(mine[0]) ? st.requests.get(mine[0]).blocks : [];
  const header = [...document.querySelectorAll('header > *, header .controls > *')]
    .filter((e) => e.offsetParent !== null).map((e) => box(e).top);
  const panel = document.getElementById('table-panel');
  const shownCells = [...document.querySelectorAll('#requests th, #requests td')]
    .filter((c) => c.offsetParent !== null && getComputedStyle(c).display !== 'none');
  const cut = shownCells.filter((c) => !c.classList.contains('prompt')
    && (c.scrollWidth > c.clientWidth + 1 || box(c).right > box(panel).right + 1)).map((c) => c.textContent);
  const mineChip = document.querySelector('#requests tr[data-mine] .chip, #queues .chip.mine');
  const mineCell = cells.find((c) => c.classList.contains('mine'));
  return {
    scroll_width: se.scrollWidth, client_width: se.clientWidth,
    header_spread: Math.max(...header) - Math.min(...header),
    used_lo: used.length ? used[0] : null, used_count: used.length,
    used_out_of_view: used.filter((b) => { const c = cellOf(b); return !c || !inView(box(c)); }),
    mine_blocks: mineBlocks.length, cells: cells.length, group, cell_px: cells.length ? box(cells[0]).width : 0,
    mine_cell: mineCell ? {text: mineCell.textContent, outline: getComputedStyle(mineCell).outlineColor,
                           background: getComputedStyle(mineCell).backgroundColor} : null,
    mine, selected: m.view.selected,
    output_in_view: inView(box(document.getElementById('output'))),
    output_text: document.getElementById('output').textContent,
    mine_text: mine.length && st.requests.has(mine[0]) ? st.requests.get(mine[0]).text : null,
    output_title: document.getElementById('output-title').textContent,
    map_title: document.getElementById('map-title').textContent,
    legend: document.getElementById('legend').textContent,
    chip: mineChip ? {text: mineChip.textContent, title: mineChip.title} : null,
    headings: shownCells.filter((c) => c.tagName === 'TH').map((c) => c.textContent),
    computed: [...document.querySelectorAll('#requests td.computed')].map((c) => c.textContent),
    cut,
  };
})()"""


async def type_a_prompt(page, text: str) -> None:
    await evaluate(page, "document.getElementById('prompt').focus()")
    await page.call("Input.insertText", text=text)
    for kind in ("keyDown", "keyUp"):
        await page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                        nativeVirtualKeyCode=13)


def save(tmp_path: Path, name: str, png: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(png)
    print(f"screenshot: {path}")
    return path


@needs_chromium
@pytest.mark.parametrize("layout", ["desk", "projector"])
def test_a_room_reads_its_own_answer_and_the_pool_at_1366x768(server, layout, tmp_path):
    query = "?projector=1" if layout == "projector" else ""

    async def run() -> tuple[dict, dict]:
        async with open_page(server + "/" + query, size=ROOM) as page:
            await wait_for(page, "window.minipaged && window.minipaged.view.connected && !!window.minipaged.state",
                           "the page never connected to /v1/events")
            enough = threading.Event()
            classmates = [threading.Thread(target=keep_busy, args=(server, enough, who)) for who in range(3)]
            for t in classmates:
                t.start()
            try:
                await wait_for(page, "window.minipaged.usedBlocks() > 0", "the classmates' requests never ran")
                await type_a_prompt(page, "hello from the back row")
                await wait_for(page, """(() => { const m = window.minipaged, mine = [...m.view.mine];
                    const r = mine.length && m.head.requests.get(mine[0]);
                    return !!r && r.state === 'finished'; })()""", "the typed prompt never finished")
            finally:
                enough.set()
                for t in classmates:
                    t.join(120)
            await asyncio.sleep(0.3)                           # one more frame
            after = await evaluate(page, MEASURE)
            after["png"] = str(save(tmp_path, f"{layout}-own-answer.png", await screenshot(page)))
            # Back to the last buffered step at which the own request ran beside a classmate's: the map must
            # show every block in use there, the own ones marked.
            index = await evaluate(page, """(() => { const m = window.minipaged, mine = [...m.view.mine][0];
                const evs = m.view.events;
                for (let i = evs.length - 1; i >= 0; i--) {
                  if ((evs[i].running || []).includes(mine) && evs[i].running.length > 1) return i;
                }
                return -1; })()""")
            assert index >= 0, "the own request never ran beside another one"
            await evaluate(page, f"window.minipaged.goto({index})")
            await asyncio.sleep(0.3)
            running = await evaluate(page, MEASURE)
            running["png"] = str(save(tmp_path, f"{layout}-while-running.png", await screenshot(page)))
            return after, running

    after, running = asyncio.run(run())
    for seen in (after, running):
        assert seen["scroll_width"] <= seen["client_width"], (seen["scroll_width"], seen["client_width"], seen["png"])
        assert seen["header_spread"] < 8, ("the header wrapped", seen["header_spread"], seen["png"])
        assert not seen["cut"], (seen["cut"], seen["png"])
    # The own request: selected, its whole answer in view without scrolling, named as the TUI names requests.
    mine = after["mine"]
    assert len(mine) == 1 and after["selected"] == mine[0] and mine[0].startswith("chatcmpl-"), after
    assert after["output_in_view"] and after["mine_text"] and after["output_text"] == after["mine_text"], after
    assert after["chip"] and after["chip"]["title"].startswith(mine[0]), after["chip"]
    name = after["chip"]["text"].lstrip("★ ")
    assert name[0] == "r" and name[1:].isdigit(), after["chip"]
    assert after["output_title"].startswith(f"output of {name} ★ mine"), after["output_title"]
    # The map: a window of the pool, readable cells, every block in use at the shown step inside the viewport;
    # earlier work moved the blocks in use past the first 256, and the window followed them.
    assert running["used_count"] >= 2 and running["mine_blocks"] >= 1, running
    assert not running["used_out_of_view"], (running["used_out_of_view"], running["map_title"], running["png"])
    assert running["used_lo"] >= 256 and f"of {POOL:,}" in running["map_title"], running["map_title"]
    assert running["cells"] <= (128 if layout == "projector" else 256) and running["cell_px"] >= 20, running
    assert f"1 cell = {running['group']} block" in running["legend"], running["legend"]
    # Mine: a white ring and a ★ on its blocks, not one more hue.
    assert running["mine_cell"] and running["mine_cell"]["outline"] == "rgb(255, 255, 255)", running["mine_cell"]
    assert "★" in running["mine_cell"]["text"] or running["mine_cell"]["text"] in ("+", "x2"), running["mine_cell"]
    assert "mine" in running["legend"] and "★" in running["legend"], running["legend"]
    if layout == "desk":                               # the table: every column whole, the computed one in words
        assert after["headings"][-1] == "finish" and "KV computed" in after["headings"], after["headings"]
        assert after["computed"] and all(" of " in c for c in after["computed"]), after["computed"]


def record_spread_trace(tiny_engine_factory, path: Path) -> int:
    """A run on a serve-sized pool whose blocks in use spread past one window (grouped cells) and share a
    prefix ("+" cells); returns the number of steps recorded."""
    from minipaged import SamplingParams
    from minipaged.trace import write_trace_event, write_trace_header

    # (every prompt prefills in one step: no cap on a long prompt's chunk, the CPU default's 128 would stagger them)
    engine = tiny_engine_factory(num_blocks=POOL, max_num_batched_tokens=4096, long_prefill_token_threshold=0)
    events = []
    engine.subscribe(events.append)
    system = [7] * 64                                                   # 16 blocks every request shares
    for i in range(6):
        engine.add_request(system + [20 + i] * 180, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with open(path, "w") as fp:
        write_trace_header(fp, engine.info)
        for ev in events:
            write_trace_event(fp, ev)
    return len(events)


@needs_chromium
def test_a_replay_shows_no_live_controls_and_its_legend_explains_grouped_cells(tiny_engine_factory, tmp_path):
    from minipaged.cli import main

    trace, page_file = tmp_path / "room.jsonl", tmp_path / "room.html"
    num_steps = record_spread_trace(tiny_engine_factory, trace)
    assert main(["export-html", str(trace), "-o", str(page_file)]) == 0

    async def run() -> dict:
        async with open_page(page_file.as_uri() + f"?step={num_steps - 1}", size=ROOM, offline=True) as page:
            await wait_for(page, "!!(window.minipaged && window.minipaged.state)", "the exported page never drew")
            await asyncio.sleep(0.3)
            seen = {"desk": await evaluate(page, MEASURE)}
            seen["desk"]["png"] = str(save(tmp_path, "replay-desk.png", await screenshot(page)))
            seen["plus_cells"] = await evaluate(page, f"{CELLS_JS}.filter((c) => c.textContent === '+').length")
            seen["text"] = await evaluate(page, "document.body.innerText")
            seen["live_only_shown"] = await evaluate(page, """['live', 'freeze', 'prompt-panel', 'prompt', 'forget-key',
                'whole-prompt'].filter((id) => document.getElementById(id).offsetParent !== null)""")
            await evaluate(page, "window.minipaged.projector(true)")
            await asyncio.sleep(0.3)
            seen["projector"] = await evaluate(page, MEASURE)
            seen["projector"]["png"] = str(save(tmp_path, "replay-projector.png", await screenshot(page)))
            return seen

    seen = asyncio.run(run())
    desk, projector = seen["desk"], seen["projector"]
    assert not seen["live_only_shown"], seen["live_only_shown"]
    assert "● live" not in seen["text"] and "mine" not in seen["text"], seen["text"][:2000]
    assert "replay" in seen["text"]
    # Six 244-token prompts: ~370 blocks in use, more than 256 cells hold: 2 blocks a cell, said in the legend.
    assert desk["group"] == 2 and "1 cell = 2 blocks" in desk["legend"], (desk["group"], desk["legend"])
    assert seen["plus_cells"] >= 1 and "+" in desk["legend"] and "shared" in desk["legend"], desk["legend"]
    assert "filled" in desk["legend"], desk["legend"]
    for shown in (desk, projector):
        assert shown["scroll_width"] <= shown["client_width"] and shown["header_spread"] < 8, shown["png"]
        assert not shown["used_out_of_view"] and not shown["cut"], (shown["used_out_of_view"], shown["png"])
    assert projector["group"] >= 4 and projector["cells"] <= 128, projector
