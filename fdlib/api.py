"""``fdlib.decode_attention``: the one entry point that reaches every method.

Data flow: plan (once per shape, cached: :mod:`fdlib.plan`) -> run (launch only) -> out (, lse).
Under ``torch.compile`` the call goes through the registered op ``torch.ops.fdlib.decode_attention``, which runs
the eager call with every option (``block_table``, ``batch_invariant``, ``check_lengths``, 8-bit caches and their
scales, every method): a model step compiles with ``fullgraph=True``, paged or not, and gives the eager call's
bits; a bad argument raises the eager call's error, type and message (:mod:`fdlib.compiled`).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from . import quant
from .kernels.launch import heads_adjacent
from .kernels import launch as _launch_mod
from .plan import DecodePlan, call_layout, check_lengths_and_table, plan
from .compiled import traced_call
from .validate import check_bool, check_inputs, check_removed, check_unified_max

PLAN_CACHE_SIZE = 32
"""Plans decode_attention keeps (least recently used dropped first); each holds its workspace."""

_PLANS: OrderedDict = OrderedDict()
_CALLS: OrderedDict = OrderedDict()
"""A call's key (:func:`_call_key`) -> (its plan, the launches :meth:`DecodePlan.run` recorded for its layout):
a call laid out like one that ran goes straight to them (the plan cache's lookup and the run's checks were
passed by that call), the host time of a decode step being mostly Python."""
_FLAGS: dict = {}
"""device -> int32 [1]: the clamp flag that every plan of decode_attention on that device shares (:func:`clamped`)."""


def _flag(device) -> torch.Tensor:
    flag = _FLAGS.get(device)
    if flag is None:
        flag = _FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def clamped(reset: bool = True) -> bool:
    """Whether a :func:`decode_attention` call (any method, compiled or not) clamped something on the device since
    the last check: a device length outside 0..L_max, or a block-table entry outside the page pool that a
    sequence's length reaches (entries past a length are never read and never flagged). The calls record it in
    one flag a device, shared by all their plans, so it outlives the plan cache; reading it is one
    device-to-host copy a device (a sync): call it outside the hot loop and outside CUDA-graph capture.
    ``reset``: set the flags back to 0 after reading. A plan of your own (:func:`fdlib.plan`) keeps its flag:
    :meth:`fdlib.plan.DecodePlan.clamped`. To raise instead, pass ``check_lengths=True``."""
    if not isinstance(reset, bool):
        raise TypeError(f"reset: expected a bool, got {type(reset).__name__}")
    seen = False
    for flag in _FLAGS.values():
        if flag.item():
            seen = True
            if reset:
                flag.zero_()
    return seen


def decode_attention(q, k_cache, v_cache, cache_seqlens=None, *, block_table=None, scale=None, method="auto",
                     num_splits=None, return_lse=False, max_seqlen=None, check_lengths=False, batch_invariant=False,
                     validate=None, k_scale=None, v_scale=None):
    r"""Attention of one query token (or a few) per sequence against its KV cache.

    .. math::  O_{b,h} = \sum_{j < L_b} \operatorname{softmax}_j(\text{scale}\; q_{b,h}\cdot k_{b,j,h_{kv}})\; v_{b,j,h_{kv}},
               \qquad h_{kv} = \lfloor h/\text{group}\rfloor,\ \text{group} = H_q/H_{kv}

    Several query tokens per sequence (speculative decoding, multi-token prediction): q ``[B, q_len, H_q, D]``,
    1 <= q_len <= 16. The q_len new tokens are already the last q_len keys of each sequence's cache, and query t
    sees keys :math:`j \le L_b - q_{len} + t` (causal among the new tokens: ``flash_attn_with_kvcache``'s
    convention). A query whose limit is below 0 (:math:`L_b < q_{len} - t`) sees no key: out = 0, lse = -inf
    (never NaN). Every method takes it; each K/V tile is still read once per KV head.

    Args:
        q: ``[B, H_q, D]`` or ``[B, q_len, H_q, D]`` (the answer has q's shape).
        k_cache, v_cache: ``[B, L_max, H_kv, D]``, token-major; any strides with a contiguous last dim. Or a
            paged cache (vLLM/FlashInfer NHD pages): ``[n_pages, page_size, H_kv, D]`` with ``block_table``.
        block_table: int32 ``[B, max_pages]``: page j of sequence b holds its keys j·page_size ...
            (j+1)·page_size - 1, so L_max = max_pages·page_size; page_size a power of two from 1 to 256. Pages
            may be shared between sequences and listed in any order; entries past a sequence's length are
            never read (-1 is fine there). An index outside the pool that a length reaches is clamped on the
            device (never read outside it) and recorded in the flag that :func:`fdlib.clamped` reads, like a
            clamped length; ``check_lengths=True`` raises instead.
        cache_seqlens: the valid length of each sequence: int32/int64 ``[B]`` on q's device, or on the host
            (a CPU tensor or a list of ints); default: all L_max. Host lengths are checked on every call
            (``ValueError`` outside 0..L_max; reading them costs no device sync); on the CPU runtime (Triton's
            interpreter) q's device is the host, so there a CPU tensor is checked exactly as a list is.
        scale: multiplies q·k (default 1/√D).
        method: ``"auto"`` (splits from the cost model; the unified kernel, or the persistent one when every
            row is one split of a short cache and there are many rows: :func:`fdlib.splits.choose_kernel`; with
            lengths on the device and two or more sequences, stream-K, whose shares are made on the device:
            :func:`fdlib.plan.device_schedule_suits`),
            ``"unified"``, ``"split"`` (stage 1 + stage 2 kernels), ``"persistent"`` (one launch of a few
            programs per SM walking all rows, no split), ``"balanced"`` (ragged batches: the batch cut into work
            items of near-equal size on the device, :mod:`fdlib.schedule`), ``"streamk"`` (a few programs per
            SM, as many for every KV head, take equal shares of their head's tiles, rows cut wherever the
            shares fall: :mod:`fdlib.kernels.streamk`), ``"worklist"`` (each call's rows cut into at most
            ``num_splits`` pieces, default :data:`fdlib.plan.WORK_SPLITS`, listed longest first on the device from
            the lengths it finds, so a plan needs none: :mod:`fdlib.worklist`; pieces sized by the batch, or with
            ``batch_invariant=True`` by each row's own length), ``"naive"`` (PyTorch
            matmul-softmax-matmul) or ``"unified_max"`` (FlashDecoding++'s fixed-φ softmax with exact
            recomputation of rows whose logits leave the safe window: :func:`fdlib.exact.unified_max_attention`,
            φ estimated from each row's first keys; one query token, planned per call, not batch-invariant).
        num_splits: force the number of KV splits (1..256) instead of letting fdlib choose; at most one split
            per tile of keys is launched (:func:`fdlib.kernels.config.chunk_for`). ``"persistent"`` and
            ``"streamk"`` do not cut rows into splits and take only None or 1; ``"naive"`` only None.
        return_lse: also return lse ``q.shape[:-1]`` float32 (natural log): ``[B, H_q]``, or ``[B, q_len, H_q]``
            for a 4-D q.
        max_seqlen: a host bound on the lengths, a Python int in 0..L_max: splits are chosen as if every
            sequence were this long (default: the cache's capacity L_max). Only speed depends on it; longer rows
            are still right.
        check_lengths: read device lengths and the block table back and raise ``ValueError`` if a length lies
            outside 0..L_max (naming ``cache_seqlens``) or a table entry that a length reaches lies outside the
            pool (naming ``block_table``, with the sequence, the entry, its value and the pool's size); both are
            reduced on the device and read together: one device-to-host copy, a sync, not allowed in CUDA-graph
            capture. By default nothing is read: such a length or page index is clamped on the device and
            recorded in a flag that :func:`fdlib.clamped` reads. Host lengths are always checked, for free.
        batch_invariant: a sequence's out and lse are bitwise the same whatever its batchmates, the batch size,
            its place in the batch and the run (:func:`fdlib.plan.invariant_decision`: fixed tiles, chunks set
            by each row's own length, one fixed merge order: :mod:`fdlib.kernels.invariant`). The default mode is deterministic run to run for the same batch.
        k_scale, v_scale: the scales of an 8-bit cache (k_cache/v_cache ``torch.float8_e4m3fn`` or ``torch.int8``,
            q float16 or bfloat16; :mod:`fdlib.quant`, :func:`fdlib.quantize_kv`): each a float (per tensor), a float32
            tensor ``[H_kv]`` (per KV head) or one of the cache's shape without D (per token and KV head); the
            cache stands for ``stored.float() * scale``. None for a 16-bit cache. Every method but
            ``"unified_max"`` takes them (with ``check_lengths=True`` a per-head tensor's values are read too).

    Every call is :func:`fdlib.plan` (made once per shape, dtype, device, method, splits and max_seqlen,
    and cached; never keyed by length values) followed by :meth:`DecodePlan.run`: no device-to-host copy,
    no sync, and it can be captured in a CUDA graph as written. A call laid out like one that ran (the same
    shapes, strides, dtypes and devices, the same options) goes straight to the launches that call recorded:
    its checks passed for that layout, so only the addresses are read again.

    A sequence of length 0 gives out = 0 and lse = -inf. A NaN in a sequence's q, K or V makes that
    sequence's output NaN (for the query heads that read it) and leaves every other sequence untouched.
    """
    if torch.compiler.is_compiling():
        return traced_call(q, k_cache, v_cache, cache_seqlens, block_table, scale, method, num_splits, return_lse,
                           max_seqlen, check_lengths, batch_invariant, validate, k_scale, v_scale)
    key = None
    if _launch_mod.FAST_LAUNCH and validate is None and check_lengths is False and (return_lse is False
                                                                                    or return_lse is True):
        key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table, scale, method, num_splits, return_lse,
                        max_seqlen, batch_invariant, k_scale, v_scale)
        try:
            hit = _CALLS.get(key) if key is not None else None
        except TypeError:   # an unhashable option: the checks name it
            key = hit = None
        if hit is not None:   # laid out like an earlier call that ran: its plan's launches, no checks
            got = hit[0].replayed(hit[1], q, k_cache, v_cache, cache_seqlens, None, None, block_table, return_lse,
                                  k_scale, v_scale)
            if got is not None:
                return got
    check_removed(validate)
    if method == "unified_max":
        check_unified_max(k_cache, k_scale, v_scale, batch_invariant, max_seqlen, check_lengths)
        return _unified_max(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, return_lse)
    p = plan_for(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale, method=method,
                 num_splits=num_splits, return_lse=return_lse, max_seqlen=max_seqlen, batch_invariant=batch_invariant,
                 k_scale=k_scale, v_scale=v_scale)
    if check_lengths is not False:
        check_bool("check_lengths", check_lengths)
        check_lengths_and_table(cache_seqlens, block_table, q.shape[0], p.L_max, p.page_size,
                                k_cache.shape[0], p.device)   # the one device-to-host read
        quant.check_values("k_scale", k_scale)
        quant.check_values("v_scale", v_scale)
    try:
        got = p.run(q, k_cache, v_cache, cache_seqlens, block_table=block_table, return_lse=return_lse,
                    k_scale=k_scale, v_scale=v_scale)
        if key is not None:
            _remember_call(key, p)
        return got
    except (ValueError, TypeError, AttributeError):
        # arguments that do not fit the cached plan: the full checks name what is wrong, in the same words
        # for every call; if they find nothing, the plan's own error stands
        check_inputs(q, k_cache, v_cache, cache_seqlens, scale, method, num_splits, return_lse, block_table,
                     k_scale, v_scale)
        raise


def _call_key(q, k_cache, v_cache, cache_seqlens, block_table, scale, method, num_splits, return_lse, max_seqlen,
              batch_invariant, k_scale, v_scale):
    """What a call's plan and launches depend on besides its addresses: its tensors' layout
    (:func:`fdlib.plan.call_layout`) and its options with their types (``True == 1 == 1.0`` hash alike, and a
    remembered call must not accept what a fresh one refuses); None where an argument is not a tensor (an
    unhashable option fails the lookup: such calls take the checked path too)."""
    lay = call_layout(q, k_cache, v_cache, cache_seqlens, None, None, block_table, return_lse, k_scale, v_scale)
    if lay is None:
        return None
    return (lay, scale, type(scale), method, num_splits, type(num_splits), max_seqlen, type(max_seqlen),
            batch_invariant, type(batch_invariant))


def _remember_call(key, p: DecodePlan) -> None:
    """After a call that ran checked, keep its plan and recorded launches for the next call laid out alike
    (``_CALLS``, bounded like the plans; a plan dropped from ``_PLANS`` takes its entries with it). A remembered
    call does not refresh its plan's place in ``_PLANS``: after PLAN_CACHE_SIZE newer plans it is planned again, once."""
    steps = p._replays.get(key[0])
    if steps is not None:
        _CALLS[key] = (p, steps)
        while len(_CALLS) > 4 * PLAN_CACHE_SIZE:
            _CALLS.popitem(last=False)


def clear_plans() -> None:
    """Drop every plan :func:`decode_attention` keeps (and the calls it remembers); the next call plans again."""
    _PLANS.clear()
    _CALLS.clear()


def _unified_max(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, return_lse):
    """``method="unified_max"``: :func:`fdlib.exact.unified_max_attention` (it plans per call and allocates its
    workspace; the options that belong to the plan path are refused by name first: :func:`check_unified_max`)."""
    from .exact import unified_max_attention
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"q: method='unified_max' takes one query token ([B, H_q, D] or [B, 1, H_q, D]), got "
                         f"{list(q.shape)}")
    return unified_max_attention(q, k_cache, v_cache, cache_seqlens, scale=scale, num_splits=num_splits,
                                 block_table=block_table, return_lse=return_lse,
                                 clamp_flag=_flag(q.device) if isinstance(q, torch.Tensor) else None)


def plan_for(q, k_cache, v_cache, cache_seqlens=None, *, block_table=None, scale=None, method="auto",
             num_splits=None, return_lse=False, max_seqlen=None, batch_invariant=False, k_scale=None,
             v_scale=None) -> DecodePlan:
    """The cached plan :func:`decode_attention` runs for these arguments (made and checked on first use)."""
    try:
        adjacent = heads_adjacent(k_cache, k_cache.shape[-1]) and heads_adjacent(v_cache, v_cache.shape[-1])
        # the options' types too: True == 1 == 1.0 hash alike, and a cached plan must not accept what a fresh
        # one refuses (scale=True, num_splits=True, max_seqlen=5.0 or numpy's int64(5))
        key = (q.shape, k_cache.shape, q.dtype, q.device, scale, type(scale), method, num_splits, type(num_splits),
               max_seqlen, type(max_seqlen), None if block_table is None else block_table.shape, batch_invariant,
               type(batch_invariant), q.shape[1] if q.dim() == 4 else 1, k_cache.dtype,
               quant.scale_key(k_scale), quant.scale_key(v_scale), adjacent, cache_seqlens is None)
        p = _PLANS.get(key)
    except (AttributeError, TypeError):   # not tensors, or unhashable arguments: the checks say which
        key, p = None, None
    if p is not None:
        _PLANS.move_to_end(key)
        check_bool("return_lse", return_lse)
        return p
    pr = check_inputs(q, k_cache, v_cache, cache_seqlens, scale, method, num_splits, return_lse, block_table,
                      k_scale, v_scale)
    kv = pr.kv   # an 8-bit cache's dtype and scale granularities (None: K/V in q's dtype)
    p = plan(pr.B, pr.H_q, pr.H_kv, pr.D, pr.L_max, dtype=q.dtype, device=q.device, max_seqlen=max_seqlen,
             scale=scale, method=method, num_splits=num_splits, page_size=pr.page_size or None,
             batch_invariant=batch_invariant, q_len=pr.q_len,
             pack_heads=None if key is None or adjacent else False,   # packed heads need them side by side
             # no cache_seqlens: every row is L_max, lengths the host knows (equal rows: the exact plan)
             lengths=[pr.L_max] * pr.B if cache_seqlens is None else None,
             clamp_flag=_flag(q.device), kv_dtype=kv and kv.dtype, k_scale=kv and kv.k, v_scale=kv and kv.v)
    _PLANS[key] = p
    while len(_PLANS) > PLAN_CACHE_SIZE:
        _, dropped = _PLANS.popitem(last=False)
        for call in [c for c, (kept, _) in _CALLS.items() if kept is dropped]:
            del _CALLS[call]
    return p
