"""Shapes for Nsight Compute (GPU only): warm up (compile), then profile one launch of each kernel.

ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis python3 tools/ncu_case.py [CASE ...]

CASE: ``short`` (B=64, H 32:32, L=512: the plain unified grid at one split, then the persistent kernel),
``small`` (B=1, H 32:8, L=512 at fdlib's splits: stage 1, stage 2, unified) or ``paged`` (B=32, H 32:8, rows of
8192 keys, the ragged bench's inputs: stream-K and the unified kernel over shuffled pages of 16, then stream-K on
the contiguous cache) or ``small-paged`` (B=8, H 32:8, rows of 1024 keys: ``auto`` over shuffled pages of 16, then
on the contiguous cache) or ``uniform`` (B=128, H 32:8, the ragged grid's draw of lengths uniform around 1024,
``--seed 19``, over shuffled pages of 16: ``auto``, which orders the rows longest first on the device, then the
same lengths sorted longest first run by the unified kernel at one split, the same schedule without the order).
Default: short and small.

Give it a cache of its own (``FDLIB_CACHE=/tmp/ncu-cache``): fdlib calibrates its cost model on first use, and a
calibration timed under the profiler (run 31 of 2026-12-01: t_launch 48 µs, rms error 12.6%) would then plan every
later run that shares the cache.
"""
from __future__ import annotations

import math
import sys

import torch

import fdlib  # noqa: F401  (decides the runtime before any kernel is defined)
from fdlib.gpus import sm_count
from fdlib.kernels.config import TileConfig, chunk_for, tile_config
from fdlib.kernels.persistent import run_persistent
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.kernels.unified import run_unified


def paged_calls(B=32, L=8192, runs=(("streamk", 16), ("unified", 16), ("streamk", 0)), lens=None, seed=0):
    """One plan.run each of ``runs`` (method, page size (0: the contiguous cache)[, num_splits]) on B rows of L
    keys (or of ``lens``), H 32:8, over pages shuffled from ``seed``: by default stream-K and unified over pages
    of 16, stream-K on the contiguous cache."""
    from fdlib.bench.ragged import _inputs
    from fdlib.validate import check_inputs
    shape = dict(dtype="float16", B=B, H_q=32, H_kv=8, D=128, dist="constant", mean=L)
    lens = lens or [L] * B
    fns = []
    for method, page, *splits in runs:
        q, k, v, lens_t, bt = _inputs(shape, lens, page, seed, "shuffled")
        L_max = check_inputs(q, k, v, lens_t, None, method, None, False, bt).L_max
        p = fdlib.plan(B, 32, 8, 128, L_max, dtype=q.dtype, device=q.device, lengths=lens, method=method,
                       page_size=page or None, num_splits=splits[0] if splits else None)
        fns.append(lambda p=p, a=(q, k, v, lens_t, bt): p.run(*a[:4], block_table=a[4]))
    return fns


def calls(case):
    if case == "paged":
        return paged_calls()
    if case == "small-paged":   # the one constant shape where pages of 16 cost > 3% (results/h200/ab, run 68)
        return paged_calls(8, 1024, (("auto", 16), ("auto", 0)))
    if case == "uniform":   # the ragged grid's draw of its one miss, then the same rows longest first at one split
        from fdlib.bench.ragged import case_lengths
        lens = case_lengths("uniform", 128, 1024, 19)
        return (paged_calls(128, 1024, (("auto", 16),), lens, 19)
                + paged_calls(128, 1024, (("unified", 16, 1),), sorted(lens, reverse=True), 19))
    D = 128
    if case == "short":
        B, Hq, Hkv, L, splits = 64, 32, 32, 512, 1
    else:
        B, Hq, Hkv, L, splits = 1, 32, 8, 512, 8
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.float16)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(B, Hq, device="cuda")
    cfg = tile_config(D, L, 2, rows=B * Hkv)
    chunk, splits = chunk_for(L, splits, cfg.BLOCK_N)
    s = 1 / math.sqrt(D)
    sms = sm_count()
    if case == "short":
        return [lambda: run_unified(q, k, v, lens, scale=s, chunk=chunk, splits=splits, cfg=cfg, out=out, lse=lse),
                lambda: run_persistent(q, k, v, lens, scale=s, cfg=TileConfig(64, 4, 3), out=out, lse=lse,
                                       programs=2 * sms)]
    op, lp = run_stage1(q, k, v, lens, scale=s, chunk=chunk, splits=splits, cfg=cfg)
    return [lambda: run_stage1(q, k, v, lens, scale=s, chunk=chunk, splits=splits, cfg=cfg),
            lambda: run_stage2(op, lp, out, lse),
            lambda: run_unified(q, k, v, lens, scale=s, chunk=chunk, splits=splits, cfg=cfg, out=out, lse=lse)]


def main():
    fns = [f for case in (sys.argv[1:] or ["short", "small"]) for f in calls(case)]
    for f in fns:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in fns:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
