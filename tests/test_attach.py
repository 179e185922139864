"""``minipaged watch --attach URL`` against a live ``minipaged serve``: a thin client (no torch), driven by Pilot."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from browser_util import INSTALL_HINT, find_chromium
from serve_util import running_classroom, running_server, wait_until_idle


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("attach") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "128", log_path=str(log)) as url:
        yield url


def test_the_attach_client_never_imports_torch_or_transformers(server):
    """The whole client path, from the command's parser to reading a live event, in a fresh interpreter."""
    code = f"""
import sys
from minipaged.cli import make_parser, is_user_error
from minipaged.tui import run_watch, _flag_problem
from minipaged.tui.attach import AttachApp, AttachRun
args = make_parser().parse_args(["watch", "--attach", "{server}"])
assert _flag_problem(args) is None
run = AttachRun(args.attach)
info = run.load()
event = run.step()
assert event is not None and info.num_blocks == 128
AttachApp(run)
is_user_error(ValueError())
run.close()
print(sorted(m for m in ("torch", "transformers", "numpy", "fastapi") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_attach_refuses_engine_flags_and_replay():
    from minipaged.cli import make_parser
    from minipaged.tui import _flag_problem

    parse = make_parser().parse_args
    assert "give engine flags to `minipaged serve`" in _flag_problem(
        parse(["watch", "--attach", "http://x", "--num-blocks", "8"]))
    assert "give one of them" in _flag_problem(parse(["watch", "--attach", "http://x", "--replay", "t.jsonl"]))
    assert _flag_problem(parse(["watch", "--attach", "http://x", "--max-tokens", "8"])) is None


def test_attach_to_nothing_says_what_to_start(capsys):
    from minipaged.cli import main
    from serve_util import free_port

    assert main(["watch", "--attach", f"http://127.0.0.1:{free_port()}", "--no-tui"]) == 2
    assert "start one with `minipaged serve`" in capsys.readouterr().err


def test_pilot_draws_a_request_sent_by_another_client_and_sends_its_own(server, tiny_model):
    from minipaged.tui.attach import AttachApp, AttachRun
    from minipaged.tui.widgets.block_map import BlockMap

    async def run() -> None:
        app = AttachApp(AttachRun(server), max_tokens=12)
        async with app.run_test(size=(160, 45)) as pilot:
            async def wait_for(condition, timeout: float = 30.0) -> None:
                start = time.monotonic()
                while not condition():
                    assert time.monotonic() - start < timeout, "timed out waiting for the app"
                    await pilot.pause(0.05)

            await wait_for(lambda: app.state is not None)
            other = threading.Thread(target=httpx.post, args=(server + "/v1/completions",),
                                     kwargs=dict(json={"model": tiny_model, "prompt": "another client asks",
                                                       "max_tokens": 150, "ignore_eos": True}, timeout=60))
            other.start()

            def theirs():
                return next((r for r in app.state.view.requests.values() if "another client" in r.prompt), None)

            def drawn(request) -> bool:
                block_map = app.query_one("#gpu-map", BlockMap)
                colour = app.state.colour(request.request_id).lower()
                return any(colour in str(seg.style).lower() for y in range(block_map.content_size.height)
                           for seg in block_map.render_line(y))
            await wait_for(lambda: theirs() is not None and theirs().blocks and drawn(theirs()))
            other.join(60)

            await pilot.press("slash")
            await pilot.press(*"hello class")
            await pilot.press("enter")
            await wait_for(lambda: app.answers)
            request_id, text = app.answers[0]
            await wait_for(lambda: app.state.view.requests.get(request_id) is not None
                           and app.state.view.requests[request_id].state == "finished")
            mine = app.state.view.requests[request_id]
            assert "hello class" in mine.prompt and 1 <= mine.num_output_tokens <= 12
            assert mine.text == text and app.selected == request_id
            await pilot.pause(2.5)            # the server is idle now: its silence is not a step in flight
            header = app._topbar().plain
            assert "running" not in header and "waiting for the server's next step" in header
            await pilot.press("escape", "q")
        assert app.return_code == 0

    asyncio.run(run())
    health = wait_until_idle(server)
    assert health["blocks_free"] == health["blocks_total"]


def test_q_quits_at_once_and_the_key_bar_shows_beside_the_prompt_box(server):
    """A class trial pressed q and typed a q: the box had the focus from the start, and it covered the key bar.
    The picture has the keys until ``/`` opens the box; escape leaves it; the footer stays visible above it."""
    from textual.widgets import Footer, Input
    from textual.widgets._footer import FooterKey

    from minipaged.tui.attach import AttachApp, AttachRun
    from pilot_util import wait_for

    async def run() -> None:
        app = AttachApp(AttachRun(server), max_tokens=4)
        async with app.run_test(size=(160, 45)) as pilot:
            await wait_for(pilot, lambda: app.state is not None, timeout=30)
            box, footer = app.query_one("#prompt", Input), app.query_one(Footer)

            def shown() -> list[FooterKey]:
                return [key for key in footer.query(FooterKey) if key.region.height]
            await wait_for(pilot, lambda: any(k.description == "Quit" and k.key_display == "q" for k in shown()),
                           timeout=30)                    # (the key bar is laid out after the first picture)
            assert app.focused is not box
            assert footer.region.height and not footer.region.overlaps(box.region)
            await pilot.press("slash", "q")
            assert app.focused is box and box.value == "q"        # in the box a q is a letter
            await pilot.press("escape")
            assert app.focused is not box
            await pilot.press("q")
        assert app.return_code == 0 and app.answers == []

    asyncio.run(run())


def test_an_attach_app_that_ends_without_q_lets_its_process_end(server):
    """An app that ends any other way than q (here: a failing check inside it, as a test or an error in a panel
    would) must not leave its engine worker waiting on the server: the process waited until the server went
    away (a CI run hung 20 minutes on one failed check)."""
    from minipaged.tui.attach import AttachApp, AttachRun
    from pilot_util import wait_for

    async def run() -> None:
        app = AttachApp(AttachRun(server), max_tokens=4)
        async with app.run_test(size=(160, 45)) as pilot:
            await wait_for(pilot, lambda: app.state is not None, timeout=30)
            raise LookupError("a check inside the app failed")

    ended, raised = threading.Event(), []

    def go() -> None:
        try:
            asyncio.run(run())
        except LookupError as exc:
            raised.append(exc)
        ended.set()
    threading.Thread(target=go, daemon=True).start()
    assert ended.wait(60), "asyncio.run still waits for the app's engine worker"
    assert raised


def test_classroom_serves_the_attach_tui_to_two_browsers_at_once(server, tiny_model, tmp_path):
    """Two websocket clients speak textual-serve's browser protocol, and each must receive its own live attach
    TUI (the top bar says LIVE and names the server's model). Runs without a browser; the Chromium test below
    checks what a real browser draws."""
    import aiohttp

    model = Path(tiny_model).name                 # the top bar names the model once the event stream is read

    async def one_browser(session: aiohttp.ClientSession, port: int) -> str:
        seen = ""
        async with session.ws_connect(f"ws://127.0.0.1:{port}/ws?width=140&height=40") as ws:
            await ws.send_json(["resize", {"width": 140, "height": 40}])
            deadline = time.monotonic() + 60
            while not ("LIVE" in seen and model in seen) and time.monotonic() < deadline:
                try:
                    message = await ws.receive(timeout=5)
                except asyncio.TimeoutError:
                    continue
                if message.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    data = message.data
                    seen += data.decode("utf-8", "replace") if isinstance(data, bytes) else data
                elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break
        return seen

    async def two_browsers(public: str) -> tuple[str, list[str]]:
        port = int(public.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as session:
            async with session.get(public + "/") as page:
                html = await page.text()
            return html, list(await asyncio.gather(one_browser(session, port), one_browser(session, port)))

    log = tmp_path / "classroom.log"
    with running_classroom(server, log_path=str(log)) as public:
        html, screens = asyncio.run(two_browsers(public))
    assert f"{public.replace('http', 'ws')}/ws" in html   # the page connects back to the public URL
    for screen in screens:
        assert "minipaged watch" in screen and "LIVE" in screen and model in screen, (
            screen[-2000:], log.read_text())


def block_map_pixels(png: bytes) -> dict[str, int]:
    """Pixels of a screenshot in the block map's colours: requests' colours and the cached-prefix grey
    (``map``, solid cells and shade glyphs), and the free-block grey (``free``, the dots)."""
    from browser_util import count_colour, decode_png
    from minipaged.tui.state import PALETTE
    from minipaged.tui.widgets.block_map import CACHED, FREE

    rgb = decode_png(png)
    return {"map": sum(count_colour(rgb, colour) for colour in (*PALETTE, CACHED)), "free": count_colour(rgb, FREE)}


# Measured at 1400x900: an empty map (a fresh server: only the legend's swatches and 128 dots) draws 1,301
# "map" pixels and 2,212 "free" ones; one finished 30-token prompt's cached blocks take "map" to 13,469;
# a blank page and textual-serve's intro card (the app not drawn yet) have 0 of each.
MAP_PIXELS = 3000
FREE_PIXELS = 200


def shows_a_block_map(png: bytes) -> bool:
    pixels = block_map_pixels(png)
    return pixels["map"] >= MAP_PIXELS and pixels["free"] >= FREE_PIXELS


@pytest.mark.skipif(find_chromium() is None, reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
def test_two_headless_chromiums_at_once_both_draw_the_block_map(server, tiny_model, tmp_path):
    """issue 13: a real browser opens the classroom page, xterm.js draws the attach TUI, and a screenshot
    shows the block map with the blocks of a request the test sent; two browsers at once both do."""
    from browser_util import screenshot_when
    answer = httpx.post(server + "/v1/completions", timeout=60,
                        json={"model": tiny_model, "prompt": "the class watches these blocks fill up " * 3,
                              "max_tokens": 40, "ignore_eos": True})
    assert answer.status_code == 200, answer.text

    async def two_browsers(url: str) -> list[tuple[bytes, bool]]:
        return list(await asyncio.gather(screenshot_when(url, shows_a_block_map, timeout_s=45),
                                          screenshot_when(url, shows_a_block_map, timeout_s=45)))

    log = tmp_path / "classroom.log"
    with running_classroom(server, log_path=str(log)) as page:
        shots = asyncio.run(two_browsers(page))
    for number, (png, ready) in enumerate(shots, 1):
        (tmp_path / f"browser{number}.png").write_bytes(png)        # kept for a look when this fails
        assert ready, (f"browser {number} never drew the block map; pixels {block_map_pixels(png)}, "
                       f"screenshot {tmp_path}/browser{number}.png", log.read_text()[-2000:])
