"""8-bit KV caches (fdlib.quant): float8_e4m3fn and int8 caches with scales per tensor, per KV head and per token,
through every method, contiguous and paged, one query token and several, against float64 attention over the
DEQUANTIZED cache (stored · scale, exact in float64) at the fp16/bf16 kernels' tolerances; quantize_kv's round
trip and error bound; the checks on the scales; the cost model's bytes."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import fdlib
from fdlib import costmodel, quant
from fdlib.exact import unified_max_attention
from helpers import BLOCK_N, DEVICE, counters_zero, hyp_settings
from test_qlen import assert_close_qlen

N = BLOCK_N
KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
GRANS = quant.GRANULARITIES
METHODS = ("auto", "naive", "split", "unified", "persistent", "balanced", "streamk")


def kv8_problem(seed, B, q_len, H_q, H_kv, D, L_max, lens, kv_dtype, k_gran, v_gran, page=0, q_dtype=torch.float16,
                outliers=False):
    """(q, stored K/V, their scales, float64 K/V [B, L_max, H_kv, D] the cache stands for, lengths, block table).
    ``page`` > 0: a page pool quantized as it is stored (per-token scales [n_pages, page, H_kv]), pages shuffled,
    entries past each length -1 (never read); its dequantized pages gathered into the contiguous float64 cache."""
    g = torch.Generator().manual_seed(seed)
    shape_q = (B, q_len, H_q, D) if q_len > 1 else (B, H_q, D)
    q = torch.randn(shape_q, generator=g).to(q_dtype)
    if page:
        max_pages = L_max // page
        n_pages = B * max_pages + 2
        kv = [torch.randn(n_pages, page, H_kv, D, generator=g) for _ in range(2)]
    else:
        kv = [torch.randn(B, L_max, H_kv, D, generator=g) for _ in range(2)]
    if outliers:   # a few channels 20x larger, as real K caches have
        for t in kv:
            t[..., :2] *= 20
    (k8, ks), (v8, vs) = quant.quantize_kv(kv[0], kv_dtype, k_gran), quant.quantize_kv(kv[1], kv_dtype, v_gran)
    kd, vd = quant.dequantize_kv(k8, ks, torch.float64), quant.dequantize_kv(v8, vs, torch.float64)
    bt = None
    if page:
        bt = torch.stack([torch.randperm(n_pages, generator=g)[:max_pages] for _ in range(B)]).to(torch.int32)
        for b, L in enumerate(lens):
            bt[b, -(-L // page):] = -1
        idx = bt.long().clamp(0, n_pages - 1)
        kd, vd = (t[idx].reshape(B, L_max, H_kv, D) for t in (kd, vd))
        bt = bt.to(DEVICE)
    dev = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t   # noqa: E731
    return (dev(q), dev(k8), dev(v8), dev(ks), dev(vs), kd, vd, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            bt)


def edge_lengths(q_len, L_max, page):
    xs = [0, 1, q_len - 1, q_len, N - 1, N, N + 1, 2 * N + 1, L_max - 1, L_max] + ([page - 1, page + 1] if page else [])
    return sorted({x for x in xs if 0 <= x <= L_max})


def check_every_method(q, k8, v8, ks, vs, kd, vd, lens, bt, what, methods=METHODS):
    """Every method, and batch_invariant=True, matches float64 on the dequantized cache (out and lse)."""
    for method in methods + ("invariant",):
        kw = dict(method="auto", batch_invariant=True) if method == "invariant" else dict(method=method)
        out, lse = fdlib.decode_attention(q, k8, v8, lens, block_table=bt, k_scale=ks, v_scale=vs, return_lse=True,
                                          **kw)
        assert_close_qlen(out, lse, q, kd, vd, lens, what=f"{method} {what}")
    assert counters_zero()


# ------------------------------------------------------------------------------------------ every method, float64
CASES = [(kv, g, page) for kv in KV_DTYPES for g, page in zip(GRANS, (0, 16, 4) if kv == torch.int8 else (16, 4, 0))]


@pytest.mark.parametrize("kv_dtype,gran,page", CASES, ids=[f"{str(c[0])[6:]}-{c[1]}-page{c[2]}" for c in CASES])
def test_every_method_matches_float64_on_the_dequantized_cache(kv_dtype, gran, page):
    """e4m3 and int8 with K and V scaled per tensor, per head and per token, each on a contiguous cache and on pages
    of 4 and 16 (a lookup in each tile's iteration; table rows read a tile ahead or held in registers): ragged
    lengths with 0, 1 and tile edges, group 3 (not a power of two), D = 80."""
    B, H_kv, group, D, L_max = 4, 2, 3, 80, 48
    lens = [L_max, 0, 1, N + 1]
    args = kv8_problem(7, B, 1, group * H_kv, H_kv, D, L_max, lens, kv_dtype, gran, gran, page)
    check_every_method(*args, what=f"{kv_dtype} {gran} page={page}")


@hyp_settings(max_examples=6)
@given(kv_dtype=st.sampled_from(KV_DTYPES), k_gran=st.sampled_from(GRANS), v_gran=st.sampled_from(GRANS),
       page=st.sampled_from([0, 1, 4, 16]), q_len=st.sampled_from([1, 2, 5, 16]), group=st.sampled_from([1, 3, 4]),
       D=st.sampled_from([32, 80, 96]), q_dtype=st.sampled_from([torch.float16, torch.bfloat16]), data=st.data())
def test_kv8_property(kv_dtype, k_gran, v_gran, page, q_len, group, D, q_dtype, data):
    """Random mixes: K and V of different granularities, several query tokens (q_len up to 16), bf16 queries, odd
    head dims and groups, ragged lengths (incl. 0, 1, shorter than q_len, tile edges), pages of 1 to 16."""
    B, H_kv = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    L_max = 32 if page in (0, 16) else 20
    lens = [data.draw(st.sampled_from(edge_lengths(q_len, L_max, page))) for _ in range(B)]
    args = kv8_problem(data.draw(st.integers(0, 2 ** 16)), B, q_len, group * H_kv, H_kv, D, L_max, lens, kv_dtype,
                       k_gran, v_gran, page, q_dtype)
    methods = ("auto", "unified", data.draw(st.sampled_from(("split", "persistent", "balanced", "streamk", "naive"))))
    check_every_method(*args, what=f"{kv_dtype} K:{k_gran} V:{v_gran} page={page} q_len={q_len} lens={lens}",
                       methods=methods)


def test_plan_run_with_new_scales_and_values():
    """One plan (fdlib.plan with kv_dtype and the granularities) runs caches quantized anew, scales and all: a
    per-tensor scale is a launch argument, so a new one must reach the kernels."""
    B, H_q, H_kv, D, L = 2, 8, 2, 32, 40
    lens = [40, 23]
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=DEVICE, kv_dtype=torch.float8_e4m3fn,
                   k_scale="tensor", v_scale="head")
    assert p.kv == quant.KVQuant(torch.float8_e4m3fn, "tensor", "head")
    assert "float8_e4m3fn cache, scales per tensor (K) and per head (V)" in str(p)
    for seed, amp in ((1, 1.0), (2, 30.0)):
        q, k8, v8, ks, vs, kd, vd, lens_t, _ = kv8_problem(seed, B, 1, H_q, H_kv, D, L, lens, torch.float8_e4m3fn,
                                                           "tensor", "head")
        ks = ks * amp   # the same stored values standing for a cache amp times larger
        out, lse = p.run(q, k8, v8, lens_t, k_scale=ks, v_scale=vs, return_lse=True)
        assert_close_qlen(out, lse, q, kd * amp, vd, lens_t, what=f"plan.run, K scale x{amp}")


def test_packed_heads_and_longest_first_over_8bit_caches():
    """The plans auto takes on a GPU for some shapes, forced here: adjacent KV heads read as one (per-tensor scales,
    the only ones packed heads can share), and sequences launched longest first over pages (per-token scales)."""
    B, H_q, H_kv, D, L = 3, 8, 4, 32, 48
    lens = [48, 5, 31]
    q, k8, v8, ks, vs, kd, vd, lens_t, _ = kv8_problem(12, B, 1, H_q, H_kv, D, L, lens, torch.float8_e4m3fn,
                                                       "tensor", "tensor")
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=DEVICE, method="unified", pack_heads=True,
                   kv_dtype=torch.float8_e4m3fn)
    assert p.decision.pack > 1, str(p)
    assert_close_qlen(*p.run(q, k8, v8, lens_t, k_scale=ks, v_scale=vs, return_lse=True), q, kd, vd, lens_t,
                      what="packed heads")
    q, k8, v8, ks, vs, kd, vd, lens_t, bt = kv8_problem(13, B, 1, H_q, H_kv, D, L, lens, torch.int8, "token", "token",
                                                        page=16)
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=DEVICE, method="unified", longest_first=True,
                   page_size=16, lengths=lens, kv_dtype=torch.int8, k_scale="token", v_scale="token")
    assert p.decision.order > 0, str(p)
    assert_close_qlen(*p.run(q, k8, v8, lens_t, block_table=bt, k_scale=ks, v_scale=vs, return_lse=True), q, kd, vd,
                      lens_t, what="longest first")


def test_strided_caches_and_scales():
    """8-bit caches stored head-major and read as [B, L, H_kv, D] views, with per-token scales that are views of a
    larger tensor (every stride unusual) and per-head scales of stride 2: the strides are the kernels' arguments."""
    B, H_q, H_kv, D, L = 2, 6, 2, 32, 40
    q, k8, v8, ks, vs, kd, vd, lens, _ = kv8_problem(4, B, 1, H_q, H_kv, D, L, [40, 19], torch.int8, "token", "head")
    k8p = k8.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    big = torch.full((B, L + 3, H_kv + 1), float("nan"), device=DEVICE)
    big[:, 1:L + 1, 1:] = ks
    ks_view = big[:, 1:L + 1, 1:]
    vs_view = torch.stack([vs, torch.full_like(vs, float("nan"))], 1).reshape(-1)[::2]
    assert ks_view.stride() != ks.stride() and vs_view.stride() == (2,)
    for method in ("unified", "split", "persistent", "naive"):
        out, lse = fdlib.decode_attention(q, k8p, v8, lens, k_scale=ks_view, v_scale=vs_view, method=method,
                                          return_lse=True)
        assert_close_qlen(out, lse, q, kd, vd, lens, what=f"strided {method}")


def test_per_token_scales_are_read_at_each_key_and_head():
    """A per-token scale changed at one (key, KV head) changes exactly the rows that read it (its KV head's group),
    and past a sequence's length the scales are never read (NaN there changes nothing)."""
    B, H_q, H_kv, D, L = 2, 4, 2, 16, 24
    q, k8, v8, ks, vs, kd, vd, lens, _ = kv8_problem(3, B, 1, H_q, H_kv, D, L, [24, 10], torch.int8, "token", "token")
    base = fdlib.decode_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs, method="unified")
    ks2, vs2 = ks.clone(), vs.clone()
    ks2[0, 5, 1] *= 4
    vs2[1, 10:, :] = float("nan")   # past sequence 1's 10 keys
    out = fdlib.decode_attention(q, k8, v8, lens, k_scale=ks2, v_scale=vs2, method="unified")
    changed = (out != base).any(-1)
    assert changed[0, 2:].all() and not changed[0, :2].any() and not changed[1].any(), changed
    kd2 = kd.clone()
    kd2[0, 5, 1] *= 4
    assert_close_qlen(*fdlib.decode_attention(q, k8, v8, lens, k_scale=ks2, v_scale=vs2, return_lse=True),
                      q, kd2, vd, lens, what="one key's scale x4")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["e4m3", "int8"])
def test_per_token_v_scales_far_apart_keep_float16_precision(kv_dtype):
    """Per-token V scales 10^6 apart within one tile, the largest on a key of tiny weight (a token with outlier V
    that the query barely attends): the 16-bit weights of the product with V must not fall below float16's
    normal range. They were p·σ_V/max σ_V, about 10^-7 here, 6% off; each row's weights now share its largest."""
    g = torch.Generator().manual_seed(0)
    B, L, H_kv, H_q, D = 1, 32, 1, 2, 64
    q = torch.randn(B, H_q, D, generator=g)
    k = torch.randn(B, L, H_kv, D, generator=g)
    v = torch.randn(B, L, H_kv, D, generator=g) * 1e-2
    v[0, 5] *= 1e6
    k[0, 5] = -15 * q[0, 0] / q[0, 0].norm()
    (k8, ks), (v8, vs) = quant.quantize_kv(k, kv_dtype, "token"), quant.quantize_kv(v, kv_dtype, "token")
    kd, vd = quant.dequantize_kv(k8, ks, torch.float64), quant.dequantize_kv(v8, vs, torch.float64)
    q, lens = q.half().to(DEVICE), torch.tensor([L], dtype=torch.int32, device=DEVICE)
    args = [t.to(DEVICE) for t in (k8, v8, ks, vs)]
    check_every_method(q, args[0], args[1], args[2], args[3], kd, vd, lens, None, what=f"{kv_dtype} V scales 1e6 apart")


# ------------------------------------------------------------------------------------------ quantize_kv
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["e4m3", "int8"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("outliers", [False, True], ids=["normal", "outliers"])
def test_quantize_kv_round_trip_and_error_bound(kv_dtype, gran, outliers):
    """stored · scale lies within half a step of x: s/2 for int8; half an e4m3 ulp of x/s (relative 2^-4 for
    normals, 2^-10 absolute below 2^-6), times s. Each group's absolute maximum is stored as ±qmax; a group of zeros
    gets scale 1 and stays 0; shapes, dtypes and devices as documented."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 20, 4, 24, generator=g, dtype=torch.float64)
    if outliers:
        x[..., 3] *= 50
    x[1, 7] = 0.0                                  # a token of zeros (every head)
    x = x.float()
    stored, scale = quant.quantize_kv(x, kv_dtype, gran)
    assert stored.dtype == kv_dtype and stored.shape == x.shape
    if gran == "tensor":
        assert isinstance(scale, float) and scale > 0
    else:
        want = (4,) if gran == "head" else (3, 20, 4)
        assert scale.dtype == torch.float32 and tuple(scale.shape) == want and scale.is_contiguous()
    assert_within_half_a_step(x, stored, scale, kv_dtype, gran)
    qmax = quant.QMAX[kv_dtype]
    amax_stored = stored.double().abs()
    if gran == "token":
        group_max = amax_stored.amax(-1)
        nonzero = x.abs().amax(-1) > 0
        assert (group_max[nonzero] == qmax).all() and (group_max[~nonzero] == 0).all()
        assert (scale[~nonzero] == 1).all()
    elif gran == "head":
        assert (amax_stored.transpose(-2, 0).reshape(4, -1).amax(1) == qmax).all()
    else:
        assert amax_stored.max() == qmax
    assert (stored[1, 7].double() == 0).all()


def assert_within_half_a_step(x, stored, scale, kv_dtype, gran):
    """quantize_kv's documented bound: |stored·s − x| <= s/2 (int8), half an e4m3 ulp of x/s times s (e4m3)."""
    s = torch.as_tensor(scale, dtype=torch.float64)
    s = s if gran == "tensor" else s[:, None] if gran == "head" else s[..., None]
    y = x.double() / s
    err = (quant.dequantize_kv(stored, scale, torch.float64) - x.double()).abs()
    if kv_dtype == torch.int8:
        bound = 0.5 * s * (1 + 1e-6)
    else:
        bound = s * torch.where(y.abs() >= 2 ** -6, y.abs() * 2 ** -4, torch.full_like(y, 2 ** -10)) * (1 + 1e-6)
    assert (err <= bound).all(), (err / bound).max()


@hyp_settings(max_examples=30)
@given(kv_dtype=st.sampled_from(KV_DTYPES), gran=st.sampled_from(GRANS), exp=st.integers(-160, -110),
       spread=st.integers(0, 30), seed=st.integers(0, 2 ** 16))
def test_quantize_kv_of_tiny_values_gives_normal_positive_scales(kv_dtype, gran, exp, spread, seed):
    """Values around float32's subnormals (max|x|/q_max would be subnormal or 0): every scale is finite and at
    least 2^-126 (float32's smallest normal), the documented bound holds, and decode_attention takes the cache."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 2, 8, generator=g, dtype=torch.float64)
    x *= 2.0 ** (exp - torch.randint(0, spread + 1, x.shape, generator=g))   # magnitudes 2^(exp - spread) .. 2^exp
    x = x.float()
    stored, scale = quant.quantize_kv(x, kv_dtype, gran)
    s = torch.as_tensor(scale)
    assert torch.isfinite(s).all() and (s > 0).all(), s
    assert (s >= 2.0 ** -126).all(), s
    assert_within_half_a_step(x, stored, scale, kv_dtype, gran)
    q = torch.randn(2, 4, 8, generator=g).half()
    out = fdlib.decode_attention(q.to(DEVICE), stored.to(DEVICE), stored.to(DEVICE), [5, 3],
                                 k_scale=scale if gran == "tensor" else scale.to(DEVICE),
                                 v_scale=scale if gran == "tensor" else scale.to(DEVICE))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["e4m3", "int8"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_kv_refuses_a_nan_or_inf_naming_x(kv_dtype, gran, x_dtype, bad):
    """A NaN or an infinity anywhere in x raises ValueError naming x, the value and its index (int8 has no NaN and
    either would poison its group's scale)."""
    x = torch.randn(2, 4, 3, 8).to(x_dtype)
    x[1, 2, 0, 5] = bad
    with pytest.raises(ValueError, match=rf"^x: expected finite values to quantize, got {bad} at \[1, 2, 0, 5\]$"):
        quant.quantize_kv(x, kv_dtype, gran)


@pytest.mark.parametrize("gran", GRANS)
def test_quantize_kv_refuses_a_float64_value_beyond_float32_naming_x(gran):
    """A float64 x is quantized through float32: a finite value beyond float32's range (once an IndexError from
    the search for a non-finite element) raises ValueError naming x, the value and its index."""
    x = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    x[1, 2, 0, 5] = -1e300
    with pytest.raises(ValueError, match=r"^x: expected finite values to quantize, got -1e\+300 at \[1, 2, 0, 5\] "
                                         r"\(beyond float32's largest value"):
        quant.quantize_kv(x, torch.int8, gran)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["e4m3", "int8"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("shape", [(0, 4, 2, 8), (2, 0, 2, 8), (2, 4, 0, 8), (2, 4, 2, 0), (0, 0)])
def test_quantize_kv_of_an_empty_tensor_is_empty_with_scales_of_one(kv_dtype, gran, shape):
    """An empty x: stored empty of x's shape, each scale 1 (a group with no value, as a group of zeros); an empty
    cache quantized so runs through decode_attention (out 0, lse -inf)."""
    stored, scale = quant.quantize_kv(torch.randn(shape), kv_dtype, gran)
    assert stored.dtype == kv_dtype and stored.shape == shape
    if gran == "tensor":
        assert scale == 1.0 and isinstance(scale, float)
    else:
        want = (shape[-2],) if gran == "head" else shape[:-1]
        assert scale.dtype == torch.float32 and tuple(scale.shape) == want and (scale == 1).all()
    if shape == (2, 0, 2, 8):
        s = scale if gran == "tensor" else scale.to(DEVICE)
        out, lse = fdlib.decode_attention(torch.randn(2, 4, 8).half().to(DEVICE), stored.to(DEVICE), stored.to(DEVICE),
                                          [0, 0], k_scale=s, v_scale=s, return_lse=True)
        assert (out == 0).all() and (lse == -math.inf).all()


def test_quantize_kv_errors():
    x = torch.randn(2, 4, 2, 8)
    with pytest.raises(ValueError, match="dtype: expected torch.float8_e4m3fn or torch.int8, got torch.float16"):
        quant.quantize_kv(x, torch.float16)
    with pytest.raises(ValueError, match="granularity: expected one of 'tensor', 'head', 'token', got 'row'"):
        quant.quantize_kv(x, torch.int8, "row")
    with pytest.raises(TypeError, match="x: expected a float16, bfloat16 or float32 tensor to quantize, got "
                                        "torch.int8"):
        quant.quantize_kv(x.to(torch.int8))
    with pytest.raises(ValueError, match=r"x: expected \[..., H_kv, D\]"):
        quant.quantize_kv(torch.randn(5))
    assert fdlib.quantize_kv is quant.quantize_kv


# ------------------------------------------------------------------------------------------ scale checks
def _small(kv_dtype=torch.int8, gran="head", page=0):
    lens = [8, 3]
    return kv8_problem(5, 2, 1, 4, 2, 16, 8, lens, kv_dtype, gran, gran, page)


BAD_SCALES = [
    ("missing k_scale", dict(k_scale=None), ValueError,
     r"k_scale: k_cache is int8, an 8-bit cache.*: pass its scale, a float \(per tensor\), a float32 tensor \[H_kv\] "
     r"\(per KV head\) or a float32 tensor of the cache's shape without D \(per token and KV head\)"),
    ("float16 tensor", dict(k_scale=torch.ones(2, dtype=torch.float16)), TypeError,
     r"k_scale: dtype must be torch.float32, got torch.float16"),
    ("wrong shape", dict(v_scale=torch.ones(3)), ValueError,
     r"v_scale: expected a float \(per tensor\), a float32 tensor \[H_kv\] = \[2\] \(per KV head\) or \[B, L_max, "
     r"H_kv\] = \[2, 8, 2\] \(per token and KV head: the cache's shape without D\), got shape \[3\]"),
    ("NaN float", dict(k_scale=float("nan")), ValueError, r"k_scale: expected a finite positive float, got nan$"),
    ("negative float", dict(v_scale=-1.0), ValueError, r"v_scale: expected a finite positive float, got -1.0$"),
    ("inf float", dict(v_scale=float("inf")), ValueError, r"v_scale: expected a finite positive float, got inf$"),
    # finite as a Python float, but not as the float32 the kernels take: once NaN or inf out, or Triton's fp64
    ("float beyond float32", dict(k_scale=1e39), ValueError,
     r"k_scale: expected a finite positive float, got 1e\+39 \(beyond float32's largest value, 3.40282e\+38: the "
     r"kernels take it as a float32\)"),
    ("int beyond float", dict(v_scale=10 ** 400), ValueError,   # once OverflowError, naming nothing
     r"v_scale: expected a finite positive float, got 1000\d+ \(beyond float32's largest value"),
    ("v float beyond float32", dict(v_scale=4e38), ValueError,
     r"v_scale: expected a finite positive float, got 4e\+38 \(beyond float32's largest value"),
    ("NaN head", dict(k_scale=torch.tensor([1.0, float("nan")])), ValueError,
     r"k_scale: per-head scales must be finite and positive, got nan at KV head 1"),
    ("zero head", dict(v_scale=torch.tensor([0.0, 1.0])), ValueError,
     r"v_scale: per-head scales must be finite and positive, got 0.0 at KV head 0"),
    ("other device", dict(k_scale=torch.ones(2, device="meta")), ValueError,
     r"k_scale: must be on the cache's device \(cpu\), got a tensor on meta"),
    ("a string", dict(k_scale="head"), TypeError,
     r"k_scale: expected a float \(per tensor\) or a float32 tensor \(per KV head or per token\), got str"),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="the host-side value checks and the meta device case are for a CPU run")
@pytest.mark.parametrize("what,kw,exc,msg", BAD_SCALES, ids=[c[0] for c in BAD_SCALES])
def test_bad_scales_are_named(what, kw, exc, msg):
    q, k8, v8, ks, vs, _, _, lens, _ = _small()
    args = dict(k_scale=ks, v_scale=vs)
    args.update(kw)
    with pytest.raises(exc, match=msg):
        fdlib.decode_attention(q, k8, v8, lens, **args)
    p = fdlib.plan(2, 4, 2, 16, 8, dtype=torch.float16, device=DEVICE, kv_dtype=torch.int8, k_scale="head",
                   v_scale="head")
    with pytest.raises(exc, match=msg):
        p.run(q, k8, v8, lens, **args)


def test_paged_token_scale_shape_is_named():
    q, k8, v8, ks, vs, _, _, lens, bt = _small(gran="token", page=4)
    with pytest.raises(ValueError, match=r"k_scale: .* or \[n_pages, page_size, H_kv\] = \[6, 4, 2\] .*got shape "
                                         r"\[2, 8, 2\]"):
        fdlib.decode_attention(q, k8, v8, lens, block_table=bt, k_scale=torch.ones(2, 8, 2, device=DEVICE),
                               v_scale=vs)


def test_cache_and_scale_mismatches_are_named():
    q, k8, v8, ks, vs, kd, vd, lens, _ = _small()
    k16, v16 = kd.to(torch.float16).to(DEVICE), vd.to(torch.float16).to(DEVICE)
    with pytest.raises(ValueError, match=r"k_scale: scales are for 8-bit caches \(float8_e4m3fn, int8\); k_cache is "
                                         r"float16. Pass k_scale=None"):
        fdlib.decode_attention(q, k16, v16, lens, k_scale=1.0)
    with pytest.raises(TypeError, match="k_cache/v_cache: an 8-bit cache stores K and V in one dtype, got k_cache "
                                        "int8, v_cache float8_e4m3fn"):
        fdlib.decode_attention(q, k8, v8.to(torch.float8_e4m3fn), lens, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match=r"q: with an 8-bit cache \(int8\) q must be float16 or bfloat16"):
        fdlib.decode_attention(q.float(), k8, v8, lens, k_scale=ks, v_scale=vs)
    with pytest.raises(NotImplementedError, match="method: 'unified_max' does not read 8-bit caches yet"):
        fdlib.decode_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs, method="unified_max")
    with pytest.raises(NotImplementedError, match="k_cache/v_cache: unified_max_attention does not read 8-bit caches"):
        unified_max_attention(q, k8, v8, lens)
    p = fdlib.plan(2, 4, 2, 16, 8, dtype=torch.float16, device=DEVICE, kv_dtype=torch.int8, k_scale="token",
                   v_scale="head")
    with pytest.raises(ValueError, match=r"k_scale: this plan was made for scales per token, got one per head; make a "
                                         r"plan with fdlib.plan\(..., k_scale='head'\)"):
        p.run(q, k8, v8, lens, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="k_cache: this plan runs int8, got float16"):
        p.run(q, k16, v16, lens)
    p16 = fdlib.plan(2, 4, 2, 16, 8, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="v_scale: this plan is for a 16-bit cache"):
        p16.run(q, k16, v16, lens, v_scale=1.0)
    with pytest.raises(TypeError, match="kv_dtype: expected None .*, torch.float8_e4m3fn or torch.int8, got "
                                        "torch.uint8"):
        fdlib.plan(2, 4, 2, 16, 8, kv_dtype=torch.uint8)
    with pytest.raises(ValueError, match="k_scale: a plan takes the scale's granularity, one of 'tensor', 'head', "
                                         "'token', got 0.5"):
        fdlib.plan(2, 4, 2, 16, 8, kv_dtype=torch.int8, k_scale=0.5)
    with pytest.raises(ValueError, match="k_scale: a scale granularity is for an 8-bit cache"):
        fdlib.plan(2, 4, 2, 16, 8, k_scale="head")
    with pytest.raises(TypeError, match="dtype: with an 8-bit cache .* q must be float16 or bfloat16"):
        fdlib.plan(2, 4, 2, 16, 8, dtype=torch.float32, kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="pack_heads: KV heads read as one share their scales"):
        fdlib.plan(2, 4, 2, 16, 8, kv_dtype=torch.int8, k_scale="head", pack_heads=True)


# ------------------------------------------------------------------------------------------ bytes
def test_cost_model_counts_the_bytes_read():
    """At a bandwidth-bound shape (B=1 32:8 L=131072 on the H200 preset) the cost model predicts an 8-bit cache in
    about half the 16-bit time, and per-token scales (4 bytes for each of K and V a key and KV head) in
    (2·D + 8)/(2·D) of that, as their bytes say; the plan's format carries those bytes."""
    kw = dict(B=1, H_q=32, H_kv=8, L=131072, D=128, gpu="H200")
    t16, t8 = (min(c.time_us for c in costmodel.explain(dtype_bytes=e, **kw).candidates) for e in (2, 1))
    t8s = min(c.time_us for c in costmodel.explain(dtype_bytes=1, scale_bytes=8, **kw).candidates)
    assert 0.45 < t8 / t16 < 0.6, (t8, t16)
    assert t8s / t8 == pytest.approx((2 * 128 + 8) / (2 * 128), rel=0.02), (t8s, t8)
    kv = quant.KVQuant(torch.int8, "token", "head")
    assert kv.itemsize == 1 and kv.scale_bytes == 4 and quant.scale_bytes(torch.float16) == 0
    assert quant.KVQuant(torch.float8_e4m3fn, "token", "token").scale_bytes == 8


def test_quant_error_results_are_reproducible():
    """The committed CPU error table (results/cpu/quant-error.json, tools/quant_error.py) is what the code computes
    now: one of its rows recomputed from its seed."""
    import json
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    import quant_error
    res = json.loads((root / "results" / "cpu" / "quant-error.json").read_text())
    row = next(r for r in res["rows"] if r["data"] == "outlier channels" and r["dtype"] == "int8"
               and r["granularity"] == "head")
    again = quant_error.measure(row["data"], torch.int8, "head", **res["settings"])
    for key in ("cache_rel_err", "out_rel_err", "out_max_row_err"):
        assert math.isclose(again[key], row[key], rel_tol=1e-9), (key, again[key], row[key])


def test_batch_invariant_8bit_rows_do_not_depend_on_their_batchmates():
    """batch_invariant=True over an e4m3 cache with per-token scales: a sequence's out and lse are bitwise the same
    alone and in a batch (its scales are its own rows')."""
    B, H_q, H_kv, D, L = 3, 4, 2, 16, 40
    q, k8, v8, ks, vs, _, _, lens, _ = kv8_problem(9, B, 1, H_q, H_kv, D, L, [40, 33, 7], torch.float8_e4m3fn,
                                                   "token", "token")
    out, lse = fdlib.decode_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs, batch_invariant=True, return_lse=True)
    for b in range(B):
        o1, l1 = fdlib.decode_attention(q[b:b + 1], k8[b:b + 1], v8[b:b + 1], lens[b:b + 1], k_scale=ks[b:b + 1],
                                        v_scale=vs[b:b + 1], batch_invariant=True, return_lse=True)
        assert torch.equal(o1[0], out[b]) and torch.equal(l1[0], lse[b]), b


# ------------------------------------------------------------------------------------------ the bench option
def test_bench_kv8_dense_and_ragged_quick_runs():
    """``python -m fdlib.bench --kv-dtype ... --kv-scale ...`` on a tiny dense grid and a tiny ragged one over pages:
    fdlib's records are right (against the 16-bit cache the 8-bit one stands for) and carry the cache's format; the
    bytes are what fdlib reads (1 byte an element, 4 a key and head for each per-token scale), the peers' the 16-bit
    cache's."""
    from fdlib.bench import harness, ragged
    from fdlib.bench.__main__ import main
    res = harness.run_benchmark(quick=True, L=(40,), methods=("unified", "fa2"), kv_dtype="float8_e4m3fn",
                                kv_scale="token", ceiling=False, progress=False)
    assert res["settings"]["kv_cache"].startswith("float8_e4m3fn cache, scales per token")
    for r in res["records"]:
        assert r["kv_dtype"] == "float8_e4m3fn" and r["kv_scale"] == "token"
        per_key = 2 * r["D"] * 2 if r["kind"] == "peer" else 2 * r["D"] + 8
        assert r["kv_bytes"] == r["B"] * r["H_kv"] * r["L"] * per_key, r
    uni = next(r for r in res["records"] if r["method"] == "unified")
    assert uni["status"] == "ok" and uni["rel_err"] < 1e-2, uni
    assert uni["eager_tbs"] == pytest.approx(uni["kv_bytes"] / uni["eager_us"] / 1e6)
    rg = ragged.run_ragged(quick=True, methods=("auto",), dists=("uniform",), page_size=16, kv_dtype="int8",
                           kv_scale="head", ceiling=False, progress=False)
    (r,) = rg["records"]
    assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["kv_dtype"] == "int8" and r["kv_scale"] == "head", r
    lens = ragged.draw_lengths("uniform", r["B"], r["mean"], 0)
    assert r["kv_mb"] == pytest.approx(r["H_kv"] * 2 * r["D"] * sum(lens) / 1e6)
    assert main(["--kv-scale", "head"]) == 2
    assert main(["--qlen", "--kv-dtype", "int8"]) == 2
    with pytest.raises(ValueError, match="--kv-dtype: expected one of float8_e4m3fn, int8, got 'fp8'"):
        harness.run_benchmark(quick=True, kv_dtype="fp8")


# ------------------------------------------------------------------------------------------ replayed launches
from test_replay import direct  # noqa: E402,F401  (the stand-in for Triton's C launcher)


def test_replayed_8bit_calls_take_the_new_tensors_and_scales(direct):   # noqa: F811
    """plan.run's replay (stood in for on the CPU, as test_replay.py does): a call laid out like a checked one
    launches with the new tensors' addresses, its per-token scale tensor among them; a per-tensor scale is a launch
    argument, so a new value is a new layout, checked (and computed) first, then replayed with that value."""
    from fdlib.kernels.unified import unified_args
    if not fdlib.runtime.INTERPRET:
        pytest.skip("stands in for the C launcher; on a GPU the real direct launches run")
    B, H_q, H_kv, D, L = 3, 8, 2, 32, 40
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=DEVICE, method="unified", num_splits=2,
                   kv_dtype=torch.int8, k_scale="token", v_scale="tensor")

    def expected(q, k8, v8, ks, vs, lens, out, lse):
        d, ws = p.decision, p.workspace
        k_mul, *scales, _ = quant.launch_args(p.kv, ks, vs, ws.flag)
        grid, ptrs, scalars = unified_args(q, k8, v8, lens, p.scale * k_mul, d.chunk, d.splits, out, lse, ws.o_part,
                                           ws.lse_part, ws.counters, ws.flag, scales=scales)
        go = p._launchers[0]
        names = go.kernel.arg_names[len(ptrs) + len(scalars):]
        return tuple(grid), (*[t.data_ptr() for t in ptrs], *scalars, *[go.meta[n] for n in names])

    args = kv8_problem(0, B, 1, H_q, H_kv, D, L, [40, 17, 1], torch.int8, "token", "tensor")
    q, k8, v8, ks, vs, kd, vd, lens, _ = args
    assert_close_qlen(*p.run(q, k8, v8, lens, k_scale=ks, v_scale=vs, return_lse=True), q, kd, vd, lens,
                      what="checked")
    assert not direct and len(p._replays) == 1
    for seed in (1, 2):
        q, k8, v8, ks, vs, kd, vd, lens, _ = kv8_problem(seed, B, 1, H_q, H_kv, D, L, [40, 17, 1], torch.int8,
                                                         "token", "tensor")
        vs = args[4]   # the same per-tensor V scale: the same layout
        out, lse = p.run(q, k8, v8, lens, k_scale=ks, v_scale=vs, return_lse=True)
        assert direct[-1] == expected(q, k8, v8, ks, vs, lens, out, lse)
    assert len(direct) == 2
    out, lse = p.run(q, k8, v8, lens, k_scale=ks, v_scale=vs * 2, return_lse=True)   # a new value: checked first
    assert len(direct) == 2 and len(p._replays) == 2
    assert_close_qlen(out, lse, q, kd, quant.dequantize_kv(v8, vs * 2, torch.float64), lens,
                      what="new per-tensor V scale")
    out, lse = p.run(q, k8, v8, lens, k_scale=ks, v_scale=vs * 2, return_lse=True)
    assert len(direct) == 3 and direct[-1] == expected(q, k8, v8, ks, vs * 2, lens, out, lse)


def test_dequantize_kv_names_each_bad_argument():
    """dequantize_kv checks what it is given, as quantize_kv does: a bad stored tensor, dtype or scale is refused
    with the argument named, where it would have returned zeros (an int dtype) or broadcast silently."""
    stored, head = quant.quantize_kv(torch.randn(2, 8, 2, 16), torch.int8, "head")
    _, token = quant.quantize_kv(torch.randn(2, 8, 2, 16), torch.int8, "token")
    assert torch.equal(quant.dequantize_kv(stored, head), stored.float() * head[:, None])
    assert torch.equal(quant.dequantize_kv(stored, token), stored.float() * token[..., None])
    assert torch.equal(quant.dequantize_kv(stored, 0.5, torch.float64), stored.double() * 0.5)
    bad = [((stored, head, torch.int32), TypeError, "dtype: expected a float dtype"),
           ((stored, head, torch.int8), TypeError, "dtype"),
           ((stored.float(), head), TypeError, "stored: expected an 8-bit cache"),
           ((torch.ones(16, dtype=torch.int8), torch.ones(2)), ValueError, r"stored: expected \[..., H_kv, D\]"),
           ((stored, torch.ones(3)), ValueError, r"scale: expected .* got shape \[3\]"),
           ((stored, head.double()), TypeError, "scale: dtype must be torch.float32"),
           ((stored, [1.0, 2.0]), TypeError, "scale: expected a float"),
           ((stored, True), TypeError, "scale"),
           ((stored, 0.0), ValueError, "scale: expected a finite positive float, got 0.0"),
           ((stored, float("nan")), ValueError, "scale: expected a finite positive float")]
    for args, kind, match in bad:
        with pytest.raises(kind, match=match):
            quant.dequantize_kv(*args)
