r"""The SM-occupancy explorer: how a decode launch's programs fill a GPU, and what that costs, drawn.

A split-KV decode launch runs :math:`P = B \cdot H \cdot \text{splits}` programs (H = H_kv with GQA
packing, H_q with one program per query head) in :math:`\lceil P/(rS) \rceil` waves over S SMs with r
programs each; :mod:`fdlib.course.explorer_model` computes those numbers and the cost model's time per decode step.
This module draws them:

* :func:`summary` -- the numbers for one setting (:func:`fdlib.course.explorer_model.summary`), with a
  deterministic text form for checked notebook cells;
* :func:`draw` -- a static matplotlib Figure for one setting: SM maps of the first waves and the tail wave,
  and predicted time vs splits with the cost model's choice and any recorded results;
* :func:`explorer` -- the interactive widget (sliders, toggles, a length histogram: constant, uniform or
  Zipf-like lengths of mean L, a PNG redrawn on every move, and on a GPU a button that times the real kernels,
  :func:`measure`). For a ragged histogram the readout adds the balanced schedule next to the split one; for two
  or more sequences, the stream-K launch that ``decode_attention`` runs with the lengths on the device.
"""
from __future__ import annotations

import io
import time

import numpy as np

from .. import gpus, runtime
from .explorer_model import (Summary, check_shape, per_sm_text, ragged_lengths, recorded,  # noqa: F401
                             results_dir, splits_used, summary, summary_and_curve, wave_rows)
from ..kernels.config import MAX_SPLITS
from ..occupancy import Schedule

__all__ = ["explorer", "draw", "measure", "summary", "Summary", "recorded", "results_dir", "SPLIT_OPTIONS"]

COLUMNS = 12
"""SM tiles per row in the SM map."""

SPLIT_OPTIONS = (list(range(1, 17)) + list(range(18, 33, 2)) + list(range(36, 65, 4))
                 + list(range(72, 129, 8)) + list(range(144, 257, 16)))
"""The splits slider's stops: every count up to 16, then coarser (log-ish) steps up to 256."""

L_OPTIONS = [2 ** e for e in range(6, 21)]
B_OPTIONS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
H_Q_OPTIONS = [1, 2, 4, 8, 16, 28, 32, 40, 48, 64, 96, 128]
GROUP_OPTIONS = [1, 2, 4, 5, 7, 8, 16]
Q_LEN_OPTIONS = [1, 2, 4, 8, 16]   # query tokens per sequence (speculative decoding: the draft tokens)
DIST_OPTIONS = [("constant: every row L", "constant"), ("uniform in [1, 2L]", "uniform"),
                ("Zipf-like: most short, a few long (mean L)", "zipf")]
"""The length histogram's choices (L is the mean; :func:`fdlib.course.explorer_model.ragged_lengths`)."""


# ----------------------------------------------------------------------------------------------- the figure
_IDLE = "#e4e4e4"
_BUSY = "#1b7837"


_TILE_PX = 6
_MAP_TITLE = dict(fontsize=9, pad=9)
"""A wave's title: clear of its squares (pad in points) and of the subtitle above."""


def _tiles(a: np.ndarray) -> np.ndarray:
    """Each cell of ``a`` as a _TILE_PX-pixel square with a one-pixel NaN (white) border on its right and bottom."""
    big = np.repeat(np.repeat(a.astype(float), _TILE_PX, axis=0), _TILE_PX, axis=1)
    big[_TILE_PX - 1::_TILE_PX, :] = np.nan
    big[:, _TILE_PX - 1::_TILE_PX] = np.nan
    return big


class _Canvas:
    """One figure and its artists; :meth:`update` changes data, colours and text in place."""

    FIGSIZE = (10.0, 6.8)

    def __init__(self, figure=None, dpi=80):
        import matplotlib
        from matplotlib.colors import LinearSegmentedColormap
        from matplotlib.figure import Figure

        # the margins below are the layout: no layout engine (the course style turns constrained layout on,
        # which would move the axes up under the subtitle and cut the labels at the figure's edges)
        self.fig = figure if figure is not None else Figure(figsize=self.FIGSIZE, dpi=dpi, layout="none")
        self.fig.set_layout_engine("none")
        if self.fig.canvas is None or type(self.fig.canvas).__name__ == "FigureCanvasBase":
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            FigureCanvasAgg(self.fig)
        gs = self.fig.add_gridspec(2, 3, height_ratios=[1.0, 1.15], hspace=0.45, wspace=0.12,
                                   left=0.08, right=0.97, top=0.85, bottom=0.085)
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
        self.map_label = self.maps[0].text(-0.04, 0.5, f"SMs ({COLUMNS} per row)", rotation=90, ha="right", va="center",
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
        self.subtitle = self.fig.text(0.5, 0.925, "", ha="center", fontsize=9, color="0.25")

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
        grids = wave_rows(sched, waves)
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
                ax.set_title(f"wave {w + 1} of {sched.waves}{tail}: {busy}/{sms} SMs busy", **_MAP_TITLE)
                self.empty[i].set_text("")
            else:
                im.set_visible(False)
                ax.set_title("", **_MAP_TITLE)
                self.empty[i].set_text(f"no wave {i + 1}\n(the launch has {sched.waves})")
        self.cbar.set_ticks(sorted({0, r} | ({r // 2} if r > 3 else set(range(r + 1)))))
        if len(waves) < sched.waves:
            self.maps[1].set_title(self.maps[1].get_title() + f"  …  {sched.waves - 3} more", **_MAP_TITLE)

        xs = [int(c.splits) for c in ex.candidates]
        ts = [float(c.time_us) for c in ex.candidates]
        self.model_line.set_data(xs, ts)
        self.model_line.set_label("predicted (cost model)")
        self.chosen_pt.set_data([summ.chosen_splits], [summ.chosen_us])
        self.chosen_pt.set_label(f"cost model's choice: {summ.chosen_splits} split{'s' if summ.chosen_splits != 1 else ''}, "
                                 f"{summ.chosen_us:.1f} µs")
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
                                f"H_kv={summ.H_kv}, L={summ.L}, D={summ.D}"
                                + (f", q_len={summ.q_len}" if summ.q_len > 1 else "") + ")", fontsize=10)
        self.suptitle.set_text(f"SM occupancy: model of {summ.gpu}, {sms} SMs, {per_sm_text(r)} — "
                               f"{summ.programs} programs in {summ.waves} wave{'s' if summ.waves != 1 else ''}, "
                               f"{summ.utilization:.0%} of SMs busy")
        self.subtitle.set_text(f"{summ.mode}; splits {summ.splits_used}; "
                               f"predicted {summ.predicted_us:.1f} µs [cost model]")
        return self.fig

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.fig.canvas.print_png(buf)
        return buf.getvalue()


def draw(B: int, H_q: int, H_kv: int, L: int, splits: int, gpu="H200", gqa: bool = True, unified: bool = True,
         D: int = 128, dtype_bytes: int = 2, dist: str = "constant", q_len: int = 1):
    """The explorer's picture for one setting, as a matplotlib Figure (SM maps of the first waves and the
    tail wave, and predicted time vs splits with the cost model's choice and any recorded results)."""
    import matplotlib.pyplot as plt
    summ, sched, ex = summary_and_curve(B, H_q, H_kv, L, splits, gpu, gqa, unified, D, dtype_bytes, dist,
                                        q_len=q_len)
    fig = plt.figure(figsize=_Canvas.FIGSIZE, dpi=100, layout="none")
    plt.close(fig)   # returned, not auto-shown: a cell ending in draw(...) shows it once
    canvas = _Canvas(fig)
    rp, dev = recorded(summ.B, summ.H_q, summ.H_kv, summ.L, summ.D, summ.dtype_bytes, summ.unified) \
        if comparable(summ) else ([], None)
    return canvas.update(summ, sched, ex, recorded_pts=rp, recorded_device=dev)


def comparable(summ: Summary) -> bool:
    """Recorded and measured timings are of the packed kernel on equal-length rows and one query token: they
    are drawn beside the model only for such a setting."""
    return summ.gqa and summ.dist == "constant" and summ.q_len == 1


# ----------------------------------------------------------------------------------------------- measurement
def measure(B, H_q, H_kv, L, splits_list, D=128, dtype_bytes=2, unified=True, warmup=5, rep=30):
    """Time ``fdlib.decode_attention`` on this GPU at each split count (triton.testing.do_bench, L2 flushed
    by do_bench between runs): [(splits, µs)]."""
    import torch
    import triton

    import fdlib
    if runtime.MODE != "gpu":
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
        out.append((splits_used(L, s, D, B * H_kv, dtype_bytes), float(triton.testing.do_bench(fn, warmup=warmup, rep=rep)) * 1e3))
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
                     D=128, dtype_bytes=2, group=None, dist="constant", q_len=1):
            if H_kv is None:
                H_kv = H_q // (group or 4) if H_q % (group or 4) == 0 else H_q
            self.D, self.dtype_bytes = int(D), int(dtype_bytes)
            g = gpus.resolve(gpu)
            check_shape(B, H_q, H_kv, L, splits, D, dtype_bytes)
            ragged_lengths(dist, 1, 1)          # ValueError naming dist unless it is one of the histograms
            grp = H_q // H_kv
            style = {"description_width": "135px"}    # the longest label, "query tokens q_len", whole
            lay = W.Layout(width="405px")
            tstyle = {"description_width": "135px", "button_width": "auto"}
            c = self.controls = {
                "B": W.SelectionSlider(options=_with(B_OPTIONS, B), value=B, description="batch B", style=style,
                                       layout=lay),
                "H_q": W.SelectionSlider(options=_with(H_Q_OPTIONS, H_q), value=H_q, description="query heads H_q",
                                         style=style, layout=lay),
                "group": W.SelectionSlider(options=_with(GROUP_OPTIONS, grp), value=grp,
                                           description="group H_q/H_kv", style=style, layout=lay),
                "L": W.SelectionSlider(options=[(_pow2_label(v), v) for v in _with(L_OPTIONS, L)], value=L,
                                       description="KV length L", style=style, layout=lay),
                "dist": W.Dropdown(options=DIST_OPTIONS, value=dist,
                                   description="lengths", style=style, layout=lay),
                "q_len": W.SelectionSlider(options=_with(Q_LEN_OPTIONS, q_len), value=q_len,
                                           description="query tokens q_len", style=style, layout=lay),
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
            self.readout = W.HTML(layout=W.Layout(width="425px"))
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
            if runtime.MODE != "gpu":   # compiled kernels on the live GPU, or nothing to time
                self.button.disabled = True
                self.button.tooltip = "no CUDA GPU here: recorded results (if any) are overlaid instead"
                self.status.value = ("<i>needs a CUDA GPU; kernels here run in Triton's interpreter on the CPU, "
                                     "so recorded results are shown instead</i>")
            for w in c.values():
                w.observe(self._on_change, names="value")
            left = W.VBox([*c.values(), self.button, self.status], layout=W.Layout(width="420px"))
            # in a narrow window the readout goes under the controls instead of squeezing them
            super().__init__([W.HBox([left, self.readout], layout=W.Layout(flex_flow="row wrap")), self.image])
            self.add_class("fdlib-explorer")
            self.update()

        # ---- state
        def setting(self) -> dict:
            c = self.controls
            H_q, grp = c["H_q"].value, c["group"].value
            return dict(B=c["B"].value, H_q=H_q, H_kv=H_q // grp if H_q % grp == 0 else None, L=c["L"].value,
                        splits=c["splits"].value, gpu=self._gpu_obj.get(c["gpu"].value, c["gpu"].value),
                        gqa=c["gqa"].value, unified=c["unified"].value, D=self.D, dtype_bytes=self.dtype_bytes,
                        dist=c["dist"].value, q_len=c["q_len"].value)

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
            summ, sched, ex = summary_and_curve(**st)
            self.summary = summ
            key = (summ.gpu, summ.B, summ.H_q, summ.H_kv, summ.L, summ.D, summ.dtype_bytes, summ.unified)
            measured = self._measured.get(key, []) if comparable(summ) else []
            rp, dev = recorded(summ.B, summ.H_q, summ.H_kv, summ.L, summ.D, summ.dtype_bytes, summ.unified) \
                if comparable(summ) else ([], None)
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
            if st["dist"] != "constant":
                self.status.value = "the measurement times dense batches: switch the lengths to constant to measure"
                return
            if st["q_len"] != 1:
                self.status.value = "the measurement times one query token: set q_len to 1 to measure"
                return
            self.button.disabled = True
            self.status.value = "measuring…"
            try:
                L = st["L"]
                D = self.D
                rows, nbytes = st["B"] * st["H_kv"], self.dtype_bytes
                todo = sorted({splits_used(L, s, D, rows, nbytes) for s in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
                              | {splits_used(L, st["splits"], D, rows, nbytes), self.summary.chosen_splits})
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
    names = gpus.choices()
    return names if name in names else names + [name]


_EXPLORER_CLS = None


def explorer(**defaults):
    """The interactive SM-occupancy explorer (an ipywidgets VBox; display it or end a cell with it).

    Keyword defaults: ``B, H_q, H_kv`` (or ``group``), ``L, splits, gpu`` (preset name, ``"live"``, or a
    :class:`fdlib.gpus.GPU`), ``gqa, unified, D, dtype_bytes``, ``dist`` (the length histogram: ``"constant"``,
    ``"uniform"`` or ``"zipf"``, of mean L).
    """
    global _EXPLORER_CLS
    if _EXPLORER_CLS is None:
        _EXPLORER_CLS = _make_explorer_class()
    return _EXPLORER_CLS(**defaults)
