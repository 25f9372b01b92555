"""Lab 08's "what the GPU shows": the cost of verifying several query tokens per sequence.

One results file, ``qlen-fp16.json`` (``python -m fdlib.bench --qlen``): for every shape (batch B, KV length L;
heads 32:8, fp16, D = 128) and contender, the time of one decode step with q_len = 1, 2, 4, 8 new tokens per
sequence, each causal among the new tokens. The figure and the table give, per shape,

    growth(q_len) = time(q_len) / time(q_len = 1)

for fdlib (the bottom-right rule applied inside its kernel) and for SDPA's cuDNN backend (given whatever mask
the run found right for it, which the caption names from the file).
"""
from __future__ import annotations

import math
from pathlib import Path

from . import Shown, load, provenance, shown_path, view

QLEN = "qlen-fp16.json"
PANELS = {"fdlib": "fdlib (the mask inside its kernel), linear scale", "cudnn": "SDPA cuDNN, log scale"}


def growth_rows(res: dict) -> list[dict]:
    """The file's ``ratios`` (one per shape and contender), sorted by (L, B, contender as in PANELS)."""
    order = list(PANELS)
    return sorted(res["ratios"], key=lambda r: (r["L"], r["B"], order.index(r["method"])
                                                if r["method"] in order else len(order)))


def given(res: dict) -> dict:
    """{contender: {mask given: [q_len, ...]}} and why a contender did not run: {contender: {reason}}."""
    masks: dict = {}
    missing: dict = {}
    for r in res["records"]:
        masks.setdefault(r["method"], {}).setdefault(r["mask"], set()).add(r["q_len"])
        if r["status"] != "ok":
            missing.setdefault(r["method"], set()).add(r.get("reason") or r["status"])
    return {m: {k: sorted(v) for k, v in d.items()} for m, d in masks.items()}, missing


def _shape(r) -> str:
    return f"B={r['B']} L={r['L']}"


@view("qlen")
def qlen(results_dir: Path) -> Shown:
    import matplotlib.pyplot as plt

    from fdlib.course.figures import legend_outside

    path = results_dir / QLEN
    res = load(path)
    st = res["settings"]
    qls = st["qlens"]
    rows = growth_rows(res)
    shapes = list(dict.fromkeys(_shape(r) for r in rows))
    color = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(shapes)}
    timing = {r["timing"] for r in rows}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, m in zip(axes, PANELS):
        for r in (r for r in rows if r["method"] == m):
            ax.plot(qls, [r["ratio"][str(t)] for t in qls], "o-", color=color[_shape(r)], label=_shape(r))
        ax.set_xscale("log", base=2)
        ax.set_xticks(qls, [str(t) for t in qls])
        ax.minorticks_off()
        ax.set_xlabel("new query tokens per sequence (q_len)")
        ax.set_ylabel("time(q_len) / time(q_len = 1)")
        ax.set_title(PANELS[m], fontsize=10)
        ax.axhline(1, color="black", lw=0.8)
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].yaxis.set_minor_formatter(plt.FuncFormatter(
        lambda v, _: f"{v:g}" if round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
    legend_outside(axes[1], title="shape (both panels)")
    p = res["provenance"]
    modes = "/".join("CUDA-graph" if t == "graph" else t for t in sorted(timing))
    fig.suptitle(f"Cost of extra query tokens, heads {st['heads'][0]}:{st['heads'][1]}, D = {st['D']}, fp16: "
                 f"recorded on {p['device']} {p['date_utc'][:10]}, {modes} timings ({shown_path(path)})",
                 fontsize=10.5)

    table = [["shape", "contender", "q_len=1 µs"] + [f"×, q_len={t}" for t in qls[1:]]]
    for r in rows:
        table.append([_shape(r), r["method"], f"{r['q1_us']:.1f}"] + [f"{r['ratio'][str(t)]:.3f}" for t in qls[1:]])

    masks, missing = given(res)
    ran = [m for m in masks if m not in missing]
    gave = "; ".join(f"{m}: " + ", ".join(f"{mask} at q_len {','.join(map(str, q))}" for mask, q in masks[m].items())
                     for m in ran)
    absent = "".join(f" {m} did not run ({'; '.join(sorted(why)).rstrip('.')})." for m, why in missing.items())
    probe = "; ".join(f"{m}: {a}" for m, a in st["is_causal_alignment"].items() if m in ran)
    spans = "; ".join(f"{m} from {min(r4):.3f}× to {max(r4):.3f}× over {len(r4)} shapes"
                      for m in PANELS if (r4 := [r["ratio"]["4"] for r in rows if r["method"] == m]))
    caption = (f"{shown_path(path)}: recorded on {provenance(res['provenance'])}; L2: {st['l2_handling']}. SDPA's is_causal "
               f"alignment, probed in the run: {probe}. What each contender was given: {gave}.{absent} "
               f"time(q_len = 4) / time(q_len = 1): {spans}.")
    return Shown(figure=fig, table=table, caption=caption, sources=[shown_path(path)])
