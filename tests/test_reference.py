"""The float64 reference and method="naive" against the attention formula written as a plain loop."""
from __future__ import annotations

import math

import pytest
import torch

import fdlib
from fdlib.reference import naive_attention
from helpers import DEVICE, DTYPES, OUT_RTOL, make_problem, row_rel_err


def loop_attention(q, k, v, lens, scale):
    """O[b,h] = sum_j softmax_j(scale q·k_j) v_j over j < L_b, one (b, h) at a time, in float64."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    B, H_q, D = q.shape
    H_kv = k.shape[2]
    group = H_q // H_kv
    out = torch.zeros(B, H_q, D, dtype=torch.float64)
    lse = torch.full((B, H_q), float("-inf"), dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        for h in range(H_q):
            if L == 0:
                continue
            kk, vv = k[b, :L, h // group], v[b, :L, h // group]
            s = [scale * float(q[b, h] @ kk[j]) for j in range(L)]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            tot = sum(w)
            out[b, h] = sum(wj * vv[j] for j, wj in enumerate(w)) / tot
            lse[b, h] = m + math.log(tot)
    return out, lse


@pytest.mark.parametrize("B,L,H_q,H_kv,D,lens,scale", [
    (1, 5, 1, 1, 8, [5], None),
    (2, 9, 4, 2, 16, [9, 3], 0.3),
    (3, 7, 6, 2, 8, [0, 1, 7], None),
    (2, 12, 8, 1, 4, [12, 11], -1.7),
])
def test_reference_equals_loop(B, L, H_q, H_kv, D, lens, scale):
    q, k, v, lens_t = make_problem(B, L, H_q, H_kv, D, torch.float32, seed=L, lens=lens)
    exp_o, exp_l = loop_attention(q, k, v, lens, 1 / math.sqrt(D) if scale is None else scale)
    o, l = fdlib.reference_attention(q, k, v, lens_t, scale)
    assert o.dtype == torch.float64 and l.dtype == torch.float64
    torch.testing.assert_close(o, exp_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l, exp_l, rtol=1e-12, atol=1e-12)


def test_reference_default_lengths_are_full():
    q, k, v, _ = make_problem(2, 10, 2, 2, 8, torch.float32, seed=1)
    exp_o, exp_l = loop_attention(q, k, v, [10, 10], 1 / math.sqrt(8))
    o, l = fdlib.reference_attention(q, k, v)
    torch.testing.assert_close(o, exp_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l, exp_l, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_naive_vs_reference(dtype, group):
    lens = [0, 1, 37]
    q, k, v, lens_t = make_problem(3, 40, 2 * group, 2, 32, dtype, seed=group, lens=lens)
    out, lse = fdlib.decode_attention(q, k, v, lens_t, method="naive", return_lse=True)
    ref_o, ref_l = fdlib.reference_attention(q, k, v, lens_t)
    assert out.dtype == dtype and out.shape == q.shape
    assert row_rel_err(out, ref_o).max() <= OUT_RTOL[dtype]
    fin = torch.isfinite(ref_l)
    assert torch.isneginf(lse.cpu()[~fin]).all()
    torch.testing.assert_close(lse.cpu().double()[fin], ref_l[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", ["reference", "naive"])
def test_length_zero_gives_zeros_and_neg_inf(fn):
    q, k, v, lens = make_problem(3, 6, 4, 2, 8, torch.float32, seed=2, lens=[0, 0, 0])
    if fn == "reference":
        o, l = fdlib.reference_attention(q, k, v, lens)
    else:
        o, l = naive_attention(q, k, v, lens, 0.5)
    assert not torch.isnan(o).any() and not torch.isnan(l).any()
    assert (o == 0).all() and torch.isneginf(l).all()


def test_empty_cache_l_max_zero():
    q = torch.randn(2, 2, 8, device=DEVICE)
    k = torch.zeros(2, 0, 1, 8, device=DEVICE)
    o, l = fdlib.reference_attention(q, k, k)
    assert (o == 0).all() and torch.isneginf(l).all()
    out, lse = fdlib.decode_attention(q, k, k, method="naive", return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("fn", ["reference", "naive"])
def test_garbage_past_length_is_ignored(fn):
    """Unused cache slots (past each length) may hold anything, e.g. NaN/inf from torch.empty."""
    q, k, v, lens = make_problem(2, 12, 2, 1, 8, torch.float32, seed=3, lens=[5, 12])
    k2, v2 = k.clone(), v.clone()
    k2[0, 5:] = float("nan")
    v2[0, 5:] = float("inf")
    if fn == "reference":
        exp, got = fdlib.reference_attention(q, k, v, lens)[0], fdlib.reference_attention(q, k2, v2, lens)[0]
    else:
        exp = fdlib.decode_attention(q, k, v, lens, method="naive")
        got = fdlib.decode_attention(q, k2, v2, lens, method="naive")
    assert torch.equal(exp, got)
