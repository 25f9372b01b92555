"""Lab 07's "what the GPU shows": what batch invariance costs, and what the unified max saves, on an H200.

* The figure: time(``batch_invariant=True``) / time(``auto``) on every shape of the fp16 bench grid, against the
  KV length L, one line per batch size B and one panel per head layout H_q:H_kv (``invariant-fp16.json``, made by
  ``python -m fdlib.bench --methods auto,invariant``).
* The table: FlashDecoding++'s unified max (pass 1 adds the φ-scaled partials and marks rows, pass 2 recomputes
  the marked ones) and its pass 1 alone, each as time / time(unified kernel), with the share of rows recomputed
  (``unified-max.json``, made by ``python -m fdlib.bench.unified_max``).

Every time is a CUDA-graph replay. The numbers in the caption are computed here from the same files.
"""
from __future__ import annotations

from pathlib import Path

from . import RESULTS, Shown, gmean, load, provenance, shown_path, skipped_reason, view

INVARIANT = "invariant-fp16.json"
UNIFIED_MAX = "unified-max.json"
FULL, PASS1 = "unified_max:ticket", "unified_max:ticket:pass1"

Shape = tuple  # (B, H_q, H_kv, L)




def _graph_times(records) -> dict[Shape, dict[str, float]]:
    """{(B, H_q, H_kv, L): {method: CUDA-graph µs}} of the records that ran."""
    by: dict[Shape, dict[str, float]] = {}
    for r in records:
        if r["status"] == "ok" and r.get("graph_us"):
            by.setdefault((r["B"], r["H_q"], r["H_kv"], r["L"]), {})[r["method"]] = r["graph_us"]
    return by


def invariant_ratios(results_dir: Path) -> tuple[dict[Shape, float], dict, list[dict]]:
    """({shape: time(invariant) / time(auto)}, provenance, shapes skipped) of ``invariant-fp16.json``."""
    data = load(Path(results_dir) / INVARIANT)
    if not str(data.get("schema", "")).startswith("fdlib.bench/"):
        raise ValueError(f"{INVARIANT}: expected an fdlib.bench results file, got schema {data.get('schema')!r}")
    times = _graph_times(data["records"])
    return ({k: t["invariant"] / t["auto"] for k, t in times.items() if "invariant" in t and "auto" in t},
            data["provenance"], data.get("skipped", []))


def unified_max_rows(results_dir: Path) -> tuple[list[dict], dict]:
    """([{shape, unified µs, full ratio, pass-1 ratio, recompute rate}], provenance) of ``unified-max.json``."""
    data = load(Path(results_dir) / UNIFIED_MAX)
    if not str(data.get("schema", "")).startswith("fdlib.bench.unified_max/"):
        raise ValueError(f"{UNIFIED_MAX}: expected an fdlib.bench.unified_max file, got schema {data.get('schema')!r}")
    rates = {(r["B"], r["H_q"], r["H_kv"], r["L"]): r.get("recompute_rate", 0.0)
             for r in data["records"] if r["method"] == FULL and r["status"] == "ok"}
    rows = []
    for key, t in sorted(_graph_times(data["records"]).items()):
        if all(m in t for m in ("unified", FULL, PASS1)):
            rows.append({"shape": key, "unified_us": t["unified"], "full": t[FULL] / t["unified"],
                         "pass1": t[PASS1] / t["unified"], "recompute": rates[key]})
    return rows, data["provenance"]


def _shape(key: Shape) -> str:
    B, hq, hkv, L = key
    return f"B={B} {hq}:{hkv} L={L}"


def _keys(L: int) -> str:
    return f"{L // 1024}K" if L >= 1024 else str(L)


@view("exact")
def exact(results_dir: Path) -> Shown:
    """The cost of batch invariance (figure) and of the unified max (table) on an H200."""
    import matplotlib.pyplot as plt

    from ..figures import legend_outside

    ratio, prov, skipped = invariant_ratios(results_dir)
    layouts = sorted({k[1:3] for k in ratio}, key=lambda hk: hk[1])
    batches = sorted({k[0] for k in ratio})
    Ls = sorted({k[3] for k in ratio})
    colors = dict(zip(batches, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")))
    fig, axes = plt.subplots(1, len(layouts), figsize=(9.5, 3.8), sharey=True)
    axes = list(axes) if len(layouts) > 1 else [axes]
    for ax, (hq, hkv) in zip(axes, layouts):
        ax.axhline(1.0, color="k", ls="--", lw=1)
        for B in batches:
            pts = [(L, ratio[(B, hq, hkv, L)]) for L in Ls if (B, hq, hkv, L) in ratio]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[B], label=f"B = {B}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ls, [_keys(L) for L in Ls])
        ax.minorticks_off()
        ax.set_title(f"H_q:H_kv = {hq}:{hkv}")
        ax.set_xlabel("KV length L (keys)")
    axes[0].set_ylabel("time(batch_invariant) / time(auto)")
    legend_outside(axes[-1])
    fig.suptitle(f"The cost of batch invariance: fp16, D = 128, CUDA-graph times, recorded on {prov['device']} "
                 f"{prov['date_utc'][:10]}\nbelow the dashed line, batch_invariant=True is faster than auto",
                 fontsize=10.5)

    rows, um_prov = unified_max_rows(results_dir)
    table = [["shape", "unified kernel µs", "unified max ×", "its pass 1 alone ×", "rows recomputed"]]
    for r in rows:
        table.append([_shape(r["shape"]), f"{r['unified_us']:.1f}", f"{r['full']:.3f}", f"{r['pass1']:.3f}",
                      f"{r['recompute']:.0%}"])
    full_gm, pass1_gm = gmean(r["full"] for r in rows), gmean(r["pass1"] for r in rows)
    table.append(["geometric mean", "", f"{full_gm:.3f}", f"{pass1_gm:.3f}", ""])

    inv_path, um_path = (shown_path(Path(results_dir) / f) for f in (INVARIANT, UNIFIED_MAX))
    worst = max(ratio, key=ratio.get)
    best = min(ratio, key=ratio.get)
    short = [x for k, x in ratio.items() if k[3] <= 2048]
    long_ = [x for k, x in ratio.items() if k[3] >= 8192]
    fast1 = min(rows, key=lambda r: r["pass1"])
    not_run = (f" The grid's other {len(skipped)} shapes were not run "
               f"({skipped_reason(s['reason'] for s in skipped)}).") if skipped else ""
    caption = (
        f"Figure: {inv_path}, recorded on {provenance(prov)}. Over its {len(ratio)} shapes, "
        f"time(batch_invariant) / time(auto) has a geometric mean of {gmean(ratio.values()):.3f}, from {ratio[best]:.2f} "
        f"({_shape(best)}) to {ratio[worst]:.2f} ({_shape(worst)}), below 1 on {sum(x < 1 for x in ratio.values())}; "
        f"{gmean(short):.3f} over the {len(short)} shapes with L <= 2048 and {gmean(long_):.3f} over the "
        f"{len(long_)} with L >= 8192.{not_run}\n"
        f"Table: {um_path}, recorded on {provenance(um_prov)}. Each time is divided by the "
        f"unified kernel's (< 1: faster). The unified max is faster on {sum(r['full'] < 1 for r in rows)} of {len(rows)} shapes; "
        f"pass 1 alone on {sum(r['pass1'] < 1 for r in rows)}, most on {_shape(fast1['shape'])} "
        f"({fast1['pass1']:.3f}); the most rows recomputed in any call: {max(r['recompute'] for r in rows):.0%}.")
    return Shown(fig, table, caption, [inv_path, um_path])


# ------------------------------------------------------------- batch_invariant=True: two schedules, on an H100
INVARIANT_SERVING = RESULTS.parent / "h100" / "worklist" / "serving.json"
"""A ``--serving`` run of Lab 06's seven batches with the two batch-invariant rows, on an H100."""
LONG_ROWS = 8192
"""The table's grouping: batches whose rows may reach this many keys (the longest row drawn), and the others."""
INVARIANT_ROWS = (("invariant", "invariant kernel"), ("worklist+invariant", "work list, invariant"))
"""The two batch-invariant rows of :data:`INVARIANT_SERVING`: (row, heading). ``invariant``:
``batch_invariant=True`` (the invariant kernel); ``worklist+invariant``: ``method="worklist", batch_invariant=True``
(pieces by each row's length alone)."""


def invariant_schedules(path=None) -> str:
    """The two batch-invariant schedules on Lab 06's serving batches, as printed text: per batch and cache, each
    one's µs and × the host-lengths plan, and the work list's time over the invariant kernel's; then how many
    batches of long rows (a row that may reach :data:`LONG_ROWS` keys) the work list is faster on, and
    its span on the others; a caption naming the file."""
    from . import format_rows, wrap_caption
    from .lab06 import CACHES, cache_name, load_serving, span_text
    run = load_serving(INVARIANT_SERVING if path is None else path)
    rows = [["#", "batch", "cache", *(h for _, h in INVARIANT_ROWS), "work list / kernel"]]
    over = {}
    for case, c in sorted(run.cases.items()):
        for layout in CACHES:
            over[case, layout] = run.us(case, layout, "worklist+invariant") / run.us(case, layout, "invariant")
            rows.append([str(case), c["name"].split(",")[0], cache_name(layout, run),
                         *(f"{run.us(case, layout, r):.1f} µs {run.ratio(case, layout, r):.2f}×"
                           for r, _ in INVARIANT_ROWS), f"{over[case, layout]:.2f}"])
    long_ = [k for k in over if max(run.cases[k[0]]["lengths"]) >= LONG_ROWS]
    short = sorted({k[0] for k in over} - {k[0] for k in long_})
    faster = [k for k in long_ if over[k] < 1]
    lines = [format_rows(rows), "",
             f"Batches whose rows may reach {LONG_ROWS} keys, two caches each: the work list faster in "
             f"{len(faster)} of {len(long_)},",
             f"  {min(over[k] for k in long_):.2f}-{max(over[k] for k in long_):.2f}× the kernel's time"]
    lines += [f"Batch {n}, {run.cases[n]['name']}: the work list "
              f"{span_text(run.span(n, 'worklist+invariant', 'invariant'))} the kernel's time" for n in short]
    lines += ["", wrap_caption(
        f"{shown_path(run.path)} (Lab 06's serving batches, bf16, D = 128), recorded on {run.device} {run.date}: "
        f"CUDA-graph times, × the time of the plan made from the host lengths.")]
    return "\n".join(lines)
