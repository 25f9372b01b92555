"""reveal_solution / reset_exercise / restore_backup / list_backups, the kernel side (fdlib.course.grading.live).

The page side (the script that backs up the notebook open in JupyterLab and changes its cell) runs in the browser
test (``test_browser.py::test_reveal_reload_restore_round_trip``). Here: what the kernel sends the page, the
backups' listing and choice, the messages, and that nothing is ever written to a notebook file.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fdlib.course.grading import core, live

ROOT = Path(__file__).resolve().parents[1]
NAME = "lab01.naive_attention"


def _notebook(cells: dict, meta: dict | None = None) -> dict:
    """A notebook whose exercise cells hold ``cells`` ({name: source}), with an fdlib_backup record if given."""
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# a lab"}], "metadata": {},
          "nbformat": 4, "nbformat_minor": 5}
    for name, src in cells.items():
        nb["cells"].append({"cell_type": "code", "execution_count": None, "outputs": [], "source": src.splitlines(True),
                            "metadata": {"tags": ["exercise"], "fdlib": {"exercise": name, "stub": "stub"}}})
    if meta:
        nb["metadata"]["fdlib_backup"] = meta
    return nb


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A pretend kernel for notebooks/01_naive_decode.ipynb: what it displays is collected in the list it yields."""
    nb = tmp_path / "notebooks" / "01_naive_decode.ipynb"
    nb.parent.mkdir()
    nb.write_text(json.dumps(_notebook({NAME: "my work"})))
    shown = []
    monkeypatch.setenv("JPY_SESSION_NAME", str(nb))
    monkeypatch.setattr(live, "_in_kernel", lambda: True)
    import IPython.display
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    return nb, shown


def _request(bundle: dict) -> dict:
    script = bundle["application/javascript"]
    start = script.index("const REQ = ") + len("const REQ = ")
    return json.JSONDecoder().raw_decode(script[start:])[0]


def test_outside_a_notebook_nothing_happens(capsys, monkeypatch):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    for fn in (live.reveal_solution, live.reset_exercise):
        assert fn(NAME) is None
        assert "nothing was changed" in capsys.readouterr().out
    live.restore_backup()
    live.list_backups()
    out = capsys.readouterr().out
    assert out.count("run it in a notebook open in JupyterLab") == 2


def test_an_unknown_exercise_names_the_known_ones():
    with pytest.raises(ValueError, match=r"expected the name of an exercise, one of \[.*'lab01.naive_attention'.*\]; "
                                         r"got 'lab01.naive'"):
        live.reveal_solution("lab01.naive")


def test_reveal_sends_the_solution_to_the_page_and_writes_no_notebook(kernel):
    nb, shown = kernel
    before = nb.read_bytes()
    live.reveal_solution(NAME)
    (bundle,) = shown
    req = _request(bundle)
    assert req["action"] == "reveal" and req["cells"] == {NAME: core.solution_source(NAME)}
    assert req["homes"] == {NAME: "01_naive_decode.ipynb"} and req["folder"] == "backups" and req["notebook"] is None
    assert "nothing was changed" in bundle["text/plain"]             # what a front end without scripts shows
    assert nb.read_bytes() == before                                   # the notebook file is never written
    ignore = nb.parent / "backups" / ".gitignore"
    assert ignore.read_text().strip().endswith("*")                    # backups/ is visible, and kept out of git


def test_reset_asks_for_the_stored_stub_and_the_old_call_form_still_works(kernel):
    nb, shown = kernel
    live.reset_exercise(NAME)
    live.reveal_solution("01_naive_decode.ipynb", NAME)                # the old (path, name) form
    reset, reveal = (_request(b) for b in shown)
    assert reset["action"] == "reset" and reset["cells"] == {NAME: None}
    assert reveal["notebook"] == "01_naive_decode.ipynb"               # the page checks it is that notebook


def _backup(folder: Path, name: str, cells: dict, meta: dict | None = None) -> Path:
    folder.mkdir(exist_ok=True)
    p = folder / name
    p.write_text(json.dumps(_notebook(cells, meta)))
    return p


def test_backups_are_listed_newest_first_with_their_times(kernel, capsys):
    nb, _ = kernel
    d = nb.parent
    live.list_backups()
    assert "No backups of 01_naive_decode.ipynb yet" in capsys.readouterr().out
    _backup(d / "backups", "01_naive_decode.20260101-100000.ipynb", {NAME: "first try"},
            {"time": "2026-01-01 10:00:00", "action": "reveal", "exercises": [NAME]})
    _backup(d / "backups", "01_naive_decode.20260102-090000.ipynb", {NAME: "second try"},
            {"time": "2026-01-02 09:00:00", "action": "reset", "exercises": [NAME]})
    old = _backup(d / ".backups", "01_naive_decode.20251231-120000-000000001.ipynb", {NAME: "older fdlib"})
    _backup(d / "backups", "02_online_softmax.20260103-090000.ipynb", {"lab02.merge": "other notebook"})
    (d / "backups" / "01_naive_decode.20260104-090000.ipynb").write_text("{half written")
    import os
    os.utime(old, (1767182400, 1767182400))                            # 2025-12-31, by its file time
    live.list_backups()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Backups of 01_naive_decode.ipynb, newest first")
    assert "[0] 2026-01-02 09:00:00  before reset_exercise of lab01.naive_attention" in lines[1]
    assert "[1] 2026-01-01 10:00:00  before reveal_solution of lab01.naive_attention" in lines[2]
    assert "[2] 2025-12-31" in lines[3] and "made by an older fdlib" in lines[3] and ".backups/" in lines[3]
    assert len(lines) == 4                                             # not 02's, not the unreadable one


def test_restore_sends_the_backups_version_of_its_exercise(kernel, capsys):
    nb, shown = kernel
    d = nb.parent
    _backup(d / "backups", "01_naive_decode.20260101-100000.ipynb", {NAME: "first try\n"},
            {"time": "2026-01-01 10:00:00", "action": "reveal", "exercises": [NAME]})
    _backup(d / "backups", "01_naive_decode.20260102-090000.ipynb", {NAME: "second try\n"},
            {"time": "2026-01-02 09:00:00", "action": "reset", "exercises": [NAME]})
    live.restore_backup()
    out = capsys.readouterr().out
    assert "→ [0] 2026-01-02 09:00:00" in out and "Restoring lab01.naive_attention from [0]" in out
    req = _request(shown[-1])
    assert req["action"] == "restore" and req["cells"] == {NAME: "second try\n"}
    assert req["source"] == "backups/01_naive_decode.20260102-090000.ipynb"
    live.restore_backup(1)
    assert _request(shown[-1])["cells"] == {NAME: "first try\n"}
    live.restore_backup("01_naive_decode.20260101-100000.ipynb")
    assert _request(shown[-1])["cells"] == {NAME: "first try\n"}


def test_restore_errors_say_what_was_expected_and_what_came(kernel, capsys):
    nb, shown = kernel
    live.restore_backup()
    assert "nothing to restore" in capsys.readouterr().out and not shown
    _backup(nb.parent / "backups", "01_naive_decode.20260101-100000.ipynb", {NAME: "x"},
            {"time": "2026-01-01 10:00:00", "action": "reveal", "exercises": [NAME]})
    with pytest.raises(ValueError, match=r"expected a backup number from 0 to 0 \(see list_backups\(\)\), got 3"):
        live.restore_backup(3)
    with pytest.raises(ValueError, match=r"expected a backup number or one of the files "
                                         r"\['01_naive_decode.20260101-100000.ipynb'\], got 'nope.ipynb'"):
        live.restore_backup("nope.ipynb")
    with pytest.raises(ValueError, match=r"expected the backup 01_naive_decode.20260101-100000.ipynb to hold the "
                                         r"exercise cell of \['lab02.merge'\]; it holds \['lab01.naive_attention'\]"):
        live.restore_backup(exercise="lab02.merge")
    assert not shown


def test_course_lab_gives_page_scripts_the_app():
    text = (ROOT / "course").read_text()
    lab = text[text.index("  lab)"):text.index("  test)")]
    assert live.LAB_FLAG in lab


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (syntax check only)")
def test_the_page_script_parses(tmp_path):
    script = live.PAGE_SCRIPT.replace("__REQUEST__", json.dumps(live.request("reveal", {NAME: "x"})))
    (tmp_path / "page.js").write_text(script)
    proc = subprocess.run(["node", "--check", str(tmp_path / "page.js")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
