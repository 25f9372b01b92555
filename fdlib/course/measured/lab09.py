r"""Lab 09's views: an 8-bit KV cache's error (CPU arithmetic) and its speed against a 16-bit one (GPU).

``quant-error``: ``results/cpu/quant-error.json`` (``python tools/quant_error.py``: float64 arithmetic on the CPU, no
kernel): for each data kind (N(0, 1), and with outlier channels), 8-bit dtype and scale granularity, the relative
error of the cache and of the attention output against the unquantized cache.

``kv8``: results files of ``python -m fdlib.bench`` on the dense grid, all in one folder ``results/<device>/``:

* :data:`KV16` = ``kv16-bf16.json``, the 16-bit cache (``--dtype bfloat16 --name kv16-bf16``);
* ``kv8-<dtype>-<scale>.json`` (:func:`kv8_name`) for dtype float8_e4m3fn and int8 and scale tensor, head and token
  (the same grid with ``--kv-dtype <dtype> --kv-scale <scale> --name kv8-<dtype>-<scale>``).

For every shape (B, L) and 8-bit format, the speed-up of fdlib's ``auto`` is

.. math::  \text{speed-up} = \frac{\text{time (16-bit cache)}}{\text{time (8-bit cache)}}

(CUDA-graph times where every run has them), 2 where the time is the bytes' alone. A format **pays from** L* on a
batch size when it is faster than 16 bits at L* and at every longer L measured (:func:`pays_from`).
The view looks for the files in ``results_dir`` and, where they are not there, in the newest folder beside it
that holds :data:`KV16` (the GPU that ran them names the folder).
"""
from __future__ import annotations

import math
from pathlib import Path

from . import RESULTS, Shown, gmean, load, provenance, shown_path, view

KV16 = "kv16-bf16.json"
KV_DTYPES = ("float8_e4m3fn", "int8")
SCALES = ("tensor", "head", "token")
FORMATS = tuple((d, s) for d in KV_DTYPES for s in SCALES)
SHORT = {"float8_e4m3fn": "e4m3", "int8": "int8"}
METHOD = "auto"
QUANT_ERROR = Path("cpu") / "quant-error.json"
"""The error file, from the results root (``results/``)."""
COLORS = {"float8_e4m3fn": "tab:purple", "int8": "tab:gray"}
"""One colour per cache dtype, the same in every figure of the lab."""
STYLES = {"tensor": (":", "^"), "head": ("-", "o"), "token": ("--", "s")}
"""(line style, marker) per scale granularity."""


def kv8_name(kv_dtype: str, kv_scale: str) -> str:
    return f"kv8-{kv_dtype}-{kv_scale}.json"


def label(fmt) -> str:
    """'e4m3, per head' for ('float8_e4m3fn', 'head')."""
    return f"{SHORT[fmt[0]]}, per {fmt[1]}"


# ---------------------------------------------------------------------------------------------- the error (CPU)
def quant_error(results_root: Path | None = None) -> dict:
    """The error file (``results/cpu/quant-error.json`` by default)."""
    return load(Path(RESULTS.parent if results_root is None else results_root) / QUANT_ERROR)


def error_of(data: dict, kind: str, dtype: str, granularity: str, field: str = "out_rel_err") -> float:
    """One row's error (a fraction) from the error file: ``kind`` is its ``data`` column (``"N(0,1)"`` or
    ``"outlier channels"``)."""
    for r in data["rows"]:
        if (r["data"], r["dtype"], r["granularity"]) == (kind, dtype, granularity):
            return r[field]
    raise KeyError(f"no row ({kind}, {dtype}, {granularity}) in the error file")


def error_findings(data: dict) -> dict:
    """What the lesson says of the error file, each computed from it (cache and output errors, fractions):

    * ``e4m3_flat``: on N(0, 1) data e4m3's cache error changes by less than 10 % from per tensor to per token;
    * ``int8_finer``: on N(0, 1) data int8's cache error falls from per tensor to per head to per token;
    * ``int8_token_beats_e4m3``: per token on N(0, 1) data, int8's output error is below e4m3's;
    * ``outliers_int8_cache``: int8's per-tensor cache error with outlier channels over that on N(0, 1);
    * ``outliers_int8_above_e4m3``: with outlier channels, int8's cache error is above e4m3's per tensor and per
      head (the coarse scales);
    * ``outliers_output_grows``: every dtype and granularity has a larger output error with outlier channels;
    * ``token_best_with_outliers``: with outlier channels, per token gives each dtype its smallest output error;
    * ``outliers_out_ratio``: with outlier channels, {granularity: int8's output error over e4m3's};
    * ``outliers_out_close``: those ratios all lie within 15 % of 1 (the two dtypes end up close in the output).
    """
    n, o = "N(0,1)", "outlier channels"
    e = lambda kind, d, g, f="cache_rel_err": error_of(data, kind, d, g, f)   # noqa: E731
    e4 = [e(n, "float8_e4m3fn", g) for g in SCALES]
    i8 = [e(n, "int8", g) for g in SCALES]
    ratio = {g: e(o, "int8", g, "out_rel_err") / e(o, "float8_e4m3fn", g, "out_rel_err") for g in SCALES}
    return {
        "e4m3_flat": max(e4) / min(e4) < 1.1,
        "int8_finer": i8[0] > i8[1] > i8[2],
        "int8_token_beats_e4m3": e(n, "int8", "token", "out_rel_err") < e(n, "float8_e4m3fn", "token", "out_rel_err"),
        "outliers_int8_cache": e(o, "int8", "tensor") / e(n, "int8", "tensor"),
        "outliers_int8_above_e4m3": all(e(o, "int8", g) > e(o, "float8_e4m3fn", g) for g in ("tensor", "head")),
        "outliers_output_grows": all(e(o, d, g, "out_rel_err") > e(n, d, g, "out_rel_err") for d in KV_DTYPES
                                     for g in SCALES),
        "token_best_with_outliers": all(min(SCALES, key=lambda g: e(o, d, g, "out_rel_err")) == "token"
                                        for d in KV_DTYPES),
        "outliers_out_ratio": ratio,
        "outliers_out_close": all(1 / 1.15 < r < 1.15 for r in ratio.values()),
    }


@view("quant-error")
def quant_error_view(results_dir: Path) -> Shown:
    """Output error per dtype and granularity, on N(0, 1) data and with outlier channels (one panel each)."""
    import matplotlib.pyplot as plt

    path = Path(results_dir).parent / QUANT_ERROR
    data = load(path)
    kinds = list(dict.fromkeys(r["data"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(11, 3.8), sharey=True)
    width = 0.38
    for ax, kind in zip(axes, kinds):
        for i, d in enumerate(KV_DTYPES):
            ys = [100 * error_of(data, kind, d, g) for g in SCALES]
            ax.bar([x + (i - 0.5) * width for x in range(len(SCALES))], ys, width, label=SHORT[d],
                   color=COLORS[d])
        ax.set_xticks(range(len(SCALES)), [f"per {g}" for g in SCALES])
        ax.set_title(f"data: {kind}", fontsize=10)
        ax.set_xlabel("scale granularity")
        ax.grid(axis="x", visible=False)
    axes[0].set_ylabel("output error ‖Ô − O‖ / ‖O‖ (%)")
    axes[-1].legend(title="cache dtype")
    s = data["settings"]
    fig.suptitle(f"Attention output error of an 8-bit cache: B={s['B']}, L={s['L']}, {s['H_q']}:{s['H_kv']} heads, "
                 f"D={s['D']}; CPU float64 arithmetic, no GPU ({shown_path(path)})", fontsize=10)
    table = [["data", "dtype", "scales per", "cache error", "output error", "worst row"]]
    for r in data["rows"]:
        table.append([r["data"], SHORT.get(r["dtype"], r["dtype"]), r["granularity"], f"{100 * r['cache_rel_err']:.2f}%",
                      f"{100 * r['out_rel_err']:.2f}%", f"{100 * r['out_max_row_err']:.1f}%"])
    out = data["outliers"]
    caption = (f"{shown_path(path)}: {data['provenance']['arithmetic']}. q, K, V ~ "
               f"N(0, 1); outlier channels: {out['channels']} of D channels {out['scale']:g}x larger in K and V. "
               f"Errors relative to the unquantized cache: the cache's (the larger of K's and V's), the output's, and "
               f"the worst (b, h) row's max|ΔO| / max|O|. Scales per 'unit': e4m3 with scale 1.")
    return Shown(figure=fig, table=table, caption=caption, sources=[shown_path(path)])


# ---------------------------------------------------------------------------------------------- the speed (GPU)
def find_run(results_dir: Path) -> Path:
    """The folder of the 8-bit runs: ``results_dir`` if it holds :data:`KV16`, else the newest (by the file's date)
    of the folders beside it that do; FileNotFoundError naming the file and the command otherwise."""
    results_dir = Path(results_dir)
    if (results_dir / KV16).exists():
        return results_dir
    found = sorted(results_dir.parent.glob(f"*/{KV16}"), key=lambda p: (load(p)["provenance"]["date_utc"], str(p)))
    if found:
        return found[-1].parent
    raise FileNotFoundError(f"no recorded GPU run yet: {shown_path(results_dir / KV16)} (the runs that make it: "
                            f"results/notes/09_fewer_bytes.md)")


def timing(runs: list) -> str:
    """'graph' where every fdlib record of every run has a CUDA-graph time, else 'eager'."""
    ok = [r for res in runs for r in res["records"] if r.get("kind") == "fdlib" and r["status"] == "ok"]
    return "graph" if ok and all(r.get("graph_us") for r in ok) else "eager"


def times(res: dict, tk: str) -> dict:
    """{(B, H_q, H_kv, L, D): record} of the file's ``auto`` records that ran (the first fdlib method if no auto)."""
    recs = [r for r in res["records"] if r["status"] == "ok" and r.get(f"{tk}_us")]
    methods = [r["method"] for r in recs if r.get("kind") == "fdlib"]
    method = METHOD if METHOD in methods else (methods[0] if methods else METHOD)
    return {(r["B"], r["H_q"], r["H_kv"], r["L"], r["D"]): r for r in recs if r["method"] == method}


def pays_from(points) -> int | None:
    """The shortest L from which every longer L has a speed-up > 1 (``points``: (L, speed-up)); None if the
    longest L has none."""
    first = None
    for L, x in sorted(points, reverse=True):
        if x <= 1:
            break
        first = L
    return first


def speedups(base: dict, runs: dict, tk: str) -> list:
    """One dict per (format, shape) both runs timed: format, B, L, the two times, speed-up and the 8-bit run's % of
    its read ceiling; sorted by format, B, L."""
    t16 = times(base, tk)
    rows = []
    for fmt, res in runs.items():
        for key, r8 in times(res, tk).items():
            if key in t16:
                us16, us8 = t16[key][f"{tk}_us"], r8[f"{tk}_us"]
                rows.append({"format": fmt, "B": key[0], "L": key[3], "us16": us16, "us8": us8, "x": us16 / us8,
                             "pct8": r8.get(f"{tk}_pct_ceiling"), "pct16": t16[key].get(f"{tk}_pct_ceiling")})
    order = {f: i for i, f in enumerate(FORMATS)}
    return sorted(rows, key=lambda r: (order.get(r["format"], len(order)), r["B"], r["L"]))


def summary(rows: list) -> dict:
    """{format: {B: (pays from L or None, speed-up at the shortest L, at the longest L, 8-bit % at the longest)}}."""
    out: dict = {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        for B in sorted({r["B"] for r in rows if r["format"] == fmt}):
            pts = [r for r in rows if r["format"] == fmt and r["B"] == B]
            out.setdefault(fmt, {})[B] = (pays_from([(r["L"], r["x"]) for r in pts]), pts[0]["x"], pts[-1]["x"],
                                          pts[-1]["pct8"])
    return out


def _pays(L, Ls) -> str:
    return "no L" if L is None else "every L" if L == min(Ls) else f"L ≥ {L}"


def _pct(x) -> str:
    return "—" if x is None else f"{x:.0f}%"


@view("kv8")
def kv8(results_dir: Path) -> Shown:
    import matplotlib.pyplot as plt

    from fdlib.course.figures import plain_ticks

    folder = find_run(results_dir)
    base = load(folder / KV16)
    runs = {fmt: load(folder / kv8_name(*fmt)) for fmt in FORMATS if (folder / kv8_name(*fmt)).exists()}
    if not runs:
        raise FileNotFoundError(f"no recorded GPU run yet: {shown_path(folder)} holds {KV16} but no kv8-*.json")
    missing = [kv8_name(*f) for f in FORMATS if f not in runs]
    tk = timing([base, *runs.values()])
    rows = speedups(base, runs, tk)
    Bs = sorted({r["B"] for r in rows})
    Ls = sorted({r["L"] for r in rows})
    summ = summary(rows)

    n = len(Bs) + 1
    ncols = 2
    fig, axes = plt.subplots(math.ceil(n / ncols), ncols, figsize=(11, 3.6 * math.ceil(n / ncols)), squeeze=False)
    axes = axes.ravel()
    for ax, B in zip(axes, Bs):
        for fmt in runs:
            pts = [(r["L"], r["x"]) for r in rows if r["format"] == fmt and r["B"] == B]
            if pts:
                ls, mk = STYLES[fmt[1]]
                ax.plot(*zip(*pts), ls=ls, marker=mk, ms=4, color=COLORS[fmt[0]], label=label(fmt))
        ax.axhline(1, color="black", lw=1)
        ax.axhline(2, color="0.5", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ls, [f"{L // 1024}k" for L in Ls])
        ax.minorticks_off()
        ax.set_title(f"B = {B}", fontsize=10)
        ax.set_xlabel("context length L (tokens)")
        ax.set_ylabel("speed-up over bf16 cache (×)")
    hi = max(2.2, max(r["x"] for r in rows) * 1.1)
    for ax in axes[:len(Bs)]:
        ax.set_ylim(0, hi)
    ax = axes[len(Bs)]
    err_src = []
    err_path = folder.parent / QUANT_ERROR
    if err_path.exists():
        err = load(err_path)
        err_src = [shown_path(err_path)]
        for fmt in runs:
            xs = [r["x"] for r in rows if r["format"] == fmt and r["L"] == Ls[-1]]
            if not xs:
                continue
            y = gmean(xs)
            for kind, fill in (("outlier channels", COLORS[fmt[0]]), ("N(0,1)", "white")):
                ax.plot(100 * error_of(err, kind, *fmt), y, STYLES[fmt[1]][1], ms=8, mec=COLORS[fmt[0]], mfc=fill,
                        ls="none")
        ax.set_xscale("log")
        plain_ticks(ax, "x")
        ax.set_xlabel("output error (%, CPU float64; hollow: N(0,1) data, filled: outlier channels)", fontsize=8.5)
        ax.set_ylabel(f"speed-up at L = {Ls[-1] // 1024}k\n(geometric mean over B)")
        ax.set_title("error against speed", fontsize=10)
        ax.axhline(1, color="black", lw=1)
    else:
        ax.text(0.5, 0.5, f"no error file ({shown_path(err_path)})", ha="center", va="center", transform=ax.transAxes)
    for extra in axes[len(Bs) + 1:]:
        extra.set_visible(False)
    from matplotlib.lines import Line2D
    handles, labels = axes[0].get_legend_handles_labels()
    handles += [Line2D([], [], color="black", lw=1), Line2D([], [], color="0.5", lw=1, ls=":")]
    labels += ["1×: as fast as bf16", "2×: half the bytes, half the time"]
    fig.legend(handles, labels, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.08), frameon=False)
    p = base["provenance"]
    first = next(iter(times(base, tk).values()), base["records"][0])
    fig.suptitle(f"8-bit KV cache against bf16: fdlib auto, {first['H_q']}:{first['H_kv']} heads, D = {first['D']}, "
                 f"bf16 queries;\nrecorded on {p['device']} {p['date_utc'][:10]}, "
                 f"{'CUDA-graph' if tk == 'graph' else 'eager'} timings ({shown_path(folder)})", fontsize=10)
    if fig.get_layout_engine() is None:     # the course style lays figures out itself (constrained)
        fig.tight_layout()

    table = [["cache", "B", f"× at L={Ls[0]}", f"× at L={Ls[-1]}", f"% of ceiling at L={Ls[-1]}", "8 bits pay from"]]
    for B in Bs:
        r16 = next((r for r in rows if r["B"] == B and r["L"] == Ls[-1]), None)
        table.append(["bf16", str(B), "1", "1", _pct(r16 and r16["pct16"]), "—"])
    for fmt, per_B in summ.items():
        for B, (L0, x_lo, x_hi, pct) in per_B.items():
            table.append([label(fmt), str(B), f"{x_lo:.2f}", f"{x_hi:.2f}", _pct(pct), _pays(L0, Ls)])
    every_B = []
    for fmt, per_B in summ.items():
        never = [str(B) for B, v in per_B.items() if v[0] is None]
        every_B.append(f"{label(fmt)}: " + (f"no L at B = {', '.join(never)}" if never
                                             else _pays(max(v[0] for v in per_B.values()), Ls)))
    files = [shown_path(folder / KV16)] + [shown_path(folder / kv8_name(*f)) for f in runs]
    not_run = [label(f) for f in FORMATS if f not in runs]
    caption = (f"{shown_path(folder)}/ ({', '.join(Path(f).name for f in files)}): recorded on {provenance(p)}; "
               f"run at B = {', '.join(map(str, Bs))} and L = {', '.join(map(str, Ls))} only. Speed-up = time "
               f"with the bf16 cache / time with the 8-bit one, fdlib's {METHOD}, "
               f"{'CUDA-graph' if tk == 'graph' else 'eager'} timings; % of ceiling: the cache's bytes over the "
               f"time, against the read ceiling measured in each run. '8 bits pay from': the shortest L from which "
               f"every longer measured L is faster with 8 bits. At every batch size, 8 bits pay from: "
               f"{'; '.join(every_B)}."
               + (f" Not run: {'; '.join(not_run)} ({', '.join(missing)} not recorded)." if missing else "")
               + (f" Error against the unquantized cache: {err_src[0]} (CPU arithmetic)." if err_src else ""))
    return Shown(figure=fig, table=table, caption=caption, sources=files + err_src)


def speed_findings(results_dir: Path | None = None) -> dict:
    """What the lesson says of the recorded speed runs, each computed from the files (:func:`find_run`):

    * ``device``: the GPU that ran them;
    * ``formats``: the 8-bit formats run, ``not_run``: those not run (labels);
    * ``Bs``, ``Ls``: the batch sizes and lengths run;
    * ``x``: {dtype: (slowest, fastest) speed-up over bf16 over every format of that dtype, B and L};
    * ``pct8``: {dtype: (lowest, highest) % of the read ceiling}; ``pct16``: the same of the bf16 cache;
    * ``ever_faster``: whether any 8-bit run beat bf16 at any shape (a break-even exists only then);
    * ``kernels8``: the kernels ``auto`` ran over the 8-bit caches (sorted);
    * ``timing``: 'graph' or 'eager'.
    """
    folder = find_run(RESULTS if results_dir is None else results_dir)
    base = load(folder / KV16)
    runs = {fmt: load(folder / kv8_name(*fmt)) for fmt in FORMATS if (folder / kv8_name(*fmt)).exists()}
    tk = timing([base, *runs.values()])
    rows = speedups(base, runs, tk)
    span = lambda xs: (min(xs), max(xs))    # noqa: E731
    dtypes = [d for d in KV_DTYPES if any(r["format"][0] == d for r in rows)]
    return {
        "device": base["provenance"]["device"],
        "formats": [label(f) for f in runs], "not_run": [label(f) for f in FORMATS if f not in runs],
        "Bs": sorted({r["B"] for r in rows}), "Ls": sorted({r["L"] for r in rows}),
        "x": {d: span([r["x"] for r in rows if r["format"][0] == d]) for d in dtypes},
        "pct8": {d: span([r["pct8"] for r in rows if r["format"][0] == d]) for d in dtypes},
        "pct16": span([r["pct16"] for r in rows]),
        "ever_faster": any(r["x"] > 1 for r in rows),
        "kernels8": sorted({r.get("kernel", "?") for res in runs.values() for r in times(res, tk).values()}),
        "timing": tk,
    }


PROBE = "kv8-probe.json"
"""The 8-bit loop probe's file (``tools/kv8_probe.py``), in the folder of the speed runs."""
CONV = {"triton": "the compiler's conversion", "asm": "a packed conversion, four elements a register"}


def probe_findings(results_dir: Path | None = None) -> dict:
    """The probe's file, beside the speed runs: a minimal decode loop (one query group of ``G`` rows, D, L keys a
    program, fp16 products) over a bf16 cache and over e4m3 and int8 caches. Returns its ``device``, the read
    ceiling ``ceiling_tbs``, the loop's shape (``programs``, ``L``, ``D``, ``G``) and ``rows``: one dict per variant
    run (``kv``, ``conv`` in words, ``tbs`` the cache's bytes over the time, ``pct`` of the read ceiling), in the
    file's order."""
    folder = find_run(RESULTS if results_dir is None else results_dir)
    data = load(folder / PROBE)
    ceil = data["ceiling"]["tbs"]
    rows = [{"kv": r["kv"], "conv": "none (16 bits)" if r["kv"] in ("bfloat16", "float16") else CONV.get(r["conv"],
             r["conv"]), "tbs": r["gbs"] / 1e3, "pct": 100 * r["gbs"] / 1e3 / ceil} for r in data["rows"]]
    return {"device": data["provenance"]["device"], "ceiling_tbs": ceil, "programs": data["programs"],
            "L": data["L"], "D": data["D"], "G": data["G"], "rows": rows, "file": shown_path(folder / PROBE)}
