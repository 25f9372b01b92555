"""fdlib.measured.lab06: Lab 06's "what the GPU shows" (show_measured("ragged")) reads the committed ragged grids,
and what the lesson says about them holds in those files."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from fdlib.measured import RESULTS, format_rows, names, show_measured
from fdlib.measured import lab06 as M


def _raw(name):
    data = json.loads((RESULTS / name).read_text())
    return [r for r in data["records"] if r["method"] == "auto" and r["status"] == "ok"]


@pytest.fixture(scope="module")
def shown():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = show_measured("ragged", show=False)
    yield s
    plt.close("all")


def test_the_view_is_registered_and_names_its_files(shown):
    assert "ragged" in names()
    assert shown.sources == [f"results/h200/{M.CONTIGUOUS}", f"results/h200/{M.PAGED}"]
    for src in shown.sources:
        assert src in shown.caption.replace("\n", " ") and (RESULTS.parents[1] / src).exists()


def test_the_table_is_what_the_files_hold(shown):
    """Every cell recomputed here from the raw JSON, independently of the view's own parsing."""
    rows = shown.table
    assert rows[0][:3] == ["cache", "lengths", "% ceiling"] and len(rows) == 1 + 2 * 3
    for row, (name, cache) in zip(rows[1:], [(M.CONTIGUOUS, "contiguous")] * 3 + [(M.PAGED, "pages of 16")] * 3):
        dist = {"constant": "constant", "uniform": "uniform", "Zipf-like": "zipf"}[row[1]]
        recs = [r for r in _raw(name) if r["dist"] == dist]
        large = [r for r in recs if r["kv_mb"] >= 512]
        pct = math.exp(sum(math.log(r["pct_ceiling"]) for r in recs) / len(recs))
        assert row[0] == cache and row[2] == f"{pct:.1f}"
        assert row[3] == f"{sum(r['pct_ceiling'] >= 90 for r in large)} of {len(large)}"
        counts = dict(part.rsplit(" ", 1) for part in row[4].split(", "))
        assert sum(map(int, counts.values())) == len(recs)
        assert int(counts.get("stream-K", 0)) == sum(r["kernel"] == "streamk" for r in recs)
        assert int(counts.get("longest first", 0)) == sum(bool(r["longest_first"]) for r in recs)
    text = format_rows(rows)
    assert text.splitlines()[1].startswith("---") and max(map(len, text.splitlines())) <= M.CAPTION_WIDTH


def test_the_caption_ratio_is_the_files(shown):
    flat = {(r["B"], r["H_kv"], r["mean"]): r["graph_us"] for r in _raw(M.CONTIGUOUS) if r["dist"] == "constant"}
    paged = {(r["B"], r["H_kv"], r["mean"]): r["graph_us"] for r in _raw(M.PAGED) if r["dist"] == "constant"}
    ratio = [paged[k] / flat[k] for k in flat]
    g = math.exp(sum(map(math.log, ratio)) / len(ratio))
    caption = " ".join(shown.caption.split())
    assert f"on the {len(ratio)} batches of equal lengths: time ratio {g:.3f} in geometric mean, worst " \
           f"{max(ratio):.3f}" in caption
    assert max(map(len, shown.caption.splitlines())) <= M.CAPTION_WIDTH
    data = json.loads((RESULTS / M.CONTIGUOUS).read_text())
    assert f"{data['provenance']['device']} {data['provenance']['date_utc'][:10]}" in caption


def test_the_figure_has_two_labelled_panels_and_a_legend(shown):
    axes = shown.figure.get_axes()
    assert len(axes) == 2
    assert all("(MB, log scale)" in ax.get_xlabel() for ax in axes) and "% of the read ceiling" in axes[0].get_ylabel()
    assert axes[0].get_title() == "contiguous cache" and axes[1].get_title().startswith("pages of 16")
    assert "recorded on NVIDIA H200" in shown.figure._suptitle.get_text()
    labels = [t.get_text() for t in axes[1].get_legend().get_texts()]
    assert "stream-K" in labels and "Zipf-like lengths" in labels
    n_points = sum(len(c.get_offsets()) for ax in axes for c in ax.collections)
    assert n_points == len(_raw(M.CONTIGUOUS)) + len(_raw(M.PAGED))


def test_what_the_lesson_says_about_the_schedules_holds():
    """Lab 06 reads the figure so: on a contiguous cache equal lengths run the unified or persistent kernel;
    every ragged batch of >= 512 MB runs a balanced schedule (stream-K, or over pages whole rows longest first);
    over pages stream-K takes only the largest batches of equal lengths, and longest-first only rows of about 1024
    keys; large batches reach 90% of the read ceiling over pages."""
    flat, paged = _raw(M.CONTIGUOUS), _raw(M.PAGED)
    assert {r["kernel"] for r in flat if r["dist"] == "constant"} <= {"unified", "persistent"}
    for recs in (flat, paged):
        big_ragged = [r for r in recs if r["dist"] != "constant" and r["kv_mb"] >= 512]
        assert big_ragged and all(r["kernel"] == "streamk" or r["longest_first"] for r in big_ragged)
    const = [r for r in paged if r["dist"] == "constant"]
    sk = [r["kv_mb"] for r in const if r["kernel"] == "streamk"]
    assert sk and min(sk) > max(r["kv_mb"] for r in const if r["kernel"] != "streamk")
    assert {r["mean"] for r in paged if r["longest_first"]} == {1024}
    assert all(r["pct_ceiling"] >= 90 for r in paged if r["kv_mb"] >= 512)


def test_a_missing_or_foreign_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=M.CONTIGUOUS):
        show_measured("ragged", results_dir=tmp_path, show=False)
    shutil.copy(RESULTS / M.CONTIGUOUS, tmp_path / M.CONTIGUOUS)
    (tmp_path / M.PAGED).write_text(json.dumps({"kind": "bench"}))
    with pytest.raises(ValueError, match="expected a --ragged run"):
        show_measured("ragged", results_dir=tmp_path, show=False)
    with pytest.raises(ValueError, match="unknown kernel"):
        M.schedule_of({"kernel": "naive"})
