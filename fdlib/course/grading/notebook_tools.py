"""Notebook helpers: find a notebook's exercise cells and run them for grading; a solved copy for tests.

An exercise cell is a code cell tagged ``exercise`` (cell metadata ``tags``) whose source decorates a function with
``@exercise("labNN.name")``; its metadata ``fdlib.exercise`` holds the name and ``fdlib.stub`` the original stub.

Nothing here writes to a learner's notebook: :func:`solved_copy` only writes a new file. Revealing a solution,
resetting an exercise and restoring a backup happen in the notebook open in JupyterLab, never in its file
(:mod:`fdlib.course.grading.live`; :func:`reveal_solution` and :func:`reset_exercise` are imported here too).
"""
from __future__ import annotations

import linecache
from pathlib import Path

import nbformat

from . import core
from .live import reset_exercise, reveal_solution  # noqa: F401 - notebook 00 imports them from here

TAG = core.EXERCISE_TAG
PREAMBLE = ("import math\nimport torch\nimport triton\nimport triton.language as tl\nimport fdlib\n"
            "from fdlib.online_softmax import State\nfrom fdlib.grading import *\n")
exercise_name = core.exercise_name


def exercise_cells(nb) -> dict[str, int]:
    """``{exercise name: cell index}`` of a notebook node."""
    return {n: i for i, c in enumerate(nb.cells) if (n := exercise_name(c))}


def _runnable(src: str) -> str:
    """Drop IPython-only lines (magics, shell escapes) so the cell runs as plain Python."""
    return "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))


def run_source(src: str, filename: str, ns: dict) -> None:
    """``exec`` the source in ``ns``, with the source kept in ``linecache`` under ``filename`` (as Jupyter does), so
    that ``inspect.getsource`` works on what it defines: ``@triton.jit`` needs the source of its function."""
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    exec(compile(src, filename, "exec"), ns)


def load_exercise_cells(path) -> tuple[dict, dict]:
    """Run a notebook's exercise cells one by one after the standard imports: ``({name: function}, {name: error})``.

    A cell that raises (a syntax error, a bad import) is reported under its exercise's name; the other cells
    still run, so one broken cell does not hide the rest of the lab.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    ns: dict = {"__name__": f"notebook_{path.stem}"}
    exec(compile(PREAMBLE, "<preamble>", "exec"), ns)
    errors: dict = {}
    for name, i in exercise_cells(nb).items():
        try:
            run_source(_runnable(nb.cells[i].source), f"<{path.name} cell {i} ({name})>", ns)
        except Exception as e:  # noqa: BLE001 - reported per exercise
            errors[name] = e
    found = {v.__exercise__: v for v in ns.values() if callable(v) and hasattr(v, "__exercise__")}
    return {n: f for n, f in found.items() if n not in errors}, errors


def load_exercises(path) -> dict:
    """Run a notebook's exercise cells (only those) after the standard imports; ``{name: function}``.

    Returns the exception instead of raising it if a cell fails to run, so a grader can report it.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    ns: dict = {"__name__": f"notebook_{path.stem}"}
    try:
        exec(compile(PREAMBLE, "<preamble>", "exec"), ns)
        for name, i in exercise_cells(nb).items():
            run_source(_runnable(nb.cells[i].source), f"<{path.name} cell {i} ({name})>", ns)
    except Exception as e:  # noqa: BLE001
        return e  # type: ignore[return-value]
    return {v.__exercise__: v for v in ns.values() if callable(v) and hasattr(v, "__exercise__")}


def solved_copy(path, dst) -> Path:
    """Write a copy of the notebook to ``dst`` with every exercise cell replaced by its reference solution.
    ``dst`` must not exist yet (FileExistsError otherwise), so a learner's notebook is never written over."""
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"solved_copy: {dst} already exists; pick a new file name (nothing was written)")
    nb = nbformat.read(Path(path), as_version=4)
    for name, i in exercise_cells(nb).items():
        nb.cells[i].source = core.solution_source(name)
    nbformat.write(nb, dst)
    return dst
