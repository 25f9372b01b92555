"""Notebook helpers: find a notebook's exercise cells, run them for grading, reset or reveal an exercise.

An exercise cell is a code cell tagged ``exercise`` (cell metadata ``tags``) whose source decorates a function with
``@exercise("labNN.name")``; its metadata ``fdlib.exercise`` holds the name and ``fdlib.stub`` the original stub.

:func:`reset_exercise` and :func:`reveal_solution` edit a notebook file. They never overwrite it without first
saving the learner's version to ``notebooks/.backups/<name>.<timestamp>.ipynb``; :func:`solved_copy` only
writes a new file. If the notebook is open in
JupyterLab, reload it there afterwards (File > Reload Notebook from Disk) and do not save the stale tab over it.
"""
from __future__ import annotations

import linecache
import re
import shutil
import time
from pathlib import Path

import nbformat

from . import core

TAG = "exercise"
PREAMBLE = ("import math\nimport torch\nimport triton\nimport triton.language as tl\nimport fdlib\n"
            "from fdlib.online_softmax import State\nfrom fdlib.grading import *\n")
_NAME_RE = re.compile(r"""@exercise\(\s*["']([^"']+)["']""")


def exercise_name(cell) -> str | None:
    """The exercise a cell defines, or None if it is not an exercise cell."""
    if cell.get("cell_type") != "code" or TAG not in cell.get("metadata", {}).get("tags", []):
        return None
    name = cell.get("metadata", {}).get("fdlib", {}).get("exercise")
    if name:
        return name
    found = _NAME_RE.search(cell.get("source", ""))
    return found.group(1) if found else None


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


def backup(path) -> Path:
    """Copy the notebook to ``<its folder>/.backups/<stem>.<timestamp>.ipynb``; returns the copy's path."""
    path = Path(path)
    folder = path.parent / ".backups"
    folder.mkdir(exist_ok=True)
    ignore = folder / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# learners' notebook backups stay out of git\n*\n")
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
    dst = folder / f"{path.stem}.{stamp}.ipynb"
    shutil.copy2(path, dst)
    if dst.read_bytes() != path.read_bytes():  # never go on without an exact copy
        raise OSError(f"backup of {path} to {dst} is not identical; notebook left untouched")
    return dst


def _edit_exercise(path, name: str, new_source) -> Path:
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    cells = exercise_cells(nb)
    if name not in cells:
        raise KeyError(f"{path.name} has no exercise cell for {name!r} (found: {sorted(cells)})")
    cell = nb.cells[cells[name]]
    saved = backup(path)
    cell.source = new_source(cell)
    cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, path)
    print(f"{path.name}: exercise {name} replaced; your previous version is saved in {saved}")
    return saved


def reset_exercise(path, name: str) -> Path:
    """Put the original stub back into the exercise cell of ``name`` (after backing the notebook up)."""
    def stub(cell):
        src = cell.get("metadata", {}).get("fdlib", {}).get("stub")
        if src is None:
            raise KeyError(f"the cell of {name} has no stored stub (metadata fdlib.stub)")
        return src
    return _edit_exercise(path, name, stub)


def reveal_solution(path, name: str) -> Path:
    """Write the reference solution into the exercise cell of ``name`` (after backing the notebook up)."""
    return _edit_exercise(path, name, lambda cell: core.solution_source(name))


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
