r"""Lab 06's "what the GPU shows": ``auto`` on the ragged grid of an H200, from a contiguous cache and from pages.

The grid is ``python -m fdlib.bench --ragged``: B = 8, 32, 128 sequences, H_q:H_kv = 32:8 and 32:32, D = 128, fp16,
lengths constant, uniform or Zipf-like of mean 1024, 8192 or 32768 keys. Every batch is planned from its lengths
(``fdlib.plan(..., lengths=...)``) and timed as a CUDA graph (one recorded launch replayed, so the host adds almost
nothing); a batch's effective bandwidth is

.. math:: \frac{\text{K/V bytes of its rows}}{\text{time}} \Big/ \text{read ceiling},

the ceiling being the fastest plain read of a large buffer measured in the same run (Lab 01). The view
(:func:`ragged`, registered as ``"ragged"``) plots that share against the bytes read, coloured by the schedule
``auto`` ran, and tabulates it per length mix and cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import RESULTS, Shown, gmean, skipped_reason, view

CONTIGUOUS = "ragged-fp16-auto.json"
PAGED = "ragged-fp16-page16-auto.json"
"""The runs the view reads: ``auto`` alone, contiguous and in pages of 16 keys (shuffled), one device call (each
file's provenance names its commit and command; results/README.md the runs around it)."""
TIMELINE = "timeline-uniform.json"
"""The H200's recorded timelines of Lab 06's uniform batch (``tools/record_timeline.py``)."""
LARGE_MB = 512
"""Batches of at least this many MB of K/V are large enough that fixed costs should not matter."""
TARGET_PCT = 90
DISTS = ("constant", "uniform", "zipf")
DIST_NAMES = {"constant": "constant", "uniform": "uniform", "zipf": "Zipf-like"}
MARKERS = {"constant": "s", "uniform": "o", "zipf": "^"}
SCHEDULES = {
    "unified": ("unified, rows in grid order", "unified", "#1f77b4"),
    "longest-first": ("unified, longest rows first", "longest first", "#17becf"),
    "persistent": ("persistent", "persistent", "#2ca02c"),
    "streamk": ("stream-K", "stream-K", "#ff7f0e"),
    "balanced": ("balanced (chunked)", "balanced", "#9467bd"),
    "split": ("two-stage split", "split", "#8c564b"),
}
"""Each schedule ``auto`` can run: (legend label, table name, colour)."""


@dataclass
class Grid:
    """One recorded ``--ragged`` run: its ``auto`` records by (B, H_q, H_kv, dist, mean), its ceiling and
    provenance."""
    name: str
    page_size: int
    ceiling_tbs: float
    device: str
    date: str
    records: dict
    skipped: list

    @property
    def cache(self) -> str:
        return f"pages of {self.page_size}" if self.page_size else "contiguous"


def load_grid(path) -> Grid:
    """The ``auto`` records of one ``results/.../ragged-*.json`` file (status ok, CUDA-graph time present)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"results_dir: expected the recorded run {path.name} in {path.parent}, found none")
    data = json.loads(path.read_text())
    if data.get("kind") != "ragged":
        raise ValueError(f"{path.name}: expected a --ragged run (kind 'ragged'), got kind {data.get('kind')!r}")
    prov = data["provenance"]
    recs = {(r["B"], r["H_q"], r["H_kv"], r["dist"], r["mean"]): r for r in data["records"]
            if r["method"] == "auto" and r["status"] == "ok" and r.get("graph_us")}
    return Grid(path.name, int(data["settings"].get("page_size") or 0), float(data["ceiling"]["tbs"]),
                prov["device"], prov["date_utc"][:10], recs, [s["reason"] for s in data.get("skipped", [])])


def skipped_text(g: Grid) -> str:
    """Why a run has fewer batches than the grid: '' or ', N skipped: <why>' (:func:`fdlib.course.measured.skipped_reason`)."""
    if not g.skipped:
        return ""
    return f", {len(g.skipped)} skipped: {skipped_reason(g.skipped)}"


def schedule_of(record: dict) -> str:
    """The key of :data:`SCHEDULES` for what ``auto`` ran on a batch."""
    kernel = record["kernel"]
    if kernel == "unified" and record.get("longest_first"):
        return "longest-first"
    if kernel not in SCHEDULES:
        raise ValueError(f"record: unknown kernel {kernel!r} (expected one of {sorted(SCHEDULES)})")
    return kernel



def table_rows(grids) -> list[list[str]]:
    """Header, then one row per cache and length mix: the geometric mean share of the read ceiling, and how many
    of the batches of at least :data:`LARGE_MB` MB reach :data:`TARGET_PCT` (the schedules: :func:`schedule_rows`)."""
    rows = [["cache", "lengths", "% ceiling", f">= {TARGET_PCT}% (>= {LARGE_MB} MB)"]]
    for g in grids:
        for dist in DISTS:
            recs = [r for k, r in g.records.items() if k[3] == dist]
            large = [r for r in recs if r["kv_mb"] >= LARGE_MB]
            rows.append([g.cache, DIST_NAMES[dist], f"{gmean(r['pct_ceiling'] for r in recs):.1f}",
                         f"{sum(r['pct_ceiling'] >= TARGET_PCT for r in large)} of {len(large)}"])
    return rows


def schedule_rows(grids) -> list[list[str]]:
    """Header, then per side of the :data:`LARGE_MB` line (right first) and cache: the schedules ``auto`` ran on
    the batches of equal lengths and on the ragged ones, each with its number of batches (most used first)."""
    def ran(recs):
        used: dict = {}
        for r in recs:
            used[schedule_of(r)] = used.get(schedule_of(r), 0) + 1
        return ", ".join(f"{SCHEDULES[s][1]} {n}" for s, n in sorted(used.items(), key=lambda kv: (-kv[1], kv[0])))

    rows = [["batches", "cache", "equal lengths", "ragged lengths"]]
    for side, large in ((f">= {LARGE_MB} MB", True), (f"< {LARGE_MB} MB", False)):
        for g in grids:
            recs = [r for r in g.records.values() if (r["kv_mb"] >= LARGE_MB) == large]
            rows.append([side, g.cache, ran(r for r in recs if r["dist"] == "constant"),
                         ran(r for r in recs if r["dist"] != "constant")])
    return rows


def schedules(results_dir=None) -> str:
    """The schedules ``auto`` ran in the view's two runs, by side of the :data:`LARGE_MB` line, as printed text
    (:func:`schedule_rows`)."""
    from . import format_rows
    d = Path(results_dir if results_dir is not None else RESULTS)
    return format_rows(schedule_rows([load_grid(d / CONTIGUOUS), load_grid(d / PAGED)]))


def recorded_makespans(results_dir=None, name: str = TIMELINE) -> dict:
    """{method: makespan µs} of the H200's recorded timelines of a Lab 06 batch (the median of each method's
    runs), and under "file" the file's name from the repository root, under "lengths" the batch's lengths."""
    import statistics

    from ..timeline import load_recorded
    from . import shown_path
    path = Path(results_dir if results_dir is not None else RESULTS) / name
    tls = load_recorded(path)
    out = {tl.info["method"]: statistics.median(tl.info["makespans_us"]) for tl in tls}
    return {**out, "file": shown_path(path), "lengths": list(tls[0].info["batch"]["lengths"])}


def paged_over_contiguous(contiguous: Grid, paged: Grid) -> dict:
    """time(pages) / time(contiguous) on the batches of equal lengths both runs timed (the same lengths: ragged
    draws differ between a paged and a contiguous grid, equal lengths do not)."""
    keys = sorted(k for k in contiguous.records if k[3] == "constant" and k in paged.records)
    return {k: paged.records[k]["graph_us"] / contiguous.records[k]["graph_us"] for k in keys}


def draw(grids):
    """Two panels (one per cache): share of the read ceiling against K/V MB, colour the schedule, marker the
    length mix. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from ..figures import plain_ticks

    fig, axes = plt.subplots(1, len(grids), figsize=(11, 4.2), sharey=True, squeeze=False)
    seen = set()
    for ax, g in zip(axes[0], grids):
        for r in g.records.values():
            s = schedule_of(r)
            seen.add(s)
            ax.scatter(r["kv_mb"], r["pct_ceiling"], marker=MARKERS[r["dist"]], s=42, color=SCHEDULES[s][2],
                       edgecolor="black", linewidth=0.4, zorder=3)
        ax.axhline(TARGET_PCT, color="0.35", ls=":", lw=1)
        ax.axvline(LARGE_MB, color="0.35", ls="--", lw=0.8)
        ax.set_xscale("log")
        plain_ticks(ax, "x")
        ax.set_xlabel("K/V bytes the batch reads (MB, log scale)")
        ax.set_title(f"{g.cache} cache" if not g.page_size else f"{g.cache} keys (shuffled in the pool)")
    axes[0, 0].set_ylabel("auto: % of the read ceiling")
    handles = [Line2D([], [], ls="", marker="o", color=SCHEDULES[s][2], markeredgecolor="black", label=SCHEDULES[s][0])
               for s in SCHEDULES if s in seen]
    handles += [Line2D([], [], ls="", marker=MARKERS[d], color="0.6", markeredgecolor="black",
                       label=f"{DIST_NAMES[d]} lengths") for d in DISTS]
    handles += [Line2D([], [], color="0.35", ls=":", label=f"{TARGET_PCT}% of the ceiling"),
                Line2D([], [], color="0.35", ls="--", lw=0.8, label=f"{LARGE_MB} MB")]
    axes[0, -1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    g = grids[0]
    fig.suptitle(f"fdlib auto on ragged batches: fp16, D=128, CUDA graphs, each batch planned from its lengths\n"
                 f"recorded on {g.device} {g.date}")
    return fig


@view("ragged")
def ragged(results_dir) -> Shown:
    """``auto`` on the ragged grid, contiguous and in pages of 16 (:data:`CONTIGUOUS`, :data:`PAGED`)."""
    results_dir = Path(results_dir)
    contiguous, paged = load_grid(results_dir / CONTIGUOUS), load_grid(results_dir / PAGED)
    grids = [contiguous, paged]
    fig = draw(grids)
    ratio = paged_over_contiguous(contiguous, paged)
    worst = max(ratio, key=ratio.get)
    caption = (
        f"Figure and table: fdlib's auto alone on the ragged grid, recorded on {contiguous.device} "
        f"{contiguous.date} (read ceilings {contiguous.ceiling_tbs:.2f} and {paged.ceiling_tbs:.2f} TB/s): "
        f"results/h200/{CONTIGUOUS} ({len(contiguous.records)} batches{skipped_text(contiguous)}) and "
        f"results/h200/{PAGED} ({len(paged.records)} batches{skipped_text(paged)}).\n"
        f"Pages of {paged.page_size} against the contiguous cache on the {len(ratio)} batches of equal lengths: "
        f"time ratio {gmean(ratio.values()):.3f} in geometric mean, worst {ratio[worst]:.3f} "
        f"(B={worst[0]} {worst[1]}:{worst[2]}, {worst[4]} keys, {paged.records[worst]['kv_mb']:.0f} MB).\n"
        f"% ceiling: the geometric mean over a row's batches of (K/V bytes / time) / read ceiling; >= {TARGET_PCT}%: "
        f"how many of its batches of at least {LARGE_MB} MB read {TARGET_PCT}% of the ceiling or more.")
    return Shown(fig, table_rows(grids), caption, [f"results/h200/{CONTIGUOUS}", f"results/h200/{PAGED}"])


# ------------------------------------------------------------------------------------ the serving batches, on an H100
SERVING = RESULTS.parent / "h100" / "streamk-lean" / "final" / "serving.json"
"""``python -m fdlib.bench --serving`` on an H100: seven serving batches (bf16, D = 128), pages of 16 (shuffled) and a
contiguous cache, CUDA-graph times, the read ceiling measured in the same run. Its rows (a record's ``row``):
``plan_host`` (planned from the host lengths), ``default`` (``decode_attention`` with the lengths on the device:
stream-K for two or more sequences, :func:`fdlib.plan.device_schedule_suits`) and ``captured`` (that plan
captured in a graph before the lengths are known, replayed with them)."""
SERVING_BEFORE = RESULTS.parent / "h100" / "worklist" / "serving.json"
"""The same batches, an earlier run whose ``default`` rows planned every row for L_max (the device schedule off)."""
SERVING_WORKLIST = RESULTS.parent / "h100" / "streamk-device" / "serving-streamk.json"
"""The same batches, a run whose ``default`` rows ran section 4's work list sized by the batch (kernel
``worklist``) on batches 1-5."""
EQUAL_ROWS = RESULTS.parent / "h100" / "streamk-lean" / "final" / "ab-equal-rows.json"
"""``tools/ab_ragged.py``: ``auto`` from host lengths against stream-K planned without them (``streamk+device``), on
batches of equal rows among others."""
SERVING_COLUMNS = (("default", "default call"), ("captured", "captured"))
"""The serving table's columns after the host-lengths plan: (row, heading)."""
CACHES = ("paged", "contiguous")


@dataclass
class Serving:
    """One ``--serving`` run: its records by (case, layout, row), the cases by number, ceiling and provenance."""
    path: Path
    records: dict
    cases: dict
    ceiling_tbs: float
    device: str
    date: str

    def us(self, case: int, layout: str, row: str) -> float:
        return self.records[case, layout, row]["graph_us"]

    def ratio(self, case: int, layout: str, row: str) -> float:
        """time(row) / time(the host-lengths plan) on one batch and cache."""
        return self.us(case, layout, row) / self.us(case, layout, "plan_host")

    def span(self, case: int, row: str, over: str = "plan_host") -> tuple[float, float]:
        """(least, most) of time(row) / time(over) over the two caches."""
        xs = [self.us(case, lay, row) / self.us(case, lay, over) for lay in CACHES]
        return min(xs), max(xs)


def load_serving(path=None) -> Serving:
    """The records of a ``--serving`` run (status ok, a CUDA-graph time), or a named error."""
    path = Path(path if path is not None else SERVING)
    if not path.exists():
        raise FileNotFoundError(f"path: expected the recorded serving run {path.name} in {path.parent}, found none")
    data = json.loads(path.read_text())
    if data.get("kind") != "serving":
        raise ValueError(f"{path.name}: expected a --serving run (kind 'serving'), got kind {data.get('kind')!r}")
    recs = {(r["case"], r["layout"], r["row"]): r for r in data["records"] if r["status"] == "ok" and r.get("graph_us")}
    prov = data["provenance"]
    return Serving(path, recs, {c["case"]: c for c in data["cases"]}, float(data["ceiling"]["tbs"]), prov["device"],
                   prov["date_utc"][:10])


def cache_name(layout: str, run: Serving) -> str:
    page = {r["page_size"] for k, r in run.records.items() if k[1] == "paged"}
    return f"pages of {page.pop()}" if layout == "paged" and len(page) == 1 else layout


def serving_rows(run: Serving) -> list[list[str]]:
    """Header, then per batch and cache: the host-lengths plan (µs, % of the ceiling), then each of
    :data:`SERVING_COLUMNS` as µs, × the host-lengths plan, % of the ceiling."""
    rows = [["#", "cache", "host lengths", *(h for _, h in SERVING_COLUMNS)]]
    for case in sorted(run.cases):
        for layout in CACHES:
            host = run.records[case, layout, "plan_host"]
            cells = [f"{run.us(case, layout, row):.1f} µs {run.ratio(case, layout, row):.2f}× "
                     f"{run.records[case, layout, row]['pct_ceiling']:.0f}%" for row, _ in SERVING_COLUMNS]
            rows.append([str(case), cache_name(layout, run), f"{host['graph_us']:.1f} µs {host['pct_ceiling']:.0f}%",
                         *cells])
    return rows


def span_text(lo_hi) -> str:
    lo, hi = lo_hi
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}×"


def serving_findings(run: Serving, before: Serving, worklist_run: Serving, equal: list) -> dict:
    """What the lesson reads, each a (least, most) span of time / the host-lengths plan's: ``default`` and
    ``captured`` over every batch and cache of ``run`` (``pct``: the default's % of the ceiling), ``streamk``: the
    batches where the default ran stream-K, and ``same``: whether the host plan ran it there too; ``before``: the
    plan for L_max on the batch with one long row (``one_long``); ``worklist``: the work list sized by the batch,
    per cache, over the batches it ran; ``equal``: stream-K planned without lengths over ``auto`` from host lengths
    on the equal-row batches of ``equal`` (records of an ab_ragged run)."""
    keys = [(n, lay) for n in sorted(run.cases) for lay in CACHES]
    ratios = {row: [run.ratio(n, lay, row) for n, lay in keys] for row, _ in SERVING_COLUMNS}
    pct = [run.records[n, lay, "default"]["pct_ceiling"] for n, lay in keys]
    streamk = [n for n in sorted(run.cases) if all(run.records[n, lay, "default"]["kernel"] == "streamk"
                                                   for lay in CACHES)]
    same = all(run.records[n, lay, "plan_host"]["kernel"] == "streamk" for n in streamk for lay in CACHES)
    one_long = next(n for n, c in before.cases.items() if c["law"][0] == "one_long")
    wl = {lay: [worklist_run.ratio(n, lay, "default") for n in sorted(worklist_run.cases)
                if worklist_run.records[n, lay, "default"]["kernel"] == "worklist"] for lay in CACHES}
    by = {}
    for r in equal:
        if r["dist"] == "constant" and r["status"] == "ok":
            by.setdefault((r["B"], r["H_q"], r["H_kv"], r["mean"], r["page_size"]), {})[r["method"]] = r["graph_us"]
    eq = [m["streamk+device"] / m["auto"] for m in by.values() if {"auto", "streamk+device"} <= set(m)]
    return {"default": (min(ratios["default"]), max(ratios["default"])), "pct": (min(pct), max(pct)),
            "captured": (min(ratios["captured"]), max(ratios["captured"])), "streamk": streamk, "same": same,
            "one_long": one_long, "before": before.span(one_long, "default"),
            "worklist": {lay: (min(x), max(x)) for lay, x in wl.items()}, "wl_batches": len(wl["paged"]),
            "equal": (min(eq), max(eq)), "equal_batches": len(eq)}


def batches_text(ns) -> str:
    return f"{ns[0]}-{ns[-1]}" if ns == list(range(ns[0], ns[-1] + 1)) else ", ".join(map(str, ns))


def serving(path=None) -> str:
    """The serving batches as printed text: the batches, the table (:func:`serving_rows`), what the lesson reads
    (:func:`serving_findings`, with the earlier runs of :data:`SERVING_BEFORE`, :data:`SERVING_WORKLIST` and
    :data:`EQUAL_ROWS`), and a caption naming the files."""
    from . import format_rows, shown_path, wrap_caption
    run = load_serving(path)
    before, wl_run = load_serving(SERVING_BEFORE), load_serving(SERVING_WORKLIST)
    if not EQUAL_ROWS.exists():
        raise FileNotFoundError(f"path: expected the recorded run {EQUAL_ROWS.name} in {EQUAL_ROWS.parent}, found none")
    f = serving_findings(run, before, wl_run, json.loads(EQUAL_ROWS.read_text())["records"])
    pct = f"{f['pct'][0]:.0f}-{f['pct'][1]:.0f}%"
    lines = ["The batches (bf16, D = 128):"]
    lines += [f"  {n}  {c['name']}, {run.records[n, 'paged', 'plan_host']['kv_mb']:.0f} MB of K and V"
              for n, c in sorted(run.cases.items())]
    lines += ["", format_rows(serving_rows(run)), "", "× the host-lengths plan:",
              f"  default call: {span_text(f['default'])} on every batch and cache, {pct} of the ceiling; "
              f"stream-K on batches {batches_text(f['streamk'])}",
              f"  (the host plan ran stream-K there too: {'the same launch' if f['same'] else 'not everywhere'})",
              f"  captured: {span_text(f['captured'])}",
              f"  before, planned for L_max: batch {f['one_long']}, one long row, {span_text(f['before'])}",
              f"  section 4's work list sized by the batch ({f['wl_batches']} batches): contiguous "
              f"{span_text(f['worklist']['contiguous'])}, pages of 16 {span_text(f['worklist']['paged'])}",
              f"  stream-K without lengths on {f['equal_batches']} batches of equal rows, over auto with host lengths: "
              f"{span_text(f['equal'])}", ""]
    lines.append(wrap_caption(
        f"{shown_path(run.path)}, recorded on {run.device} {run.date}: CUDA-graph times (µs), × the host-lengths "
        f"plan's, % of the read ceiling ({run.ceiling_tbs:.2f} TB/s, measured in the same run). host lengths: "
        f"planned from the lengths on the host; default call: decode_attention with the lengths on the device; "
        f"captured: the same plan captured in a CUDA graph before the lengths are known and replayed with them. "
        f"Other runs on the same GPU: {shown_path(before.path)} (the plan for L_max), "
        f"{shown_path(wl_run.path)} (the work list), {shown_path(EQUAL_ROWS)} (equal rows)."))
    return "\n".join(lines)
