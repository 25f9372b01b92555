r"""The persistent no-split kernel: one launch of P programs walks all B·H_kv rows, one tile at a time.

With one split per row, the plain grid ``(B, H_kv, 1)`` starts B·H_kv programs and each one pays a fixed
start-up: launch, read its length and queries, fill the load pipeline before the first tile arrives, drain it
after the last. For short caches (a row of 512 keys is 4 tiles) that start-up is a large part of each
program's life, and every program on an SM pays it at the same moment. Here a fixed set of P programs
(a few per SM) shares the rows: program p owns rows :math:`r_j = p + jP`, j = 0, 1, ..., and runs **one** loop
over the tiles of all its rows,

.. math::  t = 0, 1, \dots, T_p - 1,\qquad T_p = \sum_j n_j,\quad n_j = \max(1, \lceil L_{b(r_j)}/N\rceil),

so the load pipeline keeps prefetching across row boundaries: tile t of the flat loop belongs to row slot
:math:`j(t) = \#\{j : E_j \le t\}` with :math:`E_j = n_0 + \dots + n_j` (a cumulative sum kept in registers).
Each tile is the usual :func:`~fdlib.kernels.tile.tile_update` on the row's queries (group × q_len query rows,
each stopping at its causal limit when q_len > 1); on the last tile of a row
the program writes :math:`O = \tilde O/\ell` and lse (masked stores: nothing branches inside the loop) and
starts the next row from the empty state. Rows are whole, so there is nothing to merge.

Row r is (b, h_kv) = (r div H_kv, r mod H_kv): programs that run at the same time read neighbouring heads of
the same tokens.

With CHUNKS > 0 the kernel is the batch-invariant one's schedule for short rows of a large batch
(:mod:`fdlib.kernels.invariant`): each row is cut into its chunks by its own length (:func:`chunk_of`), the
online softmax restarts at each chunk's first tile, and each chunk's partial is folded into the row's merge as
the chunk ends (:func:`~fdlib.kernels.tile.fold_partial`, in chunk order), so a row gets bit for bit what the
invariant kernel's program alone on its row computes; which program walks it changes nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher, paging, q_len_of, scale_args, strides4
from .invariant import CHUNKS, MIN_TILES, chunk_of
from .tile import (LOG2E, TABLE_AHEAD_PAGE, empty_state, finish_state, fold_result, fold_where, k_scaled,
                   load_lengths, paged_tile_rows, restart_where, row_tile_update, row_walk_offsets, scale_row, store_out,
                   tile_update, timeline_record, timeline_start)


@triton.jit
def tile_of(t, slots, ends, lens, tiles, BLOCK_N: tl.constexpr):
    """Tile t of a program's flat loop: its row slot j = #{j : E_j ≤ t}, the end E_j, the row's length L and the
    tile's first key n0 in its row. Past the last tile, j = ROWS and L = 0 (nothing of it is read)."""
    j = tl.sum((ends <= t).to(tl.int32), 0)
    here = slots == j
    end_j = tl.sum(tl.where(here, ends, 0), 0)
    L = tl.sum(tl.where(here, lens, 0), 0)
    n0 = (t - (end_j - tl.sum(tl.where(here, tiles, 0), 0))) * BLOCK_N
    return j, end_j, L, n0


@triton.jit
def persistent_kernel(Q, K, V, LENS, OUT, LSE, FLAG, BT, TIMES, KS, VS,
                      stride_qb, stride_qt, stride_qh,
                      stride_kb, stride_kl, stride_kh,
                      stride_vb, stride_vl, stride_vh,
                      stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh,
                      qk_scale, n_rows, H_KV, L_MAX, stride_bt, n_pages,
                      stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul,
                      GROUP: tl.constexpr, D: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      ROWS: tl.constexpr, FP32_DOT: tl.constexpr, TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr,
                      Q_LEN: tl.constexpr = 1, TIMELINE: tl.constexpr = False, CHUNKS: tl.constexpr = 0,
                      MIN_TILES: tl.constexpr = 1, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    if TIMELINE:
        t_start = timeline_start()
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    slots = tl.arange(0, ROWS)
    rows = pid + slots * P
    mine = rows < n_rows
    lens = load_lengths(LENS, rows // H_KV, mine, L_MAX, FLAG)
    tiles = tl.where(mine, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0)   # an empty row still takes one tile
    ends = tl.cumsum(tiles, 0)                                          # E_j
    total = tl.sum(tiles, 0)

    offs_g, offs_n, offs_d, mask_d, mask_g, mask_gd, k_offs, v_offs = row_walk_offsets(
        stride_kl, stride_vl, GROUP, Q_LEN, D, BLOCK_G, BLOCK_N, BLOCK_D)
    m, l, acc = empty_state(BLOCK_G, BLOCK_D)
    f_m, f_den, f_acc = empty_state(BLOCK_G, BLOCK_D)      # CHUNKS > 0: the row's merge of its chunks
    SC = (KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul)   # 8-bit caches
    if PAGE >= TABLE_AHEAD_PAGE:   # each tile's table rows read one tile ahead (tile.paged_tile_rows)
        j_n, end_n, L_n, n0_n = tile_of(0, slots, ends, lens, tiles, BLOCK_N)
        ahead_n = paged_tile_rows(BT, (pid + j_n * P) // H_KV, n0_n, L_n, offs_n, stride_bt, n_pages, FLAG, stride_kb,
                                 stride_kl, stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)
    for t in range(0, total):
        if PAGE >= TABLE_AHEAD_PAGE:
            j, end_j, L, n0, ahead = j_n, end_n, L_n, n0_n, ahead_n
            j_n, end_n, L_n, n0_n = tile_of(t + 1, slots, ends, lens, tiles, BLOCK_N)
            ahead_n = paged_tile_rows(BT, (pid + j_n * P) // H_KV, n0_n, L_n, offs_n, stride_bt, n_pages, FLAG,
                                     stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)
        else:
            j, end_j, L, n0 = tile_of(t, slots, ends, lens, tiles, BLOCK_N)
            ahead = None
        row = pid + j * P
        b = row // H_KV
        h_kv = row % H_KV
        SC_row = scale_row(SC, b, h_kv, PAGE, K_SCALE, V_SCALE)
        m, l, acc = row_tile_update(Q, K, V, b, h_kv, n0, L, m, l, acc, offs_g, offs_n, offs_d, mask_d, k_offs,
                                    v_offs, k_scaled(qk_scale, SC_row, K_SCALE), stride_qb, stride_qt, stride_qh,
                                    stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh, BT, stride_bt,
                                    n_pages, FLAG, GROUP, Q_LEN, D, BLOCK_G, BLOCK_D, FP32_DOT, TILE_UPDATE, PAGE,
                                    ahead, None, SC_row, K_SCALE, V_SCALE)
        # Tile t ends its row: one scalar flag, uniform over the program, selected into the masks with
        # tl.where (boolean in the compiled kernel and in the interpreter; a scalar compare `&`-ed into a mask
        # is int32 in Triton's interpreter, which Triton 3.9's tl.store refuses). A [BLOCK_G] block compare
        # instead made the persistent kernel ~5% slower on the H200.
        last = t + 1 == end_j
        o, lse = finish_state(m, l, acc, SC_row, V_SCALE)
        if CHUNKS > 0:   # a chunk (or the row) ends here: its partial folded into the row's merge, in order
            emit = ((n0 + BLOCK_N) % chunk_of(L, BLOCK_N, CHUNKS, MIN_TILES)[0] == 0) | last
            f_m, f_den, f_acc = fold_where(emit, f_m, f_den, f_acc, o, lse)
            o, lse = fold_result(f_m, f_den, f_acc)
            f_m, f_den, f_acc = restart_where(last, f_m, f_den, f_acc)
        else:
            emit = last
        store_out(o, lse, offs_g, mask_gd, h_kv * GROUP, OUT + b * stride_ob, stride_ot, stride_oh,
                  LSE + b * stride_sb, stride_st, stride_sh, last, GROUP, Q_LEN, BLOCK_D)
        m, l, acc = restart_where(emit, m, l, acc)
    if TIMELINE:   # one row per program, over all its rows
        timeline_record(TIMES, t_start)


MAX_ROWS_PER_PROGRAM = 256
"""A program keeps its rows' lengths in registers: more programs are launched rather than more rows each."""


def programs_for(n_rows: int, sms: int, per_sm: int) -> int:
    r"""P for ``n_rows`` rows: with at most SMs·per_sm programs each has :math:`k = \lceil \text{rows} /
    (\text{SMs}\cdot\text{per\_sm})\rceil` rows (k <= MAX_ROWS_PER_PROGRAM: more programs rather than more rows
    each), and :math:`P = \lceil \text{rows}/k \rceil` spreads them so that every program has k or k - 1 rows
    (512 rows on 264 slots: 256 programs of 2 rows, not 248 of 2 and 16 of 1)."""
    from .config import cdiv
    if n_rows <= 0:
        return 1
    k = min(cdiv(n_rows, max(1, sms * per_sm)), MAX_ROWS_PER_PROGRAM)
    return cdiv(n_rows, k)


def persistent_launcher(dtype, group: int, D: int, cfg, rows_per_program: int, tile_update_fn=None,
                        dtype_slots=None, page: int = 0, q_len: int = 1, timeline: bool = False,
                        invariant: bool = False, scale_modes: tuple = (0, 0)) -> Launcher:
    """The persistent kernel with its constexprs fixed; ``rows_per_program`` (a power of two) is its ROWS;
    ``page`` the page size of a paged cache (0: contiguous); ``q_len`` the query tokens per sequence;
    ``timeline``: the variant that records each program's (SM, start, end); ``invariant``: the batch-invariant
    rows (CHUNKS, MIN_TILES of :mod:`fdlib.kernels.invariant`; ``cfg`` must then be the invariant plan's tiles);
    ``scale_modes``: (K_SCALE, V_SCALE) of an 8-bit cache, (0, 0) for a 16-bit one."""
    BLOCK_G, BLOCK_D = block_sizes(group * q_len, D)
    return Launcher(persistent_kernel, dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D,
                                            ROWS=rows_per_program, FP32_DOT=fp32_dot(dtype),
                                            TILE_UPDATE=tile_update_fn or tile_update, PAGE=page, Q_LEN=q_len,
                                            TIMELINE=timeline, CHUNKS=CHUNKS if invariant else 0,
                                            MIN_TILES=MIN_TILES, K_SCALE=scale_modes[0], V_SCALE=scale_modes[1],
                                            num_warps=cfg.num_warps,
                                            num_stages=cfg.num_stages), dtype_slots)


def persistent_args(q, k_cache, v_cache, lens, scale, out, lse, programs: int, flag, block_table=None, times=None,
                    scales=None):
    """(grid, pointers, scalars) of one launch over all B·H_kv rows (at most one program per row); with a
    ``block_table`` [B, max_pages] the caches are pages [n_pages, page_size, H_kv, D]. q, out ``[B, H_q, D]``
    and lse ``[B, H_q]``, or ``[B, q_len, H_q, D]`` and ``[B, q_len, H_q]``. ``times``: the timeline buffer of a
    TIMELINE launch (else the flag stands in for the unused pointer). ``scales``: an 8-bit cache's scale pointers
    and scalars (:func:`~fdlib.kernels.launch.scale_args`)."""
    sp, sc = scale_args(scales, flag)
    H_kv = k_cache.shape[2]
    n_rows = q.shape[0] * H_kv
    qs, ks, vs, os_, ls = strides4(q), k_cache.stride(), v_cache.stride(), strides4(out), strides4(lse, 3)
    bt, bt_stride, n_pages, L_max = paging(k_cache, block_table, flag)
    return ((max(1, min(programs, n_rows)),),
            (q, k_cache, v_cache, lens, out, lse, flag, bt, flag if times is None else times, *sp),
            (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2], ls[0], ls[1],
             ls[2], scale * LOG2E, n_rows, H_kv, L_max, bt_stride, n_pages, *sc))


def rows_for(n_rows: int, programs: int) -> int:
    """ROWS: the power of two >= the rows each of ``programs`` programs owns."""
    from .config import cdiv
    return triton.next_power_of_2(cdiv(n_rows, max(1, min(programs, n_rows))))


def run_persistent(q, k_cache, v_cache, lens, scale, cfg, out, lse, programs: int, tile_update_fn=None, *,
                   flag=None, block_table=None):
    """One launch of ``programs`` programs over all B·H_kv rows (one split each); writes out and lse in place."""
    from .unified import scratch_flag
    B, H_q, D = q.shape[0], q.shape[-2], q.shape[-1]
    H_kv = k_cache.shape[2]
    programs = int(programs)
    launcher = persistent_launcher(q.dtype, H_q // H_kv, D, cfg, rows_for(B * H_kv, programs), tile_update_fn,
                                   page=0 if block_table is None else k_cache.shape[1], q_len=q_len_of(q))
    launcher(*persistent_args(q, k_cache, v_cache, lens, scale, out, lse, programs,
                              scratch_flag(q.device) if flag is None else flag, block_table))
