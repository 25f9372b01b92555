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
