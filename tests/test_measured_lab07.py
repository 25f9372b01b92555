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
