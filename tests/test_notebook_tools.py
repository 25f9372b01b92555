"""notebook_tools reads notebooks for grading and never writes over one. Works on shipped copies (``shipped.py``),
never on the learner's notebooks."""
from __future__ import annotations

import nbformat
import pytest
from shipped import shipped_copy

from fdlib.course.grading import core
from fdlib.course.grading.notebook_tools import exercise_cells, load_exercise_cells, load_exercises, solved_copy

NAME = "lab01.naive_attention"


@pytest.fixture
def notebook(tmp_path):
    """A shipped Lab 01 with the learner's own (wrong) attempt in its exercise cell."""
    (tmp_path / "notebooks").mkdir()
    dst = shipped_copy("01_naive_decode.ipynb", tmp_path / "notebooks")
    nb = nbformat.read(dst, as_version=4)
    i = exercise_cells(nb)[NAME]
    nb.cells[i].source = nb.cells[i].source.replace('todo("lab01.naive_attention")', "return q, q  # my attempt")
    nbformat.write(nb, dst)
    return dst


def test_shipped_notebooks_have_their_exercises(tmp_path):
    for nb_name, names in (("01_naive_decode", {NAME}),
                           ("02_online_softmax", {"lab02.online_softmax", "lab02.merge"})):
        nb = nbformat.read(shipped_copy(f"{nb_name}.ipynb", tmp_path), as_version=4)
        assert set(exercise_cells(nb)) == names
        for name, i in exercise_cells(nb).items():
            assert nb.cells[i].metadata["fdlib"]["stub"] == nb.cells[i].source   # shipped = stub
            assert f'todo("{name}")' in nb.cells[i].source


def test_load_exercises_grades_learner_cells(notebook, tmp_path):
    found = load_exercises(notebook)
    res = core.run_checks(NAME, found[NAME], quiet=True)
    assert not res.ok and res.passed == 0
    solved = solved_copy(notebook, tmp_path / "solved.ipynb")
    assert core.run_checks(NAME, load_exercises(solved)[NAME], quiet=True).ok


def test_a_broken_cell_is_reported_under_its_exercise_and_the_others_still_load(tmp_path):
    dst = shipped_copy("02_online_softmax.ipynb", tmp_path)
    nb = nbformat.read(dst, as_version=4)
    i = exercise_cells(nb)["lab02.online_softmax"]
    nb.cells[i].source += "\ndef broken(:"
    nbformat.write(nb, dst)
    found, errors = load_exercise_cells(dst)
    assert set(errors) == {"lab02.online_softmax"} and isinstance(errors["lab02.online_softmax"], SyntaxError)
    assert set(found) == {"lab02.merge"}
    assert isinstance(load_exercises(dst), SyntaxError)          # the all-or-nothing loader the pytest graders use


def test_solved_copy_never_writes_over_a_file(notebook):
    mine = notebook.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        solved_copy(notebook, notebook)
    assert notebook.read_bytes() == mine
