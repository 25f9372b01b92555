"""The SM-occupancy explorer in a real JupyterLab, driven by headless Chromium.

Starts JupyterLab on 127.0.0.1 (free port, random token) over a temporary root holding a one-cell notebook
(the explorer at B=1, H_q=32, H_kv=8, L=131072 on the H200 model, splits=1), runs the cell with
Shift+Enter, reads the utilization text and the picture, moves the splits slider with the keyboard, and
checks that both change: 1 split keeps 8 of 132 SMs busy; the cost model's choice, and 256 splits, keep
nearly all of them busy.
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
from pathlib import Path

import pytest

from fdlib.explorer import SPLIT_OPTIONS

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

ARTIFACTS = Path(__file__).resolve().parent / "_artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
KERNEL = "fdlib-test-venv"
CELL = ("import sys\n"
        "from fdlib.explorer import explorer\n"
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


@pytest.fixture
def lab(tmp_path):
    """A running JupyterLab: yields (url of the notebook with the token, path of its log)."""
    pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); the browser test never downloads one")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    pytest.importorskip("jupyterlab_widgets", reason="jupyterlab_widgets (ipywidgets' lab extension) is not installed")
    root = tmp_path / "root"
    root.mkdir()
    (root / "explorer_test.ipynb").write_text(json.dumps(_notebook()))
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
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False"]
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
        yield f"http://127.0.0.1:{port}/lab/tree/explorer_test.ipynb?token={token}", log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
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

    url, log_path = lab
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
