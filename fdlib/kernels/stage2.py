r"""Stage 2 of Flash-Decoding: merge each query head's split partials with log-sum-exp weights.

Grid ``(B, H_q)``. For row (b, h) with partials :math:`(O_i, \text{lse}_i)`, i < splits:

.. math::  \text{lse} = \log\sum_i e^{\text{lse}_i},\qquad O = \sum_i e^{\text{lse}_i-\text{lse}}\,O_i

written to ``out`` in q's dtype and ``lse`` (float32). The arithmetic is :func:`fdlib.kernels.tile.combine_heads`,
the same function the unified kernel's last program calls.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tile import combine_blocks, combine_heads


@triton.jit
def stage2_kernel(O_PART, LSE_PART, OUT, LSE, n_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, stride_sb, stride_sh,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    combine_heads(O_PART + b * stride_pb + h * stride_ph, LSE_PART + b * stride_lb + h * stride_lh,
                  n_splits, 1, stride_ph, stride_ps, stride_lh,
                  OUT + b * stride_ob + h * stride_oh, stride_oh, LSE + b * stride_sb + h * stride_sh, stride_sh,
                  1, BLOCK_S, BLOCK_D, D, False)


def run_stage2(o_part, lse_part, out, lse, kernel=None):
    """Merge partials into ``out [B, H_q, D]`` (any float dtype) and ``lse [B, H_q]`` float32, in place."""
    from .config import block_sizes
    from .launch import launch
    B, H_q, splits, D = o_part.shape
    BLOCK_D = block_sizes(1, D)[1]
    _, BLOCK_S = combine_blocks(1, splits, BLOCK_D)
    launch(kernel or stage2_kernel, (B, H_q),
           (o_part, lse_part, out, lse),
           (splits, *o_part.stride()[:3], *lse_part.stride()[:2], *out.stride()[:2], *lse.stride()[:2]),
           (("D", D), ("BLOCK_S", BLOCK_S), ("BLOCK_D", BLOCK_D), ("num_warps", 4 if BLOCK_D >= 128 else 2)))
