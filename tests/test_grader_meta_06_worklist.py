"""The grader of lab06.work_list is tested too: the reference and a correct kernel written differently pass, an
edited stub is a real attempt, and each known-wrong work list fails with a message that names its likely cause.
(The untouched stub is a TODO and the reference's source runs as a cell: test_grader_meta_06.py.)"""
from __future__ import annotations

import pytest

from fdlib import worklist  # first: importing fdlib picks the runtime before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fdlib.course.grading import core
from fdlib.course.grading.core import run_checks
from fdlib.course.grading.lab06_worklist import explain, run_work_list
from helpers import cell_function

NAME = "lab06.work_list"

OK, DROP_EMPTY, DROP_LAST, TWICE, SHORTEST_FIRST, TIES, COUNT, ROUND_ROBIN, BATCH_ORDER, NO_CAP, J_REVERSED, \
    PADDING, FIRST_AXIS = (tl.constexpr(i) for i in range(13))


@triton.jit
def _list(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
          MISTAKE: tl.constexpr):
    """The reference list with one mistake built in (MISTAKE, one of the constants above)."""
    rows = tl.arange(0, BLOCK_B)
    live = rows < B
    if MISTAKE == DROP_LAST:
        live = rows < B - 1                                       # the last row masked off
    L = tl.maximum(tl.load(LENS + rows, mask=live, other=0), 0)
    tiles = tl.maximum(1, tl.cdiv(L, BLOCK_N))
    if MISTAKE == DROP_EMPTY:
        tiles = tl.cdiv(L, BLOCK_N)                               # no max(1, ...): an empty row has no item
    c = tl.maximum(chunk // BLOCK_N, tl.cdiv(tiles, S))
    if MISTAKE == NO_CAP:
        c = chunk // BLOCK_N + 0 * tiles                          # no cap of S pieces
    n = tl.where(live, tl.cdiv(tiles, c), 0)
    if MISTAKE == PADDING:
        n = tl.cdiv(tiles, c)                                     # the padding rows >= B get a piece each
    longer = L[None, :] > L[:, None]
    if MISTAKE == SHORTEST_FIRST:
        longer = L[None, :] < L[:, None]
    lower = rows[None, :] < rows[:, None]
    if MISTAKE == TIES:
        lower = rows[None, :] > rows[:, None]
    before = longer | ((L[None, :] == L[:, None]) & lower)
    if MISTAKE == BATCH_ORDER:
        before = lower                                            # no sort
    first = tl.sum(tl.where(before, n[None, :], 0), axis=1)
    if MISTAKE == FIRST_AXIS:
        first = tl.sum(tl.where(before, n[None, :], 0), axis=0)   # summed along the wrong axis
    total = tl.sum(n, axis=0)
    if MISTAKE == COUNT:
        total = tl.sum(live.to(tl.int32), axis=0)                 # rows, not items
    if MISTAKE == TWICE:                                          # item 0 again at the end of the list
        tl.store(OUT + 1 + total, tl.sum(tl.where(live & (first == 0), rows * S, 0), axis=0))
        total += 1
    tl.store(OUT, total)
    for j in range(0, S):
        at = first + j
        if MISTAKE == J_REVERSED:
            at = first + n - 1 - j
        if MISTAKE == ROUND_ROBIN:                                # piece 0 of every row, then piece 1, ...
            at = tl.sum(tl.minimum(n, j), axis=0) + tl.sum(tl.where(before & (n[None, :] > j), 1, 0), axis=1)
        keep = (j < n) & live
        if MISTAKE == PADDING:
            keep = j < n
        tl.store(OUT + 1 + at, rows * S + j, mask=keep)


# one kernel a mistake (a Triton kernel cannot close over a Python variable)
@triton.jit
def _ok(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, OK)


@triton.jit
def _drop_empty(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, DROP_EMPTY)


@triton.jit
def _drop_last(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, DROP_LAST)


@triton.jit
def _twice(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, TWICE)


@triton.jit
def _shortest_first(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, SHORTEST_FIRST)


@triton.jit
def _ties(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, TIES)


@triton.jit
def _count(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, COUNT)


@triton.jit
def _round_robin(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, ROUND_ROBIN)


@triton.jit
def _batch_order(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, BATCH_ORDER)


@triton.jit
def _no_cap(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, NO_CAP)


@triton.jit
def _j_reversed(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, J_REVERSED)


@triton.jit
def _padding(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, PADDING)


@triton.jit
def _first_axis(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    _list(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B, FIRST_AXIS)


@triton.jit
def _rows_one_by_one(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Correct, written differently: a loop over the rows, each one's place counted from the others' lengths."""
    rows = tl.arange(0, BLOCK_B)
    Ls = tl.load(LENS + rows, mask=rows < B, other=-1)
    ts = tl.cdiv(tl.maximum(Ls, 0), BLOCK_N)
    ns = tl.where(rows < B, tl.maximum(1, tl.cdiv(ts, tl.maximum(chunk // BLOCK_N, tl.cdiv(ts, S)))), 0)
    for b in range(0, B):
        L = tl.load(LENS + b)
        ahead = (rows < B) & ((Ls > L) | ((Ls == L) & (rows < b)))
        start = tl.sum(tl.where(ahead, ns, 0), axis=0)
        c = tl.maximum(chunk, BLOCK_N * tl.cdiv(tl.cdiv(L, BLOCK_N), S))   # in keys, as fdlib.worklist
        n = tl.maximum(1, tl.cdiv(L, c))
        for j in range(0, n):
            tl.store(OUT + 1 + start + j, b * S + j)
    tl.store(OUT, tl.sum(ns, axis=0))


def _plain_python(LENS, OUT, B, chunk, S, BLOCK_N, BLOCK_B):
    """A kernel without @triton.jit."""
    OUT[0] = B


WRONG = {
    "an empty row dropped (n(0) = 0)": (_drop_empty, "has no item: a row dropped (an empty row is still"),
    "the last row masked off": (_drop_last, "a row dropped"),
    "the first item again at the end": (_twice, "a piece twice"),
    "shortest first": (_shortest_first, "shortest first"),
    "ties: the higher b first": (_ties, "ties broken the wrong way"),
    "the count is the rows, not the items": (_count, "The count is wrong"),
    "piece 0 of every row, then piece 1 (round robin)": (_round_robin, "not consecutive"),
    "rows in batch order": (_batch_order, "longest first"),
    "pieces of chunk keys, no cap of S": (_no_cap, "more than S = 4 pieces"),
    "a row's pieces in reverse": (_j_reversed, "a row's pieces go j = 0, 1"),
    "the padding rows (>= B) cut into pieces": (_padding, "the padding rows"),
    "first summed along the wrong axis": (_first_axis, "stored at the wrong place"),
    "no @triton.jit": (_plain_python, "expected a @triton.jit function"),
}


def test_the_reference_passes():
    assert run_checks(NAME, core.reference(NAME), quiet=True).ok


def test_a_variant_written_differently_passes():
    assert run_checks(NAME, _ok, quiet=True).ok
    assert run_checks(NAME, _rows_one_by_one, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG, ids=list(WRONG))
def test_each_known_wrong_list_fails_and_is_named(wrong):
    kernel, cause = WRONG[wrong]
    res = run_checks(NAME, kernel, quiet=True)
    assert res.failed > 0 and not res.todo, wrong
    lines = [o.line() for o in res.outcomes if o.status == "fail"]
    assert any(cause in line for line in lines), f"{wrong}: no line names '{cause}':\n" + "\n".join(lines)


def test_the_causes_on_one_batch():
    """One batch that shows every mistake (a tie, an empty row, a row longer than chunk·S), each named on it."""
    lengths, chunk, S, N = [40, 0, 200, 40, 7, 1000, 33], 32, 4, 16
    assert explain(run_work_list(core.reference(NAME), lengths, chunk, S, N), lengths, chunk, S, N) is None
    for wrong, (kernel, cause) in WRONG.items():
        if wrong != "no @triton.jit":
            why = explain(run_work_list(kernel, lengths, chunk, S, N), lengths, chunk, S, N)
            assert why is not None and cause in why + ".", (wrong, why)


def test_explain_reads_the_buffer_not_the_kernel():
    lengths, chunk, S, N = [3, 50, 50], 16, 4, 16
    want = worklist.encode(worklist.work_list(lengths, chunk, S, N), S)
    assert explain(want + [-1] * 3, lengths, chunk, S, N) is None
    assert "The count is wrong" in explain([want[0] + 1] + want[1:] + [-1] * 3, lengths, chunk, S, N)
    assert "was never written" in explain(want[:3] + [-1] + want[4:] + [-1] * 3, lengths, chunk, S, N)
    assert "The count is wrong" in explain([99] + want[1:] + [-1] * 3, lengths, chunk, S, N)
    assert "outside 0..B·S" in explain([99] + want[1:] + [want[1]] + [-1] * 2, lengths, chunk, S, N)


def test_edited_stub_is_a_real_attempt():
    src = core.stub_source(NAME).replace("rows = tl.arange(0, BLOCK_B)", "rows = tl.arange(0, BLOCK_B) + 0")
    res = run_checks(NAME, cell_function(src, "work_list"), quiet=True)
    core._LEARNER.pop(NAME, None)
    assert not res.todo and res.failed == res.total

