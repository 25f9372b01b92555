r"""Decode attention, written the obvious way.

For one sequence b and query head h (KV head h_kv = h // group) with L = cache_seqlens[b] keys:

.. math::
    s_j = \text{scale}\; q \cdot k_j, \qquad
    O = \sum_{j<L} \frac{e^{s_j}}{\sum_{i<L} e^{s_i}} v_j, \qquad
    \text{lse} = \log \sum_{j<L} e^{s_j}

A sequence of length 0 attends to nothing: O = 0 and lse = -inf (never NaN).

Two versions live here:

* :func:`reference_attention` computes it in float64 on the CPU; every test compares against it.
* :func:`naive_attention` is ``method="naive"``: plain PyTorch (matmul, softmax, matmul) on the input's
  device, scores in float32. It materialises the whole score matrix, which is what Lab 01 measures.
"""
from __future__ import annotations

import math

import torch


def _scores(q, k_cache, lengths, scale, dtype):
    """s[b, h_kv, g, j] with keys past each sequence's length set to -inf."""
    B, H_q, D = q.shape
    L_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    qg = q.to(dtype).reshape(B, H_kv, group, D)
    k = k_cache.to(dtype).permute(0, 2, 3, 1)            # [B, H_kv, D, L_max]
    s = torch.matmul(qg, k) * scale                       # [B, H_kv, group, L_max]
    j = torch.arange(L_max, device=q.device)
    keep = j[None, :] < lengths.to(q.device)[:, None]     # [B, L_max]
    return s.masked_fill(~keep[:, None, None, :], float("-inf"))


def _softmax_av(s, v_cache, dtype, lengths):
    """O and lse from masked scores; rows with no key give O = 0, lse = -inf. Values past a sequence's
    length are never read (zeroed), so garbage there (NaN, inf in an unused cache slot) cannot leak in as 0·NaN."""
    B, H_kv, group, L_max = s.shape
    lse = torch.logsumexp(s, dim=-1)                      # -inf for empty rows
    p = torch.exp(s - torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)[..., None])
    v = v_cache.to(dtype).permute(0, 2, 1, 3)            # [B, H_kv, L_max, D]
    past = torch.arange(L_max, device=v.device)[None, :] >= lengths.to(v.device)[:, None]
    v = v.masked_fill(past[:, None, :, None], 0)
    o = torch.matmul(p, v)                                # [B, H_kv, group, D]
    return o.reshape(B, H_kv * group, -1), lse.reshape(B, H_kv * group)


def _lengths(k_cache, cache_seqlens):
    B, L_max = k_cache.shape[0], k_cache.shape[1]
    if cache_seqlens is None:
        return torch.full((B,), L_max, dtype=torch.int64)
    return cache_seqlens.detach().to("cpu", torch.int64)


def reference_attention(q, k_cache, v_cache, cache_seqlens=None, scale=None):
    """Float64 CPU reference. ``q`` is ``[B, H_q, D]``; returns ``(out, lse)`` as float64 CPU tensors."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lengths = _lengths(k_cache, cache_seqlens)
    q64, k64, v64 = (t.detach().to("cpu", torch.float64) for t in (q, k_cache, v_cache))
    s = _scores(q64, k64, lengths, scale, torch.float64)
    return _softmax_av(s, v64, torch.float64, lengths)


def naive_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """``method="naive"``: matmul, softmax, matmul in PyTorch with float32 scores; ``(out, lse)``."""
    lengths = (torch.full((q.shape[0],), k_cache.shape[1], device=q.device)
               if cache_seqlens is None else cache_seqlens)
    s = _scores(q, k_cache, lengths, scale, torch.float32)
    o, lse = _softmax_av(s, v_cache, torch.float32, lengths)
    return o.to(q.dtype), lse
