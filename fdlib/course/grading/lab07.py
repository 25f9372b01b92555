r"""Checks for Lab 07: exact decode (a fixed merge order, FlashDecoding++'s unified max, and a bug zoo).

Graded exercises (the learner writes the function):

* ``lab07.fixed_order_merge(o, lse, arrival) -> (O, lse)``: merge the S partials of one row, ``o [S, D]`` and
  ``lse [S]`` (float32), in an order that does not depend on ``arrival`` (the order in which the S programs
  finished):

  .. math:: m = \max_i \text{lse}_i,\quad w_i = e^{\text{lse}_i - m},\quad
            O = \frac{\sum_i w_i O_i}{\sum_i w_i},\quad \text{lse} = m + \log\sum_i w_i

  Same partials, any arrival order: bitwise the same O and lse. A row whose partials are all empty
  (lse = −inf everywhere) gives O = 0, lse = −inf, never NaN.
* ``lab07.unified_max_partial(s, v, phi, w_lo, w_hi) -> (Õ, ℓ, overflow)``: one split's partial with a fixed scale φ
  instead of its running max (FlashDecoding++): :math:`\ell = \sum_j e^{s_j - \varphi}`,
  :math:`\tilde O = \sum_j e^{s_j - \varphi} v_j` (float32), and ``overflow`` True when a key's
  :math:`s_j - \varphi` lies outside the window [w_lo, w_hi] (masked keys, s = −inf, never count).

The bug zoo: each exercise is shipped as a small merge function carrying one real class of bug from public
decode-attention code; the learner finds and fixes it. The shipped (buggy) version fails its checks
(:func:`checks_as_is` runs them on it; the check cell shows a TODO line for the untouched cell instead, saying
that the cell still holds the buggy code to fix):

* ``lab07.bug_nan_merge(o_a, lse_a, o_b, lse_b) -> (o, lse)``: two partials whose lse are both −inf merged into NaN.
* ``lab07.bug_lse_base2(o, lse2) -> (o, lse)``: an lse kept in base 2 (exp2 kernels) merged as if in base e.
* ``lab07.bug_strided_partials(o, lse) -> (o, lse)``: a combine that addresses its partials as if contiguous.
* ``lab07.bug_empty_splits(q, k, v, length, splits, block, scale) -> (o, lse)``: more splits than tiles, and the
  empty splits leak 0/0 into the merge.
* ``lab07.bug_fp16_sum(s, v, block) -> (m, ℓ, Õ)``: ℓ and Õ accumulated in fp16: ℓ stalls, then overflows.
"""
from __future__ import annotations

import math

import torch

from .core import (
    CheckFailure, CheckOutcome, TodoError, assert_close, call, check_case, exercise_stub, expect_tensor,
    expect_tuple, load_checks, with_likely_cause,
)
from .triton_exercise import is_untouched

MERGE = "lab07.fixed_order_merge"
UNIFIED = "lab07.unified_max_partial"
NAN = "lab07.bug_nan_merge"
BASE2 = "lab07.bug_lse_base2"
STRIDED = "lab07.bug_strided_partials"
EMPTY = "lab07.bug_empty_splits"
FP16 = "lab07.bug_fp16_sum"
BUGS = (NAN, BASE2, STRIDED, EMPTY, FP16)
NEG_INF = float("-inf")

MERGE_STUB = exercise_stub(MERGE, '''
@exercise("lab07.fixed_order_merge")
def fixed_order_merge(o, lse, arrival):
    """Merge the S partials of one row in a fixed order: o [S, D] (O_i), lse [S] (lse_i), float32.

    arrival: the split indices in the order their programs finished (the last one merges). The result must
    not depend on it: same partials, any arrival order, bitwise the same (O [D], lse []) in float32.
    m = max_i lse_i, w_i = exp(lse_i - m), O = sum_i w_i O_i / sum_i w_i, lse = m + log(sum_i w_i);
    all partials empty (lse = -inf everywhere): O = 0, lse = -inf, no NaN.
    """
    todo("lab07.fixed_order_merge")
''')

UNIFIED_STUB = exercise_stub(UNIFIED, '''
@exercise("lab07.unified_max_partial")
def unified_max_partial(s, v, phi, w_lo, w_hi):
    """One split's partial with the unified max phi (FlashDecoding++): s [n] float32 logits (-inf: masked key),
    v [n, D] values, phi a float, [w_lo, w_hi] the safe window (w_lo < 0 < w_hi).

    Returns (o_tilde [D] float32, l [] float32, overflow bool): l = sum_j exp(s_j - phi),
    o_tilde = sum_j exp(s_j - phi) v_j, accumulated in float32; overflow is True when some finite s_j - phi
    lies outside [w_lo, w_hi] (then the row is recomputed exactly and o_tilde, l are not used).
    """
    todo("lab07.unified_max_partial")
''')

def untouched_line(name: str) -> str:
    """The TODO line of a bug-zoo cell that still holds the code it was shipped with."""
    return f"fix {name}: the cell still holds the buggy code as shipped; find the bug, fix it, then run this cell again"


def _bug_stub(name: str, source: str) -> str:
    """Register a bug-zoo stub: the buggy function as shipped. Its untouched cell is "not started" (one TODO
    line, like every other stub, saying that the buggy code is still there; recognised by its code, comments and
    docstring aside); any edit is graded."""
    def guard(impl):
        if is_untouched(impl, source):
            raise TodoError(f"fix {name}", line=untouched_line(name))
    return exercise_stub(name, source, guard=guard)


NAN_STUB = _bug_stub(NAN, '''
@exercise("lab07.bug_nan_merge")
def bug_nan_merge(o_a, lse_a, o_b, lse_b):
    """Merge two partial results of the same rows (as vLLM's merge_attn_states merges a prefix and a suffix):
    o_a, o_b [N, H_q, D] float32, lse_a, lse_b [N, H_q] float32 (-inf: that part had no keys).
    Returns (o [N, H_q, D], lse [N, H_q]); a row empty in both parts gives o = 0, lse = -inf.
    """
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    den = w_a + w_b
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / den[..., None]
    return o, m + torch.log(den)
''')

BASE2_STUB = _bug_stub(BASE2, '''
@exercise("lab07.bug_lse_base2")
def bug_lse_base2(o, lse2):
    """Merge S partials per row from a kernel that works in base 2 (exp2 is the fast instruction):
    o [S, N, D] float32, lse2 [S, N] float32 with lse2_i = log2(sum_j 2^(s_j * log2(e))) = lse_i / ln(2).
    Returns (o [N, D], lse [N]) with lse in base e, as torch.logsumexp gives it; an all-empty row: 0, -inf.
    """
    m = lse2.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse2 - m)
    den = w.sum(0)
    out = (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out, m + torch.log(den)
''')

STRIDED_STUB = _bug_stub(STRIDED, '''
@exercise("lab07.bug_strided_partials")
def bug_strided_partials(o, lse):
    """Merge S partials per row: o [S, N, D] float32, lse [S, N] float32, any strides (views of larger
    buffers, transposed layouts). Returns (o [N, D], lse [N]); an all-empty row gives 0, -inf.
    Written like a combine kernel: it gets a base pointer and computes each element's offset itself.
    """
    def load(t):
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.insert(0, step)
            step *= n
        return torch.as_strided(t, t.shape, strides, t.storage_offset())

    o, lse = load(o), load(lse)
    m = lse.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    den = w.sum(0)
    out = (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out, m + torch.log(den)
''')

EMPTY_STUB = _bug_stub(EMPTY, '''
@exercise("lab07.bug_empty_splits")
def bug_empty_splits(q, k, v, length, splits, block, scale):
    """Flash-Decoding of one row: q [D], k, v [L_max, D], the first `length` keys are valid. Cut them into
    `splits` splits of whole tiles of `block` keys, compute each split's (O_i, lse_i), merge them.
    Returns (o [D] float32, lse [] float32); length 0 gives o = 0, lse = -inf.
    """
    chunk = -(-max(length, 1) // splits)
    chunk = -(-chunk // block) * block
    o_parts, lse_parts = [], []
    for i in range(splits):
        lo, hi = i * chunk, min((i + 1) * chunk, length)
        s = (k[lo:hi].float() @ q.float()) * scale
        m = s.max() if s.numel() else torch.tensor(float("-inf"))
        p = torch.exp(s - m)
        l = p.sum()
        o_parts.append((p @ v[lo:hi].float()) / l)
        lse_parts.append(m + torch.log(l))
    o_parts, lse = torch.stack(o_parts), torch.stack(lse_parts)
    m = lse.max()
    m = m if torch.isfinite(m) else torch.zeros_like(m)
    w = torch.exp(lse - m)
    return (w[:, None] * o_parts).sum(0) / w.sum(), m + torch.log(w.sum())
''')

FP16_STUB = _bug_stub(FP16, '''
@exercise("lab07.bug_fp16_sum")
def bug_fp16_sum(s, v, block):
    """One split's partial state, tile by tile as a kernel keeps it in registers: s [n] float32 logits
    (-inf: masked key), v [n, D] float16. Returns (m, l, o_tilde) in float32: m = max_j s_j,
    l = sum_j exp(s_j - m), o_tilde = sum_j exp(s_j - m) v_j; no keys: (-inf, 0, 0).
    """
    n, D = v.shape
    m = s.max() if n else torch.tensor(float("-inf"))
    ref = m if torch.isfinite(m) else torch.zeros_like(m)
    l = torch.zeros((), dtype=torch.float16)
    o = torch.zeros(D, dtype=torch.float16)
    for lo in range(0, n, block):
        p = torch.exp(s[lo:lo + block] - ref)
        l = l + p.sum().to(l.dtype)
        o = o + (p @ v[lo:lo + block].float()).to(o.dtype)
    return m.float(), l.float(), o.float()
''')


def checks_as_is(name: str, impl) -> list[CheckOutcome]:
    """Run every check of ``name`` on ``impl`` without the untouched-stub guard: the bug zoo's shipped buggy
    functions then show how they fail (the meta-tests use this to prove that each one does)."""
    out = []
    for chk in load_checks(name):
        gen = torch.Generator().manual_seed(chk.seed)
        try:
            chk.fn(impl, gen)
            out.append(CheckOutcome(chk.name, "pass"))
        except CheckFailure as e:
            out.append(CheckOutcome(chk.name, "fail", str(e)))
        except Exception as e:  # noqa: BLE001
            out.append(CheckOutcome(chk.name, "fail", f"{type(e).__name__}: {e}"))
    return out


def show_as_is(impl) -> None:
    """Print the ✅/❌ lines of a bug-zoo function's checks as it is now (even the untouched, buggy cell)."""
    name = getattr(impl, "__exercise__", None)
    if name not in BUGS:
        raise ValueError(f"show_as_is: expected a bug-zoo exercise function ({', '.join(BUGS)}), got {name!r}")
    for o in checks_as_is(name, impl):
        print(o.line())


# ---------------------------------------------------------------------------------------------- references
def ref_merge(o: torch.Tensor, lse: torch.Tensor):
    """Float64 merge of partials along dim 0: o [S, ..., D], lse [S, ...] -> (O [..., D], lse [...]).
    Empty partials (lse = -inf) weigh 0 and their O_i is never read; an all-empty row gives 0, -inf."""
    o, lse = o.detach().double().cpu(), lse.detach().double().cpu()
    m = lse.amax(0)
    ms = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - ms)
    den = w.sum(0)
    num = torch.where(w[..., None] > 0, w[..., None] * torch.nan_to_num(o), torch.zeros_like(o)).sum(0)
    out = num / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out, torch.where(den == 0, torch.full_like(den, NEG_INF), ms + torch.log(den))


def _partials(gen, S, D, *shape, spread=4.0, empty=0.0):
    """Random partials: O_i of unit size, lse_i ~ spread·N(0, 1); a fraction `empty` of them lse = -inf, O = 0."""
    o = torch.randn(S, *shape, D, generator=gen)
    lse = torch.randn(S, *shape, generator=gen) * spread
    if empty:
        dead = torch.rand(S, *shape, generator=gen) < empty
        lse = torch.where(dead, torch.full_like(lse, NEG_INF), lse)
        o = torch.where(dead[..., None], torch.zeros_like(o), o)
    return o, lse


def _as_out_lse(got, what, o_shape, lse_shape):
    o, lse = expect_tuple(got, what, 2, "O, lse")
    o = expect_tensor(o, f"{what}: O", shape=o_shape, dtype=(torch.float32,))
    if isinstance(lse, float):
        lse = torch.tensor(lse)
    lse = expect_tensor(lse, f"{what}: lse", dtype=(torch.float32,))
    if tuple(lse.shape) != tuple(lse_shape):
        if lse.numel() == 1 and math.prod(lse_shape) == 1:
            lse = lse.reshape(lse_shape)
        else:
            raise CheckFailure(f"{what}: lse: expected shape {list(lse_shape)}, got {list(lse.shape)}")
    return o, lse


def _compare(got_o, got_lse, ref_o, ref_lse, what, atol=2e-5, rtol=2e-5, lse_atol=2e-5):
    if bool(torch.isnan(got_o).any()) or bool(torch.isnan(got_lse).any()):
        rows = torch.isnan(got_o).flatten(end_dim=-2).any(-1).nonzero().flatten().tolist() \
            if got_o.dim() > 1 else []
        where = ", ".join(map(str, rows[:4])) + (f", … ({len(rows)} rows)" if len(rows) > 4 else "")
        raise CheckFailure(f"{what}: NaN in the result ({int(torch.isnan(got_o).sum())} in O, "
                           f"{int(torch.isnan(got_lse).sum())} in lse)" + (f", rows [{where}]" if rows else ""))
    assert_close(got_lse, ref_lse, f"{what}: lse", lse_atol, 1e-6)
    assert_close(got_o, ref_o, f"{what}: O", atol, rtol)


# ---------------------------------------------------------------------------------------------- fixed_order_merge
def _merge_call(impl, o, lse, arrival, what):
    got = call(impl, {"o": o, "lse": lse, "arrival": list(arrival)})
    return _as_out_lse(got, what, (o.shape[1],), ())


def _shuffled(gen, S):
    return torch.randperm(S, generator=gen).tolist()


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 that counts float32 steps: adjacent float32 numbers map to adjacent integers (±0 to 0)."""
    bits = x.detach().float().cpu().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 steps (units in the last place, ulps) lie between a and b, elementwise (finite values)."""
    return (_ordered_bits(a) - _ordered_bits(b)).abs()


def bits_of(x) -> str:
    """A float32 number with its bit pattern: '2.98306561 [bits 0x403ee952]'."""
    t = torch.as_tensor(x, dtype=torch.float32).reshape(())
    return f"{float(t):.9g} [bits 0x{int(t.view(torch.int32)) & 0xFFFFFFFF:08x}]"


def _n_ulps(n: int) -> str:
    return f"{n} ulp" if n == 1 else f"{n} ulps"


def bit_difference(o1, lse1, o2, lse2) -> str:
    """Where two merge results differ, in bits: the lse's bit patterns and how many O values differ, by how
    many ulps."""
    parts = []
    if torch.equal(lse1, lse2):
        parts.append(f"lse bitwise equal, {bits_of(lse1)}")
    else:
        parts.append(f"lse {bits_of(lse1)} vs {bits_of(lse2)}, {_n_ulps(int(ulps(lse1, lse2)))} apart")
    diff = o1 != o2
    if bool(diff.any()):
        parts.append(f"{int(diff.sum())} of {o1.numel()} O values differ, by up to {_n_ulps(int(ulps(o1, o2).max()))}")
    else:
        parts.append("O bitwise equal")
    return "; ".join(parts)


@check_case(MERGE, "random partials (S = 1, 2, 3, 7, 16; D = 80, 96; lse spread up to ±40) vs float64", points=2)
def _m_values(impl, gen):
    for S, D, spread in ((1, 80, 4.0), (2, 96, 4.0), (3, 80, 1.0), (7, 96, 10.0), (16, 80, 40.0)):
        o, lse = _partials(gen, S, D, spread=spread)
        got_o, got_lse = _merge_call(impl, o, lse, _shuffled(gen, S), f"S={S}, D={D}")
        ref_o, ref_lse = ref_merge(o, lse)
        _compare(got_o, got_lse, ref_o, ref_lse, f"S={S}, D={D}, lse spread {spread}")


@check_case(MERGE, "large lse (±3000): the max is subtracted before exp, nothing overflows")
def _m_large(impl, gen):
    o, lse = _partials(gen, 5, 64)
    for shift in (3000.0, -3000.0):
        got_o, got_lse = _merge_call(impl, o, lse + shift, _shuffled(gen, 5), f"lse + {shift:g}")
        ref_o, ref_lse = ref_merge(o, lse + shift)
        _compare(got_o, got_lse, ref_o, ref_lse, f"S=5, every lse shifted by {shift:g}", lse_atol=1e-3)


@check_case(MERGE, "bitwise the same result for 12 arrival orders (S = 3, 7, 13)", points=2)
def _m_order(impl, gen):
    for S in (3, 7, 13):
        o, lse = _partials(gen, S, 80, spread=3.0)
        first = None
        for trial in range(12):
            arrival = list(range(S)) if trial == 0 else (list(range(S))[::-1] if trial == 1 else _shuffled(gen, S))
            got = _merge_call(impl, o, lse, arrival, f"S={S}, arrival {arrival}")
            if first is None:
                first = (arrival, got)
                ref_o, ref_lse = ref_merge(o, lse)
                _compare(*got, ref_o, ref_lse, f"S={S}")
                continue
            if not (torch.equal(got[0], first[1][0]) and torch.equal(got[1], first[1][1])):
                raise CheckFailure(f"S={S}: arrival {first[0]} and arrival {arrival} give different bits "
                                   f"({bit_difference(first[1][0], first[1][1], got[0], got[1])}; an ulp is the "
                                   f"gap between two adjacent float32 numbers): the merge order must not follow "
                                   f"the arrival order")


@check_case(MERGE, "empty partials: some lse = -inf weigh 0; all -inf gives O = 0, lse = -inf, no NaN")
def _m_empty(impl, gen):
    o, lse = _partials(gen, 6, 80)
    lse[1] = lse[4] = NEG_INF
    o[1] = o[4] = 0
    got = _merge_call(impl, o, lse, _shuffled(gen, 6), "2 of 6 partials empty")
    _compare(*got, *ref_merge(o, lse), "2 of 6 partials empty (lse = -inf)")
    for S in (1, 4):
        o = torch.zeros(S, 80)
        lse = torch.full((S,), NEG_INF)
        got_o, got_lse = _merge_call(impl, o, lse, _shuffled(gen, S), f"all {S} partials empty")
        if bool(torch.isnan(got_o).any()) or bool(torch.isnan(got_lse)):
            raise CheckFailure(f"all {S} partials empty (lse = -inf): NaN in the result (-inf - (-inf) = NaN: "
                               f"use a finite reference point when the max is -inf)")
        if not (bool((got_o == 0).all()) and bool(torch.isneginf(got_lse))):
            raise CheckFailure(f"all {S} partials empty: expected O = 0 and lse = -inf, got max |O| "
                               f"{float(got_o.abs().max()):.3g} and lse {float(got_lse):.6g}")


# ---------------------------------------------------------------------------------------------- unified_max_partial
def ref_unified_partial(s, v, phi, w_lo, w_hi):
    """Float64: (Õ [D], ℓ, overflow) with the unified max phi (see the module docstring)."""
    s64, v64 = s.double().cpu(), v.double().cpu()
    x = s64 - phi
    fin = torch.isfinite(s64)
    overflow = bool(((x > w_hi) | (x < w_lo))[fin].any())
    p = torch.where(fin, torch.exp(x), torch.zeros_like(x))
    return p @ v64 if len(s64) else torch.zeros(v.shape[-1], dtype=torch.float64), p.sum(), overflow


def _unified_call(impl, s, v, phi, w_lo, w_hi, what):
    got = call(impl, {"s": s, "v": v, "phi": phi, "w_lo": w_lo, "w_hi": w_hi})
    o, l, flag = expect_tuple(got, what, 3, "Õ, ℓ, overflow")
    o = expect_tensor(o, f"{what}: Õ", shape=(v.shape[-1],), dtype=(torch.float32,))
    if isinstance(l, (int, float)):
        l = torch.tensor(float(l))
    l = expect_tensor(l, f"{what}: ℓ", dtype=(torch.float32,))
    if l.numel() != 1:
        raise CheckFailure(f"{what}: ℓ: expected one number (shape []), got shape {list(l.shape)}")
    if isinstance(flag, torch.Tensor):
        if flag.numel() != 1:
            raise CheckFailure(f"{what}: overflow: expected one bool, got a tensor of shape {list(flag.shape)}")
        flag = flag.item()
    if not isinstance(flag, bool):
        raise CheckFailure(f"{what}: overflow: expected a bool, got {type(flag).__name__}")
    return o, l.reshape(()), flag


def _unified_compare(impl, s, v, phi, w_lo, w_hi, what, rtol=2e-5):
    o, l, flag = _unified_call(impl, s, v, phi, w_lo, w_hi, what)
    ref_o, ref_l, ref_flag = ref_unified_partial(s, v, phi, w_lo, w_hi)
    if flag != ref_flag:
        x = (s.double() - phi)[torch.isfinite(s)]
        rng = f"s - phi in [{float(x.min()):.4g}, {float(x.max()):.4g}]" if len(x) else "no finite logits"
        raise CheckFailure(f"{what}: overflow {flag}, expected {ref_flag} ({rng}, window [w_lo, w_hi] = "
                           f"[{w_lo:g}, {w_hi:g}])")
    if not ref_flag:
        assert_close(l, ref_l, f"{what}: ℓ", 1e-30, rtol)
        scale = float(ref_o.abs().max()) if len(ref_o) else 1.0
        assert_close(o, ref_o, f"{what}: Õ", rtol * max(scale, 1e-30), rtol)


@check_case(UNIFIED, "logits inside the window: ℓ = Σ e^(s−φ), Õ = Σ e^(s−φ)·v vs float64 (φ is not the max)",
            points=2)
def _u_values(impl, gen):
    for n, D, phi in ((1, 64, 0.5), (37, 80, 3.0), (256, 96, -2.0), (1000, 64, 6.0)):
        s = torch.randn(n, generator=gen) * 2
        v = torch.randn(n, D, generator=gen)
        _unified_compare(impl, s, v, phi, -30.0, 20.0, f"n={n}, D={D}, phi={phi:g}")


@check_case(UNIFIED, "the overflow flag: a logit above φ + w_hi, or below φ + w_lo; the window's edges are inside",
            points=2)
def _u_flag(impl, gen):
    s = torch.randn(40, generator=gen)
    v = torch.randn(40, 32, generator=gen)
    w_lo, w_hi, phi = -12.0, 8.0, 1.0
    for j, val, what in ((17, phi + w_hi + 0.5, "one logit 0.5 above phi + w_hi"),
                         (3, phi + w_lo - 0.5, "one logit 0.5 below phi + w_lo"),
                         (39, phi + w_hi, "one logit exactly at phi + w_hi (inside)"),
                         (0, phi + w_lo, "one logit exactly at phi + w_lo (inside)"),
                         (5, 1e4, "one logit of 1e4 (e^(s - phi) = inf in float32)")):
        t = s.clone()
        t[j] = val
        _unified_compare(impl, t, v, phi, w_lo, w_hi, what)


@check_case(UNIFIED, "masked keys (s = -inf) never raise the flag; no keys at all: Õ = 0, ℓ = 0, no flag")
def _u_masked(impl, gen):
    s = torch.randn(50, generator=gen)
    s[::3] = NEG_INF
    v = torch.randn(50, 48, generator=gen)
    _unified_compare(impl, s, v, 0.0, -20.0, 20.0, "every third key masked (-inf)")
    _unified_compare(impl, torch.full((9,), NEG_INF), torch.randn(9, 48, generator=gen), 0.0, -20.0, 20.0,
                     "every key masked")
    _unified_compare(impl, torch.empty(0), torch.empty(0, 48), 0.0, -20.0, 20.0, "no keys (n = 0)")


@check_case(UNIFIED, "float16 values, n = 4096: accumulated in float32 (fp16 accumulation fails here)")
def _u_fp16(impl, gen):
    s = torch.randn(4096, generator=gen) * 0.5 + 2.0
    v = torch.randn(4096, 64, generator=gen).to(torch.float16)
    _unified_compare(impl, s, v, 2.0, -20.0, 10.0, "n=4096, v float16", rtol=2e-5)


# ---------------------------------------------------------------------------------------------- bug zoo: NaN merge
def _two_parts(gen, N=9, H_q=4, D=64, spread=3.0):
    o_a, o_b = torch.randn(N, H_q, D, generator=gen), torch.randn(N, H_q, D, generator=gen)
    lse_a, lse_b = torch.randn(N, H_q, generator=gen) * spread, torch.randn(N, H_q, generator=gen) * spread
    return o_a, lse_a, o_b, lse_b


def _nan_case(impl, o_a, lse_a, o_b, lse_b, what):
    got = call(impl, {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b})
    o, lse = _as_out_lse(got, what, tuple(o_a.shape), tuple(lse_a.shape))
    ref_o, ref_lse = ref_merge(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))
    _compare(o, lse, ref_o, ref_lse, what)


@check_case(NAN, "finite lse: the merge of two partials vs float64", points=2)
def _n_finite(impl, gen):
    _nan_case(impl, *_two_parts(gen), "N=9, H_q=4, finite lse")


@check_case(NAN, "rows empty in one part (lse = -inf on one side): the other part's O and lse")
def _n_one_empty(impl, gen):
    o_a, lse_a, o_b, lse_b = _two_parts(gen)
    lse_a[::2] = NEG_INF          # even rows: part a empty
    o_a[::2] = 0
    lse_b[1::2, 1] = NEG_INF      # odd rows, head 1: part b empty (never both)
    o_b[1::2, 1] = 0
    _nan_case(impl, o_a, lse_a, o_b, lse_b, "some rows empty in one part")


@check_case(NAN, "rows empty in both parts (chunked prefill with no context): O = 0, lse = -inf, no NaN", points=2)
def _n_both_empty(impl, gen):
    o_a, lse_a, o_b, lse_b = _two_parts(gen, N=16)
    dead = torch.rand(16, 4, generator=gen) < 0.25
    dead[0, 0] = True
    for lse, o in ((lse_a, o_a), (lse_b, o_b)):
        lse[dead] = NEG_INF
        o[dead] = 0
    _nan_case(impl, o_a, lse_a, o_b, lse_b, f"{int(dead.sum())} of 64 rows empty in both parts")


@check_case(NAN, "large lse (±500 on both sides): nothing overflows")
def _n_large(impl, gen):
    o_a, lse_a, o_b, lse_b = _two_parts(gen)
    _nan_case(impl, o_a, lse_a + 500, o_b, lse_b + 500, "lse around +500")
    _nan_case(impl, o_a, lse_a - 500, o_b, lse_b - 500, "lse around -500")


# ---------------------------------------------------------------------------------------------- bug zoo: base 2
LOG2E = 1.0 / math.log(2.0)


def _base2_mistakes(o, lse2, ref_o, ref_lse) -> list:
    """[(why, (O, lse))]: what the known base mix-ups return on these partials (float64)."""
    ln2 = math.log(2.0)
    natural_on_base2 = ref_merge(o, lse2.double())                 # e^(lse2 - m): base 2 read as base e
    twice = ref_merge(o, lse2.double() * ln2 * ln2)                # converted to base e, then weighed with 2^x
    return [
        ("the lse you return is still in base 2: the natural-log lse is lse2 · ln 2", (ref_o, ref_lse * LOG2E)),
        ("the weights e^(lse2 − m) read base-2 values as natural logs: weigh with 2^(lse2 − m) (torch.exp2) and "
         "return (m + log2 Σ 2^(lse2 − m)) · ln 2, or convert first, lse = lse2 · ln 2, and use e^x throughout",
         natural_on_base2),
        ("lse2 was converted to base e (× ln 2) and then weighed with 2^x as well: convert once and use e^x, or "
         "keep base 2 and use 2^x", twice),
        ("converted with log2(e) = 1/ln 2 where base 2 → base e multiplies by ln 2", (ref_o, ref_lse * LOG2E ** 2)),
    ]


def _base2_case(impl, o, lse, what):
    lse2 = (lse.double() * LOG2E).float()          # what an exp2 kernel stores
    got = call(impl, {"o": o, "lse2": lse2})
    got_o, got_lse = _as_out_lse(got, what, tuple(o.shape[1:]), tuple(lse.shape[1:]))
    ref_o, ref_lse = ref_merge(o, lse2.double() / LOG2E)
    try:
        _compare(got_o, got_lse, ref_o, ref_lse, what, lse_atol=5e-5)
    except CheckFailure as e:
        mistakes = _base2_mistakes(o, lse2, ref_o, ref_lse)
        raise CheckFailure(with_likely_cause(str(e), (got_o, got_lse), mistakes)) from None


@check_case(BASE2, "S = 4 partials per row, lse given in base 2: O and the natural-log lse vs float64", points=2)
def _b_values(impl, gen):
    o, lse = _partials(gen, 4, 64, 6, spread=3.0)
    _base2_case(impl, o, lse, "S=4, N=6")


@check_case(BASE2, "one partial per row: O is O_1 and lse is lse_1 in base e (torch.logsumexp's)")
def _b_one(impl, gen):
    o, lse = _partials(gen, 1, 32, 5, spread=5.0)
    _base2_case(impl, o, lse, "S=1, N=5")


@check_case(BASE2, "empty partials and all-empty rows: weight 0; O = 0, lse = -inf")
def _b_empty(impl, gen):
    o, lse = _partials(gen, 3, 32, 8, empty=0.3)
    lse[:, 0] = NEG_INF
    o[:, 0] = 0
    _base2_case(impl, o, lse, "S=3, N=8, some empty")


# ---------------------------------------------------------------------------------------------- bug zoo: strides
def _strided_case(impl, o, lse, what):
    got = call(impl, {"o": o, "lse": lse})
    got_o, got_lse = _as_out_lse(got, what, tuple(o.shape[1:]), tuple(lse.shape[1:]))
    _compare(got_o, got_lse, *ref_merge(o, lse), what)


@check_case(STRIDED, "contiguous partials (S = 5, N = 7, D = 64) vs float64", points=2)
def _s_contiguous(impl, gen):
    _strided_case(impl, *_partials(gen, 5, 64, 7), "contiguous o and lse")


@check_case(STRIDED, "lse a transposed view (stored [N, S], as some kernels write it)", points=2)
def _s_lse_t(impl, gen):
    o, lse = _partials(gen, 5, 64, 7)
    lse_t = lse.t().contiguous().t()               # same values, strides (1, S)
    _strided_case(impl, o, lse_t, f"lse with strides {list(lse_t.stride())}")


@check_case(STRIDED, "o a slice of a padded buffer [S, N, D + 16] and lse a column block of [S, N + 3]")
def _s_slices(impl, gen):
    o, lse = _partials(gen, 4, 48, 6)
    big_o = torch.full((4, 6, 64), float("nan"))
    big_o[:, :, 8:56] = o
    big_l = torch.full((4, 9), float("nan"))
    big_l[:, 2:8] = lse
    _strided_case(impl, big_o[:, :, 8:56], big_l[:, 2:8], "o = buf[:, :, 8:56], lse = buf[:, 2:8]")


@check_case(STRIDED, "head-major partials (o stored [N, S, D] and permuted) with empty rows")
def _s_permuted(impl, gen):
    o, lse = _partials(gen, 3, 32, 5, empty=0.3)
    lse[:, 2] = NEG_INF
    o[:, 2] = 0
    _strided_case(impl, o.transpose(0, 1).contiguous().transpose(0, 1), lse.t().contiguous().t(),
                  "o [N, S, D] permuted to [S, N, D], lse transposed, empty rows")


# ---------------------------------------------------------------------------------------------- bug zoo: empty splits
def _empty_case(impl, gen, length, splits, block=16, L_max=None, D=64):
    L_max = L_max or max(length, 1)
    q = torch.randn(D, generator=gen)
    k, v = torch.randn(L_max, D, generator=gen), torch.randn(L_max, D, generator=gen)
    scale = D ** -0.5
    what = f"length {length}, {splits} splits of whole {block}-key tiles"
    got = call(impl, {"q": q, "k": k, "v": v, "length": length, "splits": splits, "block": block, "scale": scale})
    o, lse = _as_out_lse(got, what, (D,), ())
    if length == 0:
        ref_o, ref_lse = torch.zeros(D, dtype=torch.float64), torch.tensor(NEG_INF, dtype=torch.float64)
    else:
        s = (k[:length].double() @ q.double()) * scale
        ref_lse = torch.logsumexp(s, 0)
        ref_o = torch.softmax(s, 0) @ v[:length].double()
    tiles = -(-length // block)
    _compare(o, lse, ref_o, ref_lse, what + (f" ({tiles} tile(s): some splits are empty)" if splits > tiles else ""))


@check_case(EMPTY, "as many tiles as splits or more (no split is empty): vs float64", points=2)
def _e_full(impl, gen):
    for length, splits in ((64, 4), (100, 3), (16, 1), (250, 8)):
        _empty_case(impl, gen, length, splits, L_max=256)


@check_case(EMPTY, "more splits than tiles (lengths 33, 40, 17 with 4 and 8 splits): empty splits weigh 0", points=2)
def _e_more(impl, gen):
    for length, splits in ((33, 4), (40, 8), (17, 8), (1, 4)):
        _empty_case(impl, gen, length, splits, L_max=64)


@check_case(EMPTY, "length 0 (every split empty): O = 0, lse = -inf, no NaN")
def _e_zero(impl, gen):
    _empty_case(impl, gen, 0, 4, L_max=32)


# ---------------------------------------------------------------------------------------------- bug zoo: fp16 sums
def _accumulated_in(dtype, s, v, block):
    """(ℓ, Õ) of one split summed tile by tile into accumulators of ``dtype`` (what the shipped bug does)."""
    m = s.max() if len(s) else torch.tensor(NEG_INF)
    p_all = torch.exp(s - (m if torch.isfinite(m) else torch.zeros_like(m)))
    l, o = torch.zeros((), dtype=dtype), torch.zeros(v.shape[1], dtype=dtype)
    for lo in range(0, len(s), block):
        p = p_all[lo:lo + block]
        l = l + p.sum().to(dtype)
        o = o + (p @ v[lo:lo + block].float()).to(dtype)
    return l.float(), o.float()


def _accumulator_hint(got, which: int, s, v, block) -> str:
    """'. That is ... accumulated in float16 ...' when ``got`` (ℓ for which=0, Õ for 1) is what a 16-bit accumulator
    gives on these inputs, else ''."""
    for dtype in (torch.float16, torch.bfloat16):
        sim = _accumulated_in(dtype, s, v, block)[which]
        if torch.equal(torch.nan_to_num(got.reshape(sim.shape)), torch.nan_to_num(sim)):
            name = str(dtype).split(".")[1]
            what = "ℓ" if which == 0 else "Õ"
            return (f". That is exactly what summing {what} in {name} gives: the sum is accumulated in {name} and "
                    f"should be float32 (start {what} as a float32 zero and drop the .to({name}) cast on each add)")
    return ""


def _fp16_case(impl, s, v, block, what, rtol=2e-5):
    got = call(impl, {"s": s, "v": v, "block": block})
    m, l, o = expect_tuple(got, what, 3, "m, ℓ, Õ")
    for val, nm in ((m, "m"), (l, "ℓ")):
        expect_tensor(val, f"{what}: {nm}", dtype=(torch.float32,))
        if val.numel() != 1:
            raise CheckFailure(f"{what}: {nm}: expected one number, got shape {list(val.shape)}")
    o = expect_tensor(o, f"{what}: Õ", shape=(v.shape[1],), dtype=(torch.float32,))
    s64 = s.double()
    n = len(s64)
    ref_m = s64.max() if n else torch.tensor(NEG_INF, dtype=torch.float64)
    ref_r = ref_m if torch.isfinite(ref_m) else torch.zeros((), dtype=torch.float64)
    p = torch.exp(s64 - ref_r)
    ref_l, ref_o = p.sum(), (p @ v.double() if n else torch.zeros(v.shape[1], dtype=torch.float64))
    assert_close(m.reshape(()), ref_m, f"{what}: m", 0, 0)
    if bool(torch.isinf(l)) and not bool(torch.isinf(ref_l)):
        raise CheckFailure(f"{what}: ℓ overflowed to inf (the true ℓ is {float(ref_l):.6g}; float16 stops at 65504)"
                           + _accumulator_hint(l, 0, s, v, block))
    scale = max(float(ref_o.abs().max()) if n else 1.0, 1e-30)
    for got, ref, which, atol in ((l.reshape(()), ref_l, 0, 1e-30), (o, ref_o, 1, rtol * scale)):
        try:
            assert_close(got, ref, f"{what}: {'ℓ' if which == 0 else 'Õ'}", atol, rtol)
        except CheckFailure as e:
            raise CheckFailure(str(e) + _accumulator_hint(got, which, s, v, block)) from None


@check_case(FP16, "a split of 300 keys (normal logits), tiles of 32: m, ℓ, Õ vs float64", points=2)
def _f_values(impl, gen):
    s = torch.randn(300, generator=gen) * 1.5
    v = torch.randn(300, 64, generator=gen).to(torch.float16)
    _fp16_case(impl, s, v, 32, "n=300, block=32")


@check_case(FP16, "a long split: 70 000 keys with equal logits (ℓ = 70 000 > float16's 65 504)", points=2)
def _f_long(impl, gen):
    n = 70_000
    s = torch.full((n,), 1.25)
    v = torch.randn(n, 16, generator=gen).to(torch.float16)
    _fp16_case(impl, s, v, 64, f"n={n}, equal logits, block=64")


@check_case(FP16, "masked keys (-inf) and an empty split: (-inf, 0, 0)")
def _f_masked(impl, gen):
    s = torch.randn(90, generator=gen)
    s[10:40] = NEG_INF
    _fp16_case(impl, s, torch.randn(90, 32, generator=gen).to(torch.float16), 16, "n=90, 30 keys masked")
    _fp16_case(impl, torch.empty(0), torch.empty(0, 32, dtype=torch.float16), 16, "n=0")
