"""fdlib.timeline: the model timelines (split, unified, balanced, stream-K), recorded buffers, the Gantt plot."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fdlib import costmodel, timeline as T
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
    assert sk.source == "stream-K model" and sk.programs == 2 * 132 and sk.info["block_n"] == 64
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
    assert "H200" in title and "cost model" in title and "split" in title and "idle" in title
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
