r"""Checks for Lab 09: the dequantizing tile load of an 8-bit KV cache.

``lab09.dequant_tile(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY)`` is a ``@triton.jit`` function that
loads one tile of BLOCK_N keys of an 8-bit K or V cache and returns what it stands for (:mod:`fdlib.quant`), in float32:

.. math::  x_{jd} = \text{float}(\hat x_{jd})\cdot \sigma_j, \qquad
           \sigma_j = \begin{cases} S_0 & \text{per tensor}\\ S_h & \text{per KV head } h\\
                               S[\text{s\_offs}_j] & \text{per token}\end{cases}

The cache arrives as bytes (``X`` a uint8 pointer, as serving systems often store an 8-bit cache); ``KV_DTYPE``
(``tl.int8`` or ``tl.float8e4nv``, a constexpr) says what they hold, so the bytes are reinterpreted (bitcast),
not converted. Rows of keys past the sequence's end (``valid`` False) are 0: their bytes are not read.

Most checks call the function once on one tile of a real cache made by :func:`fdlib.quantize_kv` (a harness
kernel, :func:`tile_of`), with the slots past each sequence's end holding the byte 0x7F (NaN in e4m3) and NaN
scales. A wrong tile is compared with the tiles that known mistakes give (:data:`MISTAKES`: the scale applied
twice, a per-token scale on the wrong axis, int8 read as unsigned, ...) and the message names the one it matches.
The last check runs the function inside a decode loop (:func:`decode_8bit`: for every tile of K and of V, the
learner's load, then fdlib's tile update) against :func:`fdlib.reference_attention` over the dequantized cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fdlib import runtime
from fdlib.kernels.tile import LOG2E, state_to_partial, tile_update
from fdlib.quant import dequantize_kv, granularity_of, quantize_kv
from fdlib.reference import reference_attention

from .core import CheckFailure, assert_close, check_case, randn
from .triton_exercise import launch, triton_stub

NAME = "lab09.dequant_tile"

STUB = triton_stub(NAME, '''
@exercise("lab09.dequant_tile")
@triton.jit
def dequant_tile(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    """One tile of an 8-bit K or V cache, loaded and dequantized: x[j, :] = float(stored[j, :]) * σ_j, float32
    [BLOCK_N, D].

    X: the cache as bytes (a uint8 pointer); the tile's BLOCK_N x D bytes lie at X + offs (offs [BLOCK_N, D]).
    KV_DTYPE: what the bytes hold, tl.int8 or tl.float8e4nv (e4m3): reinterpret them, don't convert them.
    S: float32 scales; GRANULARITY: "tensor" (one scale, at S), "head" (the tile's KV head h: at S + h) or
    "token" (key j's scale at S + s_offs[j]; s_offs [BLOCK_N]).
    valid [BLOCK_N]: False for keys past the end of the sequence: read nothing there; their rows must be 0.
    """
    # TODO: load the bytes (masked, other=0), .to(KV_DTYPE, bitcast=True), .to(tl.float32), then multiply
    #       each row j by its key's scale σ_j (per token, the scales s are [BLOCK_N]: make them a column, s[:, None]).
    return tl.zeros_like(offs).to(tl.float32)
''')

TL_DTYPES = {torch.int8: tl.int8, torch.float8_e4m3fn: tl.float8e4nv}
"""What ``KV_DTYPE`` is for each 8-bit cache dtype of :mod:`fdlib.quant`."""
BLOCK_N = 16
"""Keys a tile in the checks and in :func:`decode_8bit`."""
PAD_BYTE = 0x7F
"""What the slots past a sequence's end hold in the checks: 127 in int8; NaN in e4m3 on a GPU (Triton 3.6's
interpreter reads it as 480). Their per-token scales are NaN."""


def tl_dtype(dtype) -> tl.dtype:
    """``KV_DTYPE`` of a cache dtype (torch.int8 or torch.float8_e4m3fn)."""
    if dtype not in TL_DTYPES:
        raise TypeError(f"cache dtype: expected torch.int8 or torch.float8_e4m3fn, got {dtype}")
    return TL_DTYPES[dtype]


def _scale_buffer(scale, granularity: str, n: int) -> torch.Tensor:
    """The scales as a float32 tensor for the kernels: [1] per tensor, [H_kv] per head, the tensor itself per
    token; per tensor and per head inside a NaN-filled buffer of at least ``n`` floats, so a load at a wrong
    offset reads NaN, never past the allocation."""
    dev = runtime.DEVICE
    if granularity == "token":
        return scale.to(dev, torch.float32).contiguous()
    flat = torch.tensor([float(scale)]) if granularity == "tensor" else scale.detach().reshape(-1).float().cpu()
    buf = torch.full((max(n, flat.numel()),), float("nan"))
    buf[:flat.numel()] = flat
    return buf.to(dev)


def _token_strides(scale, granularity: str) -> tuple:
    return tuple(scale.stride()) if granularity == "token" else (0, 0, 0)


# ---------------------------------------------------------------------------------------------- one tile
@triton.jit
def _tile_kernel(X, S, OUT, b, n0, length, h, stride_xb, stride_xl, stride_xh, stride_sb, stride_sl, stride_sh,
                 N: tl.constexpr, D: tl.constexpr, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr,
                 DEQUANT: tl.constexpr):
    """Tile (b, keys n0 .. n0+N-1, KV head h) of a cache [B, L, H_kv, D] through DEQUANT, stored to OUT [N, D]."""
    pos = n0 + tl.arange(0, N)
    d = tl.arange(0, D)
    offs = b * stride_xb + pos[:, None] * stride_xl + h * stride_xh + d[None, :]
    s_offs = b * stride_sb + pos * stride_sl + h * stride_sh
    x = DEQUANT(X, S, offs, s_offs, pos < length, h, KV_DTYPE, GRANULARITY)
    tl.store(OUT + tl.arange(0, N)[:, None] * D + d[None, :], x)


def tile_of(impl, stored, scale, b: int, n0: int, length: int, h: int) -> torch.Tensor:
    """The learner's tile (float32 [BLOCK_N, D], on the CPU) of keys n0 .. n0+BLOCK_N-1 of sequence b (length
    ``length``), KV head h, of the 8-bit cache ``stored`` [B, L, H_kv, D] with ``scale`` (as quantize_kv gives it)."""
    g = granularity_of("scale", scale, stored)
    B, L, H_kv, D = stored.shape
    S = _scale_buffer(scale, g, B * L * H_kv + 64)
    out = torch.full((BLOCK_N, D), float("nan"), device=runtime.DEVICE)
    X = stored.to(runtime.DEVICE).view(torch.uint8)
    launch("your dequant_tile", lambda: _tile_kernel[(1,)](
        X, S, out, b, n0, length, h, *X.stride()[:3], *_token_strides(S, g), N=BLOCK_N, D=D,
        KV_DTYPE=tl_dtype(stored.dtype), GRANULARITY=g, DEQUANT=impl))
    return out.cpu()


def row_scales(scale, granularity: str, b: int, pos: torch.Tensor, h: int) -> torch.Tensor:
    """σ_j of keys ``pos`` of sequence b, KV head h: float64 [BLOCK_N, 1]."""
    if granularity == "tensor":
        return torch.full((len(pos), 1), float(scale), dtype=torch.float64)
    if granularity == "head":
        return torch.full((len(pos), 1), float(scale[h]), dtype=torch.float64)
    return scale.cpu().double()[b, pos, h][:, None]


MISTAKES = {
    "twice": "the scale applied twice (x · σ · σ)",
    "none": "no scale applied (the stored values themselves)",
    "divided": "x divided by the scale instead of multiplied",
    "unsigned": "int8 read as unsigned: a negative value v came out as 256 + v (reinterpret the bytes with "
                ".to(tl.int8, bitcast=True) before converting them)",
    "as_integers": "the e4m3 bytes converted as integers 0..255 instead of reinterpreted "
                   "(.to(tl.float8e4nv, bitcast=True) before converting them)",
    "as_int8": "e4m3 bytes read as int8: use KV_DTYPE (tl.float8e4nv here), not tl.int8",
    "as_e4m3": "int8 bytes read as e4m3: use KV_DTYPE (tl.int8 here), not tl.float8e4nv",
    "wrong_axis": "a scale on the wrong axis: key d's scale multiplied column d, not key j's scale row j (a per-token "
                  "scales s [BLOCK_N] are a column: s[:, None])",
    "head0": "the scale of KV head 0 instead of the tile's own head h (S + h)",
    "first": "one scale for the whole tile, the one at S (the per-tensor rule): here key j's scale is at "
             "S + s_offs[j]",
    "first_key": "the first key's scale for every key of the tile (each key j has its own, at S + s_offs[j])",
}
"""Known wrong tiles, by the cause a failure message names."""


def wrong_tiles(stored, scale, granularity: str, b: int, pos: torch.Tensor, h: int) -> dict:
    """{cause: the float64 tile [N, D] that mistake gives} for the keys ``pos`` (valid keys only)."""
    raw = stored.cpu()[b, pos, h]                                            # [N, D] stored values
    x = raw.double()
    s = row_scales(scale, granularity, b, pos, h)
    as_bytes = raw.view(torch.uint8).double()
    out = {"twice": x * s * s, "none": x, "divided": x / s}
    if stored.dtype == torch.int8:
        out["unsigned"] = as_bytes * s
        out["as_e4m3"] = raw.view(torch.uint8).view(torch.float8_e4m3fn).double() * s
    else:
        out["as_integers"] = as_bytes * s
        out["as_int8"] = raw.view(torch.uint8).view(torch.int8).double() * s
    if granularity == "token" and x.shape[0] == x.shape[1]:
        out["wrong_axis"] = x * s.T
    if granularity == "head" and h != 0:
        out["head0"] = x * float(scale[0])
    if granularity == "token":
        out["first"] = x * float(scale.reshape(-1)[0])
        out["first_key"] = x * s[:1]
    return out


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.isclose(got.double(), want, rtol=1e-5, atol=1e-30).all())


def check_tile(impl, stored, scale, b: int, n0: int, length: int, h: int) -> None:
    """The learner's tile against float(stored) · s in float32 (exact: one rounding); on a mismatch, the known
    mistake it matches is named; rows past the end must be 0."""
    g = granularity_of("scale", scale, stored)
    got = tile_of(impl, stored, scale, b, n0, length, h)
    N = got.shape[0]
    n_valid = max(0, min(N, length - n0))
    pos = torch.arange(n0, n0 + n_valid)
    name = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3"}[stored.dtype]
    what = (f"dequant_tile({name}, scales per {g}, sequence {b}, KV head {h}, keys {n0}..{n0 + N - 1}, "
            f"{n_valid} of them before the end)")
    want = stored.cpu()[b, pos, h].float() * row_scales(scale, g, b, pos, h).float()
    good = got[:n_valid]
    if not _matches(good, want.double()):
        for cause, tile in wrong_tiles(stored, scale, g, b, pos, h).items():
            if not _matches(tile, want.double()) and _matches(good, tile):
                raise CheckFailure(f"{what}: the tile is wrong; it matches {MISTAKES[cause]}")
        assert_close(good, want, f"{what}: the tile", 0.0, 1e-6)
    tail = got[n_valid:]
    if tail.numel() and not bool((tail == 0).all()):
        bad = "NaN" if bool(torch.isnan(tail).any()) else "non-zero values"
        raise CheckFailure(f"{what}: the rows of the {N - n_valid} keys past the end hold {bad}, expected 0: those "
                           f"slots hold no key (here the byte 0x7F, NaN in e4m3 on a GPU, and NaN per-token scales); load "
                           f"the bytes with mask=valid[:, None], other=0, and the scales with mask=valid, other=0")


# ---------------------------------------------------------------------------------------------- caches for the checks
def make_cache(gen, dtype, granularity: str, B: int = 2, L: int = 48, H_kv: int = 4, D: int = 32,
               lengths=None, outliers: bool = True):
    """(stored [B, L, H_kv, D], scale, lengths) from :func:`fdlib.quantize_kv` of a random cache (a few outlier
    channels, heads of different sizes, so that the scales differ), with every slot past a sequence's end
    holding the byte 0x7F and a NaN per-token scale."""
    x = randn(gen, B, L, H_kv, D)
    x = x * (0.5 + torch.arange(H_kv, dtype=torch.float32))[None, None, :, None]       # heads of different sizes
    if outliers:
        x[..., :2] *= 8.0
    lengths = [L] * B if lengths is None else list(lengths)
    stored, scale = quantize_kv(x, dtype, granularity)
    for b, n in enumerate(lengths):
        stored.view(torch.uint8)[b, n:] = PAD_BYTE
        if granularity == "token":
            scale[b, n:] = float("nan")
    return stored, scale, lengths


# ---------------------------------------------------------------------------------------------- a decode loop
@triton.jit
def _decode_kernel(Q, K, V, KS, VS, LENS, OUT, LSE, qk_scale,
                   stride_qb, stride_qh, stride_kb, stride_kl, stride_kh,
                   stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh,
                   stride_ob, stride_oh, stride_lb, stride_lh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   KV_DTYPE: tl.constexpr, K_GRAN: tl.constexpr, V_GRAN: tl.constexpr, DEQUANT: tl.constexpr):
    """Program (b, h_kv): the group's query rows over every key of sequence b, one tile at a time: K's and V's
    tiles through DEQUANT, then fdlib's tile update (float32 products); O = Õ/ℓ and lse at the end."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    rows = g < GROUP
    q = tl.load(Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :], mask=rows[:, None],
                other=0.0).to(tl.float32)
    length = tl.load(LENS + b)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < length
        offs = b * stride_kb + pos[:, None] * stride_kl + h * stride_kh + d[None, :]
        k = DEQUANT(K, KS, offs, b * stride_ksb + pos * stride_ksl + h * stride_ksh, valid, h, KV_DTYPE, K_GRAN)
        v = DEQUANT(V, VS, offs, b * stride_vsb + pos * stride_vsl + h * stride_vsh, valid, h, KV_DTYPE, V_GRAN)
        m, l, acc = tile_update(q, k, v, valid, m, l, acc, qk_scale, True)
    o, lse = state_to_partial(m, l, acc)
    tl.store(OUT + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :], o, mask=rows[:, None])
    tl.store(LSE + b * stride_lb + (h * GROUP + g) * stride_lh, lse, mask=rows)


def _padded(t: torch.Tensor, L: int) -> torch.Tensor:
    """``t`` [B, L_max, ...] with its key axis padded with zeros to L (a copy), or ``t`` itself."""
    if t.shape[1] == L:
        return t
    out = torch.zeros((t.shape[0], L, *t.shape[2:]), dtype=t.dtype, device=t.device)
    out[:, :t.shape[1]] = t
    return out


def decode_8bit(q, k_cache, v_cache, k_scale, v_scale, cache_seqlens, scale=None, dequant=None):
    """One decode step over an 8-bit cache with ``dequant`` (a ``lab09.dequant_tile``; default: the reference
    solution) loading every K and V tile, and fdlib's tile update after it, in float32.

    q: [B, H_q, D] (any float dtype; D a power of two ≥ 16); k_cache, v_cache: [B, L_max, H_kv, D], torch.int8 or
    torch.float8_e4m3fn (both the same); k_scale, v_scale: as :func:`fdlib.quantize_kv` returns them (a float, [H_kv]
    or [B, L_max, H_kv]), each its own granularity; cache_seqlens: [B]; scale: multiplies q·k (default D^-1/2).
    Returns (out [B, H_q, D], lse [B, H_q]), float32 on the kernels' device."""
    if dequant is None:
        from .core import reference
        dequant = reference(NAME)
    B, H_q, D = q.shape
    L, H_kv = k_cache.shape[1], k_cache.shape[2]
    if D < 16 or D & (D - 1):
        raise ValueError(f"q: this loop takes a head dim D that is a power of two >= 16, got D={D}")
    if H_q % H_kv:
        raise ValueError(f"q: H_q={H_q} must be a multiple of the cache's H_kv={H_kv}")
    grans = [granularity_of(n, s, c) for n, s, c in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache))]
    dev = runtime.DEVICE
    L_pad = triton.cdiv(L, BLOCK_N) * BLOCK_N            # whole tiles inside the allocation
    K = _padded(k_cache.to(dev), L_pad).contiguous().view(torch.uint8)
    V = _padded(v_cache.to(dev), L_pad).contiguous().view(torch.uint8)
    scales = []
    for s, gran in zip((k_scale, v_scale), grans):
        if gran == "token":
            s = _padded(s.to(dev, torch.float32), L_pad)
        scales.append(_scale_buffer(s, gran, 64))
    group = H_q // H_kv
    qd = q.to(dev, torch.float32).contiguous()
    out = torch.empty(B, H_q, D, device=dev)
    lse = torch.empty(B, H_q, device=dev)
    qk_scale = (D ** -0.5 if scale is None else scale) * LOG2E
    _decode_kernel[(B, H_kv)](
        qd, K, V, scales[0], scales[1], cache_seqlens.to(dev, torch.int32), out, lse, qk_scale,
        qd.stride(0), qd.stride(1), K.stride(0), K.stride(1), K.stride(2),
        *_token_strides(scales[0], grans[0]), *_token_strides(scales[1], grans[1]),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, D=D,
        KV_DTYPE=tl_dtype(k_cache.dtype), K_GRAN=grans[0], V_GRAN=grans[1], DEQUANT=dequant)
    return out, lse


# ---------------------------------------------------------------------------------------------- the checks
@check_case(NAME, "per-tensor scale, int8: a 16-key tile of KV head 2, D = 32", points=2)
def _tensor_int8(impl, gen):
    stored, scale, _ = make_cache(gen, torch.int8, "tensor")
    check_tile(impl, stored, scale, b=1, n0=16, length=48, h=2)


@check_case(NAME, "per-tensor scale, e4m3: the bytes reinterpreted as float8e4nv")
def _tensor_e4m3(impl, gen):
    stored, scale, _ = make_cache(gen, torch.float8_e4m3fn, "tensor")
    check_tile(impl, stored, scale, b=0, n0=32, length=48, h=1)


@check_case(NAME, "per-head scales, int8 and e4m3: the scale of the tile's own KV head h")
def _head(impl, gen):
    for dtype, h in ((torch.int8, 3), (torch.float8_e4m3fn, 2)):
        stored, scale, _ = make_cache(gen, dtype, "head")
        check_tile(impl, stored, scale, b=1, n0=0, length=48, h=h)


@check_case(NAME, "per-token scales [B, L, H_kv], a 16 × 16 tile: key j's scale multiplies row j", points=2)
def _token(impl, gen):
    for dtype in (torch.int8, torch.float8_e4m3fn):
        stored, scale, _ = make_cache(gen, dtype, "token", D=16)
        check_tile(impl, stored, scale, b=1, n0=16, length=48, h=1)


@check_case(NAME, "per-token scales, D = 32 (a tile of 16 keys × 32 channels)")
def _token_wide(impl, gen):
    stored, scale, _ = make_cache(gen, torch.int8, "token", D=32)
    check_tile(impl, stored, scale, b=0, n0=32, length=48, h=3)


@check_case(NAME, "the last tile of a sequence of 37 keys: keys past the end (NaN bytes and scales) give rows of 0")
def _tail(impl, gen):
    for dtype, gran in ((torch.float8_e4m3fn, "token"), (torch.float8_e4m3fn, "tensor"), (torch.int8, "head")):
        stored, scale, lens = make_cache(gen, dtype, gran, lengths=[48, 37])
        check_tile(impl, stored, scale, b=1, n0=32, length=lens[1], h=2)


def _decode_case(impl, gen, dtype, k_gran, v_gran, lengths, H_q, H_kv, D):
    B, L = len(lengths), max(max(lengths), 1)
    k8, ks, _ = make_cache(gen, dtype, k_gran, B=B, L=L, H_kv=H_kv, D=D, lengths=lengths)
    v8, vs, _ = make_cache(gen, dtype, v_gran, B=B, L=L, H_kv=H_kv, D=D, lengths=lengths)
    q = randn(gen, B, H_q, D)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = launch("a decode loop with your dequant_tile", lambda: decode_8bit(q, k8, v8, ks, vs, lens,
                                                                                  dequant=impl))
    ref_o, ref_l = reference_attention(q, dequantize_kv(k8, ks, torch.float64), dequantize_kv(v8, vs, torch.float64),
                                       lens)
    what = (f"decode over a {dtype} cache (K per {k_gran}, V per {v_gran}), H {H_q}:{H_kv}, D={D}, "
            f"lengths {lengths}")
    assert_close(out, ref_o, f"{what}: out", 2e-5, 2e-5)
    assert_close(lse, ref_l, f"{what}: lse", 2e-5, 1e-5)


@check_case(NAME, "inside a decode loop (your load for every K and V tile, then the tile update): mixed "
                  "granularities, ragged lengths 0, 5, 37, 64, group 4", timeout_s=90, points=2)
def _decode(impl, gen):
    lengths = [0, 5, 37, 64]
    _decode_case(impl, gen, torch.float8_e4m3fn, "head", "token", lengths, H_q=8, H_kv=2, D=32)
    _decode_case(impl, gen, torch.int8, "token", "tensor", lengths, H_q=8, H_kv=2, D=32)

