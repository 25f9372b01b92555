r"""The balanced kernel: the unified kernel over a work list of near-equal items, built on the device.

Grid ``(P + B, H_kv)`` for a budget of P items (:mod:`fdlib.schedule`). Every program loads all B lengths and
computes the schedule itself, the same in every program:

.. math::
    \text{tiles}_b = \max(1, \lceil L_b/N\rceil),\quad c = \lceil \textstyle\sum_b \text{tiles}_b / P\rceil,\quad
    n_b = \lceil \text{tiles}_b / c\rceil,\quad E_b = n_0 + \dots + n_b

Program i takes item i: its row is :math:`b = \#\{b : E_b \le i\}`, its split :math:`j = i - (E_b - n_b)`,
its keys :math:`[j\,cN,\ \min((j+1)\,cN,\ L_b))`. Items past :math:`E_{B-1}` exit at once. A row of one item
writes :math:`O = \tilde O/\ell` and lse itself; a row of several stores its partials at its items' slots and
the last of them to take a ticket merges them (:func:`~fdlib.kernels.tile.take_ticket`,
:func:`~fdlib.kernels.tile.combine_heads`), as in the unified kernel. Nothing is read on the host, so a
captured graph stays balanced when the lengths change in place. Several query tokens: an item holds the
group × q_len query rows of its KV head (the cost of an item is its K/V tiles, the same for any q_len).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher, paging, scale_args, strides4
from .tile import (LOG2E, attend_group, batch_tiles, combine_blocks, finish_row, split_range, take_ticket,
                   tile_update, timeline_record, timeline_start)

MAX_BATCH = 4096
"""Every program keeps all B lengths in registers; larger batches use the other kernels."""


@triton.jit
def balanced_kernel(Q, K, V, LENS, O_PART, LSE_PART, COUNTERS, OUT, LSE, FLAG, BT, TIMES, KS, VS,
                    stride_qb, stride_qt, stride_qh,
                    stride_kb, stride_kl, stride_kh,
                    stride_vb, stride_vl, stride_vh,
                    stride_pi, stride_pt, stride_ph,
                    stride_lt, stride_lh,
                    stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh,
                    qk_scale, n_batch, budget, H_KV, L_MAX, stride_bt, n_pages,
                    stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul,
                    GROUP: tl.constexpr, D: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, FP32_DOT: tl.constexpr,
                    TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr, Q_LEN: tl.constexpr = 1,
                    TIMELINE: tl.constexpr = False, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    if TIMELINE:
        t_start = timeline_start()
    item = tl.program_id(0)
    h_kv = tl.program_id(1)
    # the schedule, computed alike by every program (fdlib.schedule.balanced)
    offs_b, lens, tiles = batch_tiles(LENS, n_batch, L_MAX, FLAG, BLOCK_B, BLOCK_N)
    c = tl.maximum(tl.cdiv(tl.sum(tiles, 0), budget), 1)
    n = tl.cdiv(tiles, c)                                               # 0 past the batch (tiles 0)
    ends = tl.cumsum(n, 0)                                              # E_b
    if item < tl.sum(n, 0):
        b = tl.sum((ends <= item).to(tl.int32), 0)                      # the row of this item
        here = offs_b == b
        n_b = tl.sum(tl.where(here, n, 0), 0)
        first = tl.sum(tl.where(here, ends, 0), 0) - n_b
        L = tl.sum(tl.where(here, lens, 0), 0)
        start, end = split_range(item - first, n_b, c * BLOCK_N, L)
        o, lse, rows, mask_gd = attend_group(Q, K, V, b, h_kv, start, end, L, stride_qb, stride_qt, stride_qh,
                                             stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                                             qk_scale, BT, stride_bt, n_pages, FLAG, GROUP, Q_LEN, D, BLOCK_G,
                                             BLOCK_N, BLOCK_D, FP32_DOT, TILE_UPDATE, PAGE,
                                             SC=(KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl,
                                                 stride_vsh, v_mul), K_SCALE=K_SCALE, V_SCALE=V_SCALE)
        finish_row(o, lse, rows, mask_gd, h_kv * GROUP, item - first, n_b,
                   O_PART + first.to(tl.int64) * stride_pi, stride_pt, stride_ph, stride_pi,
                   LSE_PART + first, stride_lt, stride_lh,
                   COUNTERS + b * H_KV + h_kv, OUT + b * stride_ob, stride_ot, stride_oh,
                   LSE + b * stride_sb, stride_st, stride_sh,
                   GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D, take_ticket)
    if TIMELINE:
        timeline_record(TIMES, t_start)


def items_max(B: int, budget: int) -> int:
    """Slots the workspace needs: Σ n_b <= budget + B (each row rounds its item count up once)."""
    return budget + B


def balanced_launcher(dtype, group: int, D: int, B: int, cfg, dtype_slots=None, page: int = 0,
                      q_len: int = 1, timeline: bool = False, scale_modes: tuple = (0, 0)) -> Launcher:
    """The balanced kernel with its constexprs fixed (BLOCK_B covers the planned batch B; group × q_len query
    rows a program; ``timeline``: the variant that records each program's (SM, start, end); ``scale_modes``:
    (K_SCALE, V_SCALE) of an 8-bit cache)."""
    BLOCK_G, BLOCK_D = block_sizes(group * q_len, D)
    block_h, block_s = combine_blocks(group * q_len, 16, BLOCK_D)
    return Launcher(balanced_kernel, dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D,
                                          BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_B=max(16, triton.next_power_of_2(B)),
                                          FP32_DOT=fp32_dot(dtype), TILE_UPDATE=tile_update, PAGE=page, Q_LEN=q_len,
                                          TIMELINE=timeline, K_SCALE=scale_modes[0], V_SCALE=scale_modes[1],
                                          num_warps=cfg.num_warps, num_stages=cfg.num_stages), dtype_slots)


def balanced_args(q, k_cache, v_cache, lens, scale, budget, out, lse, o_part, lse_part, counters, flag,
                  block_table=None, times=None, scales=None):
    """(grid, pointers, scalars) of one launch; ``o_part`` [items, H_q, D] and ``lse_part`` [H_q, items] float32
    (a row's partials lie at its consecutive items) with items >= :func:`items_max`. Several query tokens: q
    and out ``[B, q_len, H_q, D]``, lse ``[B, q_len, H_q]``, o_part [items, q_len, H_q, D], lse_part
    [q_len, H_q, items]. ``times``: the timeline buffer of a TIMELINE launch (else the flag stands in).
    ``scales``: an 8-bit cache's scale pointers and scalars (:func:`~fdlib.kernels.launch.scale_args`)."""
    sp, sc = scale_args(scales, flag)
    B = q.shape[0]
    qs, ks, vs, os_, ls = strides4(q), k_cache.stride(), v_cache.stride(), strides4(out), strides4(lse, 3)
    ps = strides4(o_part)
    lps = lse_part.stride() if lse_part.dim() == 3 else (0, *lse_part.stride())
    bt, bt_stride, n_pages, L_max = paging(k_cache, block_table, flag)
    return ((items_max(B, budget), k_cache.shape[2]),
            (q, k_cache, v_cache, lens, o_part, lse_part, counters, out, lse, flag, bt,
             flag if times is None else times, *sp),
            (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], ps[0], ps[1], ps[2], lps[0], lps[1],
             os_[0], os_[1], os_[2], ls[0], ls[1], ls[2], scale * LOG2E, B, budget, k_cache.shape[2], L_max,
             bt_stride, n_pages, *sc))
