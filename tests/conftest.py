"""Shared pytest configuration.

Grading: ``tests/test_graders_labNN.py`` run the checks of ``fdlib/course/grading/labNN.py`` on the reference solutions in
``labsolutions/`` by default, or, with ``--grade-notebooks``, on the learner's exercise cells of
``notebooks/NN_*.ipynb``. A per-lab scorecard is printed at the end of the run.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def pytest_addoption(parser):
    parser.addoption("--grade-notebooks", action="store_true", default=False,
                     help="grade the exercise cells of notebooks/NN_*.ipynb instead of labsolutions/")
    parser.addoption("--notebooks-dir", default=str(NOTEBOOKS),
                     help="where --grade-notebooks looks for NN_*.ipynb (default: notebooks/)")


# ---------------------------------------------------------------------------------------------- grading
_NB_CACHE: dict[str, dict] = {}


def _notebook_exercises(lab: str, folder: Path) -> tuple[Path | None, dict]:
    from fdlib.course.grading.notebook_tools import load_exercises
    nbs = sorted(folder.glob(f"{lab[3:]}_*.ipynb"))
    if not nbs:
        return None, {}
    if lab not in _NB_CACHE:
        _NB_CACHE[lab] = load_exercises(nbs[0])
    return nbs[0], _NB_CACHE[lab]


@pytest.fixture
def grade(request):
    """``grade(exercise, check_name)``: run one check on the solution (or notebook cell) and fail with its ❌ line."""
    from fdlib.course.grading import core

    def run(name: str, check_name: str):
        lab = name.split(".")[0]
        request.node.user_properties.append(("grading_lab", lab))
        if request.config.getoption("--grade-notebooks"):
            nb, found = _notebook_exercises(lab, Path(request.config.getoption("--notebooks-dir")))
            if nb is None:
                pytest.fail(f"no notebook notebooks/{lab[3:]}_*.ipynb to grade", pytrace=False)
            if isinstance(found, Exception):
                pytest.fail(f"{nb.name}: running its exercise cells raised {found!r}", pytrace=False)
            if name not in found:
                pytest.fail(f"{nb.name} defines no @exercise({name!r}) in a cell tagged 'exercise'", pytrace=False)
            impl = found[name]
        else:
            impl = core.reference(name)
        chk = next(c for c in core.load_checks(name) if c.name == check_name)
        out = core.run_one(chk, impl)
        if out.status == "todo":
            request.node.user_properties.append(("grading_todo", True))
        if out.status != "pass":
            pytest.fail(out.line(), pytrace=False)

    return run


_SCORES: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])     # passed, total, still a stub (TODO)


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    lab = props.get("grading_lab")
    if lab and (report.when == "call" or (report.when == "setup" and not report.passed)):
        _SCORES[lab][1] += 1
        _SCORES[lab][0] += int(report.passed)
        _SCORES[lab][2] += int(bool(props.get("grading_todo")))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _SCORES:
        return
    what = "notebook exercise cells" if config.getoption("--grade-notebooks") else "labsolutions/"
    tr = terminalreporter
    tr.section(f"lab scorecard ({what})")
    for lab in sorted(_SCORES):
        ok, total, todo = _SCORES[lab]
        if todo == total:
            tr.write_line(f"📝 {lab}: not started ({total} checks)")
        else:
            tr.write_line(f"{'✅' if ok == total else '❌'} {lab}: {ok}/{total} checks passed")
