r"""Context-parallel decode: every rank of a process group holds a slice of each sequence's KV cache.

The ranks are the *splits* of Flash-Decoding, one level up. Each rank holds a set of keys
:math:`J_\text{rank}` of every sequence (the sets are disjoint and together cover the sequence; usually
contiguous by position, the rank holding positions [start_rank, stop_rank)) and decodes them with
:func:`fdlib.decode_attention` into the normalised partial (O_rank, lse_rank). In the state of
:mod:`fdlib.online_softmax`, with m_rank the max logit of the rank's keys and
:math:`\ell_\text{rank} = \sum_{j\in J_\text{rank}} e^{s_j - m_\text{rank}}`:

.. math::
    \text{lse}_\text{rank} = m_\text{rank} + \log \ell_\text{rank}, \qquad
    O_\text{rank} = \tilde O_\text{rank} / \ell_\text{rank}
    \qquad (\text{lse}_\text{rank} = -\infty,\ O_\text{rank} = 0 \text{ when the rank holds no key of the sequence}).

The merge is Lab 04's stage 2 with the splits on different GPUs. Per row (b, h):

.. math::
    m = \max_\text{rank} \text{lse}_\text{rank}, \qquad
    w_\text{rank} = e^{\text{lse}_\text{rank} - m}\ \ (= \ell_\text{rank} e^{m_\text{rank} - m}:
    \text{this rank's share of the softmax denominator, times } e^{-m}),

    \text{lse} = m + \log \sum_\text{rank} w_\text{rank} = \log \sum_\text{rank} e^{\text{lse}_\text{rank}}, \qquad
    O = \frac{\sum_\text{rank} w_\text{rank} O_\text{rank}}{\sum_\text{rank} w_\text{rank}}
      = \sum_\text{rank} e^{\text{lse}_\text{rank} - \text{lse}} O_\text{rank} .

Subtracting m keeps every weight in [0, 1] and the largest at exactly 1, so nothing overflows (an lse of
10⁴ is possible) and the denominator is at least 1 unless the row is empty everywhere. A rank with
lse_rank = −∞ weighs :math:`e^{-\infty} = 0` (and its O_rank is ignored, whatever it holds); a row with
lse_rank = −∞ on every rank has m = −∞ and gives O = 0, lse = −∞, never NaN (the reference point is then 0,
as in :func:`fdlib.online_softmax.merge_lse`). A NaN lse_rank (a NaN in that rank's keys or values) makes that
row NaN on every rank, as it would on one GPU.

**Two merges** (``merge=``), the same math, different collectives:

* ``"allgather"`` (the default): every rank packs (O_rank, lse_rank) into one float32 tensor ``[B, H_q, D + 1]``,
  one ``all_gather`` gives every rank all of them ``[world, B, H_q, D + 1]``, and every rank runs the
  stage-2 merge of Labs 02 and 04 over them locally (:func:`merge_stacked`'s code). **One collective**,
  and every rank merges the same partials in the same order, so the ranks agree bitwise by construction.
  It moves world × (D + 1) floats per row to every rank (2 × 16.5 KB at B=1, 32 heads, D=128; 1 MB per
  rank at B=64), and each rank does world × the merge arithmetic: negligible at a few ranks.
* ``"allreduce"``: an all-reduce of the max, then one all-reduce of the rescaled sums (below). Two
  collectives, each of the size of one rank's partials, whatever the world size.

At the sizes of decode a collective costs its latency, not its bytes, so one collective beats two; the
default is the one measured faster on 2 H200s (``tools/cp_decode_case.py`` times both, eager and under a
CUDA graph, and writes ``results/h200/cp-decode.json``).

**The all-reduce merge in two collectives.** m must be known on every rank before any rank can weight its partial:
``all_reduce(MAX)`` of lse ``[B, H_q]``. Then each rank packs its weighted output and its weight into one
float32 tensor ``[B, H_q, D + 1]`` (``w_rank·O_rank`` in the first D columns, ``w_rank`` in the last) and a single
``all_reduce(SUM)`` gives both Σ_rank w_rank O_rank and Σ_rank w_rank. Without the max the weights
:math:`e^{\text{lse}_\text{rank}}` overflow float32 for lse > 88.7 (or all underflow to 0 below −103); with a
separate sum of the weights the step would cost three collectives. Every rank ends with the same out and lse.

**Several query tokens** (q_len > 1, speculative decoding): q ``[B, q_len, H_q, D]``, query t of sequence b
sees keys 0 … L_b − q_len + t (``flash_attn_with_kvcache``'s convention; the new tokens are already in the
cache). A rank whose slice ends before position L_b − q_len + 1 must let *every* query see all its keys,
while the rank holding the new tokens masks them causally, so the local call cannot be one causal call
with local lengths. :func:`decode_attention_cp` cuts the rank's keys of each sequence in two:

* the keys every query sees (positions < L_b − q_len + 1): one fdlib call with the q_len tokens packed as
  extra query heads of their group (q viewed as ``[B, H_q·q_len, D]``: group·q_len rows share each K/V
  tile, no mask needed);
* the at most q_len − 1 newest keys, seen by the later queries only (key L_b − q_len + j by queries
  t ≥ j): a small masked attention in PyTorch over the keys this rank holds;

and merges the two partials (:func:`merge_stacked`) before the cross-rank merge. Both are device ops on
device lengths: no host read, graph-capturable.

**Precision.** The merge runs in float32 (float64 when ``o`` is float64) whatever o's dtype; out is rounded
to o's dtype once, at the end. Each O_rank from :func:`decode_attention_cp` was itself rounded to the input's
dtype by the kernel, so an fp16/bf16 result carries at most two roundings (about one ulp) instead of one.

**Streams and CUDA graphs.** The collectives are ordinary synchronous ``torch.distributed`` calls
(``all_gather_single`` / ``all_gather_into_tensor``, ``all_reduce``; ``async_op=False``). With NCCL, PyTorch ≥ 2.8 launches them on the caller's current CUDA stream
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

**The ranks agree on the shapes** (``check_shapes``). The collectives' sizes must match across the group: with a
batch of 3 on one rank and 2 on another, gloo may return wrong numbers on one rank while the other fails. One
rank cannot see another's shapes, so the check is one more, small collective: every rank all-gathers
(B, q_len, H_q, D, dtype, merge) and compares them, and on a mismatch **every** rank raises the same
``ValueError`` naming each rank's shapes, before any collective of the merge (the group stays usable). It
reads the gathered shapes back (a sync, not allowed in CUDA-graph capture), so by default
(``check_shapes=None``) it runs on a group's first call in each process only (the eager step that comes before
any capture; all ranks make their first call together, so they all check it); ``True`` checks every call,
``False`` never. A call made while a CUDA graph is being captured skips the default check (and leaves it due).
"""
from __future__ import annotations

import re
import weakref

import torch
import torch.distributed as dist

from .api import decode_attention

__all__ = ["merge_partials", "merge_stacked", "decode_attention_cp", "decode_slice", "local_seqlens", "shard_bounds",
           "MERGES", "DEFAULT_MERGE"]

NEG_INF = float("-inf")
MERGES = ("allgather", "allreduce")
DEFAULT_MERGE = "allgather"
"""One collective instead of two (module docstring); ``tools/cp_decode_case.py`` measures both on 2 GPUs."""


# ---------------------------------------------------------------------------------- the ranks' shapes
_CHECKED: weakref.WeakSet = weakref.WeakSet()
"""Process groups whose ranks have compared their shapes (``check_shapes=None`` checks a group's first call)."""
_SIGNATURE = ("B", "q_len", "H_q", "D", "dtype", "merge")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _signature(t: torch.Tensor, merge: str) -> list[int]:
    """(B, q_len, H_q, D, dtype, merge) of a ``[B, H_q, D]`` or ``[B, q_len, H_q, D]`` tensor, as ints (a tensor
    of another rank: (-its rank, 0, 0, 0, ...), so the ranks still gather together and it is named)."""
    dtype = _DTYPES.index(t.dtype) + 1 if t.dtype in _DTYPES else 0
    if t.dim() not in (3, 4):
        return [-t.dim(), 0, 0, 0, dtype, MERGES.index(merge)]
    return [t.shape[0], t.shape[1] if t.dim() == 4 else 1, t.shape[-2], t.shape[-1], dtype, MERGES.index(merge)]


def _describe(sig) -> str:
    B, q_len, H_q, D, dtype, merge = sig
    name = str(_DTYPES[dtype - 1])[6:] if 0 < dtype <= len(_DTYPES) else "another dtype"
    shape = f"a {-B}-D tensor" if B < 0 else f"B={B}, q_len={q_len}, H_q={H_q}, D={D}"
    return f"{shape}, {name}, merge={MERGES[merge]!r}"


def _check_ranks_agree(t: torch.Tensor, merge: str, group, check_shapes, name: str, caller: str) -> None:
    """``check_shapes`` (module docstring): all-gather every rank's (B, q_len, H_q, D, dtype, merge) and raise
    the same ``ValueError`` on every rank if they differ. None: on the group's first call in this process."""
    if check_shapes is not None and not isinstance(check_shapes, bool):
        raise TypeError(f"check_shapes: expected None, True or False, got {type(check_shapes).__name__}")
    if check_shapes is False:
        return
    key = group if group is not None else dist.group.WORLD
    if check_shapes is None and key in _CHECKED:
        return
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        if check_shapes:
            raise RuntimeError("check_shapes: True reads the ranks' shapes back, which CUDA-graph capture does not "
                               "allow; check in an eager step before capture (the default, None, does)")
        return
    mine = torch.tensor(_signature(t, merge), dtype=torch.int64, device=t.device)
    world = dist.get_world_size(group)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.10
    gather(every, mine, group=group)
    rows = every.view(world, mine.numel()).tolist()                                     # the one read
    if any(row != rows[0] for row in rows):
        ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
        said = "; ".join(f"rank {r}: {_describe(row)}" for r, row in zip(ranks, rows))
        raise ValueError(f"{name}: the ranks of the group called {caller} with different shapes ({said}); every "
                         f"rank must pass the same {', '.join(_SIGNATURE)}, each holding its own keys")
    _CHECKED.add(key)


# ----------------------------------------------------------------------------------------- the merge
def _acc_dtype(o: torch.Tensor) -> torch.dtype:
    """float32 for fp16/bf16/fp32 outputs, float64 for float64 ones."""
    return torch.promote_types(o.dtype, torch.float32)


def _merge(o, lse, reduce_max, reduce_sum):
    """The merge, written once. ``reduce_max``/``reduce_sum`` reduce over the splits and may work in place
    (they are all_reduce in :func:`merge_partials` and amax/sum over dim 0 in :func:`merge_stacked` and
    after the all-gather).

    ``o [..., D]`` and ``lse [...]`` are one split's partials (or all of them stacked on dim 0); returns
    (out in the accumulation dtype, lse) over all splits, shaped like the reduced tensors."""
    acc = _acc_dtype(o)
    D = o.shape[-1]
    lse_a = lse.to(acc)
    m = reduce_max(lse_a.clone())                                 # m = max_rank lse_rank   (collective 1)
    ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # empty everywhere: any finite reference
    w = torch.exp(lse_a - ref)                                    # w_rank = e^(lse_rank - m); 0 where lse_rank = -inf
    packed = torch.empty((*w.shape, D + 1), dtype=acc, device=o.device)
    torch.mul(w[..., None], o.to(acc), out=packed[..., :D])       # w_rank O_rank ...
    packed[..., :D].masked_fill_(torch.isneginf(lse_a)[..., None], 0.0)   # ... 0 for an empty split, whatever O holds
    packed[..., D] = w                                            # ... and w_rank, in the same tensor
    packed = reduce_sum(packed)                                   # Σ_rank w_rank O_rank, Σ_rank w_rank   (collective 2)
    total = packed[..., D]
    empty = total == 0                                            # lse_rank = -inf on every split
    safe = torch.where(empty, torch.ones_like(total), total)
    out = packed[..., :D] / safe[..., None]
    lse_out = torch.where(empty, torch.full_like(total, NEG_INF), ref + torch.log(safe))
    return out, lse_out


def _amax0(t):
    return t.amax(0, keepdim=True)


def _sum0(t):
    return t.sum(0, keepdim=True)


def _check_partials(o, lse, stacked: bool):
    """(o, lse, lse's shape as given) after checking them; errors name the argument. o is ``[..., B, H_q, D]``
    or ``[..., B, q_len, H_q, D]`` with lse ``o.shape[:-1]``; decode_attention's q_len-1 layout (o
    ``[B, 1, H_q, D]``, lse ``[B, H_q]``) is accepted too (lse is then given a q_len axis of 1)."""
    if not isinstance(o, torch.Tensor):
        raise TypeError(f"o: expected a tensor, got {type(o).__name__}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse: expected a tensor, got {type(lse).__name__}")
    if not o.is_floating_point():
        raise TypeError(f"o: expected a floating-point tensor, got {o.dtype}")
    if not lse.is_floating_point():
        raise TypeError(f"lse: expected a floating-point tensor (float32 from decode_attention), got {lse.dtype}")
    lead = 1 if stacked else 0
    pre = "splits, " if stacked else ""
    want = f"[{pre}B, H_q, D] or [{pre}B, q_len, H_q, D]"
    shape, lse_shape = tuple(o.shape), tuple(lse.shape)
    if o.dim() not in (3 + lead, 4 + lead):
        raise ValueError(f"o: expected {want}, got shape {list(shape)}")
    if o.dim() == 4 + lead and shape[1 + lead] == 1 and lse_shape == shape[:1 + lead] + shape[2 + lead:-1]:
        lse = lse.unsqueeze(1 + lead)                              # [B, H_q] beside o [B, 1, H_q, D]
    if tuple(lse.shape) != shape[:-1]:
        raise ValueError(f"lse: expected shape {list(shape[:-1])} to match o {list(shape)}, got {list(lse_shape)}")
    if lse.device != o.device:
        raise ValueError(f"lse: must be on o's device ({o.device}), got {lse.device}")
    return o, lse, lse_shape


def merge_stacked(o: torch.Tensor, lse: torch.Tensor):
    r"""The merge of :func:`merge_partials` over partials stacked in one process: ``o [splits, B, H_q, D]``
    (or ``[splits, B, q_len, H_q, D]``), ``lse [splits, B, H_q]`` (``[splits, B, q_len, H_q]``). Same code,
    with the two collectives replaced by amax and sum over dim 0, so the math can be tested (and used)
    without a process group. Returns ``(out`` like one split's o, in o's dtype, ``lse`` float32, like one
    split's lse ``)``."""
    o, lse3, lse_shape = _check_partials(o, lse, stacked=True)
    out, lse_out = _merge(o, lse3, _amax0, _sum0)
    return out.squeeze(0).to(o.dtype), lse_out.squeeze(0).reshape(lse_shape[1:])


def merge_partials(o: torch.Tensor, lse: torch.Tensor, group=None, *, merge: str = DEFAULT_MERGE,
                   check_shapes: bool | None = None):
    r"""Merge the partials (O_rank, lse_rank) of every rank of ``group`` (default: the default process group).

    Math (module docstring): :math:`m = \max_\text{rank} \text{lse}_\text{rank}`,
    :math:`w_\text{rank} = e^{\text{lse}_\text{rank} - m}` (0 where lse_rank = −∞),
    :math:`\text{lse} = m + \log\sum_\text{rank} w_\text{rank}`,
    :math:`O = \sum_\text{rank} w_\text{rank} O_\text{rank} / \sum_\text{rank} w_\text{rank}`;
    a row empty on every rank gives O = 0, lse = −∞.

    Args:
        o: this rank's normalised output ``[B, H_q, D]`` or ``[B, q_len, H_q, D]``, any float dtype.
        lse: this rank's log-sum-exp, ``o.shape[:-1]`` (natural log; −∞ where the rank held no key of the
            row); ``[B, H_q]`` beside an o of ``[B, 1, H_q, D]`` is accepted too.
        group: a ``torch.distributed`` process group this rank belongs to; every rank of it must call with
            the same shapes and the same ``merge``. The tensors must live where the backend wants them (CUDA
            for NCCL, CPU for gloo).
        merge: ``"allgather"``: one all-gather of the packed ``[B, …, H_q, D + 1]`` partials, then the merge
            on every rank over all of them; ``"allreduce"``: ``all_reduce(MAX)`` of lse, then one
            ``all_reduce(SUM)`` of the weighted outputs and weights packed together. In float32 either way.
        check_shapes: compare every rank's (B, q_len, H_q, D, dtype, merge) first, one small all-gather, and
            raise ``ValueError`` on every rank if they differ (module docstring): None (default) on the group's
            first call in this process, True on every call, False never; the same on every rank.

    Returns ``(out, lse)``: out like o (shape and dtype), lse float32 (float64 if o is float64) shaped like the
    lse given, identical on every rank. o and lse are not modified.
    """
    if merge not in MERGES:
        raise ValueError(f"merge: expected one of {', '.join(map(repr, MERGES))}, got {merge!r}")
    o, lse3, lse_shape = _check_partials(o, lse, stacked=False)
    _check_group(group)
    _check_ranks_agree(o, merge, group, check_shapes, "o", "merge_partials")
    if merge == "allgather":
        out, lse_out = _gather_merge(o, lse3, group)
    else:
        out, lse_out = _merge(o, lse3, lambda t: _all_reduce(t, dist.ReduceOp.MAX, group),
                              lambda t: _all_reduce(t, dist.ReduceOp.SUM, group))
    return out.to(o.dtype), lse_out.reshape(lse_shape)


def _all_reduce(t, op, group):
    dist.all_reduce(t, op=op, group=group)
    return t


def _gather_merge(o, lse, group):
    """All-gather (O_rank, lse_rank) packed as ``[..., D + 1]`` (O_rank in the first D columns, lse_rank in the last),
    then the stage-2 merge over dim 0 of ``[world, ...]`` on every rank."""
    acc = _acc_dtype(o)
    D = o.shape[-1]
    world = dist.get_world_size(group)
    mine = torch.empty((*lse.shape, D + 1), dtype=acc, device=o.device)
    mine[..., :D] = o
    mine[..., D] = lse
    every = torch.empty((world * mine.shape[0], *mine.shape[1:]), dtype=acc, device=o.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.10
    gather(every, mine, group=group)                                                    # the one collective
    every = every.view(world, *mine.shape)                                              # [world, ..., D + 1]
    out, lse_out = _merge(every[..., :D], every[..., D], _amax0, _sum0)
    return out.squeeze(0), lse_out.squeeze(0)


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


def _local_decode(q, k_slice, v_slice, seqlens, kwargs):
    """fdlib.decode_attention(..., return_lse=True) with this module's argument names in its errors."""
    try:
        return decode_attention(q, k_slice, v_slice, seqlens, return_lse=True, **kwargs)
    except (ValueError, TypeError) as e:     # name this function's arguments, not decode_attention's
        msg = _RENAME_RE.sub(lambda mt: _RENAME[mt.group(1)], str(e))
        if msg == str(e):
            raise
        raise type(e)(msg) from e


def _slice_keys(k_slice, block_table):
    """Positions this rank can hold per sequence: L_rank (contiguous) or pages × page size."""
    if block_table is None:
        return k_slice.shape[1]
    return block_table.shape[1] * k_slice.shape[1]


def _newest_keys_partial(q, k_slice, v_slice, cache_seqlens, start, S, scale, block_table, acc):
    r"""(O, lse) of the q_len − 1 newest keys of every sequence that this rank holds, for all q_len queries:
    key j (global position L_b − q_len + 1 + j, j = 0 … q_len − 2) is seen by queries t ≥ j + 1 only. In
    ``acc`` on q's device; rows that see none of them give O = 0, lse = −∞. q is ``[B, q_len, H_q, D]``."""
    B, T, H_q, D = q.shape
    H_kv = k_slice.shape[-2]
    dev = q.device
    if S == 0 or k_slice.shape[0] == 0:                                        # a slice with no position at all
        return (torch.zeros(B, T, H_q, D, dtype=acc, device=dev),
                torch.full((B, T, H_q), NEG_INF, dtype=acc, device=dev))
    j = torch.arange(T - 1, device=dev)
    glob = cache_seqlens.to(device=dev, dtype=torch.int64)[:, None] - (T - 1) + j       # [B, T-1] global position
    local = glob - start
    held = (glob >= 0) & (local >= 0) & (local < S)
    idx = local.clamp(0, max(S - 1, 0))
    if block_table is None:
        rows = torch.arange(B, device=dev)[:, None]
        kk, vv = k_slice[rows, idx], v_slice[rows, idx]                                   # [B, T-1, H_kv, D]
    else:
        P = k_slice.shape[1]
        page = block_table.to(dev).long().gather(1, idx // P)
        kk, vv = k_slice[page, idx % P], v_slice[page, idx % P]
    qg = q.to(acc).reshape(B, T, H_kv, H_q // H_kv, D)
    s = torch.einsum("bthgd,bjhd->bthgj", qg, kk.to(acc)) * scale                          # [B, T, H_kv, g, T-1]
    t = torch.arange(T, device=dev)
    seen = held[:, None, :] & (j[None, None, :] < t[None, :, None])                        # [B, T, T-1]
    s = s.masked_fill(~seen[:, :, None, None, :], NEG_INF)
    lse = torch.logsumexp(s, dim=-1)                                                       # [B, T, H_kv, g]
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None])
    vv = vv.to(acc).masked_fill(~held[:, :, None, None], 0.0)                              # never 0·NaN
    o = torch.einsum("bthgj,bjhd->bthgd", p, vv)
    return o.reshape(B, T, H_q, D), lse.reshape(B, T, H_q)


def decode_slice(q, k_slice, v_slice, slice_seqlens=None, *, cache_seqlens=None, slice_start=None, **kwargs):
    r"""One rank's partial (O_rank, lse_rank): attention of q over the keys of this slice only, normalised over them.

    For one query token it is ``fdlib.decode_attention(q, k_slice, v_slice, slice_seqlens, return_lse=True)``.
    For q_len > 1 (query t sees global positions 0 … L_b − q_len + t) it is the merge of two partials
    (module docstring): the slice's keys before position L_b − q_len + 1, seen by every query (one fdlib
    call with the tokens packed as query heads), and its keys among the q_len − 1 newest, each seen by the
    later queries only (PyTorch). Arguments as in :func:`decode_attention_cp`. Returns ``(O_rank`` like q,
    ``lse_rank`` float32 ``[B, H_q]`` or ``[B, q_len, H_q])``; rows that see no key of the slice give 0, −∞.
    """
    T = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 1
    if (cache_seqlens is None) != (slice_start is None):
        raise ValueError("cache_seqlens, slice_start: pass both (the whole lengths and this slice's first "
                         f"position) or neither, got cache_seqlens={'a value' if cache_seqlens is not None else None} "
                         f"and slice_start={slice_start!r}")
    if cache_seqlens is not None:
        if slice_seqlens is not None:
            raise ValueError("slice_seqlens: pass either slice_seqlens or cache_seqlens with slice_start, not both")
        if isinstance(slice_start, bool) or not isinstance(slice_start, int) or slice_start < 0:
            raise ValueError(f"slice_start: expected an int >= 0, got {slice_start!r}")
        if isinstance(cache_seqlens, (list, tuple)):
            cache_seqlens = torch.tensor(cache_seqlens, dtype=torch.int32, device=q.device)
        if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.shape != (q.shape[0],):
            raise ValueError(f"cache_seqlens: expected [B] = [{q.shape[0]}] lengths, got "
                             f"{list(cache_seqlens.shape) if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens!r}")
    elif T > 1:
        raise ValueError(f"cache_seqlens, slice_start: q has q_len={T} query tokens, whose causal rule needs the "
                         "whole lengths and this slice's first position (slice_seqlens alone cannot say whether a "
                         "sequence goes on past this slice)")
    bt = kwargs.get("block_table")
    if T == 1:
        if cache_seqlens is not None:
            S = _slice_keys(k_slice, bt)
            slice_seqlens = local_seqlens(cache_seqlens, slice_start, slice_start + S)
        return _local_decode(q, k_slice, v_slice, slice_seqlens, kwargs)
    B, _, H_q, D = q.shape
    S = _slice_keys(k_slice, bt)
    acc = _acc_dtype(q)
    # the keys every query sees (positions < L_b - q_len + 1): the q_len tokens packed as group members
    everyone = local_seqlens(cache_seqlens.to(torch.int64) - (T - 1), slice_start, slice_start + S)
    q_packed = q.permute(0, 2, 1, 3).reshape(B, H_q * T, D)                 # head h·T + t -> KV head h // group
    o_a, lse_a = _local_decode(q_packed, k_slice, v_slice, everyone, kwargs)
    o_a = o_a.reshape(B, H_q, T, D).permute(0, 2, 1, 3)                     # [B, T, H_q, D]
    lse_a = lse_a.reshape(B, H_q, T).permute(0, 2, 1)                       # [B, T, H_q]
    # the q_len - 1 newest keys, seen by the later queries only
    scale = kwargs.get("scale")
    scale = D ** -0.5 if scale is None else float(scale)
    o_b, lse_b = _newest_keys_partial(q, k_slice, v_slice, cache_seqlens, slice_start, S, scale, bt, acc)
    o_rank, lse_rank = merge_stacked(torch.stack([o_a.to(acc), o_b]), torch.stack([lse_a.to(lse_b.dtype), lse_b]))
    return o_rank, lse_rank.to(torch.float32)


def decode_attention_cp(q, k_slice, v_slice, slice_seqlens=None, *, cache_seqlens=None, slice_start=None,
                        group=None, merge: str = DEFAULT_MERGE, return_lse=False, check_shapes: bool | None = None,
                        **kwargs):
    r"""Decode attention with each sequence's KV cache spread over the ranks of ``group`` (context parallel).

    Each rank decodes its slice, :math:`(O_\text{rank}, \text{lse}_\text{rank})` = :func:`decode_slice` (for one
    query token ``fdlib.decode_attention(q, k_slice, v_slice, slice_seqlens, return_lse=True, **kwargs)``; inside the
    slice the kernel's own splits merge as usual), and :func:`merge_partials` combines the ranks:
    :math:`\text{lse} = \log\sum_\text{rank} e^{\text{lse}_\text{rank}}`,
    :math:`O = \sum_\text{rank} e^{\text{lse}_\text{rank} - \text{lse}} O_\text{rank}`
    (module docstring). The result is attention over the union of the slices. For one query token the order
    of keys plays no part, so the slices need only be disjoint and cover each sequence; for q_len > 1 they
    must be contiguous by position (:func:`shard_bounds`), since the causal rule is about positions.

    Args:
        q: ``[B, H_q, D]``, ``[B, 1, H_q, D]`` or ``[B, q_len, H_q, D]``, the same on every rank. Query t of
            sequence b sees keys 0 … L_b − q_len + t (the new tokens are already in the cache; the convention
            of ``flash_attn_with_kvcache``).
        k_slice, v_slice: this rank's keys and values, ``[B, L_rank, H_kv, D]`` (L_rank may differ between ranks
            and may be 0), or pages with ``block_table=`` as in :func:`fdlib.decode_attention`.
        slice_seqlens: how many of this rank's L_rank positions hold keys, per sequence (``[B]``, device or host,
            like ``cache_seqlens``; 0 where the rank holds none of that sequence; default all L_rank). One query
            token only.
        cache_seqlens, slice_start: instead of slice_seqlens (required when q_len > 1): the whole sequences'
            lengths L_b (``[B]``; a tensor on q's device for graph capture) and the position of this rank's
            first key (an int: the rank holds positions [slice_start, slice_start + L_rank)).
        group: the process group (default: the default group).
        merge: ``"allgather"`` or ``"allreduce"`` (:func:`merge_partials`); the same on every rank.
        return_lse: also return lse (``[B, H_q]``; ``[B, q_len, H_q]`` for a q with q_len > 1) float32,
            log Σ over all ranks' keys.
        check_shapes: before anything else, compare every rank's (B, q_len, H_q, D, dtype, merge), one small
            all-gather read back, and raise ``ValueError`` on every rank, naming each rank's shapes, if they
            differ (module docstring): None (default) on the group's first call in this process (the eager step
            before any CUDA-graph capture), True on every call, False never; the same on every rank.
        **kwargs: passed to :func:`fdlib.decode_attention` (scale, method, num_splits, max_seqlen,
            block_table, check_lengths); ``scale`` defaults to 1/√D on every rank alike.

    Returns out like q (and lse), identical on every rank; a row that sees no key on any rank gives 0
    (lse −∞). Every rank must call it (the merge is collective) with the same B, q_len, H_q, D, dtype and merge;
    ``check_shapes`` checks that.
    """
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if merge not in MERGES:
        raise ValueError(f"merge: expected one of {', '.join(map(repr, MERGES))}, got {merge!r}")
    _check_group(group)
    if isinstance(q, torch.Tensor):   # else decode_slice names what is wrong, locally
        _check_ranks_agree(q, merge, group, check_shapes, "q", "decode_attention_cp")
    o_rank, lse_rank = decode_slice(q, k_slice, v_slice, slice_seqlens, cache_seqlens=cache_seqlens,
                              slice_start=slice_start, **kwargs)
    out, lse = merge_partials(o_rank, lse_rank, group, merge=merge, check_shapes=False)
    out = out.to(q.dtype)
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
