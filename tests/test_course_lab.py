"""``./course lab`` leaves a small machine usable: a kernel nobody is connected to any more (its notebook's tab or
the browser closed) is culled after an idle time, and closing a notebook in JupyterLab shuts its kernel down.

The real server, started by ``./course lab`` (needs ``.venv``, which ``./course test`` makes), with the culling
times shortened through the script's own variables: a session opened over the REST API, no browser attached, is
gone within seconds; the lab settings it serves shut a notebook's kernel down on close."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _get(url: str, token: str, method: str = "GET", body: dict | None = None):
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"token {token}",
                                                              "Content-Type": "application/json"},
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


@pytest.fixture
def course_lab(tmp_path):
    if not (REPO / ".venv" / "bin" / "jupyter").exists():
        pytest.skip("no .venv: ./course lab would create it (./course test makes it)")
    env = {**os.environ, "COURSE_CULL_IDLE_S": "3", "COURSE_CULL_INTERVAL_S": "1"}
    log_path = tmp_path / "course_lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(REPO / "course"), "lab"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            m = re.search(r"(http://127\.0\.0\.1:\d+)/lab[^\s]*\?token=(\w+)", log_path.read_text())
            if m:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"./course lab printed no URL with a token:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield m.group(1), m.group(2), log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)            # the server and the kernels it started, nothing else
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_a_kernel_nobody_is_connected_to_is_culled(course_lab):
    base, token, log_path = course_lab
    session = _get(f"{base}/api/sessions", token, "POST",
                   {"path": "notebooks/00_welcome.ipynb", "type": "notebook", "name": "00_welcome.ipynb",
                    "kernel": {"name": "python3"}})
    kid = session["kernel"]["id"]
    assert kid in {k["id"] for k in _get(f"{base}/api/kernels", token)}
    deadline = time.monotonic() + 60
    while kid in {k["id"] for k in _get(f"{base}/api/kernels", token)}:
        assert time.monotonic() < deadline, f"kernel {kid} still running after 60 s:\n{log_path.read_text()[-3000:]}"
        time.sleep(1)
    assert "Culling" in log_path.read_text()


def test_closing_a_notebook_shuts_its_kernel_down(course_lab):
    base, token, _ = course_lab
    tracker = _get(f"{base}/lab/api/settings/@jupyterlab/notebook-extension:tracker", token)
    # the course's overrides.json becomes the schema's default (a learner's own setting would still win)
    assert tracker["schema"]["properties"]["kernelShutdown"]["default"] is True
    assert tracker["settings"].get("kernelShutdown", True) is True


def test_the_course_script_culls_by_default():
    text = (REPO / "course").read_text()
    assert '--MappingKernelManager.cull_idle_timeout="${COURSE_CULL_IDLE_S:-900}"' in text
    assert '--MappingKernelManager.cull_interval="${COURSE_CULL_INTERVAL_S:-60}"' in text
    settings = json.loads((REPO / ".jupyter" / "settings" / "overrides.json").read_text())
    assert settings["@jupyterlab/notebook-extension:tracker"]["kernelShutdown"] is True


def test_the_readme_says_what_memory_the_course_needs():
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    quick = text.split("## Quick start")[1].split("## ")[0]
    assert "each open notebook's kernel 0.4–0.55 GB" in quick and "2 GB of free memory" in quick
