"""The SM-occupancy explorer: its numbers, its figure, its widget, and its speed."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import fdlib
from fdlib import costmodel
from fdlib.course import explorer as E
from fdlib.gpus import PRESETS
from fdlib.kernels.config import tile_config_for


@pytest.fixture
def no_results(tmp_path, monkeypatch):
    monkeypatch.setenv("FDLIB_RESULTS", str(tmp_path / "none"))


def test_one_split_keeps_only_the_kv_heads_busy():
    s = E.summary(B=1, H_q=32, H_kv=8, L=131072, splits=1, gpu="H200")
    assert (s.programs, s.waves, s.busy_sms_per_wave, s.sms) == (8, 1, (8,), 132)
    assert s.utilization == pytest.approx(8 / 132)
    assert "busy SMs per wave: 8 of 132" in str(s)
    assert "SM utilization: 6.1%" in str(s)


def test_enough_splits_fill_every_sm():
    s = E.summary(B=1, H_q=16, H_kv=4, L=33 * 4096, splits=33, gpu="H200")   # 132 programs, one per SM
    assert s.splits_used == 33 and s.programs == 132
    assert s.busy_sms_first_wave == 132 and s.utilization == 1.0 and s.waves == 1


def test_programs_follow_packing_and_method():
    packed = E.summary(B=2, H_q=32, H_kv=8, L=8192, splits=4)
    per_head = E.summary(B=2, H_q=32, H_kv=8, L=8192, splits=4, gqa=False)
    two_stage = E.summary(B=2, H_q=32, H_kv=8, L=8192, splits=4, unified=False)
    assert packed.programs == 2 * 8 * 4 and per_head.programs == 2 * 32 * 4
    assert packed.stage2_programs == 0 and two_stage.stage2_programs == 2 * 32
    assert "stage 2: 64 programs" in str(two_stage)


def test_tail_wave_and_waves():
    s = E.summary(B=1, H_q=32, H_kv=8, L=131072, splits=34, gpu="H200")
    assert s.programs == 8 * s.splits_used and s.programs_per_sm >= 1
    slots = 132 * s.programs_per_sm
    assert s.waves == -(-s.programs // slots) and len(s.busy_sms_per_wave) == s.waves
    assert s.busy_sms_per_wave[-1] == min(132, s.programs - (s.waves - 1) * slots)


def test_splits_capped_at_one_per_tile():
    s = E.summary(B=1, H_q=8, H_kv=8, L=128, splits=16)
    assert s.splits_used == 2 and s.programs == 16
    assert "16 requested, 2 launched" in str(s)


def test_repr_is_deterministic_text():
    a = E.summary(B=4, H_q=64, H_kv=8, L=4096, splits=8, gpu="A100 SXM4 80GB")
    b = E.summary(B=4, H_q=64, H_kv=8, L=4096, splits=8, gpu="A100 SXM4 80GB")
    assert repr(a) == str(a) == str(b)
    assert str(a).splitlines()[0].startswith("model of A100 SXM4 80GB, 108 SMs")


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of H_kv"):
        E.summary(B=1, H_q=30, H_kv=8, L=1024, splits=1)
    with pytest.raises(ValueError, match="splits"):
        E.summary(B=1, H_q=32, H_kv=8, L=1024, splits=0)
    with pytest.raises(ValueError, match="gpu"):
        E.summary(B=1, H_q=32, H_kv=8, L=1024, splits=1, gpu="no such GPU")


def test_draw_has_titles_units_and_device(no_results):
    fig = E.draw(1, 32, 8, 131072, 1, gpu="H200")
    text = fig._suptitle.get_text()
    assert "model of H200, 132 SMs" in text
    curve = [ax for ax in fig.axes if ax.get_xlabel().startswith("splits")][0]
    assert "(µs)" in curve.get_ylabel() and curve.get_title()
    maps = [ax for ax in fig.axes if ax.get_title().startswith("wave 1 of 1")]
    assert maps and "8/132 SMs busy" in maps[0].get_title()


def test_times_and_programs_per_sm_are_the_cost_models():
    """One model serves the explorer and the library: r and the predicted µs are fdlib.costmodel.explain's."""
    s = E.summary(B=1, H_q=32, H_kv=8, L=131072, splits=16, gpu="H200")
    ex = costmodel.explain(1, 32, 8, 131072, gpu="H200")
    times = {c.splits: c.time_us for c in ex.candidates}
    assert s.programs_per_sm == ex.programs_per_sm and s.predicted_exact and s.predicted_us == times[16]
    assert (s.chosen_splits, s.chosen_us) == (ex.chosen, times[ex.chosen])
    assert "[cost model]" in str(s)
    per_head = E.summary(B=1, H_q=32, H_kv=8, L=131072, splits=16, gpu="H200", gqa=False, unified=False)
    assert per_head.predicted_us == {c.splits: c.time_us for c in costmodel.explain(
        1, 32, 32, 131072, gpu="H200", method="split").candidates}[16]


def test_time_between_candidates_is_interpolated():
    s = E.summary(B=1, H_q=32, H_kv=8, L=131072, splits=7, gpu="H200")     # 6 and 8 are candidates, 7 is not
    times = {c.splits: c.time_us for c in costmodel.explain(1, 32, 8, 131072, gpu="H200").candidates}
    assert s.splits_used == 7 and 7 not in times and not s.predicted_exact and "(interpolated)" in str(s)
    assert min(times[6], times[8]) <= s.predicted_us <= max(times[6], times[8])


def _bench_file(records, device="NVIDIA H200"):
    """A results file as ``python -m fdlib.bench`` writes it (the fields the explorer reads)."""
    return json.dumps({"schema": "fdlib.bench/1", "kind": "bench", "provenance": {"device": device},
                       "settings": {"graphs": True}, "records": records})


def _rec(method, splits, L=131072, B=1, status="ok", graph_us=None, eager_us=None):
    return {"method": method, "splits": splits, "status": status, "graph_us": graph_us, "eager_us": eager_us,
            "dtype": "bfloat16", "B": B, "H_q": 32, "H_kv": 8, "L": L, "D": 128}


def test_recorded_results_come_from_bench_files(tmp_path, monkeypatch):
    """Only the benchmark's results files are read (fdlib.bench.report.load_results); other JSON is skipped."""
    monkeypatch.setenv("FDLIB_RESULTS", str(tmp_path))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "calibration.json").write_text(json.dumps({"bw_tbs": 5.0, "splits": 3, "graph_us": 1.0}))
    (tmp_path / "bench.json").write_text(_bench_file([
        _rec("unified", 1, graph_us=900.0, eager_us=950.0),
        _rec("unified", 16, graph_us=60.0, eager_us=70.0),
        _rec("split", 16, graph_us=80.0),
        _rec("unified", 4, L=4096, graph_us=9.0),
        _rec("unified", 32, status="error"),
        _rec("cudnn", None, graph_us=50.0),
    ]))
    pts, dev = E.recorded(1, 32, 8, 131072)
    assert pts == [(1, 900.0), (16, 60.0)] and dev == "NVIDIA H200"
    assert E.recorded(1, 32, 8, 131072, unified=False)[0] == [(16, 80.0)]
    assert E.recorded(2, 32, 8, 131072) == ([], None)
    assert E.recorded(1, 32, 8, 131072, dtype_bytes=4) == ([], None)
    fig = E.draw(1, 32, 8, 131072, 1)
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert any("recorded on NVIDIA H200" in t for t in labels)


def test_recorded_eager_only_results_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FDLIB_RESULTS", str(tmp_path))
    (tmp_path / "bench.json").write_text(_bench_file([_rec("unified", 2, eager_us=70.0)]))
    assert E.recorded(1, 32, 8, 131072) == ([(2, 70.0)], "NVIDIA H200, eager timing")


def test_recorded_bench_sweep_format(tmp_path, monkeypatch):
    """The layout ``python -m fdlib.bench --sweep-splits`` writes: shape on the row, splits on its points."""
    monkeypatch.setenv("FDLIB_RESULTS", str(tmp_path))
    row = {"dtype": "bfloat16", "B": 1, "H_q": 32, "H_kv": 8, "L": 131072, "D": 128,
           "points": [{"splits": 1, "status": "ok", "us": 700.0, "eager_us": None, "graph_us": 700.0},
                      {"splits": 32, "status": "ok", "us": 40.0, "eager_us": None, "graph_us": 40.0},
                      {"splits": 64, "status": "error", "us": None, "graph_us": None}],
           "chosen": {"costmodel": {"splits": 32, "us": 41.0}}, "best": {"splits": 32, "us": 40.0}}
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "sweep-x.json").write_text(json.dumps({
        "schema": "fdlib.bench/1", "kind": "sweep", "provenance": {"device": "NVIDIA H200"},
        "settings": {"method": "unified", "timing": "graph"}, "shapes": [], "sweep": [row]}))
    (tmp_path / "h200" / "tune.json").write_text(json.dumps({"device": "NVIDIA H200", "records": [
        {"B": 1, "H_q": 32, "H_kv": 8, "L": 131072, "D": 128, "method": "unified", "BLOCK_N": 32, "splits": 8,
         "us": 600.0}]}))
    assert E.recorded(1, 32, 8, 131072) == ([(1, 700.0), (32, 40.0)], "NVIDIA H200")
    assert E.recorded(1, 32, 8, 131072, dtype_bytes=4) == ([], None)


def test_no_results_dir_means_no_overlay(no_results):
    assert E.recorded(1, 32, 8, 131072) == ([], None)


def test_widget_state_and_redraw_speed(no_results):
    pytest.importorskip("ipywidgets")
    w = E.explorer(B=1, H_q=32, H_kv=8, L=131072, gpu="H200", splits=1)
    assert {"B", "H_q", "group", "L", "splits", "gpu", "gqa", "unified"} <= set(w.controls)
    assert "SM utilization: 6.1%" in w.readout.value and "8 of 132" in w.readout.value
    first = w.image.value
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    times = []
    for s in (2, 4, 8, 12, 16, 24, 32, 64, 128, 256):
        t0 = time.perf_counter()
        w.controls["splits"].value = s
        times.append(time.perf_counter() - t0)
    mean = sum(times) / len(times)
    print(f"explorer redraw: mean {mean * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms over {len(times)} moves")
    assert mean < 1.0
    assert w.image.value != first and w.summary.splits_used == 256 and w.summary.utilization > 0.9
    assert f"SM utilization: {w.summary.utilization:.1%}" in w.readout.value
    w.controls["gqa"].value = False
    assert w.summary.programs == 32 * w.summary.splits_used
    w.controls["unified"].value = False
    assert "stage 2" in w.readout.value
    w.controls["gpu"].value = "L4"
    assert w.summary.sms == 58 and "model of L4, 58 SMs" in w.readout.value
    w.controls["group"].value = 7                                 # 32 is not a multiple of 7
    assert "not a multiple" in w.readout.value
    w.controls["H_q"].value = 28
    assert w.summary.H_kv == 4


def test_every_preset_draws(no_results):
    pytest.importorskip("ipywidgets")
    w = E.explorer()
    for name in PRESETS:
        w.controls["gpu"].value = name
        assert f"{PRESETS[name].sms} SMs" in w.readout.value


def test_measured_points_are_overlaid(no_results, monkeypatch):
    """The "Measure on this GPU" path, with the timing replaced (no GPU needed)."""
    pytest.importorskip("ipywidgets")
    calls = []

    def fake_measure(B, H_q, H_kv, L, splits_list, D=128, dtype_bytes=2, unified=True):
        calls.append(list(splits_list))
        return [(s, 1000.0 / s + 100.0) for s in splits_list]

    monkeypatch.setattr(E, "measure", fake_measure)
    w = E.explorer(B=1, H_q=32, H_kv=8, L=131072, gpu="H200")
    w._on_measure()
    assert calls and 1 in calls[0] and w.summary.chosen_splits in calls[0]
    assert "measured" in w.status.value and w._canvas.measured_pts.get_visible()
    assert "measured on H200" in w._canvas.measured_pts.get_label()
    w.controls["gqa"].value = False                      # the kernels always pack: no measured overlay
    assert not w._canvas.measured_pts.get_visible()


@pytest.mark.gpu
def test_measure_on_gpu(no_results):
    if fdlib.runtime.MODE != "gpu":
        pytest.skip("needs a CUDA GPU")
    pts = E.measure(1, 32, 8, 8192, [1, 4, 16])
    assert [p[0] for p in pts] == [1, 4, 16] and all(us > 0 for _, us in pts)
    pytest.importorskip("ipywidgets")
    w = E.explorer(B=1, H_q=32, H_kv=8, L=8192, gpu="live")
    w.button.click()
    assert "measured" in w.status.value, w.status.value
    assert w._canvas.measured_pts.get_visible()


def test_float32_uses_the_kernels_float32_tiles():
    """The explorer's tiles and launched splits follow the element size, as the kernels and the cost model do."""
    s = E.summary(B=1, H_q=32, H_kv=8, L=4096, splits=64, dtype_bytes=4)
    assert s.block_n == tile_config_for(128, 4096, compiled_mode=True, elem_bytes=4, rows=8).BLOCK_N == 64
    assert s.splits_used == 64


# ---------------------------------------------------------------------------------------------- length histogram
def test_constant_histogram_is_the_dense_setting():
    a = E.summary(B=32, H_q=32, H_kv=8, L=16384, splits=6)
    b = E.summary(B=32, H_q=32, H_kv=8, L=16384, splits=6, dist="constant")
    assert str(a) == str(b) and "balanced" not in str(a)


def test_ragged_histogram_counts_programs_per_row():
    from fdlib.bench.ragged import draw_lengths
    from fdlib.kernels.config import chunk_for
    from fdlib.schedule import balanced
    s = E.summary(B=32, H_q=32, H_kv=8, L=16384, splits=6, dist="uniform")
    lens = draw_lengths("uniform", 32, 16384, 0)
    assert s.L_longest == max(lens) and s.dist == "uniform"
    chunk = chunk_for(max(lens), s.splits_used, s.block_n)[0]
    assert s.programs == 8 * sum(max(1, -(-x // chunk)) for x in lens)
    sched = balanced(lens, 32 * s.splits_used, s.block_n)
    assert s.balanced_items == sched.items and s.balanced_programs == 8 * sched.items
    ex = costmodel.explain(32, 32, 8, lens, gpu="H200")
    assert s.predicted_us == {c.splits: c.time_us for c in ex.candidates}[s.splits_used]
    assert s.idle_balanced < s.idle_split                      # the timeline model on the batch
    text = str(s)
    assert "L: uniform in [1, 32768], mean 16384" in text and "Σ_b ⌈L_b/chunk⌉" in text
    assert "balanced schedule (budget B·splits)" in text and "SMs idle (timeline model)" in text


def test_balanced_time_is_the_cost_model_formula_on_its_items():
    """Equal rows that divide evenly: the balanced items are the splits, so the two predictions agree."""
    from fdlib.course.explorer_model import balanced_time, gpu_tile, ragged_lengths
    lens = ragged_lengths("constant", 4, 8192)
    g = PRESETS["H200"]
    ex = costmodel.explain(4, 32, 8, lens, gpu=g)
    n = gpu_tile(128, 8192, 32).BLOCK_N
    items, P, w, t = balanced_time(lens, 8, 128, 2, 4 * 4, g, costmodel.H200_DEFAULT, n, ex.programs_per_sm, 4)
    want = next(c for c in ex.candidates if c.splits == 4)
    assert (items, P, w) == (16, 128, want.waves) and t == pytest.approx(want.time_us, rel=1e-9)


def test_bad_histogram_is_named():
    with pytest.raises(ValueError, match="dist"):
        E.summary(B=4, H_q=32, H_kv=8, L=1024, splits=1, dist="pareto")


def test_widget_length_histogram(no_results):
    pytest.importorskip("ipywidgets")
    w = E.explorer(B=32, H_q=32, H_kv=8, L=16384, splits=6, gpu="H200")
    assert w.controls["dist"].value == "constant" and "balanced" not in w.readout.value
    w.controls["dist"].value = "zipf"
    assert w.summary.dist == "zipf" and "balanced schedule" in w.readout.value
    w._on_measure()
    assert "switch the lengths to constant" in w.status.value
    w.controls["dist"].value = "uniform"
    assert "uniform in [1, 32768]" in w.readout.value
    fig = E.draw(32, 32, 8, 16384, 6, dist="zipf")
    assert "model of H200" in fig._suptitle.get_text()


def test_several_query_tokens_count_rows_not_bytes():
    """q_len query tokens: the same programs and K/V bytes, group × q_len rows a program, and a predicted time
    that stays close to one token's on a memory-bound shape (the cost model sees H_q·q_len query heads)."""
    from fdlib.course.explorer_model import summary
    one = summary(B=1, H_q=32, H_kv=8, L=131072, splits=16)
    four = summary(B=1, H_q=32, H_kv=8, L=131072, splits=16, q_len=4)
    assert four.programs == one.programs and four.q_len == 4
    assert one.predicted_us <= four.predicted_us <= 1.15 * one.predicted_us
    assert "q_len=4 query tokens: 16 query rows a program" in str(four)
    with pytest.raises(ValueError, match="q_len"):
        summary(B=1, H_q=32, H_kv=8, L=4096, splits=1, q_len=17)
    two_stage = summary(B=2, H_q=32, H_kv=8, L=4096, splits=4, unified=False, q_len=4)
    assert two_stage.stage2_programs == 2 * 32 * 4


def test_one_token_timings_are_not_drawn_beside_several_tokens():
    """Recorded and measured timings are one-token runs: the explorer draws them only at q_len = 1."""
    from fdlib.course.explorer import comparable
    from fdlib.course.explorer_model import summary
    assert comparable(summary(B=1, H_q=32, H_kv=8, L=131072, splits=16))
    assert not comparable(summary(B=1, H_q=32, H_kv=8, L=131072, splits=16, q_len=4))
    assert not comparable(summary(B=1, H_q=32, H_kv=8, L=131072, splits=16, dist="zipf"))


# ---------------------------------------------------------------------------------------------- the picture's layout
LAYOUTS = [dict(B=1, L=131072, splits=1, gpu="H200"),                       # one wave: two empty panels
           dict(B=1, L=131072, splits=34, gpu="H200"),                      # three waves, a tail
           dict(B=256, L=1048576, splits=256, gpu="L4"),                    # thousands of waves: "… N more"
           dict(B=32, L=16384, splits=6, gpu="A100 SXM4 80GB", dist="zipf", unified=False),
           dict(B=4, L=4096, splits=4, gpu="RTX 4090", gqa=False, q_len=4)]


@pytest.mark.parametrize("setting", LAYOUTS, ids=lambda s: f"{s['gpu']}-B{s['B']}-splits{s['splits']}")
def test_text_stays_off_the_sm_squares(no_results, setting):
    """In the drawn picture (pixels of the PNG the widget shows) every line of text is clear of every SM map:
    a wave's title sits well above its squares, the subtitle well above the titles, and no two texts overlap."""
    import matplotlib

    from fdlib.course.explorer_model import summary_and_curve
    from fdlib.course.figures import STYLE
    summ, sched, ex = summary_and_curve(H_q=32, H_kv=8, **setting)
    with matplotlib.rc_context(STYLE):     # as in a notebook: the course style (constrained layout on) applied
        canvas = E._Canvas(dpi=80)         # the widget's figure: FIGSIZE at 80 dpi, shown 800 px wide
        canvas.update(summ, sched, ex)
        canvas.png()
    r = canvas.fig.canvas.get_renderer()
    W, H = canvas.fig.bbox.width, canvas.fig.bbox.height
    assert (W, H) == (800, 544)
    every = [canvas.suptitle, canvas.subtitle, canvas.map_label, *(ax.title for ax in canvas.maps), *canvas.empty,
             canvas.curve_ax.title, canvas.curve_ax.xaxis.label, canvas.curve_ax.yaxis.label,
             canvas.cbar.ax.yaxis.label, *canvas.legend.get_texts()]
    for t in every:                                                          # whole, inside the picture
        if t.get_text():
            b = t.get_window_extent(r)
            assert b.x0 >= 0 and b.y0 >= 0 and b.x1 <= W and b.y1 <= H, (t.get_text(), b, (W, H))
    squares = [im.get_window_extent(r) for im in canvas.images if im.get_visible()]
    texts = {t.get_text(): t.get_window_extent(r)
             for t in [canvas.suptitle, canvas.subtitle, canvas.map_label, *(ax.title for ax in canvas.maps),
                       *canvas.empty] if t.get_text()}
    assert squares and len(texts) >= 4, texts
    margin = 3                                                               # pixels
    for text, box in texts.items():
        for sq in squares:
            assert not box.expanded(1, 1).padded(margin).overlaps(sq), (text, box, sq)
    for i, (a, box_a) in enumerate(texts.items()):
        for b, box_b in list(texts.items())[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
    sub = texts[canvas.subtitle.get_text()]
    for ax, im in zip(canvas.maps, canvas.images):     # clear gaps, not touching lines: 6 px and a 12-px band
        if im.get_visible():
            title, sq = ax.title.get_window_extent(r), im.get_window_extent(r)
            assert title.y0 - sq.y1 >= 6 and sub.y0 - title.y1 >= 12, (ax.title.get_text(), title, sq, sub)


def test_static_figure_keeps_its_margins_under_the_course_style(no_results):
    """draw() under the course style: the subtitle stays above the wave titles, the titles above the squares."""
    import matplotlib

    from fdlib.course.figures import STYLE
    with matplotlib.rc_context(STYLE):
        fig = E.draw(B=1, H_q=32, H_kv=8, L=131072, splits=16)
        fig.canvas.draw()
    r = fig.canvas.get_renderer()
    maps = [ax for ax in fig.axes if ax.images]
    sub = next(t for t in fig.texts if "cost model" in t.get_text()).get_window_extent(r)
    title, sq = maps[0].title.get_window_extent(r), maps[0].images[0].get_window_extent(r)
    assert title.y0 - sq.y1 >= 6 and sub.y0 - title.y1 >= 12, (title, sq, sub)
    label = next(t for t in maps[0].texts if "per row" in t.get_text()).get_window_extent(r)
    assert label.x0 >= 0 and label.x1 < sq.x0, (label, sq)


def test_the_readout_shows_what_the_default_call_runs():
    """For two or more sequences the summary adds the launch decode_attention runs with the lengths on the device
    (stream-K: fdlib.plan.device_schedule_suits), from the timeline model: the same programs, shares, makespan and
    idle share as timeline.model_timeline's stream-K schedule of those lengths; one sequence runs another kernel
    (no line), and equal rows show fewer shares with work than programs (whole pieces a row)."""
    from fdlib.course import explorer_model as M
    from fdlib.course.timeline import model_timeline
    s = M.summary(B=32, H_q=32, H_kv=8, L=16384, splits=6, dist="uniform")
    t = model_timeline(M.ragged_lengths("uniform", 32, 16384), 32, 8, schedule="stream-k", gpu="H200")
    (line,) = [x for x in s.lines() if x.startswith("default call")]
    assert (s.streamk_programs, s.streamk_shares, s.streamk_us) == (t.info["programs"], t.info["shares"], t.makespan)
    assert f"stream-K, {t.info['programs']} programs" in line and f"makespan {t.makespan:.1f} µs" in line
    eq = M.summary(B=8, H_q=32, H_kv=8, L=1024, splits=1)
    assert 0 < eq.streamk_shares < eq.streamk_programs
    one = M.summary(B=1, H_q=32, H_kv=8, L=131072, splits=16)
    assert one.streamk_programs == 0 and not any(x.startswith("default call") for x in one.lines())
    lesson = (Path(__file__).resolve().parents[1] / "notebooks" / "src" / "06_paged_ragged.md").read_text()
    said = "The explorer shows both, and the default call's stream-K, for a length histogram."
    assert said in " ".join(lesson.split())
