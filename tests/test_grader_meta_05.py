"""The Lab 05 graders are tested too: untouched stubs and known-wrong cost models, choice rules and ticket
functions must fail their checks."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from fdlib import costmodel  # first: importing fdlib picks the runtime before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fdlib.course.grading import core
from fdlib.course.grading.core import run_checks
from fdlib.kernels import unified
from fdlib.kernels.config import chunk_for
from helpers import assert_one_todo_line, not_implemented_stub, todo_stub

PREDICT, CHOOSE, TICKET = "lab05.predict_time", "lab05.choose_splits", "lab05.take_ticket"


# ---------------------------------------------------------------------------------------------- predict_time
def _predict(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r, *, corner="smax", waves="ceil",
             per_program=True, merge=True, merge_splits="used", startup=True, per_sm=True, empty_rows=1):
    chunk, used = chunk_for(max(max(lengths), 1), splits, block_n)
    P = sum(H_kv * max(empty_rows, -(-L // chunk)) for L in lengths)
    slots = r * gpu.sms
    W = -(-P // slots) if waves == "ceil" else P / slots
    phi = {True: costmodel.SECOND_PROGRAM, "whole": 1.0, False: 0.0}[per_sm]
    n = 1 + (min(-(-P // gpu.sms), r) - 1) * phi
    t_bw = 2 * sum(lengths) * H_kv * D * dtype_bytes / 1e6 / cal.bw_tbs
    t_prog = W * n * 2 * chunk * D * dtype_bytes / 1e6 / cal.rho_tbs if per_program else 0.0
    stream = (t_bw ** 4 + t_prog ** 4) ** 0.25 if corner == "smax" else max(t_bw, t_prog)
    t = cal.t_launch_us + (P / slots * cal.t_wave_us if startup else 0.0) + stream
    if merge and used > 1:
        t += cal.t_merge_us + (used if merge_splits == "used" else splits) * cal.t_split_us
    return t, used


WRONG_PREDICT = {
    "max instead of smax": lambda *a: _predict(*a, corner="max"),
    "no wave quantisation (P/(r·SMs) in the per-program term)": lambda *a: _predict(*a, waves="frac"),
    "pure bandwidth model (no per-program limit)": lambda *a: _predict(*a, per_program=False),
    "no merge cost": lambda *a: _predict(*a, merge=False),
    "merge priced with the requested splits": lambda *a: _predict(*a, merge_splits="requested"),
    "no start-up (wave) term": lambda *a: _predict(*a, startup=False),
    "every program streams at rho (no busiest-SM load n)": lambda *a: _predict(*a, per_sm=False),
    "a second program on an SM costs a whole program (phi = 1)": lambda *a: _predict(*a, per_sm="whole"),
    "a length-0 sequence launches no program (no max(1, ·) in P)": lambda *a: _predict(*a, empty_rows=0),
    "returns the requested splits": lambda *a: (_predict(*a)[0], a[4]),
    "time only, no splits_used": lambda *a: _predict(*a)[0],
}


def test_predict_variant_passes():
    assert run_checks(PREDICT, _predict, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_PREDICT, ids=list(WRONG_PREDICT))
def test_wrong_predict_fails(wrong):
    assert run_checks(PREDICT, WRONG_PREDICT[wrong], quiet=True).failed > 0, wrong


def test_pure_bandwidth_model_fails_the_recorded_sweep():
    """Not only the exact comparison: the behavioural check on the H200 sweep catches it too."""
    chk = next(c for c in core.load_checks(PREDICT) if "recorded H200 sweep" in c.name)
    out = core.run_one(chk, WRONG_PREDICT["pure bandwidth model (no per-program limit)"])
    assert out.status == "fail" and "slower than the best measured split count" in out.message


CAUSE = {                                   # each wrong time's message names its mistake
    "max instead of smax": "where the formula has smax",
    "no wave quantisation (P/(r·SMs) in the per-program term)": "without rounding up",
    "pure bandwidth model (no per-program limit)": "the per-program limit W·n·bytes_prog/ρ is missing",
    "no merge cost": "the merge term t_merge + S·t_split is missing",
    "merge priced with the requested splits": "counts the 48 splits you asked for; S in [S>1](t_merge + S·t_split) "
                                              "is the count chunk_for returns, the splits used (47 here)",
    "no start-up (wave) term": "the start-up term P/(r·SMs)·t_wave is missing",
    "every program streams at rho (no busiest-SM load n)": "n is missing from W·n·bytes_prog/ρ",
    "a second program on an SM costs a whole program (phi = 1)": "counts a second program on an SM as a whole one",
    "a length-0 sequence launches no program (no max(1, ·) in P)": "P = 40 programs, not 32: a sequence of length 0 "
                                                                   "still launches one program",
}


@pytest.mark.parametrize("wrong", CAUSE, ids=list(CAUSE))
def test_a_wrong_time_names_its_cause(wrong):
    """Not two numbers only: the first failing check says which term is wrong and how."""
    res = run_checks(PREDICT, WRONG_PREDICT[wrong], quiet=True)
    line = next(o.line() for o in res.outcomes if o.status == "fail")
    assert "Likely cause: " in line and CAUSE[wrong] in line.split("Likely cause: ")[1], line


def test_an_unknown_mistake_gets_no_made_up_cause():
    res = run_checks(PREDICT, lambda *a: (_predict(*a)[0] * 1.01, _predict(*a)[1]), quiet=True)
    line = next(o.line() for o in res.outcomes if o.status == "fail")
    assert "expected" in line and "Likely cause" not in line


# ---------------------------------------------------------------------------------------------- the lesson's T(S)
LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "05_unified_kernel.md"


def _as_written(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r):
    """T(S) coded term by term from section 2 of Lab 05, in its symbols, as a learner reads it."""
    chunk, S = chunk_for(max(max(lengths), 1), splits, block_n)     # "S below is the count it uses"
    SMs, elem = gpu.sms, dtype_bytes
    P = sum(H_kv * max(1, math.ceil(L_b / chunk)) for L_b in lengths)
    W = math.ceil(P / (r * SMs))
    n = 1 + (min(math.ceil(P / SMs), r) - 1) * costmodel.SECOND_PROGRAM
    bytes_kv = 2 * sum(L_b * H_kv * D * elem for L_b in lengths) / 1e6   # MB, and TB/s = MB/µs
    bytes_prog = 2 * chunk * D * elem / 1e6
    BW, rho = cal.bw_tbs, cal.rho_tbs

    def smax(a, b):
        return (a ** 4 + b ** 4) ** (1 / 4)

    T = (cal.t_launch_us + P / (r * SMs) * cal.t_wave_us + smax(bytes_kv / BW, W * n * bytes_prog / rho)
         + (S > 1) * (cal.t_merge_us + S * cal.t_split_us))
    return T, S


def test_the_formula_as_the_lesson_writes_it_passes():
    assert run_checks(PREDICT, _as_written, quiet=True).ok


def test_the_lesson_writes_the_formula_coded_above():
    """_as_written follows the lesson: the merge term's S is the split count chunk_for uses, not the one asked
    for, and the lesson says so where it defines S and in the exercise."""
    text = LESSON.read_text(encoding="utf-8")
    formula = re.search(r"\$\$ T\(S\) = (.*?)\$\$", text, re.S).group(1)
    flat = " ".join(formula.split())
    assert r"[S>1]\,(t_{\text{merge}} + S\,t_{\text{split}})" in flat
    assert r"\operatorname{smax}(x,y) = (x^4+y^4)^{1/4}" in flat
    assert "may use fewer splits\nthan asked for: **S** below is the count it uses" in text
    assert "the formula's S is `splits_used`, not the `splits` asked for" in " ".join(text.split())


def test_predict_mismatch_names_the_terms():
    res = run_checks(PREDICT, WRONG_PREDICT["no merge cost"], quiet=True)
    line = next(o.line() for o in res.outcomes if o.status == "fail")
    assert "expected" in line and "merge" in line and "smax(bytes_kv/BW=" in line


# ---------------------------------------------------------------------------------------------- choose_splits
def _choose(lengths, H_kv, D, dtype_bytes, gpu, cal, block_n, r, predict, *, pick="smallest", tol=1.01,
            report="used"):
    preds = [(s, *predict(lengths, H_kv, D, dtype_bytes, s, gpu, cal, block_n, r)) for s in costmodel.CANDIDATES]
    best = min(t for _, t, _ in preds)
    near = [(s if report == "requested" else u) for s, t, u in preds if t <= best * tol]
    return min(near) if pick == "smallest" else max(near)


WRONG_CHOOSE = {
    "largest within 1%": lambda *a: _choose(*a, pick="largest"),
    "fastest only (no 1% tolerance)": lambda *a: _choose(*a, tol=1.0),
    "returns the requested count": lambda *a: _choose(*a, report="requested"),
    "always 1 split": lambda *a: 1,
    "FA2's 85% rule instead": lambda lengths, H_kv, D, *a: costmodel.fa2_rule(len(lengths), 32, H_kv, max(lengths), D),
}


def test_choose_variant_passes():
    assert run_checks(CHOOSE, _choose, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_CHOOSE, ids=list(WRONG_CHOOSE))
def test_wrong_choose_fails(wrong):
    assert run_checks(CHOOSE, WRONG_CHOOSE[wrong], quiet=True).failed > 0, wrong


# ---------------------------------------------------------------------------------------------- take_ticket
@triton.jit
def _ticket_ok(counter_ptr, n_splits):
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == n_splits - 1
    if is_last:
        tl.atomic_xchg(counter_ptr, 0)
    return is_last


@triton.jit
def _ticket_no_reset(counter_ptr, n_splits):
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == n_splits - 1


@triton.jit
def _ticket_never_last(counter_ptr, n_splits):
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == n_splits
    if is_last:
        tl.atomic_xchg(counter_ptr, 0)
    return is_last


@triton.jit
def _ticket_first(counter_ptr, n_splits):
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == 0
    if is_last:
        tl.atomic_xchg(counter_ptr, 0)
    return is_last


@triton.jit
def _ticket_first_resets_at_end(counter_ptr, n_splits):
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == n_splits - 1:
        tl.atomic_xchg(counter_ptr, 0)
    return ticket == 0


@triton.jit
def _ticket_always(counter_ptr, n_splits):
    return n_splits > 0


def _ticket_plain_python(counter_ptr, n_splits):      # a correct body, but no @triton.jit
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == n_splits - 1


WRONG_TICKET = {
    "no reset": _ticket_no_reset,
    "ticket == n_splits (never last)": _ticket_never_last,
    "ticket == 0 (first program merges)": _ticket_first,
    "ticket == 0, reset by the last": _ticket_first_resets_at_end,
    "everybody is last": _ticket_always,
    "no @triton.jit": _ticket_plain_python,
}


def test_ticket_variant_passes():
    assert run_checks(TICKET, _ticket_ok, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_TICKET, ids=list(WRONG_TICKET))
def test_wrong_ticket_fails(wrong):
    res = run_checks(TICKET, WRONG_TICKET[wrong], quiet=True)
    assert res.failed > 0 and not res.todo, wrong
    counters = unified._COUNTERS.get("cpu")
    assert counters is None or not bool(counters.any()), "a wrong ticket left the shared counters dirty"


def test_no_reset_message():
    line = run_checks(TICKET, _ticket_no_reset, quiet=True).outcomes[0].line()
    assert "not back at 0" in line
    n = int(re.search(r"(\d+) ticket counter\(s\) are not back at 0", line).group(1))
    listed = re.search(r"values:? \[([^\]]*)\]", line).group(1).split(",")
    assert len(listed) == n or (len(listed) == 8 and f"the first 8 of {n} values" in line), line


@pytest.mark.parametrize("n_bad", [1, 5, 8, 13])
def test_counter_message_lists_what_it_counts(n_bad):
    """The message's count and the values it lists agree: all of them, or "the first 8 of n"."""
    import torch

    from fdlib.course.grading.core import CheckFailure
    from fdlib.course.grading.lab05 import _expect_zero
    c = torch.zeros(20, dtype=torch.int32)
    c[:n_bad] = torch.arange(1, n_bad + 1, dtype=torch.int32)
    with pytest.raises(CheckFailure) as e:
        _expect_zero(c, "call 2")
    msg = str(e.value)
    assert f"{n_bad} ticket counter(s) are not back at 0" in msg
    if n_bad <= 8:
        assert f"values {list(range(1, n_bad + 1))}" in msg
    else:
        assert f"the first 8 of {n_bad} values: {list(range(1, 9))}" in msg
    _expect_zero(torch.zeros(4, dtype=torch.int32), "call 1")          # all back at 0: no failure


def test_missing_jit_message():
    line = run_checks(TICKET, _ticket_plain_python, quiet=True).outcomes[0].line()
    assert "@triton.jit" in line


# ---------------------------------------------------------------------------------------------- stubs
@pytest.mark.parametrize("stub", [todo_stub, not_implemented_stub], ids=["todo()", "raise NotImplementedError"])
@pytest.mark.parametrize("name", [PREDICT, CHOOSE, TICKET])
def test_stub_is_todo(name, stub, capsys):
    res = run_checks(name, stub)
    assert_one_todo_line(res, capsys.readouterr().out, name)


def test_solution_source_of_the_jit_solution():
    src = core.solution_source(TICKET)
    assert src.startswith('@exercise("lab05.take_ticket")\n@triton.jit\ndef take_ticket(')

