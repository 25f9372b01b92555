"""fdlib.online_softmax: blockwise attention equals the full softmax; merge is associative and commutative."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, strategies as st

from fdlib.online_softmax import block_state, blockwise_attention, empty_state, merge, merge_lse
from helpers import hyp_settings

F64 = torch.float64


def full_softmax(q, k, v, scale, length=None):
    """(O, lse) of softmax(scale q kᵀ) v over the first ``length`` keys, float64."""
    L = k.shape[-2] if length is None else length
    s = (q[..., None, :] @ k[..., :L, :].transpose(-1, -2))[..., 0, :] * scale
    if L == 0:
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=F64), torch.full(q.shape[:-1], float("-inf"), dtype=F64)
    return torch.softmax(s, -1)[..., None, :].matmul(v[..., :L, :])[..., 0, :], torch.logsumexp(s, -1)


def data(seed, L=37, D=8, lead=(3,), dtype=F64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, D, generator=g, dtype=dtype) * scale
    k = torch.randn(*lead, L, D, generator=g, dtype=dtype)
    v = torch.randn(*lead, L, D, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8, 16, 36, 37, 38, 100])
@pytest.mark.parametrize("length", [None, 0, 1, 17, 36])
def test_blockwise_equals_full_softmax(block, length):
    q, k, v = data(block)
    st_ = blockwise_attention(q, k, v, block, 0.4, length)
    o, lse = full_softmax(q, k, v, 0.4, length)
    torch.testing.assert_close(st_.output(), o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st_.lse(), lse, rtol=1e-12, atol=1e-12)


def test_blockwise_float32_inputs():
    q, k, v = data(1, dtype=torch.float32)
    st_ = blockwise_attention(q, k, v, 7, 0.5)
    o, lse = full_softmax(q.double(), k.double(), v.double(), 0.5)
    assert st_.m.dtype == torch.float32
    torch.testing.assert_close(st_.output().double(), o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st_.lse().double(), lse, rtol=1e-6, atol=1e-6)


def states_of_partition(q, k, v, scale, cuts, length):
    """Block states for key ranges [cuts[i], cuts[i+1]); keys >= length masked with -inf (can empty a block)."""
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        s = (q[..., None, :] @ k[..., a:b, :].transpose(-1, -2))[..., 0, :] * scale
        pos = torch.arange(a, b)
        s = s.masked_fill(pos >= length, float("-inf"))
        out.append(block_state(s, v[..., a:b, :]))
    return out


def merge_in_random_tree(states, rnd):
    """Merge a list of states by repeatedly merging two random (not necessarily adjacent) ones, in random order."""
    pool = list(states)
    while len(pool) > 1:
        i, j = rnd.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        merged = merge(a, b) if rnd.random() < 0.5 else merge(b, a)
        pool = [s for n, s in enumerate(pool) if n not in (i, j)] + [merged]
    return pool[0]


@given(L=st.integers(1, 40), n_cuts=st.integers(0, 8), length_frac=st.floats(0, 1), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.1, 1.0, 50.0, 3000.0]))
@hyp_settings(60)
@pytest.mark.timeout(120)
def test_merge_associative_commutative(L, n_cuts, length_frac, seed, scale):
    rnd = random.Random(seed)
    q, k, v = data(seed, L=L, lead=(2,))
    length = int(round(length_frac * L))
    cuts = sorted({0, L, *(rnd.randint(0, L) for _ in range(n_cuts))})
    states = states_of_partition(q, k, v, scale, cuts, length)
    states += [empty_state((2,), 8, dtype=F64)] * rnd.randint(0, 2)    # explicit empty blocks (-inf, 0, 0)
    rnd.shuffle(states)
    exp_o, exp_l = full_softmax(q, k, v, scale, length)
    for _ in range(3):
        got = merge_in_random_tree(states, rnd)
        assert torch.isfinite(got.output()).all()
        torch.testing.assert_close(got.output(), exp_o, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got.lse(), exp_l, rtol=1e-9, atol=1e-9)


def test_merge_commutes_and_associates_exactly_on_structure():
    q, k, v = data(5, L=30, lead=(4,))
    a, b, c = states_of_partition(q, k, v, 1.0, [0, 10, 20, 30], 30)
    for x, y in [(merge(a, b), merge(b, a)), (merge(merge(a, b), c), merge(a, merge(b, c)))]:
        torch.testing.assert_close(x.output(), y.output(), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(x.lse(), y.lse(), rtol=1e-13, atol=1e-13)


def test_empty_state_is_identity_and_empty_merge_stays_empty():
    q, k, v = data(6, L=9)
    (s,) = states_of_partition(q, k, v, 1.0, [0, 9], 9)
    e = empty_state((3,), 8, dtype=F64)
    for m in (merge(s, e), merge(e, s)):
        torch.testing.assert_close(m.output(), s.output(), rtol=0, atol=0)
        torch.testing.assert_close(m.lse(), s.lse(), rtol=0, atol=0)
    ee = merge(e, e)
    assert not torch.isnan(ee.output()).any() and (ee.output() == 0).all() and torch.isneginf(ee.lse()).all()
    # a block whose every key is masked is the empty state too
    (masked,) = states_of_partition(q, k, v, 1.0, [0, 9], 0)
    assert torch.isneginf(masked.m).all() and (masked.l == 0).all() and (masked.o_tilde == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_logits_stay_finite(dtype, sign):
    """Scores of about ±1e4 (exp would overflow float32/float64 without the running max)."""
    L = 24
    q = torch.zeros(2, 4, dtype=dtype)
    q[:, 0] = 100.0
    k = torch.zeros(2, L, 4, dtype=dtype)
    k[..., 0] = sign * torch.linspace(90, 100, L, dtype=dtype)            # s in [±9000, ±1e4]
    v = torch.randn(2, L, 4, dtype=dtype, generator=torch.Generator().manual_seed(0))
    exp_o, exp_l = full_softmax(q.double(), k.double(), v.double(), 1.0)
    for block in (1, 5, 16, 24):
        st_ = blockwise_attention(q, k, v, block, 1.0)
        assert torch.isfinite(st_.output()).all() and torch.isfinite(st_.lse()).all()
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(st_.output().double(), exp_o, rtol=tol, atol=tol)
        torch.testing.assert_close(st_.lse().double(), exp_l, rtol=tol, atol=tol)


@given(L=st.integers(1, 50), n_cuts=st.integers(0, 7), seed=st.integers(0, 2**16), length_frac=st.floats(0, 1))
@hyp_settings(50)
@pytest.mark.timeout(120)
def test_merge_lse_equals_concatenated_softmax(L, n_cuts, seed, length_frac):
    rnd = random.Random(seed)
    q, k, v = data(seed, L=L, lead=(3,))
    length = int(round(length_frac * L))
    cuts = sorted({0, L, *(rnd.randint(0, L) for _ in range(n_cuts))})
    states = states_of_partition(q, k, v, 0.7, cuts, length)
    order = list(range(len(states)))
    rnd.shuffle(order)                                        # order of the partials must not matter
    o = torch.stack([states[i].output() for i in order], dim=1)     # [3, S, D]
    lse = torch.stack([states[i].lse() for i in order], dim=1)      # [3, S]
    got_o, got_l = merge_lse(o, lse, dim=1)
    exp_o, exp_l = full_softmax(q, k, v, 0.7, length)
    torch.testing.assert_close(got_o, exp_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_l, exp_l, rtol=1e-10, atol=1e-10)


def test_merge_lse_all_empty_and_huge():
    o = torch.randn(2, 4, 3, dtype=F64)
    lse = torch.full((2, 4), float("-inf"), dtype=F64)
    got_o, got_l = merge_lse(o, lse, dim=1)
    assert (got_o == 0).all() and torch.isneginf(got_l).all()
    lse = torch.tensor([[1e4, 1e4 - 1.0, float("-inf"), -1e4]], dtype=F64)
    o = torch.randn(1, 4, 3, dtype=F64)
    got_o, got_l = merge_lse(o, lse, dim=1)
    w = torch.softmax(lse, -1)
    torch.testing.assert_close(got_o, (w[..., None] * o).sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_l, torch.logsumexp(lse, -1), rtol=1e-12, atol=1e-12)
    # merge_lse along dim 0 (default)
    o0, l0 = merge_lse(o[0], lse[0])
    torch.testing.assert_close(o0, got_o[0], rtol=1e-12, atol=1e-12)
