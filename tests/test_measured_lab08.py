"""Lab 08's "what the GPU shows" view: its table and caption say what the committed results file says."""
from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from fdlib.course.measured import RESULTS, show_measured  # noqa: E402
from fdlib.course.measured.lab08 import QLEN  # noqa: E402


def _shown(results_dir=None):
    import matplotlib.pyplot as plt
    shown = show_measured("qlen", results_dir=results_dir, show=False)
    plt.close(shown.figure)
    return shown


def test_table_is_the_files_time_and_growth_per_shape():
    data = json.loads((RESULTS / QLEN).read_text())
    table = _shown().table
    assert table[0] == ["shape", "contender", "q_len=1 µs", "×, q_len=2", "×, q_len=4", "×, q_len=8"]
    rows = {(r[0], r[1]): r[2:] for r in table[1:]}
    assert len(rows) == len(data["ratios"]) == len(table) - 1
    for r in data["ratios"]:
        got = rows[(f"B={r['B']} L={r['L']}", r["method"])]
        assert got == [f"{r['q1_us']:.1f}"] + [f"{r['ratio'][q]:.3f}" for q in ("2", "4", "8")]
        q1_rec = [x for x in data["records"] if x["method"] == r["method"] and x["q_len"] == 1
                    and (x["B"], x["L"]) == (r["B"], r["L"])]
        assert len(q1_rec) == 1 and f"{q1_rec[0]['graph_us']:.1f}" == got[0]


def test_caption_names_the_file_the_masks_and_the_spans():
    data = json.loads((RESULTS / QLEN).read_text())
    shown = _shown()
    assert shown.caption.startswith("results/h200/qlen-fp16.json: recorded on NVIDIA H200")
    assert shown.sources == ["results/h200/qlen-fp16.json"]
    assert "cudnn: none (q_len = 1) at q_len 1, bottom-right bool mask at q_len 2,4,8" in shown.caption
    assert "fa2 did not run" in shown.caption and "fa2:" not in shown.caption.split("given:")[1].split(".")[0]
    for m in ("fdlib", "cudnn"):
        r4 = [r["ratio"]["4"] for r in data["ratios"] if r["method"] == m]
        assert f"{m} from {min(r4):.3f}× to {max(r4):.3f}× over {len(r4)} shapes" in shown.caption
    # the run's own goal is not the learner's: neither the caption nor the figure shows it
    assert "target" not in shown.caption and data["settings"]["target"] not in shown.caption
    texts = [t.get_text() for ax in shown.figure.get_axes() for t in ax.texts]
    assert not any("target" in t for t in texts)
    assert all(len(ax.get_lines()) == len([r for r in data["ratios"] if r["method"] == m]) + 1   # curves + y = 1
               for ax, m in zip(shown.figure.get_axes(), ("fdlib", "cudnn")))


def test_the_view_follows_the_file(tmp_path):
    data = json.loads((RESULTS / QLEN).read_text())
    data["ratios"][0]["ratio"]["4"] = 3.25
    (tmp_path / QLEN).write_text(json.dumps(data))
    rows = {(r[0], r[1]): r for r in _shown(tmp_path).table[1:]}
    first = data["ratios"][0]
    assert rows[(f"B={first['B']} L={first['L']}", first["method"])][4] == "3.250"


def test_missing_file_says_which(tmp_path):
    with pytest.raises(FileNotFoundError, match="qlen-fp16.json"):
        _shown(tmp_path)
