"""8-bit KV caches in the benchmark: ``--kv-dtype float8_e4m3fn|int8 --kv-scale tensor|head|token`` on the dense grid
(``python -m fdlib.bench``) and on the ragged one (``--ragged``).

Each shape's 16-bit K and V are quantized (:func:`fdlib.quantize_kv`, K and V alike); fdlib's methods read the 8-bit
cache with its scales, and the reference (and SDPA's peers, which take no 8-bit cache) the 16-bit cache it stands for,
``stored · scale`` in q's dtype. The bytes a step reads are the cache's own, :func:`bytes_per_key` a key and KV head:
2·D bytes of K and V, plus 4 for each of K and V scaled per token (a per-head or per-tensor scale is a few bytes a
program, not counted); effective bandwidth is those bytes over the time. The records carry ``kv_dtype`` and
``kv_scale``; a 16-bit run of the same grid (no ``--kv-dtype``) gives the times to compare with.
"""
from __future__ import annotations

import torch

from .. import quant

KV_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}
KV_SCALES = quant.GRANULARITIES


def check(kv_dtype: str | None, kv_scale: str | None) -> None:
    """The options' values (``kv_scale`` alone, without ``kv_dtype``, is an error)."""
    if kv_dtype is None:
        if kv_scale is not None:
            raise ValueError("--kv-scale: scales are for an 8-bit cache; give --kv-dtype too")
        return
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype: expected one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_scale is not None and kv_scale not in KV_SCALES:
        raise ValueError(f"--kv-scale: expected one of {', '.join(KV_SCALES)}, got {kv_scale!r}")


def shape_fields(kv_dtype: str | None, kv_scale: str | None) -> dict:
    """The fields a shape (and so each record) gets: none for a 16-bit cache."""
    return {} if kv_dtype is None else {"kv_dtype": kv_dtype, "kv_scale": kv_scale or "tensor"}


def fmt(shape: dict) -> quant.KVQuant | None:
    """The cache format of a shape (None: K and V in q's dtype)."""
    if "kv_dtype" not in shape:
        return None
    return quant.KVQuant(KV_DTYPES[shape["kv_dtype"]], shape["kv_scale"], shape["kv_scale"])


def bytes_per_key(shape: dict, elem_bytes: int) -> int:
    """Bytes fdlib reads a key and KV head: K and V, ``elem_bytes`` an element for a 16-bit cache, 1 and the per-token
    scales for an 8-bit one (:attr:`fdlib.quant.KVQuant.scale_bytes`)."""
    kv = fmt(shape)
    if kv is None:
        return 2 * shape["D"] * elem_bytes
    return 2 * shape["D"] * kv.itemsize + kv.scale_bytes


def quantize(k: torch.Tensor, v: torch.Tensor, shape: dict) -> tuple:
    """(K stored, V stored, K's scale, V's scale, K and V dequantized to their own dtype) of a shape's cache (a
    contiguous one or a page pool: per-token scales have its shape without D)."""
    kv = fmt(shape)
    (k8, ks), (v8, vs) = quant.quantize_kv(k, kv.dtype, kv.k), quant.quantize_kv(v, kv.dtype, kv.v)
    return k8, v8, ks, vs, quant.dequantize_kv(k8, ks).to(k.dtype), quant.dequantize_kv(v8, vs).to(v.dtype)


def clone(s):
    """A copy of a scale for another copy of the inputs (a float is one already)."""
    return s.clone() if isinstance(s, torch.Tensor) else s


def describe(shape_or_settings: dict) -> str | None:
    kv = fmt(shape_or_settings)
    return None if kv is None else (f"{kv}: fdlib reads the 8-bit cache; the reference and SDPA's peers the 16-bit "
                                    f"cache it stands for")
