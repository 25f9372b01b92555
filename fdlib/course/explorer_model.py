r"""What the SM-occupancy explorer draws: the numbers of one setting, computed without drawing anything.

A split-KV decode launch runs

.. math:: P = B \cdot H \cdot \text{splits}, \qquad
          H = H_{kv}\ \text{(GQA packing)}\ \text{or}\ H_q\ \text{(one program per query head)}

programs. With ``r`` programs per SM and S SMs they run in :math:`\lceil P/(rS) \rceil` waves
(:func:`fdlib.occupancy.schedule`). With B = 1 and H_kv = 8, one split keeps 8 of an H200's 132 SMs busy
and the other 124 idle; cutting the KV sequence into splits multiplies the programs until every SM streams
its own slice. The two-stage method adds a second, small launch of B·H_q merge programs.

* :func:`summary` -- the numbers of one setting (programs, waves, utilization, busy SMs per wave,
  predicted µs) as a :class:`Summary`, with a deterministic text form for checked notebook cells;
* :func:`summary_and_curve` -- the same with the schedule and the cost model's curve, what a picture needs;
* :func:`recorded` -- measured µs of the same shape from the committed benchmark results.

A **length histogram** (``dist``: ``"constant"``, ``"uniform"`` in [1, 2L], ``"zipf"``: most short, a few long;
:func:`fdlib.bench.ragged.draw_lengths`, L their mean) makes the batch ragged: the split schedule then launches
:math:`H\sum_b \max(1, \lceil L_b/\text{chunk}\rceil)` programs with chunk sized for the longest row, and the
summary adds the balanced schedule (:mod:`fdlib.schedule`, budget B·splits as the plan sets it) priced by the same
cost-model formula over its items (:func:`balanced_time`), and both schedules' idle SM share from the timeline model
(:mod:`fdlib.course.timeline`, up to :data:`TIMELINE_MAX_PROGRAMS` programs). For any histogram, where
``decode_attention`` with the lengths on the device runs stream-K (:func:`fdlib.plan.device_schedule_suits`: two
or more sequences), the summary adds that launch from the timeline model: programs, shares with work, tiles a
share, makespan and idle SMs.

r, the splits a launch really has and every predicted time come from the cost model
(:func:`fdlib.costmodel.explain`, r by :func:`fdlib.costmodel.kernel_programs_per_sm`) and the planner
(:func:`fdlib.plan.launched_splits`): the explorer draws the model the library decides with.
:mod:`fdlib.course.explorer` draws it (matplotlib) and puts it behind sliders (ipywidgets).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import costmodel, gpus
from ..kernels.config import MAX_SPLITS
from ..occupancy import Schedule, programs_per_sm, schedule

DISTS = ("constant", "uniform", "zipf")
TIMELINE_MAX_PROGRAMS = 20000
"""Above this many programs the explorer skips the timeline model (it plays out every program)."""

STAGE2_WARPS = 4
"""Warps of a stage-2 (merge) program, for the programs per SM of the two-stage method's second launch."""


def gpu_tile(D: int, L: int, rows: int | None = None, dtype_bytes: int = 2):
    """The compiled kernels' tile (BLOCK_N keys, warps, stages) for head dim D, length L, B·H_kv rows and
    element size, as :func:`fdlib.kernels.config.tile_config_for` picks it on a GPU (the explorer models a
    GPU even on a CPU)."""
    from ..kernels.config import tile_config_for
    return tile_config_for(D, L, compiled_mode=True, elem_bytes=dtype_bytes, rows=rows)


def splits_used(L: int, splits: int, D: int = 128, rows: int | None = None, dtype_bytes: int = 2) -> int:
    """Splits the kernels really launch on a GPU: the planner's :func:`fdlib.plan.launched_splits`."""
    from ..plan import launched_splits
    return launched_splits(L, splits, D, rows, dtype_bytes, compiled=True)


def time_at(cands, splits: int) -> tuple[float, bool]:
    """(predicted µs at ``splits``, exact?) -- log-log interpolation between candidates when not one of them."""
    xs = [int(c.splits) for c in cands]
    ts = [float(c.time_us) for c in cands]
    if splits in xs:
        return ts[xs.index(splits)], True
    if splits <= xs[0]:
        return ts[0], False
    if splits >= xs[-1]:
        return ts[-1], False
    i = int(np.searchsorted(xs, splits))
    f = (math.log(splits) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return math.exp((1 - f) * math.log(ts[i - 1]) + f * math.log(ts[i])), False


def per_sm_text(r: int) -> str:
    return f"{r} program{'s' if r != 1 else ''}/SM"


# ----------------------------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class Summary:
    """The numbers of one setting. ``str()``/``repr()`` give the same deterministic text."""
    gpu: str
    sms: int
    B: int
    H_q: int
    H_kv: int
    L: int
    D: int
    dtype_bytes: int
    gqa: bool
    unified: bool
    splits: int                  # requested
    splits_used: int             # launched: at most one split per BLOCK_N-key tile
    block_n: int                 # keys per tile of the compiled kernel for this D and L
    programs: int                # of the main (stage-1 / unified) launch
    programs_per_sm: int
    waves: int
    tail_programs: int
    wave_efficiency: float
    utilization: float           # SMs with work, averaged over the waves
    busy_sms_per_wave: tuple = field(repr=False)
    stage2_programs: int         # 0 for the unified kernel
    stage2_waves: int
    predicted_us: float
    predicted_exact: bool        # False: interpolated between the cost model's candidates
    chosen_splits: int           # the cost model's choice for this shape
    chosen_us: float
    dist: str = "constant"       # the length histogram (L is its mean when not constant)
    seed: int = 0
    L_longest: int = 0           # the longest row of a ragged batch
    balanced_items: int = 0      # the balanced schedule's items (per KV head) and their cost-model numbers
    balanced_programs: int = 0
    balanced_waves: int = 0
    balanced_us: float = 0.0
    idle_split: float | None = None      # timeline model: share of SM time idle (None: not computed)
    idle_balanced: float | None = None
    q_len: int = 1               # query tokens per sequence: group × q_len rows a program, the same K/V bytes
    streamk_programs: int = 0    # the default call without host lengths (stream-K; 0: it runs another kernel)
    streamk_shares: int = 0      # programs with a share of the tiles (fewer on equal rows: whole pieces a row)
    streamk_tiles: float = 0.0   # tiles a share
    streamk_us: float | None = None      # timeline model: its makespan and idle SM share
    idle_streamk: float | None = None

    @property
    def group(self) -> int:
        return self.H_q // self.H_kv

    @property
    def mode(self) -> str:
        pack = "GQA packed (one program per KV head)" if self.gqa else "one program per query head"
        return f"{pack}, {'unified kernel' if self.unified else 'two-stage (stage 1 + stage 2)'}"

    @property
    def busy_sms_first_wave(self) -> int:
        return self.busy_sms_per_wave[0] if self.busy_sms_per_wave else 0

    @property
    def busy_sms_last_wave(self) -> int:
        return self.busy_sms_per_wave[-1] if self.busy_sms_per_wave else 0

    def busy_text(self) -> str:
        w = self.waves
        if w == 0:
            return "none"
        if w == 1:
            return f"{self.busy_sms_per_wave[0]} of {self.sms}"
        full = f"{self.sms} of {self.sms} in wave{'s 1-' + str(w - 1) if w > 2 else ' 1'}"
        return f"{full}, {self.busy_sms_per_wave[-1]} of {self.sms} in the tail (wave {w})"

    def lines(self) -> list[str]:
        split_txt = f"{self.splits}" if self.splits == self.splits_used else \
            f"{self.splits} requested, {self.splits_used} launched (one per {self.block_n}-key tile at most)"
        heads = f"{'H_kv ' + str(self.H_kv) if self.gqa else 'H_q ' + str(self.H_q)}"
        progs = f"{self.programs} = B {self.B} × {heads} × splits {self.splits_used}" if self.dist == "constant" \
            else f"{self.programs} = {heads} × Σ_b ⌈L_b/chunk⌉ (splits sized for the longest row, {self.L_longest})"
        if self.stage2_programs:
            progs += f" (+ stage 2: {self.stage2_programs} programs, {self.stage2_waves} wave" \
                     f"{'s' if self.stage2_waves != 1 else ''})"
        approx = "" if self.predicted_exact else " (interpolated)"
        L = f"L={self.L}" if self.dist == "constant" else \
            f"L: {'uniform in [1, ' + str(2 * self.L) + ']' if self.dist == 'uniform' else 'Zipf-like'}, mean {self.L}"
        out = [
            f"model of {self.gpu}, {self.sms} SMs, {per_sm_text(self.programs_per_sm)}; {self.mode}",
            f"shape: B={self.B} H_q={self.H_q} H_kv={self.H_kv} (group {self.group}) {L} D={self.D} "
            f"dtype={self.dtype_bytes} bytes"
            + (f"; q_len={self.q_len} query tokens: {self.group * self.q_len} query rows a program, "
               f"the same K/V bytes" if self.q_len > 1 else ""),
            f"splits: {split_txt}",
            f"programs: {progs}",
            f"waves: {self.waves} (tail wave: {self.tail_programs} programs), "
            f"wave efficiency {self.wave_efficiency:.1%}",
            f"busy SMs per wave: {self.busy_text()}",
            f"SM utilization: {self.utilization:.1%}",
            f"predicted time per decode step: {self.predicted_us:.1f} µs{approx} [cost model]",
            f"cost model's choice: {self.chosen_splits} splits, {self.chosen_us:.1f} µs",
        ]
        if self.dist != "constant":
            out.append(f"balanced schedule (budget B·splits): {self.balanced_items} items × {self.H_kv} KV heads = "
                       f"{self.balanced_programs} programs, {self.balanced_waves} waves, predicted "
                       f"{self.balanced_us:.1f} µs [cost model]")
            if self.idle_split is not None:
                out.append(f"SMs idle (timeline model): split {self.idle_split:.1%}, balanced {self.idle_balanced:.1%}")
            else:
                out.append(f"SMs idle (timeline model): not computed above {TIMELINE_MAX_PROGRAMS} programs")
        if self.streamk_programs:
            out.append(f"default call, lengths on the device: stream-K, {self.streamk_programs} programs "
                       f"({self.streamk_shares} with a share), ~{self.streamk_tiles:.1f} tiles a share, makespan "
                       f"{self.streamk_us:.1f} µs, SMs idle {self.idle_streamk:.1%} [timeline model]")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle):   # IPython: the same text
        p.text(str(self))


def check_shape(B, H_q, H_kv, L, splits, D, dtype_bytes):
    """ValueError naming the argument unless every size is an integer >= 1, H_q a multiple of H_kv and
    splits at most MAX_SPLITS."""
    for name, v in (("B", B), ("H_q", H_q), ("H_kv", H_kv), ("L", L), ("splits", splits), ("D", D),
                    ("dtype_bytes", dtype_bytes)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    if H_q % H_kv:
        raise ValueError(f"H_q ({H_q}) must be a multiple of H_kv ({H_kv}): "
                         "group = H_q/H_kv query heads share a KV head")
    if splits > MAX_SPLITS:
        raise ValueError(f"splits: expected 1..{MAX_SPLITS}, got {splits}")


def wave_rows(s: Schedule, waves: list[int]) -> list[np.ndarray]:
    """Programs per SM in the given (0-based) waves; round-robin like :func:`fdlib.occupancy.placement`."""
    rows = []
    for w in waves:
        n = s.slots if w < s.waves - 1 else s.tail_programs
        full, extra = divmod(n, s.sms)
        row = np.full(s.sms, full, dtype=int)
        row[:extra] += 1
        rows.append(row)
    return rows


def ragged_lengths(dist: str, B: int, L: int, seed: int = 0) -> list[int]:
    """B lengths of mean L from the histogram ``dist`` (:data:`DISTS`; :func:`fdlib.bench.ragged.draw_lengths`)."""
    if dist not in DISTS:
        raise ValueError(f"dist: expected one of {', '.join(DISTS)}, got {dist!r}")
    from ..bench.ragged import draw_lengths
    return draw_lengths(dist, int(B), int(L), int(seed))


def balanced_time(lengths, H_kv: int, D: int, dtype_bytes: int, budget: int, gpu, cal, block_n: int, r: int,
                  group: int):
    r"""(items, programs, waves, µs) of the balanced schedule by the cost model's formula (:mod:`fdlib.costmodel`)
    applied to its items: P = H_kv·Σ n_b programs of at most c tiles, bytes per program 2·c·N·D·elem, and the
    unified kernel's epilogue for the row with the most items."""
    from ..schedule import balanced
    s = balanced(lengths, budget, block_n)
    P = H_kv * s.items
    w = -(-P // (r * gpu.sms))
    kv_mb = 2 * float(sum(lengths)) * H_kv * D * dtype_bytes / 1e6
    t_bw = kv_mb / cal.bw_tbs
    t_prog = w * 2 * s.chunk_tiles * block_n * D * dtype_bytes / 1e6 / cal.rho_tbs
    most = int(s.splits.max()) if len(s.splits) else 1
    per_split = cal.t_split_us * (D + 1) / (costmodel.CAL_GROUP * (costmodel.CAL_D + 1))
    merge = cal.t_merge_us + most * per_split * group if most > 1 else 0.0
    t = cal.t_launch_us + P / (r * gpu.sms) * cal.t_wave_us + (t_bw ** 4 + t_prog ** 4) ** 0.25 + merge
    return s.items, P, w, float(t)


def summary_and_curve(B, H_q, H_kv, L, splits, gpu="H200", gqa=True, unified=True, D=128, dtype_bytes=2,
                      dist="constant", seed=0, q_len=1):
    """(:class:`Summary`, the main launch's :class:`~fdlib.occupancy.Schedule`, the cost model's
    :class:`~fdlib.costmodel.Explanation` over split counts) of one setting; ``gpu`` as
    :func:`fdlib.gpus.resolve` takes it; ``dist`` the length histogram of mean L (module docstring).
    ``q_len`` query tokens per sequence (speculative decoding): the programs and K/V bytes are those of one
    token, while every query-side count (rows a program holds, outputs, partials, the merge) is H_q·q_len, as
    :func:`fdlib.plan.decide` tells the cost model."""
    check_shape(B, H_q, H_kv, L, splits, D, dtype_bytes)
    if not (isinstance(q_len, int) and 1 <= q_len <= 16):
        raise ValueError(f"q_len: expected an integer from 1 to 16, got {q_len!r}")
    rows_q = H_q * q_len
    g = gpus.resolve(gpu)
    heads = H_kv if gqa else H_q
    lens = ragged_lengths(dist, B, L, seed)
    longest = max(max(lens), 1)
    # One program per query head is the packed kernel with group 1: each query head streams its own KV copy.
    ex = costmodel.explain(B=int(B), H_q=int(rows_q), H_kv=int(heads), L=int(L) if dist == "constant" else lens,
                           D=int(D), dtype_bytes=int(dtype_bytes), gpu=g, method="unified" if unified else "split")
    r = int(ex.programs_per_sm)
    used = splits_used(longest, splits, D, B * heads, dtype_bytes)
    block_n = gpu_tile(D, longest, B * heads, dtype_bytes).BLOCK_N
    if dist == "constant":
        P = B * heads * used
    else:
        from ..kernels.config import chunk_for
        chunk = chunk_for(longest, used, block_n)[0]
        P = heads * sum(max(1, -(-x // chunk)) for x in lens)
    s = schedule(P, r, g.sms)
    busy = tuple([g.sms] * (s.waves - 1) + [s.busy_sms_last_wave]) if s.waves else ()
    s2 = schedule(B * rows_q, programs_per_sm(g, STAGE2_WARPS, 64, 0), g.sms) if not unified else None
    t, exact = time_at(ex.candidates, used)
    chosen_t, _ = time_at(ex.candidates, int(ex.chosen))
    extra = {}
    if dist != "constant":
        from ..calibration import calibration_for
        cal = calibration_for(g)
        items, bp, bw_, bt = balanced_time(lens, heads, D, dtype_bytes, B * used, g, cal, block_n, r, H_q // heads)
        extra = dict(dist=dist, seed=int(seed), L_longest=longest, balanced_items=items, balanced_programs=bp,
                     balanced_waves=bw_, balanced_us=bt)
        if max(P, bp) <= TIMELINE_MAX_PROGRAMS:
            from .timeline import model_timeline
            kw = dict(D=int(D), dtype_bytes=int(dtype_bytes), gpu=g, splits=used, cal=cal)
            extra["idle_split"] = model_timeline(lens, H_q, heads, schedule="split" if not unified else "unified",
                                                 **kw).idle_fraction
            extra["idle_balanced"] = model_timeline(lens, H_q, heads, schedule="balanced", **kw).idle_fraction
    if gqa and unified and _default_streamk(B, q_len):
        from ..calibration import calibration_for
        from .timeline import model_timeline
        sk = model_timeline(lens, H_q, heads, D=int(D), dtype_bytes=int(dtype_bytes), gpu=g, schedule="stream-k",
                            cal=calibration_for(g))
        extra.update(streamk_programs=sk.info["programs"], streamk_shares=sk.info["shares"],
                     streamk_tiles=sk.info["tiles_per_program"], streamk_us=sk.makespan,
                     idle_streamk=sk.idle_fraction)
    summ = Summary(gpu=g.name, sms=g.sms, B=int(B), H_q=int(H_q), H_kv=int(H_kv), L=int(L), D=int(D),
                   dtype_bytes=int(dtype_bytes), gqa=bool(gqa), unified=bool(unified), splits=int(splits),
                   splits_used=used, block_n=block_n, programs=P,
                   programs_per_sm=r, waves=s.waves, tail_programs=s.tail_programs,
                   wave_efficiency=s.wave_efficiency, utilization=s.utilization, busy_sms_per_wave=busy,
                   stage2_programs=s2.programs if s2 else 0, stage2_waves=s2.waves if s2 else 0,
                   predicted_us=t, predicted_exact=exact, chosen_splits=int(ex.chosen), chosen_us=chosen_t,
                   q_len=int(q_len), **extra)
    return summ, s, ex


def _default_streamk(B: int, q_len: int) -> bool:
    """Whether ``decode_attention`` with the lengths on the device runs stream-K for this batch
    (:func:`fdlib.plan.device_schedule_suits`)."""
    from ..plan import device_schedule_suits
    return device_schedule_suits(int(B), int(q_len))


def summary(B: int, H_q: int, H_kv: int, L: int, splits: int, gpu="H200", gqa: bool = True, unified: bool = True,
            D: int = 128, dtype_bytes: int = 2, dist: str = "constant", seed: int = 0, q_len: int = 1) -> Summary:
    """The numbers of one setting: programs, waves, utilization, busy SMs per wave, predicted µs.

    >>> print(summary(B=1, H_q=32, H_kv=8, L=131072, splits=1).busy_text())
    8 of 132
    """
    return summary_and_curve(B, H_q, H_kv, L, splits, gpu, gqa, unified, D, dtype_bytes, dist, seed, q_len)[0]


# ----------------------------------------------------------------------------------------------- recorded results
def results_dir() -> Path:
    """Where committed benchmark results live: ``$FDLIB_RESULTS`` or the checkout's ``results/``."""
    return Path(os.environ.get("FDLIB_RESULTS", Path(__file__).resolve().parents[2] / "results"))


def _point(shape: dict, method: str, point: dict, device: str, sweep: bool) -> tuple | None:
    """(shape key, method, splits, µs, device, timing, sweep) of one timed point of a results file, or None
    when it has no split count or did not pass; CUDA-graph µs where the run has them, else eager."""
    sp = point.get("splits")
    if not isinstance(sp, int) or sp < 1 or point.get("status") != "ok":
        return None
    us, timing = point.get("graph_us"), "graph"
    if us is None:
        us, timing = point.get("us", point.get("eager_us")), "eager"
    if us is None:
        return None
    import torch
    key = (int(shape["B"]), int(shape["H_q"]), int(shape["H_kv"]), int(shape["L"]), int(shape["D"]),
           getattr(torch, shape["dtype"]).itemsize)
    return key, str(method), sp, float(us), device, timing, sweep


@functools.lru_cache(maxsize=8)
def _load_points(root: str, stamp: tuple) -> tuple:
    """Every timed point of the ``python -m fdlib.bench`` results under ``root`` (bench records and sweep
    points; read by :func:`fdlib.bench.report.load_results`); ``stamp`` (paths and mtimes) invalidates the
    cache when files change."""
    from ..bench.report import load_results
    out = []
    for path in sorted(Path(root).rglob("*.json")):
        try:
            res = load_results(path)
        except ValueError:   # not a results file of fdlib.bench (a calibration, a tuning run, a tool's output)
            continue
        device = res["provenance"]["device"]
        if res["kind"] == "sweep":
            method = res["settings"]["method"]
            out += [_point(row, method, p, device, True) for row in res["sweep"] for p in row["points"]]
        elif res["kind"] == "bench":
            out += [_point(rec, rec["method"], rec, device, False) for rec in res["records"]]
    return tuple(p for p in out if p is not None)


def recorded(B, H_q, H_kv, L, D=128, dtype_bytes=2, unified=True) -> tuple[list[tuple[int, float]], str | None]:
    """Benchmark results committed under :func:`results_dir` for this shape: ([(splits, µs)], device) or
    ([], None) when none match.

    Reads every ``python -m fdlib.bench`` results file there; prefers ``--sweep-splits`` sweeps and CUDA-graph
    times, and keeps one device and timing only (the fastest time per split count).
    """
    root = results_dir()
    if not root.is_dir():
        return [], None
    try:
        stamp = tuple((str(p), p.stat().st_mtime_ns) for p in sorted(root.rglob("*.json")))
    except OSError:
        return [], None
    want_methods = ("unified", "auto") if unified else ("split",)
    match = [r for r in _load_points(str(root), stamp)
             if r[0] == (B, H_q, H_kv, L, D, dtype_bytes) and r[1] in want_methods]
    if not match:
        return [], None
    match.sort(key=lambda r: (not r[6], r[5] != "graph"))      # sweeps first, graph timings first
    best = match[0]
    pts = {}
    for _, _, sp, us, dev, timing, sweep in match:
        if (dev, timing, sweep) == best[4:]:
            pts[sp] = min(us, pts.get(sp, float("inf")))
    label = best[4] + ("" if best[5] == "graph" else f", {best[5]} timing")
    return sorted(pts.items()), label
