r"""``./course grade [lab ...]``: grade the exercise cells of the learner's saved notebooks, and print a scorecard.

Only the graders run (the checks of :mod:`fdlib.course.grading.core` and ``labNN.py``, the same ones the check cells and
the pytest graders run), on the exercise cells of ``notebooks/NN_topic.ipynb`` as saved on disk: a few seconds
for all labs on a laptop CPU. For each exercise it prints one line, and a ❌ line with the reason for each
failed check; it ends with the scorecard, one line per lab:

* ✅ k/n: every check passed; ❌ k/n: some did not; 📝 not started: every exercise of the lab is still its stub.

k/n are points: each check is worth 1 or 2 (``@check_case(..., points=2)`` for an exercise's main case),
summed per lab, so a partly working exercise earns partial credit. ``--speed`` adds, on a CUDA GPU, the speed
of the learner's kernels (:mod:`fdlib.course.grading.speed`). Where the terminal cannot show emoji, ``--ascii`` (or a
terminal encoding without them) prints ``[ok]``, ``[FAIL]`` and ``[todo]`` instead.

Exit status: 0 when every graded lab is complete (✅), 1 otherwise, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

import fdlib

from . import core, speed
from .notebook_tools import exercise_cells, load_exercise_cells

ROOT = Path(__file__).resolve().parents[3]
EMOJI = {"pass": "✅ PASS", "fail": "❌ FAIL", "todo": "📝 TODO"}   # words beside the emoji: readable without an emoji font
TEXT = {"pass": "[ok]", "fail": "[FAIL]", "todo": "[todo]"}
# where the terminal's encoding lacks them: the symbols the checks' messages use, in plain text
PLAIN = {"−": "-", "ℓ": "l", "Õ": "O~", "√": "sqrt", "→": "->", "±": "+-", "×": "x", "≤": "<=", "≥": ">=", "⌈": "ceil(",
         "⌉": ")", "⌊": "floor(", "⌋": ")", "·": "*", "…": "...", "µ": "u", "α": "alpha", "Σ": "sum", "∞": "inf",
         "–": "-", "—": "-", "’": "'", "“": '"', "”": '"', "🎉": "", "ℹ️": "i"}


@dataclass
class ExerciseGrade:
    name: str
    result: core.Result | None = None     # None: could not be run (see error)
    error: str = ""
    max_points: float = 0

    @property
    def points(self) -> float:
        return self.result.points if self.result is not None else 0

    @property
    def todo(self) -> bool:
        return self.result is not None and self.result.todo


@dataclass
class LabGrade:
    lab: str                                    # "lab01"
    notebook: Path | None
    exercises: list[ExerciseGrade] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def points(self) -> float:
        return sum(e.points for e in self.exercises)

    @property
    def max_points(self) -> float:
        return sum(e.max_points for e in self.exercises)

    @property
    def not_started(self) -> bool:
        return bool(self.exercises) and all(e.todo for e in self.exercises)

    @property
    def complete(self) -> bool:
        return bool(self.exercises) and all(e.result is not None and e.result.ok for e in self.exercises)


def labs() -> list[str]:
    """Every lab that has checks: ``["lab01", ..., "lab09"]``."""
    return sorted({n.split(".", 1)[0] for n in core.exercises()})


def lab_name(arg: str) -> str:
    """``"3"``, ``"03"``, ``"lab03"``, ``"03_split_kv"`` -> ``"lab03"``; ValueError naming the labs otherwise."""
    known = labs()
    s = arg.strip().lower()
    s = s[3:] if s.startswith("lab") else s
    digits = s.split("_", 1)[0]
    if digits.isdigit() and f"lab{int(digits):02d}" in known:
        return f"lab{int(digits):02d}"
    raise ValueError(f"expected a lab: one of {', '.join(k[3:] for k in known)} (or {known[0]}, ...), got {arg!r}")


def notebook_of(lab: str, folder: Path) -> Path | None:
    found = sorted(Path(folder).glob(f"{lab[3:]}_*.ipynb"))
    return found[0] if found else None


def exercise_order(nb: Path) -> dict[str, int]:
    try:
        return exercise_cells(nbformat.read(nb, as_version=4))
    except Exception:  # noqa: BLE001 - an unreadable notebook is reported by the loader
        return {}


def grade_lab(lab: str, folder: Path, learner: dict | None = None) -> LabGrade:
    """Run the checks of every exercise of ``lab`` on the exercise cells of its notebook in ``folder``.
    ``learner`` (optional) collects the learner's functions that pass all their checks, by exercise name."""
    t0 = time.perf_counter()
    nb = notebook_of(lab, folder)
    grade = LabGrade(lab, nb)
    found, errors = ({}, {}) if nb is None else load_exercise_cells(nb)
    order = {} if nb is None else exercise_order(nb)
    names = sorted(core.exercises(lab), key=lambda n: (order.get(n, len(order)), n))   # as in the notebook
    for name in names:
        worth = sum(c.points for c in core.load_checks(name))
        g = ExerciseGrade(name, max_points=worth)
        if nb is None:
            g.error = f"no notebook {lab[3:]}_*.ipynb in {folder}"
        elif name in errors:
            e = errors[name]
            g.error = f"running its exercise cell raised {type(e).__name__}: {e}"
        elif name not in found:
            g.error = (f"{nb.name} has no exercise cell for {name} (expected a code cell tagged 'exercise' with "
                       f"@exercise(\"{name}\"))")
        else:
            g.result = core.run_checks(name, found[name], quiet=True)
            if learner is not None and g.result.ok:
                learner[name] = found[name]
        grade.exercises.append(g)
    grade.seconds = time.perf_counter() - t0
    return grade


# ---------------------------------------------------------------------------------------------- printing
def _num(x: float) -> str:
    return f"{x:g}"


def exercise_lines(g: ExerciseGrade, sym: dict, verbose: bool = False) -> list[str]:
    if g.result is None:
        return [f"  {sym['fail']} {g.name}: 0/{_num(g.max_points)} points: {g.error}"]
    r = g.result
    if r.todo:
        why = r.outcomes[0].todo_line if r.outcomes and r.outcomes[0].todo_line else "its cell is still the stub"
        return [f"  {sym['todo']} {g.name}: not started ({why}), 0/{_num(g.max_points)} points"]
    head = (f"  {sym['pass' if r.ok else 'fail']} {g.name}: {r.passed}/{r.total} checks, "
            f"{_num(r.points)}/{_num(g.max_points)} points")
    lines = [head]
    for o in r.outcomes:
        if o.status != "pass":
            lines.append(f"      {sym['fail']} {o.name} ({_num(o.worth)} pt): {o.message}")
        elif verbose:
            lines.append(f"      {sym['pass']} {o.name} ({_num(o.worth)} pt)")
    return lines


def lab_lines(grade: LabGrade, sym: dict, verbose: bool = False) -> list[str]:
    where = grade.notebook.name if grade.notebook else "no notebook"
    if grade.notebook is not None:
        saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(grade.notebook.stat().st_mtime))
        where += f", saved {saved}"
    lines = [f"{grade.lab} · {where}"]
    for g in grade.exercises:
        lines += exercise_lines(g, sym, verbose)
    return lines


def scorecard_lines(grades: list[LabGrade], sym: dict) -> list[str]:
    width = max(len(_num(g.max_points)) for g in grades)
    lines = ["Scorecard (points: each check is worth 1 or 2, summed per lab)"]
    for g in grades:
        if g.not_started:
            lines.append(f"  {sym['todo']} {g.lab}  not started")
        else:
            mark = sym["pass"] if g.complete else sym["fail"]
            lines.append(f"  {mark} {g.lab}  {_num(g.points):>{width}}/{_num(g.max_points)}")
    total, most = sum(g.points for g in grades), sum(g.max_points for g in grades)
    lines.append(f"  total  {_num(total)}/{_num(most)} points")
    return lines


def can_show(stream, text: str) -> bool:
    enc = getattr(stream, "encoding", None) or "ascii"
    try:
        text.encode(enc)
        return True
    except (UnicodeEncodeError, LookupError):
        return False


def plain(text: str) -> str:
    """``text`` with the symbols of :data:`PLAIN` spelled out."""
    for k, v in PLAIN.items():
        text = text.replace(k, v)
    return text


class Printer:
    """Prints unicode as unicode; where the stream's encoding cannot encode a line, spells the symbols out
    (and replaces what is left) instead of failing or printing ``\\u2212``."""

    def __init__(self, stream=None, ascii_only: bool = False):
        self.stream = stream or sys.stdout
        self.ascii_only = ascii_only
        self.sym = TEXT if ascii_only or not can_show(self.stream, "".join(EMOJI.values())) else EMOJI

    def __call__(self, line: str = "") -> None:
        if self.ascii_only or not can_show(self.stream, line):
            line = plain(line)
            enc = getattr(self.stream, "encoding", None) or "ascii"
            line = line.encode(enc, errors="replace").decode(enc) if not self.ascii_only else \
                line.encode("ascii", errors="replace").decode("ascii")
        print(line, file=self.stream, flush=True)


# ---------------------------------------------------------------------------------------------- the command
def main(argv=None, stream=None) -> int:
    parser = argparse.ArgumentParser(
        prog="./course grade", description="Grade the exercise cells of your saved notebooks and print a scorecard "
        "(save the notebooks in JupyterLab first).")
    parser.add_argument("labs", nargs="*", metavar="lab", help="labs to grade, e.g. 03 or lab03 (default: all)")
    parser.add_argument("--notebooks-dir", default=str(ROOT / "notebooks"),
                        help="where the NN_topic.ipynb notebooks are (default: notebooks/)")
    parser.add_argument("--ascii", action="store_true", default=bool(os.environ.get("FDLIB_ASCII")),
                        help="print [ok]/[FAIL]/[todo] instead of emoji (also: FDLIB_ASCII=1)")
    parser.add_argument("--speed", action="store_true",
                        help="on a CUDA GPU, also time your kernels as a fraction of the measured read ceiling")
    parser.add_argument("-v", "--verbose", action="store_true", help="list the passed checks too")
    args = parser.parse_args(argv)
    out = Printer(stream, args.ascii)
    try:
        chosen = [lab_name(a) for a in args.labs] or labs()
    except ValueError as e:
        out(f"./course grade: {e}")
        return 2
    folder = Path(args.notebooks_dir)
    if not folder.is_dir():
        out(f"./course grade: expected a folder of notebooks, got {folder} (not a folder)")
        return 2
    t0 = time.perf_counter()
    out(f"Grading the exercise cells of the notebooks in {folder} as saved on disk (save in JupyterLab first).")
    out(f"{fdlib.describe()}")
    grades, learner = [], {}
    for lab in dict.fromkeys(chosen):
        grade = grade_lab(lab, folder, learner)
        grades.append(grade)
        out()
        for line in lab_lines(grade, out.sym, args.verbose):
            out(line)
    if args.speed:
        out()
        for line in speed.report_lines(learner):
            out(line)
    out()
    for line in scorecard_lines(grades, out.sym):
        out(line)
    out(f"  graded in {time.perf_counter() - t0:.1f} s")
    return 0 if all(g.complete for g in grades) else 1
