"""Lab 05's "what the GPU shows": the showdown of every decode method against SDPA's cuDNN backend.

One results file, ``bench-float16.json`` (``python -m fdlib.bench --dtype float16``): for every shape of the grid
(batch B, heads H_q:H_kv, KV length L; fp16, D = 128) the time of one decode step of each method. For a shape s
and a method m the figure plots

    ratio(m, s) = time(m, s) / time(cudnn, s)        (< 1: faster than cuDNN)

and the table gives the times of four shapes that tell the lab's story, the kernel and split count ``auto`` ran
there, and each method's geometric mean of ratio(m, ·) over every shape ("gmean/cuDNN").
"""
from __future__ import annotations

import math
from pathlib import Path

from . import Shown, gmean, load, provenance, shown_path, view

SHOWDOWN = "bench-float16.json"

METHODS = {                      # method: (what it is, marker, colour); cuDNN is the reference line
    "naive": ("PyTorch matmul-softmax-matmul (Lab 01)", "x", "tab:gray"),
    "split1": ("one program per (sequence, KV head), no split", "v", "tab:red"),
    "split": ("stage 1 + stage 2 (Labs 03-04)", "s", "tab:orange"),
    "unified": ("one launch, ticket hand-off (this lab)", "o", "tab:blue"),
    "persistent": ("2 programs per SM walking every row", "^", "tab:green"),
    "auto": ("fdlib's choice of kernel and splits", "|", "black"),
    "fa2": ("SDPA's FlashAttention-2 backend", "D", "tab:purple"),
}
TABLE_SHAPES = [(1, 8, 131072), (1, 32, 131072), (16, 8, 8192), (64, 8, 512)]
"""(B, H_kv, L) of the table's columns: few programs and a long cache, the same with four times the KV heads,
a batch that fills the GPU without splitting, many short rows."""





def timing_key(res: dict) -> str:
    """'graph' when the run has CUDA-graph timings, else 'eager'."""
    return "graph" if any(r.get("graph_us") for r in res["records"]) else "eager"


def times_by_shape(res: dict, tk: str) -> dict:
    """{(B, H_q, H_kv, L): {method: µs}} over the fp16 records that ran."""
    out: dict = {}
    for r in res["records"]:
        if r["status"] == "ok" and r.get(f"{tk}_us"):
            out.setdefault((r["B"], r["H_q"], r["H_kv"], r["L"]), {})[r["method"]] = r[f"{tk}_us"]
    return out



def ratios_to_cudnn(times: dict, method: str) -> dict:
    """{shape: time(method) / time(cudnn)} where both ran."""
    return {s: m[method] / m["cudnn"] for s, m in times.items() if method in m and "cudnn" in m}


def _label(shape) -> str:
    B, H_q, H_kv, L = shape
    return f"B={B} {H_q}:{H_kv} L={L}"


@view("showdown")
def showdown(results_dir: Path) -> Shown:
    import matplotlib.pyplot as plt

    from fdlib.course.figures import legend_outside

    path = results_dir / SHOWDOWN
    res = load(path)
    tk = timing_key(res)
    times = times_by_shape(res, tk)
    shapes = sorted(times)
    kernel_of = {(r["B"], r["H_q"], r["H_kv"], r["L"]): f"{r.get('kernel', '?')}@{r.get('splits')}"
                 for r in res["records"] if r["method"] == "auto" and r["status"] == "ok"}
    mode = "CUDA-graph" if tk == "graph" else "eager"

    # the figure: one row per shape, time relative to cuDNN
    fig, ax = plt.subplots(figsize=(8.5, 0.19 * len(shapes) + 1.9))
    y = {s: i for i, s in enumerate(shapes)}
    for m, (_, marker, color) in METHODS.items():
        pts = sorted((x, y[s]) for s, x in ratios_to_cudnn(times, m).items())
        if pts:
            ax.plot(*zip(*pts), marker, color=color, ms=11 if m == "auto" else 5, mew=1.6 if m == "auto" else 1,
                    ls="none", label=m, mfc=color if m == "unified" else "none", zorder=3 if m == "auto" else 2)
    ax.axvline(1, color="black", ls="--", lw=1, label="cuDNN (= 1)")
    ax.set_xscale("log")
    ax.set_yticks(range(len(shapes)), [_label(s) for s in shapes], family="monospace", fontsize=8)
    ax.set_ylim(len(shapes) - 0.5, -0.5)
    ax.grid(True, axis="x", which="both")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(plt.FuncFormatter(
        lambda v, _: f"{v:g}×" if round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
    ax.set_xlabel("time / cuDNN time (log scale; left of the dashed line is faster than cuDNN)")
    ax.set_ylabel("shape: batch B, heads H_q:H_kv, KV length L")
    ax.set_title(f"One decode step against SDPA's cuDNN backend, fp16, D = 128\n"
                 f"recorded on {res['provenance']['device']} {res['provenance']['date_utc'][:10]}, "
                 f"{mode} timings ({shown_path(path)})")
    legend_outside(ax)

    # the table: four shapes in µs, the kernel auto ran, the geometric mean over the grid
    cols = [s for s in ((B, 32, H_kv, L) for B, H_kv, L in TABLE_SHAPES) if s in times]
    rows = [["µs per step"] + [_label(s) for s in cols] + ["gmean/cuDNN"]]
    for m in list(METHODS) + ["cudnn"]:
        r = ratios_to_cudnn(times, m)
        rows.append([m] + [f"{times[s][m]:.1f}" if m in times[s] else "n/a" for s in cols]
                    + [f"{gmean(r.values()):.3f}" if r else "n/a"])
    rows.append(["auto ran"] + [kernel_of.get(s, "n/a") for s in cols] + [""])

    auto = ratios_to_cudnn(times, "auto")
    auto_line = ""
    if auto:                      # a run of your own may lack cuDNN or auto
        worst = max(auto, key=auto.get)
        auto_line = (f" auto / cuDNN over the {len(auto)} shapes: geometric mean {gmean(auto.values()):.3f}, "
                     f"worst {auto[worst]:.3f} ({_label(worst)}).")
    gqa_line = ""
    for B, H_kv, L in TABLE_SHAPES:           # time follows H_kv: 32:32 heads read 4x the bytes of 32:8
        few, many = times.get((B, 32, 8, L), {}), times.get((B, 32, 32, L), {})
        if H_kv == 32 and "unified" in few and "unified" in many:
            gqa_line += (f" unified at B={B}, L={L}: 32:32 heads take {many['unified'] / few['unified']:.2f}× the "
                         f"time of 32:8 (4× the KV bytes).")
    ceiling = f", read ceiling {res['ceiling']['tbs']:.2f} TB/s" if res.get("ceiling") else ""
    caption = (f"{shown_path(path)}: recorded on {provenance(res['provenance'])}; {mode} timings, the L2 flushed between runs"
               f"{ceiling}. gmean/cuDNN: the geometric mean over the {len(shapes)} shapes of time / cuDNN's time; "
               f"'auto ran': the kernel and split count auto chose." + auto_line + gqa_line)
    return Shown(figure=fig, table=rows, caption=caption, sources=[shown_path(path)])
