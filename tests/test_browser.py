"""The course in a real JupyterLab, driven by headless Chromium: the SM-occupancy explorer, the reveal / reload /
restore round trip of an exercise cell (``fdlib.course.grading.live``), and the URL ``./course lab`` prints (it opens
notebooks/00_welcome.ipynb; run only where ./course test made .venv).

The first two start JupyterLab on 127.0.0.1 (free port, random token, and the flags ``./course lab`` adds:
``--LabApp.expose_app_in_browser=True`` and the course's settings, ``.jupyter/settings``) over a temporary root.

The explorer test's root holds a one-cell notebook
(the explorer at B=1, H_q=32, H_kv=8, L=131072 on the H200 model, splits=1); it runs the cell with
Shift+Enter, reads the utilization text and the picture, moves the splits slider with the keyboard, and
checks that both change: 1 split keeps 8 of 132 SMs busy; the cost model's choice, and 256 splits, keep
nearly all of them busy. Every control's label is shown whole. Then it saves the notebook, shuts the kernel
down and opens the notebook again: the explorer is shown as last drawn (the course's settings save widget
state with the notebook), not "Error displaying widget: model not found".
The round-trip test's root holds the shipped ``notebooks/01_naive_decode.ipynb``: it types into the exercise
cell without saving, reveals the solution, reloads the notebook from disk, restores the backup, saves, and
opens the backup from the file browser (see :func:`test_reveal_reload_restore_round_trip`).
The kernel is this interpreter (``sys.executable``), through a kernelspec written into the temporary
Jupyter path. On failure, screenshots and the server log go to ``tests/_artifacts/``.
Uses Debian's ``chromium`` (never downloads a browser); skips when chromium or playwright is missing.
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
from contextlib import contextmanager
from pathlib import Path

import pytest

from fdlib.course.explorer import SPLIT_OPTIONS
from fdlib.course.grading import core
from fdlib.course.grading.live import LAB_FLAG
from shipped import shipped_copy

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parent / "_artifacts"
REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
KERNEL = "fdlib-test-venv"
CELL = ("import sys\n"
        "from fdlib.course.explorer import explorer\n"
        "print('kernel python:', sys.executable)\n"
        "explorer(B=1, H_q=32, H_kv=8, L=131072, gpu='H200', splits=1)")
UTIL = ".fdlib-explorer-readout .fdlib-util"
IMAGE = "img.fdlib-explorer-image"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook() -> dict:
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": "explorer", "metadata": {},
                       "outputs": [], "source": CELL}],
            "metadata": {"kernelspec": {"name": KERNEL, "display_name": "fdlib test (venv)", "language": "python"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def _need_browser():
    pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); the browser test never downloads one")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")


@pytest.fixture
def lab(tmp_path):
    """A running JupyterLab: yields (url of the notebook with the token, path of its log, path of the notebook)."""
    _need_browser()
    pytest.importorskip("jupyterlab_widgets", reason="jupyterlab_widgets (ipywidgets' lab extension) is not installed")
    root = tmp_path / "root"
    root.mkdir()
    (root / "explorer_test.ipynb").write_text(json.dumps(_notebook()))
    with _jupyterlab(tmp_path, root) as (base, log_path):
        yield base.replace("/lab?", "/lab/tree/explorer_test.ipynb?"), log_path, root / "explorer_test.ipynb"


def _stop(proc: subprocess.Popen) -> None:
    """End a server this test started: SIGTERM, then SIGKILL if it is still up 20 s later."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def _jupyterlab(tmp_path, root):
    """JupyterLab over ``root`` with the flags ``./course lab`` adds, the test kernel and a random token: yields
    (url of /lab with the token, path of the server log)."""
    share = tmp_path / "share" / "jupyter"
    spec = share / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fdlib test (venv)", "language": "python"}))
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    env = dict(os.environ)
    env.update(JUPYTER_PATH=os.pathsep.join(filter(None, [str(share), os.environ.get("JUPYTER_PATH")])),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), MPLBACKEND="Agg")
    env.pop("JUPYTER_TOKEN", None)
    port, token = _free_port(), secrets.token_hex(24)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
           LAB_FLAG, f"--LabApp.app_settings_dir={REPO / '.jupyter' / 'settings'}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = tmp_path / "jupyterlab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=3) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within 60 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/lab?token={token}", log_path
    finally:
        _stop(proc)
        log.close()


def _util_percent(text: str) -> float:
    m = re.search(r"SM utilization: ([\d.]+)%", text)
    assert m, f"no utilization in {text!r}"
    return float(m.group(1))


def _wait_text_change(page, old: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        txt = page.inner_text(UTIL)
        if txt != old:
            return txt
        page.wait_for_timeout(200)
    return page.inner_text(UTIL)


def test_explorer_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    url, log_path, nb_path = lab
    t_start = time.monotonic()
    shots = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(60_000)

        def shot(name):
            ARTIFACTS.mkdir(exist_ok=True)
            p = ARTIFACTS / f"browser_{name}.png"
            try:
                page.screenshot(path=str(p), full_page=True)
                shots.append(p)
            except Exception:
                pass

        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content")
            # the kernel is connected and idle (the status bar names it); running before that loses the request
            page.wait_for_selector(".jp-StatusBar-Widget:has-text('Idle')", timeout=90_000)
            for attempt in range(3):
                page.click(".jp-Notebook .jp-Cell .cm-content >> nth=0")
                page.keyboard.press("Shift+Enter")
                try:
                    page.wait_for_selector(UTIL, timeout=60_000)
                    break
                except Exception:
                    if attempt == 2:
                        raise
                    shot(f"run_attempt{attempt}")
            out_text = page.inner_text(".jp-Notebook .jp-Cell >> nth=0")
            assert f"kernel python: {sys.executable}" in out_text, out_text[:2000]

            util1 = page.inner_text(UTIL)
            assert "8 of 132" in util1 and _util_percent(util1) < 10, util1
            img1 = page.locator(IMAGE).screenshot()
            src1 = page.get_attribute(IMAGE, "src")

            readout = page.inner_text(".fdlib-explorer-readout")
            m = re.search(r"cost model's choice: (\d+) splits", readout)
            assert m, readout
            chosen = min((s for s in SPLIT_OPTIONS if s >= int(m.group(1))), default=SPLIT_OPTIONS[-1])
            handle = page.locator(".fdlib-explorer .widget-slider", has_text="splits").locator(".noUi-handle")
            handle.focus()
            for _ in range(SPLIT_OPTIONS.index(chosen)):     # 1 split -> the cost model's choice (or next stop)
                page.keyboard.press("ArrowRight")
            util2 = _wait_text_change(page, util1)
            page.wait_for_timeout(500)          # let the last moves' redraws land
            util2 = page.inner_text(UTIL)
            assert util2 != util1, "the utilization text did not change after moving the splits slider"
            first_wave_busy = int(re.search(r"busy SMs: (\d+) of 132", util2).group(1))
            assert first_wave_busy >= 0.9 * 132, util2
            assert f"splits: {chosen}" in page.inner_text(".fdlib-explorer-readout")
            page.wait_for_function(f"document.querySelector('{IMAGE}').src !== {json.dumps(src1)}", timeout=30_000)
            img2 = page.locator(IMAGE).screenshot()
            assert img2 != img1, "the picture did not change after moving the splits slider"

            handle.focus()
            page.keyboard.press("End")          # 256 splits: many waves, still nearly every SM busy
            util3 = _wait_text_change(page, util2)
            assert util3 != util2 and _util_percent(util3) >= 90, util3
            readout = page.inner_text(".fdlib-explorer-readout")
            assert "splits: 256" in readout, readout
            cut = page.evaluate("() => Array.from(document.querySelectorAll('.fdlib-explorer .widget-label'))"
                                ".filter(e => e.scrollWidth > e.clientWidth).map(e => e.textContent)")
            assert cut == [], f"labels cut off: {cut}"

            # save, shut the kernel down, open the notebook again: the explorer as last drawn, not an error
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 30
            while "widget-state" not in nb_path.read_text() and time.monotonic() < deadline:
                page.wait_for_timeout(300)
            assert "application/vnd.jupyter.widget-state+json" in nb_path.read_text()
            page.evaluate("async () => { const s = window.jupyterapp.serviceManager.sessions;"
                          " for (const m of Array.from(s.running())) await s.shutdown(m.id); }")
            page.close()
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content")
            page.wait_for_function(f"document.querySelector('{IMAGE}') && "
                                   f"document.querySelector('{IMAGE}').naturalWidth > 0", timeout=60_000)
            reopened = page.inner_text(".jp-Notebook .jp-Cell >> nth=0")
            assert "model not found" not in reopened and "splits: 256" in reopened, reopened[:2000]
        except BaseException:
            shot("failure")
            ARTIFACTS.mkdir(exist_ok=True)
            try:
                shutil.copy(log_path, ARTIFACTS / "browser_jupyterlab.log")
            except OSError:
                pass
            raise
        finally:
            browser.close()
    print(f"browser test: {time.monotonic() - t_start:.1f} s in the browser; "
          f"utilization {util1.split(' — ')[0]!r} -> {util2.split(' — ')[0]!r} -> {util3.split(' — ')[0]!r}")


# ---------------------------------------------------------------------------------------------- ./course lab
def test_course_lab_url_opens_the_welcome_notebook(tmp_path):
    """``./course lab`` prints a URL (with its token) that opens notebooks/00_welcome.ipynb, not the Launcher."""
    _need_browser()
    if not (REPO / ".venv" / "bin" / "jupyter").exists():
        pytest.skip("no .venv: ./course lab would create it (./course test makes it)")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
    env.update(JUPYTER_PORT=str(port), JUPYTER_PORT_RETRIES="0", JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    log_path = tmp_path / "course_lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(REPO / "course"), "lab"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None:
            found = re.findall(rf"http://127\.0\.0\.1:{port}/\S*\?token=[0-9a-f]+", log_path.read_text())
            url = found[0] if found else None
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"./course lab printed no URL with a token:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        assert f"127.0.0.1:{port}/lab/tree/notebooks/00_welcome.ipynb?token=" in url, url
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(60_000)
            try:
                page.goto(url)
                page.wait_for_selector(".lm-TabBar-tab.lm-mod-current:has-text('00_welcome.ipynb')")
                page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell:has-text('Welcome')")
            except BaseException:
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "browser_course_lab_failure.png"))
                raise
            finally:
                browser.close()
    finally:
        _stop(proc)


# ---------------------------------------------------------------------------------------------- reveal, reload, restore
EXERCISE = "lab01.naive_attention"
MARK = "my own attempt, typed and never saved"
EXERCISE_CELL = ".jp-Notebook .jp-Cell:has(.cm-content:has-text('@exercise(\"lab01.naive_attention\")'))"
LIVE_SOURCE = """(name) => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const meta = cells.get(i).getMetadata('fdlib');
    if (meta && meta.exercise === name) return cells.get(i).sharedModel.getSource();
  }
  return null;
}"""


@pytest.fixture
def course_lab(tmp_path):
    """JupyterLab over a root holding a shipped notebooks/01_naive_decode.ipynb: yields (url, root, log path)."""
    _need_browser()
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    path = shipped_copy("01_naive_decode.ipynb", root / "notebooks")
    nb = json.loads(path.read_text())
    nb["metadata"]["kernelspec"] = {"name": KERNEL, "display_name": "fdlib test (venv)", "language": "python"}
    path.write_text(json.dumps(nb, indent=1))
    with _jupyterlab(tmp_path, root) as (base, log_path):
        yield base.replace("/lab?", "/lab/tree/notebooks/01_naive_decode.ipynb?"), root, log_path


def _exercise_source(path: Path) -> str:
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if c.get("metadata", {}).get("fdlib", {}).get("exercise") == EXERCISE)
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _saved_source(path: Path) -> str:
    """:func:`_exercise_source` of a file JupyterLab may be writing at that moment ("" while it is not yet whole:
    a save empties the file, then writes it)."""
    try:
        return _exercise_source(path)
    except (json.JSONDecodeError, StopIteration):
        return ""


def _run_below_exercise(page, code: str):
    """Insert a cell below the exercise cell (command mode B), type ``code`` into it and run it (Shift+Enter)."""
    page.locator(EXERCISE_CELL + " .jp-InputPrompt").first.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")


def test_reveal_reload_restore_round_trip(course_lab):
    """The learner types into the exercise cell and does not save; reveal_solution backs up what the browser
    holds and puts the solution in; Reload Notebook from Disk throws the unsaved edit away; restore_backup()
    lists the backups with their times and puts the typed code back; saving writes it to the file; the file
    browser opens the backup."""
    from playwright.sync_api import sync_playwright

    url, root, log_path = course_lab
    nb_file = root / "notebooks" / "01_naive_decode.ipynb"
    backups = root / "notebooks" / "backups"
    shipped_bytes = nb_file.read_bytes()
    stub = _exercise_source(nb_file)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(60_000)
        live = lambda: page.evaluate(LIVE_SOURCE, EXERCISE)   # noqa: E731 - the exercise cell as the browser holds it
        try:
            page.goto(url)
            page.wait_for_selector(EXERCISE_CELL)
            page.wait_for_selector(".jp-StatusBar-Widget:has-text('Idle')", timeout=90_000)

            # 1. type into the exercise cell, do not save
            page.locator(EXERCISE_CELL + " .cm-content").first.click()
            page.keyboard.press("Control+End")
            page.keyboard.press("Enter")
            page.keyboard.type("# " + MARK)
            assert MARK in live() and MARK not in nb_file.read_text()

            # 2. reveal: the browser's version (with the typed line) is backed up, the solution goes in
            _run_below_exercise(page, f'from fdlib.grading import reveal_solution\nreveal_solution("{EXERCISE}")')
            status = page.wait_for_selector("text=the reference solution is now in", timeout=90_000).inner_text()
            assert live() == core.solution_source(EXERCISE), live()
            made = sorted(backups.glob("01_naive_decode.*.ipynb"))
            assert len(made) == 1 and MARK in _exercise_source(made[0]), made
            assert made[0].name in status, status
            assert nb_file.read_bytes() == shipped_bytes            # nothing was written over the notebook

            # 3. File > Reload Notebook from Disk (as notebook 00 used to ask): the unsaved edit is gone
            page.click(".lm-MenuBar-itemLabel:text-is('File')")
            page.click(".lm-Menu-itemLabel:text-is('Reload Notebook from Disk')")
            page.click(".jp-Dialog-button.jp-mod-accept")
            page.wait_for_function(f"({LIVE_SOURCE})({json.dumps(EXERCISE)}) === {json.dumps(stub)}")
            page.wait_for_selector(".jp-StatusBar-Widget:has-text('Idle')")

            # 4. restore_backup(): the backups with their times, and the typed code is back
            _run_below_exercise(page, "from fdlib.grading import restore_backup\nrestore_backup()")
            page.wait_for_selector("text=is back in its exercise cell", timeout=90_000)
            listing = page.locator(".jp-Cell:has(.cm-content:has-text('restore_backup()')) .jp-OutputArea").inner_text()
            assert re.search(r"\[0\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d  before reveal_solution of " + re.escape(EXERCISE),
                             listing), listing
            assert made[0].name in listing, listing
            assert MARK in live() and live().startswith(stub.rstrip()), live()
            assert len(list(backups.glob("01_naive_decode.*.ipynb"))) == 2   # the state before the restore, too

            # 5. save: the file holds the typed code, and no page script is left in it
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 30
            while MARK not in _saved_source(nb_file) and time.monotonic() < deadline:
                time.sleep(0.3)
            assert MARK in _saved_source(nb_file)
            saved = nb_file.read_text()
            assert "application/javascript" not in saved and "Nothing was changed" not in saved

            # 6. the backups are where JupyterLab's file browser shows and opens them
            page.dblclick(".jp-DirListing-item:has-text('backups')")
            page.dblclick(f".jp-DirListing-item:has-text('{made[0].name}')")
            page.wait_for_selector(f".lm-TabBar-tab:has-text('{made[0].name}')")
            page.wait_for_selector(f".jp-NotebookPanel:not(.lm-mod-hidden) .cm-content:has-text('{MARK}')")
        except BaseException:
            ARTIFACTS.mkdir(exist_ok=True)
            try:
                page.screenshot(path=str(ARTIFACTS / "browser_round_trip_failure.png"), full_page=True)
                shutil.copy(log_path, ARTIFACTS / "browser_round_trip_jupyterlab.log")
            except Exception:
                pass
            raise
        finally:
            browser.close()
