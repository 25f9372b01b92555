"""shipped.py finds the notebooks as shipped whatever the learner saved: in a pretend checkout in a temporary
folder (a notebook with one exercise cell, committed with git), the learner solves the exercise, commits it,
or has no git at all."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import shipped

NB = "01_lab.ipynb"


def _nb(exercise_src: str, extra: str = "print('hi')") -> str:
    return json.dumps({"cells": [
        {"cell_type": "code", "execution_count": None, "outputs": [], "source": extra, "metadata": {}},
        {"cell_type": "code", "execution_count": None, "outputs": [], "source": exercise_src,
         "metadata": {"tags": ["exercise"], "fdlib": {"exercise": "lab01.x", "stub": "todo()"}}}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.setattr(shipped, "ROOT", tmp_path)
    monkeypatch.setattr(shipped, "NOTEBOOKS", tmp_path / "notebooks")
    shipped.shipped_json.cache_clear(), shipped._source_cells.cache_clear()
    yield tmp_path
    shipped.shipped_json.cache_clear(), shipped._source_cells.cache_clear()


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def _save(root, text, commit=None):
    (root / "notebooks" / NB).write_text(text)
    if commit:
        _git(root, "add", f"notebooks/{NB}")
        _git(root, "commit", "-q", "-m", commit)
    shipped.shipped_json.cache_clear()


def _exercise(text: str) -> str:
    return json.loads(text)["cells"][1]["source"]


def test_the_learners_solution_is_never_the_shipped_notebook(checkout):
    _git(checkout, "init", "-q")
    _save(checkout, _nb("todo()"), commit="the course")
    assert _exercise(shipped.shipped_json(NB)) == "todo()"                          # clean: the working file
    _save(checkout, _nb("return 42  # mine"))
    assert _exercise(shipped.shipped_json(NB)) == "todo()"                          # solved: HEAD's version
    _save(checkout, _nb("return 42  # mine"), commit="my work")
    assert _exercise(shipped.shipped_json(NB)) == "todo()"                          # committed: the one before
    dst = shipped.shipped_copy(NB, checkout)
    assert _exercise(dst.read_text()) == "todo()" and "# mine" in (checkout / "notebooks" / NB).read_text()
    with pytest.raises(FileExistsError):
        shipped.shipped_copy(NB, checkout)


def test_a_developers_rebuilt_notebook_is_used_before_the_commit(checkout):
    _git(checkout, "init", "-q")
    _save(checkout, _nb("todo()"), commit="the course")
    _save(checkout, _nb("todo()", extra="print('a new lesson')"))                 # rebuilt, not committed
    assert "a new lesson" in shipped.shipped_json(NB)


def test_without_git_the_exercise_cells_go_back_to_their_stubs(checkout):
    _save(checkout, _nb("return 42  # mine"))                                       # no .git here
    text = shipped.shipped_json(NB)
    assert _exercise(text) == "todo()" and "print('hi')" in text


def test_when_nothing_qualifies_it_says_what_it_tried(checkout):
    nb = json.loads(_nb("return 42"))
    del nb["cells"][1]["metadata"]["fdlib"]["stub"]
    _save(checkout, json.dumps(nb))
    with pytest.raises(AssertionError, match=r"(?s)expected to find notebooks/01_lab.ipynb as shipped.*"
                                             r"the working file: an exercise cell has no stub.*git history: none"):
        shipped.shipped_json(NB)
