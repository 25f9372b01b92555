"""The course's figure style: one look for every plot in the notebooks.

* :func:`use_course_style` -- 100 dpi and 10-point text, so a figure is readable at the notebook's width while
  its PNG stays small; light grids; no top and right spines;
* :func:`legend_outside` -- the legend beside (or below) the axes, never over the data;
* :func:`plain_ticks` -- plain numbers on log axes (30, 200), not 3×10¹ or 2×10²;
* every plot has a title, labelled axes with units, and says which device and mode produced it (the notebooks
  write that into the title: "analytic model", "recorded on NVIDIA H200 ...", "PyTorch on the CPU").
"""
from __future__ import annotations

import math

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "figure.figsize": (8.0, 4.0),
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "axes.grid": True,
    "axes.grid.which": "major",
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.constrained_layout.use": True,
}


def use_course_style() -> None:
    """Apply :data:`STYLE` to matplotlib's defaults (call once, after importing pyplot)."""
    import matplotlib
    matplotlib.rcParams.update(STYLE)


def _plain(v, _pos=None) -> str:
    return f"{v:g}"


def plain_ticks(ax, axis: str = "both", minor: tuple = (2, 5)) -> None:
    """Plain tick labels on ``ax`` ("x", "y" or "both"): majors as numbers, and on log axes the minor ticks at
    ``minor``·10^k labelled too when the axis spans less than two decades, and every minor tick when it spans
    less than a factor of 5 (so a short log axis is not bare)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for name in ("x", "y") if axis == "both" else (axis,):
        a = getattr(ax, f"{name}axis")
        a.set_major_formatter(FuncFormatter(_plain))
        if a.get_scale() != "log":
            continue
        lo, hi = sorted(getattr(ax, f"get_{name}lim")())
        if lo > 0 and hi / lo < 100:
            shown = range(1, 10) if hi / lo < 5 else minor      # less than a decade wide: label every tick

            def label(v, _pos=None, shown=shown):
                lead = round(v / 10 ** math.floor(math.log10(v)), 6)
                return f"{v:g}" if lead in shown else ""
            a.set_minor_formatter(FuncFormatter(label))
        else:
            a.set_minor_formatter(NullFormatter())


def legend_outside(ax, where: str = "right", **kw):
    """A legend beside the axes (``where="right"``) or under them (``"below"``), off the data."""
    if where == "below":
        kw = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.18), "ncol": 4, **kw}
    else:
        kw = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, **kw}
    return ax.legend(**kw)
