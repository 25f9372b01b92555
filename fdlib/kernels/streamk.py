r"""The stream-K kernel: P programs share a ragged batch's tiles equally, cutting rows wherever they fall.

Each KV head h has the same rows, one per sequence: lay sequence b's tiles end to end,
:math:`T_b = \max(1, \lceil L_b/N\rceil)` tiles (an empty row still takes one, to write O = 0, lse = −∞).
The :math:`P = H_{kv} P_h` programs are :math:`P_h` per head, program :math:`p = q H_{kv} + h` taking the
share :math:`q` of head h's tiles:

.. math::  T = \sum_b T_b, \qquad \text{share } q \text{ of head } h: \text{tiles } [t_0, t_1) =
           [\lfloor qT/P_h \rfloor,\ \lfloor (q+1)T/P_h \rfloor).

Every program streams the same number of tiles (±1) in **one** software-pipelined loop, whatever the mix of
lengths, and pays its start-up once (the persistent kernel's loop, :mod:`fdlib.kernels.persistent`, over
equal shares instead of whole rows). Programs launched together, :math:`p = qH_{kv}, \dots, qH_{kv} + H_{kv}-1`,
hold the same share of neighbouring heads, so they read the same tokens at the same time, as the persistent
kernel's neighbouring rows do; shares laid over the rows (b, h) in order put each program's tiles far from its
neighbours' and streamed up to 9% slower on the H200 (B=32 32:32, rows of 1024 keys: 133.4 against 122.8 µs,
results/h200/ragged-fp16-streamk-fc2f57f.json and ragged-fp16-49e0d6b.json). On rows of equal length
(:math:`T_b` all equal) with :math:`s = \lfloor P_h/B\rfloor \ge 1` and at most one program in ALIGN_IDLE
left idle, only :math:`P = sB` shares take part: each row is then cut into s pieces of whole tiles and no share
holds parts of two rows, the decomposition of the unified kernel's splits (:func:`active_shares`; on an H100, B=32
32:8 rows of 1024 keys took 1.02x the host plan's time instead of 1.11x, results/h100/device-ragged/align). A
share inside one row runs the unified kernel's loop over one split (``one_row``: the row's queries loaded once, no
search for a tile's row, the row's end after the loop; sm_90: 337 instructions a tile on a contiguous cache against
the general loop's 677): on an H100 seven batches of equal rows took 1.014x the host plan in geometric mean, worst
1.029x, against 1.042x and 1.068x with the general loop (results/h100/streamk-lean/final/ab-equal-rows.md).
Fewer tiles than programs:
only the first T shares of each head take part, one tile each, so that every share of :math:`q_a \dots q_b`
holds a piece of a cut row and its n pieces lie in n consecutive slots. Tile t of a head belongs to sequence
:math:`b = \#\{b : E_b \le t\}`, :math:`E_b = T_0 + \dots + T_b`, tile :math:`j = t - E_{b-1}` of its row (all
B lengths kept in registers, computed in every program: nothing is read on the host, so a captured graph stays
balanced when the lengths change in place).

A row that starts and ends inside a program's share is written directly (masked stores at its last tile; the
state restarts for the next row). A row cut by share boundaries leaves one partial (O, lse) per share it
touches, :math:`q_a \dots q_b` with :math:`q(t) = \lfloor ((t+1)P_h - 1)/T \rfloor`; share q stores its piece
at slot :math:`2P_h h + q_a + q + 1`, so the row's pieces lie at slots :math:`2P_h h + 2q_a + 1 \dots
2P_h h + 2q_a + n` (n = q_b − q_a + 1) and no two rows' slots overlap (2P slots in all). The last of the n
programs to take the row's ticket merges them (:func:`~fdlib.kernels.tile.take_ticket`,
:func:`~fdlib.kernels.tile.combine_heads`). A program has at most two pieces: its first row (begun by an
earlier share) and its last (continued by a later one).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher, paging, scale_args, strides4
from .tile import (LOG2E, TABLE_AHEAD_PAGE, batch_tiles, combine_blocks, combine_heads, empty_state, finish_state,
                   group_queries, head_row, k_scaled, load_lengths, paged_tile_rows, restart_where, row_tile_update,
                   row_walk_offsets, scale_row, store_out, store_partial, take_ticket, tile_update, timeline_record,
                   timeline_start)

MAX_BATCH = 4096
"""Every program keeps all B lengths in registers; larger batches use the other kernels."""

ROW_WINDOW = 32
"""The loop finds each tile's row among a window of this many sequences (BLOCK_W, at most BLOCK_B)."""
MIN_BLOCK_B = 32
"""BLOCK_B, the lengths a program holds, is the batch rounded up to a power of two, at least this. With 16 (B =
8), stream-K streamed 2-7% slower on the H200 than with 32 or 128 (results/h200/ab/ab-ragged-b8.json: B=8
32:32 constant 8192 keys 260.0 against 242.3 µs, as fast as the persistent kernel's 242.2; B=8 32:8 uniform
mean 32768 247.1 against 233.6)."""

ALIGN_IDLE = 8
"""On rows of equal length the shares are B·⌊P_h/B⌋ (each row cut into the same number of pieces, no share
holding parts of two rows) where that leaves at most one program in ALIGN_IDLE without a share
(:func:`active_shares`); 0: never (every launch P_h shares, cut wherever they fall)."""

MAX_REGISTERS = None
"""A cap on the registers a thread (Triton's ``maxnreg``), so that more programs fit on an SM; None: the
compiler's choice."""


@triton.jit
def program_of(t, T, P):
    """The program whose share [⌊pT/P⌋, ⌊(p+1)T/P⌋) holds tile t (64-bit products)."""
    return (((t.to(tl.int64) + 1) * P - 1) // T).to(tl.int32)


@triton.jit
def tile_row(t, offs_b, ends, tiles, lens):
    """(b, tiles of the row T_b, tile j within the row, L_b) of tile t of a head's tile sequence."""
    b = tl.sum((ends <= t).to(tl.int32), 0)
    here = offs_b == b
    T_b = tl.sum(tl.where(here, tiles, 0), 0)
    return b, T_b, t - (tl.sum(tl.where(here, ends, 0), 0) - T_b), tl.sum(tl.where(here, lens, 0), 0)


@triton.jit
def hand_off(b, h, s0, n, O_PART, LSE_PART, COUNTERS, OUT, LSE, stride_pp, n_slots,
             stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, H_KV,
             GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
             BLOCK_D: tl.constexpr, D: tl.constexpr):
    """After storing its piece of row (b, h): take the row's ticket; the last of its n programs merges the
    pieces at slots s0 ... s0 + n - 1 into O and lse."""
    if take_ticket(COUNTERS + b * H_KV + h, n):
        h0 = h * GROUP
        combine_heads(O_PART + s0.to(tl.int64) * stride_pp, LSE_PART + s0, n, GROUP * D, D, stride_pp,
                      GROUP * n_slots, n_slots, OUT + b * stride_ob + h0 * stride_oh, stride_ot, stride_oh,
                      LSE + b * stride_sb + h0 * stride_sh, stride_st, stride_sh,
                      GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D, True, False)


@triton.jit
def end_row(m, l, acc, last, whole, piece, offs_g, mask_gd, h, b, slot_f, O_PART, LSE_PART, OUT, LSE, stride_pp,
            n_slots, stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, GROUP: tl.constexpr,
            Q_LEN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SC=None, V_SCALE: tl.constexpr = 0):
    """The end of row (b, h) at a tile: its (O, lse) from (m, ℓ, Õ), stored as the output where the scalar
    ``whole`` holds (the row ends here and began in this share), as the share's first piece at slot ``slot_f``
    where ``piece`` does (it began in an earlier share); the state is emptied where ``last`` holds (the tile
    ends its row), else kept (masked stores and selects, no branch). An 8-bit cache's per-tensor or per-head V
    scale (SC at head h) goes into the output (:func:`~fdlib.kernels.tile.finish_state`)."""
    o, lse = finish_state(m, l, acc, SC, V_SCALE)
    store_out(o, lse, offs_g, mask_gd, h * GROUP, OUT + b * stride_ob, stride_ot, stride_oh, LSE + b * stride_sb,
              stride_st, stride_sh, whole, GROUP, Q_LEN, BLOCK_D)
    store_partial(o, lse, offs_g, mask_gd, 0, slot_f, O_PART, GROUP * D, D, stride_pp, LSE_PART, GROUP * n_slots,
                  n_slots, piece, GROUP, Q_LEN, BLOCK_D)
    return restart_where(last, m, l, acc)


@triton.jit
def streamk_kernel(Q, K, V, LENS, O_PART, LSE_PART, COUNTERS, OUT, LSE, FLAG, BT, TIMES, KS, VS,
                   stride_qb, stride_qt, stride_qh,
                   stride_kb, stride_kl, stride_kh,
                   stride_vb, stride_vl, stride_vh,
                   stride_pp, n_slots,
                   stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh,
                   qk_scale, n_batch, H_KV, L_MAX, stride_bt, n_pages,
                   stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul,
                   GROUP: tl.constexpr, D: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, FP32_DOT: tl.constexpr,
                   TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr, Q_LEN: tl.constexpr = 1,
                   TIMELINE: tl.constexpr = False, BLOCK_W: tl.constexpr = ROW_WINDOW, K_SCALE: tl.constexpr = 0,
                   V_SCALE: tl.constexpr = 0, ALIGN: tl.constexpr = 0):
    if TIMELINE:
        t_start = timeline_start()
    P_h = tl.num_programs(0) // H_KV                       # shares a head (the launch is H_kv·P_h programs)
    q = tl.program_id(0) // H_KV
    h = tl.program_id(0) % H_KV
    offs_b, lens, tiles = batch_tiles(LENS, n_batch, L_MAX, FLAG, BLOCK_B, BLOCK_N)
    ends = tl.cumsum(tiles, 0)                                          # E_b
    T = tl.sum(tiles, 0)
    # the shares taking part (active_shares): each has >= 1 tile; on rows of equal length, a multiple of B that
    # cuts every row into the same number of whole pieces, where at most one program in ALIGN_IDLE is left idle
    P = P_h
    one_row = False      # every share lies in one row (aligned shares on equal rows)
    if ALIGN > 0:
        s = P_h // tl.maximum(n_batch, 1)   # no sequences (a plan called with none): no division by 0
        equal = tl.min(tl.where(offs_b < n_batch, tiles, 2147483647), 0) == tl.max(tiles, 0)
        one_row = equal & (s >= 1) & (ALIGN * n_batch * s >= (ALIGN - 1) * P_h)
        P = tl.where(one_row, n_batch * s, P_h)
    P = tl.maximum(tl.minimum(P, T), 1)
    t0 = (q.to(tl.int64) * T // P).to(tl.int32)
    t1 = ((q.to(tl.int64) + 1) * T // P).to(tl.int32)
    base = 2 * P_h * h + 1                                              # slot of piece 0 of share 0 of head h
    if (q < P) & (t0 < t1):
        # the first row's piece (begun by an earlier share, ending here) and its slot
        b_f, T_f, j_f, L_f = tile_row(t0, offs_b, ends, tiles, lens)
        q_af = program_of(t0 - j_f, T, P)
        slot_f = base + q_af + q
        offs_g, offs_n, offs_d, mask_d, mask_g, mask_gd, k_offs, v_offs = row_walk_offsets(
            stride_kl, stride_vl, GROUP, Q_LEN, D, BLOCK_G, BLOCK_N, BLOCK_D)
        m, l, acc = empty_state(BLOCK_G, BLOCK_D)
        # an 8-bit cache's scales (tile.head_row): every tile of the program is of head h
        SC = (KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul)
        SC_h = head_row(SC, h, K_SCALE, V_SCALE)
        qk = k_scaled(qk_scale, SC_h, K_SCALE)
        if one_row:
            # the share lies in row b_f, tiles j_f .. j_f + t1 - t0 - 1: the unified kernel's loop over one split
            # (the row's queries loaded once, no search for a tile's row, the row's end once, after the loop)
            q_row = group_queries(Q, b_f, h, stride_qb, stride_qt, stride_qh, GROUP, Q_LEN, D, BLOCK_G, BLOCK_D)[0]
            sc_b = scale_row(SC, b_f, h, PAGE, K_SCALE, V_SCALE)
            if PAGE >= TABLE_AHEAD_PAGE:   # each tile's table rows read one tile ahead (tile.paged_tile_rows)
                ahead_ln = paged_tile_rows(BT, b_f, j_f * BLOCK_N, L_f, offs_n, stride_bt, n_pages, FLAG, stride_kb,
                                           stride_kl, stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)
            for i_l in range(0, t1 - t0):
                j_l = j_f + i_l
                if PAGE >= TABLE_AHEAD_PAGE:
                    ahead_l = ahead_ln
                    ahead_ln = paged_tile_rows(BT, b_f, (j_l + 1) * BLOCK_N, L_f, offs_n, stride_bt, n_pages, FLAG,
                                               stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)
                else:
                    ahead_l = None
                m, l, acc = row_tile_update(Q, K, V, b_f, h, j_l * BLOCK_N, L_f, m, l, acc, offs_g, offs_n, offs_d,
                                            mask_d, k_offs, v_offs, qk, stride_qb, stride_qt, stride_qh, stride_kb,
                                            stride_kl, stride_kh, stride_vb, stride_vl, stride_vh, BT, stride_bt,
                                            n_pages, FLAG, GROUP, Q_LEN, D, BLOCK_G, BLOCK_D, FP32_DOT, TILE_UPDATE,
                                            PAGE, ahead_l, q_row, sc_b, K_SCALE, V_SCALE)
            n_l = program_of(t0 - j_f + T_f - 1, T, P) - q_af + 1                # the row's pieces
            end_row(m, l, acc, True, n_l == 1, n_l > 1, offs_g, mask_gd, h, b_f, slot_f, O_PART, LSE_PART, OUT, LSE,
                    stride_pp, n_slots, stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, GROUP,
                    Q_LEN, D, BLOCK_D, SC_h, V_SCALE)
            if n_l > 1:
                hand_off(b_f, h, base + 2 * q_af, n_l, O_PART, LSE_PART, COUNTERS, OUT, LSE, stride_pp, n_slots,
                         stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, H_KV,
                         GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D)
        else:
            if PAGE == 0:   # the queries of each tile's row, loaded with the tile (row_tile_update)
                q_b, q_n = None, None
            else:           # the queries of the row being streamed (q_b) and of the next row (q_n), a row ahead, so
                # that a row's first tile does not wait on a load issued at the row before it ends: on the H200 over
                # pages of 16, the same lengths, two rounds each (results/h200/ab/ab-qahead-{o,n}*.json), 0.980-0.988x
                # the time at 32:8 (rows of 1024 to 8192 keys), 0.998-1.010x at 32:32
                q_b = group_queries(Q, b_f, h, stride_qb, stride_qt, stride_qh, GROUP, Q_LEN, D, BLOCK_G, BLOCK_D)[0]
                q_n = group_queries(Q, tl.minimum(b_f + 1, n_batch - 1), h, stride_qb, stride_qt, stride_qh, GROUP,
                                    Q_LEN, D, BLOCK_G, BLOCK_D)[0]
            # the share's rows b_f .. b_last, walked in windows of BLOCK_W sequences: finding tile t's row in a
            # window is a reduction within one warp, where one over all B (BLOCK_B = 128) crossed the warps with a
            # barrier on every tile and streamed 13% slower on the H200 (B=128 32:32 uniform mean 1024: 552.4
            # against 487.5 µs, results/h200/ragged-fp16-49e0d6b.json and ragged-fp16-20bb156.json)
            b_last = tl.sum((ends <= t1 - 1).to(tl.int32), 0)
            offs_w = tl.arange(0, BLOCK_W)
            for w0 in range(b_f, b_last + 1, BLOCK_W):
                in_w = w0 + offs_w <= b_last
                lens_w = load_lengths(LENS, w0 + offs_w, in_w, L_MAX, FLAG)
                tiles_w = tl.where(in_w, tl.maximum(tl.cdiv(lens_w, BLOCK_N), 1), 0)
                e0 = tl.sum(tl.where(offs_b < w0, tiles, 0), 0)              # the window's first tile, E_{w0-1}
                ends_w = e0 + tl.cumsum(tiles_w, 0)
                t_lo = tl.maximum(t0, e0)
                if PAGE >= TABLE_AHEAD_PAGE:   # each tile's table rows read one tile ahead (tile.paged_tile_rows)
                    b_n, T_n, j_n, L_n = tile_row(t_lo, offs_w, ends_w, tiles_w, lens_w)
                    ahead_n = paged_tile_rows(BT, b_n + w0, j_n * BLOCK_N, L_n, offs_n, stride_bt, n_pages, FLAG,
                                               stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)
                for t in range(t_lo, tl.minimum(t1, e0 + tl.sum(tiles_w, 0))):
                    if PAGE >= TABLE_AHEAD_PAGE:
                        b, T_b, j, L, ahead = b_n + w0, T_n, j_n, L_n, ahead_n
                        b_n, T_n, j_n, L_n = tile_row(t + 1, offs_w, ends_w, tiles_w, lens_w)
                        ahead_n = paged_tile_rows(BT, b_n + w0, j_n * BLOCK_N, L_n, offs_n, stride_bt, n_pages, FLAG,
                                                  stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC, K_SCALE,
                                                  V_SCALE)
                    else:
                        b, T_b, j, L = tile_row(t, offs_w, ends_w, tiles_w, lens_w)
                        b += w0
                        ahead = None
                    m, l, acc = row_tile_update(Q, K, V, b, h, j * BLOCK_N, L, m, l, acc, offs_g, offs_n, offs_d,
                                                mask_d, k_offs, v_offs, qk, stride_qb, stride_qt, stride_qh, stride_kb,
                                                stride_kl, stride_kh, stride_vb, stride_vl, stride_vh, BT, stride_bt,
                                                n_pages, FLAG, GROUP, Q_LEN, D, BLOCK_G, BLOCK_D, FP32_DOT, TILE_UPDATE,
                                                PAGE, ahead, q_b, scale_row(SC, b, h, PAGE, K_SCALE, V_SCALE), K_SCALE,
                                                V_SCALE)
                    # tile t ends its row: a row begun in this share is written whole, the first row's piece (begun
                    # earlier) goes to its slot; either way the next row starts from the empty state. Over pages
                    # that is a branch taken once a row, and the next row's queries are loaded there: normalising,
                    # storing masked and loading the queries every tile cost the sm_90 build 253 of its 734
                    # instructions a tile that ends no row (tools/loop_sass.py), and with the branch 10 paged batches
                    # took 0.866-0.978x the time (geometric mean 0.904; results/h200/ab/ab-rowend-*.json). On a
                    # contiguous cache, in the same call, 6 batches took 0.997-1.023x (rows of 1024 keys 1.007-1.023x),
                    # so there every tile does it, masked.
                    last = j == T_b - 1
                    if PAGE == 0:
                        m, l, acc = end_row(m, l, acc, last, last & (t - j >= t0), last & (t - j < t0), offs_g,
                                            mask_gd, h, b, slot_f, O_PART, LSE_PART, OUT, LSE, stride_pp, n_slots,
                                            stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, GROUP,
                                            Q_LEN, D, BLOCK_D, SC_h, V_SCALE)
                    elif last:
                        m, l, acc = end_row(m, l, acc, True, t - j >= t0, t - j < t0, offs_g, mask_gd, h, b, slot_f,
                                            O_PART, LSE_PART, OUT, LSE, stride_pp, n_slots, stride_ob, stride_ot,
                                            stride_oh, stride_sb, stride_st, stride_sh, GROUP, Q_LEN, D, BLOCK_D, SC_h,
                                            V_SCALE)
                        q_b = q_n
                        q_n = group_queries(Q, tl.minimum(b + 2, n_batch - 1), h, stride_qb, stride_qt, stride_qh,
                                            GROUP, Q_LEN, D, BLOCK_G, BLOCK_D)[0]
            # the last row, continued by later shares: its piece from the state the loop ended in
            b_l, T_l, j_l, L_l = tile_row(t1 - 1, offs_b, ends, tiles, lens)
            q_al = program_of(t1 - 1 - j_l, T, P)
            cont = t1 - 1 - j_l + T_l > t1                                    # the row's last tile lies past t1 - 1
            if cont:
                o, lse = finish_state(m, l, acc, SC_h, V_SCALE)
                store_partial(o, lse, offs_g, mask_gd, 0, base + q_al + q, O_PART, GROUP * D, D, stride_pp, LSE_PART,
                              GROUP * n_slots, n_slots, True, GROUP, Q_LEN, BLOCK_D)
            if (j_f > 0) & (t0 - j_f + T_f <= t1):                           # the first row ended here, begun earlier
                hand_off(b_f, h, base + 2 * q_af, q - q_af + 1, O_PART, LSE_PART, COUNTERS, OUT, LSE, stride_pp,
                         n_slots, stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, H_KV,
                         GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D)
            if cont:
                q_bl = program_of(t1 - 1 - j_l + T_l - 1, T, P)
                hand_off(b_l, h, base + 2 * q_al, q_bl - q_al + 1, O_PART, LSE_PART, COUNTERS, OUT, LSE, stride_pp,
                         n_slots, stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh, H_KV,
                         GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D)
    if TIMELINE:
        timeline_record(TIMES, t_start)


def active_shares(row_tiles, programs: int) -> int:
    r"""P, the shares of one KV head that take part, of P_h = ``programs`` launched, for rows of ``row_tiles``
    tiles (the kernel's rule): at most T, at least 1; on rows of equal length, B·⌊P_h/B⌋ where that leaves at
    most one program in ALIGN_IDLE idle, so that every row is cut into ⌊P_h/B⌋ pieces of equal tiles and no share
    ends one row and begins another (no merge across rows, as the unified kernel's splits); else P_h.

    .. math::  P = \max(1, \min(T, P')), \quad P' = \begin{cases} B\lfloor P_h/B\rfloor & T_b \text{ all equal},
               \ A\,B\lfloor P_h/B\rfloor \ge (A-1)P_h \\ P_h & \text{else} \end{cases}"""
    B, T = len(row_tiles), sum(row_tiles)
    s = programs // B
    aligned = (ALIGN_IDLE > 0 and len(set(row_tiles)) == 1 and s >= 1
               and ALIGN_IDLE * B * s >= (ALIGN_IDLE - 1) * programs)
    return max(1, min(T, B * s if aligned else programs))


def shares(row_tiles, programs: int) -> list[dict]:
    """The kernel's schedule of one KV head, on the host (tests and figures): for rows of ``row_tiles`` tiles
    each (one per sequence, in order) and P_h = ``programs`` shares, one dict per row: its tiles [start, end),
    the shares p_a .. p_b that touch it, and the slots of its pieces within the head's 2·P_h (empty for a row
    inside one share; head h adds 2·P_h·h)."""
    T = sum(row_tiles)
    programs = active_shares(row_tiles, programs)   # as the kernel: the shares that take part
    rows, start = [], 0
    for n in row_tiles:
        end = start + n
        p_a, p_b = ((start + 1) * programs - 1) // T, (end * programs - 1) // T
        slots = [p_a + p + 1 for p in range(p_a, p_b + 1)] if p_b > p_a else []
        rows.append(dict(start=start, end=end, p_a=p_a, p_b=p_b, slots=slots))
        start = end
    return rows


def slots_for(programs: int) -> int:
    """Partial slots a launch of ``programs`` programs may use: 2P (2·P_h per head, a head's slots
    q_a + q + 1 <= 2P_h - 1)."""
    return 2 * max(1, programs)


def streamk_programs(H_kv: int, sms: int, per_sm: int) -> int:
    """P = H_kv·P_h, the most programs that fit ``per_sm`` to an SM with the same number of shares P_h for
    every head (at least one each)."""
    return H_kv * max(1, sms * per_sm // max(1, H_kv))


def streamk_launcher(dtype, group: int, D: int, B: int, cfg, dtype_slots=None, page: int = 0, q_len: int = 1,
                     timeline: bool = False, scale_modes: tuple = (0, 0)) -> Launcher:
    """The stream-K kernel with its constexprs fixed (BLOCK_B covers the planned batch B; group × q_len query
    rows a program; ``timeline``: the variant that records each program's (SM, start, end); ``scale_modes``:
    (K_SCALE, V_SCALE) of an 8-bit cache)."""
    BLOCK_G, BLOCK_D = block_sizes(group * q_len, D)
    block_h, block_s = combine_blocks(group * q_len, 16, BLOCK_D)
    block_b = max(MIN_BLOCK_B, triton.next_power_of_2(B))
    caps = {} if MAX_REGISTERS is None else dict(maxnreg=MAX_REGISTERS)
    return Launcher(streamk_kernel, dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D,
                                         BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_B=block_b,
                                         BLOCK_W=min(ROW_WINDOW, block_b),
                                         FP32_DOT=fp32_dot(dtype), TILE_UPDATE=tile_update, PAGE=page, Q_LEN=q_len,
                                         TIMELINE=timeline, K_SCALE=scale_modes[0], V_SCALE=scale_modes[1],
                                         ALIGN=ALIGN_IDLE, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                         **caps),
                    dtype_slots)


def streamk_args(q, k_cache, v_cache, lens, scale, programs, out, lse, o_part, lse_part, counters, flag,
                 block_table=None, times=None, scales=None):
    """(grid, pointers, scalars) of one launch of ``programs`` programs (a multiple of H_kv,
    :func:`streamk_programs`); ``o_part`` [slots, q_len·group, D] and
    ``lse_part`` [q_len·group, slots] float32 (slots >= :func:`slots_for`), ``counters`` zeroed int32 [B·H_kv].
    q and out ``[B, H_q, D]`` or ``[B, q_len, H_q, D]``, lse ``q.shape[:-1]``. ``times``: the timeline buffer
    of a TIMELINE launch (else the flag stands in). ``scales``: an 8-bit cache's scale pointers and scalars
    (:func:`~fdlib.kernels.launch.scale_args`)."""
    sp, sc = scale_args(scales, flag)
    B, H_kv = q.shape[0], k_cache.shape[2]
    if programs % H_kv:
        raise ValueError(f"programs: stream-K launches the same number of shares for every KV head, a multiple of "
                         f"H_kv={H_kv}; got {programs}")
    qs, ks, vs, os_, ls = strides4(q), k_cache.stride(), v_cache.stride(), strides4(out), strides4(lse, 3)
    bt, bt_stride, n_pages, L_max = paging(k_cache, block_table, flag)
    return ((programs,),
            (q, k_cache, v_cache, lens, o_part, lse_part, counters, out, lse, flag, bt,
             flag if times is None else times, *sp),
            (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], o_part.stride(0), lse_part.shape[1],
             os_[0], os_[1], os_[2], ls[0], ls[1], ls[2], scale * LOG2E, B, H_kv, L_max,
             bt_stride, n_pages, *sc))
