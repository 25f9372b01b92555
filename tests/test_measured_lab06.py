"""fdlib.course.measured.lab06: Lab 06's "what the GPU shows" (show_measured("ragged")) reads the committed ragged grids,
and what the lesson says about them holds in those files."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from fdlib.course.measured import RESULTS, format_rows, names, show_measured
from fdlib.course.measured import lab06 as M


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
    text = format_rows(rows)
    assert text.splitlines()[1].startswith("---") and max(map(len, text.splitlines())) <= 110


def _counts(cell):
    return {k: int(n) for k, n in (part.rsplit(" ", 1) for part in cell.split(", "))} if cell else {}


def test_the_schedules_table_is_what_the_files_hold():
    """Every count of M.schedules() recomputed from the raw JSON: per side of the 512 MB line, cache, equal or
    ragged lengths."""
    text = M.schedules()
    lines = text.splitlines()
    assert lines[0].split() == ["batches", "cache", "equal", "lengths", "ragged", "lengths"] and len(lines) == 6
    assert max(map(len, lines)) <= 100
    rows = M.schedule_rows([M.load_grid(RESULTS / M.CONTIGUOUS), M.load_grid(RESULTS / M.PAGED)])
    assert format_rows(rows) == text
    for row, (side, name) in zip(rows[1:], [(">=", M.CONTIGUOUS), (">=", M.PAGED), ("<", M.CONTIGUOUS),
                                            ("<", M.PAGED)]):
        assert row[0].startswith(side + " 512")
        recs = [r for r in _raw(name) if (r["kv_mb"] >= 512) == (side == ">=")]
        for cell, group in ((row[2], [r for r in recs if r["dist"] == "constant"]),
                            (row[3], [r for r in recs if r["dist"] != "constant"])):
            counts = _counts(cell)
            assert sum(counts.values()) == len(group)
            assert counts.get("stream-K", 0) == sum(r["kernel"] == "streamk" for r in group)
            assert counts.get("longest first", 0) == sum(bool(r["longest_first"]) for r in group)
            assert counts.get("balanced", 0) == sum(r["kernel"] == "balanced" for r in group)


def test_the_caption_ratio_is_the_files(shown):
    flat = {(r["B"], r["H_kv"], r["mean"]): r["graph_us"] for r in _raw(M.CONTIGUOUS) if r["dist"] == "constant"}
    paged = {(r["B"], r["H_kv"], r["mean"]): r["graph_us"] for r in _raw(M.PAGED) if r["dist"] == "constant"}
    ratio = [paged[k] / flat[k] for k in flat]
    g = math.exp(sum(map(math.log, ratio)) / len(ratio))
    caption = " ".join(shown.caption.split())
    assert f"on the {len(ratio)} batches of equal lengths: time ratio {g:.3f} in geometric mean, worst " \
           f"{max(ratio):.3f}" in caption
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


LESSON = RESULTS.parents[1] / "notebooks" / "src" / "06_paged_ragged.md"


def _lesson() -> str:
    return " ".join(LESSON.read_text(encoding="utf-8").split())


def test_what_the_lesson_says_about_the_schedules_holds():
    """Lab 06 reads the schedules table in these words, and the files agree with each of them."""
    text = _lesson()
    said = [
        "Right of the line (the first two rows):",
        "equal lengths leave nothing to balance: on a contiguous cache `auto` runs the unified or the persistent "
        "kernel (one program per SM slot, walking whole rows); over pages, stream-K takes the largest;",
        "ragged lengths run stream-K, except over pages on rows of about a thousand keys: there the unified kernel "
        "runs, whole rows longest first.",
        "In that run the balanced schedule of section 3 ran only on small batches, left of the line; `auto` no longer "
        "takes it.",
        "right of the line, `auto` reads 90% of the ceiling or more on nearly every batch (the table above counts them)",
    ]
    for words in said:
        assert words in text, words
    # "auto no longer takes it": test_balance_choice.test_auto_never_takes_the_balanced_kernel_whatever_its_model_predicts
    flat, paged = _raw(M.CONTIGUOUS), _raw(M.PAGED)
    big = [r for r in flat + paged if r["kv_mb"] >= 512]
    # equal lengths, right of the line: unified or persistent on a contiguous cache; stream-K on the largest paged
    assert {M.schedule_of(r) for r in flat if r["dist"] == "constant" and r["kv_mb"] >= 512} == {"unified",
                                                                                                 "persistent"}
    const = [r for r in paged if r["dist"] == "constant" and r["kv_mb"] >= 512]
    sk = [r["kv_mb"] for r in const if r["kernel"] == "streamk"]
    assert sk and min(sk) >= max(r["kv_mb"] for r in const if r["kernel"] != "streamk")
    # ragged lengths, right of the line: stream-K, but for paged rows of ~1024 keys, longest first
    for recs in (flat, paged):
        for r in recs:
            if r["dist"] != "constant" and r["kv_mb"] >= 512:
                paged_1k = recs is paged and r["mean"] == 1024
                assert M.schedule_of(r) == ("longest-first" if paged_1k else "streamk"), r
    assert any(r["longest_first"] for r in paged if r["kv_mb"] >= 512)
    # balanced: only left of the line
    bal = [r for r in flat + paged if r["kernel"] == "balanced"]
    assert bal and all(r["kv_mb"] < 512 for r in bal)
    # nearly every large batch at 90% or more
    assert sum(r["pct_ceiling"] >= 90 for r in big) >= 0.9 * len(big)


def test_what_the_lesson_says_about_the_two_models_holds():
    """Lab 06's "Two models, one batch": the unified kernel's timeline is shorter than the two-stage split's; the
    cost model ranks unified before balanced, the timeline model and the H200's recorded timelines the other way."""
    from fdlib.course import explorer_model, timeline
    text = _lesson()
    for words in ("The unified kernel's timeline is shorter than the two-stage split's (in brackets)",
                  "The models rank unified and balanced oppositely",
                  "The H200 ranks them as the timeline does"):
        assert words in text, words
    lens = timeline.batch_lengths("uniform", seed=0)
    split = timeline.model_timeline(lens, 32, 8, 128, 2, schedule="split", gpu="H200")
    tl = {s: timeline.model_timeline(lens, 32, 8, 128, 2, schedule=s) for s in ("unified", "balanced")}
    cm = explorer_model.summary(B=32, H_q=32, H_kv=8, L=16384, splits=split.info["splits"], dist="uniform")
    h200 = M.recorded_makespans()
    assert h200["lengths"] == lens and explorer_model.ragged_lengths("uniform", 32, 16384) == lens
    assert tl["unified"].makespan < split.makespan and h200["auto"] < h200["split"]
    assert cm.predicted_us < cm.balanced_us
    assert tl["balanced"].makespan < tl["unified"].makespan
    assert h200["balanced"] < h200["auto"]


def test_a_missing_or_foreign_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=M.CONTIGUOUS):
        show_measured("ragged", results_dir=tmp_path, show=False)
    shutil.copy(RESULTS / M.CONTIGUOUS, tmp_path / M.CONTIGUOUS)
    (tmp_path / M.PAGED).write_text(json.dumps({"kind": "bench"}))
    with pytest.raises(ValueError, match="expected a --ragged run"):
        show_measured("ragged", results_dir=tmp_path, show=False)
    with pytest.raises(ValueError, match="unknown kernel"):
        M.schedule_of({"kernel": "naive"})


# --------------------------------------------------------------------- the serving batches (results/h100/device-ragged)
def _serving_raw(path):
    data = json.loads(path.read_text())
    return data, {(r["case"], r["layout"], r["row"]): r for r in data["records"] if r["status"] == "ok"}


def _span_text(xs):
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}×" if lo == hi else f"{lo}-{hi}×"


def _ratios(recs, row, keep=lambda r: True, layouts=("paged", "contiguous")):
    return [r["graph_us"] / recs[c, lay, "plan_host"]["graph_us"] for (c, lay, rw), r in recs.items()
            if rw == row and lay in layouts and keep(r)]


def test_the_serving_table_is_what_the_file_holds():
    """Every cell of M.serving()'s table recomputed from the raw JSON: the host-lengths plan, then the default call
    and the captured graph, each as µs, × the host plan, % of the ceiling."""
    data, recs = _serving_raw(M.SERVING)
    text = M.serving()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 110
    header = next(i for i, l in enumerate(lines) if l.startswith("#  cache"))
    assert [c.strip() for c in lines[header].split("  ") if c.strip()] == ["#", "cache", "host lengths",
                                                                            "default call", "captured"]
    body = lines[header + 2:header + 2 + 2 * len(data["cases"])]
    i = 0
    for case in sorted(c["case"] for c in data["cases"]):
        for lay, cache in (("paged", "pages of 16"), ("contiguous", "contiguous")):
            host = recs[case, lay, "plan_host"]
            want = [str(case), cache, f"{host['graph_us']:.1f} µs {host['pct_ceiling']:.0f}%"]
            for row in ("default", "captured"):
                r = recs[case, lay, row]
                want.append(f"{r['graph_us']:.1f} µs {r['graph_us'] / host['graph_us']:.2f}× {r['pct_ceiling']:.0f}%")
            assert [c.strip() for c in body[i].split("  ") if c.strip()] == want, body[i]
            i += 1
    flat = " ".join(text.split())
    assert f"recorded on {data['provenance']['device']} {data['provenance']['date_utc'][:10]}" in flat
    assert "results/h100/streamk-lean/final/serving.json" in flat and f"({data['ceiling']['tbs']:.2f} TB/s" in flat
    for path in (M.SERVING_BEFORE, M.SERVING_WORKLIST, M.EQUAL_ROWS):
        assert str(path.relative_to(RESULTS.parent.parent)) in flat, path


def test_what_the_lesson_says_about_the_serving_batches_holds():
    """Lab 06's reading of the serving runs: each span it writes is recomputed from the raw files and printed by
    the cell (M.serving()); the default call ran stream-K on batches 1-6, the host plan too."""
    data, recs = _serving_raw(M.SERVING)
    cases = {c["case"]: c for c in data["cases"]}
    assert [n for n in sorted(cases) if recs[n, "paged", "default"]["kernel"] == "streamk"
            == recs[n, "contiguous", "default"]["kernel"]] == [1, 2, 3, 4, 5, 6]
    assert all(recs[n, lay, "plan_host"]["kernel"] == "streamk" for n in range(1, 7) for lay in ("paged", "contiguous"))
    default, captured = _span_text(_ratios(recs, "default")), _span_text(_ratios(recs, "captured"))
    pct = [r["pct_ceiling"] for (c, lay, rw), r in recs.items() if rw == "default"]
    pct = f"{min(pct):.0f}-{max(pct):.0f}%"
    bdata, brecs = _serving_raw(M.SERVING_BEFORE)
    one = next(c["case"] for c in bdata["cases"] if c["law"][0] == "one_long")
    assert brecs[one, "paged", "default"]["kernel"] != "worklist"
    before = _span_text(_ratios({k: r for k, r in brecs.items() if k[0] == one}, "default"))
    _, wrecs = _serving_raw(M.SERVING_WORKLIST)
    is_wl = lambda r: r["kernel"] == "worklist"
    wl_c = _span_text(_ratios(wrecs, "default", is_wl, ("contiguous",)))
    wl_p = _span_text(_ratios(wrecs, "default", is_wl, ("paged",)))
    eq = {}
    for r in json.loads(M.EQUAL_ROWS.read_text())["records"]:
        if r["dist"] == "constant":
            eq.setdefault((r["B"], r["H_q"], r["H_kv"], r["mean"], r["page_size"]), {})[r["method"]] = r["graph_us"]
    equal = _span_text([m["streamk+device"] / m["auto"] for m in eq.values()])
    # the default call's span covers every batch; stream-K only where B >= 2 (batch 7 is one sequence)
    assert cases[7]["B"] == 1 and recs[7, "paged", "default"]["kernel"] != "streamk"
    # on the equal rows the host plan ran the unified or the persistent kernel, never stream-K
    assert {r["kernel"] for r in json.loads(M.EQUAL_ROWS.read_text())["records"]
            if r["dist"] == "constant" and r["method"] == "auto"} == {"unified", "persistent"}
    said = (f"Without the lengths, the default call takes {default} the host plan's time on every batch and cache, "
            f"{pct} of the ceiling, and captured {captured}: on batches 1-6 both run stream-K, the same launch. "
            f"Planned for L_max instead, the batch with one long row took {before}. Section 4's work list, sized by "
            f"the batch, took {wl_c} on contiguous caches but {wl_p} over pages. The cost of being blind to "
            f"the lengths: on equal rows, where the host plan runs the unified or the persistent kernel, stream-K "
            f"takes {equal}.")
    assert said in _lesson(), said
    printed = " ".join(M.serving().split())
    for words in (f"default call: {default} on every batch and cache, {pct} of the ceiling; stream-K on batches 1-6",
                  "the host plan ran stream-K there too: the same launch", f"captured: {captured}",
                  f"before, planned for L_max: batch {one}, one long row, {before}",
                  f"contiguous {wl_c}, pages of 16 {wl_p}", f"over auto with host lengths: {equal}"):
        assert words in printed, words


def test_what_section_4_says_about_the_default_calls_schedule_holds():
    """Section 4: batches of up to 16 sequences need no schedule launch; pieces sized by the batch are a unit of
    section 3's c over a budget of about two programs per SM, rows cut into equal pieces of whole tiles
    (fdlib.worklist.balanced_chunk, balanced_pieces) that depend on the batchmates, at most P + B of them; the
    default call runs stream-K, whose launch depends on the shapes alone."""
    from fdlib import worklist
    from fdlib.kernels.worklist import INLINE_BATCH
    from fdlib.plan import WORK_WAVES, decide
    import torch
    text = _lesson()
    assert "one more small launch" not in text
    assert ("Before a batch of more than 16 sequences, one small launch reads the lengths and writes the list; up to "
            "16, none: each attention program lists the few lengths in its registers.") in text
    assert INLINE_BATCH == 16 and WORK_WAVES == 2
    assert "P·H_kv about two programs per SM (`fdlib.worklist.balanced_chunk`)" in text
    from fdlib.splits import sm_count
    H_kv = 8
    d = decide(32, 32, H_kv, 128, 32768, torch.float16, method="worklist")
    assert d.budget == -(-WORK_WAVES * sm_count() // H_kv)
    assert "equal pieces of whole tiles\n(`fdlib.worklist.balanced_pieces`)" in text or \
        "equal pieces of whole tiles (`fdlib.worklist.balanced_pieces`)" in " ".join(text.split())
    assert "so the grid needs room for P + B items, not B·S" in " ".join(text.split())
    assert worklist.capacity(32, 32, d.budget) == d.budget + 32 < 32 * 32
    for B, inline in ((16, True), (17, False)):
        d = decide(B, 32, 8, 128, 32768, torch.float16, method="worklist")
        assert d.kernel == "worklist" and d.budget > 0 and bool(d.inline) == inline
    # the default call (no host lengths) runs stream-K for two or more sequences
    assert "Without host lengths, `auto` runs it for B ≥ 2" in " ".join(text.split())
    assert decide(2, 32, 8, 128, 32768, torch.float16).kernel == "streamk"
    assert decide(1, 32, 8, 128, 32768, torch.float16).kernel != "streamk"
    assert "so its launch depends on the shapes alone" in " ".join(text.split())
    assert '`method="worklist"` runs the work list.' in text
    assert decide(2, 32, 8, 128, 32768, torch.float16, method="worklist").kernel == "worklist"
    # the unit is section 3's c (tiles over the budget), at least chunk; equal whole-tile pieces
    N, chunk, P = 16, 64, 5
    lens = [700, 90, 0, 300, 300, 1500, 17, 260]
    tiles = [max(1, -(-L // N)) for L in lens]
    c = worklist.balanced_chunk(lens, chunk, P, N)
    assert c == N * max(chunk // N, -(-sum(tiles) // P))
    for L in lens:
        keys, n = worklist.balanced_pieces(L, c, 32, N)
        assert keys % N == 0 and n * keys >= L and (n - 1) * keys < max(L, 1)
    # sized by the batch, a row's cut follows its batchmates
    alone = worklist.balanced_pieces(1500, worklist.balanced_chunk([1500], chunk, P, N), 32, N)
    assert alone != worklist.balanced_pieces(1500, c, 32, N)


def test_a_missing_or_foreign_serving_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="serving.json"):
        M.serving(tmp_path / "serving.json")
    (tmp_path / "serving.json").write_text(json.dumps({"kind": "ragged"}))
    with pytest.raises(ValueError, match="expected a --serving run"):
        M.serving(tmp_path / "serving.json")


def test_what_section_4_says_about_its_work_list_figure_holds():
    """Section 4 reads its batch's cut in these words; the cell prints c(L) and n(L) of each row from fdlib.worklist."""
    from fdlib import worklist
    lens, chunk, S, N = [700, 90, 0, 300, 300, 1500, 17, 260], 64, 4, 16
    assert f"wl_lengths, CHUNK, S, BLOCK_N = {lens}, {chunk}, {S}, {N}" in LESSON.read_text(encoding="utf-8")
    cut = {b: (worklist.piece_keys(L, chunk, S, N) // N, worklist.pieces(L, chunk, S, N)) for b, L in enumerate(lens)}
    assert [b for b, L in enumerate(lens) if L <= chunk] == [2, 6] and all(cut[b][1] == 1 for b in (2, 6))
    assert lens[1] == 90 and cut[1] == (4, 2)
    assert all(cut[b][1] == S for b, L in enumerate(lens) if L > chunk * S)
    assert lens[3] == lens[4] == 300 and cut[3] == cut[4] == (5, 4) and lens[5] == max(lens) == 1500 and cut[5] == (24, 4)
    said = ("rows of up to chunk = 64 keys stay whole; row 1's 90 keys become 2 pieces of 4 tiles; rows longer than "
            "chunk·S = 256 keys become S = 4 pieces, of c(L) = 5 tiles at 300 keys (rows 3, 4), 24 at 1500 (row 5). "
            "Right, the items in launch order: row 5's first, the empty row (a cross) last.")
    assert said in _lesson(), said
    items = worklist.work_list(lens, chunk, S, N)
    assert items[0].b == 5 and items[-1].b == 2 and lens[2] == 0


def test_what_section_3_says_about_stream_k_on_equal_rows_holds():
    """'On equal rows, fdlib cuts each row into whole, equal pieces': the kernel's rule (host mirror
    fdlib.kernels.streamk.shares) on equal rows of an H100's launch (P_h = 33 a head at H_kv = 8) gives every row
    the same number of pieces and no share two rows; on unequal rows the shares cut rows where they fall."""
    from fdlib.kernels.streamk import shares, streamk_programs
    assert "On equal rows, fdlib cuts each row into whole, equal pieces." in " ".join(_lesson().split())
    P_h = streamk_programs(8, 2 * 132, 1) // 8
    for B in (4, 8, 16, 32):
        rows = shares([16] * B, P_h)
        pieces = {r["p_b"] - r["p_a"] + 1 for r in rows}
        assert len(pieces) == 1 and all(rows[i]["p_b"] < rows[i + 1]["p_a"] for i in range(B - 1)), (B, rows)
    rows = shares([16] * 31 + [17], P_h)
    assert any(rows[i]["p_b"] == rows[i + 1]["p_a"] for i in range(31))     # a share ends one row, begins the next
