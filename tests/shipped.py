"""The notebooks as the course ships them, for the course's own tests: never the learner's working files.

A learner edits and saves ``notebooks/NN_topic.ipynb``; tests that run notebooks or read their exercise cells need
the shipped version instead. :func:`shipped_copy` writes one into a folder of the test's own, taking the first of
these that is *as shipped* (every exercise cell holds its stub, metadata ``fdlib.stub``, and, where
``notebooks/src/`` and jupytext are there, every cell's type and source are its source file's):

1. the working file: in a fresh clone (CI) and for a developer who rebuilt the notebooks it is the shipped one;
2. the committed versions, newest first (``git show <commit>:notebooks/NN_topic.ipynb``): the course never
   commits a learner's work, so HEAD's version is the shipped one (and if a learner committed theirs, the newest
   commit before that is taken);
3. without git: the working file with its exercise cells put back to their stubs (outputs cleared), which is as
   shipped when the learner changed nothing else.

Why not always git: a developer's rebuilt but uncommitted notebooks must be what the tests run, and a copy of
the course without ``.git`` must still work. Why not a second copy of the notebooks in the repository: it
would double ~0.6 MB of notebooks and could drift from them; git already holds every shipped version.
If none qualifies, the test fails and says what it found.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def notebook_names() -> list[str]:
    """``NN_topic.ipynb`` of every course notebook (the names only: their contents may be the learner's)."""
    return sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _exercise_cells(nb: dict) -> list[dict]:
    return [c for c in nb.get("cells", []) if c.get("cell_type") == "code"
            and "exercise" in c.get("metadata", {}).get("tags", [])]


def _src(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


@lru_cache(maxsize=None)
def _source_cells(name: str):
    """[(type, source)] of the notebook made from ``notebooks/src/<stem>.md``; None where that cannot be made."""
    src = NOTEBOOKS / "src" / (Path(name).stem + ".md")
    build_py = NOTEBOOKS / "build.py"
    if not (src.exists() and build_py.exists()):
        return None
    try:
        spec = importlib.util.spec_from_file_location("fdlib_notebook_build", build_py)
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        nb = build.from_source(src)
    except ImportError:      # jupytext is not installed: check the stubs only
        return None
    return [(c.cell_type, c.source) for c in nb.cells]


def why_not_shipped(name: str, nb: dict) -> str | None:
    """None if ``nb`` is as shipped, else what differs."""
    for c in _exercise_cells(nb):
        stub = c.get("metadata", {}).get("fdlib", {}).get("stub")
        if stub is None:
            return f"an exercise cell has no stub (metadata fdlib.stub): {_src(c)[:60]!r}"
        if _src(c) != stub:
            ex = c.get("metadata", {}).get("fdlib", {}).get("exercise", "?")
            return f"the exercise cell of {ex} is not its stub"
    want = _source_cells(name)
    if want is not None:
        got = [(c.get("cell_type"), _src(c)) for c in nb.get("cells", [])]
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return (f"its cells differ from notebooks/src/{Path(name).stem}.md from cell {i} on "
                    f"({len(got)} cells, the source makes {len(want)})")
    return None


def _git(*args) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _committed(name: str, depth: int = 20):
    """(commit, notebook JSON) of the committed versions of notebooks/<name>, newest first."""
    log = _git("log", f"-n{depth}", "--format=%H", "--", f"notebooks/{name}")
    if log is None or log.returncode != 0:
        return
    for sha in log.stdout.decode().split():
        shown = _git("show", f"{sha}:notebooks/{name}")
        if shown is not None and shown.returncode == 0:
            try:
                yield sha[:10], json.loads(shown.stdout)
            except ValueError:
                continue


def _stubbed(nb: dict) -> dict:
    nb = copy.deepcopy(nb)
    for c in _exercise_cells(nb):
        stub = c.get("metadata", {}).get("fdlib", {}).get("stub")
        if stub is not None:
            c["source"], c["outputs"], c["execution_count"] = stub, [], None
    return nb


@lru_cache(maxsize=None)
def shipped_json(name: str) -> str:
    """The text of the shipped ``notebooks/<name>``; AssertionError saying what was tried if none is found."""
    tried = []
    path = NOTEBOOKS / name
    working = None
    if path.exists():
        try:
            working = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            tried.append(f"the working file is not valid JSON ({e})")
    if working is not None:
        why = why_not_shipped(name, working)
        if why is None:
            return path.read_text(encoding="utf-8")
        tried.append(f"the working file: {why}")
    n = 0
    for sha, nb in _committed(name):
        n += 1
        why = why_not_shipped(name, nb)
        if why is None:
            return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
        tried.append(f"commit {sha}: {why}")
    if n == 0:
        tried.append("git history: none (not a git checkout, or the notebook is not committed)")
    if working is not None:
        nb = _stubbed(working)
        why = why_not_shipped(name, nb)
        if why is None:
            return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
        tried.append(f"the working file with its exercise cells reset to their stubs: {why}")
    raise AssertionError(f"expected to find notebooks/{name} as shipped (exercise cells = their stubs, cells = "
                         f"notebooks/src/); found none:\n  " + "\n  ".join(tried))


def shipped_copy(name: str, folder: Path) -> Path:
    """Write the shipped ``notebooks/<name>`` to ``folder/<name>`` (which must not exist yet); its path."""
    dst = Path(folder) / name
    if dst.exists():
        raise FileExistsError(f"shipped_copy: {dst} already exists")
    dst.write_text(shipped_json(name), encoding="utf-8")
    return dst
