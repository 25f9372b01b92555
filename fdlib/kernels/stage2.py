r"""Stage 2 of Flash-Decoding: merge each query head's split partials with log-sum-exp weights.

Grid ``(B, H_q)``. For row (b, h) with partials :math:`(O_i, \text{lse}_i)`, i < splits:

.. math::  \text{lse} = \log\sum_i e^{\text{lse}_i},\qquad O = \sum_i e^{\text{lse}_i-\text{lse}}\,O_i

written to ``out`` in q's dtype and ``lse`` (float32). Several query tokens per sequence: each
(b, t, h) row is merged alone, as one of q_len·H_q rows (grid ``(B, q_len·H_q)``).
The arithmetic is :func:`fdlib.kernels.tile.combine_heads`,
the same function the unified kernel's last program calls.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import block_sizes
from .launch import Launcher
from .tile import combine_blocks, combine_heads


@triton.jit
def stage2_kernel(O_PART, LSE_PART, OUT, LSE, n_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, stride_sb, stride_sh,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PACK: tl.constexpr = 1,
                  HEAD_GROUP: tl.constexpr = 1):
    b = tl.program_id(0)
    h = tl.program_id(1)
    combine_heads(O_PART + b * stride_pb + h * stride_ph, LSE_PART + b * stride_lb + h * stride_lh,
                  n_splits, 0, stride_ph, stride_ps, 0, stride_lh,
                  OUT + b * stride_ob + h * stride_oh, 0, stride_oh, LSE + b * stride_sb + h * stride_sh, 0, stride_sh,
                  1, 1, 1, BLOCK_S, BLOCK_D, D, False, True, PACK, h, HEAD_GROUP)


def stage2_launcher(D: int, splits: int, kernel=None, dtype_slots=None, pack: int = 1, group: int = 1) -> Launcher:
    """Stage 2 (or a learner's kernel of the same signature) with its constexprs fixed for D and the splits.
    ``pack`` > 1: stage 1 read ``pack`` KV heads as one (:func:`~fdlib.kernels.tile.own_dims`): the partials are
    D = pack × head dim wide and each query head (``group`` of them a KV head) keeps the dims it owns."""
    BLOCK_D = block_sizes(1, D)[1]
    _, BLOCK_S = combine_blocks(1, splits, BLOCK_D)
    meta = dict(D=D, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, num_warps=4 if BLOCK_D >= 128 else 2)
    if kernel is None:   # every constexpr in meta, so that the launcher may launch it directly
        meta.update(PACK=pack, HEAD_GROUP=group)
    elif pack > 1:
        raise ValueError(f"kernel: a stage-2 kernel of the lab's signature merges unpacked heads; pack={pack}")
    return Launcher(kernel or stage2_kernel, meta, dtype_slots)


def flat_rows(t):
    """``t`` [B, q_len, H_q, ...] as stage 2's rows [B, q_len·H_q, ...] (row t·H_q + h): a view, or None where
    t's strides allow none. Any other rank is returned as is (the one-token form [B, H_q, ...])."""
    try:
        return t.view(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])
    except RuntimeError:
        return None


def stage2_args(o_part, lse_part, out, lse):
    """(grid, pointers, scalars) of one launch (see :class:`~fdlib.kernels.launch.Launcher`). Partials
    ``[B, H_q, splits, D]``/``[B, H_q, splits]`` with out ``[B, H_q, D]`` and lse ``[B, H_q]``; or, several
    query tokens, ``[B, q_len, H_q, splits, D]``/``[B, q_len, H_q, splits]`` with out ``[B, q_len, H_q, D]`` and
    lse ``[B, q_len, H_q]``, merged as q_len·H_q rows of one token (each (t, h) row is merged alone), which
    needs out and lse whose (q_len, H_q) axes flatten to one (:func:`flat_rows`; :func:`run_stage2` copies
    otherwise)."""
    if o_part.dim() == 5:
        o_part, lse_part, out_r, lse_r = (flat_rows(t) for t in (o_part, lse_part, out, lse))
        for name, t, r in (("o_part", o_part, o_part), ("out", out, out_r), ("lse", lse, lse_r)):
            if r is None:
                raise ValueError(f"{name}: stage 2 merges [B, q_len·H_q] rows; the strides {tuple(t.stride())} "
                                 f"do not let its (q_len, H_q) axes flatten to one")
        out, lse = out_r, lse_r
    ps, ls, os_, ss = o_part.stride(), lse_part.stride(), out.stride(), lse.stride()
    return ((out.shape[0], out.shape[1]), (o_part, lse_part, out, lse),
            (o_part.shape[2], ps[0], ps[1], ps[2], ls[0], ls[1], os_[0], os_[1], ss[0], ss[1]))


def run_stage2(o_part, lse_part, out, lse, kernel=None):
    """Merge partials into ``out [B, H_q, D]`` (any float dtype) and ``lse [B, H_q]`` float32, in place (or
    ``out [B, q_len, H_q, D]``, ``lse [B, q_len, H_q]`` from partials with the q_len axis)."""
    launcher = stage2_launcher(o_part.shape[-1], o_part.shape[-2], kernel)
    if o_part.dim() == 5 and (flat_rows(out) is None or flat_rows(lse) is None):
        o_tmp, l_tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device), torch.empty_like(lse.contiguous())
        launcher(*stage2_args(o_part, lse_part, o_tmp, l_tmp))
        out.copy_(o_tmp)
        lse.copy_(l_tmp)
        return
    launcher(*stage2_args(o_part, lse_part, out, lse))
