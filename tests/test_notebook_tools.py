"""reset_exercise / reveal_solution edit notebook files, so they must never lose the learner's work."""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from fdlib.grading import core
from fdlib.grading.notebook_tools import exercise_cells, load_exercises, reset_exercise, reveal_solution, solved_copy

ROOT = Path(__file__).resolve().parents[1]
LAB01 = ROOT / "notebooks" / "01_naive_decode.ipynb"
NAME = "lab01.naive_attention"


@pytest.fixture
def notebook(tmp_path):
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    dst = nb_dir / LAB01.name
    shutil.copy(LAB01, dst)
    # the learner's own (wrong) attempt
    nb = nbformat.read(dst, as_version=4)
    i = exercise_cells(nb)[NAME]
    nb.cells[i].source = nb.cells[i].source.replace('todo("lab01.naive_attention")', "return q, q  # my attempt")
    nbformat.write(nb, dst)
    return dst


def _source(path, name=NAME):
    nb = nbformat.read(path, as_version=4)
    return nb.cells[exercise_cells(nb)[name]].source


def test_shipped_notebooks_have_their_exercises():
    for nb_name, names in (("01_naive_decode", {NAME}),
                           ("02_online_softmax", {"lab02.online_softmax", "lab02.merge"})):
        nb = nbformat.read(ROOT / "notebooks" / f"{nb_name}.ipynb", as_version=4)
        assert set(exercise_cells(nb)) == names
        for name, i in exercise_cells(nb).items():
            assert nb.cells[i].metadata["fdlib"]["stub"] == nb.cells[i].source   # shipped = stub
            assert f'todo("{name}")' in nb.cells[i].source


def test_reveal_backs_up_first_then_reset_restores_stub(notebook):
    mine = notebook.read_bytes()
    saved = reveal_solution(notebook, NAME)
    assert saved.parent == notebook.parent / ".backups" and saved.name.startswith("01_naive_decode.")
    assert saved.read_bytes() == mine                                  # the learner's version, byte for byte
    assert "my attempt" not in _source(notebook) and "@exercise(\"lab01.naive_attention\")" in _source(notebook)
    assert (notebook.parent / ".backups" / ".gitignore").read_text().strip().endswith("*")
    fn = load_exercises(notebook)[NAME]
    assert core.run_checks(NAME, fn, quiet=True).ok                    # the revealed solution passes

    revealed = notebook.read_bytes()
    saved2 = reset_exercise(notebook, NAME)
    assert saved2 != saved and saved2.read_bytes() == revealed
    assert _source(notebook) == nbformat.read(LAB01, as_version=4).cells[
        exercise_cells(nbformat.read(LAB01, as_version=4))[NAME]].source
    assert len(list((notebook.parent / ".backups").glob("*.ipynb"))) == 2


def test_unknown_exercise_leaves_notebook_untouched(notebook):
    before = notebook.read_bytes()
    with pytest.raises(KeyError):
        reveal_solution(notebook, "lab01.nope")
    assert notebook.read_bytes() == before
    assert not (notebook.parent / ".backups").exists() or not list((notebook.parent / ".backups").glob("*.ipynb"))


def test_load_exercises_grades_learner_cells(notebook, tmp_path):
    found = load_exercises(notebook)
    res = core.run_checks(NAME, found[NAME], quiet=True)
    assert not res.ok and res.passed == 0
    solved = solved_copy(notebook, tmp_path / "solved.ipynb")
    assert core.run_checks(NAME, load_exercises(solved)[NAME], quiet=True).ok


def test_solved_copy_never_writes_over_a_file(notebook):
    mine = notebook.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        solved_copy(notebook, notebook)
    assert notebook.read_bytes() == mine
