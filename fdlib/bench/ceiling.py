r"""The read ceiling: how fast this GPU streams memory into a simple Triton kernel.

:func:`read_sum_kernel` reads a large fp16 buffer once and sums it (float32 accumulators, one partial sum per
program), so it moves the same kind of traffic as decode attention (reads only, no reuse) with none of its
arithmetic. :func:`measure_ceiling` times it with ``triton.testing.do_bench`` over a few tile shapes and keeps
the best: bandwidth = buffer bytes / time. On one H200 such a kernel reached 4.65 TB/s (datasheet 4.8 TB/s;
``results/h200/bench-*.json``, key ``ceiling``).
Decode kernels are compared against this number ("% of ceiling"), measured in the same run.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from .. import runtime
from .timing import free_memory, time_eager


@triton.jit
def read_sum_kernel(X, PARTIAL, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """PARTIAL[p] = sum of X[p·BLOCK·ITERS : (p+1)·BLOCK·ITERS] (masked at n), accumulated in float32."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        acc += x.to(tl.float32)
    tl.store(PARTIAL + pid, tl.sum(acc, axis=0))


GPU_TILES = list(itertools.product((1024, 2048, 4096), (4, 16, 64), (4, 8)))   # BLOCK, ITERS, num_warps
INTERPRETER_TILES = [(1024, 4, 1)]


def _launch(x, partial, block, iters, warps):
    n = x.numel()
    grid = (triton.cdiv(n, block * iters),)
    read_sum_kernel[grid](x, partial, n, BLOCK=block, ITERS=iters, num_warps=warps)


def measure_ceiling(gib: float = 4.0, tiles=None, warmup_ms: float = 25, rep_ms: float = 100,
                    cpu_runs: int = 3) -> dict:
    """Best read bandwidth (TB/s) over ``tiles`` streaming ``gib`` GiB of fp16; a dict for the results file.

    In interpreter mode the buffer is capped at 1 MiB and the number only proves the kernel runs.
    """
    gpu = runtime.MODE == "gpu"
    nbytes = int(gib * 2**30) if gpu else min(int(gib * 2**30), 2**20)
    n = max(nbytes // 2, 1)
    tiles = list(tiles or (GPU_TILES if gpu else INTERPRETER_TILES))
    x = torch.empty(n, dtype=torch.float16, device=runtime.DEVICE).uniform_(-1, 1)
    expect = float(torch.sum(x, dtype=torch.float32))
    results = []
    best = None
    for block, iters, warps in tiles:
        rec = {"BLOCK": block, "ITERS": iters, "num_warps": warps}
        try:
            partial = torch.empty(triton.cdiv(n, block * iters), dtype=torch.float32, device=x.device)
            _launch(x, partial, block, iters, warps)
            got = float(partial.double().sum())
            if abs(got - expect) > 1e-3 * max(1.0, abs(expect)) + 1e-2 * (n ** 0.5):
                raise RuntimeError(f"read kernel summed to {got}, torch.sum says {expect}")
            us = time_eager(lambda: _launch(x, partial, block, iters, warps), warmup_ms, rep_ms, cpu_runs)
            rec.update(us=us, tbs=2 * n / us / 1e6)
            if best is None or rec["tbs"] > best["tbs"]:
                best = rec
        except Exception as e:  # noqa: BLE001 - a tile shape that fails to compile is just skipped
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        results.append(rec)
    del x
    free_memory()
    return {
        "tbs": best["tbs"] if best else None,
        "best_tile": {k: best[k] for k in ("BLOCK", "ITERS", "num_warps")} if best else None,
        "buffer_bytes": 2 * n,
        "mode": runtime.MODE,
        "method": "Triton read-and-sum of an fp16 buffer, do_bench median (L2 flushed), best of the tiles",
        "tiles": results,
    }
