"""The Lab 07 graders are tested too: untouched stubs and known-wrong merges, unified-max partials and bug fixes
fail their checks; for the bug zoo, the buggy function shipped in each exercise cell fails its own checks."""
from __future__ import annotations

import math

import pytest
import torch

from fdlib.course.grading import core, lab07
from fdlib.course.grading.core import run_checks
from helpers import assert_one_todo_line, cell_function, not_implemented_stub, todo_stub

MERGE, UNIFIED = lab07.MERGE, lab07.UNIFIED
NEG_INF = float("-inf")


def _finite(m):
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


# ---------------------------------------------------------------------------------------------- fixed_order_merge
def _merge(o, lse, arrival, *, order="index", max_sub=True, guard=True, weights="lse", add_m=True):
    m = lse.max()
    ref = (_finite(m) if guard else m) if max_sub else torch.zeros_like(m)
    idx = range(o.shape[0]) if order == "index" else arrival
    num, den = torch.zeros_like(o[0]), torch.zeros_like(m)
    for i in idx:
        w = torch.exp(lse[i] - ref) if weights == "lse" else torch.ones_like(m)
        if not guard or w > 0:
            num, den = num + w * o[i], den + w
    if guard and den == 0:
        return torch.zeros_like(o[0]), torch.full_like(m, NEG_INF)
    return num / den, (ref if add_m else 0) + torch.log(den)


def _merge_pairwise_in_arrival(o, lse, arrival):
    """A running two-state merge in the order the programs arrived (what atomics or a naive ticket would do)."""
    cur_o, cur_l = o[arrival[0]], lse[arrival[0]]
    for i in arrival[1:]:
        m = _finite(torch.maximum(cur_l, lse[i]))
        a, b = torch.exp(cur_l - m), torch.exp(lse[i] - m)
        den = a + b
        cur_o = torch.where(den > 0, (a * cur_o + b * o[i]) / torch.where(den > 0, den, 1), cur_o)
        cur_l = torch.where(den > 0, m + torch.log(den), cur_l)
    return cur_o, cur_l


WRONG_MERGE = {
    "sums in arrival order": lambda *a: _merge(*a, order="arrival"),
    "running pairwise merge in arrival order": _merge_pairwise_in_arrival,
    "no max subtraction (exp(lse) overflows)": lambda *a: _merge(*a, max_sub=False),
    "no guard for all-empty rows (-inf - -inf)": lambda *a: _merge(*a, guard=False),
    "plain average of the O_i": lambda *a: _merge(*a, weights="ones"),
    "lse without the max added back": lambda *a: _merge(*a, add_m=False),
}


def test_merge_variant_passes():
    assert run_checks(MERGE, _merge, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_MERGE, ids=list(WRONG_MERGE))
def test_wrong_merge_fails(wrong):
    assert run_checks(MERGE, WRONG_MERGE[wrong], quiet=True).failed > 0, wrong


def test_arrival_order_message():
    """The report shows the bits and the distance in ulps, and says which of O and lse differ (an lse printed
    twice in decimal looked like "values that differ" when only O did)."""
    for wrong in ("sums in arrival order", "running pairwise merge in arrival order"):
        res = run_checks(MERGE, WRONG_MERGE[wrong], quiet=True)
        line = next(o.line() for o in res.outcomes if o.status == "fail" and "arrival orders" in o.name)
        assert "different bits" in line and "arrival" in line, line
        assert "[bits 0x" in line and "O values differ, by up to" in line and "ulp" in line, line


def test_bit_difference_shows_bits_and_ulps():
    one = torch.tensor(2.98306561)
    nxt = torch.nextafter(one, torch.tensor(3.0))
    o = torch.randn(8)
    o2 = o.clone()
    o2[3] = torch.nextafter(o[3], torch.tensor(1e9))
    msg = lab07.bit_difference(o, one, o2, nxt)
    bits = [f"0x{int(x.view(torch.int32)):08x}" for x in (one, nxt)]
    assert bits[0] != bits[1] and all(b in msg for b in bits) and "1 ulp apart" in msg, msg
    assert "1 of 8 O values differ, by up to 1 ulp" in msg, msg
    assert "lse bitwise equal" in lab07.bit_difference(o, one, o2, one)
    f = torch.tensor
    assert int(lab07.ulps(f(-0.0), f(0.0))) == 0
    tiny = f(1e-45)                                              # the smallest float32 denormal
    assert int(lab07.ulps(-tiny, tiny)) == 2 and int(lab07.ulps(f(1.0), f(2.0))) == 2 ** 23


# ---------------------------------------------------------------------------------------------- unified_max_partial
def _unified(s, v, phi, w_lo, w_hi, *, ref="phi", upper_only=False, count_masked=False, closed=True, acc=torch.float32,
             normalise=False):
    x = s.float() - phi
    fin = torch.isfinite(x)
    if count_masked:
        fin = torch.ones_like(fin)
    out_hi = (x > w_hi) if closed else (x >= w_hi)
    out_lo = (x < w_lo) if closed else (x <= w_lo)
    flag = bool((out_hi if upper_only else (out_hi | out_lo))[fin].any())
    if ref == "max":                                           # the split's own max, as plain online softmax
        m = s.max() if len(s) else torch.tensor(0.0)
        x = s.float() - (m if torch.isfinite(m) else 0)
    p = torch.where(torch.isfinite(x), torch.exp(x), torch.zeros_like(x))
    if acc == torch.float32:
        l, o = p.sum(), p @ v.float()
    else:
        l, o = torch.zeros((), dtype=acc), torch.zeros(v.shape[1], dtype=acc)
        for lo in range(0, len(p), 64):
            l = l + p[lo:lo + 64].sum().to(acc)
            o = o + (p[lo:lo + 64] @ v[lo:lo + 64].float()).to(acc)
        l, o = l.float(), o.float()
    if normalise:
        o = o / torch.where(l == 0, torch.ones_like(l), l)
    return o, l, flag


WRONG_UNIFIED = {
    "the split's own max instead of phi": lambda *a: _unified(*a, ref="max"),
    "flags only logits above phi + w_hi": lambda *a: _unified(*a, upper_only=True),
    "masked keys (-inf) raise the flag": lambda *a: _unified(*a, count_masked=True),
    "open window (the edges flag)": lambda *a: _unified(*a, closed=False),
    "float16 accumulation": lambda *a: _unified(*a, acc=torch.float16),
    "normalised O instead of Õ": lambda *a: _unified(*a, normalise=True),
}


def test_unified_variant_passes():
    assert run_checks(UNIFIED, _unified, quiet=True).ok


def test_unified_old_argument_names_pass():
    """A solution saved before the window's edges were named w_lo, w_hi (it takes them as a, b) still passes: the
    checks pass the arguments by position."""
    def saved(s, v, phi, a, b):
        return _unified(s, v, phi, a, b)
    assert run_checks(UNIFIED, saved, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_UNIFIED, ids=list(WRONG_UNIFIED))
def test_wrong_unified_fails(wrong):
    assert run_checks(UNIFIED, WRONG_UNIFIED[wrong], quiet=True).failed > 0, wrong


# ---------------------------------------------------------------------------------------------- bug zoo: wrong fixes
def _nan_merge(o_a, lse_a, o_b, lse_b, *, fix="both", max_sub=True):
    m = torch.maximum(lse_a, lse_b)
    if fix == "clamp":                                     # a finite floor for the max and an epsilon: no NaN,
        m = torch.clamp(m, min=-1e30)                      # but an empty row's lse comes out finite
    elif fix in ("both", "max only"):
        m = _finite(m)
    if not max_sub:
        m = torch.zeros_like(m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    den = w_a + w_b
    safe = den + 1e-10 if fix == "clamp" else (torch.where(den == 0, torch.ones_like(den), den)
                                               if fix == "both" else den)
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / safe[..., None]
    lse = m + torch.log(safe if fix == "clamp" else den)
    if fix == "nan_to_num":
        o = torch.nan_to_num(o)
    return o, lse


WRONG_NAN = {
    "clamp the max to -1e30 and add 1e-10 (empty rows get a finite lse)": lambda *a: _nan_merge(*a, fix="clamp"),
    "nan_to_num on O only (lse still NaN)": lambda *a: _nan_merge(*a, fix="nan_to_num"),
    "finite max but 0/0 left in O": lambda *a: _nan_merge(*a, fix="max only"),
    "no max subtraction (exp(500) overflows)": lambda *a: _nan_merge(*a, max_sub=False),
}


def _base2(o, lse2, *, weights="exp2", out="e"):
    m = _finite(lse2.amax(0))
    if weights == "twice":                                 # converted to base e, then weighted with exp2 too
        lse2 = lse2 * math.log(2.0)
        m = _finite(lse2.amax(0))
    w = torch.exp2(lse2 - m) if weights in ("exp2", "twice") else torch.exp(lse2 - m)
    den = w.sum(0)
    res = (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    lse2_out = m + torch.log2(den)
    lse = {"e": lse2_out * math.log(2.0), "2": lse2_out, "log2e": lse2_out / math.log(2.0)}[out]
    return res, lse


def _base2_as_natural(o, lse2):
    """The shipped bug, edited but not fixed: base-2 lse weighed with e^x and logged with ln."""
    m = _finite(lse2.amax(0))
    w = torch.exp(lse2 - m)
    den = w.sum(0)
    return (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None], m + torch.log(den)


WRONG_BASE2 = {
    "exp2 weights, lse returned in base 2": lambda *a: _base2(*a, out="2"),
    "converted to base e and weighted with exp2 (scaled twice)": lambda *a: _base2(*a, weights="twice"),
    "converted with log2(e) instead of ln(2)": lambda *a: _base2(*a, out="log2e"),
    "e^x weights on base-2 values (the bug, edited)": _base2_as_natural,
}
BASE2_CAUSE = {                             # what each wrong fix's message names
    "exp2 weights, lse returned in base 2": "still in base 2",
    "converted to base e and weighted with exp2 (scaled twice)": "converted to base e (× ln 2) and then weighed with 2^x",
    "converted with log2(e) instead of ln(2)": "converted with log2(e) = 1/ln 2",
    "e^x weights on base-2 values (the bug, edited)": "read base-2 values as natural logs",
}


@pytest.mark.parametrize("wrong", BASE2_CAUSE, ids=list(BASE2_CAUSE))
def test_a_wrong_base2_fix_names_its_cause(wrong):
    """Not two numbers only: the first failing check names the base mix-up."""
    res = run_checks(lab07.BASE2, WRONG_BASE2[wrong], quiet=True)
    line = next(o.line() for o in res.outcomes if o.status == "fail")
    assert "Likely cause: " in line and BASE2_CAUSE[wrong] in line.split("Likely cause: ")[1], line


def _strided(o, lse, *, fix_o=True, fix_lse=True, reverse=False):
    def load(t, fixed):
        if fixed:
            st = t.stride()[::-1] if reverse else t.stride()
            return torch.as_strided(t, t.shape, st, t.storage_offset())
        st, step = [], 1
        for n in reversed(t.shape):
            st.insert(0, step)
            step *= n
        return torch.as_strided(t, t.shape, st, t.storage_offset())
    o, lse = load(o, fix_o), load(lse, fix_lse)
    m = _finite(lse.amax(0))
    w = torch.exp(lse - m)
    den = w.sum(0)
    return (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None], m + torch.log(den)


WRONG_STRIDED = {
    "o read at its strides, lse still as if contiguous": lambda *a: _strided(*a, fix_lse=False),
    "lse read at its strides, o still as if contiguous": lambda *a: _strided(*a, fix_o=False),
    "the strides in reverse order": lambda *a: _strided(*a, reverse=True),
}


def _empty(q, k, v, length, splits, block, scale, *, mask_merge=True, guard_zero=True, chunking="ceil"):
    if chunking == "ceil":
        chunk = -(-(-(-max(length, 1) // splits)) // block) * block
    else:                                                  # floor: the tail keys past splits*chunk are dropped
        chunk = max(length // splits, 1)
    o_parts, lse_parts = [], []
    for i in range(splits):
        lo, hi = i * chunk, min((i + 1) * chunk, length)
        s = (k[lo:hi].float() @ q.float()) * scale
        m = s.max() if s.numel() else torch.tensor(NEG_INF)
        p = torch.exp(s - m)
        l = p.sum()
        o_parts.append((p @ v[lo:hi].float()) / l)
        lse_parts.append(m + torch.log(l))
    o_parts, lse = torch.stack(o_parts), torch.stack(lse_parts)
    m = _finite(lse.max())
    w = torch.exp(lse - m)
    if mask_merge:
        o_parts = torch.where(w[:, None] > 0, o_parts, torch.zeros_like(o_parts))
    den = w.sum()
    if guard_zero and den == 0:
        return torch.zeros(v.shape[1]), torch.tensor(NEG_INF)
    return (w[:, None] * o_parts).sum(0) / den, m + torch.log(den)


WRONG_EMPTY = {
    "empty splits masked in the merge, length 0 still 0/0": lambda *a: _empty(*a, guard_zero=False),
    "length 0 guarded, empty splits still NaN in the merge": lambda *a: _empty(*a, mask_merge=False),
    "floor chunks (keys past splits·chunk dropped)": lambda *a: _empty(*a, chunking="floor"),
}


def _fp16(s, v, block, *, l_dtype=torch.float32, o_dtype=torch.float32):
    n, D = v.shape
    m = s.max() if n else torch.tensor(NEG_INF)
    ref = _finite(m)
    l, o = torch.zeros((), dtype=l_dtype), torch.zeros(D, dtype=o_dtype)
    for lo in range(0, n, block):
        p = torch.exp(s[lo:lo + block] - ref)
        l = l + p.sum().to(l_dtype)
        o = o + (p @ v[lo:lo + block].float()).to(o_dtype)
    return m.float(), l.float(), o.float()


WRONG_FP16 = {
    "ℓ in float32, Õ still in float16": lambda *a: _fp16(*a, o_dtype=torch.float16),
    "Õ in float32, ℓ still in float16": lambda *a: _fp16(*a, l_dtype=torch.float16),
    "bfloat16 accumulators (range, not precision)": lambda *a: _fp16(*a, l_dtype=torch.bfloat16,
                                                                    o_dtype=torch.bfloat16),
}

def test_fp16_messages_name_the_accumulator_dtype():
    """Every failure of a 16-bit accumulator says which sum is accumulated in which dtype, and that it should be
    float32."""
    cases = {"ℓ": WRONG_FP16["Õ in float32, ℓ still in float16"], "Õ": WRONG_FP16["ℓ in float32, Õ still in float16"]}
    for what, fn in cases.items():
        for o in run_checks(lab07.FP16, fn, quiet=True).outcomes:
            assert o.status == "fail" and f"summing {what} in float16" in o.message, o.line()
            assert "accumulated in float16 and should be float32" in o.message, o.line()
    for o in run_checks(lab07.FP16, WRONG_FP16["bfloat16 accumulators (range, not precision)"], quiet=True).outcomes:
        assert o.status == "fail" and "accumulated in bfloat16 and should be float32" in o.message, o.line()
    fn = _shipped(lab07.FP16)
    try:
        outcomes = lab07.checks_as_is(lab07.FP16, fn)
    finally:
        core._LEARNER.pop(lab07.FP16, None)
    assert outcomes and all("accumulated in float16 and should be float32" in o.message for o in outcomes)
    # another bug (a dropped tile) is not blamed on the dtype
    res = run_checks(lab07.FP16, lambda s, v, block: _fp16(s[:-1], v[:-1], block), quiet=True)
    assert res.failed > 0 and not any("accumulated in" in o.message for o in res.outcomes)


WRONG_BUGS = {lab07.NAN: WRONG_NAN, lab07.BASE2: WRONG_BASE2, lab07.STRIDED: WRONG_STRIDED, lab07.EMPTY: WRONG_EMPTY,
              lab07.FP16: WRONG_FP16}
BUG_CASES = [(name, w) for name, ws in WRONG_BUGS.items() for w in ws]


@pytest.mark.parametrize("name,wrong", BUG_CASES, ids=[f"{n}:{w}" for n, w in BUG_CASES])
def test_wrong_bug_fix_fails(name, wrong):
    res = run_checks(name, WRONG_BUGS[name][wrong], quiet=True)
    assert res.failed > 0 and not res.todo, f"{name} accepts a wrong fix: {wrong}"


def test_every_exercise_has_three_wrong_solutions():
    counts = {MERGE: len(WRONG_MERGE), UNIFIED: len(WRONG_UNIFIED), **{n: len(w) for n, w in WRONG_BUGS.items()}}
    assert set(counts) == set(core.exercises("lab07"))
    assert min(counts.values()) >= 3, counts


# ---------------------------------------------------------------------------------------------- the shipped bugs
def _shipped(name):
    return cell_function(core.stub_source(name), name.split(".")[1])


@pytest.mark.parametrize("name", lab07.BUGS)
def test_shipped_buggy_version_fails_its_checks(name):
    """The buggy function as shipped, run as its cell, fails at least one check (and passes none that the bug
    cannot touch... it is allowed to pass those), while the reference passes them all."""
    fn = _shipped(name)
    try:
        outcomes = lab07.checks_as_is(name, fn)
        failed = [o for o in outcomes if o.status == "fail"]
        assert failed, f"the shipped {name} passes every check: its bug is not caught"
        assert all(o.status == "pass" for o in lab07.checks_as_is(name, core.reference(name)))
    finally:
        core._LEARNER.pop(name, None)


@pytest.mark.parametrize("name", lab07.BUGS)
def test_untouched_bug_cell_is_a_todo_and_an_edited_one_is_graded(name, capsys):
    fn = _shipped(name)
    try:
        res = run_checks(name, fn)
        out = capsys.readouterr().out
        assert res.todo and not res.ok and res.passed == 0
        assert out == f"📝 TODO: {lab07.untouched_line(name)}\n" and "Traceback" not in out, out
        assert out.startswith(f"📝 TODO: fix {name}: the cell still holds the buggy code") and "stub" not in out
        # a comment added to the cell still counts as untouched; a change of code is graded (and still fails)
        src = core.stub_source(name)
        commented = src.replace('"""\n', '"""\n    # looking for the bug...\n', 1)
        assert run_checks(name, cell_function(commented, name.split(".")[1]), quiet=True).todo
        edited = src.rstrip("\n") + "\n    print('edited')\n"
        res = run_checks(name, cell_function(edited, name.split(".")[1]), quiet=True)
        assert not res.todo and res.failed > 0
    finally:
        core._LEARNER.pop(name, None)


def test_show_as_is_prints_the_failures(capsys):
    fn = _shipped(lab07.NAN)
    try:
        lab07.show_as_is(fn)
    finally:
        core._LEARNER.pop(lab07.NAN, None)
    out = capsys.readouterr().out
    assert "❌ FAIL rows empty in both parts" in out and "NaN" in out
    line = next(x for x in out.splitlines() if "rows empty in both parts" in x)
    n = int(line.split(": ")[-2].split(" of ")[0])        # "... : 22 of 64 rows empty in both parts: NaN ..."
    assert n > 4 and line.endswith(f", … ({n} rows)]")   # a shortened list of rows says so, and how many
    with pytest.raises(ValueError, match="bug-zoo"):
        lab07.show_as_is(core.reference(MERGE))


# ---------------------------------------------------------------------------------------------- stubs
@pytest.mark.parametrize("stub", [todo_stub, not_implemented_stub], ids=["todo()", "raise NotImplementedError"])
@pytest.mark.parametrize("name", core.exercises("lab07"))
def test_stub_is_todo(name, stub, capsys):
    res = run_checks(name, stub)
    assert_one_todo_line(res, capsys.readouterr().out, name)
