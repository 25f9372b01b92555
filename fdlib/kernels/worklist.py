r"""The device schedule: a small kernel that reads the lengths and writes the launch's work list.

:mod:`fdlib.worklist` gives the arithmetic: row b is cut into :math:`n(L_b) \le S` pieces of
:math:`c(L_b) = \max(\text{chunk}, N\lceil\lceil L_b/N\rceil/S\rceil)` keys, and the pieces are listed rows
longest first (L descending, the lower b first among equal lengths), a row's pieces consecutive. Row b's first
item is the number of pieces of the rows before it in that order,

.. math::  \text{first}_b = \sum_{b'} n_{b'}\,[L_{b'} > L_b \ \lor\ (L_{b'} = L_b \land b' < b)],

so each program of :func:`schedule_kernel` takes BLOCK_R rows, sums over the batch BLOCK_C rows at a time
(:math:`O(B^2)` comparisons in all, a few microseconds at B = 4096), and stores its rows' items, one int32
:math:`b S + j` each, at ``ITEMS[1 + first_b + j]``; program 0 stores the count :math:`\sum_b n_b` at
``ITEMS[0]``. The list's room, :math:`1 + B S`, is fixed at plan time (:func:`fdlib.worklist.capacity`).

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
def pieces_of(L, chunk, S, BLOCK_N: tl.constexpr):
    """(c(L), n(L)) of :mod:`fdlib.worklist`: the keys of each piece of a row of L keys, and its pieces."""
    c = tl.maximum(chunk, BLOCK_N * tl.cdiv(tl.cdiv(L, BLOCK_N), S))
    return c, tl.maximum(tl.cdiv(L, c), 1)


@triton.jit
def list_place(L, rows, Lc, cols, nc):
    """For each row (lengths ``L``, indices ``rows``), the pieces ``nc`` of the rows ``cols`` (lengths ``Lc``)
    listed before it: longer, or as long with a lower index."""
    before = (Lc[None, :] > L[:, None]) | ((Lc[None, :] == L[:, None]) & (cols[None, :] < rows[:, None]))
    return tl.sum(tl.where(before, nc[None, :], 0), 1)


@triton.jit
def work_item(ITEMS, LENS, i, n_batch, chunk, S, L_MAX, write, BLOCK_N: tl.constexpr, INLINE_B: tl.constexpr):
    """(b, j) of item i of the list, j = S past its end. INLINE_B = 0: read from ``ITEMS`` (the schedule kernel
    wrote it); else the batch's <= INLINE_B lengths are listed in this program's registers (the same list, with
    no launch before), and where ``write`` holds the program stores its own entry, so the list is in ``ITEMS``
    alike."""
    if INLINE_B > 0:
        rows = tl.arange(0, INLINE_B)
        real = rows < n_batch
        L = tl.minimum(tl.maximum(tl.load(LENS + rows, mask=real, other=0), 0), L_MAX).to(tl.int32)
        _, n = pieces_of(L, chunk, S, BLOCK_N)
        n = tl.where(real, n, 0)
        first = list_place(L, rows, L, rows, n)
        mine = real & (first <= i) & (i < first + n)
        there = tl.sum(mine.to(tl.int32), 0) > 0
        b = tl.sum(tl.where(mine, rows, 0), 0)
        j = tl.where(there, i - tl.sum(tl.where(mine, first, 0), 0), S)
        tl.store(ITEMS + 1 + i, b * S + j, mask=write & there)
        tl.store(ITEMS, tl.sum(n, 0), mask=write & (i == 0))
    else:
        there = i < tl.load(ITEMS)
        item = tl.load(ITEMS + 1 + i, mask=there, other=0)
        b = item // S
        j = tl.where(there, item % S, S)
    return b, j


@triton.jit
def schedule_kernel(LENS, ITEMS, FLAG, n_batch, chunk, L_MAX, S: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    real = rows < n_batch
    L = load_lengths(LENS, rows, real, L_MAX, FLAG)          # clamped to 0..L_max, the flag set where it was
    _, n = pieces_of(L, chunk, S, BLOCK_N)
    n = tl.where(real, n, 0)
    first = tl.zeros([BLOCK_R], dtype=tl.int32)
    total = 0
    for c0 in range(0, n_batch, BLOCK_C):                     # every row of the batch, BLOCK_C at a time
        cols = c0 + tl.arange(0, BLOCK_C)
        there = cols < n_batch
        Lc = tl.minimum(tl.maximum(tl.load(LENS + cols, mask=there, other=0), 0), L_MAX).to(tl.int32)
        c_cols, nc = pieces_of(Lc, chunk, S, BLOCK_N)
        nc = tl.where(there, nc, 0)
        first += list_place(L, rows, Lc, cols, nc)
        total += tl.sum(nc, 0)
    if tl.program_id(0) == 0:
        tl.store(ITEMS, total)
    j = tl.arange(0, BLOCK_S)
    mine = real[:, None] & (j[None, :] < n[:, None])
    tl.store(ITEMS + 1 + first[:, None] + j[None, :], rows[:, None] * S + j[None, :], mask=mine)


INLINE_BATCH = 16
"""Batches of at most this many sequences are listed inside the attention kernel (``work_item``'s INLINE_B), with
no schedule launch before it: a launch costs a few microseconds, a large part of a small batch's step."""
SCHEDULE_ROWS = 16
"""Rows a program of the schedule kernel lists (BLOCK_R)."""
SCHEDULE_COLS = 256
"""Rows it compares them with at a time (BLOCK_C)."""


def schedule_launcher(S: int, block_n: int, dtype_slots=(0,)) -> Launcher:
    """The schedule kernel with its constexprs fixed for S pieces a row at most and tiles of ``block_n`` keys."""
    return Launcher(schedule_kernel, dict(S=S, BLOCK_N=block_n, BLOCK_R=SCHEDULE_ROWS, BLOCK_C=SCHEDULE_COLS,
                                          BLOCK_S=triton.next_power_of_2(S), num_warps=4, num_stages=1),
                    dtype_slots)


def schedule_args(lens, items, flag, chunk: int, L_max: int):
    """(grid, pointers, scalars) of one launch over the B = ``lens.shape[0]`` rows of a call."""
    B = lens.shape[0]
    return (triton.cdiv(B, SCHEDULE_ROWS),), (lens, items, flag), (B, chunk, L_max)
