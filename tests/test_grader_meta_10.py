"""The Lab 10 grader is tested too: the untouched stub and known-wrong in-place appends must fail its checks, each
with a message that names its cause; appends written differently from the reference pass."""
from __future__ import annotations

import pytest
import torch

from fdlib.course.grading import core
from fdlib.course.grading.core import run_checks
from helpers import assert_one_todo_line, not_implemented_stub, todo_stub

APPEND = "lab10.append_kv"


def _append(k_cache, v_cache, lengths, k_new, v_new, real=None, *, at="own", skip_pads=True, advance=1,
            count_pads=False):
    """Loops over the sequences, written differently from the reference (a slice per sequence)."""
    B, T = k_new.shape[:2]
    real = torch.ones(B, T, dtype=torch.bool) if real is None else real
    n = real.sum(1)
    start = lengths.clone() if at == "own" else lengths.max().expand(B)
    for b in range(B):
        rows = slice(T - int(n[b]), T) if skip_pads else slice(0, int(n[b]))
        s = int(start[b])
        k_cache[b, s:s + int(n[b])] = k_new[b, rows]
        v_cache[b, s:s + int(n[b])] = v_new[b, rows]
    for _ in range(advance):
        lengths += (torch.full_like(n, T) if count_pads else n).to(lengths.dtype)


def _index_put(k_cache, v_cache, lengths, k_new, v_new, real=None):
    """The other correct append: a cumulative count of real tokens gives each real token its slot."""
    B, T = k_new.shape[:2]
    real = torch.ones(B, T, dtype=torch.bool) if real is None else real
    slot = lengths.long()[:, None] + real.long().cumsum(1) - 1
    b, t = torch.where(real)
    k_cache.index_put_((b, slot[b, t]), k_new[b, t])
    v_cache.index_put_((b, slot[b, t]), v_new[b, t])
    lengths.add_(real.sum(1).int())


def _gap(k_cache, v_cache, lengths, k_new, v_new, real=None):
    """Pads skipped but still counted: real token t written at L_b + t, not L_b + t - p_b."""
    B, T = k_new.shape[:2]
    real = torch.ones(B, T, dtype=torch.bool) if real is None else real
    b, t = torch.where(real)
    pos = lengths.long()[b] + t
    k_cache[b, pos] = k_new[b, t]
    v_cache[b, pos] = v_new[b, t]
    lengths += real.sum(1).to(lengths.dtype)


def _keys_only(k_cache, v_cache, lengths, k_new, v_new, real=None):
    _append(k_cache, v_cache.clone(), lengths, k_new, v_new, real)


WRONG = {
    "appended at the longest length": (lambda *a: _append(*a, at="longest"), "the longest sequence's length"),
    "written before padding is skipped": (lambda *a: _append(*a, skip_pads=False), "skip the"),
    "lengths advanced twice": (lambda *a: _append(*a, advance=2), "advanced twice"),
    "lengths advanced by q_len, padding included": (lambda *a: _append(*a, count_pads=True), "padding included"),
    "lengths not advanced": (lambda *a: _append(*a, advance=0), "not advanced"),
    "values not written": (_keys_only, "write v_new where k_new goes"),
    "pads skipped but still counted": (_gap, "skipped but still counted"),
}


def test_variants_pass():
    assert run_checks(APPEND, _append, quiet=True).ok
    assert run_checks(APPEND, _index_put, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG, ids=list(WRONG))
def test_wrong_appends_fail_naming_the_cause(wrong):
    fn, cause = WRONG[wrong]
    res = run_checks(APPEND, fn, quiet=True)
    assert res.failed > 0 and not res.todo, wrong
    lines = [o.line() for o in res.outcomes if o.status == "fail"]
    assert any(cause in line for line in lines), lines


def test_a_new_cache_instead_of_writing_in_place_fails():
    def returns_new(k_cache, v_cache, lengths, k_new, v_new, real=None):
        k, v, lens = k_cache.clone(), v_cache.clone(), lengths.clone()
        _append(k, v, lens, k_new, v_new, real)
        return k, v, lens
    res = run_checks(APPEND, returns_new, quiet=True)
    assert res.failed == len(res.outcomes)
    assert all("in place" in o.line() or "expected None" in o.line() for o in res.outcomes)


def test_padding_written_is_not_taken_for_a_gap():
    """Writing the pad tokens and skipping them without closing the gap put the first real token at the same
    position; each gets its own cause."""
    lines = [o.line() for o in run_checks(APPEND, lambda *a: _append(*a, skip_pads=False), quiet=True).outcomes
             if o.status == "fail"]
    assert lines and not any("skipped but still counted" in line for line in lines), lines


def test_overwriting_old_keys_is_named():
    def from_zero(k_cache, v_cache, lengths, k_new, v_new, real=None):
        _append(k_cache, v_cache, torch.zeros_like(lengths), k_new, v_new, real)
        lengths += (torch.ones_like(k_new[:, :, 0, 0], dtype=torch.bool) if real is None else real).sum(1).int()
    lines = [o.line() for o in run_checks(APPEND, from_zero, quiet=True).outcomes if o.status == "fail"]
    assert lines and any("already in the cache" in line for line in lines), lines


@pytest.mark.parametrize("stub", [todo_stub, not_implemented_stub], ids=["todo()", "raise NotImplementedError"])
def test_stub_is_todo(stub, capsys):
    res = run_checks(APPEND, stub)
    assert_one_todo_line(res, capsys.readouterr().out, APPEND)


def test_solution_source_pastes_into_a_cell():
    assert core.solution_source(APPEND).startswith(f'@exercise("{APPEND}")\ndef ')
