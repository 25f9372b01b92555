r"""A balanced schedule for ragged batches: cut the batch into work items of near-equal cost.

Continuous batching mixes sequences of every length. Cutting every row into the same number of splits, sized
for the longest row, leaves the short rows' programs idle early and the long rows' programs running late.
Instead, give every item about the same number of key tiles (FlashInfer's chunking):

.. math::
    \text{tiles}_b = \max(1, \lceil L_b / \text{BLOCK\_N} \rceil),\qquad
    c = \Big\lceil \sum_b \text{tiles}_b / P \Big\rceil,\qquad n_b = \lceil \text{tiles}_b / c \rceil

for a budget of P items and BLOCK_N keys per tile: row b is cut into n_b items of c tiles (its last item shorter),
:math:`\sum_b n_b \le P + B`. An empty row still counts one tile: it still costs a program's start-up. Item
i of row b covers keys :math:`[i\,c\,\text{BLOCK\_N},\ \min((i+1)\,c\,\text{BLOCK\_N},\ L_b))`; the items of one row are numbered
contiguously, so row b owns items :math:`[E_b - n_b, E_b)` with :math:`E_b = n_0 + \dots + n_b`.

The balanced kernel (:mod:`fdlib.kernels.balanced`) computes exactly this on the device from the lengths,
inside every program, so a captured CUDA graph stays balanced when the lengths change. This module is the
same arithmetic in PyTorch, for the tests, the explorer and the lab.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Schedule(NamedTuple):
    chunk_tiles: int            # c: tiles per item
    splits: torch.Tensor        # n_b: items of each row
    first: torch.Tensor         # E_b - n_b: the first item of each row
    items: int                  # Σ n_b


def balanced(lengths, budget: int, block_n: int) -> Schedule:
    """The schedule of the module docstring for ``lengths`` (a tensor or list of ints), ``budget`` items P and
    ``block_n`` keys per tile."""
    L = torch.as_tensor(lengths, dtype=torch.int64)
    tiles = torch.clamp((L + block_n - 1) // block_n, min=1)
    total = int(tiles.sum())
    c = max(1, -(-total // max(1, budget)))
    n = (tiles + c - 1) // c
    ends = torch.cumsum(n, 0)
    return Schedule(c, n, ends - n, int(ends[-1]) if len(ends) else 0)


def items(lengths, budget: int, block_n: int) -> list[tuple[int, int, int]]:
    """The work items ``(b, start, end)`` in item order (an empty row gives one empty item)."""
    s = balanced(lengths, budget, block_n)
    chunk = s.chunk_tiles * block_n
    out = []
    for b, (L, n_b) in enumerate(zip(torch.as_tensor(lengths).tolist(), s.splits.tolist())):
        for j in range(n_b):
            start = j * chunk
            end = L if j == n_b - 1 else min(start + chunk, L)
            out.append((b, start, end))
    return out


# ------------------------------------------------------------------------------ the budget of method="balanced"
START_KEYS = 128
"""A program's start-up (launch, q and lengths loads, pipeline fill), in keys of D=128 streamed."""


def choose_balanced(B: int, H_q: int, H_kv: int, D: int, dtype, L_cap: int, lengths=None, paged: int = 0) -> int:
    """splits of ``method="balanced"`` (its budget is B·splits items per KV head): with host lengths on a GPU,
    the candidate of :func:`balanced_candidates` whose schedule :func:`balance_gain` predicts fastest, so that
    a batch with one long row is not cut into items of one or two tiles each paying a start-up; otherwise
    :func:`fdlib.splits.choose_splits`. (``auto`` never runs the balanced kernel: ``results/notes/chooser.md``.)"""
    from . import runtime, splits as chooser
    s = chooser.choose_splits(B, H_q, H_kv, D, dtype, L_cap, lengths, paged)
    if runtime.INTERPRET or lengths is None:
        return s
    return best_balanced(lengths, H_kv, D, dtype, L_cap, s, paged)[1]


def balanced_candidates(B: int, H_kv: int, splits: int) -> list[int]:
    """splits the balanced kernel is tried at (its budget is P = B·splits items per KV head): the split
    schedule's, and 1, 2 and 4 times what makes P·H_kv programs two per SM. More items even out the SMs' loads;
    each also pays a start-up, which :func:`balance_gain` counts."""
    from . import splits as chooser
    from .kernels.config import MAX_SPLITS, cdiv
    need = cdiv(2 * chooser.sm_count(), max(B * H_kv, 1))
    return sorted({splits, need, 2 * need, 4 * need} & set(range(1, MAX_SPLITS + 1)) or {1})


def makespan(pieces, sms: int) -> float:
    """Time to run ``pieces`` (costs, in launch order) on ``sms`` SMs when each SM takes the next piece as soon as
    it is free (the hardware's block scheduler, one program at a time per SM; co-resident programs share the
    SM's bandwidth, so this is the same finish time): list scheduling with a heap."""
    import heapq
    free = [0.0] * min(sms, len(pieces))
    for c in pieces:
        t = heapq.heappop(free)
        heapq.heappush(free, t + c)
    return max(free, default=0.0)


def balance_gain(lengths, H_kv: int, D: int, dtype, L_cap: int, splits: int, bal_splits: int,
                 paged: int = 0) -> float:
    """Predicted time(balanced) / time(split schedule) for host ``lengths``: every row cut into pieces of the
    split schedule's chunk (sized for the longest row, L_cap / splits), against the balanced schedule's
    near-equal items (:func:`balanced` at a budget of B·bal_splits), each piece costing START_KEYS + its keys
    (scaled by D/128), for each of the H_kv heads, on the live GPU's SMs."""
    split_t, balanced_t = _schedule_times(lengths, H_kv, D, dtype, L_cap, splits, paged)
    return balanced_t(bal_splits) / split_t


def best_balanced(lengths, H_kv: int, D: int, dtype, L_cap: int, splits: int,
                  paged: int = 0) -> tuple[float, int]:
    """(gain, splits) of the :func:`balanced_candidates` budget whose :func:`balance_gain` is smallest; the
    split schedule's time is computed once for all candidates."""
    split_t, balanced_t = _schedule_times(lengths, H_kv, D, dtype, L_cap, splits, paged)
    return min((balanced_t(b) / split_t, b) for b in balanced_candidates(len(lengths), H_kv, splits))


def _schedule_times(lengths, H_kv: int, D: int, dtype, L_cap: int, splits: int, paged: int = 0):
    """(the split schedule's makespan, a function of bal_splits giving the balanced schedule's), in keys
    (:func:`balance_gain`)."""
    from . import splits as chooser
    from .kernels.config import cdiv, chunk_for, tile_config
    B = len(lengths)
    block_n = tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
    chunk = chunk_for(L_cap, splits, block_n)[0]
    start = START_KEYS * 128 / D
    sms = chooser.sm_count()
    split = [start + min(chunk, L - j * chunk) for L in lengths for j in range(max(1, cdiv(L, chunk)))]
    split_t = max(makespan(split * H_kv, sms), 1e-9)

    def balanced_t(bal_splits: int) -> float:
        bal = [start + (e - s) for _, s, e in items(lengths, B * bal_splits, block_n)]
        return makespan(bal * H_kv, sms)
    return split_t, balanced_t
