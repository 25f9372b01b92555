r"""How much of a decode step is moving the bytes: the same launches with the attention taken out.

A plan's kernels stream every key and value of the batch and, tile by tile, fold them into the online-softmax
state (:func:`fdlib.kernels.tile.tile_update`: :math:`s = q K^\top`, the running max m, :math:`p = 2^{s-m}`,
ℓ and :math:`\tilde O \leftarrow \alpha \tilde O + p V`). Two twins of a step bound what that arithmetic and the
shape of the launch cost:

* :func:`math_free` - the plan itself (kernels, grid, tiles, pipelining, block-table gathers, tickets, merge),
  with ``tile_update`` replaced by :func:`sum_tile`: :math:`(m, \ell, \tilde O) \leftarrow (\max(m, 0),\ \ell + 1,\
  \tilde O + \sum_n (K_n + V_n))`. Every element of every tile is still loaded and used once; no dot product,
  no exponential. Its time is the step's loads and launch with almost none of the math.
* :func:`flat_read_us` - the same number of bytes read by the read-ceiling kernel
  (:func:`fdlib.bench.ceiling.read_sum_kernel`, its best tile) in one launch: no rows, no pages, no merge. Its time
  is what one launch of that size costs at best on this GPU, ramp-up and tail included; the read ceiling itself is
  measured on 4 GiB, where they are negligible.

``python tools/ab_ragged.py`` times both next to the real plan (methods ``NAME+math_free`` and ``flat_read``).
The twin's output is not attention: with one split it is :math:`\sum_{n<L}(K_n + V_n) / \lceil L/N \rceil` for
every query head of the group (N: the plan's BLOCK_N), which :func:`expected_math_free` computes and the tests
check, so the twin provably reads exactly the keys the plan reads.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import runtime
from ..kernels.launch import Launcher
from .ceiling import read_sum_kernel
from .timing import Rotating, copies_for_l2, free_memory, synchronize, time_eager, time_graph


@triton.jit
def sum_tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    r""":func:`~fdlib.kernels.tile.tile_update`'s signature, none of its math: :math:`m \leftarrow \max(m, 0)`,
    :math:`\ell \leftarrow \ell + 1`, :math:`\tilde O \leftarrow \tilde O + \sum_n (K_n + V_n)` broadcast over the
    group's rows. Masked keys load as 0, so only the slice's keys count."""
    kv = tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    return tl.maximum(m, 0.0), l + 1.0, acc + kv[None, :]


def math_free(plan):
    """A copy of ``plan`` whose kernels run :func:`sum_tile` in place of the tile update (any launch without a
    tile update, such as the two-stage path's merge, is kept as it is). The copy has launchers of its own, so
    the plan itself is unchanged."""
    def swap(launcher):
        if "TILE_UPDATE" not in launcher.meta:
            return launcher
        return Launcher(launcher.kernel, {**launcher.meta, "TILE_UPDATE": sum_tile}, launcher.dtype_slots)
    return dataclasses.replace(plan, _launchers=tuple(swap(g) for g in plan._launchers), _timeline={},
                               _replays={})


def expected_math_free(k, v, lengths, block_n: int, H_q: int, block_table=None) -> torch.Tensor:
    r"""What :func:`math_free` of a one-split plan returns, in float64: row (b, h) =
    :math:`\sum_{n < L_b}(K_{b,n,h_{kv}} + V_{b,n,h_{kv}}) / \max(1, \lceil L_b / N\rceil)` with
    :math:`h_{kv} = h / \text{group}`, K/V ``[B, L_max, H_kv, D]`` or pages behind ``block_table``."""
    B, H_kv, D = len(lengths), k.shape[2], k.shape[3]
    out = torch.zeros(B, H_q, D, dtype=torch.float64)
    for b, L in enumerate(int(x) for x in lengths):
        if block_table is None:
            kb, vb = k[b, :L], v[b, :L]
        else:
            P = k.shape[1]
            pos = torch.arange(L, device=k.device)
            page = block_table[b].long()[pos // P]
            kb, vb = k[page, pos % P], v[page, pos % P]
        s = (kb.double() + vb.double()).sum(0) / max(1, -(-L // block_n))     # [H_kv, D]
        out[b] = s.cpu().repeat_interleave(H_q // H_kv, 0)
    return out


def flat_read_us(nbytes: int, tile: dict | None, graphs: bool, rep_ms: float = 20, warmup_ms: float = 25,
                 rep_eager_ms: float = 100) -> float:
    """µs of one launch of :func:`~fdlib.bench.ceiling.read_sum_kernel` over ``nbytes`` of fp16 (``tile``: the
    ceiling's ``best_tile``, dict of BLOCK, ITERS, num_warps; None: 1024, 16, 4): under CUDA graphs rotating over
    copies holding >= 4x the L2 (:func:`~fdlib.bench.timing.copies_for_l2`), else eager with the L2 flushed."""
    if nbytes < 2:
        raise ValueError(f"nbytes: expected at least 2 (one fp16 element), got {nbytes}")
    tile = tile or {"BLOCK": 1024, "ITERS": 16, "num_warps": 4}
    block, iters, warps = tile["BLOCK"], tile["ITERS"], tile["num_warps"]
    n = nbytes // 2
    copies = copies_for_l2(nbytes) if graphs else 1
    bufs = [torch.ones(n, dtype=torch.float16, device=runtime.DEVICE) for _ in range(copies)]
    grid = (triton.cdiv(n, block * iters),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=runtime.DEVICE)

    def call(x):
        return lambda: read_sum_kernel[grid](x, partial, n, BLOCK=block, ITERS=iters, num_warps=warps)
    calls = [call(x) for x in bufs]
    calls[0]()
    synchronize()
    got = float(partial.double().sum())
    if got != n:
        raise RuntimeError(f"flat read: summed {got} ones, expected {n}")
    us = time_graph(Rotating(calls), rep_ms) if graphs else time_eager(calls[0], warmup_ms, rep_eager_ms, 1)
    del bufs, partial
    free_memory()
    return us
