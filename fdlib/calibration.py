r"""Calibrating the cost model: time the unified kernel on a few shapes, fit the constants, cache them per GPU.

The cost model (:mod:`fdlib.costmodel`) predicts one decode step as

.. math::
    T(\text{splits}) = t_{\text{launch}} + \frac{P}{r\cdot\text{SMs}}\,t_{\text{wave}}
                     + \operatorname{smax}\!\Big(\frac{K}{BW},\ W\,n\,\frac{c}{\rho}\Big)
                     + [\text{splits}>1]\,(t_{\text{merge}} + \text{splits}\cdot t_{\text{split}})

Six constants are the GPU's: BW, ρ, t_launch, t_wave, t_merge, t_split. :func:`calibrate` times the unified
kernel at :data:`CALIBRATION_POINTS` (CUDA graphs, a few seconds) and :func:`fit` finds them: for a fixed
(BW, ρ) the time is linear in the four others, so for each (BW, ρ) on a grid a least-squares solve gives
t_launch, t_wave, t_merge, t_split (clipped at 0), and the pair with the smallest rms relative error wins.

The result is cached on disk (``~/.cache/fdlib`` or ``$FDLIB_CACHE``, one file per GPU name) and in memory;
:func:`calibration_for` is what the cost model asks: the live GPU's calibration (measured the first time
unless ``FDLIB_NO_CALIBRATE=1``), the H200 constants for an H200 preset, scaled defaults for other presets.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .costmodel import H200_DEFAULT, Calibration, default_calibration, kernel_programs_per_sm, predict
from .gpus import GPU, resolve
from .kernels.config import tile_config_for

CALIBRATION_POINTS = [(1, 8, 131072, 8), (1, 8, 131072, 16), (1, 8, 131072, 64), (1, 8, 8192, 8),
                      (1, 8, 8192, 16), (1, 8, 8192, 64), (1, 8, 2048, 16), (1, 8, 2048, 32), (16, 8, 512, 1),
                      (16, 8, 512, 2), (64, 8, 2048, 1), (64, 8, 2048, 4), (4, 8, 32768, 4), (4, 8, 32768, 16),
                      (1, 8, 512, 1), (1, 8, 512, 8)]
"""(B, H_kv, L, splits) timed by :func:`calibrate`, with H_q = 32, D = 128, fp16."""

_CAL: dict = {}
"""Calibrations of live GPUs loaded or measured in this process, by GPU name (None: none on disk)."""


def _cache_path(gpu_name: str) -> Path:
    root = Path(os.environ.get("FDLIB_CACHE", Path.home() / ".cache" / "fdlib"))
    slug = "".join(ch if ch.isalnum() else "-" for ch in gpu_name).strip("-").lower()
    return root / f"calibration-{slug}.json"


def calibration_cached(gpu: GPU) -> Calibration | None:
    """The calibration already in memory or on disk for this GPU, without measuring anything."""
    if gpu.name in _CAL and _CAL[gpu.name] is not None:
        return _CAL[gpu.name]
    path = _cache_path(gpu.name)
    try:
        return Calibration(**json.loads(path.read_text())) if path.exists() else None
    except (TypeError, ValueError):
        return None


def calibration_for(gpu: GPU) -> Calibration:
    """For the live GPU: its calibration from memory or disk, else measured now (:func:`calibrate`, a few
    seconds) unless ``FDLIB_NO_CALIBRATE=1``; for an H200 preset the H200 defaults; else scaled defaults."""
    if gpu.name.endswith("(live)"):
        if gpu.name not in _CAL:
            _CAL[gpu.name] = calibration_cached(gpu)
            if _CAL.get(gpu.name) is None and os.environ.get("FDLIB_NO_CALIBRATE", "0") != "1":
                _CAL[gpu.name] = calibrate(gpu)
        if _CAL.get(gpu.name) is not None:
            return _CAL[gpu.name]
    if gpu.name.startswith("H200") or gpu.name.startswith("NVIDIA H200"):
        return H200_DEFAULT
    return default_calibration(gpu)


def calibrate(gpu: GPU | None = None, progress: bool = True) -> Calibration:
    """Time the unified kernel at :data:`CALIBRATION_POINTS` (a few seconds) and :func:`fit` BW, ρ, t_launch,
    t_wave, t_merge, t_split; the result is written to the disk cache (:func:`calibration_cached` reads it).

    Each point is one launch of the unified kernel (:func:`fdlib.kernels.unified.run_unified`) at the tiles
    and the chunk of its forced split count (:func:`~fdlib.kernels.config.tile_config_for`,
    :func:`~fdlib.kernels.config.chunk_for`: what ``fdlib.plan(..., method="unified", num_splits=s)`` launches,
    without going through the planner, whose ``auto`` reads this calibration), timed under CUDA graphs
    (``triton.testing.do_bench_cudagraph``, median), cycling over enough copies of the KV cache (at least
    4·60 MB in all, at most 8) that the L2 does not hold the one being read.
    """
    import torch
    import triton

    gpu = gpu or resolve(None)
    points = CALIBRATION_POINTS
    D, H_q = 128, 32
    rows = []
    it = points
    if progress:
        try:
            from tqdm.auto import tqdm
            it = tqdm(points, desc=f"calibrating fdlib on {gpu.name}", leave=False)
        except ImportError:
            pass
    for B, H_kv, L, s in it:
        copies = max(1, min(8, -(-4 * 60_000_000 // (2 * B * L * H_kv * D * 2))))
        fn, _ = unified_point(B, H_q, H_kv, D, L, s, copies)
        fn()   # compiled before capture
        t = triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median") * 1e3
        rows.append((B, H_kv, L, s, t))
        del fn
    cal = fit(rows, gpu, D)
    _save(gpu, cal)
    return cal


def unified_point(B: int, H_q: int, H_kv: int, D: int, L: int, s: int, copies: int = 1, device="cuda",
                  compiled: bool = True):
    """(fn, (q, kv, out, lse)) of one calibration point: ``fn()`` launches the unified kernel on the next of
    ``copies`` fp16 KV caches of B rows of L keys at ``s`` splits, with the tiles and chunk the planner gives a
    forced split count (``compiled``: a GPU's tiles, else the interpreter's), into preallocated outputs and
    workspace (nothing allocated per call, so it can be captured)."""
    import torch

    from .kernels.config import chunk_for
    from .kernels.unified import run_unified
    q = torch.randn(B, H_q, D, device=device, dtype=torch.float16)
    kv = [(torch.randn(B, L, H_kv, D, device=device, dtype=torch.float16),
           torch.randn(B, L, H_kv, D, device=device, dtype=torch.float16)) for _ in range(copies)]
    cfg = tile_config_for(D, L, compiled_mode=compiled, elem_bytes=2, rows=B * H_kv)
    chunk, splits = chunk_for(L, s, cfg.BLOCK_N)
    f32 = dict(dtype=torch.float32, device=device)
    out, lse = torch.empty_like(q), torch.empty(B, H_q, **f32)
    parts = (dict(o_part=torch.empty(B, H_q, splits, D, **f32), lse_part=torch.empty(B, H_q, splits, **f32))
             if splits > 1 else {})
    ws = dict(parts, counters=torch.zeros(B * H_kv, dtype=torch.int32, device=device),
              flag=torch.zeros(1, dtype=torch.int32, device=device))
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    state = {"i": 0}

    def fn():
        k, v = kv[state["i"] % copies]
        state["i"] += 1
        run_unified(q, k, v, lens, D ** -0.5, chunk, splits, cfg, out, lse, **ws)
    return fn, (q, kv, out, lse)


def _save(gpu: GPU, cal: Calibration) -> None:
    """Write ``cal`` to the disk cache of ``gpu`` (what :func:`calibration_cached` reads)."""
    path = _cache_path(gpu.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=1))


def fit(rows, gpu: GPU, D: int = 128, dtype_bytes: int = 2) -> Calibration:
    """Fit the model's constants to measured rows (B, H_kv, L, splits, µs): for each (BW, ρ) on a grid
    (BW from 0.7 to 1.1 × the datasheet bandwidth, ρ from 0.01 to 0.2 TB/s), least squares on relative errors
    for t_launch, t_wave, t_merge, t_split (clipped at 0); the pair with the smallest rms relative error wins."""
    best = None
    times = np.array([r[4] for r in rows])
    for bw in np.linspace(0.7, 1.1, 33) * gpu.bandwidth_tbs:
        for rho in np.geomspace(0.01, 0.2, 41):
            A, base = [], []
            for B, H_kv, L, s, t in rows:
                cfg = tile_config_for(D, L, compiled_mode=True, elem_bytes=dtype_bytes, rows=B * H_kv)
                r = kernel_programs_per_sm(gpu, D, dtype_bytes, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages)
                c = predict([L] * B, H_kv, D, dtype_bytes, s, gpu, Calibration(bw, rho, 0, 0, 0, 0), cfg.BLOCK_N, r)
                A.append([1.0, c.programs / (r * gpu.sms), 1.0 if c.splits > 1 else 0.0,
                          c.splits if c.splits > 1 else 0.0])
                base.append(c.time_us)
            A, base = np.array(A), np.array(base)
            w = 1.0 / times                                   # fit relative errors
            coef, *_ = np.linalg.lstsq(A * w[:, None], (times - base) * w, rcond=None)
            coef = np.clip(coef, 0.0, None)
            err = float(np.sqrt(np.mean(((base + A @ coef) / times - 1) ** 2)))
            if best is None or err < best[0]:
                best = (err, bw, rho, coef)
    err, bw, rho, (t_launch, t_wave, t_merge, t_split) = best
    return Calibration(float(bw), float(rho), float(t_launch), float(t_wave), float(t_merge), float(t_split),
                       source=f"calibrated on {gpu.name} (rms rel. error {err:.1%})")
