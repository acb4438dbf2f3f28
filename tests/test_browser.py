"""The tutorials in a real browser: JupyterLab on 127.0.0.1, driven in headless Chromium.

Checks what nbclient cannot: that the LayoutPicker renders as a widget and reacts to a click, and that
the dashboard shows new frames in one output, in place, while training runs (the quickstart trains
long enough that at one frame per 2 s several must appear). Screenshots land in artifacts/.
Needs Debian's `chromium` (CI installs it); Playwright drives that binary, no browser download.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
RUN_ALL_TIMEOUT_MS = 240_000
MAX_FRAME_INTERVAL_S = 2.0  # the dashboard's promise while training (it aims at 0.5 s)
MIN_LIVE_FRAMES = 3

# Records every distinct dashboard frame the page shows (the test polls nothing itself, so frames
# shown between two polls are not missed): when it appeared, its kind (svg while training, png at
# the end), the step its progress line names, and which output element showed it.
_WATCH_FRAMES = """() => {
  window.__frames = [];
  const seen = new Set();
  let outputs = 0;
  const record = () => document.querySelectorAll('.jp-OutputArea-output img').forEach(img => {
    const match = img.src.match(/^data:image\\/(svg\\+xml|png);base64,/);
    if (!match) return;
    const key = img.src.length + ':' + img.src.slice(-64);
    if (seen.has(key)) return;
    seen.add(key);
    const output = img.closest('.jp-OutputArea-output');
    output.dataset.watched = output.dataset.watched || String(++outputs);
    const step = (output.textContent.match(/step (\\d+)\\/(\\d+)/) || []).slice(1).map(Number);
    window.__frames.push({t: performance.now() / 1000, kind: match[1], step: step,
                          output: output.dataset.watched});
  });
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, attributes: true,
                                                       attributeFilter: ['src']});
}"""


# A cell failing on rank 1 inside a notebook function, then the post-mortem typed in the input box.
DEBUG_CELLS = ["%load_ext colab_par\n%colossal start -n 2 --backend gloo",
               "def scale(x, r):\n    y = x * 10\n    if r == 1:\n        raise ValueError(f'bad {y}')\n    return y",
               "%%colossal\nb = scale(rank + 100, rank)",
               "%colossal debug",
               "%colossal stop"]


def _write_notebook(path: Path, cells: list[str]) -> None:
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def picker_cells() -> list[str]:
    """Tutorial 02's LayoutPicker cells, as written there: its model, the picker, the chosen layout
    (its training cells run under nbclient in test_notebooks; the picker needs no cluster)."""
    import nbformat

    sources = [cell.source for cell in nbformat.read(REPO / "notebooks" / "02_layouts.ipynb", as_version=4).cells
               if cell.cell_type == "code"]
    return ["import torch"] + [next(source for source in sources if fragment in source)
                               for fragment in ("GPTConfig(", "picker.widget", "chosen layout")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a token, serving copies of the notebooks under test."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Chromium not found at {CHROMIUM}; install Debian's `chromium` package (apt)")
    root = tmp_path_factory.mktemp("lab")
    served = root / "notebooks"
    served.mkdir()
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", served)
    _write_notebook(served / "picker.ipynb", picker_cells())
    _write_notebook(served / "debug.ipynb", DEBUG_CELLS)
    settings = root / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_RUNTIME_DIR=str(root / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(root / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"))
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}", "--allow-root"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(0.25)
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


def open_notebook(browser, jupyterlab, name: str):
    url, token = jupyterlab
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    page.set_default_timeout(90_000)
    # a workspace of its own, reset: the notebook opened before must not come back as the active tab
    page.goto(f"{url}/lab/workspaces/{name}/tree/{name}.ipynb?reset&token={token}")
    page.wait_for_selector(".jp-Notebook .jp-CodeCell .cm-content", state="visible")
    page.get_by_text("| Idle").wait_for()  # the kernel is up
    return page


def run_all_cells(page) -> None:
    """Run > Run All Cells, through the menu as a user would."""
    page.locator(".lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()


def output_of(page, fragment: str):
    """The output area of the one code cell whose source contains `fragment`."""
    cell = page.locator(".jp-CodeCell").filter(has=page.locator(".jp-InputArea", has_text=fragment))
    return cell.locator(".jp-OutputArea")


def choose(page, label: str, value: str, *, expect: "str | re.Pattern") -> None:
    """Pick `value` in the picker's `label` dropdown; wait until its validation message says `expect`."""
    dropdown = page.locator(".widget-dropdown", has=page.locator("label", has_text=re.compile(f"^{label}$")))
    dropdown.locator("select").select_option(value)
    page.locator(".widget-html-content", has_text=expect).first.wait_for(timeout=30_000)


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.2)


def wait_for_text(locator, pattern: str) -> None:
    """Until `locator`'s text matches `pattern` (a regex: one stream output holds many lines)."""
    wait_for(lambda: re.search(pattern, locator.inner_text()), f"{pattern!r} in {locator}")


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"browser-{name}.png"), full_page=False)


def test_quickstart_dashboard_updates_in_place(browser, jupyterlab):
    page = open_notebook(browser, jupyterlab, "01_quickstart")
    try:
        page.evaluate(_WATCH_FRAMES)
        run_all_cells(page)
        training = output_of(page, "trainer.fit()")
        training.locator("img").first.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
        # the image itself is replaced at every frame; scroll its (stable) output area instead
        training.scroll_into_view_if_needed()
        shot(page, "01-training")
        page.get_by_text("colab_par: engines stopped").wait_for(timeout=RUN_ALL_TIMEOUT_MS)
        output_of(page, "trainer.fit()").scroll_into_view_if_needed()
        shot(page, "01-done")
        frames = page.evaluate("window.__frames")
        assert {frame["output"] for frame in frames} == {"1"}, \
            f"every frame must replace the one dashboard output in place: {frames}"
        live = [frame for frame in frames if frame["kind"] == "svg+xml"]
        final = [frame for frame in frames if frame["kind"] == "png"]
        assert len(final) == 1 and frames[-1]["kind"] == "png", f"one final picture, last: {frames}"
        assert final[0]["step"][0] == final[0]["step"][1], f"the final picture is not the last step: {final}"
        steps = [frame["step"][0] for frame in live]
        # a rank's row for a step the lowest rank already showed redraws at that step (the bars change)
        assert steps == sorted(steps), f"live frames must never go back a step: {steps}"
        assert len(set(steps)) >= MIN_LIVE_FRAMES, f"{len(set(steps))} steps shown while training: {frames}"
        mean_interval = (final[0]["t"] - live[0]["t"]) / len(live)
        assert mean_interval <= MAX_FRAME_INTERVAL_S, f"a new frame every {mean_interval:.1f} s on average"
        assert page.locator(".jp-OutputArea-output img").count() == 1, "updates must replace one image"
        assert re.search(r"layout dp2: loss first [\d.]+ -> last [\d.]+",
                         output_of(page, "trainer.fit()").inner_text())
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                            has_text="Traceback").count() == 0
    except Exception:
        shot(page, "01-failure")
        raise
    finally:
        page.close()


def test_layout_picker_renders_and_reacts(browser, jupyterlab):
    page = open_notebook(browser, jupyterlab, "picker")
    try:
        run_all_cells(page)
        picker = output_of(page, "picker.widget")
        picker.get_by_text("Layout for 4").wait_for(timeout=RUN_ALL_TIMEOUT_MS)
        chosen = output_of(page, "chosen layout")
        chosen.get_by_text("chosen layout:").wait_for(timeout=RUN_ALL_TIMEOUT_MS)  # the kernel is idle
        picker.scroll_into_view_if_needed()
        shot(page, "02-picker")
        # whatever the planner picked, reach dp4 and then dp4 zero3 through the selectors
        choose(page, "pp", "1", expect=re.compile(r"dp4|dp=4"))
        choose(page, "microbatches", "1", expect=re.compile(r"✓ dp4"))
        choose(page, "zero", "0", expect="✓ dp4 is valid")
        estimate = page.locator(".widget-html-content", has_text="per device").first  # one picker
        before = estimate.inner_text()
        choose(page, "zero", "3", expect="✓ dp4 zero3 is valid")
        after = estimate.inner_text()
        shot(page, "02-picker-changed")
        memory = [re.search(r"([\d.,]+ [MG]iB) of [\d.,]+ [MG]iB per device", text).group(1)
                  for text in (before, after)]
        assert memory[0] != memory[1], f"changing zero did not change the memory estimate: {before!r}"
        # what the browser chose is what the kernel's picker holds: the next cell reads it
        page.locator(".jp-InputArea", has_text="chosen layout").locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")
        wait_for_text(chosen, r"chosen layout: dp4 zero3\n")
    except Exception:
        shot(page, "02-failure")
        raise
    finally:
        page.close()


def test_debug_a_failed_rank_from_the_input_box(browser, jupyterlab):
    page = open_notebook(browser, jupyterlab, "debug")
    try:
        run_all_cells(page)  # stops at the cell failing on rank 1, as Run All does
        output_of(page, "b = scale").get_by_text("ValueError").first.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
        page.locator(".jp-InputArea", has_text="%colossal debug").locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")
        debug = output_of(page, "%colossal debug")
        for command, answer in (("p y", r"p y\s+1010\s"), ("up", r"Cell In\[\d+\]\(1\)<module>\(\)\s+-> b = scale"),
                                ("p b", r"p b\s+\*\*\* NameError: name 'b' is not defined"), ("q", None)):
            box = debug.locator(".jp-Stdin-input")
            wait_for(lambda: box.count() == 1, "one open input box")  # the answered one goes away
            box.fill(command)
            box.press("Enter")
            if answer:
                wait_for_text(debug, answer)
        debug.locator(".jp-Stdin-input").wait_for(state="detached")
        shot(page, "debug")
        text = debug.inner_text()
        assert "post-mortem of rank 1: ValueError: bad 1010" in text, text
        assert re.search(r"<notebook In\[\d+\]>\(4\)scale\(\)", text), text
        page.locator(".jp-InputArea", has_text="%colossal stop").locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")
        page.get_by_text("colab_par: engines stopped").wait_for(timeout=60_000)
    except Exception:
        shot(page, "debug-failure")
        raise
    finally:
        page.close()


# ---- the shard map, drawn in a cell -------------------------------------------------------------------
SHARD_MAP_CELLS = [
    "%load_ext colab_par",
    "%colossal start -n 2",
    "%%colossal\nimport colab_par\nfrom colab_par import parallelize\nfrom colab_par.models.gpt import GPT, GPTConfig\n"
    "pm = parallelize(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, "
    "kernels='torch')), 'tp2')",
    "%%colossal\ncolab_par.show(pm)",
    "%colossal stop",
]


def put_notebook(jupyterlab, name: str, cells: list[str]) -> None:
    """A notebook of `cells` in the server's folder, through Jupyter's contents API."""
    import nbformat

    url, token = jupyterlab
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells],
                                        metadata={"kernelspec": {"display_name": "Python 3 (ipykernel)",
                                                                 "language": "python", "name": "python3"}})
    body = json.dumps({"type": "notebook", "format": "json", "content": notebook}).encode()
    request = urllib.request.Request(f"{url}/api/contents/{name}.ipynb?token={token}", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).close()


def test_shard_map_draws_in_a_cell(browser, jupyterlab):
    """`colab_par.show(pm)` as the value of a %%colossal cell, as a person would use it: the map is
    one picture in the cell's output (drawn by the notebook from rank 0's data), showing held
    slices, not a table of text."""
    import base64

    from test_shard_map import colour_pixels

    from colab_par.shard_map.picture import SLICE

    put_notebook(jupyterlab, "shard_map", SHARD_MAP_CELLS)
    page = open_notebook(browser, jupyterlab, "shard_map")
    try:
        run_all_cells(page)
        page.get_by_text("colab_par: engines stopped").wait_for(timeout=RUN_ALL_TIMEOUT_MS)
        output = output_of(page, "colab_par.show(pm)")
        output.scroll_into_view_if_needed()
        shot(page, "shard-map")
        images = output.locator("img")
        assert images.count() == 1, f"expected one picture, the output reads: {output.inner_text()!r}"
        src = images.first.get_attribute("src")
        assert src.startswith("data:image/png;base64,")
        assert colour_pixels(base64.b64decode(src.split(",", 1)[1]), SLICE) > 100, "the map shows no slices"
        assert images.first.evaluate("img => img.naturalWidth") > 300
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                            has_text="Traceback").count() == 0
    except Exception:
        shot(page, "shard-map-failure")
        raise
    finally:
        page.close()
