r"""The work list: a launch's schedule, made on the device from the lengths, the same for every batch shape.

A plan made without the lengths (a CUDA graph captured before they are known, or the lengths on the GPU only)
knows the shapes, never the mix. It fixes two numbers, ``chunk`` (the fewest keys a piece of a row holds) and
S (the most pieces a row is cut into), and every call cuts each row by its own length L alone:

.. math::
    c(L) = \max\Bigl(\text{chunk},\ N \Bigl\lceil \frac{\lceil L/N \rceil}{S} \Bigr\rceil\Bigr), \qquad
    n(L) = \max\bigl(1, \lceil L / c(L) \rceil\bigr) \le S

for tiles of N keys: piece j of row b covers keys :math:`[j\,c,\ \min((j+1)\,c,\ L_b))`, the last one running to
:math:`L_b`. A short row is one piece; a long one at most S pieces of :math:`c(L) \approx L/S` keys. An empty
row is still one piece: its program writes O = 0, lse = −∞.

The pieces become one list, **longest rows first**: rows ordered by L descending (ties: lower b first), each
row's pieces consecutive, j = 0, 1, …. Program i of the launch computes item i (one per KV head), so the GPU
starts the largest pieces first and fills the end of the launch with the small ones; programs past the end of
the list exit at once. The list is written by a small kernel (:mod:`fdlib.kernels.worklist`) into the plan's
workspace at every call, so the host never reads a length and a captured graph replayed with new lengths
schedules them anew. At most :math:`B \cdot S` items (:func:`capacity`; sized by the batch, below, at most budget + B):
the grid and the workspace are fixed at plan time.

**Batch-invariant by construction**: a row's pieces depend on (L, chunk, S, N) only, and its pieces' partials
are merged in piece order (:func:`fdlib.kernels.tile.combine_heads`) whoever merges; so with chunk, S and the
tiles fixed independently of the batch, a sequence's result is the same bits whatever its batchmates.

**Sized by the batch** (a plan's ``budget`` > 0, ``method="worklist"`` without ``batch_invariant``): the same list,
but the pieces' size follows the whole batch, as FlashMLA's scheduler cuts :math:`\sum_b` blocks evenly: a unit
:math:`c = N\max(\text{chunk}/N, \lceil \sum_b t_b / \text{budget}\rceil)` for the rows' tiles
:math:`t_b = \max(1, \lceil L_b/N \rceil)`, and row b cut into :math:`n_b = \min(S, \max(1,
\mathrm{round}(t_b N / c)))` equal pieces of whole tiles. The budget, about two programs an SM for the KV heads
(``fdlib.plan.WORK_WAVES``), is fixed by the shapes; the unit is computed on the device at every call. A row's
cut then depends on its batchmates' lengths, so this schedule is not batch-invariant.

This module is the same arithmetic in Python: the model the kernel is tested against, and the one the lab's
exercise is graded with.
"""
from __future__ import annotations

from typing import NamedTuple


class Item(NamedTuple):
    b: int          # the sequence
    j: int          # the piece of its row, 0 … n(L_b) − 1
    start: int      # its first key
    end: int        # one past its last key


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def piece(b: int, j: int, L: int, c: int, n: int) -> Item:
    """Piece j of row b's n pieces of c keys (L keys in all): keys [j·c, min((j+1)·c, L)), the last one running to L
    (the kernels' ``split_range``)."""
    return Item(b, j, j * c, L if j == n - 1 else min((j + 1) * c, L))


def piece_keys(L: int, chunk: int, S: int, N: int) -> int:
    """c(L): the keys of each piece of a row of L keys (its last piece may hold fewer)."""
    return max(chunk, N * cdiv(cdiv(max(L, 0), N), S))


def pieces(L: int, chunk: int, S: int, N: int) -> int:
    """n(L): the pieces a row of L keys is cut into, 1 … S."""
    return max(1, cdiv(max(L, 0), piece_keys(L, chunk, S, N)))


def balanced_chunk(lengths, chunk: int, budget: int, N: int) -> int:
    r"""The unit c (keys) a batch's pieces are sized by when the plan gives a ``budget`` of items (sized by
    the batch, the module doc): :math:`c = N\max(\text{chunk}/N,\ \lceil \sum_b \max(1, \lceil L_b/N\rceil) /
    \text{budget} \rceil)`, so the batch's tiles come to about ``budget`` pieces however they are spread."""
    tiles = sum(max(1, cdiv(max(int(L), 0), N)) for L in lengths)
    return N * max(chunk // N, cdiv(tiles, budget))


def balanced_pieces(L: int, c: int, S: int, N: int) -> tuple[int, int]:
    r"""(keys a piece, pieces) of a row of L keys under the unit c: :math:`n = \min(S, \max(1,
    \mathrm{round}(t/(c/N))))` for its t tiles, pieces of :math:`N\lceil t/n\rceil` keys (a row within half a
    unit of a multiple of c is cut into equal whole-tile pieces, never into a full one and a sliver)."""
    t, ct = max(1, cdiv(max(L, 0), N)), c // N
    n = min(S, max(1, (2 * t + ct) // (2 * ct)))
    keys = N * cdiv(t, n)
    return keys, max(1, cdiv(max(L, 0), keys))


def order(lengths) -> list[int]:
    """The rows longest first: L descending, the lower b first among equal lengths."""
    lengths = [int(L) for L in lengths]
    return sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))


def work_list(lengths, chunk: int, S: int, N: int, budget: int = 0) -> list[Item]:
    """The launch's items in program order (see the module doc); ``budget`` > 0: pieces sized by the batch
    (:func:`balanced_chunk`, :func:`balanced_pieces`) instead of by each row alone."""
    lengths = [int(L) for L in lengths]
    unit = balanced_chunk(lengths, chunk, budget, N) if budget else chunk
    out = []
    for b in order(lengths):
        L = lengths[b]
        c, n = (balanced_pieces(L, unit, S, N) if budget else (piece_keys(L, chunk, S, N), pieces(L, chunk, S, N)))
        for j in range(n):
            out.append(piece(b, j, L, c, n))
    return out


def encode(items, S: int) -> list[int]:
    """The list as the kernel stores it: its length, then one int32 b·S + j an item."""
    return [len(items)] + [it.b * S + it.j for it in items]


def capacity(B: int, S: int, budget: int = 0) -> int:
    r"""The most items a batch of B rows can have: the list's room (the launch's grid along the items). B·S cut by
    each row; sized by the batch at most budget + B: :math:`n_b \le t_b/c_t + 1` for the unit's
    :math:`c_t \ge \sum_b t_b / \text{budget}` tiles, so :math:`\sum_b n_b \le \text{budget} + B`."""
    return min(B * S, budget + B) if budget else B * S
