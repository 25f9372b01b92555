r"""8-bit KV caches: K and V stored in ``torch.float8_e4m3fn`` or ``torch.int8``, each with its scales.

An 8-bit cache holds stored values :math:`\hat k` and scales σ; the value it stands for is

.. math::  k = \text{float}(\hat k)\cdot \sigma,

with σ one float for the whole tensor (``"tensor"``, as vLLM and FlashInfer keep it), one per KV head
(``"head"``, a float32 tensor ``[H_kv]``), or one per token and KV head (``"token"``, a float32 tensor of the
cache's shape without D: ``[B, L_max, H_kv]``, or ``[n_pages, page_size, H_kv]`` for pages). V likewise; K and V
may have different granularities. q and out stay float16 or bfloat16. Decode reads the whole cache once a step
and little else, so half the bytes allow half the time.

Where the kernels apply the scales (:mod:`fdlib.kernels.tile`): a tile is loaded in 8 bits and converted to q's
dtype in registers (exact: every e4m3 and every int8 value is an fp16 and a bf16 value), so ``tl.dot`` stays
fp16/bf16, and

* K: :math:`s_j = \text{scale}\; q\cdot k_j = (\text{scale}\cdot \sigma_K)\,(q\cdot\hat k_j)`: a per-tensor or per-head
  :math:`\sigma_K` is folded into the softmax scale; a per-token :math:`\sigma_{K,j}` multiplies column j of the logits.
* V: :math:`O = \sum_j p_j\, \sigma_{V,j}\, \hat v_j / \ell`: a per-tensor or per-head :math:`\sigma_V` multiplies the
  output (one factor with 1/ℓ); a per-token one multiplies the weights :math:`p_j` before their product with V (ℓ
  sums the unscaled :math:`p_j`).

:func:`quantize_kv` makes such a cache from a 16- or 32-bit one. This module also checks the scales a call passes
(:func:`check_cache`, :func:`check_run`) and turns them into launch arguments (:class:`KVQuant`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .validate import FLOAT32_MAX, beyond_float32, fits_float32, shown

KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
"""The 8-bit cache dtypes the kernels read."""
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
"""The largest stored magnitude :func:`quantize_kv` maps a tensor's, head's or token's absolute maximum to: e4m3's
largest finite value, and 127 for int8 (symmetric, so −128 is never stored)."""
MIN_SCALE = 2.0 ** -126
"""The smallest scale :func:`quantize_kv` makes: float32's smallest normal number (a subnormal scale may be
flushed to 0 on a GPU; a group whose max|x|/q_max lies below this keeps this scale)."""
GRANULARITIES = ("tensor", "head", "token")
SCALE_CODES = {None: 0, "tensor": 1, "head": 2, "token": 3}
"""The kernels' K_SCALE / V_SCALE constexprs (:data:`fdlib.kernels.tile.SCALE_TENSOR` ...); 0: a 16-bit cache."""
SCALE_BYTES = 4
"""Bytes of one float32 scale."""
SCALE_FORMS = ("a float (per tensor), a float32 tensor [H_kv] (per KV head) or a float32 tensor of the cache's shape "
               "without D (per token and KV head)")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------ quantizing
def quantize_kv(x: torch.Tensor, dtype=torch.float8_e4m3fn, granularity: str = "tensor"):
    r"""(stored, scale): ``x`` ``[..., H_kv, D]`` (a cache ``[B, L, H_kv, D]`` or a page pool) in ``dtype`` with its
    scales, such that ``stored.float() * scale`` (broadcast over D, :func:`dequantize_kv`) approximates x.

    Absmax scaling: over each group of values that share a scale (the whole tensor, one KV head, or one token's
    head: its D values), :math:`\sigma = \max(\max|x| / q_{max},\ 2^{-126})` with :math:`q_{max}` = 448 for e4m3 and
    127 for int8 (:data:`QMAX`), and :math:`\hat x = x/\sigma` rounded to the nearest stored value (e4m3: PyTorch's
    cast, round to nearest even, after clamping to ±448; int8: ``torch.round``, then clamped to ±127). A group of
    zeros, or one with no value (an empty x: the result is empty too, its scales 1), gets σ = 1. No scale lies below
    :data:`MIN_SCALE` = 2^-126, float32's smallest normal number: a group of values so tiny that max|x|/q_max would
    be subnormal (or round to 0) keeps the scale 2^-126 and is stored on that grid, within the bound below (a
    subnormal scale, which GPUs may flush to 0, is never made). Every value then lies within half a step of its
    group's grid: :math:`|\hat x \sigma - x| \le \sigma/2` for int8, and for e4m3 within half an e4m3 ulp of
    :math:`x/\sigma` (a relative 2^-4 for normal values, an absolute :math:`2^{-10}\sigma` below
    :math:`2^{-6}\sigma`), scaled by σ.

    x must be finite: a NaN or an infinity (or, in a float64 x, which is quantized through float32, a value beyond
    float32's range) raises ``ValueError`` naming ``x`` and the first such element (an 8-bit cache cannot stand for
    it: int8 has no NaN, and it would poison its group's scale). Checking costs one read of a
    flag from x's device (a sync), as the per-tensor scale's read does.

    Returns ``scale`` as a Python float for ``"tensor"`` (read back from the device: one sync), a float32
    tensor ``[H_kv]`` for ``"head"``, and a float32 tensor ``x.shape[:-1]`` for ``"token"``, on x's device.

    The error this costs against the unquantized cache, per dtype and granularity, on N(0, 1) data and on data
    with outlier channels, is in ``results/cpu/quant-error.md`` (CPU float64 arithmetic, no GPU involved;
    ``python tools/quant_error.py`` writes it; the lab notes ``results/notes/09_fewer_bytes.md`` discuss it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in KV_DTYPES:
        raise TypeError(f"x: expected a float16, bfloat16 or float32 tensor to quantize, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x: expected [..., H_kv, D] (e.g. a cache [B, L, H_kv, D]), got shape {list(x.shape)}")
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype: expected torch.float8_e4m3fn or torch.int8, got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    amax = _group_max(x, granularity).float()
    if granularity == "tensor" and not math.isfinite(float(amax)) or \
            granularity != "tensor" and not bool(torch.isfinite(amax).all()):
        # a float64 x is quantized through float32: a finite value beyond its range is as bad as an infinity
        i = (~torch.isfinite(x) | (x.abs() > FLOAT32_MAX)).nonzero()[0].tolist()
        bad = x[tuple(i)].item()
        raise ValueError(f"x: expected finite values to quantize, got {bad} at {i}"
                         + beyond_float32(bad))
    qmax = QMAX[dtype]
    scale = absmax_scale(amax, qmax)
    y = x.to(torch.float32, copy=True)   # never x itself (a float32 x is divided in place below)
    y /= scale[..., None] if granularity == "token" else scale[:, None] if granularity == "head" else scale
    if dtype == torch.int8:
        y.round_()
    stored = y.clamp_(-qmax, qmax).to(dtype)
    if granularity == "tensor":
        return stored, float(scale)
    return stored, scale.contiguous()


def absmax_scale(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    r"""float32 :math:`\sigma = \max(\text{amax} / q_{max},\ 2^{-126})`, or 1 where amax = 0: the scale of a group
    whose largest magnitude is amax (:func:`quantize_kv`, the per-head and per-tensor calibration of
    :class:`fdlib.hf.DecodeCache`). The division is correctly rounded on every device: q_max is divided as a tensor
    on amax's device, since PyTorch's CUDA division by a Python number multiplies by its rounded reciprocal,
    which can differ in the last bit (the fused append kernel divides with ``div_rn`` alike,
    :mod:`fdlib.hf.append`)."""
    amax = amax.float()
    return torch.where(amax > 0, (amax / amax.new_tensor(float(qmax))).clamp_(min=MIN_SCALE), torch.ones_like(amax))


def _group_max(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max|x| over each group that shares a scale, in x's dtype (exact): ``[]`` (tensor), ``[H_kv]`` (head) or
    ``x.shape[:-1]`` (token); 0 for a group with no value (an empty x)."""
    shape = () if granularity == "tensor" else (x.shape[-2],) if granularity == "head" else x.shape[:-1]
    if x.numel() == 0:
        return x.new_zeros(shape)
    a = x.abs()
    if granularity == "tensor":
        return a.amax()
    if granularity == "head":
        return a.transpose(-2, 0).reshape(x.shape[-2], -1).amax(1)
    return a.amax(-1)


def dequantize_kv(stored: torch.Tensor, scale, dtype=torch.float32) -> torch.Tensor:
    """``stored.float() * scale``, the scale broadcast over D (and over tokens, for a per-head scale ``[H_kv]``): the
    cache an 8-bit cache stands for, in ``dtype`` (float32; float64 gives the exact products, for references).
    ``stored`` ``[..., H_kv, D]`` of an 8-bit dtype; ``scale`` as :func:`quantize_kv` returns it: a finite positive
    float, a float32 tensor ``[H_kv]`` or ``stored.shape[:-1]``, on stored's device (its values are not read)."""
    check_dequantize(stored, scale, dtype)
    s = scale
    if isinstance(s, torch.Tensor):
        s = (s[:, None] if s.dim() == 1 else s[..., None]).to(dtype)
    return stored.to(dtype) * s


# ------------------------------------------------------------------------------------------------ checking
def check_dequantize(stored, scale, dtype) -> None:
    """:func:`dequantize_kv`'s arguments (metadata, and a float scale's value), each error naming the argument."""
    if not isinstance(stored, torch.Tensor):
        raise TypeError(f"stored: expected a torch.Tensor, got {type(stored).__name__}")
    if stored.dtype not in KV_DTYPES:
        raise TypeError(f"stored: expected an 8-bit cache (torch.float8_e4m3fn or torch.int8), got {stored.dtype}")
    if stored.dim() < 2:
        raise ValueError(f"stored: expected [..., H_kv, D], got shape {list(stored.shape)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in KV_DTYPES:
        raise TypeError(f"dtype: expected a float dtype (torch.float32, or torch.float64 for references), got {dtype}")
    granularity_of("scale", scale, stored, read=False)


def granularity_of(name: str, scale, cache: torch.Tensor, paged: bool = False, read: bool = True) -> str:
    """``"tensor"``, ``"head"`` or ``"token"`` for a scale of ``cache`` [..., H_kv, D] (checked: type, dtype,
    device, shape; a float's value, finite and positive as the float32 the kernels take; a per-head tensor's
    values where it is on the host and ``read``). ``name``: the argument, for the error; ``paged``: the cache is a
    page pool."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise TypeError(f"{name}: expected a float (per tensor) or a float32 tensor (per KV head or per token), got "
                        f"{type(scale).__name__}")
    if not isinstance(scale, torch.Tensor):
        if not fits_float32(scale) or scale <= 0:
            raise ValueError(f"{name}: expected a finite positive float, got {shown(scale)}" + beyond_float32(scale))
        return "tensor"
    H_kv = cache.shape[-2]
    token_shape = tuple(cache.shape[:-1])
    if scale.dim() == 1 and scale.shape[0] == H_kv:
        kind = "head"
    elif tuple(scale.shape) == token_shape:
        kind = "token"
    else:
        lead = ("[n_pages, page_size, H_kv] = " if paged else "[B, L_max, H_kv] = ") if cache.dim() == 4 else ""
        raise ValueError(f"{name}: expected a float (per tensor), a float32 tensor [H_kv] = [{H_kv}] (per KV head) or "
                         f"{lead}{list(token_shape)} (per token and KV head: the cache's shape without D), got "
                         f"shape {list(scale.shape)}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: dtype must be torch.float32, got {scale.dtype}")
    if scale.device != cache.device:
        raise ValueError(f"{name}: must be on the cache's device ({cache.device}), got a tensor on {scale.device}")
    if kind == "head" and scale.device.type == "cpu" and read:
        check_values(name, scale)
    return kind


def check_values(name: str, scale) -> None:
    """A per-head scale's values: finite and positive (reads the tensor: free on the host, one device-to-host
    copy on a GPU). Per-token scales are read only at the keys the lengths cover, like K and V themselves: a NaN
    there makes that sequence's output NaN, as a NaN in K would."""
    if isinstance(scale, torch.Tensor) and scale.dim() == 1:
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"{name}: per-head scales must be finite and positive, got {float(scale[i])} at KV head "
                             f"{i}")


@dataclass(frozen=True)
class KVQuant:
    """An 8-bit cache's format: its dtype and the granularity of K's and V's scales. A plan holds one; the cost
    model reads :attr:`itemsize` and :attr:`scale_bytes` as it reads a dtype's itemsize."""
    dtype: torch.dtype
    k: str
    v: str

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of scales a step reads per key and KV head, K's and V's together (per-token scales only: a
        per-head scale is one load a program)."""
        return SCALE_BYTES * ((self.k == "token") + (self.v == "token"))

    def __str__(self) -> str:
        k, v = self.k, self.v
        return f"{_dtype_name(self.dtype)} cache, scales per {k}" + ("" if k == v else f" (K) and per {v} (V)")


def scale_bytes(dtype) -> int:
    """Bytes of scales per key and KV head of a cache format (0 for a plain dtype)."""
    return dtype.scale_bytes if isinstance(dtype, KVQuant) else 0


def is_8bit(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in KV_DTYPES


def check_cache(q, k_cache, v_cache, k_scale, v_scale, paged: bool = False, read: bool = True) -> KVQuant | None:
    """The format of the cache a call passes: None for a 16- or 32-bit one (then no scale may be given), else its
    :class:`KVQuant`, with both caches 8-bit of one dtype, q float16 or bfloat16 and each scale checked
    (:func:`granularity_of`; ``read=False`` reads no tensor's values, as a trace under ``torch.compile`` must
    not)."""
    if not (is_8bit(k_cache) or is_8bit(v_cache)):
        for name, s, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
            if s is not None:
                raise ValueError(f"{name}: scales are for 8-bit caches ({', '.join(map(_dtype_name, KV_DTYPES))}); "
                                 f"{name[0]}_cache is {_dtype_name(cache.dtype)}. Pass {name}=None, or the 8-bit cache "
                                 f"(fdlib.quantize_kv makes one)")
        return None
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache/v_cache: an 8-bit cache stores K and V in one dtype, got k_cache "
                        f"{_dtype_name(k_cache.dtype)}, v_cache {_dtype_name(v_cache.dtype)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q: with an 8-bit cache ({_dtype_name(k_cache.dtype)}) q must be float16 or bfloat16 (the "
                        f"tiles are dequantized to q's dtype), got {_dtype_name(q.dtype)}")
    kinds = []
    for name, s, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if s is None:
            raise ValueError(f"{name}: {name[0]}_cache is {_dtype_name(cache.dtype)}, an 8-bit cache: pass its scale, "
                             f"{SCALE_FORMS}; fdlib.quantize_kv returns it")
        kinds.append(granularity_of(name, s, cache, paged, read))
    return KVQuant(k_cache.dtype, *kinds)


def plan_format(kv_dtype, k_scale, v_scale, q_dtype=torch.float16) -> KVQuant | None:
    """The cache format a :func:`fdlib.plan` is made for: ``kv_dtype`` None (K/V in q's dtype; no scale may be
    named) or an 8-bit dtype, with each of ``k_scale``/``v_scale`` a granularity name (default ``"tensor"``), and
    q (``q_dtype``) float16 or bfloat16."""
    if kv_dtype is None:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name}: a scale granularity is for an 8-bit cache; pass kv_dtype="
                                 f"torch.float8_e4m3fn or torch.int8 too, got kv_dtype=None")
        return None
    if kv_dtype not in KV_DTYPES:
        raise TypeError(f"kv_dtype: expected None (K/V in q's dtype), torch.float8_e4m3fn or torch.int8, got "
                        f"{kv_dtype}")
    if q_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype: with an 8-bit cache (kv_dtype={kv_dtype}) q must be float16 or bfloat16 (the tiles "
                        f"are dequantized to q's dtype), got {q_dtype}")
    kinds = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        s = "tensor" if s is None else s
        if s not in GRANULARITIES:
            raise ValueError(f"{name}: a plan takes the scale's granularity, one of "
                             f"{', '.join(map(repr, GRANULARITIES))}, got {s!r} (the scale itself goes to run)")
        kinds.append(s)
    return KVQuant(kv_dtype, *kinds)


def check_run(kv: KVQuant | None, k_cache, v_cache, k_scale, v_scale, paged: bool = False) -> None:
    """A :meth:`fdlib.plan.DecodePlan.run` call's scales against its plan's format ``kv`` (the caches' shapes,
    dtypes and devices are the plan's own checks)."""
    if kv is None:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name}: this plan is for a 16-bit cache; make the plan with fdlib.plan(..., "
                                 f"kv_dtype=..., k_scale=..., v_scale=...) for an 8-bit one")
        return
    for name, s, cache, want in (("k_scale", k_scale, k_cache, kv.k), ("v_scale", v_scale, v_cache, kv.v)):
        if s is None:
            raise ValueError(f"{name}: {name[0]}_cache is {_dtype_name(kv.dtype)}, an 8-bit cache ({kv}): pass its "
                             f"scale, {SCALE_FORMS}")
        got = granularity_of(name, s, cache, paged)
        if got != want:
            raise ValueError(f"{name}: this plan was made for scales per {want}, got one per {got}; make a plan "
                             f"with fdlib.plan(..., {name}={got!r})")


def scale_modes(kv: KVQuant | None) -> tuple:
    """(K_SCALE, V_SCALE) of the kernels for a cache format (:data:`SCALE_CODES`; (0, 0) for a 16-bit cache)."""
    return (0, 0) if kv is None else (SCALE_CODES[kv.k], SCALE_CODES[kv.v])


def layout(k_scale, v_scale) -> tuple:
    """What a call's launch depends on in its scales besides their addresses (:meth:`~fdlib.plan.DecodePlan.run`'s
    replay key): a float's value (it is a launch argument), a tensor's shape, strides, dtype and device."""
    if k_scale is None and v_scale is None:   # a 16-bit cache: every call of a decode step
        return None, None

    def one(s):
        if isinstance(s, torch.Tensor):
            return s.shape, s.stride(), s.dtype, s.device
        return s if s is None or isinstance(s, (int, float)) and not isinstance(s, bool) else ("unchecked", id(s))
    return one(k_scale), one(v_scale)


def scale_key(s):
    """What :func:`fdlib.api.plan_for`'s plan cache tells scales apart by: None, a number (per tensor), or a
    tensor's rank (1: per head, 3: per token); the plan checks the rest on every run."""
    if isinstance(s, torch.Tensor):
        return s.dim()
    return None if s is None else "number" if isinstance(s, (int, float)) else type(s).__name__


def tensors(k_scale, v_scale) -> tuple:
    """The scale tensors of a call, None for a float or an absent scale (the launch's pointer roles)."""
    if k_scale is None and v_scale is None:
        return None, None
    return tuple(s if isinstance(s, torch.Tensor) else None for s in (k_scale, v_scale))


def launch_args(kv: KVQuant | None, k_scale, v_scale, flag) -> tuple:
    """(K's factor for the softmax scale, pointers (KS, VS), scalars (K's batch-or-page, slot and head strides,
    V's, v_mul), constexprs (K_SCALE, V_SCALE)) of a launch: a per-tensor K scale multiplies the softmax scale on
    the host, a per-tensor V scale is v_mul; a per-head scale has strides (0, 0, stride), a per-token one its
    tensor's; an absent tensor's pointer is the plan's flag (never read)."""
    if kv is None:
        return 1.0, (flag, flag), (0, 0, 0, 0, 0, 0, 1.0), (0, 0)
    ptrs, strides = [], []
    for s, kind in ((k_scale, kv.k), (v_scale, kv.v)):
        if kind == "tensor":
            ptrs.append(flag)
            strides += [0, 0, 0]
        elif kind == "head":
            ptrs.append(s)
            strides += [0, 0, s.stride(0)]
        else:
            ptrs.append(s)
            strides += list(s.stride())
    k_mul = float(k_scale) if kv.k == "tensor" else 1.0
    v_mul = float(v_scale) if kv.v == "tensor" else 1.0
    return k_mul, tuple(ptrs), (*strides, v_mul), (SCALE_CODES[kv.k], SCALE_CODES[kv.v])


__all__ = ["quantize_kv", "dequantize_kv", "KVQuant", "KV_DTYPES", "QMAX", "GRANULARITIES", "check_cache",
           "check_run", "plan_format", "launch_args", "check_values", "scale_modes"]
