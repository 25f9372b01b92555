"""Lab 05's "what the GPU shows" view: its table and caption say what the committed results file says."""
from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from fdlib.course.measured import RESULTS, show_measured  # noqa: E402
from fdlib.course.measured.lab05 import SHOWDOWN, TABLE_SHAPES  # noqa: E402


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


def test_printed_caption_is_wrapped_whole_words(capsys):
    """show_measured prints the caption wrapped at CAPTION_WIDTH, words and file names whole; Shown keeps it
    unwrapped; the printed table fits 100 columns."""
    import matplotlib.pyplot as plt

    from fdlib.course.measured import CAPTION_WIDTH, format_rows
    shown = show_measured("showdown")
    plt.close(shown.figure)
    out = capsys.readouterr().out
    table = format_rows(shown.table)
    assert out.startswith(table) and max(map(len, table.splitlines())) <= 100
    printed = out[len(table):].strip("\n")
    assert max(map(len, shown.caption.splitlines())) > CAPTION_WIDTH       # there is something to wrap
    lines = printed.splitlines()
    assert all(len(x) <= CAPTION_WIDTH or " " not in x for x in lines), lines
    assert printed.split() == shown.caption.split()                        # no word broken, none lost
    assert "results/h200/bench-float16.json:" in printed.split()


def test_wrap_caption_keeps_long_tokens_and_lines():
    from fdlib.course.measured import wrap_caption
    long_token = "results/h200/" + "x" * 100 + ".json"
    text = f"first line {long_token} and more words here\n\nthird-line with-hyphens " + "word " * 30
    wrapped = wrap_caption(text, 40)
    assert long_token in wrapped.splitlines()
    assert all(len(x) <= 40 for x in wrapped.splitlines() if x != long_token)
    assert "" in wrapped.splitlines() and "third-line" in wrapped and "with-hyphens" in wrapped
    assert wrapped.split() == text.split()


def test_what_the_lesson_says_about_the_table_holds():
    """Lab 05 reads the table by its columns (shapes): in the first, split1 (8 programs) trails far behind cuDNN
    while split, unified and auto, cut into the splits of the 'auto ran' row, match it; in the last, auto runs the
    persistent kernel and beats cuDNN. The lesson says so in these words, and the file agrees."""
    from pathlib import Path
    text = " ".join((Path(__file__).resolve().parents[1] / "notebooks" / "src" / "05_unified_kernel.md")
                    .read_text(encoding="utf-8").split())
    for words in ("The table has four shapes as its columns. Read its first column first",
                  "`split1` has 8 programs for 132 SMs and trails far behind cuDNN; `split`, `unified` and `auto` "
                  "cut the sequence into the splits of the last row and match cuDNN",
                  "In the last column, many rows of 512 keys, `auto` switches to the persistent kernel and beats cuDNN",
                  "The figure shows every shape of the grid, one a row"):
        assert words in text, words
    _, us = _file()
    table = _shown().table
    assert table[0][1] == "B=1 32:8 L=131072" and table[0][len(TABLE_SHAPES)] == "B=64 32:8 L=512"
    first, last = TABLE_SHAPES[0], TABLE_SHAPES[-1]
    cudnn = us[(*first, "cudnn")]
    assert us[(*first, "split1")] > 5 * cudnn
    assert all(abs(us[(*first, m)] / cudnn - 1) < 0.03 for m in ("split", "unified", "auto"))
    rows = {r[0]: r for r in table[1:]}
    assert rows["auto ran"][len(TABLE_SHAPES)].startswith("persistent@")
    assert us[(*last, "auto")] < us[(*last, "cudnn")]
