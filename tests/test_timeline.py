"""fdlib.course.timeline: the model timelines (split, unified, balanced, stream-K), recorded buffers, the Gantt plot."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fdlib import costmodel
from fdlib.course import timeline as T
from fdlib.schedule import balanced

CAL = costmodel.H200_DEFAULT


def _prog(mb, startup=0.0, key=0):
    return T._Program(((key, mb),), startup, 0)


def test_one_program_streams_at_rho():
    sm, s, e = T.simulate([_prog(1.0, startup=2.0)], sms=4, r=1, bw_tbs=5.0, rho_tbs=0.05, merge_us={})
    assert e[0] == pytest.approx(2.0 + 1.0 / 0.05)


def test_many_programs_share_the_bandwidth():
    """8 slots, 8 programs of 1 MB, BW 1 TB/s, ρ 10 TB/s: together bandwidth-bound, all end at 8 µs."""
    sm, s, e = T.simulate([_prog(1.0, key=i) for i in range(8)], sms=8, r=1, bw_tbs=1.0, rho_tbs=10.0,
                          merge_us={})
    assert np.allclose(e, 8.0) and sorted(sm.tolist()) == list(range(8))


def test_greedy_dispatch_to_the_first_free_slot():
    """2 SMs: a long program on SM 0, short ones follow each other on SM 1 (the next program takes the slot
    that frees first), and the merge runs on the last program of its row."""
    progs = [_prog(10.0, key="a"), _prog(1.0, key="b"), _prog(1.0, key="b"), _prog(1.0, key="c")]
    sm, s, e = T.simulate(progs, sms=2, r=1, bw_tbs=100.0, rho_tbs=1.0, merge_us={"b": 0.5})
    assert sm.tolist() == [0, 1, 1, 1]
    assert e.tolist() == pytest.approx([10.0, 1.0, 2.5, 3.5])     # program 2 finishes row b and merges 0.5 µs
    assert s.tolist() == pytest.approx([0.0, 0.0, 1.0, 2.5])


def test_dense_batch_one_full_wave_has_no_idle_sm():
    """132 equal programs on 132 SMs: every SM busy from start to end."""
    tl = T.model_timeline([131072] * 1, 32, 8, schedule="unified", splits=16)   # 8 heads × 16 splits = 128
    assert tl.programs == 128 and tl.info["splits"] == 16
    assert set(tl.sm.tolist()) == set(range(128))
    assert tl.idle_fraction == pytest.approx(4 / 132, abs=0.01)             # 4 SMs never get a program


def test_every_key_is_streamed_once():
    lens = [0, 1, 127, 128, 129, 5000, 32768, 300]
    for sched in T.SCHEDULES:
        tl = T.model_timeline(lens, 8, 2, schedule=sched)
        assert tl.kv_mb == pytest.approx(2 * sum(lens) * 2 * 128 * 2 / 1e6)
        # bandwidth never exceeds the model's BW
        assert tl.kv_mb / tl.makespan <= CAL.bw_tbs * (1 + 1e-9), sched


def test_balanced_items_follow_fdlib_schedule():
    lens = T.batch_lengths("uniform")
    tl = T.model_timeline(lens, 32, 8, schedule="balanced")
    s = balanced(lens, tl.info["budget"], tl.info["block_n"])
    assert tl.programs == 8 * s.items and tl.info["chunk_tiles"] == s.chunk_tiles
    assert tl.info["budget"] == 32 * tl.info["splits"]


def test_balancing_leaves_fewer_idle_sms_on_the_issue_batch():
    lens = T.batch_lengths("uniform")
    split = T.model_timeline(lens, 32, 8, schedule="split")
    bal = T.model_timeline(lens, 32, 8, schedule="balanced", splits=split.info["splits"])
    sk = T.model_timeline(lens, 32, 8, schedule="stream-k")
    assert bal.idle_fraction < split.idle_fraction and bal.makespan < split.makespan
    assert sk.idle_fraction < bal.idle_fraction
    # as the kernel launches: 2 programs per SM on the persistent kernel's 64-key tiles
    assert split.source == bal.source == sk.source == "timeline model" and sk.programs == 2 * 132 and sk.info["block_n"] == 64
    assert split.bands and split.bands[0][0] == "kernel boundary"


def test_split_count_is_the_cost_models():
    lens = T.batch_lengths("zipf")
    ex = costmodel.explain(32, 32, 8, lens, gpu="H200")
    assert T.model_splits(lens, 32, 8) == ex.chosen
    assert T.model_timeline(lens, 32, 8).info["splits"] == ex.chosen


def test_stream_k_slices_span_rows_and_merge_them():
    lens = [1000, 3, 1000]
    tl = T.model_timeline(lens, 4, 1, schedule="stream-k", budget=3)
    N = tl.info["block_n"]
    assert tl.programs == 3 and tl.info["tiles"] == 2 * -(-1000 // N) + 1
    assert (tl.row == -1).any()                                # a slice over several sequences


def test_empty_rows_cost_a_start_up():
    tl = T.model_timeline([0, 0, 0], 4, 1, schedule="balanced", budget=3)
    assert tl.programs == 3 and np.allclose(tl.end_us - tl.start_us, CAL.t_wave_us)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="schedule"):
        T.model_timeline([10], 4, 1, schedule="fifo")
    with pytest.raises(ValueError, match="H_q"):
        T.model_timeline([10], 6, 4)
    with pytest.raises(ValueError, match="lengths"):
        T.model_timeline([], 4, 1)
    with pytest.raises(ValueError, match="dist"):
        T.batch_lengths("pareto")


def test_recorded_buffer_makespan_and_idle():
    buf = np.array([[0, 1000, 5000], [1, 1000, 3000], [1, 3000, 5000], [0, 0, 0], [2, 2000, 3000]])
    tl = T.from_buffer(buf, "GPU X", "balanced", sms=4)
    assert tl.programs == 4 and tl.makespan == pytest.approx(4.0)
    # busy: SM0 4 µs, SM1 4 µs, SM2 1 µs, SM3 0 over 4 SMs × 4 µs
    assert tl.idle_fraction == pytest.approx(1 - 9 / 16)
    with pytest.raises(ValueError, match="ends before it starts"):
        T.from_buffer([[0, 5, 1]], "GPU X", "x")
    with pytest.raises(ValueError, match="no program recorded"):
        T.from_buffer(np.zeros((3, 3)), "GPU X", "x")


def test_span_parts_add_up_to_the_makespan():
    # SM0: programs 1-5 and 6-9 µs (a 1 µs gap), SM1: 0-4 µs and 2-3 µs at once; makespan 9 µs from t = 0
    buf = np.array([[0, 1000, 5000], [0, 6000, 9000], [1, 0, 4000], [1, 2000, 3000]])
    p = T.from_buffer(buf, "GPU X", "x", sms=2).span_parts()
    assert p["makespan"] == pytest.approx(9.0) and p["sms_used"] == 2 and p["programs_per_sm"] == 2
    assert p["ramp"] == pytest.approx((1 + 0) / 2) and p["tail"] == pytest.approx(9 - (9 + 4) / 2)
    assert p["busy"] == pytest.approx((7 + 4) / 2) and p["gaps"] == pytest.approx((1 + 0) / 2)
    assert p["ramp"] + p["gaps"] + p["busy"] + p["tail"] == pytest.approx(p["makespan"])
    assert p["program"] == pytest.approx(np.median([4, 3, 4, 1]))
    ends = T.from_buffer(buf, "GPU X", "x", sms=3).sm_last_end_us()     # SM 2 ran nothing
    assert ends[:2].tolist() == pytest.approx([9.0, 4.0]) and np.isnan(ends[2])


def test_lanes_separate_programs_sharing_an_sm():
    tl = T.from_buffer([[0, 0, 10], [0, 5, 20], [0, 12, 30]], "GPU X", "x", sms=1)
    assert T.lanes(tl).tolist() == [0, 1, 0]
    assert tl.idle_fraction == pytest.approx(0.0)


def test_recorded_file_round_trip(tmp_path):
    prov = {"device": "NVIDIA H200", "date_utc": "2026-12-01T00:00:00+00:00", "torch": "2.x", "triton": "3.x",
            "fdlib": "0.1", "command": "python tools/record_timeline.py", "sm_count": 132}
    batch = dict(T.BATCH, name="uniform", lengths=[5, 6], seed=0, kv_mb=1.0)
    run = {"method": "balanced", "mode": "balanced, 12 items", "kernel": "balanced", "splits": 3,
           "programs": [[0, 100, 2100], [5, 100, 1100]]}
    path = T.save_recorded(tmp_path / "timeline-uniform.json", batch, [run], prov)
    (tl,) = T.load_recorded(path)
    assert tl.sms == 132 and tl.makespan == pytest.approx(2.0) and tl.source.startswith("recorded on NVIDIA H200")
    assert "command: python tools/record_timeline.py" in tl.info["provenance"] and tl.info["splits"] == 3
    (tmp_path / "other.json").write_text(json.dumps({"schema": "x"}))
    with pytest.raises(ValueError, match="not a timeline file"):
        T.load_recorded(tmp_path / "other.json")


def test_gantt_has_title_axes_units_and_source():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tl = T.model_timeline(T.batch_lengths("zipf"), 32, 8, schedule="split")
    ax = T.draw_gantt(tl)
    title = ax.get_title()
    assert "H200" in title and "timeline model" in title and "cost model" not in title and "split" in title and "idle" in title
    assert "(µs)" in ax.get_xlabel() and "SM" in ax.get_ylabel()
    ax2 = T.draw_gantt(tl, max_sms=16)
    assert "16 of 132 shown" in ax2.get_ylabel()
    plt.close("all")


def test_record_tool_needs_a_gpu(tmp_path, capsys):
    """tools/record_timeline.py refuses to run in the interpreter (its timestamps come from the GPU's timer)."""
    import importlib.util
    from pathlib import Path
    from fdlib import runtime
    if runtime.MODE == "gpu":
        pytest.skip("on a GPU the tool runs for real (see tools/record_timeline.py)")
    path = Path(__file__).resolve().parents[1] / "tools" / "record_timeline.py"
    spec = importlib.util.spec_from_file_location("record_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert mod.case_name("128:32:8:uniform:1024:16") == "B128-32x8-uniform-1024-page16"
    with pytest.raises(SystemExit, match="B:H_q:H_kv:dist:mean:page"):
        mod.record_case("128:32:8:uniform", 0, 1, ["auto"])


# ----------------------------------------------------------------------------------------------- pretend GPU, parts
def test_pretend_gpu_keeps_an_sms_rates_and_scales_the_bandwidth():
    g = T.pretend_gpu(8)
    h200 = T.gpus.PRESETS["H200"]
    assert g.sms == 8 and "8 SMs" in g.name and "H200" in g.name
    assert g.bandwidth_tbs == pytest.approx(h200.bandwidth_tbs * 8 / 132)
    assert g.smem_per_sm_kb == h200.smem_per_sm_kb and g.regs_per_sm == h200.regs_per_sm
    _, cal, _, r = T.model_inputs([4096] * 8, 4, 1, gpu=g)
    _, cal_h, _, r_h = T.model_inputs([4096] * 8, 4, 1, gpu="H200")
    assert cal.bw_tbs == pytest.approx(cal_h.bw_tbs * 8 / 132) and cal.rho_tbs == cal_h.rho_tbs
    assert cal.t_wave_us == cal_h.t_wave_us and r == r_h
    tl = T.model_timeline(T.batch_lengths("uniform", B=8, mean=4096), 4, 1, gpu=g)
    assert tl.sms == 8 and set(tl.sm.tolist()) <= set(range(8)) and tl.device == g.name
    assert tl.kv_mb / tl.makespan <= cal.bw_tbs * (1 + 1e-9)      # never faster than the pretend GPU's BW
    with pytest.raises(ValueError, match="sms"):
        T.pretend_gpu(0)
    with pytest.raises(ValueError, match="sms"):
        T.pretend_gpu(200)


def test_batch_lengths_take_a_mean():
    assert T.batch_lengths("uniform") == T.batch_lengths("uniform", mean=16384)
    lens = T.batch_lengths("uniform", B=8, mean=4096)
    assert len(lens) == 8 and max(lens) <= 2 * 4096 and lens != T.batch_lengths("uniform", B=8)


def test_a_piece_ends_when_its_bytes_are_streamed_at_the_shared_rate():
    """P0 streams 2 MB of row a then 2 MB of row b, P1 starts up for 0.5 µs then streams 1 MB of row c; 2 SMs,
    BW 1 TB/s, ρ 1: P0 alone at 1 MB/µs until 0.5, both at 0.5 until P1 ends at 2.5 (P0 has streamed 1.5 MB),
    P0 alone again: a ends at 3, b at 5, and b's merge (P0 finished its last piece) at 5.25."""
    progs = [T._Program(((("a", 0), 2.0), (("b", 0), 2.0)), 0.0, -1), T._Program(((("c", 0), 1.0),), 0.5, 0)]
    sm, s, e, parts = T.simulate(progs, sms=2, r=1, bw_tbs=1.0, rho_tbs=1.0, merge_us={("b", 0): 0.25}, parts=True)
    p0 = [(kind, key, a, b) for pid, kind, key, a, b in parts if pid == 0]
    assert [(k, key) for k, key, _, _ in p0] == [("stream", ("a", 0)), ("stream", ("b", 0)), ("merge", None)]
    assert [x for _, _, a, b in p0 for x in (a, b)] == pytest.approx([0.0, 3.0, 3.0, 5.0, 5.0, 5.25])
    p1 = [(kind, a, b) for pid, kind, _, a, b in parts if pid == 1]
    assert p1 == [("start-up", 0.0, 0.5), ("stream", 0.5, pytest.approx(2.5))]
    assert e.tolist() == pytest.approx([5.25, 2.5])
    assert T.simulate(progs, sms=2, r=1, bw_tbs=1.0, rho_tbs=1.0, merge_us={})[2].tolist() == pytest.approx([5.0, 2.5])


@pytest.mark.parametrize("schedule", T.SCHEDULES)
def test_parts_tile_every_program_from_start_to_end(schedule):
    lens = [0, 1, 127, 700, 3000, 5000]
    tl = T.model_timeline(lens, 4, 1, schedule=schedule, gpu=T.pretend_gpu(4))
    by = {}
    for i, kind, b, a, e in tl.parts:
        by.setdefault(i, []).append((kind, b, a, e))
    assert set(by) == set(range(tl.programs))
    for i, ps in by.items():
        assert ps[0][2] == pytest.approx(tl.start_us[i]) and ps[-1][3] == pytest.approx(tl.end_us[i])
        for (_, _, _, e0), (_, _, a1, _) in zip(ps, ps[1:]):
            assert a1 == pytest.approx(e0)                       # no gap inside a program
        kinds = [k for k, *_ in ps]
        assert kinds[0] in ("start-up", "stream") and kinds.count("merge") <= 1 and "merge" not in kinds[:-1]
        assert all(lens[b] > 0 for kind, b, _, _ in ps if kind == "stream")
    rows = {b for _, kind, b, _, _ in tl.parts if kind == "stream"}
    assert rows == {b for b, L in enumerate(lens) if L > 0}          # every row with keys is streamed by someone


def test_idle_spans_add_up_to_the_idle_fraction():
    g = T.pretend_gpu(8)
    lens = T.batch_lengths("uniform", B=8, mean=4096)
    for schedule in ("split", "balanced", "stream-k"):
        tl = T.model_timeline(lens, 4, 1, schedule=schedule, gpu=g)
        idle = sum(b - a for k in range(tl.sms) for a, b in T.idle_spans(tl, k))
        assert idle / (tl.sms * tl.makespan) == pytest.approx(tl.idle_fraction, abs=1e-9), schedule
    # the two-stage path's kernel boundary is idle on every SM; its stage-2 merge is not
    split = T.model_timeline(lens, 4, 1, schedule="split", gpu=g)
    (_, a, b), (_, m0, m1) = split.bands
    for k in range(split.sms):
        spans = T.idle_spans(split, k)
        assert any(s <= a + 1e-9 and e >= b - 1e-9 for s, e in spans)
        assert not any(s < m1 - 1e-9 and e > m0 + 1e-9 for s, e in spans)


def test_gantt_colours_merge_and_idle_apart_from_the_sequences():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex
    g = T.pretend_gpu(8)
    lens = T.batch_lengths("uniform", B=8, mean=4096)
    tls = [T.model_timeline(lens, 4, 1, schedule=s, gpu=g) for s in ("split", "balanced", "stream-k")]
    ax = T.draw_gantt(tls[1])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [f"sequence {b}" for b in range(8)] == labels[:8]
    assert "merge" in labels and "idle SM" in labels and "start-up (pale)" in labels
    assert T.MERGE_COLOR not in T.SEQUENCE_COLORS and len(set(T.SEQUENCE_COLORS)) == len(T.SEQUENCE_COLORS)
    faces = {to_hex(c) for coll in ax.collections for c in coll.get_facecolor()}
    assert T.MERGE_COLOR in faces and to_hex(T.IDLE_STYLE["facecolor"]) in faces
    assert "pretend H200 with 8 SMs" in ax.get_title() and "timeline model" in ax.get_title()
    assert ax.get_ylabel() == "SM id (8 SMs)" and "(µs)" in ax.get_xlabel()
    sk = T.draw_gantt(tls[2])      # stream-K: two programs an SM, one in each slot, drawn as two lanes
    assert sk.get_ylabel() == "SM id (8 SMs; 2 slots each)" and "one in each slot (2 an SM)" in sk.get_title()
    assert "KV head" not in sk.get_title()     # one KV head: nothing to say per head
    fig = T.draw_gantts(tls, suptitle="three schedules")
    axes = fig.get_axes()
    assert len(axes) == 3 and len({a.get_xlim() for a in axes}) == 1
    assert axes[0].get_legend() is not None and all(a.get_legend() is None for a in axes[1:])
    assert axes[-1].get_xlabel().endswith("(µs)")
    with pytest.raises(ValueError, match="tls"):
        T.draw_gantts([])
    plt.close("all")


def test_piece_boundaries_after_a_stretch_with_nothing_streaming():
    """One slot: P0 streams rows a and b (1 MB each at 1 MB/µs), then P1 starts up for 1 µs (nothing streams:
    the virtual clock stands still) and streams rows c and d."""
    progs = [T._Program(((("a", 0), 1.0), (("b", 0), 1.0)), 0.0, -1),
             T._Program(((("c", 0), 1.0), (("d", 0), 1.0)), 1.0, -1)]
    *_, parts = T.simulate(progs, sms=1, r=1, bw_tbs=5.0, rho_tbs=1.0, merge_us={}, parts=True)
    assert [(pid, kind, key[0] if key else None) for pid, kind, key, _, _ in parts] == [
        (0, "stream", "a"), (0, "stream", "b"), (1, "start-up", "c"), (1, "stream", "c"), (1, "stream", "d")]
    assert [x for *_, a, b in parts for x in (a, b)] == pytest.approx([0, 1, 1, 2, 2, 3, 3, 4, 4, 5])


def test_stream_k_model_on_equal_rows_takes_the_kernels_shares():
    """On equal rows the model's stream-K schedule takes the kernel's shares (fdlib.kernels.streamk.active_shares):
    B = 8 rows of 16 tiles and 33 shares a head give 32 shares with work, four whole pieces a row, and the mode
    says so; on ragged rows every launched share has work."""
    from fdlib.kernels.config import persistent_config
    from fdlib.kernels.streamk import active_shares
    N = persistent_config(128, 2, compiled_mode=True).BLOCK_N
    t = T.model_timeline([16 * N] * 8, 32, 8, 128, 2, schedule="stream-k", gpu="H100 SXM")
    P_h = t.info["programs"] // 8
    P_a = active_shares([16] * 8, P_h)
    assert P_a < P_h and t.info["shares"] == 8 * P_a and t.info["tiles_per_program"] == 8 * 16 / P_a
    assert f"{8 * P_a} with a share" in t.mode
    r = T.model_timeline([N, 40 * N, 3 * N] + [16 * N] * 5, 32, 8, 128, 2, schedule="stream-k", gpu="H100 SXM")
    assert r.info["shares"] == r.info["programs"] and "with a share" not in r.mode
