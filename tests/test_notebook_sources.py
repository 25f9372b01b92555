"""The notebooks are made from their sources (notebooks/src/NN_topic.md, MyST markdown) by notebooks/build.py.

No execution here: the cells of every shipped notebook must be those of its source, and every exercise cell must
ship the stub its grader recognises as untouched.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from fdlib.course.grading import core
from shipped import shipped_json     # the shipped notebook (the committed one where the learner saved work)

pytest.importorskip("jupytext", reason="jupytext reads the notebook sources")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebook_build", ROOT / "notebooks" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)
SOURCES = build.sources()


def test_every_notebook_has_a_source():
    shipped = {p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert shipped and shipped == {p.stem for p in SOURCES}


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_matches_its_source(src):
    hint = f"{src.stem}.ipynb differs from notebooks/src/{src.name}: run python notebooks/build.py {src.stem}"
    try:
        shipped = nbformat.reads(shipped_json(f"{src.stem}.ipynb"), as_version=4)
    except AssertionError as e:
        raise AssertionError(f"{hint}\n{e}") from None
    assert build.cells_of(shipped) == build.cells_of(build.from_source(src)), hint


def test_exercise_stubs_are_the_graders():
    """Every exercise cell ships the stub its grader module holds (fdlib.course.grading.core.stub_source), and every
    exercise with checks has its cell."""
    graders = {name: core.stub_source(name) for name in core.exercises()}
    seen = set()
    for src in SOURCES:
        for cell in build.from_source(src).cells:
            name = cell.metadata.get("fdlib", {}).get("exercise")
            if name is not None:
                seen.add(name)
                assert name in graders, f"{src.name}: the exercise {name} has no stub in fdlib/course/grading"
                assert cell.source == graders[name], f"{src.name}: the stub of {name} is not the grader's"
    assert seen == set(graders)


def test_checked_cells_use_the_nbval_tag():
    for src in SOURCES:
        assert "NBVAL_CHECK_OUTPUT" not in src.read_text(), f"{src.name}: use the cell tag nbval-check-output"


# ---------------------------------------------------------------------------------------------- lessons, not diaries
MAX_WORDS = 3000
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_HISTORY = re.compile(r"\bruns? [0-9]+\b|\bissue [0-9]+|\bthe protocol\b", re.IGNORECASE)


def prose(src: Path) -> str:
    """The markdown of a lesson source, code fences left out (what a learner reads as text)."""
    out, in_code = [], False
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_a_lesson_is_short_and_carries_no_history(src):
    text = prose(src)
    words = len(text.split())
    assert words <= MAX_WORDS, f"{src.name}: {words} markdown words, at most {MAX_WORDS} (history goes to results/notes/)"
    assert not _HASH.findall(text), f"{src.name}: commit hashes in the prose: {_HASH.findall(text)}"
    assert not _HISTORY.findall(text), f"{src.name}: run/issue/protocol mentions: {_HISTORY.findall(text)}"


def test_the_history_check_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "99_bad.md"
    bad.write_text("As run 63 showed (commit 3c4b0db), the protocol met issue 13.\n```python\nx = 1\n```\n")
    text = prose(bad)
    assert _HASH.findall(text) == ["3c4b0db"] and len(_HISTORY.findall(text)) == 3 and "x = 1" not in text
