"""The benchmark harness: quick mode end to end (in-process and ``python -m fdlib.bench``), result files,
the splits sweep, and the pieces the GPU paths rely on. GPU-only checks are marked ``gpu``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fdlib
from fdlib import costmodel, runtime
from fdlib.bench import device_slug, format_table, load_results, plot_results, run_benchmark, run_sweep, write_results
from fdlib.bench import harness, methods, timing
from fdlib.gpus import live_gpu
from fdlib.kernels.config import tile_config

PROVENANCE = ("device", "sm_count", "mode", "torch", "triton", "cuda", "date_utc", "command", "git_commit")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and runtime.MODE == "gpu"), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def quick():
    return run_benchmark(quick=True, progress=False, command="test_bench quick")


def test_quick_records_and_provenance(quick):
    prov = quick["provenance"]
    for key in PROVENANCE:
        assert key in prov, key
    assert prov["command"] == "test_bench quick"
    assert prov["torch"] == torch.__version__ and prov["mode"] == runtime.MODE
    assert quick["shapes"] and quick["records"]
    assert quick["ceiling"]["tbs"] > 0
    by = {}
    for r in quick["records"]:
        by.setdefault(r["method"], []).append(r)
        assert r["status"] in ("ok", "failed", "unavailable", "error"), r
        assert r["kv_bytes"] == 2 * r["B"] * r["H_kv"] * r["L"] * r["D"] * 2
    for name in ("unified", "naive"):
        for r in by[name]:
            assert r["status"] == "ok", r
            assert r["rel_err"] < 1e-2
            assert r["eager_us"] > 0 and r["eager_tbs"] > 0
            assert r["eager_pct_ceiling"] > 0
    for r in by["unified"]:
        assert r["splits"] >= 1 and r["fdlib_method"] == "unified"
    for r in by["cudnn"]:   # on a CPU the cuDNN backend cannot run: recorded, not raised
        if runtime.MODE != "gpu":
            assert r["status"] == "unavailable" and r["reason"]


def test_table_prints(quick, capsys):
    text = format_table(quick)
    print(text)
    out = capsys.readouterr().out
    assert "Time, µs" in out and "KV MB" in out and "unified" in out and "read ceiling" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("| float16")]) >= 2 * len(quick["shapes"])


def test_files_roundtrip_and_no_silent_overwrite(quick, tmp_path):
    paths = write_results(quick, str(tmp_path), name="run")
    for p in paths.values():
        assert os.path.getsize(p) > 0, p
    back = load_results(paths["json"])
    assert back["records"] == json.loads(json.dumps(quick["records"]))
    assert load_results(str(tmp_path))["provenance"]["date_utc"] == quick["provenance"]["date_utc"]
    with pytest.raises(FileExistsError):
        write_results(quick, str(tmp_path), name="run")
    write_results(quick, str(tmp_path), name="run", force=True)
    stamped = write_results(quick, str(tmp_path), plot=False)     # default name: <kind>-<UTC timestamp>
    assert os.path.basename(stamped["json"]).startswith("bench-")
    fig = plot_results(paths["json"])
    titles = [ax.get_title() for ax in fig.axes]
    assert all(quick["provenance"]["device"] in t for t in titles)
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)


def test_cli_quick_subprocess(tmp_path):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    proc = subprocess.run([sys.executable, "-m", "fdlib.bench", "--quick", "--out", str(tmp_path), "--name", "q",
                           "--no-progress"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Time, µs" in proc.stdout and "| float16" in proc.stdout
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"q.{ext}").stat().st_size > 0
    res = load_results(tmp_path / "q.json")
    assert res["provenance"]["command"].startswith("python -m fdlib.bench --quick")
    assert any(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in res["records"])
    again = subprocess.run([sys.executable, "-m", "fdlib.bench", "--quick", "--out", str(tmp_path), "--name", "q"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr


def test_sweep_quick(tmp_path, monkeypatch):
    monkeypatch.setattr(costmodel, "choose", lambda B, H_q, H_kv, L, D, dtype_bytes, gpu, method: 2)   # stand-ins
    monkeypatch.setattr(costmodel, "fa2_rule", lambda B, H_q, H_kv, L, D, sms: 64)
    res = run_sweep(quick=True, L=(96,), candidates=(1, 2, 4, 64), progress=False, command="sweep test")
    (row,) = res["sweep"]
    assert [p["splits"] for p in row["points"]] == [1, 2, 3, 6]   # 4 -> 3 x 32 keys; 64 -> one split per 16-key tile
    assert all(p["status"] == "ok" and p["rel_err"] < 1e-2 for p in row["points"])
    assert row["best"]["splits"] in (1, 2, 3, 6)
    assert row["chosen"]["costmodel"]["splits"] == 2 and row["chosen"]["costmodel"]["ratio_to_best"] >= 1
    assert row["chosen"]["costmodel"]["call"] == harness.COSTMODEL_CALL
    assert row["chosen"]["fdlib_auto"]["splits"] >= 1
    assert row["chosen"]["fa2_rule"]["splits"] == 6                # 64 asked: one split per tile launched
    paths = write_results(res, str(tmp_path), name="s")
    write_results({**res, "kind": "bench", "records": []}, str(tmp_path), name="b", plot=False)
    assert load_results(str(tmp_path), kind="sweep")["kind"] == "sweep"
    assert "model/best" in open(paths["table"]).read()
    assert os.path.getsize(paths["plot"]) > 0


def test_sweep_asks_the_cost_model():
    """The sweep's "costmodel" and "fa2_rule" split counts are fdlib.costmodel's for the shape."""
    shape = {"dtype": "bfloat16", "B": 1, "H_q": 32, "H_kv": 8, "L": 8192, "D": 128}
    row = harness._costmodel_choice(shape)
    assert row == {"splits": costmodel.choose(1, 32, 8, 8192, 128, 2, gpu=live_gpu()), "call": harness.COSTMODEL_CALL}
    assert row["splits"] >= 1
    sms = runtime.sm_count() or 132
    assert harness._fa2_rule_choice(shape) == {"splits": costmodel.fa2_rule(1, 32, 8, 8192, 128, sms=sms)}


def test_method_names_and_forced_splits():
    assert methods.expand_methods(["split", "unified", "cudnn"], [1, 8]) == \
        ["split@1", "split@8", "unified@1", "unified@8", "cudnn"]
    assert methods.parse_method("unified@8") == ("unified", 8)
    for bad in ("nope", "cudnn@4", "unified@0", "unified@999"):
        with pytest.raises(ValueError):
            methods.parse_method(bad)
    m = methods.build("auto@3")
    assert m.kind == "fdlib" and m.info == {"fdlib_method": "auto", "num_splits": 3}
    assert methods.parse_method("unified@8:bhld") == ("unified", 8) and methods.build("auto").layout == "fdlib"
    for bad in ("auto:nhd", "cudnn:bhld", "auto:"):
        with pytest.raises(ValueError, match="layout suffix"):
            methods.parse_method(bad)


def test_fdlib_on_the_peers_layout_reads_the_same_numbers():
    """``auto:bhld`` runs fdlib on the peers' [B, H_kv, L, D] memory (as strided [B, L, H_kv, D] views) and gets
    the reference's answer."""
    shape = {"dtype": "float16", "B": 2, "H_q": 6, "H_kv": 2, "L": 37, "D": 16}
    inp = harness.make_inputs(shape, seed=3)
    ref = harness.reference(inp)
    m = methods.build("unified@2:bhld")
    assert m.layout == "bhld" and m.kind == "fdlib" and "kv_layout" in m.info
    peer = methods.to_layout(inp, "bhld")
    assert harness.rel_error(m.make(peer)(), ref) < 1e-2


def test_grid_skips_large_shapes():
    shapes, skipped = harness.shape_grid((1, 64), (131072,), ((32, 8),), (128,), ("float16",), max_kv_gb=20)
    assert [s["B"] for s in shapes] == [1] and [s["B"] for s in skipped] == [64]
    assert "max-kv-gb" in skipped[0]["reason"]


def test_device_slug_and_foreign_json(tmp_path):
    assert device_slug("NVIDIA H200") == "h200" and device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    (tmp_path / "tune.json").write_text('{"device": "x", "records": []}')   # another tool's file is ignored
    with pytest.raises(FileNotFoundError):
        load_results(str(tmp_path))


def test_l2_rotation_copies():
    l2 = 60 * 2**20
    assert timing.copies_for_l2(2_097_152, l2) == 120          # 2.1 MB cache: 120 copies = 4x L2
    assert timing.copies_for_l2(4 * l2, l2) == 1
    assert timing.copies_for_l2(1, l2) == timing.MAX_COPIES
    calls = []
    rot = timing.Rotating([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        rot()
    assert calls == [0, 1, 2, 0, 1, 2, 0]


def test_peer_layout_matches_reference():
    shape = {"dtype": "float16", "B": 2, "H_q": 4, "H_kv": 2, "L": 40, "D": 16}
    inp = harness.make_inputs(shape)
    ref = harness.reference(inp)
    peer = methods.to_layout(inp, "bhld")
    assert peer.k.shape == (2, 2, 40, 16) and peer.k.is_contiguous() and peer.q.shape == (2, 4, 1, 16)
    # the peers' layout holds the same numbers: attention over it (math backend) matches the reference
    out = torch.nn.functional.scaled_dot_product_attention(peer.q.float(), peer.k.float(), peer.v.float(),
                                                           enable_gqa=True)[:, :, 0]
    assert harness.rel_error(out, ref) < 1e-3


def test_gpu_code_paths_simulated(monkeypatch, tmp_path):
    """The GPU branches (do_bench, do_bench_cudagraph over rotated copies, ratio to cuDNN, graph-timed plot)
    with CPU stand-ins for triton's timers and torch's math backend standing in for cuDNN."""
    import triton.testing
    seen = {"graph_calls": 0}

    def fake_do_bench(fn, warmup=25, rep=100, return_mode="mean"):
        assert return_mode == "median"
        fn()
        return 0.010                                  # ms

    def fake_do_bench_cudagraph(fn, rep=20, return_mode="mean"):
        assert return_mode == "median" and isinstance(fn, timing.Rotating)
        for _ in range(3):
            fn()
        seen["graph_calls"] += 1
        seen["copies"] = len(fn.fns)
        seen["index"] = fn.i
        return 0.005

    monkeypatch.setattr(runtime, "MODE", "gpu")
    monkeypatch.setattr(runtime, "device_name", lambda: "Simulated GPU")
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_do_bench_cudagraph)
    monkeypatch.setitem(methods.PEERS, "cudnn", "MATH")
    res = run_benchmark(quick=True, L=(64,), methods=("unified", "cudnn"), graphs=True, ceiling=False,
                        progress=False)
    by = {r["method"]: r for r in res["records"]}
    assert all(r["status"] == "ok" for r in by.values()), [(r["method"], r.get("reason")) for r in by.values()]
    assert by["unified"]["eager_us"] == pytest.approx(10.0) and by["unified"]["graph_us"] == pytest.approx(5.0)
    assert by["unified"]["graph_ratio_cudnn"] == pytest.approx(1.0)
    assert by["unified"]["l2_copies"] == seen["copies"] > 1 and seen["index"] == 3
    assert seen["graph_calls"] == 2 and by["unified"]["graph_pct_ceiling"] is None
    assert "graph: triton.testing.do_bench_cudagraph does not flush" in res["settings"]["l2_handling"]
    assert "5.0" in format_table(res)
    fig = plot_results(res)
    assert "CUDA graph" in fig.axes[0].get_title()


# ------------------------------------------------------------------------------------------------ GPU only

@gpu
@needs_cuda
def test_gpu_small_grid_with_graphs_and_peers(tmp_path):
    res = run_benchmark(B=(1,), L=(4096,), heads=((32, 8),), D=(128,), dtypes=("float16",),
                        methods=("unified", "split1", "cudnn", "fa2"), rep_ms=20, graph_rep_ms=10,
                        ceiling_gib=1.0, progress=False)
    by = {r["method"]: r for r in res["records"]}
    assert by["unified"]["status"] == "ok" and by["unified"]["graph_us"] > 0
    assert by["unified"]["l2_copies"] >= 2          # 16.8 MB of KV < 4x L2: rotated copies
    assert res["ceiling"]["tbs"] > 0.5
    if by["cudnn"]["status"] == "ok":
        assert by["unified"]["graph_ratio_cudnn"] > 0
    write_results(res, str(tmp_path), name="gpu")


@gpu
@needs_cuda
def test_gpu_sweep_one_shape():
    res = run_sweep(B=(1,), L=(8192,), heads=((32, 8),), D=(128,), dtypes=("float16",), candidates=(1, 8, 64),
                    graph_rep_ms=5, progress=False)
    (row,) = res["sweep"]
    assert res["settings"]["timing"] == "graph"
    assert row["best"]["us"] > 0 and row["chosen"]["fdlib_auto"]["ratio_to_best"] >= 1


def test_block_n_follows_the_element_size():
    """The splits a record reports are counted in the tiles decode_attention uses for that dtype."""
    for elem in (2, 4):
        assert methods.block_n(128, 8192, 8, elem) == tile_config(128, 8192, elem, rows=8).BLOCK_N


def test_host_overhead_harness_takes_turns_and_reports_failures():
    """The host-overhead loop times every variant in turns and records a variant that raises, with its reason,
    instead of stopping the others (the numbers themselves are GPU measurements, not tested here)."""
    from fdlib.bench.host import _loop_us, format_host_table, run_host_overhead
    order = []

    def ok():
        order.append("a")

    def bad():
        order.append("b")
        raise RuntimeError("no backend")

    timed = _loop_us({"a": ok, "b": bad}, n=4, warmup=1, repeats=3)
    assert timed["a"] > 0 and isinstance(timed["b"], RuntimeError)
    assert order[:2] == ["a", "b"] and order.count("a") == 1 + 3 * 4 and order.count("b") == 1
    res = run_host_overhead(progress=False)
    by = {r["variant"]: r for r in res["records"]}
    assert by["plan.run"]["status"] == "ok" and by["plan.run"]["us_per_call"] > 0
    assert "median of 5 loops" in format_host_table(res)


def test_figure_without_cudnn_compares_against_the_first_method(quick):
    """A run whose peers did not run (the interpreter has no cuDNN) still draws panel (a): every other method's
    time over the first method's, with one colour per method in both panels."""
    res = json.loads(json.dumps(quick))
    for r in res["records"]:
        for k in [k for k in r if k.endswith("_ratio_cudnn")]:
            r.pop(k)
    res["records"] = [r for r in res["records"] if r["method"] != "cudnn"]
    fig = plot_results(res)
    ax1, ax2 = fig.axes[:2]
    first = res["records"][0]["method"]
    assert f"relative to fdlib '{first}'" in ax1.get_title()
    drawn = {line.get_label(): line.get_color() for line in ax1.get_lines() if not line.get_label().startswith("_")}
    dots = {line.get_label(): line.get_color() for line in ax2.get_lines() if not line.get_label().startswith("_")}
    others = [m for m in dots if m != first and not m.startswith("measured")]
    assert others and all(drawn[m] == dots[m] for m in others)


def test_plot_labels_name_the_head_dim_where_it_varies():
    """The heads sweep has shapes that differ only in D: their tick labels must differ (D=128, the grid's, is
    left out)."""
    from fdlib.bench import report
    shapes = [dict(dtype="float16", B=1, H_q=16, H_kv=4, L=8192, D=d) for d in (64, 128, 256)]
    labels = [report._shape_label(r, short=True) for r in shapes]
    assert len(set(labels)) == 3 and labels[1] == "fp16 B1 16:4 L8192" and labels[0].endswith("D64")


def test_auto_records_the_kernel_the_timed_call_ran(monkeypatch):
    """The dense bench times decode_attention with the lengths on the device; the kernel its record names is the
    plan of that call (stream-K at B >= 2: fdlib.plan.device_schedule_suits), not the plan of a call without
    lengths (every row L_max, which the host knows: the unified kernel). The records named the latter while the
    former ran."""
    import fdlib.api
    ran = []
    real = fdlib.api.DecodePlan.run
    monkeypatch.setattr(fdlib.api.DecodePlan, "run", lambda self, *a, **k: ran.append(self.decision.kernel) or
                        real(self, *a, **k))
    res = run_benchmark(B=[2], L=[40], heads=[(4, 2)], D=[32], dtypes=["float32"], methods=["auto"], quick=True,
                        progress=False, ceiling=False)
    (rec,) = [r for r in res["records"] if r["method"] == "auto"]
    assert rec["status"] == "ok" and ran and set(ran) == {"streamk"}, (rec, ran)
    assert rec["kernel"] == "streamk", rec
