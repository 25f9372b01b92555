r"""Checks for Lab 02: online softmax and the merge of partial states.

* ``lab02.online_softmax(q, k, v, block, scale) -> (m, ℓ, Õ)``: attention of one query ``q [D]`` over keys
  ``k [L, D]`` and values ``v [L, D]``, ``block`` keys at a time. m = max_j s_j, ℓ = Σ_j e^{s_j − m},
  Õ = Σ_j e^{s_j − m} v_j with s_j = scale·q·k_j; no keys (or only −inf scores) give (−inf, 0, 0).
* ``lab02.merge(a, b) -> (m, ℓ, Õ)``: the state of the union of two disjoint key sets; states hold m, ℓ ``[N]``
  and Õ ``[N, D]`` (one row per query).

A :class:`fdlib.online_softmax.State` is a named tuple, so either a State or a plain tuple is accepted.
"""
from __future__ import annotations

import torch

from fdlib.online_softmax import State, block_state

from .core import CheckFailure, assert_close, call, check_case, exercise_stub, expect_tensor, expect_tuple, randn

ONLINE = "lab02.online_softmax"
MERGE = "lab02.merge"

ONLINE_STUB = exercise_stub(ONLINE, '''
@exercise("lab02.online_softmax")
def online_softmax(q, k, v, block, scale):
    """Attention of one query q [D] over keys k [L, D] and values v [L, D], `block` keys at a time.

    Returns State(m, l, o_tilde) (or a tuple): m = max_j s_j, l = sum_j exp(s_j - m),
    o_tilde = sum_j exp(s_j - m) v_j with s_j = scale * q . k_j. No keys (or only -inf scores): (-inf, 0, 0).
    """
    todo("lab02.online_softmax")
''')

MERGE_STUB = exercise_stub(MERGE, '''
@exercise("lab02.merge")
def merge(a, b):
    """The state of the union of two disjoint key sets. a, b: State(m [N], l [N], o_tilde [N, D])."""
    todo("lab02.merge")
''')
FLOATS = (torch.float32, torch.float64)


def _as_state(x, what: str, m_shape, d: int) -> State:
    m, l, o = expect_tuple(x, what, 3, "m, ℓ, Õ")
    parts = []
    for val, nm in ((m, "m"), (l, "ℓ")):
        if isinstance(val, (int, float)):
            val = torch.tensor(float(val), dtype=torch.float64)
        val = expect_tensor(val, f"{what}: {nm}", dtype=FLOATS)
        if (val.numel() != 1) if len(m_shape) == 0 else (tuple(val.shape) != tuple(m_shape)):
            raise CheckFailure(f"{what}: {nm}: expected shape {list(m_shape)}, got {list(val.shape)}")
        parts.append(val.reshape(m_shape))
    o = expect_tensor(o, f"{what}: Õ", shape=(*m_shape, d), dtype=FLOATS)
    return State(parts[0], parts[1], o)


def _ref_state(q, k, v, scale) -> State:
    if k.shape[0] == 0:
        return State(torch.tensor(float("-inf"), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64),
                     torch.zeros(q.shape[-1], dtype=torch.float64))
    s = (k.double() @ q.double()) * scale
    return block_state(s, v.double())


def _compare(got: State, ref: State, what: str, tol: float = 2e-5) -> None:
    assert_close(got.m, ref.m, f"{what}: m", tol, tol)
    assert_close(got.l, ref.l, f"{what}: ℓ", tol, tol)
    assert_close(got.o_tilde, ref.o_tilde, f"{what}: Õ", tol, tol)


# ---------------------------------------------------------------------------------------------- online softmax
def _online(impl, gen, *, L, D, block, scale=None, spread=1.0, masked=(), tol=2e-5):
    masked = list(masked)
    q = randn(gen, D, scale=spread)
    if masked:
        q = q.abs() + 0.1          # positive q, so a key of -inf entries scores exactly -inf
    k = randn(gen, L, D, scale=spread)
    v = randn(gen, L, D)
    for j in masked:
        k[j] = float("-inf")
    sc = D ** -0.5 if scale is None else scale
    got = call(impl, {"q": q, "k": k, "v": v, "block": block, "scale": sc})
    state = _as_state(got, "return value", (), D)
    ref = _ref_state(q, k, v, sc)
    _compare(state, ref, "state", tol)
    if L and bool(torch.isfinite(ref.m)):
        o_ref = ref.o_tilde / ref.l
        assert_close(state.o_tilde / state.l, o_ref, "O = Õ/ℓ", tol, tol)


@check_case(ONLINE, "64 keys in blocks of 16, D=32", points=2)
def _os_basic(impl, gen):
    _online(impl, gen, L=64, D=32, block=16)


@check_case(ONLINE, "50 keys in blocks of 16 (last block partial)")
def _os_partial(impl, gen):
    _online(impl, gen, L=50, D=24, block=16)


@check_case(ONLINE, "block larger than L (5 keys, block 16) and a single key")
def _os_small(impl, gen):
    _online(impl, gen, L=5, D=8, block=16)
    _online(impl, gen, L=1, D=8, block=4)


@check_case(ONLINE, "the max grows block after block (every block must rescale by e^(m_old − m_new))", points=2)
def _os_growing(impl, gen):
    D, L, block = 16, 48, 8
    q = torch.ones(D) / D ** 0.5
    k = randn(gen, L, D) + torch.linspace(0, 6, L)[:, None]   # later keys score higher
    v = randn(gen, L, D)
    got = call(impl, {"q": q, "k": k, "v": v, "block": block, "scale": 1.0})
    _compare(_as_state(got, "return value", (), D), _ref_state(q, k, v, 1.0), "state")


@check_case(ONLINE, "huge logits (scores ~ 1e4): no overflow, no NaN")
def _os_huge(impl, gen):
    _online(impl, gen, L=40, D=16, block=8, scale=1.0, spread=30.0, tol=5e-3)


@check_case(ONLINE, "first block entirely −inf (masked): no NaN from −inf − (−inf)")
def _os_first_masked(impl, gen):
    _online(impl, gen, L=32, D=16, block=8, masked=range(0, 8))


@check_case(ONLINE, "a masked block in the middle and a masked last key")
def _os_mid_masked(impl, gen):
    _online(impl, gen, L=40, D=16, block=8, masked=[*range(16, 24), 39])


@check_case(ONLINE, "all keys −inf, and no keys at all: (m, ℓ, Õ) = (−inf, 0, 0)")
def _os_empty(impl, gen):
    _online(impl, gen, L=12, D=8, block=4, masked=range(12))
    _online(impl, gen, L=0, D=8, block=4)


# ---------------------------------------------------------------------------------------------- merge
def _states(gen, n, d, sizes, spread=1.0, masked_rows=()):
    """Random disjoint key blocks for n query rows; returns (list of float32 States, float64 state of all keys)."""
    s_all = [randn(gen, n, size, scale=spread).double() for size in sizes]
    v_all = [randn(gen, n, size, d).double() for size in sizes]
    for i, r in masked_rows:
        s_all[i][r] = float("-inf")
    parts = [block_state(s, v) for s, v in zip(s_all, v_all)]
    parts32 = [State(*(t.float() for t in p)) for p in parts]
    whole = block_state(torch.cat(s_all, dim=1), torch.cat(v_all, dim=1))
    return parts32, whole


def _merge(impl, a, b, d, what="merge(a, b)"):
    got = call(impl, {"a": a, "b": b})
    return _as_state(got, what, tuple(a.m.shape), d)


@check_case(MERGE, "two blocks of keys: merge(a, b) is the state of all keys", points=2)
def _mg_basic(impl, gen):
    (a, b), whole = _states(gen, 5, 16, [7, 12])
    _compare(_merge(impl, a, b, 16), whole, "merge(a, b)")


@check_case(MERGE, "very different maxima (scores ~ ±1e4): no overflow, no NaN")
def _mg_huge(impl, gen):
    (a, b), whole = _states(gen, 4, 8, [6, 6], spread=1e4)
    got = _merge(impl, a, b, 8)
    assert_close(got.m, whole.m, "merge(a, b): m", 1e-2, 1e-6)
    assert_close(got.o_tilde / got.l[:, None], whole.o_tilde / whole.l[:, None], "O = Õ/ℓ", 1e-4, 1e-4)
    assert_close(got.m + got.l.log(), whole.m + whole.l.log(), "lse = m + log ℓ", 1e-2, 1e-6)


@check_case(MERGE, "an empty state (m=−inf, ℓ=0, Õ=0) on either side changes nothing")
def _mg_empty_side(impl, gen):
    (a,), whole = _states(gen, 3, 8, [9])
    empty = State(torch.full((3,), float("-inf")), torch.zeros(3), torch.zeros(3, 8))
    _compare(_merge(impl, a, empty, 8), whole, "merge(a, empty)")
    _compare(_merge(impl, empty, a, 8, "merge(empty, a)"), whole, "merge(empty, a)")


@check_case(MERGE, "two empty states stay empty: (−inf, 0, 0), no NaN")
def _mg_both_empty(impl, gen):
    e = State(torch.full((2,), float("-inf")), torch.zeros(2), torch.zeros(2, 4))
    got = _merge(impl, e, State(*(t.clone() for t in e)), 4)
    _compare(got, State(*(t.double() for t in e)), "merge(empty, empty)")


@check_case(MERGE, "rows where one side is fully masked (−inf scores) and rows where both are")
def _mg_rows(impl, gen):
    (a, b), whole = _states(gen, 4, 8, [5, 5], masked_rows=[(0, 1), (1, 2), (0, 3), (1, 3)])
    _compare(_merge(impl, a, b, 8), whole, "merge(a, b)")


@check_case(MERGE, "commutative and associative: any order and grouping of 3 blocks gives the same state", points=2)
def _mg_assoc(impl, gen):
    (a, b, c), whole = _states(gen, 3, 8, [4, 9, 6])
    ab_c = _merge(impl, _merge(impl, a, b, 8), c, 8, "merge(merge(a, b), c)")
    a_bc = _merge(impl, a, _merge(impl, b, c, 8), 8, "merge(a, merge(b, c))")
    cb_a = _merge(impl, _merge(impl, c, b, 8), a, 8, "merge(merge(c, b), a)")
    for got, what in ((ab_c, "merge(merge(a, b), c)"), (a_bc, "merge(a, merge(b, c))"),
                      (cb_a, "merge(merge(c, b), a)")):
        _compare(got, whole, what)
