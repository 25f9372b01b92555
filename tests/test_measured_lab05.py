"""Lab 05's "what the GPU shows" view: its table and caption say what the committed results file says."""
from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from fdlib.measured import RESULTS, show_measured  # noqa: E402
from fdlib.measured.lab05 import SHOWDOWN, TABLE_SHAPES  # noqa: E402


def _file(path=RESULTS / SHOWDOWN):
    data = json.loads(path.read_text())
    us = {}
    for r in data["records"]:
        if r["status"] == "ok":
            us[(r["B"], r["H_kv"], r["L"], r["method"])] = r["graph_us"]
    return data, us


def _shown(results_dir=None):
    import matplotlib.pyplot as plt
    shown = show_measured("showdown", results_dir=results_dir, show=False)
    plt.close(shown.figure)
    return shown


def test_table_times_are_the_files():
    _, us = _file()
    table = _shown().table
    header, rows = table[0], {r[0]: r for r in table[1:]}
    assert header[1:1 + len(TABLE_SHAPES)] == [f"B={B} 32:{H_kv} L={L}" for B, H_kv, L in TABLE_SHAPES]
    for method in ("naive", "split1", "split", "unified", "persistent", "auto", "cudnn", "fa2"):
        for i, (B, H_kv, L) in enumerate(TABLE_SHAPES):
            assert rows[method][1 + i] == f"{us[(B, H_kv, L, method)]:.1f}", (method, B, H_kv, L)


def test_geometric_means_and_auto_choices_are_the_files():
    data, us = _file()
    shapes = {(B, H_kv, L) for B, H_kv, L, _ in us}
    rows = {r[0]: r for r in _shown().table[1:]}
    for method in ("split1", "unified", "auto", "fa2"):
        logs = [math.log(us[(*s, method)] / us[(*s, "cudnn")]) for s in shapes]
        assert rows[method][-1] == f"{math.exp(sum(logs) / len(logs)):.3f}"
    assert rows["cudnn"][-1] == "1.000"
    auto = {(r["B"], r["H_kv"], r["L"]): f"{r['kernel']}@{r['splits']}" for r in data["records"]
            if r["method"] == "auto"}
    assert rows["auto ran"][1:1 + len(TABLE_SHAPES)] == [auto[s] for s in TABLE_SHAPES]


def test_caption_names_the_file_and_its_worst_shape():
    _, us = _file()
    shown = _shown()
    assert shown.caption.startswith("results/h200/bench-float16.json: recorded on NVIDIA H200")
    assert shown.sources == ["results/h200/bench-float16.json"]
    shapes = {(B, H_kv, L) for B, H_kv, L, _ in us}
    ratio = {s: us[(*s, "auto")] / us[(*s, "cudnn")] for s in shapes}
    B, H_kv, L = max(ratio, key=ratio.get)
    assert f"worst {ratio[(B, H_kv, L)]:.3f} (B={B} 32:{H_kv} L={L})" in shown.caption
    gqa = us[(1, 32, 131072, "unified")] / us[(1, 8, 131072, "unified")]
    assert f"32:32 heads take {gqa:.2f}×" in shown.caption


def test_the_view_follows_the_file(tmp_path):
    """A changed time in a copy of the file changes the table: nothing is fixed in the view."""
    data = json.loads((RESULTS / SHOWDOWN).read_text())
    for r in data["records"]:
        if (r["B"], r["H_kv"], r["L"], r["method"]) == (1, 8, 131072, "unified"):
            r["graph_us"] = 987.6
    (tmp_path / SHOWDOWN).write_text(json.dumps(data))
    rows = {r[0]: r for r in _shown(tmp_path).table[1:]}
    assert rows["unified"][1] == "987.6"


def test_a_run_without_cudnn_still_draws(tmp_path):
    """A learner's own run may lack a peer: its cells say n/a, and the caption states nothing about it."""
    data = json.loads((RESULTS / SHOWDOWN).read_text())
    data["records"] = [r for r in data["records"] if r["method"] != "cudnn"]
    (tmp_path / SHOWDOWN).write_text(json.dumps(data))
    shown = _shown(tmp_path)
    rows = {r[0]: r for r in shown.table[1:]}
    assert rows["cudnn"][1:] == ["n/a"] * (len(TABLE_SHAPES) + 1) and rows["auto"][-1] == "n/a"
    assert "auto / cuDNN" not in shown.caption and "32:32 heads take" in shown.caption


def test_missing_file_says_which(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench-float16.json"):
        _shown(tmp_path)
