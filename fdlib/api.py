"""``fdlib.decode_attention``: the one entry point that reaches every method.

Data flow: validate -> lengths -> choose splits (cost model, or forced) -> launch kernel(s) -> out (, lse).
"""
from __future__ import annotations

import torch

from . import runtime
from .reference import naive_attention
from .validate import check


def _lengths(p, cache_seqlens, validate):
    """int32 lengths on the device, and L_cap: the longest length the launch must cover (host int): the
    longest of ``cache_seqlens`` with ``validate=True``, else the cache's capacity L_max (nothing is read)."""
    if cache_seqlens is None:
        return torch.full((p.B,), p.L_max, dtype=torch.int32, device=p.q.device), p.L_max
    lens = cache_seqlens.to(torch.int32).contiguous()   # kernels read LENS + b: dense int32
    return lens, (max(p.lengths) if validate else p.L_max)


def decode_attention(q, k_cache, v_cache, cache_seqlens=None, *, scale=None, method="auto", num_splits=None,
                     return_lse=False, validate=True):
    r"""Attention of one query token per sequence against its KV cache.

    .. math::  O_{b,h} = \sum_{j < L_b} \operatorname{softmax}_j(\text{scale}\; q_{b,h}\cdot k_{b,j,h_{kv}})\; v_{b,j,h_{kv}},
               \qquad h_{kv} = \lfloor h/\text{group}\rfloor,\ \text{group} = H_q/H_{kv}

    Args:
        q: ``[B, H_q, D]`` (or ``[B, 1, H_q, D]``; the answer has q's shape).
        k_cache, v_cache: ``[B, L_max, H_kv, D]``, token-major; any strides with a contiguous last dim.
        cache_seqlens: int32/int64 ``[B]``, the valid length of each sequence (default: all L_max).
        scale: multiplies q·k (default 1/√D).
        method: ``"auto"`` (splits from the cost model; the unified kernel, or the persistent one when every
            row is one split of a short cache and there are many rows: :func:`fdlib.splits.choose_kernel`),
            ``"unified"``, ``"split"`` (stage 1 + stage 2 kernels), ``"persistent"`` (one launch of a few
            programs per SM walking all rows, no split) or ``"naive"`` (PyTorch matmul-softmax-matmul).
        num_splits: force the number of KV splits (1..256) instead of letting fdlib choose; at most one split
            per tile of keys is launched (:func:`fdlib.kernels.config.chunk_for`).
        return_lse: also return lse ``[B, H_q]`` float32 (natural log).
        validate: check ``cache_seqlens`` values (needs a device-to-host copy); pass False inside CUDA-graph
            capture, where splits are then chosen for the cache's full capacity L_max. Without the check the
            lengths must still lie in 0..L_max: a longer one makes the kernels read past the cache.

    A sequence of length 0 gives out = 0 and lse = -inf. A NaN in a sequence's q, K or V makes that
    sequence's output NaN (for the query heads that read it) and leaves every other sequence untouched.
    """
    p = check(q, k_cache, v_cache, cache_seqlens, scale, method, num_splits, return_lse, validate)
    if method == "naive":
        out, lse = naive_attention(p.q, k_cache, v_cache, cache_seqlens, p.scale)
    else:
        out, lse = _triton(p, k_cache, v_cache, cache_seqlens, method, num_splits, validate)
    if p.q_was_4d:
        out = out[:, None]
    return (out, lse) if return_lse else out


def _triton(p, k_cache, v_cache, cache_seqlens, method, num_splits, validate):
    from .kernels.config import chunk_for, tile_config
    from .splits import choose_kernel, choose_splits, persistent_per_sm, sm_count
    runtime.smoke_check()
    lens, L_cap = _lengths(p, cache_seqlens, validate)
    cfg = tile_config(p.D, L_cap, p.q.element_size(), rows=p.B * p.H_kv)
    if method == "persistent":
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_splits(p, L_cap)
    chunk, splits = chunk_for(L_cap, num_splits, cfg.BLOCK_N)
    if method == "auto":
        method = choose_kernel(p, L_cap, splits)
    try:
        out = torch.empty_like(p.q)
        lse = torch.empty((p.B, p.H_q), dtype=torch.float32, device=p.q.device)
        if method == "persistent":
            from .kernels.config import persistent_config
            from .kernels.persistent import programs_for, run_persistent
            run_persistent(p.q, k_cache, v_cache, lens, p.scale, persistent_config(p.D, p.q.element_size()), out,
                           lse, programs_for(p.B * p.H_kv, sm_count(), persistent_per_sm()))
        elif method == "split":
            from .kernels.stage1 import run_stage1
            from .kernels.stage2 import run_stage2
            o_part, lse_part = run_stage1(p.q, k_cache, v_cache, lens, p.scale, chunk, splits, cfg)
            run_stage2(o_part, lse_part, out, lse)
        else:
            from .kernels.unified import run_unified
            run_unified(p.q, k_cache, v_cache, lens, p.scale, chunk, splits, cfg, out, lse)
    except _OOM as e:
        raise _OOM(f"decode_attention: out of memory on {p.q.device} allocating out, lse and the split workspace, "
                   f"{_workspace_bytes(p, splits)} bytes in all (B={p.B}, H_q={p.H_q}, D={p.D}, splits={splits}); "
                   f"fewer splits (num_splits) or a smaller batch needs less. {e}") from e
    return out, lse


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _workspace_bytes(p, splits):
    """Bytes a Triton call allocates: out (q's dtype), lse, and float32 partials O_i, lse_i when splits > 1."""
    rows = p.B * p.H_q
    partials = rows * splits * (p.D + 1) * 4 if splits > 1 else 0
    return rows * p.D * p.q.element_size() + rows * 4 + partials
