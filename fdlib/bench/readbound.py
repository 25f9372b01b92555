r"""How much of a decode step is moving the bytes: the same bytes read with no attention.

A decode step streams every key and value of the batch, :math:`2\sum_b L_b H_{kv} D` elements, and folds them
tile by tile into the online-softmax state. Two reads of the same bytes, with none of that arithmetic, bound what
the step could cost on this GPU:

* :func:`row_read_us` - :func:`row_read_kernel`: one program per (KV head, sequence, split), the unified kernel's
  grid ``(H_kv, B, splits)``, walking its split's keys (the row cut into ``splits`` chunks of whole tiles) in tiles
  of BLOCK_N through the same pointers and block-table gathers as the attention kernels
  (:func:`~fdlib.kernels.tile.kv_base`, :func:`~fdlib.kernels.tile.load_kv`) and adding each tile into an
  accumulator of the tile's own shape. No query, no dot product, no exponential, no
  shared-memory staging, no merge. Its time is the row walk's access pattern and grid at this size.
* :func:`flat_read_us` - the read-ceiling kernel (:func:`fdlib.bench.ceiling.read_sum_kernel`, its best tile)
  over one flat buffer of the same size, in one launch: no rows, no pages. Its time is what one launch of this size
  costs at best, ramp-up and tail included (the ceiling itself is measured on 4 GiB, where they are negligible).

``python tools/ab_ragged.py`` times both next to the plans (methods ``row_read``, ``row_read#S@W`` for S splits
and W warps, and ``flat_read``). Both check what they summed: the row read against :func:`expected_row_sums`
(float64), the flat read against the count of ones it read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..kernels.config import chunk_for
from ..kernels.launch import paging
from ..kernels.tile import kv_base, load_kv, load_lengths
from .ceiling import read_sum_kernel
from .harness import row_keys
from .timing import Rotating, copies_for_l2, free_memory, synchronize, time_eager, time_graph


@triton.jit
def row_read_kernel(K, V, LENS, BT, OUT, FLAG, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                    stride_bt, n_pages, L_MAX, H_KV, CHUNK,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    r"""OUT[(b·H_kv + h)·S + s] = :math:`\sum_{sC \le n < \min(L_b, (s+1)C)} \sum_d (K_{b,n,h,d} + V_{b,n,h,d})`
    (float32), program (h, b, s) of S splits of C = CHUNK keys, K/V contiguous ``[B, L_max, H_kv, D]`` (PAGE = 0)
    or pages behind the block table BT."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    start = s * CHUNK
    L = tl.minimum(load_lengths(LENS, b, True, L_MAX, FLAG), start + CHUNK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    k_ptrs, v_ptrs = kv_base(K, V, b, h, stride_kb, stride_kh, stride_vb, stride_vh, offs_d, PAGE)
    bt_row = BT + b.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, L, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < L
        if PAGE == 0:
            kp = k_ptrs + (pos.to(tl.int64) * stride_kl)[:, None]
            vp = v_ptrs + (pos.to(tl.int64) * stride_vl)[:, None]
        else:
            kp, vp = k_ptrs, v_ptrs
        k, v = load_kv(kp, vp, pos, valid, mask_d, stride_kl, stride_vl, bt_row, stride_kb, stride_vb, n_pages,
                       FLAG, PAGE)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + (b * H_KV + h) * tl.num_programs(2) + s, tl.sum(tl.sum(acc, 1), 0))


def row_read(k, v, lens, block_table, out, flag, block_n: int = 64, num_warps: int = 4, splits: int = 1,
             max_len: int | None = None):
    """One launch of :func:`row_read_kernel` over K/V (``[B, L_max, H_kv, D]``, or pages
    ``[n_pages, page_size, H_kv, D]`` with ``block_table``), every row cut into ``splits`` chunks of whole tiles
    of ``max_len`` keys (the cache's L_max when None); ``out`` [B·H_kv·splits] float32 (the split fastest),
    ``flag`` [1] int32."""
    B, H_kv, D = lens.shape[0], k.shape[2], k.shape[3]
    bt, bt_stride, n_pages, L_max = paging(k, block_table, flag)
    if splits < 1:
        raise ValueError(f"splits: expected at least 1, got {splits}")
    if out.numel() != B * H_kv * splits:
        raise ValueError(f"out: expected B·H_kv·splits = {B * H_kv * splits} elements, got {out.numel()}")
    chunk = chunk_for(max_len or L_max, splits, block_n)[0]   # the plans' own splits of whole tiles
    sk, sv = k.stride(), v.stride()
    row_read_kernel[(H_kv, B, splits)](k, v, lens, bt, out, flag, sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
                                       bt_stride, n_pages, L_max, H_kv, chunk, D=D, BLOCK_N=block_n,
                                       BLOCK_D=triton.next_power_of_2(D),
                                       PAGE=0 if block_table is None else k.shape[1], num_warps=num_warps)


def expected_row_sums(k, v, lengths, block_table=None) -> torch.Tensor:
    r"""What :func:`row_read` writes, in float64: :math:`\sum_{n<L_b, d}(K + V)` for every (b, h), flattened
    b-major."""
    rows = []
    for b, L in enumerate(int(x) for x in lengths):
        kb, vb = row_keys(k, v, b, L, block_table)
        rows.append((kb.double() + vb.double()).sum((0, 2)).cpu())
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64)


def _time(calls, graphs: bool, rep_ms: float, warmup_ms: float, rep_eager_ms: float) -> float:
    """µs of one of ``calls``: under CUDA graphs rotating over them, else eager on the first with the L2 flushed."""
    return time_graph(Rotating(calls), rep_ms) if graphs else time_eager(calls[0], warmup_ms, rep_eager_ms, 1)


def row_read_us(copies, graphs: bool, block_n: int = 64, num_warps: int = 4, rep_ms: float = 20,
                warmup_ms: float = 25, rep_eager_ms: float = 100, splits: int = 1) -> tuple[float, float]:
    """(µs of one :func:`row_read` of ``splits`` chunks a row, sized for the longest row, its relative error
    against :func:`expected_row_sums`) over the batch ``copies`` (the ragged bench's list of (q, K, V, lengths,
    table); under CUDA graphs rotating over them, else eager with the L2 flushed, on the first)."""
    q, k, v, lens, bt = copies[0]
    lengths = lens.tolist()
    longest = max(lengths)
    n = lens.shape[0] * k.shape[2] * splits
    outs = [torch.empty(n, dtype=torch.float32, device=k.device) for _ in copies]
    flag = torch.zeros(1, dtype=torch.int32, device=k.device)

    def call(c, out):
        return lambda: row_read(c[1], c[2], c[3], c[4], out, flag, block_n, num_warps, splits, longest)
    calls = [call(c, o) for c, o in zip(copies, outs)]
    calls[0]()
    synchronize()
    ref = expected_row_sums(k, v, lengths, bt)
    got = outs[0].double().cpu().view(-1, splits).sum(1)
    err = float((got - ref).norm() / max(float(ref.norm()), 1e-30))
    us = _time(calls, graphs, rep_ms, warmup_ms, rep_eager_ms)
    return us, err


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
    us = _time(calls, graphs, rep_ms, warmup_ms, rep_eager_ms)
    del bufs, partial
    free_memory()
    return us
