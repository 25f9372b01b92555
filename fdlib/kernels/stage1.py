r"""Stage 1 of Flash-Decoding: each program attends over one split of one sequence's KV cache.

Grid ``(B, H_kv, splits)``. Program (b, h_kv, i) covers keys
:math:`[i\cdot\text{chunk},\ \min((i+1)\cdot\text{chunk},\ L_b))` of sequence b (the last split runs
to :math:`L_b`), for all ``group`` query
heads :math:`h = h_{kv}\cdot\text{group} + g` at once (GQA: each K/V tile is loaded once for the group), and
for each of the sequence's q_len query tokens t (group × q_len rows in one tile, row t stopping at its causal
limit :math:`L_b - q_{len} + t`), and writes the split's partial result

.. math::  O_{b,h,i} = \tilde O/\ell \ \ (\text{float32}),\qquad \text{lse}_{b,h,i} = m + \log \ell

A split that starts past the sequence's end writes the empty state O = 0, lse = -inf. Stage 2
(:mod:`fdlib.kernels.stage2`) merges the splits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher, check_pack, packed_kv, paging, q_len_of, scale_args, strides4
from .tile import (LOG2E, attend_group, load_lengths, row_offset, split_range, tile_update, timeline_record,
                   timeline_start)


@triton.jit
def stage1_kernel(Q, K, V, LENS, O_PART, LSE_PART, FLAG, BT, TIMES, KS, VS,
                  stride_qb, stride_qt, stride_qh,
                  stride_kb, stride_kl, stride_kh,
                  stride_vb, stride_vl, stride_vh,
                  stride_pb, stride_pt, stride_ph, stride_ps,
                  stride_lb, stride_lt, stride_lh,
                  qk_scale, chunk, L_MAX, stride_bt, n_pages,
                  stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul,
                  GROUP: tl.constexpr, D: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
                  TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr, Q_LEN: tl.constexpr = 1,
                  TIMELINE: tl.constexpr = False, PACK: tl.constexpr = 1, K_SCALE: tl.constexpr = 0,
                  V_SCALE: tl.constexpr = 0):
    if TIMELINE:
        t_start = timeline_start()
    b = tl.program_id(0)
    h_kv = tl.program_id(1)
    split = tl.program_id(2)
    L = load_lengths(LENS, b, b >= 0, L_MAX, FLAG)
    start, end = split_range(split, tl.num_programs(2), chunk, L)

    o, lse, rows, mask_gd = attend_group(Q, K, V, b, h_kv, start, end, L, stride_qb, stride_qt, stride_qh, stride_kb,
                                         stride_kl, stride_kh, stride_vb, stride_vl, stride_vh, qk_scale, BT, stride_bt,
                                         n_pages, FLAG, GROUP, Q_LEN, D, BLOCK_G, BLOCK_N, BLOCK_D, FP32_DOT,
                                         TILE_UPDATE, PAGE, PACK,
                                         SC=(KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl,
                                             stride_vsh, v_mul), K_SCALE=K_SCALE, V_SCALE=V_SCALE)
    offs_d = tl.arange(0, BLOCK_D)
    h0 = h_kv * GROUP
    tl.store(O_PART + b * stride_pb + row_offset(rows, h0, stride_pt, stride_ph, GROUP, Q_LEN)[:, None]
             + split * stride_ps + offs_d[None, :], o, mask=mask_gd)
    tl.store(LSE_PART + b * stride_lb + row_offset(rows, h0, stride_lt, stride_lh, GROUP, Q_LEN) + split,
             lse, mask=rows < GROUP * Q_LEN)
    if TIMELINE:
        timeline_record(TIMES, t_start)


def stage1_launcher(dtype, group: int, D: int, cfg, tile_update_fn=None, dtype_slots=None, page: int = 0,
                    q_len: int = 1, timeline: bool = False, pack: int = 1, scale_modes: tuple = (0, 0)) -> Launcher:
    """Stage 1 with its constexprs fixed for q's dtype, the group, D, the tiles, the page size (0: contiguous)
    and the query tokens per sequence (BLOCK_G covers group × q_len rows); ``timeline``: the variant that
    records each program's (SM, start, end) (:meth:`fdlib.plan.DecodePlan.timeline_buffer`); ``pack``: KV heads
    read as one (:func:`~fdlib.kernels.tile.own_dims`), ``group`` and ``D`` then the pack's; ``scale_modes``:
    (K_SCALE, V_SCALE) of an 8-bit cache, (0, 0) for a 16-bit one."""
    check_pack(pack, D, q_len)
    BLOCK_G, BLOCK_D = block_sizes(group * q_len, D)
    return Launcher(stage1_kernel, dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D,
                                        FP32_DOT=fp32_dot(dtype), TILE_UPDATE=tile_update_fn or tile_update,
                                        PAGE=page, Q_LEN=q_len, TIMELINE=timeline, PACK=pack,
                                        K_SCALE=scale_modes[0], V_SCALE=scale_modes[1],
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                    dtype_slots)


def stage1_args(q, k_cache, v_cache, lens, scale, chunk, splits, o_part, lse_part, flag, block_table=None,
                times=None, pack: int = 1, scales=None):
    """(grid, pointers, scalars) of one launch (see :class:`~fdlib.kernels.launch.Launcher`); with a
    ``block_table`` [B, max_pages] the caches are pages [n_pages, page_size, H_kv, D]. q is ``[B, H_q, D]`` with
    partials ``[B, H_q, splits, D]``/``[B, H_q, splits]``, or ``[B, q_len, H_q, D]`` with
    ``[B, q_len, H_q, splits, D]``/``[B, q_len, H_q, splits]``. ``times``: the timeline buffer of a TIMELINE
    launch (else the flag stands in for the unused pointer). ``pack``: KV heads a program reads as one
    (:func:`~fdlib.kernels.launch.packed_kv`; partials ``pack·D`` wide). ``scales``: an 8-bit cache's scale
    pointers and scalars (:func:`~fdlib.kernels.launch.scale_args`)."""
    sp, sc = scale_args(scales, flag)
    qs = strides4(q)
    H_kv, ks, vs = packed_kv(k_cache, v_cache, pack)
    ps, ls = strides4(o_part, 5), strides4(lse_part)
    bt, bt_stride, n_pages, L_max = paging(k_cache, block_table, flag)
    return ((q.shape[0], H_kv, splits),
            (q, k_cache, v_cache, lens, o_part, lse_part, flag, bt, flag if times is None else times, *sp),
            (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], ps[0], ps[1], ps[2], ps[3], ls[0], ls[1],
             ls[2], scale * LOG2E, chunk, L_max, bt_stride, n_pages, *sc))


def run_stage1(q, k_cache, v_cache, lens, scale, chunk, splits, cfg, tile_update_fn=None, *, o_part=None,
               lse_part=None, flag=None, block_table=None):
    """Launch stage 1; returns the partials (O_part [B, H_q, splits, D] float32, lse_part [B, H_q, splits]; with
    q ``[B, q_len, H_q, D]``: [B, q_len, H_q, splits, D] and [B, q_len, H_q, splits]), written into
    ``o_part``/``lse_part`` when given (a plan's workspace), else into new tensors. ``flag``
    ([1] int32) is set to 1 if a length was clamped to 0..L_max (:func:`~fdlib.kernels.tile.load_lengths`)."""
    from .unified import scratch_flag
    *lead, H_q, D = q.shape
    if o_part is None:
        o_part = q.new_empty((*lead, H_q, splits, D), dtype=torch.float32)
        lse_part = q.new_empty((*lead, H_q, splits), dtype=torch.float32)
    flag = scratch_flag(q.device) if flag is None else flag
    launcher = stage1_launcher(q.dtype, H_q // k_cache.shape[2], D, cfg, tile_update_fn,
                               page=0 if block_table is None else k_cache.shape[1], q_len=q_len_of(q))
    launcher(*stage1_args(q, k_cache, v_cache, lens, scale, chunk, splits, o_part, lse_part, flag, block_table))
    return o_part, lse_part
