"""``./course grade``: the learner's grading command (fdlib.course.grading.scorecard, fdlib.course.grading.speed).

Each test grades a folder of shipped notebooks (``shipped.py``) in which it writes the learner's cells itself.
"""
from __future__ import annotations

import io
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch
from shipped import notebook_names, shipped_copy

from fdlib import runtime
from fdlib.course.grading import core, scorecard, speed
from fdlib.course.grading.notebook_tools import exercise_cells

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def notebooks(tmp_path):
    """``.path``: a folder with a shipped copy of every notebook; ``.edit(nn, name, source)`` writes an exercise
    cell of notebook ``nn``."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    for name in notebook_names():
        shipped_copy(name, folder)

    def edit(nn: str, name: str, source: str):
        path = next(folder.glob(f"{nn}_*.ipynb"))
        nb = nbformat.read(path, as_version=4)
        nb.cells[exercise_cells(nb)[name]].source = source
        nbformat.write(nb, path)
    return SimpleNamespace(path=folder, edit=edit)


def _grade(*args, encoding="utf-8"):
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding, errors="strict")
    rc = scorecard.main(list(args), stream=stream)
    stream.flush()
    return rc, raw.getvalue().decode(encoding)


def _scorecard(out: str) -> list[str]:
    lines = out.rstrip("\n").splitlines()
    return lines[lines.index(next(x for x in lines if x.startswith("Scorecard"))):]


def test_untouched_labs_are_not_started(notebooks):
    t0 = time.perf_counter()
    rc, out = _grade("--notebooks-dir", str(notebooks.path))
    assert rc == 1
    card = _scorecard(out)
    labs = scorecard.labs()
    assert card[1:1 + len(labs)] == [f"  📝 TODO {lab}  not started" for lab in labs]
    total = sum(c.points for n in core.exercises() for c in core.load_checks(n))
    assert card[-2] == f"  total  0/{total:g} points" and card[-1].startswith("  graded in ")   # it ends there
    assert "❌" not in out and "\\u" not in out
    # a stub says so; an untouched bug-zoo cell holds buggy code, not a stub, and the line says that instead
    assert "  📝 TODO lab01.naive_attention: not started (its cell is still the stub)" in out
    zoo = [x for x in out.splitlines() if x.startswith("  📝 TODO lab07.bug_")]
    assert zoo and all("the cell still holds the buggy code as shipped" in x and "stub" not in x for x in zoo), zoo
    assert time.perf_counter() - t0 < 60


def test_partial_credit_is_summed_per_lab(notebooks):
    # Lab 01: the solution with 1/√D in place of the given scale fails the two checks that pass another scale
    wrong_scale = core.solution_source("lab01.naive_attention").replace("* scale ", "* (1 / math.sqrt(D)) ")
    assert wrong_scale != core.solution_source("lab01.naive_attention")
    notebooks.edit("01", "lab01.naive_attention", wrong_scale)
    notebooks.edit("02", "lab02.online_softmax", core.solution_source("lab02.online_softmax"))   # merge: a stub
    rc, out = _grade("01", "02", "--notebooks-dir", str(notebooks.path))
    assert rc == 1
    checks = core.load_checks("lab01.naive_attention")
    failed = [c for c in checks if c.name.startswith(("uses the given scale", "huge logits"))]
    lab01_max = sum(c.points for c in checks)
    lab01 = lab01_max - sum(c.points for c in failed)
    assert f"❌ FAIL lab01.naive_attention: {len(checks) - 2}/{len(checks)} checks, {lab01:g}/{lab01_max:g} points" in out
    assert "❌ FAIL uses the given scale (scale=0.3, not 1/√D) (1 pt): out: " in out            # unicode as unicode
    lab02_max = sum(c.points for n in core.exercises("lab02") for c in core.load_checks(n))
    softmax = sum(c.points for c in core.load_checks("lab02.online_softmax"))
    assert "✅ PASS lab02.online_softmax: 8/8 checks" in out and "📝 TODO lab02.merge: not started" in out
    assert out.index("lab02.online_softmax") < out.index("lab02.merge")                  # the notebook's order
    card = _scorecard(out)
    assert card[1] == f"  ❌ FAIL lab01  {lab01:>2g}/{lab01_max:g}"
    assert card[2] == f"  ❌ FAIL lab02  {softmax:>2g}/{lab02_max:g}"
    assert card[3] == f"  total  {lab01 + softmax:g}/{lab01_max + lab02_max:g} points"


def test_solved_labs_get_every_point_and_exit_0(notebooks):
    for name in core.exercises("lab02"):
        notebooks.edit("02", name, core.solution_source(name))
    rc, out = _grade("lab02", "--notebooks-dir", str(notebooks.path), "-v")
    most = sum(c.points for n in core.exercises("lab02") for c in core.load_checks(n))
    assert rc == 0 and _scorecard(out)[1] == f"  ✅ PASS lab02  {most:g}/{most:g}"
    assert "      ✅ PASS commutative and associative" in out                                # -v lists passed checks


def test_a_broken_cell_costs_its_exercise_only(notebooks):
    notebooks.edit("02", "lab02.merge", "def merge(a, b:\n    pass")
    notebooks.edit("02", "lab02.online_softmax", core.solution_source("lab02.online_softmax"))
    rc, out = _grade("02", "--notebooks-dir", str(notebooks.path))
    assert "❌ FAIL lab02.merge: 0/8 points: running its exercise cell raised SyntaxError" in out
    assert "✅ PASS lab02.online_softmax: 8/8 checks" in out


def test_text_fallback_where_the_terminal_cannot_show_emoji(notebooks):
    notebooks.edit("02", "lab02.online_softmax", core.solution_source("lab02.online_softmax").replace(
        "alpha = torch.exp(m - ref)", "alpha = torch.exp(m - ref) * 0 + 1"))          # no rescale
    for args, enc in ((("02",), "ascii"), (("02",), "latin-1"), (("02", "--ascii"), "utf-8")):
        rc, out = _grade(*args, "--notebooks-dir", str(notebooks.path), encoding=enc)
        assert "[FAIL] lab02.online_softmax" in out and "[todo] lab02.merge: not started" in out, out
        assert "  [FAIL] lab02" in _scorecard(out)[1]
        assert "e^(m_old - m_new)" in out                                            # − spelled out, not \u2212
        assert not any(s in out for s in ("✅", "❌", "📝", "\\u"))


def test_usage_errors_name_what_was_expected(tmp_path):
    rc, out = _grade("99")
    assert rc == 2 and "expected a lab: one of 01, 02, 03, 04, 05, 06, 07, 08, 09, " in out
    assert "10 (or lab01, ...), got '99'" in out
    rc, out = _grade("--notebooks-dir", str(tmp_path / "nope"))
    assert rc == 2 and f"expected a folder of notebooks, got {tmp_path / 'nope'}" in out
    rc, out = _grade("01", "--notebooks-dir", str(tmp_path))
    assert rc == 1 and f"0/13 points: no notebook 01_*.ipynb in {tmp_path}" in out


def test_course_grade_runs_it(notebooks):
    """The ``course`` script's grade command (its prepare step finds .venv ready: ./course test made it)."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv: ./course grade would create it")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(["bash", str(ROOT / "course"), "grade", "01", "--notebooks-dir", str(notebooks.path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _scorecard(proc.stdout)[1] == "  📝 TODO lab01  not started", proc.stdout


# ---------------------------------------------------------------------------------------------- --speed
def test_speed_without_a_gpu_is_skipped_in_one_line(notebooks):
    if runtime.MODE == "gpu":
        pytest.skip("a GPU is here: tests/test_gpu.py times the real thing")
    rc, out = _grade("01", "--speed", "--notebooks-dir", str(notebooks.path))
    assert "Speed: skipped: no CUDA GPU here" in out
    assert out.index("Speed: skipped") < out.index("Scorecard")                           # it still ends there


def test_speed_pipelines_everything_but_the_timing():
    """The three pipelines with the learner's pieces (here the reference solutions, and a stage 2 that writes
    nothing) on a small shape, with a pretend timer and ceiling: what is timed, the check against fdlib's result,
    and the table."""
    import triton
    import triton.language as tl

    @triton.jit
    def lazy_stage2(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                    stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        pass

    learner = {speed.TILE: core.reference(speed.TILE), speed.STAGE2: lazy_stage2}     # no take_ticket
    shape = speed.Shape(B=2, H_q=4, H_kv=2, L=80, D=16, dtype=torch.float32)
    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return 100.0 * len(timed)

    p, rows = speed.measure(learner, shape, runtime.DEVICE, timer)
    assert [r.exercise for r in rows] == [speed.TILE, speed.STAGE2, speed.TICKET]
    assert len(timed) == 4                                          # fdlib's three, and the one correct learner piece
    assert rows[0].fdlib_us == 100 and rows[0].yours_us == 200
    assert rows[1].yours_us is None and "on this shape its result differs from fdlib's: out: " in rows[1].note
    assert rows[2].yours_us is None and "does not pass all its checks yet" in rows[2].note
    lines = speed.table(shape, p, rows, 2.0, "a pretend GPU")
    tbs = shape.kv_bytes / 200 / 1e6
    assert lines[0].startswith(f"Speed on a pretend GPU: {shape}, {p.splits} splits of {p.chunk} keys")
    assert lines[2].startswith("  stage 1 with your tile_update, then fdlib's stage 2")
    assert f"200.0 µs  {tbs:.2f} TB/s" in lines[2] and f"{tbs / 2.0:5.0%}" in lines[2]
    assert speed.SHAPE.kv_bytes == 512 * 2**20                      # the GPU shape: a 512 MiB KV cache
