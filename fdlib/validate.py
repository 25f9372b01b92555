"""Checks on the arguments of :func:`fdlib.decode_attention` and :func:`fdlib.plan`; every failure names the
argument, what was expected and what came. None of them reads a tensor's values from the GPU: the lengths'
values are checked on the host only when they are on the host (or when the caller asks, ``check_lengths=True``)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

METHODS = ("auto", "naive", "split", "unified", "persistent", "balanced", "streamk", "worklist")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


class Problem(NamedTuple):
    """A checked call: q as [B, H_q, D] (its first query token), and the sizes every method needs."""
    q: torch.Tensor
    B: int
    H_q: int
    H_kv: int
    group: int
    D: int
    L_max: int
    scale: float
    q_was_4d: bool
    page_size: int = 0
    """0: K/V are ``[B, L_max, H_kv, D]``; else pages ``[n_pages, page_size, H_kv, D]`` behind a block table."""
    q_len: int = 1
    """Query tokens per sequence (q ``[B, q_len, H_q, D]``)."""
    kv: object = None
    """An 8-bit cache's format (:class:`fdlib.quant.KVQuant`); None: K and V in q's dtype."""


def shape_str(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def check_bool(name: str, flag) -> None:
    """``flag`` is True or False (1, 1.0 or "yes" are not: ``TypeError`` naming ``name``)."""
    if flag is not True and flag is not False:
        raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")


def check_removed(validate) -> None:
    """``validate=``: the argument is gone; ``TypeError`` saying what replaced it."""
    if validate is not None:
        raise TypeError("validate: this argument is gone. Calls never read lengths back now (graph-safe by "
                        "default); pass check_lengths=True to check device lengths on the host, and max_seqlen= "
                        "to choose splits for a known bound")


def shown(x):
    """``x`` as an error message writes it: an int as a plain int. Under ``torch.compile`` an int option that
    changed between calls is symbolic, and a message cannot write it out; ``int`` makes it concrete (a guard on
    that value), which only the error's path pays, so valid values that change keep one trace."""
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else x


def check_max_seqlen(max_seqlen, L_max: int | None = None) -> None:
    """``max_seqlen``: None or an int (not a bool), in 0..L_max where L_max is given."""
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen: expected an int or None, got {type(max_seqlen).__name__}")
    if L_max is not None and not 0 <= max_seqlen <= L_max:
        raise ValueError(f"max_seqlen: expected an int in 0..L_max={L_max}, got {shown(max_seqlen)!r}")


def check_lengths_type(cache_seqlens, name: str = "cache_seqlens", optional: bool = True) -> None:
    """Lengths: a tensor, a list or tuple of ints (on the host), or None where ``optional``; ``TypeError`` naming
    ``name``."""
    if isinstance(cache_seqlens, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cache_seqlens):
            raise TypeError(f"{name}: a host list of lengths must hold ints")
    elif not (optional and cache_seqlens is None) and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, a list of ints or None, got {type(cache_seqlens).__name__}")


def check_unified_max(k_cache, k_scale, v_scale, batch_invariant, max_seqlen, check_lengths) -> None:
    """``method="unified_max"`` (:func:`fdlib.exact.unified_max_attention`, planned per call): no 8-bit cache, and
    the options that belong to the plan path at their defaults, each refused by name."""
    from .quant import KV_DTYPES
    if k_scale is not None or v_scale is not None or getattr(k_cache, "dtype", None) in KV_DTYPES:
        raise NotImplementedError("method: 'unified_max' does not read 8-bit caches yet; pass another method "
                                  "(every other one takes k_scale/v_scale)")
    for name, value, default in (("batch_invariant", batch_invariant, False), ("max_seqlen", max_seqlen, None),
                                 ("check_lengths", check_lengths, False)):
        if value is not default:
            raise ValueError(f"{name}: method='unified_max' takes the default ({default!r}), got {shown(value)!r}")


def check_method(method) -> None:
    if method == "unified_max":
        raise ValueError("method: 'unified_max' runs through fdlib.decode_attention or "
                         "fdlib.exact.unified_max_attention (planned per call); fdlib.plan takes one of "
                         + ", ".join(repr(m) for m in METHODS))
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(repr(m) for m in METHODS + ('unified_max',))}, "
                         f"got {method!r}")


def check_num_splits(num_splits, method) -> None:
    if num_splits is None:
        return
    from .kernels.config import MAX_SPLITS
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1 <= num_splits <= {MAX_SPLITS}, got {shown(num_splits)}")
    if method == "naive":
        raise ValueError("num_splits: method='naive' does not split the sequence; pass num_splits=None")
    if method == "persistent" and num_splits != 1:
        raise ValueError(f"num_splits: method='persistent' runs each row whole (one split); pass num_splits=None "
                         f"or 1, got {shown(num_splits)}")
    if method == "streamk" and num_splits != 1:
        raise ValueError(f"num_splits: method='streamk' cuts each KV head's tiles into equal shares, not rows into "
                         f"splits; pass num_splits=None or 1, got {shown(num_splits)}")


FLOAT32_MAX = torch.finfo(torch.float32).max
"""float32's largest finite value: a float the kernels take (the softmax scale, a per-tensor scale of an 8-bit
cache) is a float32 there, so a larger Python float would be infinite (Triton even types it float64)."""
FLOAT32_MAX_INT = int(FLOAT32_MAX)


def fits_float32(x) -> bool:
    """``x`` (an int or a float) is finite and no larger in magnitude than float32's largest value (an int of
    any size compares exactly, with the int of that value: none is converted to float, where a huge one would
    overflow, also in a ``torch.compile`` trace that holds the int symbolically)."""
    if isinstance(x, int):
        return abs(x) <= FLOAT32_MAX_INT
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


def beyond_float32(x) -> str:
    """A note for an error on a number ``x`` too large for float32 but not infinite or NaN (empty otherwise)."""
    big = (isinstance(x, int) or math.isfinite(x)) and not fits_float32(x)
    return f" (beyond float32's largest value, {FLOAT32_MAX:g}: the kernels take it as a float32)" if big else ""


def check_scale(scale, D: int, value: bool = True) -> float:
    """The scale to use: 1/√D for None, else a float finite in float32, as the kernels take it (``value=False``:
    its type only, as a trace under ``torch.compile`` checks a float that may be symbolic; the op checks the value
    when it runs)."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if value and not fits_float32(scale):
        raise ValueError(f"scale: expected a finite number, got {shown(scale)}" + beyond_float32(scale))
    return float(scale)


MAX_PAGE_SIZE = 256
MAX_Q_LEN = 16
"""Query tokens per sequence at most (speculative decoding verifies a few draft tokens a step)."""


def check_q_len(q_len, L_max: int) -> None:
    """q_len: an int from 1 to MAX_Q_LEN, and (several tokens, which are already in the cache) at most L_max."""
    if isinstance(q_len, bool) or not isinstance(q_len, int):
        raise TypeError(f"q_len: expected an int, got {type(q_len).__name__}")
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len: expected 1 <= q_len <= {MAX_Q_LEN} query tokens per sequence, got {q_len}")
    if q_len > 1 and q_len > L_max:
        raise ValueError(f"q_len: the {q_len} new tokens must already be in the cache (the last q_len of each "
                         f"sequence), so q_len <= L_max; got q_len={q_len} > L_max={L_max}")


def check_block_table(block_table, B: int, device) -> None:
    """A block table: int32 ``[B, max_pages]`` on q's device, rows of page indices (values are not read)."""
    check_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table: dtype must be torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [B={B}, max_pages >= 1], got {shape_str(block_table)}")
    if block_table.device != device:
        raise ValueError(f"block_table: must be on q's device ({device}), got {block_table.device}")
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError(f"block_table: rows must be contiguous (stride 1), got strides {tuple(block_table.stride())}")


PAGED_OFFSET_LIMIT = 1 << 32
"""Over pages the kernels compute a row's offset page·stride_page + slot·stride_slot from unsigned 32-bit values
(:func:`fdlib.kernels.tile.page_offsets`): a pool's page stride and its slot stride × page_size must stay below
this many elements (a row of a page holds H_kv·D elements, far below it)."""


def check_page_strides(name: str, t, page_size: int) -> None:
    """A paged pool ``t`` [n_pages, page_size, H_kv, D] whose strides the kernels' 32-bit offsets reach."""
    if t.stride(0) >= PAGED_OFFSET_LIMIT or t.stride(1) * page_size >= PAGED_OFFSET_LIMIT:
        raise ValueError(f"{name}: a paged pool's page stride and slot stride x page_size must be below 2**32 "
                         f"elements, got strides {tuple(t.stride())} with page_size={page_size}; lay the pool out "
                         f"as [n_pages, page_size, H_kv, D] (.contiguous())")


def check_pool(name: str, t) -> None:
    """A paged pool ``t`` [n_pages, page_size, H_kv, D] holds at least one page (an index is clamped into it)."""
    if t.shape[0] < 1:
        raise ValueError(f"{name}: the page pool holds no page (shape {shape_str(t)}); a paged cache needs at least "
                         f"one page, [n_pages >= 1, page_size, H_kv, D]")


def check_page_size(page_size) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1 \
            or page_size > MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"page_size: expected a power of two from 1 to {MAX_PAGE_SIZE}, got {page_size!r}")


def check_inputs(q, k_cache, v_cache, cache_seqlens, scale, method, num_splits, return_lse,
                 block_table=None, k_scale=None, v_scale=None) -> Problem:
    """Check the arguments of a :func:`fdlib.decode_attention` call (types, shapes, dtypes, devices, strides;
    the lengths' dtype, shape and device, not their values; the block table's, not its page indices) and
    return the sizes."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
    check_method(method)
    check_bool("return_lse", return_lse)

    q_was_4d = q.dim() == 4
    if q.dim() == 4:
        q_len = q.shape[1]
        if not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"q: a 4-D q is [B, q_len, H_q, D] with 1 <= q_len <= {MAX_Q_LEN} query tokens per "
                             f"sequence, got {shape_str(q)} (q_len={q_len})")
        q3 = q[:, 0]
    elif q.dim() == 3:
        q3, q_len = q, 1
    else:
        raise ValueError(f"q: expected [B, H_q, D] or [B, q_len, H_q, D], got {q.dim()}-D tensor of shape "
                         f"{shape_str(q)}")
    layout = "[B, L_max, H_kv, D]" if block_table is None else "pages [n_pages, page_size, H_kv, D]"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected {layout}, got {t.dim()}-D tensor of shape {shape_str(t)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {shape_str(k_cache)}, got {shape_str(v_cache)}")
    B, H_q, D = q3.shape
    Bk, L_max, H_kv, Dk = k_cache.shape
    page_size = 0
    if block_table is not None:
        check_block_table(block_table, B, q.device)
        page_size = L_max
        check_page_size(page_size)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_pool(name, t)
            check_page_strides(name, t, page_size)
        L_max = block_table.shape[1] * page_size
    elif Bk != B:
        raise ValueError(f"k_cache: batch size {Bk} does not match q's batch size {B}")
    if Dk != D:
        raise ValueError(f"k_cache: head dim {Dk} does not match q's head dim D={D}")
    if D < 1 or D > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D must be between 1 and {MAX_HEAD_DIM}, got {D}")
    if H_kv < 1:
        raise ValueError(f"k_cache: expected at least one KV head, got H_kv={H_kv} (shape {shape_str(k_cache)})")
    if H_q < 1 or H_q % H_kv:
        raise ValueError(f"q: H_q={H_q} query heads must be a positive multiple of the cache's H_kv={H_kv} KV heads")
    if B < 1:
        raise ValueError(f"q: batch size must be at least 1, got {B}")
    if q_len > 1 and q_len > L_max:
        raise ValueError(f"q: the {q_len} query tokens of q {shape_str(q)} must already be in the cache (its last "
                         f"q_len keys), so q_len <= L_max; got L_max={L_max}")

    from .quant import check_cache   # 8-bit caches and their scales (None: K/V in q's dtype, no scales)
    kv = check_cache(q, k_cache, v_cache, k_scale, v_scale, block_table is not None)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))[:1 if kv else 3]:
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype must be float16, bfloat16 or float32, got {t.dtype}")
    if kv is None and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
        raise TypeError(f"k_cache/v_cache: dtype must match q ({q.dtype}), got k_cache {k_cache.dtype}, "
                        f"v_cache {v_cache.dtype}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"k_cache/v_cache: must be on q's device ({q.device}), got k_cache on {k_cache.device}, "
                         f"v_cache on {v_cache.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name}: the last (head) dimension must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}; call .contiguous() first")

    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cache_seqlens: dtype must be torch.int32 or torch.int64, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(f"cache_seqlens: expected shape [{B}] (one length per sequence), got "
                             f"{shape_str(cache_seqlens)}")
        if cache_seqlens.device != q.device and cache_seqlens.device.type != "cpu":
            raise ValueError(f"cache_seqlens: must be on q's device ({q.device}) or on the host (CPU), got "
                             f"{cache_seqlens.device}")
    elif cache_seqlens is not None and not isinstance(cache_seqlens, (list, tuple)):
        check_lengths_type(cache_seqlens)

    check_num_splits(num_splits, method)
    return Problem(q3, B, H_q, H_kv, H_q // H_kv, D, L_max, check_scale(scale, D), q_was_4d, page_size, q_len, kv)
