r"""The device schedule: a small kernel that reads the lengths and writes the launch's work list.

:mod:`fdlib.worklist` gives the arithmetic: row b is cut into :math:`n(L_b) \le S` pieces of
:math:`c(L_b) = \max(\text{chunk}, N\lceil\lceil L_b/N\rceil/S\rceil)` keys, and the pieces are listed rows
longest first (L descending, the lower b first among equal lengths), a row's pieces consecutive. Row b's first
item is the number of pieces of the rows before it in that order,

.. math::  \text{first}_b = \sum_{b'} n_{b'}\,[L_{b'} > L_b \ \lor\ (L_{b'} = L_b \land b' < b)],

so each program of :func:`schedule_kernel` takes BLOCK_R rows, sums over the batch BLOCK_C rows at a time
(:math:`O(B^2)` comparisons in all, a few microseconds at B = 4096), and stores its rows' items, one int32
:math:`b S + j` each, at ``ITEMS[2 + first_b + j]``; program 0 stores the count :math:`\sum_b n_b` at ``ITEMS[0]`` and the unit the
rows were cut by at ``ITEMS[1]`` (the plan's chunk, or, sized by the batch, :func:`batch_unit` of the batch's
tiles, summed in a first pass). The list's room, :math:`2 + B S`, is fixed at plan time
(:func:`fdlib.worklist.capacity`).

The attention itself is the unified kernel (:mod:`fdlib.kernels.unified`) compiled with ``WORK`` = the room:
its program (h_kv, i), in launch order, reads item i (:func:`work_item`), computes that piece, and the last piece
of a row to take the row's ticket merges the row's partials in piece order. A batch of at most INLINE_BATCH
sequences needs no schedule launch: each program lists the few lengths in its registers. Both launches read the lengths on the device, so a
captured CUDA graph schedules every replay from the lengths it finds.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch import Launcher
from .tile import load_lengths


@triton.jit
def peek_lengths(LENS, idx, mask, L_MAX):
    """The lengths ``idx`` clamped to 0..L_max as :func:`~fdlib.kernels.tile.load_lengths` clamps them, without
    touching the flag: read to list other rows, whose own loads set it."""
    return tl.minimum(tl.maximum(tl.load(LENS + idx, mask=mask, other=0), 0), L_MAX).to(tl.int32)


@triton.jit
def pieces_of(L, chunk, S, BLOCK_N: tl.constexpr):
    """(c(L), n(L)) of :mod:`fdlib.worklist`: the keys of each piece of a row of L keys, and its pieces."""
    c = tl.maximum(chunk, BLOCK_N * tl.cdiv(tl.cdiv(L, BLOCK_N), S))
    return c, tl.maximum(tl.cdiv(L, c), 1)


@triton.jit
def piece_rule(L, unit, S, BLOCK_N: tl.constexpr, BALANCED: tl.constexpr):
    """(keys a piece, pieces) of a row of L keys: by the row alone (:func:`pieces_of`, ``unit`` = the plan's
    chunk), or BALANCED, by the batch's unit (:func:`fdlib.worklist.balanced_pieces`)."""
    if BALANCED:
        t = tl.maximum(tl.cdiv(L, BLOCK_N), 1)
        ct = unit // BLOCK_N
        n = tl.minimum(tl.maximum((2 * t + ct) // (2 * ct), 1), S)
        keys = BLOCK_N * tl.cdiv(t, n)
        n = tl.maximum(tl.cdiv(L, keys), 1)
    else:
        keys, n = pieces_of(L, unit, S, BLOCK_N)
    return keys, n


@triton.jit
def batch_unit(tiles_sum, chunk, budget, BLOCK_N: tl.constexpr):
    """The unit of a batch of ``tiles_sum`` tiles: N·max(chunk/N, ⌈tiles_sum / budget⌉) keys
    (:func:`fdlib.worklist.balanced_chunk`)."""
    return BLOCK_N * tl.maximum(chunk // BLOCK_N, tl.cdiv(tiles_sum, budget))


@triton.jit
def list_place(L, rows, Lc, cols, nc):
    """For each row (lengths ``L``, indices ``rows``), the pieces ``nc`` of the rows ``cols`` (lengths ``Lc``)
    listed before it: longer, or as long with a lower index."""
    before = (Lc[None, :] > L[:, None]) | ((Lc[None, :] == L[:, None]) & (cols[None, :] < rows[:, None]))
    return tl.sum(tl.where(before, nc[None, :], 0), 1)


@triton.jit
def work_item(ITEMS, LENS, i, n_batch, chunk, S, L_MAX, write, BLOCK_N: tl.constexpr, INLINE_B: tl.constexpr,
              BUDGET: tl.constexpr):
    """(b, j, unit) of item i of the list, j = S past its end; ``unit`` is what :func:`piece_rule` cuts rows by.
    The list is ``ITEMS`` = [count, unit, item 0, item 1, …]. INLINE_B = 0: read there (the schedule kernel wrote
    it); else the batch's <= INLINE_B lengths are listed in this program's registers (the same list, with no
    launch before), and where ``write`` holds the program stores its own entry, so the list is in ``ITEMS``
    alike. BUDGET > 0: pieces sized by the batch (``batch_unit``), else by each row (unit = ``chunk``)."""
    if INLINE_B > 0:
        rows = tl.arange(0, INLINE_B)
        real = rows < n_batch
        L = peek_lengths(LENS, rows, real, L_MAX)
        if BUDGET > 0:
            unit = batch_unit(tl.sum(tl.where(real, tl.maximum(tl.cdiv(L, BLOCK_N), 1), 0), 0), chunk, BUDGET,
                              BLOCK_N)
        else:
            unit = chunk
        keys, n = piece_rule(L, unit, S, BLOCK_N, BUDGET > 0)
        n = tl.where(real, n, 0)
        first = list_place(L, rows, L, rows, n)
        mine = real & (first <= i) & (i < first + n)
        there = tl.sum(mine.to(tl.int32), 0) > 0
        b = tl.sum(tl.where(mine, rows, 0), 0)
        j = tl.where(there, i - tl.sum(tl.where(mine, first, 0), 0), S)
        tl.store(ITEMS + 2 + i, b * S + j, mask=write & there)
        tl.store(ITEMS, tl.sum(n, 0), mask=write & (i == 0))
        tl.store(ITEMS + 1, unit, mask=write & (i == 0))
    else:
        there = i < tl.load(ITEMS)
        unit = tl.load(ITEMS + 1)
        item = tl.load(ITEMS + 2 + i, mask=there, other=0)
        b = item // S
        j = tl.where(there, item % S, S)
    return b, j, unit


@triton.jit
def schedule_kernel(LENS, ITEMS, FLAG, n_batch, chunk, L_MAX, budget, S: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BALANCED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    real = rows < n_batch
    L = load_lengths(LENS, rows, real, L_MAX, FLAG)          # clamped to 0..L_max, the flag set where it was
    if BALANCED:                                              # pass 1: the batch's tiles, its unit
        tiles_sum = 0
        for c0 in range(0, n_batch, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            Lc = peek_lengths(LENS, cols, cols < n_batch, L_MAX)
            tiles_sum += tl.sum(tl.where(cols < n_batch, tl.maximum(tl.cdiv(Lc, BLOCK_N), 1), 0), 0)
        unit = batch_unit(tiles_sum, chunk, budget, BLOCK_N)
    else:
        unit = chunk
    keys, n = piece_rule(L, unit, S, BLOCK_N, BALANCED)
    n = tl.where(real, n, 0)
    first = tl.zeros([BLOCK_R], dtype=tl.int32)
    total = 0
    for c0 in range(0, n_batch, BLOCK_C):                     # pass 2: every row of the batch, BLOCK_C at a time
        cols = c0 + tl.arange(0, BLOCK_C)
        there = cols < n_batch
        Lc = peek_lengths(LENS, cols, there, L_MAX)
        c_cols, nc = piece_rule(Lc, unit, S, BLOCK_N, BALANCED)
        nc = tl.where(there, nc, 0)
        first += list_place(L, rows, Lc, cols, nc)
        total += tl.sum(nc, 0)
    if tl.program_id(0) == 0:
        tl.store(ITEMS, total)
        tl.store(ITEMS + 1, unit)
    j = tl.arange(0, BLOCK_S)
    mine = real[:, None] & (j[None, :] < n[:, None])
    tl.store(ITEMS + 2 + first[:, None] + j[None, :], rows[:, None] * S + j[None, :], mask=mine)


INLINE_BATCH = 16
"""Batches of at most this many sequences are listed inside the attention kernel (``work_item``'s INLINE_B), with
no schedule launch before it: a launch costs a few microseconds, a large part of a small batch's step."""
SCHEDULE_ROWS = 16
"""Rows a program of the schedule kernel lists (BLOCK_R)."""
SCHEDULE_COLS = 256
"""Rows it compares them with at a time (BLOCK_C)."""


def schedule_launcher(S: int, block_n: int, balanced: bool = False, dtype_slots=(0,)) -> Launcher:
    """The schedule kernel with its constexprs fixed for S pieces a row at most, tiles of ``block_n`` keys, and
    pieces sized by the batch (``balanced``) or by each row."""
    return Launcher(schedule_kernel, dict(S=S, BLOCK_N=block_n, BLOCK_R=SCHEDULE_ROWS, BLOCK_C=SCHEDULE_COLS,
                                          BLOCK_S=triton.next_power_of_2(S), BALANCED=balanced, num_warps=4,
                                          num_stages=1), dtype_slots)


def schedule_args(lens, B: int, items, flag, chunk: int, L_max: int, budget: int = 0):
    """(grid, pointers, scalars) of one launch over the B rows of a call (q's, which may be fewer than ``lens``
    holds: a call without lengths reads the first B of the plan's all-L_max ones)."""
    return (triton.cdiv(B, SCHEDULE_ROWS),), (lens, items, flag), (B, chunk, L_max, max(budget, 1))
