"""The Triton kernels (methods "split", "unified", "auto") against the float64 reference.

On a machine without a GPU these run in Triton's interpreter, where BLOCK_N = 16; the tile-boundary
lengths below are written in units of BLOCK_N so that the same tests probe the same edges when compiled.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import fdlib
from fdlib.kernels import unified
from helpers import (BLOCK_N, DEVICE, DTYPES, OUT_RTOL, TRITON_METHODS, assert_attention_close, counters_zero,
                     hyp_settings, make_problem, row_rel_err, run_device_lengths)

N = BLOCK_N
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # Triton interpreter noise
TILE_EDGE_LENGTHS = [0, 1, N - 1, N, N + 1, 2 * N - 1, 2 * N + 1]       # 0 1 15 16 17 31 33 in the interpreter


def call(q, k, v, lens, method, **kw):
    out, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True, **kw)
    assert counters_zero(), f"{method}: ticket counters not reset"
    assert tuple(lse.shape) == tuple(q.shape[:-1]), (tuple(lse.shape), tuple(q.shape))
    return out, (lse[:, 0] if q.dim() == 4 else lse)   # the helpers compare one token's lse [B, H_q]


@pytest.mark.parametrize("method", TRITON_METHODS)
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3])
def test_tile_edge_lengths(method, num_splits):
    B = len(TILE_EDGE_LENGTHS)
    q, k, v, lens = make_problem(B, 2 * N + 1, 4, 2, 32, torch.float32, seed=1, lens=TILE_EDGE_LENGTHS)
    out, lse = call(q, k, v, lens, method, num_splits=num_splits)
    assert_attention_close(out, lse, q, k, v, lens, what=f"{method} splits={num_splits}")


@pytest.mark.parametrize("method", ["split", "unified"])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 4, 5, 6, 7, 8])
def test_forced_num_splits(method, num_splits):
    """Every split count from 1 to 8, ragged lengths; 8 splits is more than the shortest sequence's tiles."""
    q, k, v, lens = make_problem(3, 5 * N + 3, 6, 2, 32, torch.float32, seed=num_splits or 0,
                                 lens=[5 * N + 3, 2 * N + 5, 3])
    out, lse = call(q, k, v, lens, method, num_splits=num_splits)
    assert_attention_close(out, lse, q, k, v, lens, what=f"{method} splits={num_splits}")


@pytest.mark.parametrize("method", ["split", "unified"])
def test_more_splits_than_tiles(method):
    q, k, v, lens = make_problem(2, 2 * N, 2, 1, 32, torch.float32, seed=4, lens=[2 * N, N + 2])
    out, lse = call(q, k, v, lens, method, num_splits=256)
    assert_attention_close(out, lse, q, k, v, lens, what=method)


@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("method", ["split", "unified"])
def test_group_sizes(group, method):
    H_kv = 2 if group < 7 else 1
    q, k, v, lens = make_problem(2, 3 * N + 2, group * H_kv, H_kv, 32, torch.float32, seed=group,
                                 lens=[3 * N + 2, N - 3])
    out, lse = call(q, k, v, lens, method, num_splits=3)
    assert_attention_close(out, lse, q, k, v, lens, what=f"group={group}")


@pytest.mark.parametrize("D", [32, 64, 80, 96, 128])
@pytest.mark.parametrize("method", ["split", "unified"])
def test_head_dims(D, method):
    q, k, v, lens = make_problem(2, 2 * N + 3, 4, 2, D, torch.float32, seed=D, lens=[2 * N + 3, N])
    out, lse = call(q, k, v, lens, method, num_splits=2)
    assert_attention_close(out, lse, q, k, v, lens, what=f"D={D}")


@pytest.mark.parametrize("layout", ["slice", "permuted"])
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_non_contiguous_caches(layout, method):
    q, k, v, lens = make_problem(2, 2 * N + 5, 4, 2, 32, torch.float32, seed=7, lens=[2 * N + 5, 9],
                                 layout=layout)
    assert not k.is_contiguous() and not v.is_contiguous()
    out, lse = call(q, k, v, lens, method, num_splits=2)
    assert_attention_close(out, lse, q, k, v, lens, what=f"{layout}")
    ref = fdlib.decode_attention(q, k.contiguous(), v.contiguous(), lens, method=method, num_splits=2)
    assert torch.equal(out, ref), "the memory layout must not change the result"


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_non_contiguous_q_and_lengths(method):
    """q a slice of a wider buffer (strided heads), cache_seqlens a strided view, int64 lengths."""
    q_big, k, v, _ = make_problem(2, 40, 8, 2, 32, torch.float32, seed=8)
    q = q_big[:, ::2]
    lens_big = torch.tensor([33, -5, 6, 99], dtype=torch.int64, device=DEVICE)
    lens = lens_big[::2]
    out, lse = call(q, k, v, lens, method)
    assert_attention_close(out, lse, q, k, v, lens, what="strided q/lens")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_dtypes_and_agreement_with_naive(dtype, method):
    q, k, v, lens = make_problem(3, 4 * N + 7, 8, 2, 64, dtype, seed=11, lens=[4 * N + 7, 0, 2 * N + 1])
    out, lse = call(q, k, v, lens, method)
    err = assert_attention_close(out, lse, q, k, v, lens, what=f"{method} {dtype}")
    naive = fdlib.decode_attention(q, k, v, lens, method="naive")
    naive_err = row_rel_err(naive, fdlib.reference_attention(q, k, v, lens)[0]).max().item()
    # within a few roundings of the naive method's own error
    assert err <= max(4 * naive_err, OUT_RTOL[dtype] / 4), (err, naive_err)


@pytest.mark.parametrize("method", TRITON_METHODS)
@pytest.mark.parametrize("return_lse", [True, False])
def test_4d_q_custom_scale_return_lse(method, return_lse):
    q, k, v, lens = make_problem(2, 2 * N + 1, 4, 1, 32, torch.float32, seed=12, lens=[2 * N + 1, 5])
    q4 = q[:, None]
    res = fdlib.decode_attention(q4, k, v, lens, method=method, scale=0.37, return_lse=return_lse)
    if return_lse:
        out, lse = res
        assert tuple(lse.shape) == (2, 1, 4)     # lse is q.shape[:-1]: [B, q_len, H_q] for a 4-D q
        lse = lse[:, 0]
    else:
        assert isinstance(res, torch.Tensor)
        out, lse = res, None
    assert tuple(out.shape) == (2, 1, 4, 32)
    assert_attention_close(out, lse, q4, k, v, lens, scale=0.37, what="4-D q")


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_default_lengths_and_lengths_shorter_than_planned(method):
    q, k, v, _ = make_problem(2, 2 * N + 3, 4, 2, 32, torch.float32, seed=13)
    full = torch.full((2,), 2 * N + 3, dtype=torch.int32, device=DEVICE)
    out, lse = call(q, k, v, None, method)
    assert_attention_close(out, lse, q, k, v, full, what="default lengths")
    lens = torch.tensor([N + 1, 3], dtype=torch.int32, device=DEVICE)
    out2, lse2 = call(q, k, v, lens, method)
    assert_attention_close(out2, lse2, q, k, v, lens, what="lengths shorter than the capacity")
    out3, lse3 = call(q, k, v, lens, method, max_seqlen=N)     # rows longer than the plan's bound: still covered
    assert_attention_close(out3, lse3, q, k, v, lens, what="lengths beyond max_seqlen")


def test_methods_agree():
    q, k, v, lens = make_problem(3, 5 * N, 8, 2, 64, torch.float32, seed=14, lens=[5 * N, 3 * N + 1, 1])
    outs = {m: fdlib.decode_attention(q, k, v, lens, method=m, return_lse=True) for m in TRITON_METHODS + ("naive",)}
    for m in ("unified", "auto", "naive"):
        torch.testing.assert_close(outs[m][0], outs["split"][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(outs[m][1], outs["split"][1], rtol=2e-6, atol=2e-6)
    # same split count: split and unified do the same arithmetic
    a = fdlib.decode_attention(q, k, v, lens, method="split", num_splits=3)
    b = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=3)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- unified kernel specifics

def test_unified_back_to_back_changing_lengths():
    q, k, v, _ = make_problem(2, 6 * N, 4, 2, 32, torch.float32, seed=15)
    for i, lens in enumerate([[6 * N, 6 * N], [1, 5 * N + 3], [0, 0], [2 * N + 1, N - 1], [6 * N, 0], [3, 4]]):
        lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        for splits in (None, 4):
            out, lse = call(q, k, v, lens, "unified", num_splits=splits)
            assert_attention_close(out, lse, q, k, v, lens, what=f"call {i} splits={splits}")
    assert all(int(b.count_nonzero()) == 0 for b in unified._COUNTERS.values())


def test_unified_short_sequence_beside_long_one():
    q, k, v, lens = make_problem(3, 12 * N, 4, 1, 32, torch.float32, seed=16, lens=[12 * N, 2, N + 1])
    for splits in (None, 8, 12):
        out, lse = call(q, k, v, lens, "unified", num_splits=splits)
        assert_attention_close(out, lse, q, k, v, lens, what=f"splits={splits}")


def test_unified_recovers_from_length_beyond_capacity():
    """A device length beyond the cache is clamped on the device; it must not leave a ticket counter stuck."""
    q, k, v, _ = make_problem(2, 4 * N, 2, 1, 32, torch.float32, seed=17)
    bad = torch.tensor([4 * N + 50, 3], dtype=torch.int32, device=DEVICE)
    p = fdlib.api.plan_for(q, k, v, bad, method="unified", num_splits=4, return_lse=True)
    out, lse = run_device_lengths(p, q, k, v, bad, return_lse=True)   # on the CPU run would check them
    assert counters_zero(), "unified: ticket counters not reset"
    assert_attention_close(out, lse, q, k, v, bad.clamp(max=4 * N), what="clamped to L_max")
    assert counters_zero()
    lens = torch.tensor([4 * N, 2 * N], dtype=torch.int32, device=DEVICE)
    out, lse = call(q, k, v, lens, "unified", num_splits=4)
    assert_attention_close(out, lse, q, k, v, lens, what="after a bad call")


# ---------------------------------------------------------------- property tests

def _problem_strategy(max_L):
    return st.fixed_dictionaries(dict(
        B=st.integers(1, 3),
        L=st.integers(1, max_L),
        H_kv=st.integers(1, 2),
        group=st.sampled_from([1, 3, 4, 7, 8]),
        D=st.sampled_from([32, 32, 64, 80, 96, 128]),
        dtype=st.sampled_from(DTYPES),
        layout=st.sampled_from(["contiguous", "slice", "permuted"]),
        num_splits=st.one_of(st.none(), st.integers(1, 8)),
        q4d=st.booleans(),
        scale=st.one_of(st.none(), st.floats(-2.0, 2.0)),
        seed=st.integers(0, 2**20),
    ))


@given(p=_problem_strategy(6 * BLOCK_N), data=st.data())
@hyp_settings(25)
@pytest.mark.timeout(240)
def test_property_split_and_unified_vs_float64(p, data):
    lens = data.draw(st.lists(st.one_of(st.integers(0, p["L"]), st.sampled_from([0, 1, p["L"]]),
                                        st.sampled_from([N - 1, N, N + 1, 2 * N - 1, 2 * N + 1]).map(
                                            lambda x: min(x, p["L"]))),
                              min_size=p["B"], max_size=p["B"]), label="lens")
    q, k, v, lens_t = make_problem(p["B"], p["L"], p["group"] * p["H_kv"], p["H_kv"], p["D"], p["dtype"],
                                   seed=p["seed"], lens=lens, layout=p["layout"])
    if p["q4d"]:
        q = q[:, None]
    results = {}
    for method in ("split", "unified"):
        out, lse = call(q, k, v, lens_t, method, num_splits=p["num_splits"], scale=p["scale"])
        assert_attention_close(out, lse, q, k, v, lens_t, scale=p["scale"], what=f"{method} {p}")
        results[method] = out
    # both kernels do the same float32 arithmetic for the same split count
    torch.testing.assert_close(results["split"].float(), results["unified"].float(),
                               rtol=OUT_RTOL[p["dtype"]], atol=OUT_RTOL[p["dtype"]] * v.abs().max().item())


@given(B=st.integers(1, 3), L=st.integers(1, 8 * BLOCK_N), group=st.sampled_from([1, 4, 8]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**20), data=st.data())
@hyp_settings(20)
@pytest.mark.timeout(240)
def test_property_auto(B, L, group, dtype, seed, data):
    lens = data.draw(st.lists(st.integers(0, L), min_size=B, max_size=B), label="lens")
    q, k, v, lens_t = make_problem(B, L, 2 * group, 2, 32, dtype, seed=seed, lens=lens)
    out, lse = call(q, k, v, lens_t, "auto")
    assert_attention_close(out, lse, q, k, v, lens_t, what="auto")
