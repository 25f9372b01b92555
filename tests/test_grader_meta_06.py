"""The Lab 06 graders are tested too: untouched stubs and known-wrong paged tile loads and work lists must fail
their checks, and a correct variant written differently must pass (the device schedule's work-list kernel:
test_grader_meta_06_worklist.py)."""
from __future__ import annotations

import pytest

from fdlib import schedule  # first: importing fdlib picks the runtime before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fdlib.course.grading import core
from fdlib.course.grading.core import run_checks
from helpers import assert_one_todo_line, cell_function, not_implemented_stub, todo_stub

TILE, ITEMS, WORK_LIST = "lab06.paged_tile_load", "lab06.work_items", "lab06.work_list"


# ---------------------------------------------------------------------------------------------- paged_tile_load
@triton.jit
def _tile_ok(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
             D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Correct, written differently: two loads of the table-derived offsets, the clamp with tl.where."""
    d = tl.arange(0, BLOCK_D)
    e = tl.load(BT_ROW + pos // PAGE, mask=valid, other=0)
    e = tl.where(e < 0, 0, tl.where(e >= n_pages, n_pages - 1, e))
    off_k = e.to(tl.int64) * stride_kp + (pos % PAGE) * stride_kl
    off_v = e.to(tl.int64) * stride_vp + (pos % PAGE) * stride_vl
    m = valid[:, None] & (d[None, :] < D)
    return (tl.load(K + off_k[:, None] + d[None, :], mask=m, other=0.0),
            tl.load(V + off_v[:, None] + d[None, :], mask=m, other=0.0))


@triton.jit
def _tile_swapped(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Page and slot swapped: page * stride_kl + slot * stride_kp."""
    d = tl.arange(0, BLOCK_D)
    page = tl.minimum(tl.maximum(tl.load(BT_ROW + pos // PAGE, mask=valid, other=0), 0), n_pages - 1)
    slot = pos % PAGE
    slot = tl.minimum(slot, n_pages - 1)          # keeps the wrong offsets inside the pool
    m = valid[:, None] & (d[None, :] < D)
    return (tl.load(K + (slot * stride_kp + page * stride_kl)[:, None] + d[None, :], mask=m & (page < PAGE)[:, None],
                    other=0.0),
            tl.load(V + (slot * stride_vp + page * stride_vl)[:, None] + d[None, :], mask=m & (page < PAGE)[:, None],
                    other=0.0))


@triton.jit
def _tile_no_valid_mask(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """No mask on unused table entries: every entry of the tile is read and followed (clamped into the pool)."""
    d = tl.arange(0, BLOCK_D)
    page = tl.minimum(tl.maximum(tl.load(BT_ROW + pos // PAGE), 0), n_pages - 1).to(tl.int64)
    slot = pos % PAGE
    m = (d[None, :] < D) & (pos >= 0)[:, None]
    return (tl.load(K + (page * stride_kp + slot * stride_kl)[:, None] + d[None, :], mask=m, other=0.0),
            tl.load(V + (page * stride_vp + slot * stride_vl)[:, None] + d[None, :], mask=m, other=0.0))


@triton.jit
def _tile_off_by_one(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Off by one at the page boundary: entry (pos + 1) // PAGE."""
    d = tl.arange(0, BLOCK_D)
    page = tl.minimum(tl.maximum(tl.load(BT_ROW + (pos + 1) // PAGE, mask=valid, other=0), 0), n_pages - 1)
    slot = pos % PAGE
    m = valid[:, None] & (d[None, :] < D)
    return (tl.load(K + (page.to(tl.int64) * stride_kp + slot * stride_kl)[:, None] + d[None, :], mask=m, other=0.0),
            tl.load(V + (page.to(tl.int64) * stride_vp + slot * stride_vl)[:, None] + d[None, :], mask=m, other=0.0))


@triton.jit
def _tile_no_clamp(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """No clamp: a used entry outside the pool is followed outside it."""
    d = tl.arange(0, BLOCK_D)
    page = tl.load(BT_ROW + pos // PAGE, mask=valid, other=0).to(tl.int64)
    slot = pos % PAGE
    m = valid[:, None] & (d[None, :] < D)
    return (tl.load(K + (page * stride_kp + slot * stride_kl)[:, None] + d[None, :], mask=m, other=0.0),
            tl.load(V + (page * stride_vp + slot * stride_vl)[:, None] + d[None, :], mask=m, other=0.0))


@triton.jit
def _tile_table_unmasked(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Reads the block table unmasked (entries past the row's pages, even past the table's end) and does not clamp;
    the K/V loads are masked by valid, so no tile differs."""
    d = tl.arange(0, BLOCK_D)
    page = tl.load(BT_ROW + pos // PAGE).to(tl.int64)
    slot = pos % PAGE
    m = valid[:, None] & (d[None, :] < D)
    return (tl.load(K + (page * stride_kp + slot * stride_kl)[:, None] + d[None, :], mask=m, other=0.0),
            tl.load(V + (page * stride_vp + slot * stride_vl)[:, None] + d[None, :], mask=m, other=0.0))


@triton.jit
def _tile_table_unmasked_clamped(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                                 D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Reads the block table unmasked but clamps, the K/V loads masked by valid: every tile is right, only the
    table reads past the row's pages are wrong."""
    d = tl.arange(0, BLOCK_D)
    page = tl.minimum(tl.maximum(tl.load(BT_ROW + pos // PAGE), 0), n_pages - 1).to(tl.int64)
    slot = pos % PAGE
    m = valid[:, None] & (d[None, :] < D)
    return (tl.load(K + (page * stride_kp + slot * stride_kl)[:, None] + d[None, :], mask=m, other=0.0),
            tl.load(V + (page * stride_vp + slot * stride_vl)[:, None] + d[None, :], mask=m, other=0.0))


@triton.jit
def _tile_contiguous(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Ignores the table: reads the pool as if it were one contiguous sequence."""
    d = tl.arange(0, BLOCK_D)
    m = valid[:, None] & (d[None, :] < D) & (pos < n_pages * PAGE)[:, None]
    return (tl.load(K + ((pos // PAGE) * stride_kp + (pos % PAGE) * stride_kl)[:, None] + d[None, :], mask=m,
                    other=0.0),
            tl.load(V + ((pos // PAGE) * stride_vp + (pos % PAGE) * stride_vl)[:, None] + d[None, :], mask=m,
                    other=0.0))


@triton.jit
def _tile_k_twice(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Returns K's rows for V too."""
    d = tl.arange(0, BLOCK_D)
    page = tl.minimum(tl.maximum(tl.load(BT_ROW + pos // PAGE, mask=valid, other=0), 0), n_pages - 1)
    m = valid[:, None] & (d[None, :] < D)
    k = tl.load(K + (page.to(tl.int64) * stride_kp + (pos % PAGE) * stride_kl)[:, None] + d[None, :], mask=m,
                other=0.0)
    return k, k


def _tile_plain_python(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages, D, BLOCK_D,
                       PAGE):
    """A body without @triton.jit."""
    page = tl.load(BT_ROW + pos // PAGE, mask=valid, other=0)
    return K + page * stride_kp, V + page * stride_vp


WRONG_TILE = {
    "page and slot swapped": _tile_swapped,
    "no mask on unused table entries": _tile_no_valid_mask,
    "off by one at the page boundary": _tile_off_by_one,
    "no clamp into the pool": _tile_no_clamp,
    "table read unmasked, no clamp": _tile_table_unmasked,
    "table read unmasked, clamped": _tile_table_unmasked_clamped,
    "ignores the block table": _tile_contiguous,
    "K returned for V": _tile_k_twice,
    "no @triton.jit": _tile_plain_python,
}


def test_tile_variant_passes():
    assert run_checks(TILE, _tile_ok, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_TILE, ids=list(WRONG_TILE))
def test_wrong_tile_fails(wrong):
    res = run_checks(TILE, WRONG_TILE[wrong], quiet=True)
    assert res.failed > 0 and not res.todo, wrong


def test_tile_messages_say_what_to_fix():
    lines = {k: " ".join(o.line() for o in run_checks(TILE, fn, quiet=True).outcomes if o.status == "fail")
             for k, fn in (("clamp", _tile_no_clamp), ("mask", _tile_no_valid_mask))}
    assert "clamp the page index" in lines["clamp"]
    assert "past the sequence's end must be 0" in lines["mask"]
    for fn in (_tile_table_unmasked, _tile_table_unmasked_clamped):
        failed = [o for o in run_checks(TILE, fn, quiet=True).outcomes if o.status == "fail"]
        assert any("block table is read only where valid" in o.name and "load the entries with mask=valid"
                   in o.line() for o in failed), fn.__name__
    line = run_checks(TILE, _tile_plain_python, quiet=True).outcomes[0].line()
    assert "expected a @triton.jit function" in line


# ---------------------------------------------------------------------------------------------- work_items
def _items(lengths, budget, block_n, *, start_up=True, ceil_c=True, ceil_n=True, use_budget=True, tiles_chunk=True):
    L = torch.as_tensor(lengths, dtype=torch.int64)
    tiles = (L + block_n - 1) // block_n
    if start_up:
        tiles = torch.clamp(tiles, min=1)
    T = int(tiles.sum())
    if not use_budget:
        c = 1
    elif ceil_c:
        c = max(1, -(-T // budget))
    else:
        c = max(1, T // budget)
    n = (tiles + c - 1) // c if ceil_n else torch.clamp(tiles // c, min=1)
    chunk = c * block_n if tiles_chunk else max(1, -(-int(L.sum()) // budget))
    out = []
    for b, (Lb, nb) in enumerate(zip(L.tolist(), n.tolist())):
        for j in range(nb):
            s = j * chunk
            out.append((b, s, Lb if (j == nb - 1 and ceil_n) else min(s + chunk, Lb)))
    return out


WRONG_ITEMS = {
    "ignores the budget (one item per tile)": lambda *a: _items(*a, use_budget=False),
    "drops a row's tail (n_b = floor(tiles_b / c))": lambda *a: _items(*a, ceil_n=False),
    "no start-up for short rows (an empty row gets no item)": lambda *a: _items(*a, start_up=False),
    "c = floor(T / P)": lambda *a: _items(*a, ceil_c=False),
    "chunk in keys, not whole tiles": lambda *a: _items(*a, tiles_chunk=False),
    "fdlib's items in reverse order": lambda *a: schedule.items(*a)[::-1],
    "(start, end, b) order": lambda *a: [(s, e, b) for b, s, e in schedule.items(*a)],
}


def test_items_variant_passes():
    assert run_checks(ITEMS, lambda *a: torch.tensor(_items(*a)), quiet=True).ok   # a [n, 3] tensor is fine too


@pytest.mark.parametrize("wrong", WRONG_ITEMS, ids=list(WRONG_ITEMS))
def test_wrong_items_fail(wrong):
    res = run_checks(ITEMS, WRONG_ITEMS[wrong], quiet=True)
    assert res.failed > 0 and not res.todo, wrong


def test_items_messages():
    line = next(o.line() for o in run_checks(ITEMS, WRONG_ITEMS["no start-up for short rows (an empty row gets no "
                                                                   "item)"], quiet=True).outcomes if o.status == "fail")
    assert "has no item" in line
    line = next(o.line() for o in run_checks(ITEMS, WRONG_ITEMS["drops a row's tail (n_b = floor(tiles_b / c))"],
                                             quiet=True).outcomes if o.status == "fail")
    assert "the tail is dropped" in line


# ---------------------------------------------------------------------------------------------- stubs
@pytest.mark.parametrize("stub", [todo_stub, not_implemented_stub], ids=["todo()", "raise NotImplementedError"])
@pytest.mark.parametrize("name", [ITEMS])
def test_stub_is_todo(name, stub, capsys):
    res = run_checks(name, stub)
    assert_one_todo_line(res, capsys.readouterr().out, name)


@pytest.mark.parametrize("name", [TILE, ITEMS, WORK_LIST])
def test_shipped_stub_is_todo(name, capsys):
    fn = cell_function(core.stub_source(name), name.split(".")[1])
    try:
        assert_one_todo_line(run_checks(name, fn), capsys.readouterr().out, name)
    finally:
        core._LEARNER.pop(name, None)


def test_edited_stub_is_a_real_attempt():
    src = core.stub_source(TILE).replace("return pos, pos", "return pos + 0, pos")
    res = run_checks(TILE, cell_function(src, "paged_tile_load"), quiet=True)
    core._LEARNER.pop(TILE, None)
    assert not res.todo and res.failed == res.total


@pytest.mark.parametrize("name", [TILE, ITEMS, WORK_LIST])
def test_solution_source_runs_as_a_cell(name):
    fn = cell_function(core.solution_source(name), name.split(".")[1])
    try:
        assert run_checks(name, fn, quiet=True).ok
    finally:
        core._LEARNER.pop(name, None)


def test_solution_source_of_the_jit_solution():
    src = core.solution_source(TILE)
    assert src.startswith('@exercise("lab06.paged_tile_load")\n@triton.jit\ndef paged_tile_load(')
