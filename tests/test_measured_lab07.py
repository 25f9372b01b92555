"""Lab 07's "what the GPU shows" view draws the committed files' numbers, and says which files they are.

The expected values are read here from the files' own derived fields (the ratios and summary that the benchmark
wrote beside its times), not through the view's parsing."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from fdlib.course.measured import RESULTS, names, show_measured  # noqa: E402
from fdlib.course.measured import lab07 as view07  # noqa: E402


@pytest.fixture(scope="module")
def shown():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = show_measured("exact", show=False)
    yield s
    plt.close(s.figure)


def _records(name):
    return json.loads((RESULTS / name).read_text())


def test_registered():
    assert "exact" in names()


def test_table_is_the_unified_max_file(shown):
    data = _records(view07.UNIFIED_MAX)
    want = {(r["B"], r["H_q"], r["H_kv"], r["L"], r["method"]): r for r in data["records"] if r["status"] == "ok"}
    header, *rows, last = shown.table
    assert header[2] == "unified max ×" and header[3] == "its pass 1 alone ×"
    assert len(rows) == 11
    for row in rows:
        B, hl, L = row[0].split()
        key = (int(B[2:]), *map(int, hl.split(":")), int(L[2:]))
        assert row[1] == f"{want[(*key, 'unified')]['graph_us']:.1f}"
        assert row[2] == f"{want[(*key, view07.FULL)]['graph_ratio_unified']:.3f}"
        assert row[3] == f"{want[(*key, view07.PASS1)]['graph_ratio_unified']:.3f}"
    assert last[2] == f"{data['summary'][view07.FULL]['graph_geomean_ratio']:.3f}"
    assert last[3] == f"{data['summary'][view07.PASS1]['graph_geomean_ratio']:.3f}"


def _invariant_ratios() -> dict:
    """{(B, H_q, H_kv, L): time(invariant) / time(auto)}, read from the file's records here."""
    data = _records(view07.INVARIANT)
    t = {}
    for r in data["records"]:
        if r["status"] == "ok":
            t.setdefault((r["B"], r["H_q"], r["H_kv"], r["L"]), {})[r["method"]] = r["graph_us"]
    return {k: v["invariant"] / v["auto"] for k, v in t.items()}


def test_figure_is_the_invariant_file(shown):
    ratios = _invariant_ratios()
    axes = shown.figure.axes
    assert [ax.get_title() for ax in axes] == ["H_q:H_kv = 32:8", "H_q:H_kv = 32:32"]
    drawn = 0
    for ax in axes:
        hq, hkv = map(int, ax.get_title().split("= ")[1].split(":"))
        for line in ax.get_lines()[1:]:                  # the first line is the dashed 1.0
            B = int(line.get_label().split("= ")[1])
            for L, y in zip(line.get_xdata(), line.get_ydata()):
                assert y == pytest.approx(ratios[(B, hq, hkv, int(L))], rel=1e-12)
                drawn += 1
    assert drawn == len(ratios) == 36
    gm = math.exp(sum(math.log(x) for x in ratios.values()) / len(ratios))
    assert f"geometric mean of {gm:.3f}" in " ".join(shown.caption.split())


def test_caption_names_the_files(shown):
    assert "results/h200/invariant-fp16.json" in shown.caption
    assert "results/h200/unified-max.json" in shown.caption
    assert shown.sources == ["results/h200/invariant-fp16.json", "results/h200/unified-max.json"]
    assert all((Path(RESULTS).parents[1] / s).exists() for s in shown.sources)


def test_the_caption_counts_what_the_table_prints(shown):
    """"The unified max is faster on N of 11 shapes": N printed ratios read below 1 (enough digits to see it)."""
    _, *rows, _ = shown.table
    caption = " ".join(shown.caption.split())
    full = sum(float(r[2]) < 1 for r in rows)
    pass1 = sum(float(r[3]) < 1 for r in rows)
    assert f"The unified max is faster on {full} of {len(rows)} shapes; pass 1 alone on {pass1}," in caption
    assert full >= 1 and any(r[2].startswith("0.") for r in rows)


LESSON = Path(RESULTS).parents[1] / "notebooks" / "src" / "07_exact_decode.md"


def test_what_the_lesson_says_about_the_figure_and_table_holds(shown):
    """Lab 07's reading of the figure and the table, in its words, against the files."""
    text = " ".join(LESSON.read_text(encoding="utf-8").split())
    for words in ("Batch invariance costs least on long caches (the caption's mean over L ≥ 8192)",
                  "Short rows cost more on average and vary most",
                  "The slowest and fastest shapes (caption) are both short rows",
                  "On average the unified max is slower than the unified kernel, even with no row recomputed",
                  "Pass 1 alone gains clearly only on the shortest step"):
        assert words in text, words
    ratio = _invariant_ratios()

    def gm(xs):
        xs = list(xs)
        return math.exp(sum(map(math.log, xs)) / len(xs))

    short = [x for k, x in ratio.items() if k[3] <= 2048]
    long_ = [x for k, x in ratio.items() if k[3] >= 8192]
    assert gm(short) > gm(long_) and max(short) - min(short) > max(long_) - min(long_)
    assert max(ratio, key=ratio.get)[3] <= 2048 and min(ratio, key=ratio.get)[3] <= 2048
    caption = " ".join(shown.caption.split())
    assert f"{gm(short):.3f} over the {len(short)} shapes with L <= 2048 and {gm(long_):.3f} over the " \
           f"{len(long_)} with L >= 8192" in caption
    assert f"below 1 on {sum(x < 1 for x in ratio.values())};" in caption
    um = _records(view07.UNIFIED_MAX)
    assert um["summary"][view07.FULL]["graph_geomean_ratio"] > 1
    _, *rows, _ = shown.table
    assert all(r[4] == "0%" for r in rows)
    shortest = min(rows, key=lambda r: float(r[1]))
    assert float(shortest[3]) < 0.9 and all(float(r[3]) > 0.98 for r in rows if r is not shortest)


def test_the_window_the_lesson_writes_is_fdlibs():
    """w_lo = ln L − 125 ln 2 (above the end of the normal range, −126 ln 2 = −87.34, for every L) and the
    w_hi the lesson writes are what fdlib.exact.default_window returns."""
    from fdlib import exact
    text = " ".join(LESSON.read_text(encoding="utf-8").split())
    assert "normal above $e^{-87.34}$ = 2^−126" in text and "w_lo = ln L − 125 ln 2" in text
    assert "w_hi = ln(float32's largest) − ln L − ln 65504" in text
    assert f"{exact.LN_FLT_MIN:.2f}" == "-87.34" and math.isclose(exact.LN_FLT_MIN, -126 * math.log(2))
    for L in (1, 2, 4096, 131072):
        w = exact.default_window(L)
        assert math.isclose(w.lo, math.log(L) - 125 * math.log(2), rel_tol=1e-12) and w.lo > exact.LN_FLT_MIN
        assert math.isclose(w.hi, exact.LN_FLT_MAX - math.log(L) - math.log(65504), rel_tol=1e-12)
    assert "an underflow only loses a tiny term" not in text


# ------------------------------------------ batch_invariant=True: the invariant kernel and the work list (H100)
def _serving():
    data = json.loads(view07.INVARIANT_SERVING.read_text())
    return data, {(r["case"], r["layout"], r["row"]): r["graph_us"] for r in data["records"] if r["status"] == "ok"}


def test_the_invariant_schedules_table_is_the_serving_file():
    """Every cell of invariant_schedules() recomputed from the raw JSON of Lab 06's serving run."""
    data, t = _serving()
    text = view07.invariant_schedules()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 110
    assert [c.strip() for c in lines[0].split("  ") if c.strip()] == ["#", "batch", "cache", "invariant kernel",
                                                                    "work list, invariant", "work list / kernel"]
    i = 2
    for c in sorted(data["cases"], key=lambda c: c["case"]):
        for lay, cache in (("paged", "pages of 16"), ("contiguous", "contiguous")):
            host = t[c["case"], lay, "plan_host"]
            kern, wl = t[c["case"], lay, "invariant"], t[c["case"], lay, "worklist+invariant"]
            want = [str(c["case"]), c["name"].split(",")[0], cache, f"{kern:.1f} µs {kern / host:.2f}×",
                    f"{wl:.1f} µs {wl / host:.2f}×", f"{wl / kern:.2f}"]
            assert [x.strip() for x in lines[i].split("  ") if x.strip()] == want, lines[i]
            i += 1
    flat = " ".join(text.split())
    assert f"recorded on {data['provenance']['device']} {data['provenance']['date_utc'][:10]}" in flat
    assert "results/h100/worklist/serving.json" in flat


def test_what_the_lesson_says_about_the_invariant_work_list_holds():
    """Lab 07: the work list with batch_invariant=True cuts each row by its length alone, max(4, ⌈tiles/32⌉)
    tiles (the invariant kernel's formula's shape, max(1, ⌈tiles/16⌉)), merged in piece order; faster than the
    invariant kernel in 11 of the 12 (batch, cache) pairs whose rows may reach 8192 keys, 1.58-1.69× on 256 rows
    of up to 2048 keys; batch_invariant=True keeps the invariant kernel. Each number the prose writes is printed
    by the cell."""
    import torch

    from fdlib import worklist
    from fdlib.kernels import invariant
    from fdlib.plan import WORK_CHUNK_TILES, WORK_SPLITS, decide
    WORK_MIN_L = view07.LONG_ROWS
    text = " ".join(LESSON.read_text(encoding="utf-8").split())
    assert ("`method=\"worklist\", batch_invariant=True` cuts each row by its own length alone, into at most 32 "
            "pieces of max(4, ⌈tiles/32⌉) tiles (the shape of the formula above), and merges a row's partials in "
            "piece order.") in text
    assert (WORK_SPLITS, WORK_CHUNK_TILES, invariant.CHUNKS, invariant.MIN_TILES) == (32, 4, 16, 1)
    N = 128
    for L in (1, 100, 2049, 8192, 32768, 131072):
        tiles = -(-L // N)
        assert worklist.piece_keys(L, WORK_CHUNK_TILES * N, WORK_SPLITS, N) == N * max(4, -(-tiles // 32))
        assert invariant.row_chunks(L, N)[0] == N * max(1, -(-tiles // 16))
    d = decide(300, 32, 8, 128, 4096, torch.float16, method="worklist", batch_invariant=True)
    assert d.kernel == "worklist" and d.invariant and d.budget == 0
    assert decide(300, 32, 8, 128, 4096, torch.float16, batch_invariant=True).kernel == "invariant"

    data, t = _serving()
    cases = {c["case"]: c for c in data["cases"]}
    over = {(n, lay): t[n, lay, "worklist+invariant"] / t[n, lay, "invariant"] for n in cases
            for lay in ("paged", "contiguous")}
    long_ = [k for k in over if max(cases[k[0]]["lengths"]) >= WORK_MIN_L]
    short = [n for n, c in cases.items() if c["B"] == 256 and c["law"] == ["uniform", 2048]]
    assert len(short) == 1 and {k[0] for k in over} - {k[0] for k in long_} == set(short)
    xs = [over[short[0], lay] for lay in ("paged", "contiguous")]
    span = f"{min(xs):.2f}-{max(xs):.2f}×"
    faster = sum(over[k] < 1 for k in long_)
    said = (f"On the batches whose rows may reach {WORK_MIN_L} keys, the work list is faster than the invariant "
            f"kernel in {faster} of {len(long_)} (two caches each), but takes {span} its time on 256 rows of up to "
            f"2048 keys: `batch_invariant=True` keeps the invariant kernel.")
    assert said in text, said
    printed = " ".join(view07.invariant_schedules().split())
    assert f"two caches each: the work list faster in {faster} of {len(long_)}," in printed
    assert f"Batch {short[0]}, B=256 32:8, uniform 1..2048: the work list {span} the kernel's time" in printed
