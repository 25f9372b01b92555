r"""Quantize on append: a step's new K and V written into an 8-bit :class:`~fdlib.hf.DecodeCache` by one fused
Triton kernel, each token quantized as it is written (no 16-bit copy of the cache is ever made).

Program (row, h) takes token ``row`` = b·T + t of the step and KV head h, for K and for V: its D values x (a pad
token's are zeroed), its scale s, and the stored :math:`\hat x = x / s`, rounded to the cache's grid, at the
token's slot (:meth:`DecodeCache.begin_step`):

* per-token scales (``"token"``): :math:`s = \max_d |x_d| / q_{max}` (1 for a row of zeros), written beside the
  token, exactly :func:`fdlib.quant.quantize_kv`'s ``"token"`` scale (the division correctly rounded, at least
  2^-126: :func:`fdlib.quant.absmax_scale`);
* per-head or per-tensor scales (``"head"``, ``"tensor"``): s is fixed (read from a float32 ``[H_kv]``), and a
  value beyond :math:`q_{max} s` saturates at :math:`\pm q_{max}`.

Rounding is :func:`~fdlib.quant.quantize_kv`'s: int8 to the nearest integer (ties to even) after clamping to
±127; e4m3 to the nearest e4m3 value (ties to even) after clamping to ±448, computed in float32 and then cast
(the value is then exact in e4m3, so the cast cannot round again). No host sync, fixed shapes: a step's append
captures in a CUDA graph.

**A token that is not finite.** A 16-bit cache keeps a NaN or an infinity, and a query that reads it gets a
NaN or infinite output (:math:`q\cdot k` is ±∞ or NaN, the softmax of +∞ NaN, and :math:`p\,v` ±∞ or NaN). An
8-bit cache keeps it too, as a NaN (:mod:`fdlib.hf.kv8` states what decode then gives): let F be the token's
finite values (:math:`|x_d| < \infty`) and :math:`x^F` the token with every other value set to 0.

* per-token scales: s is the scale of :math:`x^F`, the stored values are :math:`x^F / s` on the grid (0 where x
  was not finite), and the scale written is NaN when F misses any d: the dequantized token
  :math:`\hat x\cdot s` is NaN in every value;
* e4m3 with fixed scales: :math:`x^F/s` on the grid where x is finite, and e4m3's NaN (the byte 0x7F) where it
  is not (±∞ too: e4m3fn has no infinity, and the softmax of an infinite logit is NaN anyway). The byte is
  written as such, so it does not depend on how a cast, or a clamp before it, treats a NaN (a GPU's
  minimum returns its non-NaN operand);
* int8 with fixed scales: no byte stands for NaN, so the stored values are :math:`x^F/s` on the grid, and the
  token's position p (in its sequence) is recorded: :math:`f_{bh} \leftarrow \min(f_{bh}, p)` in the layer's
  ``nonfinite_from`` (int32 ``[B_max, H_kv]``, an atomic minimum: the same result in any order), and decode
  makes the outputs NaN of sequence b in the query heads of KV head h once :math:`f_{bh} < L_b`
  (:mod:`fdlib.hf.kv8`).

Finite tokens are stored exactly as before (bit for bit :func:`~fdlib.quant.quantize_kv`), and a pad token,
zeroed first, is always finite.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import MIN_SCALE, QMAX

SCALE_FLOOR = tl.constexpr(MIN_SCALE)
"""The least scale (:data:`fdlib.quant.MIN_SCALE`, 2^-126), as the kernel reads it."""
E4M3_NAN = tl.constexpr(0x7F)
"""The byte of e4m3fn's NaN (S.1111.111 with S = 0), as ``torch.tensor(nan).to(torch.float8_e4m3fn)`` makes it."""


@triton.jit
def _round_even(x):
    """x rounded to the nearest integer, ties to even (as torch.round), in float32."""
    r = tl.floor(x + 0.5)
    return tl.where(((r - x) == 0.5) & ((r - 2 * tl.floor(r * 0.5)) != 0), r - 1, r)


@triton.jit
def _to_grid(x, INT8: tl.constexpr):
    """x (float32, finite, already divided by its scale) clamped and rounded to the int8 or e4m3 grid, still
    float32."""
    if INT8:
        return _round_even(tl.minimum(tl.maximum(x, -127.0), 127.0))
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    e = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF           # the biased exponent (x is finite)
    ulp = ((tl.maximum(e, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)   # e4m3: 3 mantissa bits, min normal 2^-6
    return _round_even(tl.math.div_rn(x, ulp)) * ulp   # a power of two: exact, in every rounding mode


@triton.jit
def _append_one(X, sx_b, sx_h, sx_t, OUT, so_row, so_h, S, ss_row, ss_h, NF, snf_b, b, t, h, slot, pos, real,
                D: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, TOKEN: tl.constexpr,
                INT8: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    x = tl.load(X + b * sx_b + h * sx_h + t * sx_t + d, mask=d < D, other=0.0).to(tl.float32)
    x = tl.where(real, x, 0.0)
    finite = tl.abs(x) < float("inf")                         # False at NaN and at ±inf
    bad = tl.max(tl.where(finite, 0, 1), axis=0) != 0         # any value of the token not finite
    x = tl.where(finite, x, 0.0)                              # x^F (module doc)
    if TOKEN:
        amax = tl.max(tl.abs(x), axis=0)
        # quantize_kv's scale (fdlib.quant.absmax_scale): correctly rounded division (Triton's `/` on float32
        # compiles to an approximate one), never below MIN_SCALE
        s = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, QMAX * 1.0), SCALE_FLOOR), 1.0)
        tl.store(S + slot * ss_row + h * ss_h, tl.where(bad, float("nan"), s))
    else:
        s = tl.load(S + h * ss_h)
    y = _to_grid(tl.math.div_rn(x, s), INT8)
    if INT8:
        tl.store(OUT + slot * so_row + h * so_h + d, y.to(tl.int8), mask=d < D)
        if not TOKEN:
            tl.atomic_min(NF + b * snf_b + h, pos, mask=bad)
    else:   # OUT is the e4m3 cache's bytes
        y = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if not TOKEN:
            y = tl.where(finite, y, E4M3_NAN)
        tl.store(OUT + slot * so_row + h * so_h + d, y, mask=d < D)


@triton.jit
def _append_kernel(K, sk_b, sk_h, sk_t, V, sv_b, sv_h, sv_t, SLOTS, REAL, POS, T,
                   KO, VO, so_row, so_h, KS, ks_row, ks_h, VS, vs_row, vs_h, NF, snf_b,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, TOKEN: tl.constexpr,
                   INT8: tl.constexpr, HAS_REAL: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    b = row // T
    t = row % T
    slot = tl.load(SLOTS + row)
    pos = 0
    if INT8 and not TOKEN:
        pos = tl.load(POS + row).to(tl.int32)
    real = True
    if HAS_REAL:
        real = tl.load(REAL + row) != 0
    _append_one(K, sk_b, sk_h, sk_t, KO, so_row, so_h, KS, ks_row, ks_h, NF, snf_b, b, t, h, slot, pos, real,
                D, BLOCK_D, QMAX, TOKEN, INT8)
    _append_one(V, sv_b, sv_h, sv_t, VO, so_row, so_h, VS, vs_row, vs_h, NF, snf_b, b, t, h, slot, pos, real,
                D, BLOCK_D, QMAX, TOKEN, INT8)


def append_kv8(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, real: torch.Tensor | None,
               k_out: torch.Tensor, v_out: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
               token: bool, positions: torch.Tensor | None = None, nonfinite_from: torch.Tensor | None = None) -> None:
    """Quantize the new ``k``/``v`` (HF's ``[B, H_kv, T, D]``, any strides) into ``k_out``/``v_out`` (8-bit,
    ``[..., H_kv, D]``; ``slots`` int64 ``[B·T]``: each token's row of ``k_out.view(-1, H_kv, D)``); ``real``
    (bool ``[B, T]`` or None): pad tokens are written as zeros. ``token``: per-token scales, written into
    ``k_scale``/``v_scale`` (float32, the caches' shape without D) at the same rows; else the fixed float32
    ``[H_kv]`` scales are read. An int8 cache with fixed scales also takes ``positions`` (int64 ``[B·T]``: each
    token's place in its sequence) and ``nonfinite_from`` (int32 ``[B_max, H_kv]``, K's and V's together), where
    a token that is not finite records its position (module doc). One launch, grid (B·T, H_kv)."""
    B, H, T, D = k.shape
    k, v = (x if x.stride(3) == 1 else x.contiguous() for x in (k, v))
    int8 = k_out.dtype == torch.int8
    if int8 and not token and (positions is None or nonfinite_from is None):
        raise ValueError("positions/nonfinite_from: an int8 cache with fixed scales records where a token that is "
                         "not finite lies; pass both")
    ko, vo = (o.view(-1, H, D) if int8 else o.view(torch.uint8).view(-1, H, D) for o in (k_out, v_out))
    ks = k_scale.view(-1, H) if token else k_scale.view(1, H)
    vs = v_scale.view(-1, H) if token else v_scale.view(1, H)
    nf = nonfinite_from if int8 and not token else ks   # never read unless int8 with fixed scales
    real_arg = real.reshape(-1).view(torch.uint8) if real is not None else slots
    pos = positions if int8 and not token else slots
    _append_kernel[(B * T, H)](
        k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2), slots, real_arg, pos, T,
        ko, vo, ko.stride(0), ko.stride(1), ks, ks.stride(0), ks.stride(1), vs, vs.stride(0), vs.stride(1),
        nf, nf.stride(0),
        D=D, BLOCK_D=triton.next_power_of_2(D), QMAX=QMAX[k_out.dtype], TOKEN=token,
        INT8=int8, HAS_REAL=real is not None)
