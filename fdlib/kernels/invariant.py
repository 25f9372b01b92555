r"""Batch-invariant decode: a row's arithmetic fixed by the row alone, its schedule free.

A sequence's result must not depend on its batchmates, so nothing that shapes its sums may depend on the
batch. What shapes them: the tiles (fixed BLOCK_N), where the row's partial sums start and stop (its
*chunks*), and the merge (the chunks' partials folded in index order). The chunks are a
function of the row's own length L only:

.. math::  \text{tiles per chunk} = \max\bigl(\text{MIN\_TILES},\ \lceil \lceil L/N \rceil / \text{CHUNKS} \rceil\bigr),
           \qquad n_{chunks} = \lceil L / \text{chunk} \rceil \le \text{CHUNKS},

so a short row is cut finely (a batch of one still fills the GPU) and no row has more than CHUNKS chunks.

What may depend on the batch is only *who computes what*: program p of a row computes chunks
[p·k, (p+1)·k) one after another in one pass over the keys, restarting the online softmax (m, ℓ, Õ) at each
chunk's first tile, so each chunk's partial (O_c, lse_c) is bit for bit what a program computing that chunk
alone would get. The plan picks k (``per_program``) so that a large batch runs one program per row and a
small one about one per chunk. The partials are then merged in chunk order by one fixed sequence of
operations, :func:`~fdlib.kernels.tile.fold_partial` (c = 0, 1, …, n − 1), whoever does it:

* in a plan whose every program is alone on its row (k >= the most chunks a row can have: ``ALONE``) a program
  folds each chunk's partial into the merge as the chunk ends, in registers: no partial is written, nothing
  waits for anybody (the persistent kernel's walk of short rows does the same, :mod:`fdlib.kernels.persistent`);
* otherwise every program stores its chunks' partials (also one that has its whole row, unless the row is one
  chunk), takes the row's ticket, and the last one reads the n partials back and folds them in the same order
  (:func:`fold_chunks`: the loads all in flight before the first fold, on the group's real rows only).

The ticket decides only who merges, never the order, so a sequence's result does not depend on k.

Nor on when a row runs: with ``ORDER_B`` > 0 (a plan of one program a row, :data:`fdlib.plan.INVARIANT_ORDER`)
the grid is (H_kv, B, 1) and place i runs the i-th longest row (:func:`~fdlib.kernels.tile.longest_first`, from
the lengths on the device, as the unified kernel's longest-first launch), so the SMs take the longest rows first.

Nor on who chooses k: with ``SHARE`` (a plan of fewer rows than SMs, :data:`fdlib.plan.INVARIANT_SHARE`) each
program reads the B lengths and takes k for its row from one wave of equal shares of the batch's tiles
(:func:`device_share`, :func:`row_share`), so a long row among short ones gets more programs without host
lengths. The grid is (H_kv, :func:`share_programs`), of the shapes alone; program i of a KV head runs the row and
place of the rows' programs numbered in b order, and one past them exits at once. Any row may then get several
programs, so the kernel is the general one (partials stored, the ticket merges; not ALONE); nor ONE_CHUNK,
since k is not known when it is compiled. One loop for each case, chosen at run time, held 260 KB of shared
memory on sm_90 (140 KB for one loop: Triton gives each loop its own pipeline buffers), more than an SM has.

The chunk-end work (a partial, a fold, a restart) is done on every tile and kept only where a chunk ends, so
the loop stays one software-pipelined loop; a plan with k = 1 never ends a chunk inside the loop and compiles
the kernel without it (``ONE_CHUNK``), and a plan whose every program is alone on its row (k >= the most chunks a
row can have) compiles it without the partial stores and the ticket merge (``ALONE``). Measured on an H200 (fp16
grid, time against ``auto``): geometric mean 1.105 with neither, 1.078 with ONE_CHUNK (B = 1 long rows 1.107 ->
1.007), 1.057 with both (B = 64, 32:8, L = 512: 1.41 -> 1.26; 1.062 in the run of the schedule rule of
:func:`fdlib.plan.invariant_decision`; 1.048 and 1.050 in two runs with that rule's two refinements,
FEW_STAGES for short rows of large batches and ONE_CHUNK_KEYS; 1.040 once the loop of a plan that stores
partials stopped folding them too and the merge read them all at once, 1.039 with the persistent walk for every
short-row plan, and 1.037 and 1.0375 in two runs once the walk was narrowed to the shapes where it won:
``results/README.md``, runs 12-15). Not kept: a branch taken only at chunk ends
(1.080; with ALONE 1.057), chunks of at least 4 tiles (1.060: slower at B = 1), one chunk a program for chunks of
>= 2048 keys also where a row has one program (1.064), a reciprocal per row for the partials (1.058), 64-key
tiles (1.255) and every plan at 2 stages (1.281), and one tile loop per chunk nested in a loop over the chunks
(37-110x slower where a program had several chunks) (``results/h200/invariant-fp16*.md``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher
from .tile import (TABLE_AHEAD_PAGE, attend_tile, attend_tile_ahead, batch_tiles, causal_limit, empty_state,
                   finish_state, first_rows, fold_partial, fold_result, fold_where, group_queries, k_scaled, kv_base, kv_start,
                   load_lengths, longest_first, restart_where, row_offset, scale_row, store_out, store_partial,
                   take_ticket, tile_update, timeline_record, timeline_start)

CHUNKS = 16
"""Most chunks a row is cut into."""
MIN_TILES = 1
"""Fewest tiles in a chunk (a chunk shorter than the row's tiles / CHUNKS is never made)."""


def row_chunks(L: int, block_n: int, chunks: int = CHUNKS) -> tuple[int, int]:
    """(keys per chunk, number of chunks) of a row of L keys in tiles of ``block_n`` keys, at most ``chunks``
    chunks (the kernel's :func:`chunk_of`, on the host)."""
    tiles = -(-max(L, 0) // block_n)
    chunk = max(MIN_TILES, -(-tiles // chunks)) * block_n
    return chunk, max(-(-max(L, 0) // chunk), 1)


def max_chunks(L_max: int, block_n: int) -> int:
    """The most chunks any row of at most L_max keys has, min(CHUNKS, ⌈tiles(L_max) / MIN_TILES⌉): the partial
    slots a row needs (a shorter row may have more chunks than a longer one, e.g. 16 tiles make 16 chunks and
    17 tiles 9, so this is not simply L_max's count)."""
    return max(1, min(CHUNKS, -(-(-(-max(L_max, 0) // block_n)) // MIN_TILES)))


def device_share(lengths, H_kv: int, block_n: int, sms: int, chunks: int = CHUNKS) -> list[tuple[int, int]]:
    r"""(chunks a program k_b, programs n_b) of each row under the device share (the SHARE kernel's
    :func:`row_share`, on the host; the one model of the rule, which the tests hold the kernel to).

    From the B lengths alone, as the kernel reads them: row b has :math:`t_b = \max(1, \lceil L_b/N \rceil)`
    tiles of N = ``block_n`` keys, c_b chunks of :math:`\tau_b` tiles (:func:`row_chunks`), and the batch
    :math:`T = H_{kv} \sum_b t_b` tiles. Each program's share is :math:`S = \lceil T / \text{SMs} \rceil` tiles
    (one wave of equal shares), rounded up to whole chunks of its row:

    .. math::  k_b = \min\bigl(c_b,\ \max(1, \lceil S / \tau_b \rceil)\bigr), \qquad n_b = \lceil c_b / k_b \rceil,

    so a row shorter than a share is one program (its whole row), and a long row is cut into programs of about
    S tiles. Each program but a row's last holds :math:`k_b \tau_b \ge S` tiles, so
    :math:`n_b \le \lceil t_b / S \rceil` and a KV head has at most
    :math:`\sum_b n_b < \text{SMs}/H_{kv} + B` programs (:func:`share_programs`, the launch's bound).

    On equal rows it is the host rule of :func:`fdlib.plan.invariant_decision` at one wave, or within a chunk
    of it. With 128-key tiles (the compiled kernel's; the interpreter's are 16) on 132 SMs:

    ==========================================  =====  ==========================  ===========================
    batch (H_q:H_kv, lengths)                   S      k_b (chunks a program)      n_b (programs a row)
    ==========================================  =====  ==========================  ===========================
    B=16 32:8, L=8192 each (128 rows)           63     16: the whole row           1 (host rule: 1)
    B=4 32:8, L=8192 each                       16     4                           4 (host rule: 4)
    B=4 32:8, L=32768 each                      63     4                           4 (host rule: 16 of one)
    B=1 32:8, L=131072                          63     1                           16 (host rule: 16)
    B=8 32:8, one row of 131072, seven of 2048  69     2; the short rows 16        8; 1 (host rule: 16; 16)
    B=24 28:4, L_b = 65536·(b+1)/24             195    7 at 65536, whole rows      3 at 57344..65536, 2 at
                                                       at <= 24576                 27306..54613, else 1 (host
                                                                                   rule: 1 for every row)
    ==========================================  =====  ==========================  ===========================

    (B=8: T = 8·(1024 + 7·16) = 9088. B=24: T = 4·Σ t_b = 25632; its longest row's chunks are 32 tiles, so
    ⌈195/32⌉ = 7 a program; the host rule, one program a row, left that row alone at the end. B=4 L=32768 is the
    one equal shape the share runs otherwise than the host, which computes chunks of ONE_CHUNK_KEYS keys one a
    program; the share keeps its bound on the programs instead.)"""
    tiles = [max(1, -(-max(int(L), 0) // block_n)) for L in lengths]
    share = -(-H_kv * sum(tiles) // max(int(sms), 1))
    out = []
    for L in lengths:
        chunk, n = row_chunks(int(L), block_n, chunks)
        k = min(n, max(1, -(-share // (chunk // block_n))))
        out.append((k, -(-n // k)))
    return out


def share_programs(B: int, H_kv: int, sms: int, max_row_chunks: int) -> int:
    r"""Programs a KV head launches under the device share (the grid's second axis): the bound
    :math:`\min(B\,c_{max},\ \lceil \text{SMs}/H_{kv} \rceil + B - 1)` on :math:`\sum_b n_b` of
    :func:`device_share` (strictly less than SMs/H_kv + B), of the shapes alone, so that a graph captured before
    the lengths are known launches the same grid. Programs past the batch's last row exit at once."""
    return max(0, min(B * max_row_chunks, -(-int(sms) // H_kv) + B - 1))


@triton.jit
def row_share(LENS, n_batch, i, H_KV, sms, L_MAX, FLAG, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
              CHUNKS: tl.constexpr, MIN_TILES: tl.constexpr):
    """Program i of a KV head under the device share (:func:`device_share`, from the B lengths read now): its
    row b (n_batch where i is past the last row's programs), its place p among the row's programs, the row's
    length L, k_b chunks a program and n_b programs (0 past the last row). The rows' programs are numbered in b
    order: row b has programs E_{b-1} .. E_b - 1, E the running sum of the n_b."""
    offs_b, lens, tiles = batch_tiles(LENS, n_batch, L_MAX, FLAG, BLOCK_B, BLOCK_N)
    share = tl.cdiv(H_KV * tl.sum(tiles, 0), sms)
    chunk, n_chunks = chunk_of(lens, BLOCK_N, CHUNKS, MIN_TILES)
    k = tl.minimum(tl.maximum(tl.cdiv(share, chunk // BLOCK_N), 1), n_chunks)
    n = tl.where(offs_b < n_batch, tl.cdiv(n_chunks, k), 0)
    ends = tl.cumsum(n, 0)
    b = tl.minimum(tl.sum((ends <= i).to(tl.int32), 0), n_batch)   # the entries past the batch end at E_B too
    mine = offs_b == b
    p = i - tl.sum(tl.where(mine, ends - n, 0), 0)
    return (b, p, tl.sum(tl.where(mine, lens, 0), 0), tl.sum(tl.where(mine, k, 0), 0),
            tl.sum(tl.where(mine, n, 0), 0))


@triton.jit
def chunk_of(L, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, MIN_TILES: tl.constexpr):
    """(keys per chunk, number of chunks) of a row of L keys: see the module doc."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(L, BLOCK_N), CHUNKS), MIN_TILES) * BLOCK_N
    return chunk, tl.maximum(tl.cdiv(L, chunk), 1)


@triton.jit
def load_partial(O_ROW, LSE_ROW, o_rows, l_rows, c, n_chunks, rows, mask_gd, offs_d, stride_ps,
                 GROUP: tl.constexpr, Q_LEN: tl.constexpr):
    """Chunk c's partial (O_c, lse_c) of the rows, written by another program of this launch (read from L2);
    (0, −∞) for c >= n_chunks. A scalar condition enters a mask through tl.where, never ``&`` (an int32 mask in
    Triton's interpreter, which newer releases' tl.load/tl.store refuse)."""
    have = c < n_chunks
    o = tl.load(O_ROW + o_rows[:, None] + c * stride_ps + offs_d[None, :], mask=tl.where(have, mask_gd, False),
                other=0.0, cache_modifier=".cg")
    lse = tl.load(LSE_ROW + l_rows + c, mask=tl.where(have, rows < GROUP * Q_LEN, False), other=float("-inf"),
                  cache_modifier=".cg")
    return o, lse


@triton.jit
def finish_alone(f_m, f_den, f_acc, o, lse, rows, mask_gd, h0, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW, stride_st,
                 stride_sh, GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program that has its whole row: its last chunk's partial folded into the merge (of its earlier chunks in
    an ALONE plan; empty for a row of one chunk), and the row's out and lse stored."""
    f_m, f_den, f_acc = fold_partial(f_m, f_den, f_acc, o, lse)
    o, lse = fold_result(f_m, f_den, f_acc)
    store_out(o, lse, rows, mask_gd, h0, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW, stride_st, stride_sh, True,
              GROUP, Q_LEN, BLOCK_D)


@triton.jit
def fold_chunks(O_ROW, LSE_ROW, h0, n_chunks, offs_d, mask_d, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                GROUP: tl.constexpr, Q_LEN: tl.constexpr, FOLD_G: tl.constexpr, BLOCK_D: tl.constexpr,
                FOLD_C: tl.constexpr):
    """(O, lse) of a row from its n_chunks stored partials, folded in chunk order (:func:`fold_partial`,
    c = 0, 1, …, n_chunks − 1: the same operations as a program that folds its chunks as they end).

    The loop is unrolled over FOLD_C slots, the most chunks a row of the plan can have (rounded up to a power of
    two, so that few variants are compiled), so that every partial's load can be in flight before the first
    fold; a slot past the row's last chunk is kept out by a select (a fold of (0, −∞) changes nothing, except
    that it could turn an Õ of −0 into +0). It folds FOLD_G rows, the group's query rows padded to a power of
    two, not the BLOCK_G >= 16 of tl.dot, which would fold padding rows too. Also returns the rows and their
    mask, for the store."""
    rows = tl.arange(0, FOLD_G)
    mask_gd = (rows < GROUP * Q_LEN)[:, None] & mask_d[None, :]
    o_rows = row_offset(rows, h0, stride_pt, stride_ph, GROUP, Q_LEN)
    l_rows = row_offset(rows, h0, stride_lt, stride_lh, GROUP, Q_LEN)
    f_m, f_den, f_acc = empty_state(FOLD_G, BLOCK_D)
    for c in tl.static_range(FOLD_C):
        o, lse = load_partial(O_ROW, LSE_ROW, o_rows, l_rows, c, n_chunks, rows, mask_gd, offs_d, stride_ps,
                              GROUP, Q_LEN)
        f_m, f_den, f_acc = fold_where(c < n_chunks, f_m, f_den, f_acc, o, lse)
    o, lse = fold_result(f_m, f_den, f_acc)
    return o, lse, rows, mask_gd


@triton.jit
def invariant_kernel(Q, K, V, LENS, O_PART, LSE_PART, COUNTERS, OUT, LSE, FLAG, BT, TIMES, KS, VS,
                     stride_qb, stride_qt, stride_qh,
                     stride_kb, stride_kl, stride_kh,
                     stride_vb, stride_vl, stride_vh,
                     stride_pb, stride_pt, stride_ph, stride_ps,
                     stride_lb, stride_lt, stride_lh,
                     stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh,
                     qk_scale, per_program, H_KV, L_MAX, stride_bt, n_pages,
                     stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul, n_batch, sms,
                     GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
                     TILE_UPDATE: tl.constexpr, TAKE_TICKET: tl.constexpr, PAGE: tl.constexpr,
                     Q_LEN: tl.constexpr = 1, TIMELINE: tl.constexpr = False,
                     CHUNKS: tl.constexpr = 16, MIN_TILES: tl.constexpr = 1, ONE_CHUNK: tl.constexpr = False,
                     ALONE: tl.constexpr = False, FOLD_G: tl.constexpr = 16, FOLD_C: tl.constexpr = 16,
                     K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0, ORDER_B: tl.constexpr = 0,
                     SHARE: tl.constexpr = False, BLOCK_B: tl.constexpr = 16):
    if TIMELINE:
        t_start = timeline_start()
    if SHARE:         # grid (H_kv, programs a head): the device share (row_share) gives program i its row and place
        h_kv = tl.program_id(0)
        b, p, L, per_program, n_programs = row_share(LENS, n_batch, tl.program_id(1), H_KV, sms, L_MAX, FLAG,
                                                     BLOCK_B, BLOCK_N, CHUNKS, MIN_TILES)
        chunk, n_chunks = chunk_of(L, BLOCK_N, CHUNKS, MIN_TILES)
    else:
        if ORDER_B > 0:   # grid (H_kv, B, programs a row): place i runs the i-th longest row, its KV heads together
            h_kv = tl.program_id(0)
            b = longest_first(LENS, COUNTERS - ORDER_B, tl.program_id(1), tl.num_programs(1), L_MAX, ORDER_B)
        else:             # grid (B, H_kv, programs a row)
            b = tl.program_id(0)
            h_kv = tl.program_id(1)
        p = tl.program_id(2)
        L = load_lengths(LENS, b, b >= 0, L_MAX, FLAG)
        chunk, n_chunks = chunk_of(L, BLOCK_N, CHUNKS, MIN_TILES)
        n_programs = tl.cdiv(n_chunks, per_program)
    if p < n_programs:
        c0 = p * per_program
        c_last = tl.minimum(c0 + per_program, n_chunks) - 1
        start = c0 * chunk
        end = tl.minimum((c_last + 1) * chunk, L)
        h0 = h_kv * GROUP
        q, rows, offs_d, mask_d, mask_gd = group_queries(Q, b, h_kv, stride_qb, stride_qt, stride_qh, GROUP, Q_LEN,
                                                         D, BLOCK_G, BLOCK_D)
        if Q_LEN == 1:
            limit = end
        else:
            limit = causal_limit(rows, L, GROUP, Q_LEN)
        O_ROW = O_PART + b * stride_pb
        LSE_ROW = LSE_PART + b * stride_lb
        BT_ROW = BT + b.to(tl.int64) * stride_bt
        offs_n = tl.arange(0, BLOCK_N)
        k_ptrs, v_ptrs = kv_base(K, V, b, h_kv, stride_kb, stride_kh, stride_vb, stride_vh, offs_d, PAGE)
        k_ptrs, v_ptrs = kv_start(k_ptrs, v_ptrs, start, offs_n, stride_kl, stride_vl, PAGE)
        # an 8-bit cache's scales at this row (tile.scale_row): a row's own, so the results stay batch-invariant
        SC = scale_row((KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul), b,
                       h_kv, PAGE, K_SCALE, V_SCALE)
        qk = k_scaled(qk_scale, SC, K_SCALE)
        m, l, acc = empty_state(BLOCK_G, BLOCK_D)
        f_m, f_den, f_acc = empty_state(BLOCK_G, BLOCK_D)         # the fold (m, den, acc) starts empty alike
        if PAGE >= TABLE_AHEAD_PAGE:   # each tile's table rows read one tile ahead (tile.attend_tile_ahead)
            rows_n = first_rows(BT_ROW, start, offs_n, end, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl,
                                PAGE, SC, K_SCALE, V_SCALE)
        for n0 in range(start, end, BLOCK_N):
            if PAGE >= TABLE_AHEAD_PAGE:
                m, l, acc, rows_n = attend_tile_ahead(q, k_ptrs, v_ptrs, rows_n, n0, offs_n, end, limit, mask_d, m, l,
                                                      acc, qk, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb,
                                                      n_pages, FLAG, BLOCK_N, FP32_DOT, TILE_UPDATE, PAGE, Q_LEN, SC,
                                                      K_SCALE, V_SCALE)
            else:
                m, l, acc, k_ptrs, v_ptrs = attend_tile(q, k_ptrs, v_ptrs, n0, offs_n, end, limit, mask_d, m, l, acc,
                                                        qk, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb,
                                                        n_pages, FLAG, BLOCK_N, FP32_DOT, TILE_UPDATE, PAGE, Q_LEN,
                                                        SC, K_SCALE, V_SCALE)
            # a chunk that ends here, before the program's last: its partial is folded into the row's merge (an
            # ALONE plan) or stored for the merging program; the next chunk starts afresh
            # (predicated, not branched, so that the loop stays one software-pipelined loop). A plan whose
            # programs compute one chunk each (ONE_CHUNK) never ends a chunk inside the loop: it has none of it.
            if not ONE_CHUNK:
                emit = ((n0 + BLOCK_N) % chunk == 0) & (n0 + BLOCK_N < end)
                o_c, lse_c = finish_state(m, l, acc, SC, V_SCALE)
                if ALONE:    # every program is alone on its row: folded here, nothing stored
                    f_m, f_den, f_acc = fold_where(emit, f_m, f_den, f_acc, o_c, lse_c)
                else:        # stored for the merging program (also by a program alone on its row: see below)
                    store_partial(o_c, lse_c, rows, mask_gd, h0, n0 // chunk, O_ROW, stride_pt, stride_ph,
                                  stride_ps, LSE_ROW, stride_lt, stride_lh, emit, GROUP, Q_LEN, BLOCK_D)
                m, l, acc = restart_where(emit, m, l, acc)
        o, lse = finish_state(m, l, acc, SC, V_SCALE)            # the program's last chunk
        OUT_ROW = OUT + b * stride_ob
        LSE_OUT_ROW = LSE + b * stride_sb
        # ALONE (decided at compile time): no ticket code at all. Otherwise a row of one chunk finishes here
        # (folding its one partial into the empty merge); a row of several chunks merges from the stored partials,
        # also where one program computed them all (always possible under SHARE), so that the loop above never folds
        if ALONE or n_chunks == 1:
            finish_alone(f_m, f_den, f_acc, o, lse, rows, mask_gd, h0, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW,
                         stride_st, stride_sh, GROUP, Q_LEN, BLOCK_D)
        else:
            store_partial(o, lse, rows, mask_gd, h0, c_last, O_ROW, stride_pt, stride_ph, stride_ps, LSE_ROW,
                          stride_lt, stride_lh, True, GROUP, Q_LEN, BLOCK_D)
            if TAKE_TICKET(COUNTERS + b * H_KV + h_kv, n_programs):   # the last one folds the chunks in order
                o_f, lse_f, f_rows, f_mask = fold_chunks(O_ROW, LSE_ROW, h0, n_chunks, offs_d, mask_d, stride_pt,
                                                         stride_ph, stride_ps, stride_lt, stride_lh, GROUP, Q_LEN,
                                                         FOLD_G, BLOCK_D, FOLD_C)
                store_out(o_f, lse_f, f_rows, f_mask, h0, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW, stride_st,
                          stride_sh, True, GROUP, Q_LEN, BLOCK_D)
    if TIMELINE:
        timeline_record(TIMES, t_start)


def invariant_launcher(dtype, group: int, D: int, cfg, dtype_slots=None, page: int = 0, q_len: int = 1,
                       timeline: bool = False, one_chunk: bool = False, alone: bool = False,
                       max_row_chunks: int = CHUNKS, scale_modes: tuple = (0, 0), order: int = 0,
                       share_batch: int = 0) -> Launcher:
    """The batch-invariant kernel with its constexprs fixed for q's dtype, the group, D, the tiles (the plan's
    fixed ones), the page size and q_len. It takes :func:`~fdlib.kernels.unified.unified_args` with ``chunk`` =
    chunks per program. ``one_chunk``: every program computes one chunk (ONE_CHUNK); ``alone``: every program
    computes all its row's chunks (ALONE: no partial is stored, no ticket taken); ``max_row_chunks``: the most
    chunks a row of the plan can have (:func:`max_chunks` of its L_max), which the merge unrolls; ``scale_modes``:
    (K_SCALE, V_SCALE) of an 8-bit cache, (0, 0) for a 16-bit one; ``order``: ORDER_B, the rows launched longest
    first (grid (H_kv, B, programs a row), the order right before the ticket counters), 0 for b order (grid
    (B, H_kv, programs a row)); ``share_batch``: the planned B of a plan whose programs a row are chosen on the
    device (SHARE, grid (H_kv, :func:`share_programs`); the kernel holds the B lengths in BLOCK_B registers), 0
    for a fixed ``per_program``. Its scalars end with the call's B and the SMs the share is cut for."""
    BLOCK_G, BLOCK_D = block_sizes(group * q_len, D)
    return Launcher(invariant_kernel, dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D,
                                           FP32_DOT=fp32_dot(dtype), TILE_UPDATE=tile_update, TAKE_TICKET=take_ticket,
                                           PAGE=page, Q_LEN=q_len, TIMELINE=timeline, CHUNKS=CHUNKS,
                                           MIN_TILES=MIN_TILES, ONE_CHUNK=one_chunk, ALONE=alone,
                                           FOLD_G=triton.next_power_of_2(group * q_len),
                                           FOLD_C=triton.next_power_of_2(max_row_chunks),
                                           K_SCALE=scale_modes[0], V_SCALE=scale_modes[1], ORDER_B=order,
                                           SHARE=share_batch > 0,
                                           BLOCK_B=max(16, triton.next_power_of_2(max(share_batch, 1))),
                                           num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                    dtype_slots)
