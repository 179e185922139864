"""The widget as a user sees it: JupyterLab on 127.0.0.1 (a free port, a token), a notebook opened in headless
Chromium, its cells run; the widget draws the block map and its step counter advances while the engine runs
in the cell below. Screenshots are kept in the test's tmp dir. About 30 s here; skipped without Chromium or
JupyterLab."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page, screenshot
from serve_util import free_port, stop_process

pytestmark = [pytest.mark.skipif(find_chromium() is None, reason=f"no Chromium here: {INSTALL_HINT}"),
              pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="jupyterlab is not installed")]

SETUP = """\
from minipaged import Engine, SamplingParams
from minipaged.notebook import watch
engine = Engine({model!r}, block_size=4, num_blocks=96, max_num_seqs=6)
w = watch(engine, keep=8)
w"""

DRIVE = """\
import time
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
for i in range(400):
    if i % 3 == 0 and i < 300:
        engine.add_request([3 + i % 7] * (8 + i % 11), params)
    if engine.has_unfinished_requests():
        engine.step()
    time.sleep(0.05)
print("drove", w.step, "steps")"""

WIDGET = "document.querySelector('.minipaged-widget')"


def _notebook(path: Path, model: str) -> None:
    import nbformat.v4 as v4
    import nbformat

    nb = v4.new_notebook(cells=[v4.new_code_cell(SETUP.format(model=model)), v4.new_code_cell(DRIVE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def test_jupyterlab_draws_the_widget_live_in_chromium(tiny_model, tmp_path):
    root = tmp_path / "lab"
    root.mkdir()
    _notebook(root / "live.ipynb", tiny_model)
    port, token = free_port(), "minipaged-test-token"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                            f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
                            f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
                            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
                            f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
                            *(["--allow-root"] if os.geteuid() == 0 else [])],
                           env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "wb"),
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/status", params={"token": token}, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert lab.poll() is None and time.monotonic() < deadline, (tmp_path / "lab.log").read_text()[-3000:]
            time.sleep(0.3)

        async def run() -> dict:
            url = f"http://127.0.0.1:{port}/lab/tree/live.ipynb?token={token}"
            async with open_page(url, size=(1400, 1000), timeout_s=60) as page:
                series = []

                async def until(expression: str, what: str, budget_s: float = 45) -> object:
                    end = time.monotonic() + budget_s
                    guarded = f"(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()"
                    while not (value := await evaluate(page, guarded)):
                        series.append((round(time.monotonic(), 2), await evaluate(page, f"{WIDGET} && {WIDGET}.dataset.step")))
                        if time.monotonic() > end:
                            (tmp_path / "timeout.png").write_bytes(await screenshot(page))
                            raise AssertionError(f"{what}: {series[-40:]}")
                        await asyncio.sleep(0.25)
                    return value

                await until("window.jupyterapp && jupyterapp.shell.currentWidget && "
                            "jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                            "JupyterLab did not open the notebook with an idle kernel")
                await evaluate(page, "void jupyterapp.commands.execute('notebook:run-all-cells')")   # not awaited
                await until(f"{WIDGET} && {WIDGET}.shadowRoot.querySelectorAll('#map .cell').length > 0",
                            "the widget drew no block map")
                first = int(await until(f"Number({WIDGET}.dataset.step) > 0 && {WIDGET}.dataset.step",
                                        "the widget's step counter never moved"))
                (tmp_path / "first.png").write_bytes(await screenshot(page))
                later = int(await until(f"Number({WIDGET}.dataset.step) > {first} + 5 && {WIDGET}.dataset.step",
                                        "the widget's step counter stopped"))
                used = await until(f"{WIDGET}.shadowRoot.querySelectorAll('#map .cell.used, #map .cell.shared').length",
                                   "no block of the map was drawn in use")
                kept = int(await evaluate(page, f"{WIDGET}.dataset.events"))
                label = await evaluate(page, f"{WIDGET}.shadowRoot.getElementById('step-label').textContent")
                (tmp_path / "later.png").write_bytes(await screenshot(page))
                return {"first": first, "later": later, "used": used, "kept": kept, "label": label}

        seen = asyncio.run(run())
    finally:
        stop_process(lab)
    assert seen["later"] > seen["first"] > 0 and seen["used"] > 0
    assert 0 < seen["kept"] <= 8, seen                 # the view keeps the last N steps (watch(keep=8))
    assert seen["label"].startswith("step "), seen
