r"""The split-count cost model: predict the time of one decode step for each candidate split count, pick the fastest.

For a launch that cuts each sequence into chunks of ``chunk`` keys (``splits`` programs per row):

* programs :math:`P = \sum_b H_{kv}\,\max(1, \lceil L_b/\text{chunk}\rceil)` (one program serves a whole GQA
  group; a length-0 sequence still launches one),
* waves :math:`W = \lceil P / (r\cdot\text{SMs}) \rceil`, r = programs that fit on one SM at once
  (from the compiled kernel's shared memory, registers and warps: :func:`fdlib.occupancy.programs_per_sm`),
* bytes per program :math:`\text{bytes}_\text{prog} = 2\cdot\text{chunk}\cdot D\cdot\text{elem}` (its K and V
  slice), all bytes :math:`\text{bytes}_\text{kv} = 2\sum_b L_b H_{kv} D\,\text{elem}`; an 8-bit cache with
  per-token scales also reads ``scale_bytes`` (4 for each of K and V scaled per token) a key and KV head:
  :math:`\text{bytes}_\text{prog} = \text{chunk}(2D\,\text{elem} + \text{scale\_bytes})`,
  :math:`\text{bytes}_\text{kv} = \sum_b L_b H_{kv}(2D\,\text{elem} + \text{scale\_bytes})`.

.. math::
    T(\text{splits}) = n_{\text{launch}}\,t_{\text{launch}} + \frac{P}{r\cdot\text{SMs}}\,t_{\text{wave}}
                     + \operatorname{smax}\!\Big(\frac{\text{bytes}_\text{kv}}{BW},\
                                                 W\,n\,\frac{\text{bytes}_\text{prog}}{\rho}\Big)
                     + [\text{splits}>1]\,(t_{\text{merge}} + \text{splits}\cdot t_{\text{split}})

with :math:`\operatorname{smax}(a, b) = (a^4 + b^4)^{1/4}`, a maximum with a soft corner (near the corner
both limits slow the stream, as measured), and n the load of the busiest SM in a wave, which holds
:math:`k = \min(\lceil P/\text{SMs}\rceil, r)` programs: :math:`n = 1` for k = 1, and
:math:`n = k\,(1 + \gamma)/2` for k ≥ 2. One program streams its bytes in bytes_prog/ρ; a second adds a
fraction γ = ``SECOND_PROGRAM`` = 0.5 of that (it overlaps part of its stream with the first's), and beyond two the
SM's stream is saturated: each program costs (1 + γ)/2 of a whole one, what it costs with two. Measured on an
H200: the two-stage path at 148-152 programs was 10-25% slower than at 128 on four head layouts
(``results/h200/ab/ab-heads-split-counts.md``), and the unified kernel at D = 64 and 256, B = 8, 2-13% faster
at 256 programs than at 128; γ = 1 (every program on an SM costs a whole one) missed the second, γ = 0
(programs beyond the first are free) the first. A first version with γ = 0.5 let every further program add γ
(n = 1 + (k − 1)γ), so three programs an SM looked cheaper than they ran: it took 24 splits at B=1 16:16
D=64 L=262144 (254.2 µs, 1.055x cuDNN in ``results/h200/heads-sweep-256k-b1-1cd9273.json``) where the
saturated load takes 16 (238.9 µs, 1.010x cuDNN in ``heads-sweep-256k-b1.json``, another run), and 3 instead
of 2 at B=8 16:16. With the saturation ``auto`` was
within 1.02 of the faster of split and unified on all 71 head layouts of ``results/h200/heads-sweep.json`` and
``heads-sweep-256k-b{1,8}.json`` (68 of 71 before, in the ``-1cd9273`` files of the same sweeps). Two
limits race in the max: the whole GPU cannot read faster than BW, and one SM cannot stream faster than about ρ
(bytes its programs keep in flight / memory latency), so too few programs leave bandwidth unused ("too few
splits"), and a last wave with few programs still takes a whole program's time (the wave quantisation W).
Each program costs a start-up (first loads' latency, pipeline fill, storing its partial), spread over the r·SMs
slots: t_wave per full wave of programs.
Merging costs t_merge plus t_split per partial ("too many splits"). Who merges decides the critical path
(the epilogue): in the unified kernel the last program of a row merges all ``group`` query heads, reading
group·(D+1) floats per split alone on its SM after everything else, so its per-split cost is t_split scaled by
group·(D+1) / (4·129) (the calibration's 32:8 heads at D=128); the two-stage path spreads the merge over
B·H_q stage-2 programs of one head each (t_split scaled by (D+1)/(4·129)) and pays the kernel boundary
t_stage2 instead of t_merge. ``method="auto"`` takes the faster of the two by this prediction
(:func:`fdlib.splits.choose_auto`). BW, ρ, t_launch, t_wave, t_merge and t_split are measured once per GPU
by :func:`fdlib.calibration.calibrate` (cached on disk); presets without a live GPU use values scaled from an
H200 calibration (:func:`default_calibration`).

This module is the formulas only: it times nothing and imports neither the kernels' launchers nor the API.
Measuring, fitting and the disk cache live in :mod:`fdlib.calibration`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from .gpus import GPU, PRESETS, resolve
from .kernels.config import chunk_for
from .occupancy import programs_per_sm, waves

CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Calibration:
    """Per-GPU constants of the model (µs, and MB/µs = TB/s for rates). They are fitted, not read off a
    datasheet: bw_tbs can sit above the measured read ceiling because the soft max already adds time near
    the corner where the two limits meet."""
    bw_tbs: float          # whole-GPU streaming rate the kernel reaches
    rho_tbs: float         # one program's streaming rate (1 TB/s = 1 MB/µs)
    t_launch_us: float
    t_wave_us: float
    t_merge_us: float
    t_split_us: float = 0.0
    source: str = "default"
    t_stage2_us: float = 1.9   # the two-stage path's kernel boundary: stage 2 after stage 1 under CUDA graphs


H200_DEFAULT = Calibration(bw_tbs=5.16, rho_tbs=0.0482, t_launch_us=4.45, t_wave_us=2.51, t_merge_us=0.101,
                           t_split_us=0.0591,
                           source="H200 calibration of 2026-11-29 (results/h200/calibration.json, rounded)",
                           t_stage2_us=1.9)
"""t_stage2_us: two_stage - stage1 on an H200 under CUDA graphs was 1.9-2.3 µs at 2-32 splits
(results/h200/explore/explore.json); the merge work in it is counted by the t_split term."""
SECOND_PROGRAM = 0.5
"""γ: what each program beyond the first on an SM adds to the busiest SM's streaming time, in programs' worth
(see the module doc)."""
CAL_GROUP, CAL_D = 4, 128
"""The heads per group and head dim of the calibration points (H 32:8, D=128): t_split is per split there."""


def default_calibration(gpu: GPU) -> Calibration:
    """Scale the H200 constants to another GPU by its datasheet bandwidth (latency terms kept)."""
    h200 = PRESETS["H200"]
    f = gpu.bandwidth_tbs / h200.bandwidth_tbs
    return Calibration(H200_DEFAULT.bw_tbs * f, H200_DEFAULT.rho_tbs * max(f, 0.25) ** 0.5,
                       H200_DEFAULT.t_launch_us, H200_DEFAULT.t_wave_us, H200_DEFAULT.t_merge_us,
                       H200_DEFAULT.t_split_us, source=f"H200 defaults scaled to {gpu.name}",
                       t_stage2_us=H200_DEFAULT.t_stage2_us)


@dataclass(frozen=True)
class Candidate:
    splits: int
    chunk: int
    programs: int
    waves: int
    wave_efficiency: float
    time_us: float
    bound: str             # "bandwidth" or "per-program" (which side of the max won)


@dataclass
class Explanation:
    chosen: int
    candidates: list = field(default_factory=list)
    programs_per_sm: int = 1
    gpu: str = ""
    calibration: Calibration | None = None

    def table(self) -> str:
        lines = [f"cost model on {self.gpu}, {self.programs_per_sm} program(s)/SM",   # two short lines: output
                 f"constants: {self.calibration.source}",                            # areas wrap anywhere
                 " splits  chunk  programs  waves  wave-eff  predicted µs  bound"]
        for c in self.candidates:
            mark = "  <- chosen" if c.splits == self.chosen else ""
            lines.append(f"{c.splits:7d} {c.chunk:6d} {c.programs:9d} {c.waves:6d} {c.wave_efficiency:8.0%} "
                         f"{c.time_us:13.1f}  {c.bound}{mark}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()


def kernel_programs_per_sm(gpu: GPU, D: int, dtype_bytes: int, block_n: int, num_warps: int, num_stages: int,
                           compiled: dict | None = None, paged: int = 0) -> int:
    """Programs of the decode kernel resident per SM: from the compiled kernel when known, else estimated
    from its pipelined K/V tiles (num_stages × 2 tiles of block_n × D, plus 4 KB; the count the contiguous
    cache's model was fitted and graded with).

    Over pages (``paged`` > 0) the estimate is Triton's allocation instead, num_stages − 1 buffers of the K and
    the V tile plus 8 KB (the compiled contiguous unified kernel at D = 128: 139264 bytes at 128-key tiles,
    71680 at 64, results/h200/kernel-resources.json; the paged build's resources were not recorded, but its
    plans after a launch took the splits of 3 programs an SM on the three shapes below), so that a plan made
    before the kernel's first launch takes what a later one does. With the contiguous estimate, 2 programs an SM
    against the compiled 3 at the 64-key tiles of pages, auto over pages of 16 planned in a fresh process took 16
    splits instead of 32 at B=1 32:8 L=131072 (174.1 against 129.3 µs), 1 instead of 3 at B=16 32:8 L=32768
    (613.7 against 506.8) and 1 instead of 2 at B=64 32:8 L=2048 (152.6 against 137.6;
    results/h200/peers-b*-page16-shuffled.json, H200). On a
    contiguous cache the compiled count (3 at 64-key tiles) and this estimate (2) still differ; there the
    recorded sweep favours the estimate's choice (B=16 32:8 L=2048: 1 split 34.6 µs, 2 splits 39.7)."""
    if compiled:
        return programs_per_sm(gpu, compiled["num_warps"], compiled["n_regs"], compiled["shared"])
    d = max(16, 1 << (D - 1).bit_length())
    if paged:
        smem = max(1, num_stages - 1) * 2 * block_n * d * dtype_bytes + 8192
    else:
        smem = num_stages * 2 * block_n * d * dtype_bytes + 4096
    return programs_per_sm(gpu, num_warps, 128, smem)


def sm_load(k):
    """n, the streaming load of an SM holding k programs, in programs' worth: 1 for k = 1, k(1 + γ)/2 for k ≥ 2
    (the module doc; k an int or an array)."""
    k = np.asarray(k)
    return np.where(k >= 2, k * (1 + SECOND_PROGRAM) / 2, 1.0)


def _predict_many(lengths: np.ndarray, H_kv: int, D: int, dtype_bytes: int, chunks: np.ndarray, effs: np.ndarray,
                  gpu: GPU, cal: Calibration, r: int, method: str, group: int | None = None, scale_bytes: int = 0):
    """The model's terms for several chunk sizes at once (arrays over candidates); the formula of the module
    docstring, written once for :func:`predict` and :func:`explain`. ``group`` None: the merge costs as at the
    calibration points (the lab's formula: two-stage = one more launch); else the epilogue model of the module
    docstring for that group and D. ``scale_bytes``: bytes of per-token scales a key and KV head (module doc)."""
    programs = H_kv * np.maximum(1, -(-lengths[:, None] // chunks[None, :])).sum(axis=0)
    w = waves(programs, r, gpu.sms)
    per_sm = sm_load(np.minimum(-(-programs // gpu.sms), r))   # n: the busiest SM's load
    kv_mb = float(lengths.sum()) * H_kv * (2 * D * dtype_bytes + scale_bytes) / 1e6
    prog_mb = chunks * (2 * D * dtype_bytes + scale_bytes) / 1e6
    t_bw = kv_mb / cal.bw_tbs
    t_prog = w * per_sm * prog_mb / cal.rho_tbs
    if group is None:
        launches = np.where((effs > 1) & (method == "split"), 2, 1)
        merge = np.where(effs > 1, cal.t_merge_us + effs * cal.t_split_us, 0.0)
    else:
        launches = 1
        per_split = cal.t_split_us * (D + 1) / (CAL_GROUP * (CAL_D + 1))
        if method == "split":   # stage 2 always runs, even at one split
            merge = cal.t_stage2_us + effs * per_split
        else:
            merge = np.where(effs > 1, cal.t_merge_us + effs * per_split * group, 0.0)
    t = (launches * cal.t_launch_us + programs / (r * gpu.sms) * cal.t_wave_us + (t_bw ** 4 + t_prog ** 4) ** 0.25
         + merge)
    return programs, w, t, t_bw >= t_prog


def _candidates(lengths: np.ndarray, block_n: int):
    """The distinct (chunk, effective splits) pairs the candidate split counts give, fewest splits first."""
    chunks, effs = chunk_for(max(int(lengths.max(initial=0)), 1), np.array(CANDIDATES), block_n)
    effs, first = np.unique(effs, return_index=True)
    return chunks[first], effs


def _candidate(i, chunks, effs, programs, w, t, bw_bound, r, sms) -> Candidate:
    return Candidate(int(effs[i]), int(chunks[i]), int(programs[i]), int(w[i]),
                     float(programs[i] / (w[i] * r * sms)), float(t[i]),
                     "bandwidth" if bw_bound[i] else "per-program")


def predict(lengths, H_kv: int, D: int, dtype_bytes: int, splits: int, gpu: GPU, cal: Calibration,
            block_n: int, r: int, method: str = "unified") -> Candidate:
    """Predicted time of one decode step with ``splits`` (see the module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    chunk, eff = chunk_for(max(int(lengths.max(initial=0)), 1), splits, block_n)
    chunks, effs = np.array([chunk]), np.array([eff])
    return _candidate(0, chunks, effs, *_predict_many(lengths, H_kv, D, dtype_bytes, chunks, effs, gpu, cal, r, method),
                      r, gpu.sms)


def explain(B: int, H_q: int, H_kv: int, L, D: int = 128, dtype_bytes: int = 2, gpu: GPU | str | None = None,
            method: str = "unified", cal: Calibration | None = None, compiled: dict | None = None,
            epilogue: bool = True, paged: int = 0, scale_bytes: int = 0) -> Explanation:
    """Every candidate split count with its programs, waves, wave efficiency and predicted µs; ``chosen`` is
    the fastest (the smallest count within 1% of it, since fewer splits mean less merging).
    ``L`` is one length for all B sequences or a list of B lengths. ``epilogue=False``: the merge as at the
    calibration points, whatever the group and D (Lab 05's formula, :func:`predict`). ``gpu``: anything
    :func:`fdlib.gpus.resolve` takes (None: the live GPU, else the H200 preset); ``cal`` None: the GPU's
    calibration (:func:`fdlib.calibration.calibration_for`: measured once and cached for the live GPU, the
    defaults for a preset); ``paged``: the page size of a paged cache (0: contiguous), whose tiles
    (:func:`fdlib.kernels.config.tile_config_for`) the candidates and r are counted in; ``scale_bytes``: an 8-bit
    cache's per-token scale bytes a key and KV head (:attr:`fdlib.quant.KVQuant.scale_bytes`), read besides K and V."""
    gpu = resolve(gpu)
    lengths = (int(L),) * B if isinstance(L, (int, float)) else tuple(int(x) for x in L)
    if cal is None:
        from .calibration import calibration_for   # measuring needs the kernels; the formulas do not
        cal = calibration_for(gpu)
    key = tuple(sorted(compiled.items())) if compiled else None
    return _explain(B, H_q, H_kv, lengths, D, dtype_bytes, gpu, method, cal, key, epilogue, paged, scale_bytes)


@functools.lru_cache(maxsize=4096)
def _explain(B, H_q, H_kv, lengths, D, dtype_bytes, gpu, method, cal, compiled_key, epilogue, paged,
             scale_bytes=0) -> Explanation:
    """explain(), cached: a decode loop asks again and again for the same shapes."""
    from .kernels.config import tile_config_for
    compiled = dict(compiled_key) if compiled_key else None
    cfg = tile_config_for(D, max(lengths + (1,)), compiled_mode=True, elem_bytes=dtype_bytes, rows=len(lengths) * H_kv,
                          paged=paged)
    lengths = np.asarray(lengths, dtype=np.int64)
    r = kernel_programs_per_sm(gpu, D, dtype_bytes, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages, compiled, paged)
    chunks, effs = _candidates(lengths, cfg.BLOCK_N)
    terms = _predict_many(lengths, H_kv, D, dtype_bytes, chunks, effs, gpu, cal, r, method,
                          H_q // H_kv if epilogue else None, scale_bytes)
    cands = [_candidate(i, chunks, effs, *terms, r, gpu.sms) for i in range(len(chunks))]
    best = min(c.time_us for c in cands)
    chosen = min(c.splits for c in cands if c.time_us <= best * 1.01)
    return Explanation(chosen, cands, r, gpu.name, cal)


def choose(B, H_q, H_kv, L, D=128, dtype_bytes=2, gpu=None, method="unified") -> int:
    return explain(B, H_q, H_kv, L, D, dtype_bytes, gpu, method).chosen


def fa2_rule(B: int, H_q: int, H_kv: int, L: int, D: int = 128, sms: int = 132, max_splits: int = 128) -> int:
    """FlashAttention-2's split heuristic (``num_splits_heuristic``), for comparison: with B·H_kv programs
    per split (GQA packed), take the smallest split count whose wave efficiency is >= 85% of the best."""
    block_n = 256 if D <= 64 else (128 if D <= 128 else 64)
    n_blocks = -(-L // block_n)
    work = B * H_kv * max(1, -(-(H_q // H_kv) // 64))
    if work >= 0.8 * sms:
        return 1
    max_splits = min(max_splits, sms, n_blocks)
    effs = []
    for s in range(1, max_splits + 1):
        eligible = s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))
        waves = work * s / sms
        effs.append(waves / math.ceil(waves) if eligible else 0.0)
    best = max(effs)
    return next(s for s, e in enumerate(effs, start=1) if e >= 0.85 * best)
