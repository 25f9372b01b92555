r"""The SM-occupancy explorer: how a decode launch's programs fill a GPU, and what that costs.

A split-KV decode launch runs

.. math:: P = B \cdot H \cdot \text{splits}, \qquad
          H = H_{kv}\ \text{(GQA packing)}\ \text{or}\ H_q\ \text{(one program per query head)}

programs. With ``r`` programs per SM and S SMs they run in :math:`\lceil P/(rS) \rceil` waves
(:func:`fdlib.occupancy.schedule`). With B = 1 and H_kv = 8, one split keeps 8 of an H200's 132 SMs busy
and the other 124 idle; cutting the KV sequence into splits multiplies the programs until every SM streams
its own slice. The two-stage method adds a second, small launch of B·H_q merge programs.

Three entry points, all drawing the same picture:

* :func:`summary` -- the numbers for one setting (programs, waves, utilization, busy SMs per wave,
  predicted µs), with a deterministic text form for checked notebook cells;
* :func:`draw` -- a static matplotlib Figure for one setting;
* :func:`explorer` -- the interactive widget (sliders, toggles, a PNG redrawn on every move, and on a
  GPU a button that times the real kernels).

Predicted times come from the cost model (:func:`fdlib.costmodel.explain`). Where that module is missing
the explorer uses a small built-in estimate and says so ("no cost model") on every plot and readout.
"""
from __future__ import annotations

import functools
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from . import gpus
from .kernels.config import MAX_SPLITS
from .occupancy import Schedule, programs_per_sm, schedule

COLUMNS = 12
"""SM tiles per row in the SM map."""

NUM_WARPS = 4


def gpu_tile(D: int, L: int, rows: int | None = None, dtype_bytes: int = 2):
    """The compiled kernels' tile (BLOCK_N keys, warps, stages) for head dim D, length L, B·H_kv rows and
    element size, as :func:`fdlib.kernels.config.tile_config_for` picks it on a GPU (the explorer models a
    GPU even on a CPU)."""
    from .kernels.config import tile_config_for
    return tile_config_for(D, L, compiled_mode=True, elem_bytes=dtype_bytes, rows=rows)


SPLIT_OPTIONS = (list(range(1, 17)) + list(range(18, 33, 2)) + list(range(36, 65, 4))
                 + list(range(72, 129, 8)) + list(range(144, 257, 16)))
"""The splits slider's stops: every count up to 16, then coarser (log-ish) steps up to 256."""

L_OPTIONS = [2 ** e for e in range(6, 21)]
B_OPTIONS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
H_Q_OPTIONS = [1, 2, 4, 8, 16, 28, 32, 40, 48, 64, 96, 128]
GROUP_OPTIONS = [1, 2, 4, 5, 7, 8, 16]

NO_COST_MODEL = "no cost model (simple built-in estimate)"


# ----------------------------------------------------------------------------------------------- GPUs
@functools.lru_cache(maxsize=1)
def _live() -> gpus.GPU | None:
    try:
        return gpus.live_gpu()
    except Exception:   # no torch / no driver: no live GPU
        return None


def gpu_choices() -> list[str]:
    """Names the GPU picker offers: the presets, then the live GPU when this process sees one."""
    names = list(gpus.PRESETS)
    live = _live()
    if live is not None:
        names.append(live.name)
    return names


def _gpu(gpu) -> gpus.GPU:
    if isinstance(gpu, gpus.GPU):
        return gpu
    live = _live()
    if live is not None and gpu in (live.name, "live"):
        return live
    if gpu in gpus.PRESETS:
        return gpus.PRESETS[gpu]
    raise ValueError(f"gpu: expected a fdlib.gpus.GPU or one of {gpu_choices()} (or 'live' on a GPU), got {gpu!r}")


# ----------------------------------------------------------------------------------------------- cost model
def _splits_used(L: int, splits: int, D: int = 128, rows: int | None = None, dtype_bytes: int = 2) -> int:
    """Splits the kernels really launch on a GPU: the planner's :func:`fdlib.plan.launched_splits`."""
    from .plan import launched_splits
    return launched_splits(L, splits, D, rows, dtype_bytes, compiled=True)


def _estimate_programs_per_sm(gpu: gpus.GPU, D: int, L: int, dtype_bytes: int, rows: int | None = None) -> int:
    """Programs of the compiled stage-1/unified kernel per SM: its warps, about 128 registers a thread,
    K and V tiles of BLOCK_N×D in num_stages pipeline buffers of shared memory."""
    t = gpu_tile(D, L, rows, dtype_bytes)
    d = max(16, 1 << (max(int(D), 1) - 1).bit_length())
    smem = t.num_stages * 2 * t.BLOCK_N * d * dtype_bytes
    return programs_per_sm(gpu, num_warps=t.num_warps, regs_per_thread=128, smem_bytes=smem)


def _simple_explain(B, H_q, H_kv, L, D, dtype_bytes, gpu, method):
    """A small stand-in for fdlib.costmodel.explain, used only when that is missing.

    Each wave streams its programs' KV bytes; a wave with n programs in flight moves at most
    min(BW, n·1.5·BW/S) bytes/s (one program cannot pull an SM's fair share of HBM by itself); a
    launch costs 4 µs; more than one split adds the partials (B·H_q·splits·(D+1) float32 written and
    read) and, for the two-stage method, a second launch.
    """
    bw = gpu.bandwidth_tbs * 1e12 * 0.93
    r = _estimate_programs_per_sm(gpu, D, L, dtype_bytes, B * H_kv)
    kv_bytes = 2.0 * B * H_kv * L * D * dtype_bytes
    seen, cands = set(), []
    for want in range(1, MAX_SPLITS + 1):
        s = _splits_used(L, want, D, B * H_kv, dtype_bytes)
        if s in seen:
            continue
        seen.add(s)
        P = B * H_kv * s
        sch = schedule(P, r, gpu.sms)
        per_prog = kv_bytes / P
        rate = lambda n: min(bw, n * 1.5 * bw / gpu.sms)          # noqa: E731
        t = (sch.waves - 1) * sch.slots * per_prog / rate(sch.slots) + sch.tail_programs * per_prog / rate(
            sch.tail_programs)
        t = t * 1e6 + 4.0
        if s > 1:
            t += 2 * 4.0 * B * H_q * s * (D + 1) / bw * 1e6 + 1.0
        if method == "split":
            t += 4.0 + 4.0 * B * H_q * s * (D + 1) / bw * 1e6
        cands.append(SimpleNamespace(splits=s, programs=P, waves=sch.waves, wave_efficiency=sch.wave_efficiency,
                                     time_us=t))
    best = min(cands, key=lambda c: c.time_us)
    return SimpleNamespace(chosen=best.splits, candidates=cands, programs_per_sm=r)


@functools.lru_cache(maxsize=512)
def _explain(B, H_q, H_kv, L, D, dtype_bytes, gpu: gpus.GPU, method: str):
    """(explanation, source): the cost model's, or the built-in estimate's with source NO_COST_MODEL."""
    try:
        from .costmodel import explain
    except Exception:
        explain = None
    if explain is not None:
        try:
            ex = explain(B=B, H_q=H_q, H_kv=H_kv, L=L, D=D, dtype_bytes=dtype_bytes, gpu=gpu, method=method)
            cands = sorted(ex.candidates, key=lambda c: int(c.splits))
            if cands:
                return SimpleNamespace(chosen=int(ex.chosen), candidates=cands,
                                       programs_per_sm=int(ex.programs_per_sm)), "cost model"
        except Exception as e:   # a cost model that fails must not take the explorer down
            return _simple_explain(B, H_q, H_kv, L, D, dtype_bytes, gpu, method), \
                f"{NO_COST_MODEL}; fdlib.costmodel failed: {type(e).__name__}"
    return _simple_explain(B, H_q, H_kv, L, D, dtype_bytes, gpu, method), NO_COST_MODEL


def _time_at(cands, splits: int) -> tuple[float, bool]:
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
    model: str                   # "cost model" or NO_COST_MODEL

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
        progs = f"{self.programs} = B {self.B} × {'H_kv ' + str(self.H_kv) if self.gqa else 'H_q ' + str(self.H_q)}" \
                f" × splits {self.splits_used}"
        if self.stage2_programs:
            progs += f" (+ stage 2: {self.stage2_programs} programs, {self.stage2_waves} wave" \
                     f"{'s' if self.stage2_waves != 1 else ''})"
        approx = "" if self.predicted_exact else " (interpolated)"
        return [
            f"model of {self.gpu}, {self.sms} SMs, {_per_sm(self.programs_per_sm)}; {self.mode}",
            f"shape: B={self.B} H_q={self.H_q} H_kv={self.H_kv} (group {self.group}) L={self.L} D={self.D} "
            f"dtype={self.dtype_bytes} bytes",
            f"splits: {split_txt}",
            f"programs: {progs}",
            f"waves: {self.waves} (tail wave: {self.tail_programs} programs), "
            f"wave efficiency {self.wave_efficiency:.1%}",
            f"busy SMs per wave: {self.busy_text()}",
            f"SM utilization: {self.utilization:.1%}",
            f"predicted time per decode step: {self.predicted_us:.1f} µs{approx} [{self.model}]",
            f"cost model's choice: {self.chosen_splits} splits, {self.chosen_us:.1f} µs",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle):   # IPython: the same text
        p.text(str(self))


def _check_shape(B, H_q, H_kv, L, splits, D, dtype_bytes):
    for name, v in (("B", B), ("H_q", H_q), ("H_kv", H_kv), ("L", L), ("splits", splits), ("D", D),
                    ("dtype_bytes", dtype_bytes)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    if H_q % H_kv:
        raise ValueError(f"H_q ({H_q}) must be a multiple of H_kv ({H_kv}): "
                         "group = H_q/H_kv query heads share a KV head")
    if splits > MAX_SPLITS:
        raise ValueError(f"splits: expected 1..{MAX_SPLITS}, got {splits}")


def _wave_rows(s: Schedule, waves: list[int]) -> list[np.ndarray]:
    """Programs per SM in the given (0-based) waves; round-robin like :func:`fdlib.occupancy.placement`."""
    rows = []
    for w in waves:
        n = s.slots if w < s.waves - 1 else s.tail_programs
        full, extra = divmod(n, s.sms)
        row = np.full(s.sms, full, dtype=int)
        row[:extra] += 1
        rows.append(row)
    return rows


def _summary_and_curve(B, H_q, H_kv, L, splits, gpu, gqa, unified, D, dtype_bytes):
    _check_shape(B, H_q, H_kv, L, splits, D, dtype_bytes)
    g = _gpu(gpu)
    heads = H_kv if gqa else H_q
    # One program per query head is the packed kernel with group 1: each query head streams its own KV copy.
    ex, source = _explain(int(B), int(H_q), int(heads), int(L), int(D), int(dtype_bytes), g,
                          "unified" if unified else "split")
    r = int(ex.programs_per_sm)
    used = _splits_used(L, splits, D, B * heads, dtype_bytes)
    P = B * heads * used
    s = schedule(P, r, g.sms)
    busy = tuple([g.sms] * (s.waves - 1) + [s.busy_sms_last_wave]) if s.waves else ()
    s2 = schedule(B * H_q, programs_per_sm(g, NUM_WARPS, 64, 0), g.sms) if not unified else None
    t, exact = _time_at(ex.candidates, used)
    chosen_t, _ = _time_at(ex.candidates, int(ex.chosen))
    summ = Summary(gpu=g.name, sms=g.sms, B=int(B), H_q=int(H_q), H_kv=int(H_kv), L=int(L), D=int(D),
                   dtype_bytes=int(dtype_bytes), gqa=bool(gqa), unified=bool(unified), splits=int(splits),
                   splits_used=used, block_n=gpu_tile(D, L, B * heads, dtype_bytes).BLOCK_N, programs=P, programs_per_sm=r, waves=s.waves,
                   tail_programs=s.tail_programs,
                   wave_efficiency=s.wave_efficiency, utilization=s.utilization, busy_sms_per_wave=busy,
                   stage2_programs=s2.programs if s2 else 0, stage2_waves=s2.waves if s2 else 0,
                   predicted_us=t, predicted_exact=exact, chosen_splits=int(ex.chosen), chosen_us=chosen_t,
                   model=source)
    return summ, s, ex


def summary(B: int, H_q: int, H_kv: int, L: int, splits: int, gpu="H200", gqa: bool = True, unified: bool = True,
            D: int = 128, dtype_bytes: int = 2) -> Summary:
    """The numbers of one setting: programs, waves, utilization, busy SMs per wave, predicted µs.

    >>> print(summary(B=1, H_q=32, H_kv=8, L=131072, splits=1).busy_text())
    8 of 132
    """
    return _summary_and_curve(B, H_q, H_kv, L, splits, gpu, gqa, unified, D, dtype_bytes)[0]


# ----------------------------------------------------------------------------------------------- recorded results
_GRAPH_KEYS = ("graph_us", "time_graph_us", "us_graph", "cuda_graph_us", "graph_time_us", "t_graph_us")
_ANY_US_KEYS = ("time_us", "us", "median_us", "mean_us", "eager_us", "t_us")
_ALIASES = {"B": ("B", "batch"), "H_q": ("H_q", "Hq", "h_q", "heads", "num_heads"),
            "H_kv": ("H_kv", "Hkv", "h_kv", "kv_heads", "num_kv_heads"), "L": ("L", "L_max", "seqlen", "kv_len"),
            "D": ("D", "head_dim"), "dtype": ("dtype",)}
_DTYPE_BYTES = {"float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4, "float": 4,
                "float8": 1, "fp8": 1}


def results_dir() -> Path:
    """Where committed benchmark results live: ``$FDLIB_RESULTS`` or the checkout's ``results/``."""
    return Path(os.environ.get("FDLIB_RESULTS", Path(__file__).resolve().parent.parent / "results"))


def _num(v):
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    if isinstance(v, dict):
        for k in ("median_us", "us", "time_us", "median", "mean_us"):
            if k in v:
                return _num(v[k])
    return None


def _graph_us(rec: dict):
    for k in _GRAPH_KEYS:
        if _num(rec.get(k)) is not None:
            return _num(rec[k])
    for k, v in rec.items():       # any other "...graph..." field holding µs
        if "graph" in str(k).lower() and _num(v) is not None and ("us" in str(k).lower() or isinstance(v, dict)):
            return _num(v)
    for k in _ANY_US_KEYS:
        if _num(rec.get(k)) is not None:
            return _num(rec[k])
    return None


def _shape_of(rec: dict, inherited: dict | None = None) -> dict:
    """B, H_q, H_kv, L, D, dtype of a record: its ``shape`` (list or dict), its own fields, or its parent's."""
    shape = rec.get("shape")
    out = {}
    if isinstance(shape, (list, tuple)) and len(shape) >= 5:
        out = dict(zip(("B", "H_q", "H_kv", "L", "D", "dtype"), shape))
    elif isinstance(shape, dict):
        out = {k: next((shape[a] for a in al if a in shape), None) for k, al in _ALIASES.items()}
    for k, al in _ALIASES.items():
        if out.get(k) is None:
            out[k] = next((rec[a] for a in al if a in rec), None)
        if out.get(k) is None and inherited:
            out[k] = inherited.get(k)
    return out


def _dtype_bytes(v):
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, str):
        return _DTYPE_BYTES.get(v.replace("torch.", "").lower())
    return None


def _device_in(d: dict):
    for k in ("device", "gpu", "device_name", "gpu_name"):
        if isinstance(d.get(k), str):
            return d[k]
    return None


def _records(obj, ctx: dict):
    """Every dict in ``obj`` that has a split count, with what its ancestors say: the device, the method,
    the timing (graph/eager) and the shape (a sweep row holds the shape, its points the splits)."""
    if isinstance(obj, dict):
        ctx = dict(ctx)
        for holder in (obj, obj.get("provenance"), obj.get("meta"), obj.get("env")):
            if isinstance(holder, dict) and _device_in(holder):
                ctx["device"] = _device_in(holder)
        for holder in (obj, obj.get("settings")):
            if isinstance(holder, dict):
                for k in ("method", "timing"):
                    if isinstance(holder.get(k), str):
                        ctx[k] = holder[k]
        shp = _shape_of(obj, ctx.get("shape"))
        if all(shp.get(k) is not None for k in ("B", "H_q", "H_kv", "L")):
            ctx["shape"] = shp
        if "splits" in obj or "num_splits" in obj:
            yield obj, ctx
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and k not in ("chosen", "best", "settings", "provenance"):
                yield from _records(v, ctx)
    elif isinstance(obj, list):
        for v in obj:
            yield from _records(v, ctx)


@functools.lru_cache(maxsize=8)
def _load_results(root: str, stamp: tuple) -> tuple:
    """All (shape key, method, splits, µs, device, timing, from a sweep?) records under ``root``;
    ``stamp`` (paths and mtimes) invalidates the cache when files change."""
    out = []
    for path in sorted(Path(root).rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except Exception:
            continue
        sweep = isinstance(data, dict) and data.get("kind") == "sweep"
        for rec, ctx in _records(data, {}):
            try:
                sp = rec.get("splits", rec.get("num_splits"))
                if not isinstance(sp, (int, float)) or isinstance(sp, bool) or sp < 1 or sp != int(sp):
                    continue
                if rec.get("status", "ok") not in ("ok", "pass", "passed"):
                    continue
                if "BLOCK_N" in rec:          # a tile-tuning experiment, not the kernel as shipped
                    continue
                us = _graph_us(rec)
                shp = _shape_of(rec, ctx.get("shape"))
                if us is None or us <= 0 or any(shp.get(k) is None for k in ("B", "H_q", "H_kv", "L")):
                    continue
                key = tuple(int(shp[k]) for k in ("B", "H_q", "H_kv", "L")) + (
                    int(shp["D"]) if shp.get("D") is not None else None, _dtype_bytes(shp.get("dtype")))
                timing = "graph" if any(_num(rec.get(k)) is not None for k in _GRAPH_KEYS) else \
                    str(ctx.get("timing", "") or "")
                out.append((key, str(rec.get("method", ctx.get("method", ""))), int(sp), float(us),
                            str(ctx.get("device", "a GPU")), timing, sweep))
            except Exception:
                continue
    return tuple(out)


def recorded(B, H_q, H_kv, L, D=128, dtype_bytes=2, unified=True) -> tuple[list[tuple[int, float]], str | None]:
    """Committed benchmark results for this shape: ([(splits, µs)], device) or ([], None) when none match.

    Reads every ``*.json`` under :func:`results_dir` defensively; prefers ``python -m fdlib.bench
    --sweep-splits`` files (``"kind": "sweep"``) and CUDA-graph times; one device only.
    """
    root = results_dir()
    if not root.is_dir():
        return [], None
    try:
        stamp = tuple((str(p), p.stat().st_mtime_ns) for p in sorted(root.rglob("*.json")))
    except OSError:
        return [], None
    want_methods = ("unified", "auto", "") if unified else ("split", "two-stage", "two_stage")
    match = [r for r in _load_results(str(root), stamp)
             if r[0][:4] == (B, H_q, H_kv, L) and (r[0][4] is None or r[0][4] == D)
             and (r[0][5] is None or r[0][5] == dtype_bytes) and r[1].lower() in want_methods]
    if not match:
        return [], None
    match.sort(key=lambda r: (not r[6], r[5] != "graph"))      # sweeps first, graph timings first
    best = match[0]
    pts = {}
    for _, _, sp, us, dev, timing, sweep in match:
        if (dev, timing, sweep) == best[4:]:
            pts[sp] = min(us, pts.get(sp, float("inf")))
    label = best[4] + ("" if best[5] == "graph" else f", {best[5] or 'untimed kind'} timing")
    return sorted(pts.items()), label


def _per_sm(r: int) -> str:
    return f"{r} program{'s' if r != 1 else ''}/SM"


# ----------------------------------------------------------------------------------------------- the figure
_IDLE = "#e4e4e4"
_BUSY = "#1b7837"


_TILE_PX = 6


def _tiles(a: np.ndarray) -> np.ndarray:
    """Each cell of ``a`` as a _TILE_PX-pixel square with a one-pixel NaN (white) border on its right and bottom."""
    big = np.repeat(np.repeat(a.astype(float), _TILE_PX, axis=0), _TILE_PX, axis=1)
    big[_TILE_PX - 1::_TILE_PX, :] = np.nan
    big[:, _TILE_PX - 1::_TILE_PX] = np.nan
    return big


class _Canvas:
    """One figure and its artists; :meth:`update` changes data, colours and text in place."""

    FIGSIZE = (10.0, 6.4)

    def __init__(self, figure=None, dpi=80):
        import matplotlib
        from matplotlib.colors import LinearSegmentedColormap
        from matplotlib.figure import Figure

        self.fig = figure if figure is not None else Figure(figsize=self.FIGSIZE, dpi=dpi)
        if self.fig.canvas is None or type(self.fig.canvas).__name__ == "FigureCanvasBase":
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            FigureCanvasAgg(self.fig)
        gs = self.fig.add_gridspec(2, 3, height_ratios=[1.0, 1.15], hspace=0.45, wspace=0.12,
                                   left=0.08, right=0.97, top=0.86, bottom=0.09)
        curve_gs = gs[1, :].subgridspec(1, 2, width_ratios=[2.3, 1.0], wspace=0.02)  # curve | its legend
        self.cmap = LinearSegmentedColormap.from_list("sm", [_IDLE, "#a6dba0", _BUSY]).with_extremes(bad="white")
        self.maps, self.images = [], []
        for i in range(3):
            ax = self.fig.add_subplot(gs[0, i])
            im = ax.imshow(np.zeros((1, COLUMNS)), cmap=self.cmap, vmin=0, vmax=1, interpolation="nearest",
                           aspect="equal")
            ax.set_axis_off()     # no ticks to lay out: tiles are separated by white pixels in the image itself
            self.maps.append(ax)
            self.images.append(im)
        self.maps[0].text(-0.04, 0.5, f"SMs ({COLUMNS} per row)", rotation=90, ha="right", va="center",
                          transform=self.maps[0].transAxes, fontsize=9)
        self.empty = [ax.text(0.5, 0.5, "", ha="center", va="center", transform=ax.transAxes, fontsize=10,
                              color="0.4") for ax in self.maps]
        self.cbar = self.fig.colorbar(self.images[0], ax=self.maps, location="right", fraction=0.025, pad=0.01)
        self.cbar.set_label("programs on the SM", fontsize=8)
        self.cbar.ax.tick_params(labelsize=7)
        self._shape = None

        ax = self.curve_ax = self.fig.add_subplot(curve_gs[0, 0])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("splits (KV sequence cut into this many slices)")
        ax.set_ylabel("time per decode step (µs)")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlim(0.8, MAX_SPLITS * 1.25)
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)

        def minor(v, _):   # label every minor tick on a narrow range, only 2·10^k and 5·10^k on a wide one
            lo, hi = ax.get_ylim()
            return f"{v:g}" if hi / max(lo, 1e-30) < 12 or f"{v:.0e}"[0] in "25" else ""
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(minor))
        (self.model_line,) = ax.plot([], [], "-", color="#2166ac", lw=1.5, label="predicted")
        (self.chosen_pt,) = ax.plot([], [], "*", color="#d6604d", ms=15, label="cost model's choice")
        (self.current_pt,) = ax.plot([], [], "o", mfc="none", mec="black", ms=11, mew=1.8, label="this setting")
        self.current_line = ax.axvline(1, color="black", lw=0.8, ls=":")
        (self.measured_pts,) = ax.plot([], [], "D", color="#e08214", ms=6, label="measured")
        (self.recorded_pts,) = ax.plot([], [], "s", color="#762a83", ms=6, mfc="none", mew=1.5, label="recorded")
        self.legend = None
        self.suptitle = self.fig.suptitle("", fontsize=11)
        self.subtitle = self.fig.text(0.5, 0.905, "", ha="center", fontsize=9, color="0.25")

    def _set_grid_shape(self, sms: int):
        rows = -(-sms // COLUMNS)
        if self._shape == (rows, COLUMNS):
            return
        self._shape = (rows, COLUMNS)
        for ax, im in zip(self.maps, self.images):
            im.set_extent((-0.5, COLUMNS - 0.5, rows - 0.5, -0.5))
            ax.set_xlim(-0.5, COLUMNS - 0.5)
            ax.set_ylim(rows - 0.5, -0.5)

    def update(self, summ: Summary, sched: Schedule, ex, measured=(), recorded_pts=(), recorded_device=None,
               measured_label="measured on this GPU"):
        sms, r = summ.sms, summ.programs_per_sm
        self._set_grid_shape(sms)
        rows = self._shape[0]
        if sched.waves <= 3:
            waves = list(range(sched.waves))
        else:
            waves = [0, 1, sched.waves - 1]
        grids = _wave_rows(sched, waves)
        for i, ax in enumerate(self.maps):
            im = self.images[i]
            im.set_clim(0, r)
            if i < len(waves):
                w = waves[i]
                a = np.full(rows * COLUMNS, np.nan)
                a[:sms] = grids[i]
                im.set_data(_tiles(a.reshape(rows, COLUMNS)))
                im.set_visible(True)
                busy = int((grids[i] > 0).sum())
                tail = " (tail)" if w == sched.waves - 1 and sched.waves > 1 else ""
                ax.set_title(f"wave {w + 1} of {sched.waves}{tail}: {busy}/{sms} SMs busy", fontsize=9)
                self.empty[i].set_text("")
            else:
                im.set_visible(False)
                ax.set_title("", fontsize=9)
                self.empty[i].set_text(f"no wave {i + 1}\n(the launch has {sched.waves})")
        self.cbar.set_ticks(sorted({0, r} | ({r // 2} if r > 3 else set(range(r + 1)))))
        if len(waves) < sched.waves:
            self.maps[1].set_title(self.maps[1].get_title() + f"  …  {sched.waves - 3} more", fontsize=9)

        xs = [int(c.splits) for c in ex.candidates]
        ts = [float(c.time_us) for c in ex.candidates]
        self.model_line.set_data(xs, ts)
        self.model_line.set_label(f"predicted ({summ.model})")
        self.chosen_pt.set_data([summ.chosen_splits], [summ.chosen_us])
        self.chosen_pt.set_label(f"cost model's choice: {summ.chosen_splits} splits, {summ.chosen_us:.1f} µs"
                                 if summ.model == "cost model" else
                                 f"estimate's minimum: {summ.chosen_splits} splits, {summ.chosen_us:.1f} µs")
        self.current_pt.set_data([summ.splits_used], [summ.predicted_us])
        self.current_pt.set_label(f"this setting: {summ.splits_used} split{'s' if summ.splits_used != 1 else ''}, "
                                  f"{summ.predicted_us:.1f} µs")
        self.current_line.set_xdata([summ.splits_used, summ.splits_used])
        m = list(measured)
        self.measured_pts.set_data([p[0] for p in m], [p[1] for p in m])
        self.measured_pts.set_label(measured_label)
        self.measured_pts.set_visible(bool(m))
        rp = list(recorded_pts)
        self.recorded_pts.set_data([p[0] for p in rp], [p[1] for p in rp])
        self.recorded_pts.set_label(f"recorded on {recorded_device} (same shape)")
        self.recorded_pts.set_visible(bool(rp))
        ally = ts + [p[1] for p in m] + [p[1] for p in rp]
        lo, hi = min(ally), max(ally)
        self.curve_ax.set_ylim(lo / 1.4, hi * 1.4)
        handles = [self.model_line, self.chosen_pt, self.current_pt] + ([self.measured_pts] if m else []) + \
                  ([self.recorded_pts] if rp else [])
        if self.legend is not None:
            self.legend.remove()
        self.legend = self.curve_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                                           fontsize=8, frameon=False, borderaxespad=0.0)   # beside the data
        mode = "two-stage" if not summ.unified else "unified"
        self.curve_ax.set_title(f"Time per decode step vs splits ({mode}, B={summ.B}, H_q={summ.H_q}, "
                                f"H_kv={summ.H_kv}, L={summ.L}, D={summ.D})", fontsize=10)
        self.suptitle.set_text(f"SM occupancy: model of {summ.gpu}, {sms} SMs, {_per_sm(r)} — "
                               f"{summ.programs} programs in {summ.waves} wave{'s' if summ.waves != 1 else ''}, "
                               f"{summ.utilization:.0%} of SMs busy")
        self.subtitle.set_text(f"{summ.mode}; splits {summ.splits_used}; "
                               f"predicted {summ.predicted_us:.1f} µs [{summ.model}]")
        return self.fig

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.fig.canvas.print_png(buf)
        return buf.getvalue()


def draw(B: int, H_q: int, H_kv: int, L: int, splits: int, gpu="H200", gqa: bool = True, unified: bool = True,
         D: int = 128, dtype_bytes: int = 2):
    """The explorer's picture for one setting, as a matplotlib Figure (SM maps of the first waves and the
    tail wave, and predicted time vs splits with the cost model's choice and any recorded results)."""
    import matplotlib.pyplot as plt
    summ, sched, ex = _summary_and_curve(B, H_q, H_kv, L, splits, gpu, gqa, unified, D, dtype_bytes)
    fig = plt.figure(figsize=_Canvas.FIGSIZE, dpi=100)
    plt.close(fig)   # returned, not auto-shown: a cell ending in draw(...) shows it once
    canvas = _Canvas(fig)
    rp, dev = ([], None) if not gqa else \
        recorded(summ.B, summ.H_q, summ.H_kv, summ.L, summ.D, summ.dtype_bytes, summ.unified)
    return canvas.update(summ, sched, ex, recorded_pts=rp, recorded_device=dev)


# ----------------------------------------------------------------------------------------------- measurement
def measure(B, H_q, H_kv, L, splits_list, D=128, dtype_bytes=2, unified=True, warmup=5, rep=30):
    """Time ``fdlib.decode_attention`` on this GPU at each split count (triton.testing.do_bench, L2 flushed
    by do_bench between runs): [(splits, µs)]."""
    import torch
    import triton

    import fdlib
    if fdlib.runtime.MODE != "gpu":
        raise RuntimeError("measure: needs a CUDA GPU (fdlib is running in Triton's interpreter)")
    dtype = {2: torch.float16, 4: torch.float32}.get(dtype_bytes)   # fp16, as the recorded sweeps
    if dtype is None:
        raise ValueError(f"measure: dtype_bytes must be 2 (float16) or 4 (float32), got {dtype_bytes}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H_q, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, L, H_kv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, L, H_kv, D, device="cuda", dtype=dtype, generator=g)
    method = "unified" if unified else "split"
    out = []
    for s in splits_list:
        fn = lambda: fdlib.decode_attention(q, k, v, method=method, num_splits=int(s))  # noqa: E731
        fn()
        out.append((_splits_used(L, s, D, B * H_kv, dtype_bytes), float(triton.testing.do_bench(fn, warmup=warmup, rep=rep)) * 1e3))
    del q, k, v
    torch.cuda.empty_cache()
    return sorted(dict(out).items())


# ----------------------------------------------------------------------------------------------- the widget
def _pow2_label(v: int) -> str:
    for unit, n in (("Mi", 2 ** 20), ("Ki", 2 ** 10)):
        if v >= n and v % n == 0:
            return f"{v // n} {unit}"
    return str(v)


def _with(options, value):
    return sorted(set(options) | {value})


def _make_explorer_class():
    import ipywidgets as W

    class Explorer(W.VBox):
        """The SM-occupancy explorer. ``controls``: the input widgets by name; ``readout``: the numbers
        (HTML); ``image``: the picture (PNG); ``summary``: the current :class:`Summary`."""

        def __init__(self, B=1, H_q=32, H_kv=None, L=131072, splits=1, gpu="H200", gqa=True, unified=True,
                     D=128, dtype_bytes=2, group=None):
            if H_kv is None:
                H_kv = H_q // (group or 4) if H_q % (group or 4) == 0 else H_q
            self.D, self.dtype_bytes = int(D), int(dtype_bytes)
            g = _gpu(gpu)
            _check_shape(B, H_q, H_kv, L, splits, D, dtype_bytes)
            grp = H_q // H_kv
            style = {"description_width": "110px"}
            lay = W.Layout(width="420px")
            tstyle = {"description_width": "110px", "button_width": "auto"}
            c = self.controls = {
                "B": W.SelectionSlider(options=_with(B_OPTIONS, B), value=B, description="batch B", style=style,
                                       layout=lay),
                "H_q": W.SelectionSlider(options=_with(H_Q_OPTIONS, H_q), value=H_q, description="query heads H_q",
                                         style=style, layout=lay),
                "group": W.SelectionSlider(options=_with(GROUP_OPTIONS, grp), value=grp,
                                           description="group H_q/H_kv", style=style, layout=lay),
                "L": W.SelectionSlider(options=[(_pow2_label(v), v) for v in _with(L_OPTIONS, L)], value=L,
                                       description="KV length L", style=style, layout=lay),
                "splits": W.SelectionSlider(options=_with(SPLIT_OPTIONS, splits), value=splits,
                                            description="splits", style=style, layout=lay),
                "gpu": W.Dropdown(options=_with_gpu(g.name), value=g.name, description="GPU", style=style,
                                  layout=lay),
                "gqa": W.ToggleButtons(options=[("GQA packing", True), ("one program per query head", False)],
                                       value=bool(gqa), description="programs", style=tstyle),
                "unified": W.ToggleButtons(options=[("unified", True), ("two-stage", False)], value=bool(unified),
                                           description="kernel", style=tstyle),
            }
            self._gpu_obj = {g.name: g}
            self.readout = W.HTML(layout=W.Layout(width="480px"))
            self.image = W.Image(format="png", layout=W.Layout(width="800px"))
            self.image.add_class("fdlib-explorer-image")
            self.readout.add_class("fdlib-explorer-readout")
            self._canvas = _Canvas(dpi=80)
            self._measured: dict = {}
            self.last_redraw_s = 0.0
            self.summary: Summary | None = None
            self.button = W.Button(description="Measure on this GPU", icon="bolt",
                                   layout=W.Layout(width="auto", min_width="200px"),
                                   tooltip="time fdlib.decode_attention at several split counts (do_bench)")
            self.status = W.HTML()
            self.button.on_click(self._on_measure)
            live = _live()
            import fdlib
            can_measure = live is not None and fdlib.runtime.MODE == "gpu"
            if not can_measure:
                self.button.disabled = True
                self.button.tooltip = "no CUDA GPU here: recorded results (if any) are overlaid instead"
                self.status.value = ("<i>needs a CUDA GPU; kernels here run in Triton's interpreter on the CPU, "
                                     "so recorded results are shown instead</i>")
            for w in c.values():
                w.observe(self._on_change, names="value")
            left = W.VBox([*c.values(), self.button, self.status], layout=W.Layout(width="440px"))
            super().__init__([W.HBox([left, self.readout]), self.image])
            self.add_class("fdlib-explorer")
            self.update()

        # ---- state
        def setting(self) -> dict:
            c = self.controls
            H_q, grp = c["H_q"].value, c["group"].value
            return dict(B=c["B"].value, H_q=H_q, H_kv=H_q // grp if H_q % grp == 0 else None, L=c["L"].value,
                        splits=c["splits"].value, gpu=self._gpu_obj.get(c["gpu"].value, c["gpu"].value),
                        gqa=c["gqa"].value, unified=c["unified"].value, D=self.D, dtype_bytes=self.dtype_bytes)

        def _on_change(self, change):
            self.update()

        def update(self):
            """Recompute and redraw (one figure reused; only data, colours and text change)."""
            t0 = time.perf_counter()
            st = self.setting()
            if st["H_kv"] is None:
                self.readout.value = (f"<b style='color:#b2182b'>H_q = {st['H_q']} is not a multiple of the group "
                                      f"size {self.controls['group'].value}</b>: pick another H_q or group.")
                return
            summ, sched, ex = _summary_and_curve(**st)
            self.summary = summ
            key = (summ.gpu, summ.B, summ.H_q, summ.H_kv, summ.L, summ.D, summ.dtype_bytes, summ.unified)
            measured = self._measured.get(key, []) if summ.gqa else []
            rp, dev = recorded(summ.B, summ.H_q, summ.H_kv, summ.L, summ.D, summ.dtype_bytes, summ.unified) \
                if summ.gqa else ([], None)
            self._canvas.update(summ, sched, ex, measured=measured, recorded_pts=rp, recorded_device=dev,
                                measured_label=f"measured on {summ.gpu}")
            self.image.value = self._canvas.png()
            self.readout.value = self._html(summ, rp, dev)
            self.last_redraw_s = time.perf_counter() - t0

        @staticmethod
        def _html(summ: Summary, rp, dev) -> str:
            import html
            rows = summ.lines()
            util = (f"<div class='fdlib-util' style='font-size:1.15em'><b>SM utilization: {summ.utilization:.1%}"
                    f"</b> — busy SMs: {html.escape(summ.busy_text())}; {summ.waves} wave"
                    f"{'s' if summ.waves != 1 else ''}</div>")
            body = "<br>".join(html.escape(r) for r in rows)
            extra = ""
            if rp:
                counts = ", ".join(str(s) for s, _ in rp)
                extra = (f"<br><i>squares in the plot: µs per decode step recorded on {html.escape(dev)} for this "
                         f"shape, at {len(rp)} split count{'s' if len(rp) != 1 else ''} ({counts})</i>")
            return f"{util}<div style='font-family:monospace;font-size:0.85em;line-height:1.35'>{body}{extra}</div>"

        def _on_measure(self, _btn=None):
            st = self.setting()
            if st["H_kv"] is None:
                return
            if not st["gqa"]:
                self.status.value = "the kernels always pack GQA: switch to GQA packing to measure"
                return
            self.button.disabled = True
            self.status.value = "measuring…"
            try:
                L = st["L"]
                D = self.D
                rows, nbytes = st["B"] * st["H_kv"], self.dtype_bytes
                todo = sorted({_splits_used(L, s, D, rows, nbytes) for s in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
                              | {_splits_used(L, st["splits"], D, rows, nbytes), self.summary.chosen_splits})
                pts = measure(st["B"], st["H_q"], st["H_kv"], L, todo, D=self.D, dtype_bytes=self.dtype_bytes,
                              unified=st["unified"])
                s = self.summary
                self._measured[(s.gpu, s.B, s.H_q, s.H_kv, s.L, s.D, s.dtype_bytes, s.unified)] = pts
                self.status.value = f"measured {len(pts)} split counts"
            except Exception as e:
                self.status.value = f"<span style='color:#b2182b'>measurement failed: {type(e).__name__}: {e}</span>"
            finally:
                self.button.disabled = False
            self.update()

    return Explorer


def _with_gpu(name: str) -> list[str]:
    names = gpu_choices()
    return names if name in names else names + [name]


_EXPLORER_CLS = None


def explorer(**defaults):
    """The interactive SM-occupancy explorer (an ipywidgets VBox; display it or end a cell with it).

    Keyword defaults: ``B, H_q, H_kv`` (or ``group``), ``L, splits, gpu`` (preset name, ``"live"``, or a
    :class:`fdlib.gpus.GPU`), ``gqa, unified, D, dtype_bytes``.
    """
    global _EXPLORER_CLS
    if _EXPLORER_CLS is None:
        _EXPLORER_CLS = _make_explorer_class()
    return _EXPLORER_CLS(**defaults)
