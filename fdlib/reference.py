r"""Decode attention, written the obvious way.

For one sequence b and query head h (KV head h_kv = h // group) with L = cache_seqlens[b] keys:

.. math::
    s_j = \text{scale}\; q \cdot k_j, \qquad
    O = \sum_{j<L} \frac{e^{s_j}}{\sum_{i<L} e^{s_i}} v_j, \qquad
    \text{lse} = \log \sum_{j<L} e^{s_j}

A sequence of length 0 attends to nothing: O = 0 and lse = -inf (never NaN).

Several query tokens per sequence (q ``[B, q_len, H_q, D]``, speculative decoding): the q_len new tokens are
already the last q_len keys of the cache, and query t sees keys :math:`j \le L - q_{len} + t`
(``flash_attn_with_kvcache``'s convention: causal among the new tokens). A row whose limit is below 0
(:math:`L < q_{len} - t`) sees no key: O = 0, lse = -inf.

Two versions live here:

* :func:`reference_attention` computes it in float64 on the CPU; every test compares against it.
* :func:`naive_attention` is ``method="naive"``: plain PyTorch (matmul, softmax, matmul) on the input's
  device, scores in float32. It materialises the whole score matrix, which is what Lab 01 measures.
"""
from __future__ import annotations

import math

import torch


def _scores(q, k_cache, lengths, scale, dtype):
    """s[b, h_kv, r, j] for q ``[B, q_len, H_q, D]`` (or ``[B, H_q, D]``: q_len = 1), rows r = t·group + g,
    with keys j past row r's limit (j >= L_b − q_len + 1 + t) set to -inf."""
    if q.dim() == 3:
        q = q[:, None]
    B, Q, H_q, D = q.shape
    L_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    qg = q.to(dtype).reshape(B, Q, H_kv, group, D).transpose(1, 2).reshape(B, H_kv, Q * group, D)
    k = k_cache.to(dtype).permute(0, 2, 3, 1)            # [B, H_kv, D, L_max]
    s = torch.matmul(qg, k) * scale                       # [B, H_kv, q_len·group, L_max]
    j = torch.arange(L_max, device=q.device)
    limit = lengths.to(q.device)[:, None] - Q + 1 + torch.arange(Q, device=q.device)   # [B, q_len]
    keep = j[None, None, :] < limit.repeat_interleave(group, dim=1)[:, :, None]       # [B, q_len·group, L_max]
    return s.masked_fill(~keep[:, None], float("-inf"))


def _softmax_av(s, v_cache, dtype, lengths, q_len=None):
    """O [B, q_len, H_q, D] and lse [B, q_len, H_q] from masked scores (q_len None: one token, O [B, H_q, D]
    and lse [B, H_q]); rows with no key give O = 0,
    lse = -inf. Values past a sequence's length are never read (zeroed), so garbage there (NaN, inf in an
    unused cache slot) cannot leak in as 0·NaN."""
    B, H_kv, rows, L_max = s.shape
    if q_len is None:
        o, lse = _softmax_av(s, v_cache, dtype, lengths, 1)
        return o[:, 0], lse[:, 0]
    group = rows // q_len
    lse = torch.logsumexp(s, dim=-1)                      # -inf for empty rows
    p = torch.exp(s - torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)[..., None])
    v = v_cache.to(dtype).permute(0, 2, 1, 3)            # [B, H_kv, L_max, D]
    past = torch.arange(L_max, device=v.device)[None, :] >= lengths.to(v.device)[:, None]
    v = v.masked_fill(past[:, None, :, None], 0)
    o = torch.matmul(p, v)                                # [B, H_kv, q_len·group, D]
    D = o.shape[-1]   # by name, not -1: a batch of no sequences has no elements to infer it from
    o = o.reshape(B, H_kv, q_len, group, D).transpose(1, 2).reshape(B, q_len, H_kv * group, D)
    return o, lse.reshape(B, H_kv, q_len, group).transpose(1, 2).reshape(B, q_len, H_kv * group)


def _lengths(k_cache, cache_seqlens):
    B, L_max = k_cache.shape[0], k_cache.shape[1]
    if cache_seqlens is None:
        return torch.full((B,), L_max, dtype=torch.int64)
    return cache_seqlens.detach().to("cpu", torch.int64)


def _attention(q, k_cache, v_cache, lengths, scale, dtype):
    """(out, lse) for q [B, H_q, D] (one token) or [B, q_len, H_q, D]; out like q, lse q.shape[:-1]."""
    q4 = q if q.dim() == 4 else q[:, None]
    s = _scores(q4, k_cache, lengths, scale, dtype)
    o, lse = _softmax_av(s, v_cache, dtype, lengths, q4.shape[1])
    return (o, lse) if q.dim() == 4 else (o[:, 0], lse[:, 0])


def reference_attention(q, k_cache, v_cache, cache_seqlens=None, scale=None):
    """Float64 CPU reference. ``q`` is ``[B, H_q, D]``, or ``[B, q_len, H_q, D]`` (query t of sequence b sees
    keys 0 … L_b − q_len + t: the q_len new tokens are the cache's last, causal among themselves, as in
    ``flash_attn_with_kvcache``; a row that sees no key gives O = 0, lse = -inf). Returns ``(out, lse)`` as
    float64 CPU tensors, out like q and lse ``q.shape[:-1]``."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lengths = _lengths(k_cache, cache_seqlens)
    q64, k64, v64 = (t.detach().to("cpu", torch.float64) for t in (q, k_cache, v_cache))
    return _attention(q64, k64, v64, lengths, scale, torch.float64)


def naive_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """``method="naive"``: matmul, softmax, matmul in PyTorch with float32 scores; ``(out, lse)`` (q 3-D or
    4-D, as :func:`reference_attention`)."""
    lengths = (torch.full((q.shape[0],), k_cache.shape[1], device=q.device)
               if cache_seqlens is None else cache_seqlens)
    o, lse = _attention(q, k_cache, v_cache, lengths, scale, torch.float32)
    return o.to(q.dtype), lse
