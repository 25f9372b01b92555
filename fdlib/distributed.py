r"""Context-parallel decode: every rank of a process group holds a slice of each sequence's KV cache.

The ranks are the *splits* of Flash-Decoding, one level up. Rank r holds a set of keys :math:`J_r` of every
sequence (the sets are disjoint and together cover the sequence; usually contiguous by position, rank r
holding positions [start_r, stop_r)) and decodes them with :func:`fdlib.decode_attention` into the
normalised partial (O_r, lse_r). In the state of :mod:`fdlib.online_softmax`, with m_r the max logit of
rank r's keys and :math:`\ell_r = \sum_{j\in J_r} e^{s_j - m_r}`:

.. math::
    \text{lse}_r = m_r + \log \ell_r, \qquad O_r = \tilde O_r / \ell_r
    \qquad (\text{lse}_r = -\infty,\ O_r = 0 \text{ when rank r holds no key of the sequence}).

The merge is Lab 04's stage 2 with the splits on different GPUs. Per row (b, h):

.. math::
    m = \max_r \text{lse}_r, \qquad
    w_r = e^{\text{lse}_r - m}\ \ (= \ell_r e^{m_r - m}: \text{rank r's share of the softmax denominator, times } e^{-m}),

    \text{lse} = m + \log \sum_r w_r = \log \sum_r e^{\text{lse}_r}, \qquad
    O = \frac{\sum_r w_r O_r}{\sum_r w_r} = \sum_r e^{\text{lse}_r - \text{lse}} O_r .

Subtracting m keeps every weight in [0, 1] and the largest at exactly 1, so nothing overflows (an lse of
10⁴ is possible) and the denominator is at least 1 unless the row is empty everywhere. A rank with
lse_r = −∞ weighs :math:`e^{-\infty} = 0` (and its O_r is ignored, whatever it holds); a row with
lse_r = −∞ on every rank has m = −∞ and gives O = 0, lse = −∞, never NaN (the reference point is then 0,
as in :func:`fdlib.online_softmax.merge_lse`). A NaN lse_r (a NaN in rank r's keys or values) makes that row
NaN on every rank, as it would on one GPU.

**Two collectives per step.** m must be known on every rank before any rank can weight its partial:
``all_reduce(MAX)`` of lse ``[B, H_q]``. Then each rank packs its weighted output and its weight into one
float32 tensor ``[B, H_q, D + 1]`` (``w_r·O_r`` in the first D columns, ``w_r`` in the last) and a single
``all_reduce(SUM)`` gives both Σ w_r O_r and Σ w_r. Without the max the weights :math:`e^{\text{lse}_r}`
overflow float32 for lse > 88.7 (or all underflow to 0 below −103); with a separate sum of the weights the
step would cost three collectives. Every rank ends with the same out and lse.

**Precision.** The merge runs in float32 (float64 when ``o`` is float64) whatever o's dtype; out is rounded
to o's dtype once, at the end. Each O_r from :func:`decode_attention_cp` was itself rounded to the input's
dtype by the kernel, so an fp16/bf16 result carries at most two roundings (about one ulp) instead of one.

**Streams and CUDA graphs.** The collectives are ordinary synchronous ``torch.distributed.all_reduce``
calls (``async_op=False``). With NCCL, PyTorch ≥ 2.8 launches them on the caller's current CUDA stream
(pytorch/pytorch#150398); earlier releases launch them on an internal NCCL stream that first waits on the
current stream and that the current stream then waits on, so in both cases the merge is ordered after the
decode kernels and before whatever the caller launches next on the current stream. Nothing here reads a
value back to the host. Capturing a step in a CUDA graph therefore needs only what NCCL and PyTorch
require: NCCL ≥ 2.9 (CUDA ≥ 11.3) and a PyTorch whose ProcessGroupNCCL does not hand captured work to its
watchdog (pytorch/pytorch#102542); the NCCL communicator must already exist (it is made by the first
collective, or by ``init_process_group(device_id=...)``: run one eager step before capture, which also
compiles fdlib's kernels);
lengths must be a device tensor; and, as NCCL documents, capture and every replay are collective: all ranks
of the group capture the same step and replay their graphs together. ``tools/cp_decode_case.py`` tries it
on real GPUs. With gloo (CPU tensors) there is no stream and no graph: the calls block until done.

What one rank cannot check: that every rank passes the same B, H_q, D and dtype. The collectives' sizes
must match across the group; a mismatch is an error or a hang of the backend, which only another
collective could detect.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from .api import decode_attention

__all__ = ["merge_partials", "merge_stacked", "decode_attention_cp", "local_seqlens", "shard_bounds"]

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------- the merge
def _acc_dtype(o: torch.Tensor) -> torch.dtype:
    """float32 for fp16/bf16/fp32 outputs, float64 for float64 ones."""
    return torch.promote_types(o.dtype, torch.float32)


def _merge(o, lse, reduce_max, reduce_sum):
    """The merge, written once. ``reduce_max``/``reduce_sum`` reduce over the splits and may work in place
    (they are all_reduce in :func:`merge_partials` and amax/sum over dim 0 in :func:`merge_stacked`).

    ``o [..., D]`` and ``lse [...]`` are one split's partials (or all of them stacked on dim 0); returns
    (out in the accumulation dtype, lse) over all splits, shaped like the reduced tensors."""
    acc = _acc_dtype(o)
    D = o.shape[-1]
    lse_a = lse.to(acc)
    m = reduce_max(lse_a.clone())                                 # m = max_r lse_r   (collective 1)
    ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # empty everywhere: any finite reference
    w = torch.exp(lse_a - ref)                                    # w_r = e^(lse_r - m); 0 where lse_r = -inf
    packed = torch.empty((*w.shape, D + 1), dtype=acc, device=o.device)
    torch.mul(w[..., None], o.to(acc), out=packed[..., :D])       # w_r O_r ...
    packed[..., :D].masked_fill_(torch.isneginf(lse_a)[..., None], 0.0)   # ... 0 for an empty split, whatever O_r holds
    packed[..., D] = w                                            # ... and w_r, in the same tensor
    packed = reduce_sum(packed)                                   # Σ_r w_r O_r, Σ_r w_r   (collective 2)
    total = packed[..., D]
    empty = total == 0                                            # lse_r = -inf on every split
    safe = torch.where(empty, torch.ones_like(total), total)
    out = packed[..., :D] / safe[..., None]
    lse_out = torch.where(empty, torch.full_like(total, NEG_INF), ref + torch.log(safe))
    return out, lse_out


def _check_partials(o, lse, stacked: bool):
    """(o as [..., B, H_q, D], restore-shape) after checking o and lse; errors name the argument."""
    if not isinstance(o, torch.Tensor):
        raise TypeError(f"o: expected a tensor, got {type(o).__name__}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse: expected a tensor, got {type(lse).__name__}")
    if not o.is_floating_point():
        raise TypeError(f"o: expected a floating-point tensor, got {o.dtype}")
    if not lse.is_floating_point():
        raise TypeError(f"lse: expected a floating-point tensor (float32 from decode_attention), got {lse.dtype}")
    lead = 1 if stacked else 0
    want = "[splits, B, H_q, D]" if stacked else "[B, H_q, D] (or [B, 1, H_q, D])"
    shape = tuple(o.shape)
    if len(shape) == 4 + lead and shape[1 + lead] == 1:            # q_len-1 layout [B, 1, H_q, D]
        o = o.squeeze(1 + lead)
    if o.dim() != 3 + lead:
        raise ValueError(f"o: expected {want}, got shape {list(shape)}")
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"lse: expected shape {list(o.shape[:-1])} to match o {list(shape)}, "
                         f"got {list(lse.shape)}")
    if lse.device != o.device:
        raise ValueError(f"lse: must be on o's device ({o.device}), got {lse.device}")
    return o, shape[lead:]


def merge_stacked(o: torch.Tensor, lse: torch.Tensor):
    r"""The merge of :func:`merge_partials` over partials stacked in one process: ``o [splits, B, H_q, D]``,
    ``lse [splits, B, H_q]``. Same code, with the two collectives replaced by amax and sum over dim 0, so the
    math can be tested (and used) without a process group. Returns ``(out [B, H_q, D] in o's dtype,
    lse [B, H_q] float32)``."""
    o3, shape = _check_partials(o, lse, stacked=True)
    out, lse_out = _merge(o3, lse, lambda t: t.amax(0, keepdim=True), lambda t: t.sum(0, keepdim=True))
    return out.squeeze(0).to(o.dtype).reshape(shape), lse_out.squeeze(0)


def merge_partials(o: torch.Tensor, lse: torch.Tensor, group=None):
    r"""Merge the partials (O_r, lse_r) of every rank of ``group`` (default: the default process group).

    Math (module docstring): :math:`m = \max_r \text{lse}_r`, :math:`w_r = e^{\text{lse}_r - m}` (0 where
    lse_r = −∞), :math:`\text{lse} = m + \log\sum_r w_r`, :math:`O = \sum_r w_r O_r / \sum_r w_r`;
    a row empty on every rank gives O = 0, lse = −∞.

    Args:
        o: this rank's normalised output ``[B, H_q, D]`` (or ``[B, 1, H_q, D]``), any float dtype.
        lse: this rank's log-sum-exp ``[B, H_q]`` (natural log; −∞ where the rank held no key of the row).
        group: a ``torch.distributed`` process group this rank belongs to; every rank of it must call with
            the same shapes. The tensors must live where the backend wants them (CUDA for NCCL, CPU for gloo).

    Returns ``(out, lse)``: out like o (shape and dtype), lse float32 (float64 if o is float64), identical on
    every rank. Costs two collectives: ``all_reduce(MAX)`` of ``[B, H_q]`` and ``all_reduce(SUM)`` of
    ``[B, H_q, D + 1]``, in float32. o and lse are not modified.
    """
    o3, shape = _check_partials(o, lse, stacked=False)
    _check_group(group)

    def all_max(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def all_sum(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    out, lse_out = _merge(o3, lse, all_max, all_sum)
    return out.to(o.dtype).reshape(shape), lse_out


def _check_group(group):
    if not dist.is_available():
        raise RuntimeError("group: torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized; call torch.distributed.init_process_group "
                           "first (or merge partials held in one process with fdlib.distributed.merge_stacked)")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("group: this rank is not a member of the group (its collectives would do nothing here)")


# ----------------------------------------------------------------------------------------- decode
_RENAME = {"k_cache": "k_slice", "v_cache": "v_slice", "cache_seqlens": "slice_seqlens"}
_RENAME_RE = re.compile(r"\b(" + "|".join(_RENAME) + r")\b")


def decode_attention_cp(q, k_slice, v_slice, slice_seqlens=None, *, group=None, return_lse=False, **kwargs):
    r"""Decode attention with each sequence's KV cache spread over the ranks of ``group`` (context parallel).

    Rank r decodes its slice, :math:`(O_r, \text{lse}_r)` = ``fdlib.decode_attention(q, k_slice, v_slice,
    slice_seqlens, return_lse=True, **kwargs)`` (inside the slice the kernel's own splits merge as usual),
    and :func:`merge_partials` combines the ranks: :math:`\text{lse} = \log\sum_r e^{\text{lse}_r}`,
    :math:`O = \sum_r e^{\text{lse}_r - \text{lse}} O_r` (module docstring). The result is attention over the
    union of the slices; the order of keys plays no part, so the slices need only be disjoint and cover each
    sequence (contiguous by position is the usual layout: :func:`shard_bounds`, :func:`local_seqlens`).

    Args:
        q: ``[B, H_q, D]`` (or ``[B, 1, H_q, D]``), the same on every rank.
        k_slice, v_slice: this rank's keys and values, ``[B, S_r, H_kv, D]`` (S_r may differ between ranks
            and may be 0), or pages with ``block_table=`` as in :func:`fdlib.decode_attention`.
        slice_seqlens: how many of this rank's S_r positions hold keys, per sequence (``[B]``, device or host,
            like ``cache_seqlens``; 0 where the rank holds none of that sequence; default all S_r).
        group: the process group (default: the default group).
        return_lse: also return lse ``[B, H_q]`` float32, log Σ over all ranks' keys.
        **kwargs: passed to :func:`fdlib.decode_attention` (scale, method, num_splits, max_seqlen,
            block_table, check_lengths); ``scale`` defaults to 1/√D on every rank alike.

    Returns out like q (and lse), identical on every rank; a sequence with no key on any rank gives 0 (lse −∞).
    Every rank must call it (the merge is collective) with the same B, H_q, D and dtype.
    """
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    _check_group(group)
    try:
        o_r, lse_r = decode_attention(q, k_slice, v_slice, slice_seqlens, return_lse=True, **kwargs)
    except (ValueError, TypeError) as e:     # name this function's arguments, not decode_attention's
        msg = _RENAME_RE.sub(lambda mt: _RENAME[mt.group(1)], str(e))
        if msg == str(e):
            raise
        raise type(e)(msg) from e
    out, lse = merge_partials(o_r, lse_r, group)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------- slicing helpers
def shard_bounds(L: int, world_size: int, rank: int) -> tuple[int, int]:
    """Positions [start, stop) of rank ``rank`` when L positions are cut into ``world_size`` contiguous slices
    as evenly as possible (the first L % world_size ranks hold one more)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if L < 0:
        raise ValueError(f"L: expected >= 0, got {L}")
    base, extra = divmod(L, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def local_seqlens(cache_seqlens, start: int, stop: int):
    """Per-sequence lengths inside the slice [start, stop) of positions: clamp(len - start, 0, stop - start).

    ``cache_seqlens`` is a tensor (kept on its device, int32 out, no host read, graph-safe) or a list of ints
    (a list out)."""
    if not 0 <= start <= stop:
        raise ValueError(f"start, stop: expected 0 <= start <= stop, got {start}, {stop}")
    if isinstance(cache_seqlens, torch.Tensor):
        return (cache_seqlens.to(torch.int64) - start).clamp(0, stop - start).to(torch.int32)
    return [min(max(int(n) - start, 0), stop - start) for n in cache_seqlens]
