"""The notebooks run top to bottom under nbval, as shipped (stubs) and with the reference solutions filled in.

Each run is a separate pytest process (``python -m pytest --nbval-lax``) so its kernel and plugins are isolated;
cells tagged ``nbval-check-output`` must reproduce their stored outputs. Every test works on the shipped
notebooks (``shipped.py``: the working file only while it is as shipped, else the committed one), never on the
learner's saved work.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from shipped import notebook_names, shipped_copy, shipped_json

from fdlib.course.grading.notebook_tools import exercise_cells, solved_copy

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [ROOT / "notebooks" / n for n in notebook_names()]     # names only: the files may be the learner's
IDS = [p.stem for p in NOTEBOOKS]


def _nbval(path: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider", "--rootdir", str(cwd),
         "-o", "addopts=", str(path)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _assert_ok(proc, what):
    assert proc.returncode == 0, f"{what} failed under nbval:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_notebook_as_shipped(nb, tmp_path):
    copy = shipped_copy(nb.name, tmp_path)
    _assert_ok(_nbval(copy, tmp_path), nb.name)


def _has_exercises(name: str) -> bool:
    try:
        return bool(exercise_cells(nbformat.reads(shipped_json(name), as_version=4)))
    except AssertionError:
        return True          # no shipped copy found: the test itself says why


SOLVABLE = [p for p in NOTEBOOKS if _has_exercises(p.name)]


@pytest.mark.slow
@pytest.mark.parametrize("nb", SOLVABLE, ids=[p.stem for p in SOLVABLE])
def test_notebook_solved(nb, tmp_path):
    (tmp_path / "shipped").mkdir()
    solved = solved_copy(shipped_copy(nb.name, tmp_path / "shipped"), tmp_path / nb.name)
    proc = _nbval(solved, tmp_path)
    _assert_ok(proc, f"{nb.name} with the reference solutions")


@pytest.mark.slow
def test_grade_notebooks_option(tmp_path):
    """``--grade-notebooks`` grades the notebook cells: stubs fail every check, solved cells pass them all."""
    shipped, solved = tmp_path / "shipped", tmp_path / "solved"
    shipped.mkdir(), solved.mkdir()
    for nb in SOLVABLE:
        solved_copy(shipped_copy(nb.name, shipped), solved / nb.name)
    graders = [str(p) for nb in SOLVABLE if (p := ROOT / "tests" / f"test_graders_lab{nb.name[:2]}.py").exists()]

    def grade(folder):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--grade-notebooks",
                               "--notebooks-dir", str(folder), *graders],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)

    bad = grade(shipped)
    assert bad.returncode != 0 and "lab scorecard (notebook exercise cells)" in bad.stdout
    assert "📝 lab01: not started" in bad.stdout and "📝 TODO: implement lab01.naive_attention" in bad.stdout
    good = grade(solved)
    assert good.returncode == 0, good.stdout[-4000:]
    assert "✅ lab01: " in good.stdout and "✅ lab02: " in good.stdout and "❌ lab" not in good.stdout
