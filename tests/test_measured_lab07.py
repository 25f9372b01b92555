"""Lab 07's "what the GPU shows" view draws the committed files' numbers, and says which files they are.

The expected values are read here from the files' own derived fields (the ratios and summary that the benchmark
wrote beside its times), not through the view's parsing."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from fdlib.measured import RESULTS, names, show_measured  # noqa: E402
from fdlib.measured import lab07 as view07  # noqa: E402


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
        assert row[2] == f"{want[(*key, view07.FULL)]['graph_ratio_unified']:.2f}"
        assert row[3] == f"{want[(*key, view07.PASS1)]['graph_ratio_unified']:.2f}"
    assert last[2] == f"{data['summary'][view07.FULL]['graph_geomean_ratio']:.3f}"
    assert last[3] == f"{data['summary'][view07.PASS1]['graph_geomean_ratio']:.3f}"


def test_figure_is_the_invariant_file(shown):
    data = _records(view07.INVARIANT)
    t = {}
    for r in data["records"]:
        if r["status"] == "ok":
            t.setdefault((r["B"], r["H_q"], r["H_kv"], r["L"]), {})[r["method"]] = r["graph_us"]
    ratios = {k: v["invariant"] / v["auto"] for k, v in t.items()}
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
