"""Numerical edge cases: huge logits, values near the fp16 maximum, tiny and tile-edge lengths, NaN isolation."""
from __future__ import annotations

import pytest
import torch

import fdlib
from helpers import (ALL_METHODS, BLOCK_N, DEVICE, DTYPES, TRITON_METHODS, assert_attention_close, counters_zero,
                     make_problem)

N = BLOCK_N
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # Triton interpreter noise


def kw(method, splits):
    return {} if method == "naive" else dict(num_splits=splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_huge_scores_stay_finite_and_exact(dtype, method):
    """scale·q·k of about +1e4 in sequence 0 and -1e4 in sequence 1 (e^±1e4 overflows every float type):
    the running max keeps every exponential <= 1, so out is finite and lse = ±1e4 + log(...) matches float64."""
    L, D = 3 * N + 5, 32
    q, k, v, lens = make_problem(2, L, 2, 1, D, dtype, seed=1, lens=[L, 2 * N + 1])
    q = torch.zeros_like(q)
    q[:, :, 0] = 100.0
    k = k.clone() * 0.01
    ramp = torch.linspace(99.0, 100.0, L).to(dtype).to(DEVICE)        # scores 9900 .. 10000, distinct weights
    k[0, :, 0, 0] = ramp
    k[1, :, 0, 0] = -ramp.flip(0)
    out, lse = fdlib.decode_attention(q, k, v, lens, scale=1.0, method=method, return_lse=True, **kw(method, 3))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse[0].min() > 9_000 and lse[1].max() < -9_000
    # A float32 score of 1e4 carries an absolute rounding error of ~1e-3 (one ulp), which moves each softmax
    # weight by ~1e-3 relative: the problem's own conditioning, shared by method="naive" (measured ~1e-4).
    # So out gets 1e-3 (not 1e-5) in float32, and lse ~1e4 a few ulps.
    OUT_TOL = {torch.float32: 1e-3, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
    assert_attention_close(out, lse, q, k, v, lens, scale=1.0, what=f"{method} huge", lse_atol=4e-3,
                           rtol=OUT_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_values_near_fp16_max_do_not_overflow(dtype, method):
    """V entries of ±6e4 (fp16 max is 65504). With equal weights a 16-key tile's Σ p·v reaches ~1e6 and the
    unnormalised state much more: this must stay in float32 (partials are float32) and only the final O,
    |O| <= 6e4, is rounded to the input dtype."""
    L, D = 4 * N + 3, 32
    q, k, v, lens = make_problem(2, L, 4, 2, D, dtype, seed=2, lens=[L, 2 * N + 1])
    q = torch.zeros_like(q)                                           # all scores 0: p = 1 for every key
    v = torch.full_like(v, 6.0e4)
    v[:, :, :, 1::2] = -6.0e4
    v[0, :3] = 5.0e4                                                  # a few different values so O is not trivial
    for splits in (1, 3):
        out, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True, **kw(method, splits))
        assert torch.isfinite(out).all(), f"{method}: overflow"
        assert out.abs().max() <= 65504
        assert_attention_close(out, lse, q, k, v, lens, what=f"{method} near-max V splits={splits}")
        if method == "naive":
            break


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_tiny_and_tile_edge_lengths(dtype, method):
    """Lengths 0 and 1, and one less / exactly / one more than a tile (BLOCK_N) and than two tiles."""
    lens = [0, 1, N - 1, N, N + 1, 2 * N - 1, 2 * N + 1]
    q, k, v, lens_t = make_problem(len(lens), 2 * N + 1, 4, 2, 32, dtype, seed=3, lens=lens)
    out, lse = fdlib.decode_attention(q, k, v, lens_t, method=method, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what=f"{method} {dtype}")
    # length 1: O is exactly that key's value (weight 1), lse = scale·q·k
    torch.testing.assert_close(out[1].float(), v[1, 0].repeat_interleave(2, dim=0).float(), rtol=0, atol=0)


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_one_sequence_stays_in_that_sequence(method, where):
    """Documented behaviour: a NaN inside sequence b's valid keys (K or V, position < L_b) makes out[b] NaN
    for every query head that reads that KV head (here: all of them, the NaN is in every KV head), and lse[b]
    NaN when the NaN is in K; every other sequence's output is bitwise what it would be without the NaN.
    A NaN at a position >= L_b (an unused cache slot) is never read and changes nothing."""
    L = 3 * N + 2
    q, k, v, lens = make_problem(3, L, 4, 2, 32, torch.float32, seed=4, lens=[L, 2 * N + 3, N - 2])
    clean_out, clean_lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True, **kw(method, 3))
    bad = (k if where == "k" else v).clone()
    bad[1, N + 4] = float("nan")                                      # inside sequence 1 (length 2N+3)
    bad[2, N + 1] = float("nan")                                      # past sequence 2's length (N-2)
    args = (q, bad, v) if where == "k" else (q, k, bad)
    out, lse = fdlib.decode_attention(*args, lens, method=method, return_lse=True, **kw(method, 3))
    assert torch.isnan(out[1]).all(), f"{method}: NaN in sequence 1's {where.upper()} must make out[1] NaN"
    if where == "k":
        assert torch.isnan(lse[1]).all()
    for b in (0, 2):
        assert torch.equal(out[b], clean_out[b]), f"{method}: sequence {b} changed"
        assert torch.equal(lse[b], clean_lse[b])
    assert counters_zero(), "NaNs must not disturb the ticket counters"
    # and the next call, without NaN, is right again
    out2, lse2 = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True, **kw(method, 3))
    assert torch.equal(out2, clean_out)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_large_scale_and_sharp_softmax_across_splits(method):
    """A softmax that is one-hot to float32 precision, with the winning key in the last split."""
    L = 5 * N
    q, k, v, lens = make_problem(1, L, 2, 1, 32, torch.float32, seed=5, lens=[L - 1])
    k = k.clone()
    k[0, L - 2] = q[0, 0] * 3.0                                        # the best key, last valid position
    out, lse = fdlib.decode_attention(q, k, v, lens, method=method, scale=50.0, return_lse=True, num_splits=5)
    assert_attention_close(out, lse, q, k, v, lens, scale=50.0, what="sharp", lse_atol=1e-3)
