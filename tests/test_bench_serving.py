"""python -m fdlib.bench --serving: the batches' length laws, a quick run through the whole path (interpreter), rows
that fail reported and never raised, and the captured protocol: a call made while the lengths held L_max, then
run again with the batch's lengths copied into the same tensor, checked against the reference."""
from __future__ import annotations

import json

import pytest
import torch

from fdlib import runtime
from fdlib.bench.__main__ import main
from fdlib.bench.ragged import case_inputs, case_record
from fdlib.bench import serving
from fdlib.bench.serving import CASES, QUICK_CASES, draw_case_lengths, measure_row, parse_row

gpu_only = pytest.mark.skipif(runtime.MODE != "gpu", reason="CUDA graphs need a GPU")


def test_the_seven_batches_and_their_laws():
    """The issue's seven batches (B, heads), each law's range, and every draw reproducible from its seed."""
    assert [(B, hq, hkv) for _, B, hq, hkv, _ in CASES] == [(32, 32, 8), (128, 32, 8), (8, 32, 8), (48, 64, 8),
                                                            (24, 28, 4), (256, 32, 8), (1, 32, 8)]
    assert len(QUICK_CASES) == len(CASES)
    his = {0: 32768, 3: 16384, 4: 65536, 5: 2048}
    for i, (_, B, _, _, law) in enumerate(CASES):
        lens = draw_case_lengths(law, B, seed=i)
        assert len(lens) == B and min(lens) >= 1 and lens == draw_case_lengths(law, B, seed=i)
        if i in his:
            assert max(lens) <= his[i]
    one = draw_case_lengths(CASES[2][4], 8, seed=2)
    assert one.count(131072) == 1 and max(x for x in one if x != 131072) <= 20000
    assert draw_case_lengths(CASES[6][4], 1, seed=6) == [131072]
    chat = draw_case_lengths(("lognormal", 2048, 1.0, 32768), 4000, seed=1)
    assert 1700 < sorted(chat)[2000] < 2400 and max(chat) <= 32768           # median 2048, clipped
    assert draw_case_lengths(("uniform", 64), 50, seed=3) != draw_case_lengths(("uniform", 64), 50, seed=4)


def test_row_specs():
    assert parse_row("unified#4+invariant@captured") == serving.Row("unified#4+invariant@captured", "plan",
                                                                     "unified", 4, True, True)
    assert parse_row("invariant") == serving.Row("invariant", "plan", "auto", None, True, False)
    assert parse_row("worklist@captured").captured and parse_row("worklist@captured").method == "worklist"
    assert parse_row("default").kind == "default" and parse_row("captured").captured
    assert parse_row("unified@4").error and "NAME[#S][+invariant][@captured]" in parse_row("unified@4").error


def test_quick_serving_run_writes_the_files(tmp_path, monkeypatch):
    """The CLI end to end on two batches: the JSON's fields, every good row right against the reference with its
    ratio to plan_host, an unknown method and a bad spec reported as error rows, and the Markdown table."""
    monkeypatch.setenv("FDLIB_GIT_COMMIT", "abc123")
    specs = ["unified#2@captured", "nosuch_method", "nosuch#2@captured", "unified@4"]
    assert main(["--serving", "--quick", "--cases", "3,7", "--methods", ",".join(specs), "--no-ceiling",
                 "--out", str(tmp_path), "--name", "s", "--no-progress"]) == 0
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["schema"] == "fdlib.bench/1" and res["kind"] == "serving" and res["ceiling"] is None
    prov = res["provenance"]
    assert prov["git_commit"] == "abc123" and prov["command"].startswith("python -m fdlib.bench --serving")
    assert all(prov[k] for k in ("device", "torch", "triton", "date_utc", "fdlib"))
    assert res["settings"]["cases"] == [3, 7]
    assert res["settings"]["rows"] == ["plan_host", "default", "captured", *specs]
    assert [c["case"] for c in res["cases"]] == [3, 7] and res["cases"][1]["lengths"] == [128]
    recs = res["records"]
    assert len(recs) == 2 * 2 * 7
    assert [(r["case"], r["layout"]) for r in recs[::7]] == [(3, "paged"), (3, "contiguous"), (7, "paged"),
                                                             (7, "contiguous")]
    for r in recs:
        if r["row"].startswith("nosuch") or r["row"] == "unified@4":
            assert r["status"] == "error" and r["error"], r
            continue
        assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["us"] > 0 and r["kernel"], r
        assert r["kv_mb"] > 0 and r["ratio_plan_host"] > 0
    assert {r["ratio_plan_host"] for r in recs if r["row"] == "plan_host"} == {1.0}
    assert "method" in next(r for r in recs if r["row"] == "nosuch_method")["error"]
    assert [r["splits"] for r in recs if r["row"] == "unified#2@captured"] == [2, 2, 2, 2]
    md = (tmp_path / "s.md").read_text()
    assert "## Summary" in md and "| 3 | B=3 4:1, one row of 128, two 1..40 | paged |" in md
    assert "error: spec: expected NAME[#S][+invariant][@captured]" in md


def test_every_quick_batch_runs_right():
    """The seven quick batches, both caches, the three standard rows: every answer right."""
    res = serving.run_serving(quick=True, ceiling=False, progress=False, command="test")
    assert len(res["records"]) == 7 * 2 * 3 and [c["case"] for c in res["cases"]] == list(range(1, 8))
    for r in res["records"]:
        assert r["status"] == "ok" and r["rel_err"] < 1e-2, (r["row"], r.get("error"))


def _batch(case=2, layout=16):
    """The inputs of one quick batch (the one with a long row), its record fields and reference."""
    name, B, hq, hkv, law = QUICK_CASES[case]
    shape = dict(dtype="bfloat16", B=B, H_q=hq, H_kv=hkv, D=32)
    lens = draw_case_lengths(law, B, seed=case)
    base, stored = case_record(shape, lens, layout)
    base.update(case=case + 1, name=name, layout="paged" if layout else "contiguous")
    copies, ref = case_inputs(shape, lens, layout, case, "shuffled", stored, False)     # one copy
    return copies, ref, base, lens


SETTINGS = dict(graphs=runtime.MODE == "gpu", warmup_ms=1, rep_ms=2, graph_rep_ms=2, cpu_runs=1)


@pytest.mark.parametrize("page", [16, 0])
def test_captured_runs_with_the_lengths_copied_in(page, monkeypatch):
    """The captured row's call first sees L_max in every row (the capture), then the batch's lengths, copied into
    the same tensor; its answer matches the reference. Without the copy the row is flagged wrong: the check can
    fail."""
    from fdlib.plan import DecodePlan
    copies, ref, base, lens = _batch(layout=page)
    L_max = copies[0][1].shape[1] if not page else copies[0][4].shape[1] * page
    seen, run = [], DecodePlan.run
    monkeypatch.setattr(DecodePlan, "run", lambda self, q, k, v, cs=None, **kw: seen.append(
        (id(cs), cs.tolist())) or run(self, q, k, v, cs, **kw))
    rec = measure_row(parse_row("captured"), copies, ref, base, dict(SETTINGS, graphs=False))
    assert rec["status"] == "ok" and rec["rel_err"] < 1e-2, rec
    assert seen[0][1] == [L_max] * len(lens) and seen[1][1] == lens and seen[0][0] == seen[1][0]
    monkeypatch.setattr(serving, "set_lengths", lambda steps: None)
    rec = measure_row(parse_row("captured"), copies, ref, base, dict(SETTINGS, graphs=False))
    assert rec["status"] == "wrong" and rec["rel_err"] > 1e-2 and "relative error" in rec["error"]


def test_a_row_that_raises_is_recorded(monkeypatch):
    copies, ref, base, _ = _batch()
    rec = measure_row(parse_row("streamk#3"), copies, ref, base, dict(SETTINGS, graphs=False))
    assert rec["status"] == "error" and "num_splits" in rec["error"]


def test_budget_and_bad_cases(tmp_path, monkeypatch):
    """A spent budget skips every batch left; with a budget, a partial file is written after each batch and cache
    and removed once the files are; a case number out of range, or a B:context pair, is refused before any work."""
    assert main(["--serving", "--quick", "--budget-s", "0", "--no-ceiling", "--out", str(tmp_path), "--name", "b",
                 "--no-progress"]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["records"] == [] and len(res["skipped"]) == 2 * 7 and "budget" in res["skipped"][0]["reason"]
    written = []
    monkeypatch.setattr(serving, "free_memory", lambda: written.append(sorted(p.name for p in tmp_path.iterdir())))
    assert main(["--serving", "--quick", "--cases", "7", "--budget-s", "1000", "--no-ceiling", "--out", str(tmp_path),
                 "--name", "c", "--no-progress"]) == 0
    assert "c.partial.json" in written[-1] and len(json.loads((tmp_path / "c.json").read_text())["records"]) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.md", "c.json", "c.md"]
    assert main(["--serving", "--quick", "--cases", "8", "--out", str(tmp_path), "--no-progress"]) == 2
    assert main(["--serving", "--quick", "--cases", "1:20", "--out", str(tmp_path), "--no-progress"]) == 2


@gpu_only
@pytest.mark.parametrize("page", [16, 0])
def test_captured_graph_replays_the_new_lengths(page, monkeypatch):
    """On the GPU: the graph captured while the lengths held L_max, replayed after the batch's lengths were copied
    in, gives the reference's answer; replayed without the copy, it is flagged wrong."""
    copies, ref, base, _ = _batch(layout=page)
    rec = measure_row(parse_row("captured"), copies, ref, base, SETTINGS)
    assert rec["status"] == "ok" and rec["graph_us"] > 0 and "eager_us" not in rec, rec
    monkeypatch.setattr(serving, "set_lengths", lambda steps: None)
    rec = measure_row(parse_row("captured"), copies, ref, base, SETTINGS)
    assert rec["status"] == "wrong", rec
    torch.cuda.synchronize()


def test_gpu_branches_simulated(monkeypatch):
    """The GPU branches with CPU stand-ins for the timers: graph and eager times, the captured protocol (a call
    while the lengths hold L_max, the lengths copied in, a replay: still right), the ceiling, each row's ratio to
    plan_host and its % of the ceiling, and the table's cells."""
    import triton.testing
    monkeypatch.setattr(runtime, "MODE", "gpu")
    monkeypatch.setattr(runtime, "device_name", lambda: "Simulated GPU")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup=25, rep=100, return_mode="mean": (fn(), 0.010)[1])
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep=20, return_mode="mean": (fn(), 0.005)[1])
    order = []

    def after(fn, before_replay, rep_ms=20):      # time_graph_after: capture, lengths copied in, replays
        order.append("capture")
        fn()
        before_replay()
        order.append("replay")
        fn()
        return 8.0
    monkeypatch.setattr(serving, "time_graph_after", after)
    monkeypatch.setattr(serving, "measure_ceiling_or_none", lambda on, gib, settings: {"tbs": 2.0} if on else None)
    inputs = serving.case_inputs
    monkeypatch.setattr(serving, "case_inputs", lambda *a: inputs(*a[:-1], False))    # one copy, not 4x the L2's
    res = serving.run_serving(quick=True, cases=(3,), methods=("unified#2@captured",), progress=False, command="t")
    assert res["settings"]["graphs"] and res["ceiling"] == {"tbs": 2.0} and order == ["capture", "replay"] * 4
    for r in res["records"]:
        assert r["status"] == "ok" and r["rel_err"] < 1e-2, (r["row"], r.get("error"))
        if r["captured"]:
            assert r["graph_us"] == r["us"] == 8.0 and "eager_us" not in r and r["ratio_plan_host"] == 1.6
        else:
            assert r["graph_us"] == r["us"] == 5.0 and r["eager_us"] == 10.0 and r["ratio_plan_host"] == 1.0
        assert r["pct_ceiling"] == pytest.approx(100 * r["kv_mb"] / r["us"] / 2.0)
    md = serving.format_serving_table(res)
    assert "read ceiling: 2.00 TB/s" in md and "timing: CUDA graph" in md and " · 1.60× · " in md
