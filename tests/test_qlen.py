"""Several query tokens per sequence (speculative decoding): q [B, q_len, H_q, D], query t of sequence b sees keys
0 … L_b − q_len + t (the new tokens are already the cache's last q_len keys, causal among themselves: the
convention of flash_attn_with_kvcache). Every method, contiguous and paged caches, against float64."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import fdlib
from fdlib import api
from fdlib.kernels.persistent import run_persistent
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.kernels.unified import run_unified
from fdlib.plan import workspace_bytes
from helpers import (BLOCK_N, DEVICE, INTERPRET, LSE_ATOL, LSE_RTOL, OUT_RTOL, counters_zero, hyp_settings,
                     row_rel_err)
from test_paged import paged_problem

N = BLOCK_N
METHODS = ("naive", "split", "unified", "persistent", "balanced", "streamk", "auto")


def problem(B, q_len, H_q, H_kv, D, L_max, lens, dtype=torch.float32, seed=0):
    """q [B, q_len, H_q, D], K/V [B, L_max, H_kv, D] (values ~ N(0, 1)), lengths int32 on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, q_len, H_q, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, L_max, H_kv, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, L_max, H_kv, D, generator=g).to(dtype).to(DEVICE)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def assert_close_qlen(out, lse, q, k, v, lens, scale=None, what=""):
    """out [B, q_len, H_q, D] and lse [B, q_len, H_q] match the float64 reference row by row; rows that see no
    key (L_b < q_len − t) are exactly 0 with lse −inf; nothing is NaN."""
    ref_o, ref_l = fdlib.reference_attention(q, k, v, lens, scale)
    assert tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype, f"{what}: out {out.dtype} {tuple(out.shape)}"
    assert tuple(lse.shape) == tuple(q.shape[:-1]) and lse.dtype == torch.float32, f"{what}: lse {tuple(lse.shape)}"
    o, l = out.detach().cpu(), lse.detach().to("cpu", torch.float64)
    assert not torch.isnan(o).any() and not torch.isnan(l).any(), f"{what}: NaN"
    empty = torch.isneginf(ref_l)
    assert torch.equal(torch.isneginf(l), empty), f"{what}: lse is -inf exactly where a row sees no key"
    assert (o[empty] == 0).all(), f"{what}: rows that see no key must be exactly 0"
    err = row_rel_err(o, ref_o)
    assert err.max().item() <= OUT_RTOL[q.dtype], (
        f"{what}: out rel. err {err.max().item():.3e} at (b, t, h)="
        f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])}, lens={lens.tolist()}")
    fin = ~empty
    if fin.any():
        lerr = ((l[fin] - ref_l[fin]).abs() / (LSE_ATOL[q.dtype] + LSE_RTOL * ref_l[fin].abs())).max().item()
        assert lerr <= 1.0, f"{what}: lse error {lerr:.2f}x the tolerance, lens={lens.tolist()}"


def edge_lengths(q_len, L_max):
    """Lengths at the interesting places: empty, 1, shorter than q_len, q_len itself, tile boundaries, full."""
    xs = [0, 1, q_len - 1, q_len, q_len + 1, N - 1, N, N + 1, 2 * N - 1, 2 * N + 1, L_max - 1, L_max]
    return sorted({x for x in xs if 0 <= x <= L_max})


# ---------------------------------------------------------------------------------------------- the convention
def test_reference_convention_by_hand():
    """Query t sees exactly keys 0 … L − q_len + t: compare with one-token attention over that prefix."""
    q, k, v, lens = problem(2, 4, 6, 2, 16, 9, [9, 2], seed=3)
    out, lse = fdlib.reference_attention(q, k, v, lens)
    for b in range(2):
        for t in range(4):
            limit = int(lens[b]) - 4 + t + 1
            o1, l1 = fdlib.reference_attention(q[b:b + 1, t], k[b:b + 1], v[b:b + 1],
                                               torch.tensor([max(limit, 0)], dtype=torch.int32))
            torch.testing.assert_close(out[b, t], o1[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(lse[b, t], l1[0], rtol=0, atol=1e-12)
    assert torch.isneginf(lse[1, :2]).all() and (out[1, :2] == 0).all()     # L=2 < q_len − t for t = 0, 1
    assert torch.isfinite(lse[1, 2:]).all()


@pytest.mark.parametrize("method", METHODS)
def test_rows_that_see_no_key_are_zero_and_minus_inf(method):
    """L_b < q_len − t: out 0, lse −inf, never NaN, next to full rows, through every method."""
    q_len, L_max = 5, 3 * N + 2
    lens = [0, 1, 3, 4, 5, L_max]
    q, k, v, lens_t = problem(len(lens), q_len, 6, 2, 32, L_max, lens, seed=4)
    out, lse = fdlib.decode_attention(q, k, v, lens_t, method=method, return_lse=True)
    assert_close_qlen(out, lse, q, k, v, lens_t, what=method)
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :4]).all() and torch.isfinite(lse[1, 4]).all()
    assert counters_zero()


# ---------------------------------------------------------------------------------------------- properties
@given(q_len=st.sampled_from([1, 2, 3, 4, 5, 6, 16]), group=st.sampled_from([1, 2, 3, 4, 5, 7]),
       H_kv=st.integers(1, 2), D=st.sampled_from([16, 32, 80, 96]), B=st.integers(1, 3),
       extra=st.integers(0, 3 * N), dtype=st.sampled_from([torch.float32, torch.float32, torch.float16,
                                                           torch.bfloat16]),
       num_splits=st.sampled_from([None, None, 2, 3]), scale=st.sampled_from([None, 0.3]),
       seed=st.integers(0, 2**16), data=st.data())
@hyp_settings(14)
@pytest.mark.timeout(600)
def test_property_every_method_vs_float64(q_len, group, H_kv, D, B, extra, dtype, num_splits, scale, seed, data):
    L_max = q_len + extra
    lens = data.draw(st.lists(st.one_of(st.sampled_from(edge_lengths(q_len, L_max)), st.integers(0, L_max)),
                              min_size=B, max_size=B), label="lens")
    q, k, v, lens_t = problem(B, q_len, group * H_kv, H_kv, D, L_max, lens, dtype, seed)
    for method in METHODS:
        ns = num_splits if method in ("split", "unified") else None
        out, lse = fdlib.decode_attention(q, k, v, lens_t, method=method, num_splits=ns, scale=scale,
                                          return_lse=True)
        assert_close_qlen(out, lse, q, k, v, lens_t, scale, what=f"{method} splits={ns} q_len={q_len} "
                                                                 f"group={group} D={D} {dtype}")
    assert counters_zero()


@given(q_len=st.sampled_from([2, 3, 4, 6, 16]), page=st.sampled_from([1, 4, 16]), group=st.sampled_from([1, 3, 5]),
       D=st.sampled_from([32, 80]), B=st.integers(1, 3), seed=st.integers(0, 2**16), data=st.data())
@hyp_settings(8)
@pytest.mark.timeout(600)
def test_property_paged_caches_vs_float64(q_len, page, group, D, B, seed, data):
    max_pages = max(2, -(-(q_len + 2 * N) // page))
    L_max = max_pages * page
    edges = edge_lengths(q_len, L_max) + [page - 1, page, page + 1]
    lens = data.draw(st.lists(st.sampled_from([x for x in edges if 0 <= x <= L_max]), min_size=B, max_size=B),
                     label="lens")
    gen = torch.Generator().manual_seed(seed)
    H_kv = 2
    _, kp, vp, bt, k, v, lens_t = paged_problem(gen, B, group * H_kv, H_kv, D, page, max_pages, max_pages * B + 3,
                                                lens)
    q = torch.randn(B, q_len, group * H_kv, D, generator=gen).to(DEVICE)
    for method in METHODS:
        out, lse = fdlib.decode_attention(q, kp, vp, lens_t, block_table=bt, method=method, return_lse=True)
        assert_close_qlen(out, lse, q, k, v, lens_t, what=f"{method} page={page} q_len={q_len} lens={lens}")
    assert counters_zero()


# ---------------------------------------------------------------------------------------------- q_len = 1
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("paged", [False, True])
def test_one_token_4d_is_bitwise_the_3d_form(method, paged):
    """q [B, 1, H_q, D] runs the same kernels as [B, H_q, D]: out and lse bitwise equal (lse gains the q_len axis)."""
    lens = [0, 1, N, 2 * N + 3, 3 * N]
    gen = torch.Generator().manual_seed(5)
    q, kp, vp, bt, k, v, lens_t = paged_problem(gen, len(lens), 6, 2, 80, 16, 3 * N // 16, 3 * N // 16 * 5 + 1, lens)
    kw = dict(block_table=bt) if paged else {}
    kk, vv = (kp, vp) if paged else (k, v)
    o3, l3 = fdlib.decode_attention(q, kk, vv, lens_t, method=method, return_lse=True, **kw)
    o4, l4 = fdlib.decode_attention(q[:, None], kk, vv, lens_t, method=method, return_lse=True, **kw)
    assert o4.shape == (len(lens), 1, 6, 80) and l4.shape == (len(lens), 1, 6) and l3.shape == (len(lens), 6)
    assert torch.equal(o4[:, 0], o3) and torch.equal(l4[:, 0], l3)


# ---------------------------------------------------------------------------------------------- batch invariance
@pytest.mark.parametrize("q_len", [3, 16])
def test_batch_invariant_with_several_tokens(q_len):
    """batch_invariant=True with q_len > 1: each sequence's out and lse are bitwise the same alone, in any batch,
    at any place; and right."""
    n, L_max = 6, 5 * N
    lens = [0, 2, q_len, 2 * N + 1, 4 * N, L_max][:n]
    q, k, v, lens_t = problem(n, q_len, 6, 2, 80, L_max, lens, torch.float16, seed=6)
    run = lambda i: fdlib.decode_attention(q[i], k[i], v[i], lens_t[i], batch_invariant=True,  # noqa: E731
                                           return_lse=True)
    o_all, l_all = run(slice(None))
    assert_close_qlen(o_all, l_all, q, k, v, lens_t, what="batch-invariant q_len>1")
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        idx = torch.randperm(n, generator=g)[:int(torch.randint(1, n + 1, (1,), generator=g))]
        o, l = run(idx.to(DEVICE))
        for j, i in enumerate(idx.tolist()):
            assert torch.equal(o[j], o_all[i]) and torch.equal(l[j], l_all[i]), f"sequence {i} at {j} of {len(idx)}"


# ---------------------------------------------------------------------------------------------- plan / run
def test_plan_q_len_is_a_plan_parameter():
    q, k, v, lens = problem(3, 4, 6, 2, 32, 2 * N + 5, [2 * N + 5, 3, 0], seed=8)
    p = fdlib.plan(3, 6, 2, 32, 2 * N + 5, dtype=torch.float32, device=DEVICE, q_len=4, method="split",
                   num_splits=2)
    assert p.q_len == 4 and "q_len=4" in str(p)
    assert p.workspace.o_part.shape == (3, 4, 6, p.splits, 32) and p.workspace.lse.shape == (3, 4, 6)
    out, lse = p.run(q, k, v, lens, return_lse=True)
    assert_close_qlen(out, lse, q, k, v, lens, what="plan q_len=4")
    # a smaller batch, host lengths, caller's out and lse written in place
    o2, l2 = torch.empty_like(q[:2]), torch.empty(2, 4, 6, device=DEVICE)
    res = p.run(q[:2], k[:2], v[:2], [5, 2 * N + 5], out=o2, lse=l2)
    assert res[0] is o2 and res[1] is l2
    assert_close_qlen(o2, l2, q[:2], k[:2], v[:2], torch.tensor([5, 2 * N + 5], dtype=torch.int32), what="B'=2")
    with pytest.raises(ValueError, match=r"q: this plan was made for q_len=4 .*\[B, 4, 6, 32\].*got \[3, 3, 6, 32\]"):
        p.run(q[:, :3], k, v, lens)
    with pytest.raises(ValueError, match=r"q: this plan was made for q_len=4.*got \[3, 6, 32\].*q_len=\.\.\."):
        p.run(q[:, 0], k, v, lens)
    with pytest.raises(ValueError, match=r"lse: expected a float32 tensor of shape \[3, 4, 6\]"):
        p.run(q, k, v, lens, lse=torch.empty(3, 6, device=DEVICE))
    one = fdlib.plan(3, 6, 2, 32, 2 * N + 5, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match=r"q: this plan was made for q_len=1 .*got \[3, 4, 6, 32\]"):
        one.run(q, k, v, lens)


@pytest.mark.parametrize("bad,exc,msg", [
    (0, ValueError, r"q_len: expected 1 <= q_len <= 16 query tokens per sequence, got 0"),
    (17, ValueError, r"q_len: expected 1 <= q_len <= 16 query tokens per sequence, got 17"),
    (True, TypeError, r"q_len: expected an int, got bool"),
    ("4", TypeError, r"q_len: expected an int, got str"),
    (9, ValueError, r"q_len: the 9 new tokens must already be in the cache .* got q_len=9 > L_max=8"),
])
def test_plan_rejects_bad_q_len(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        fdlib.plan(1, 2, 1, 16, 8, dtype=torch.float32, device=DEVICE, q_len=bad)


def test_out_whose_rows_do_not_flatten_and_every_method_in_place():
    """A caller's out/lse with strides that do not let (q_len, H_q) flatten (stage 2 then merges into a buffer
    and copies) are still written in place, by every method."""
    q, k, v, lens = problem(2, 3, 4, 2, 32, 2 * N + 3, [2 * N + 3, 2], seed=9)
    for method in METHODS:
        out = torch.empty(2, 4, 3, 32, device=DEVICE).transpose(1, 2)         # [B, q_len, H_q, D], H_q-major
        lse = torch.empty(2, 4, 3, device=DEVICE).transpose(1, 2)
        p = fdlib.plan(2, 4, 2, 32, 2 * N + 3, dtype=torch.float32, device=DEVICE, q_len=3, method=method,
                       num_splits=2 if method in ("split", "unified") else None)
        res = p.run(q, k, v, lens, out=out, lse=lse)
        assert res[0] is out and res[1] is lse
        assert_close_qlen(out, lse, q, k, v, lens, what=f"{method}, non-flat out")


def test_decode_attention_keeps_a_plan_per_q_len():
    q, k, v, lens = problem(2, 4, 4, 2, 16, 20, [20, 3], seed=10)
    api.clear_plans()
    fdlib.decode_attention(q, k, v, lens)
    fdlib.decode_attention(q[:, :2], k, v, lens)
    fdlib.decode_attention(q[:, 0], k, v, lens)
    assert sorted(p.q_len for p in api._PLANS.values()) == [1, 2, 4]


def test_workspace_bytes_counts_the_query_rows():
    assert workspace_bytes(10, 8, 128, q_len=4) == 4 * workspace_bytes(10, 8, 128) == 4 * 10 * 8 * 129 * 4


def test_registered_op_fake_implementation_takes_4d_q():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v, lens = problem(2, 3, 4, 2, 16, 20, [20, 1], seed=11)
    with FakeTensorMode() as mode:
        fq, fk, fv, fl = (mode.from_tensor(t) for t in (q, k, v, lens))
        out, lse = torch.ops.fdlib.decode_attention(fq, fk, fv, fl, None, "auto", None, None)
    assert out.shape == q.shape and lse.shape == (2, 3, 4) and lse.dtype == torch.float32
    real_out, real_lse = torch.ops.fdlib.decode_attention(q, k, v, lens, None, "auto", None, None)
    assert_close_qlen(real_out, real_lse, q, k, v, lens, what="the registered op")


# ---------------------------------------------------------------------------------------------- kernel entry points
def test_kernel_entry_points_take_4d_q():
    """run_stage1 + run_stage2, run_unified and run_persistent (the labs' and tools' entry points) with q_len > 1."""
    from fdlib.kernels.config import chunk_for, tile_config
    q, k, v, lens = problem(2, 4, 6, 2, 32, 3 * N, [3 * N, 5], seed=12)
    scale, cfg = 32 ** -0.5, tile_config(32, 3 * N)
    chunk, splits = chunk_for(3 * N, 3, cfg.BLOCK_N)
    o_part, lse_part = run_stage1(q, k, v, lens, scale, chunk, splits, cfg)
    assert o_part.shape == (2, 4, 6, splits, 32) and lse_part.shape == (2, 4, 6, splits)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 6, device=DEVICE)
    run_stage2(o_part, lse_part, out, lse)
    assert_close_qlen(out, lse, q, k, v, lens, what="run_stage1 + run_stage2")
    out, lse = torch.empty_like(q), torch.empty(2, 4, 6, device=DEVICE)
    run_unified(q, k, v, lens, scale, chunk, splits, cfg, out, lse)
    assert_close_qlen(out, lse, q, k, v, lens, what="run_unified")
    out, lse = torch.empty_like(q), torch.empty(2, 4, 6, device=DEVICE)
    run_persistent(q, k, v, lens, scale, cfg, out, lse, programs=3)
    assert_close_qlen(out, lse, q, k, v, lens, what="run_persistent")
    assert counters_zero()


@pytest.mark.skipif(not INTERPRET, reason="tile sizes of the interpreter")
def test_tiles_count_the_query_rows():
    """On a GPU the tile shrinks as group × q_len grows (at most QROWS_TILE scores); one token is unchanged."""
    from fdlib.kernels.config import QROWS_TILE, block_sizes, tile_config_for
    base = tile_config_for(128, 1 << 20, compiled_mode=True)
    assert tile_config_for(128, 1 << 20, compiled_mode=True, q_rows=32) == base
    for rows in (64, 128, 256):
        cfg = tile_config_for(128, 1 << 20, compiled_mode=True, q_rows=rows)
        assert block_sizes(rows, 128)[0] * cfg.BLOCK_N <= QROWS_TILE and cfg.BLOCK_N >= 16
    assert tile_config_for(128, 1 << 20, compiled_mode=True, q_rows=256).num_warps == 8
    d = fdlib.plan(1, 32, 2, 128, 1 << 12, dtype=torch.float16, device=DEVICE, q_len=16).decision
    assert d.tile.BLOCK_N == 16    # the interpreter's tiles whatever the rows
