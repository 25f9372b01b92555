"""Tables, result files and plots for :mod:`fdlib.bench` (also used by the notebooks on recorded results).

* :func:`format_table` - the text table printed at the end of a run (markdown, one row per shape);
* :func:`write_results` - ``NAME.json`` (records + provenance), ``NAME.md`` (the table), ``NAME.png`` (the plot);
  never overwrites an existing file unless ``force=True``;
* :func:`load_results` - read a results file (or the newest one in a folder), e.g. the committed H200 results;
* :func:`plot_results` - the figure: (a) time / cuDNN time per shape, (b) effective bandwidth vs KV size with the
  measured read ceiling; for a splits sweep, time / best time vs splits and chosen / best per shape.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from .host import format_host_table

DPI = 110


# ----------------------------------------------------------------------------------------------- helpers

def device_slug(results_or_device) -> str:
    """``"NVIDIA H200"`` -> ``"h200"`` (vendor dropped); interpreter runs go to ``"interpreter-cpu"``."""
    if isinstance(results_or_device, dict):
        prov = results_or_device["provenance"]
        if prov.get("mode") != "gpu":
            return "interpreter-cpu"
        results_or_device = prov["device"]
    slug = re.sub(r"[^a-z0-9]+", "-", str(results_or_device).lower()).strip("-")
    return re.sub(r"^(nvidia|amd|intel)-", "", slug) or "device"


def _shape_key(r):
    return (r["dtype"], r["B"], r["H_q"], r["H_kv"], r["L"], r["D"])


SHAPE_AXIS = "shape (dtype, batch B, heads H_q:H_kv, KV length L, head dim D where not 128)"
"""The x-axis title of the per-shape plots, what :func:`_shape_label`'s short form names."""


def _shape_label(r, short=False):
    dt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(r["dtype"], r["dtype"])
    if short:   # a plot's tick label: D named where it is not the grid's 128 (the heads sweep has 64 and 256 too)
        return f"{dt} B{r['B']} {r['H_q']}:{r['H_kv']} L{r['L']}" + ("" if r["D"] == 128 else f" D{r['D']}")
    return f"{dt} B={r['B']} H={r['H_q']}:{r['H_kv']} L={r['L']} D={r['D']}"


def _fmt(x, spec=".1f", none="—"):
    return none if x is None else format(x, spec)


def _mode_of(results) -> str:
    """'CUDA graph' when the run has graph timings, else 'eager' (or 'interpreter')."""
    prov = results["provenance"]
    if prov.get("mode") != "gpu":
        return "interpreter (CPU wall clock)"
    if results["kind"] == "sweep":
        return "CUDA graph" if results["settings"].get("timing") == "graph" else "eager"
    recs = results.get("records", [])
    return "CUDA graph" if any(r.get("graph_us") for r in recs) else "eager"


def _timing_key(results) -> str:
    return "graph" if _mode_of(results) == "CUDA graph" else "eager"


def _table(header, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _sanitize(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_sanitize(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------- tables

def _header_lines(results) -> list[str]:
    prov = results["provenance"]
    ceil = results.get("ceiling") or {}
    lines = [f"device: {prov['device']} ({prov.get('sm_count') or 'no'} SMs) | mode: {prov['mode']} | "
             f"torch {prov['torch']} | triton {prov['triton']} | CUDA {prov.get('cuda')} | {prov['date_utc']}",
             f"command: {prov['command']}"]
    if ceil.get("tbs"):
        lines.append(f"read ceiling: {ceil['tbs']:.2f} TB/s (Triton read-and-sum of {ceil['buffer_bytes'] / 2**30:.3g}"
                     f" GiB, tile {ceil['best_tile']})")
    lines.append(f"L2: {results['settings'].get('l2_handling')}")
    if results["settings"].get("kv_cache"):
        lines.append(f"KV cache: {results['settings']['kv_cache']}")
    return lines


def _cell_status(r):
    return {"failed": "FAIL", "unavailable": "n/a", "error": "ERR"}.get(r["status"], "?")


def format_table(results) -> str:
    """The run's tables as text (markdown): times per method, then bandwidth, % of ceiling and ratio to cuDNN."""
    if results["kind"] == "sweep":
        return format_sweep_table(results)
    if results["kind"] == "host":
        return format_host_table(results)
    if results["kind"] == "ragged":
        from .ragged import format_ragged_table   # ragged imports the harness, which imports this module
        return format_ragged_table(results)
    recs = results["records"]
    methods = list(dict.fromkeys(r["method"] for r in recs))
    by_shape = {}
    for r in recs:
        by_shape.setdefault(_shape_key(r), {})[r["method"]] = r
    tk = _timing_key(results)
    t_rows, b_rows, e_rows = [], [], []
    for key, row in by_shape.items():
        any_r = next(iter(row.values()))
        lead = [any_r["dtype"], any_r["B"], f"{any_r['H_q']}:{any_r['H_kv']}", any_r["L"], f"{any_r['kv_mb']:.1f}"]
        tc, bc, ec = [], [], []
        for m in methods:
            r = row.get(m)
            if r is None:
                tc.append(""), bc.append(""), ec.append("")
                continue
            ec.append(_fmt(r.get("rel_err"), ".1e") + ("" if r["status"] == "ok" else f" {_cell_status(r)}"))
            if r["status"] != "ok":
                tc.append(_cell_status(r)), bc.append(_cell_status(r))
                continue
            tc.append(f"{_fmt(r.get('eager_us'))} / {_fmt(r.get('graph_us'))}")
            tbs = r.get(f"{tk}_tbs")
            pct = r.get(f"{tk}_pct_ceiling")
            ratio = r.get(f"{tk}_ratio_cudnn")
            bc.append(f"{_fmt(tbs, '.2f' if (tbs or 0) >= 0.01 else '.2g')} {_fmt(pct, '.0f')}%"
                      + (f" {ratio:.2f}x" if ratio else ""))
        t_rows.append(lead + tc)
        b_rows.append(lead + bc)
        e_rows.append(lead + ec)
    lead_h = ["dtype", "B", "H_q:H_kv", "L", "KV MB"]
    out = _header_lines(results)
    out += ["", "Time, µs (eager / CUDA graph; — = not measured, FAIL = wrong result, n/a = unavailable)",
            _table(lead_h + methods, t_rows),
            "", f"Effective bandwidth TB/s, % of read ceiling, time / cuDNN time ({tk} timings)",
            _table(lead_h + methods, b_rows),
            "", "Relative error ‖O − O_ref‖ / ‖O_ref‖",
            _table(lead_h + methods, e_rows)]
    for s in results.get("skipped", []):
        out.append(f"skipped: {_shape_label(s)} ({s['reason']})")
    notes = {r["method"]: r["reason"] for r in recs if r["status"] != "ok" and r.get("reason")}
    for m, why in notes.items():
        out.append(f"{m}: {why}")
    return "\n".join(out)


def format_sweep_table(results) -> str:
    rows = []
    ratios = {"fdlib_auto": [], "costmodel": [], "fa2_rule": []}
    for r in results["sweep"]:
        best = r.get("best") or {}
        ch = r.get("chosen", {})
        cells = [r["dtype"], r["B"], f"{r['H_q']}:{r['H_kv']}", r["L"], f"{r['kv_mb']:.1f}",
                 _fmt(best.get("splits"), "d"), _fmt(best.get("us")), _fmt(best.get("tbs"), ".2f")]
        for name in ("fdlib_auto", "costmodel"):
            c = ch.get(name, {})
            cells += [_fmt(c.get("splits"), "d"), _fmt(c.get("us")), _fmt(c.get("ratio_to_best"), ".2f")]
        for name in ratios:
            if ch.get(name, {}).get("ratio_to_best"):
                ratios[name].append(ch[name]["ratio_to_best"])
        cells.append(" ".join(f"{p['splits']}:{_fmt(p['us'], '.0f', p['status'])}" for p in r.get("points", [])))
        rows.append(cells)
    header = ["dtype", "B", "H_q:H_kv", "L", "KV MB", "best splits", "best µs", "best TB/s",
              "auto splits", "auto µs", "auto/best", "model splits", "model µs", "model/best", "splits:µs"]
    out = _header_lines(results)
    out += ["", f"Splits sweep of method='unified' ({results['settings']['timing']} timings)", _table(header, rows)]
    for name, v in ratios.items():
        if v:
            gm = math.exp(sum(map(math.log, v)) / len(v))
            out.append(f"{name}: geomean time / best = {gm:.3f}, worst = {max(v):.3f} over {len(v)} shapes")
        else:
            reasons = {c.get("chosen", {}).get(name, {}).get("reason") for c in results["sweep"]} - {None}
            out.append(f"{name}: no choice recorded" + (f" ({'; '.join(sorted(reasons))})" if reasons else ""))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- files

def default_out_dir(results) -> str:
    return os.path.join("results", device_slug(results))


def write_results(results, out_dir=None, name=None, force=False, plot=True, table=None) -> dict:
    """Write NAME.json, NAME.md and NAME.png into ``out_dir`` (default ``results/<device-slug>/``); ``table``
    formats NAME.md (default :func:`format_table`).

    NAME defaults to ``<kind>-<UTC timestamp>``, so runs never collide; an existing file is an error
    (FileExistsError) unless ``force``. Returns the paths written.
    """
    out_dir = out_dir or default_out_dir(results)
    if name is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        name = f"{results['kind']}-{stamp}"
    paths = {"json": os.path.join(out_dir, name + ".json"), "table": os.path.join(out_dir, name + ".md")}
    if plot:
        paths["plot"] = os.path.join(out_dir, name + ".png")
    existing = [p for p in paths.values() if os.path.exists(p)]
    if existing and not force:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}: pick another --name/--out or pass --force")
    os.makedirs(out_dir, exist_ok=True)
    with open(paths["json"], "w") as fh:
        json.dump(_sanitize(results), fh, indent=1)
        fh.write("\n")
    with open(paths["table"], "w") as fh:
        fh.write((table or format_table)(results) + "\n")
    if plot:
        fig = plot_results(results)
        fig.savefig(paths["plot"], dpi=DPI, bbox_inches="tight")
    return paths


def load_results(path, kind=None) -> dict:
    """A results dict from a JSON file written by :func:`write_results`, or from the newest one in a folder
    (``kind="bench"`` or ``"sweep"`` picks the newest of that kind)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json")]
        files = sorted((p for p in files if str(_peek(p, "schema") or "").startswith("fdlib.bench/")
                        and (kind is None or _peek(p, "kind") == kind)),
                       key=lambda p: (_date_of(p), p))
        if not files:
            raise FileNotFoundError(f"no {kind + ' ' if kind else ''}results (*.json) in {path}")
        path = files[-1]
    with open(path) as fh:
        results = json.load(fh)
    if not str(results.get("schema", "")).startswith("fdlib.bench/"):
        raise ValueError(f"{path}: not an fdlib.bench results file (schema {results.get('schema')!r})")
    results.setdefault("source", path)
    return results


def _peek(p, key):
    try:
        with open(p) as fh:
            return json.load(fh).get(key)
    except Exception:  # noqa: BLE001
        return None


def _date_of(p):
    try:
        with open(p) as fh:
            return json.load(fh)["provenance"]["date_utc"]
    except Exception:  # noqa: BLE001
        return ""


# ----------------------------------------------------------------------------------------------- plots

def plot_results(results, path=None):
    """The figure for a results dict (or a path to one). Returns a matplotlib Figure; saves it if ``path``."""
    if not isinstance(results, dict):
        results = load_results(results)
    prov = results["provenance"]
    mode = _mode_of(results)
    where = f"{prov['device']}, {mode}"
    if results["kind"] == "sweep":
        fig = _plot_sweep(results, where)
    else:
        fig = _plot_bench(results, where)
    if path:
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return fig


def _ratio_axis(ax):
    """A log axis of ratios (call it after plotting) labelled as plain multiples (0.95×, 2×), not as powers of
    ten (1.1 × 10⁰). Where the data span less than a decade, ticks at about eight round values (0.95×, 1×,
    1.05×, …: a log axis has few or no decade ticks there); over a wider span, the decades and the minor ticks
    of leading digit 2, 3 and 5, so labels never crowd."""
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    times = FuncFormatter(lambda y, _: f"{y:.3g}×")
    if hi / lo < 10:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(times)
        ax.set_ylim(lo, hi)
        return

    def minor(y, _):
        lead = int(round(y / 10 ** math.floor(math.log10(y) + 1e-9)))
        return f"{y:.3g}×" if lead in (2, 3, 5) else ""
    ax.yaxis.set_major_formatter(times)
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _plot_bench(results, where):
    recs = [r for r in results["records"] if r["status"] == "ok"]
    tk = _timing_key(results)
    shapes = list(dict.fromkeys(_shape_key(r) for r in results["records"]))
    labels = {}
    for r in results["records"]:
        labels.setdefault(_shape_key(r), _shape_label(r, short=True))
    methods = list(dict.fromkeys(r["method"] for r in results["records"]))
    fig = Figure(figsize=(max(10.0, 0.22 * len(shapes) + 4), 10))
    ax1, ax2 = fig.subplots(2, 1)

    # (a) time / cuDNN time per shape; a run without cuDNN (e.g. --methods auto,invariant) is drawn against its
    # first method instead, so the panel still compares what the run measured
    x = {k: i for i, k in enumerate(shapes)}
    has_cudnn = any(r.get(f"{tk}_ratio_cudnn") for r in recs)
    base = "cudnn" if has_cudnn else methods[0] if methods else None
    base_us = {_shape_key(r): r[f"{tk}_us"] for r in recs if r["method"] == base and r.get(f"{tk}_us")}
    base_label = "SDPA cuDNN" if has_cudnn else f"fdlib '{base}'"
    plotted = False
    for m in methods:
        if m == base:
            continue
        if has_cudnn:
            pts = [(x[_shape_key(r)], r[f"{tk}_ratio_cudnn"]) for r in recs
                   if r["method"] == m and r.get(f"{tk}_ratio_cudnn")]
        else:
            pts = [(x[_shape_key(r)], r[f"{tk}_us"] / base_us[_shape_key(r)]) for r in recs
                   if r["method"] == m and r.get(f"{tk}_us") and _shape_key(r) in base_us]
        if pts:
            xs, ys = zip(*pts)
            ax1.plot(xs, ys, marker="o", ms=4, lw=1, label=m, color=f"C{methods.index(m) % 10}")
            plotted = True
    short = "cuDNN" if has_cudnn else base
    ax1.axhline(1.0, color="k", lw=1, ls="--", label=f"{short} (= 1)")
    if plotted:
        _ratio_axis(ax1)
    else:
        ax1.text(0.5, 0.5, "one method only in this run: nothing to compare", transform=ax1.transAxes,
                 ha="center", va="center")
    ax1.set_xticks(range(len(shapes)))
    ax1.set_xticklabels([labels[k] for k in shapes], rotation=90, fontsize=6)
    ax1.set_xlim(-0.5, max(len(shapes) - 0.5, 0.5))
    ax1.set_xlabel(SHAPE_AXIS)
    ax1.set_ylabel(f"time / {short} time (×, lower is faster)")
    ax1.set_title(f"(a) decode-attention time relative to {base_label} — {where}")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, ncol=4)

    # (b) effective bandwidth vs KV size, with the read ceiling
    for m in methods:
        pts = sorted((r["kv_mb"], r[f"{tk}_tbs"]) for r in recs if r["method"] == m and r.get(f"{tk}_tbs"))
        if pts:
            xs, ys = zip(*pts)
            ax2.plot(xs, ys, marker="o", ms=3, lw=0, label=m, color=f"C{methods.index(m) % 10}")   # as in (a)
    ceil = (results.get("ceiling") or {}).get("tbs")
    if ceil:
        ax2.axhline(ceil, color="k", ls="--", lw=1.2, label=f"measured read ceiling {ceil:.2f} TB/s")
    ax2.set_xscale("log")
    ax2.set_xlabel("KV cache bytes read per call (MB, log scale)")
    ax2.set_ylabel("effective bandwidth (TB/s = KV bytes / time)")
    ax2.set_title(f"(b) effective bandwidth vs KV size — {where}")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, ncol=4)
    fig.suptitle(f"fdlib.bench — {where} — {results['provenance']['date_utc']}")
    fig.tight_layout()
    return fig


def _plot_sweep(results, where):
    rows = [r for r in results["sweep"] if r.get("best")]
    fig = Figure(figsize=(max(10.0, 0.22 * len(rows) + 4), 10))
    ax1, ax2 = fig.subplots(2, 1)
    for r in rows:
        pts = [(p["splits"], p["us"] / r["best"]["us"]) for p in r["points"] if p.get("us")]
        if pts:
            xs, ys = zip(*pts)
            line, = ax1.plot(xs, ys, lw=1, alpha=0.7, label=_shape_label(r, short=True))
            c = r["chosen"].get("fdlib_auto", {})
            if c.get("us"):
                ax1.plot([c["splits"]], [c["us"] / r["best"]["us"]], marker="o", color=line.get_color(), ms=5)
            c = r["chosen"].get("costmodel", {})
            if c.get("us"):
                ax1.plot([c["splits"]], [c["us"] / r["best"]["us"]], marker="*", color=line.get_color(), ms=9)
    ax1.set_xscale("log", base=2)
    _ratio_axis(ax1)
    ax1.set_xlabel("splits (log2 scale)   ● = fdlib auto's choice, ★ = cost model's choice")
    ax1.set_ylabel("time / best time over splits (×)")
    ax1.set_title(f"(a) unified kernel time vs split count, per shape — {where}")
    ax1.grid(True, which="both", alpha=0.3)
    if len(rows) <= 24:
        ax1.legend(fontsize=6, ncol=3)
    xs = range(len(rows))
    for off, name, label in ((-0.27, "fdlib_auto", "fdlib auto"), (0.0, "costmodel", "cost model"),
                             (0.27, "fa2_rule", "FA2 heuristic")):
        ys = [r["chosen"].get(name, {}).get("ratio_to_best") or 0 for r in rows]
        ax2.bar([i + off for i in xs], ys, width=0.27, label=label)
    ax2.axhline(1.0, color="k", lw=1, ls="--")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels([_shape_label(r, short=True) for r in rows], rotation=90, fontsize=6)
    ax2.set_xlabel(SHAPE_AXIS + "; no bar = no choice recorded")
    ax2.set_ylabel("time at chosen splits / best time (×)")
    ax2.set_title(f"(b) chosen vs best split count — {where}")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(f"fdlib.bench splits sweep — {where} — {results['provenance']['date_utc']}")
    fig.tight_layout()
    return fig
