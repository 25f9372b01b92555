"""python -m fdlib.bench --ragged: the length draws, and a quick run (interpreter) whose every method is right."""
from __future__ import annotations

import pytest

from fdlib.bench.ragged import DISTS, RAGGED_METHODS, draw_lengths, run_ragged


def ab_ragged():
    """tools/ab_ragged.py, loaded as a module (tools/ is no package)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("ab_ragged", Path(__file__).resolve().parents[1] / "tools"
                                                  / "ab_ragged.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


@pytest.mark.parametrize("dist", DISTS)
def test_length_draws(dist):
    lens = draw_lengths(dist, 4000, 1024, seed=1)
    assert len(lens) == 4000 and min(lens) >= 1
    mean = sum(lens) / len(lens)
    if dist == "constant":
        assert set(lens) == {1024}
    elif dist == "uniform":
        assert max(lens) <= 2048 and abs(mean - 1024) < 40
    else:   # most short, a few long, capped at 8x the mean
        assert max(lens) <= 8 * 1024 and sorted(lens)[2000] < 0.7 * 1024 and 0.7 * 1024 < mean < 1.3 * 1024
    assert draw_lengths(dist, 50, 300, seed=7) == draw_lengths(dist, 50, 300, seed=7)


@pytest.mark.parametrize("page_size,order", [(None, "shuffled"), (4, "shuffled"), (4, "sequential")])
def test_quick_ragged_run_is_right_for_every_method(page_size, order):
    res = run_ragged(quick=True, page_size=page_size, page_order=order, ceiling=False, progress=False,
                     command="test")
    assert res["kind"] == "ragged" and res["settings"]["page_size"] == (page_size or 0)
    assert res["settings"]["page_order"] == (order if page_size else None)
    assert len(res["records"]) == len(DISTS) * len(RAGGED_METHODS)
    for r in res["records"]:
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-2 and r["eager_us"] > 0


def test_page_orders():
    """Shuffled pages lie anywhere in the pool; sequential ones follow each other, sequence after sequence."""
    from fdlib.bench.ragged import _inputs
    shape = dict(dtype="float32", B=3, H_q=2, H_kv=1, D=16)
    lens = [5, 1, 9]
    bt_seq = _inputs(shape, lens, 4, 0, "sequential")[4].cpu()
    assert bt_seq[0, :2].tolist() == [0, 1] and bt_seq[1, 0] == 2 and bt_seq[2, :3].tolist() == [3, 4, 5]
    bt_shuf = _inputs(shape, lens, 4, 0, "shuffled")[4].cpu()
    used = sorted(bt_shuf[0, :2].tolist() + bt_shuf[1, :1].tolist() + bt_shuf[2, :3].tolist())
    assert used == list(range(6)) and bt_shuf[:, 0].tolist() != [0, 2, 3]
    with pytest.raises(ValueError, match="page_order"):
        run_ragged(quick=True, page_size=4, page_order="random", ceiling=False, progress=False)


def test_ab_ragged_overrides_the_tiles_of_the_method_it_names(tmp_path, monkeypatch):
    """tools/ab_ragged.py: ``balanced@NxWxS`` plans the balanced kernel with those tiles (the plan's tile_config
    replaced for that method only, restored after), ``streamk@NxWxS`` the row walkers' persistent_config; every
    record matches float64."""
    import json
    import sys

    from fdlib.kernels.config import INTERPRETER_CONFIG, TileConfig, persistent_config, tile_config
    ab = ab_ragged()
    assert ab.tiles_of("balanced@32x1x1") == ("balanced", TileConfig(BLOCK_N=32, num_warps=1, num_stages=1))
    assert ab.tiles_of("streamk+ROW_WINDOW=4") == ("streamk", None)
    assert ab.tiles_of("streamk@64x4x3+PERSISTENT_PER_SM=3") == ("streamk", TileConfig(64, 4, 3))
    assert ab.tiles_of("unified#4@32x1x1") == ("unified", TileConfig(32, 1, 1)) and ab.splits_of("unified#4") == 4
    assert ab.splits_of("unified@32x1x1") is None
    plan_module = sys.modules["fdlib.plan"]
    seen = []
    decide = plan_module.decide
    monkeypatch.setattr(plan_module, "decide", lambda *a, **k: seen.append(decide(*a, **k)) or seen[-1])
    out = tmp_path / "ab.json"
    from fdlib.kernels import config, streamk
    per_sm, regs_max = config.PERSISTENT_PER_SM, plan_module.TABLE_REGS_MAX
    ab.main([str(out), "--cases", "3:4:2:uniform:40:16", "--methods",
             "balanced,balanced@32x1x1,streamk@32x1x1+PERSISTENT_PER_SM=3+MAX_REGISTERS=128,unified#2+TABLE_REGS_MAX=1,"
             "unified#2,unified#1+longest_first"])
    assert config.PERSISTENT_PER_SM == per_sm and streamk.MAX_REGISTERS is None
    assert plan_module.TABLE_REGS_MAX == regs_max
    recs = json.loads(out.read_text())["records"]
    assert [r["method"] for r in recs] == ["balanced", "balanced@32x1x1",
                                          "streamk@32x1x1+PERSISTENT_PER_SM=3+MAX_REGISTERS=128",
                                          "unified#2+TABLE_REGS_MAX=1", "unified#2", "unified#1+longest_first"]
    assert recs[-2]["kernel"] == "unified" and recs[-2]["splits"] == 2 and not recs[-2]["longest_first"]
    # a split (a few pages of 16) holds its table in registers; under a cap of one entry, one at a time
    regs = [d.table_regs for d in seen if d.kernel == "unified" and d.splits == 2]
    assert regs[0] == 1 < regs[-1], regs
    assert (recs[-1]["kernel"], recs[-1]["splits"], recs[-1]["longest_first"]) == ("unified", 1, True)
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in recs), recs
    tiles = sorted({(d.kernel, d.tile.BLOCK_N) for d in seen})
    assert tiles == [("balanced", INTERPRETER_CONFIG.BLOCK_N), ("balanced", 32), ("streamk", 32),
                     ("unified", INTERPRETER_CONFIG.BLOCK_N)], tiles
    assert plan_module.tile_config is tile_config and plan_module.persistent_config is persistent_config


def test_case_names_and_sorted_lengths():
    """The tools' batch names B:H_q:H_kv:dist:mean:page, and dist/desc: the same draw, longest first."""
    from fdlib.bench.ragged import case_lengths, draw_lengths, parse_case
    shape, page = parse_case("128:32:8:uniform/desc:1024:16")
    assert page == 16 and (shape["B"], shape["H_q"], shape["H_kv"], shape["D"]) == (128, 32, 8, 128)
    drawn = draw_lengths("uniform", 128, 1024, 3)
    assert case_lengths(shape["dist"], 128, 1024, 3) == sorted(drawn, reverse=True) != drawn
    assert case_lengths("uniform", 128, 1024, 3) == drawn
    with pytest.raises(ValueError, match="B:H_q:H_kv:dist:mean:page"):
        parse_case("128:32:8:uniform")
    with pytest.raises(ValueError, match="/desc"):
        case_lengths("uniform/asc", 4, 10, 0)


def test_ab_ragged_times_the_reads_without_attention(tmp_path):
    """tools/ab_ragged.py: ``row_read``/``row_read@W`` record the batch's rows walked with no attention, checked
    against float64 (fdlib.bench.readbound), and ``flat_read`` the batch's bytes read in one launch."""
    import json

    ab = ab_ragged()
    out = tmp_path / "ab.json"
    ab.main([str(out), "--cases", "3:4:2:uniform:40:16,3:4:2:constant:40:0", "--methods",
             "auto,row_read,row_read@1,row_read#3@2,flat_read"])
    recs = json.loads(out.read_text())["records"]
    assert [r["method"] for r in recs] == ["auto", "row_read", "row_read@1", "row_read#3@2", "flat_read"] * 2
    for r in recs:
        assert r["status"] == "ok" and r["eager_us"] > 0, r
    assert [r["kernel"] for r in recs] == ["unified", "row_read", "row_read", "row_read", "read_sum"] * 2
    assert [r.get("num_warps") for r in recs[1:4]] == [4, 1, 2] and all(r["rel_err"] < 1e-4 for r in recs[1:4])
    assert [r["splits"] for r in recs[1:4]] == [1, 1, 3]
    assert len({r["kv_mb"] for r in recs[:5]}) == 1


def test_tile_overrides_win_over_the_one_wave_rule(monkeypatch):
    """tools/ab_ragged.py's grid_tiles (which tools/record_timeline.py uses too): inside it a plan takes the tiles
    asked for even where auto's one-wave rule would replace them; outside, and after, the rule is back. A row
    walker's (stream-K's) tiles are its own."""
    import sys

    import torch
    from fdlib.kernels.config import ONE_WAVE_TILE, TileConfig
    ab = ab_ragged()
    plan_module = sys.modules["fdlib.plan"]
    monkeypatch.setattr(plan_module, "one_wave_suits", lambda *a: True)   # as on an H200 for this batch
    lens = [40] * 16
    decide = lambda: plan_module.decide(16, 8, 2, 128, 64, torch.float16, lengths=lens, paged=16)  # noqa: E731
    assert decide().tile == ONE_WAVE_TILE
    with ab.grid_tiles(TileConfig(64, 4, 3)):
        assert decide().tile == TileConfig(64, 4, 3)
    with ab.grid_tiles(None):
        assert decide().tile == ONE_WAVE_TILE
    assert decide().tile == ONE_WAVE_TILE
    # the row walkers take theirs from persistent_config: streamk@32x4x3 gets 32-key tiles, and the grid
    # kernels' tiles and one-wave rule are left alone meanwhile
    walk = lambda: plan_module.decide(16, 8, 2, 128, 64, torch.float16, lengths=lens, paged=16,  # noqa: E731
                                      method="streamk")
    assert walk().tile != TileConfig(32, 4, 3)
    with ab.grid_tiles(TileConfig(32, 4, 3), "streamk"):
        assert walk().tile == TileConfig(32, 4, 3)
        assert decide().tile == ONE_WAVE_TILE
    assert walk().tile != TileConfig(32, 4, 3)


def test_ab_ragged_page_order(tmp_path, monkeypatch):
    """tools/ab_ragged.py --page-order: the paged batches get the table the ragged bench builds for that order
    (each row's pages in order for ``sequential``), the file says which, and the records still match float64."""
    import json

    from fdlib.bench import ragged
    ab = ab_ragged()
    orders = []
    inputs = ragged._inputs
    monkeypatch.setattr(ragged, "_inputs", lambda *a, **k: orders.append(a[4] if len(a) > 4 else k.get("page_order"))
                        or inputs(*a, **k))
    out = tmp_path / "ab.json"
    ab.main([str(out), "--cases", "3:4:2:uniform:40:16", "--methods", "auto", "--page-order", "sequential"])
    res = json.loads(out.read_text())
    assert orders == ["sequential"] and res["page_order"] == "sequential"
    assert res["records"][0]["status"] == "ok" and res["records"][0]["rel_err"] < 1e-2
    with pytest.raises(SystemExit):
        ab.main([str(out), "--cases", "3:4:2:uniform:40:16", "--page-order", "random"])


def test_ab_ragged_stale_order(tmp_path):
    """tools/ab_ragged.py ``+stale_order``: plans made inside keep their longest-first order reversed (so every
    program sorts, as after the lengths change order under a plan), fdlib.plan is restored after, and the records
    still match float64."""
    import json

    import torch

    import fdlib
    from fdlib.plan import order_hint
    ab = ab_ragged()
    make = fdlib.plan
    lens = [40, 3, 77]
    with ab.stale_order(True):
        p = fdlib.plan(3, 4, 2, 16, 80, dtype=torch.float32, lengths=lens, method="unified", page_size=16,
                       longest_first=True)
    assert fdlib.plan is make
    assert p.workspace.order[:3].tolist() == order_hint(3, 80, lens)[::-1] == [1, 0, 2]
    out = tmp_path / "ab.json"
    ab.main([str(out), "--cases", "3:4:2:uniform:40:16", "--methods",
             "unified#1+longest_first,unified#1+longest_first+stale_order"])
    recs = json.loads(out.read_text())["records"]
    assert [r["longest_first"] for r in recs] == [True, True]
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in recs), recs


def test_ab_ragged_over_an_8bit_cache(tmp_path):
    """tools/ab_ragged.py --kv-dtype/--kv-scale: every batch over an 8-bit cache, as the --ragged bench's (its
    records say the format and match float64 on the cache it stands for), stream-K planned without the lengths
    among the methods (auto from host lengths takes stream-K too on an 8-bit cache); --kv-scale alone is
    refused."""
    import json
    ab = ab_ragged()
    out = tmp_path / "ab.json"
    ab.main([str(out), "--cases", "3:4:2:uniform:40:16", "--methods", "auto,streamk+device", "--kv-dtype", "int8",
             "--kv-scale", "token"])
    recs = json.loads(out.read_text())["records"]
    assert [(r["kv_dtype"], r["kv_scale"], r["kernel"]) for r in recs] == [("int8", "token", "streamk"),
                                                                           ("int8", "token", "streamk")]
    assert all(r["status"] == "ok" and r["rel_err"] < 2e-2 for r in recs), recs
    with pytest.raises(SystemExit):
        ab.main([str(out), "--cases", "3:4:2:uniform:40:16", "--kv-scale", "head"])


def test_default_and_captured_rows_run_auto_without_host_lengths(monkeypatch):
    """The ragged bench's 'default' (decode_attention with the lengths in a tensor) and 'captured' (the call made
    while every length reads L_max, then run with the batch's) rows: stream-K at B >= 2, right against float64,
    and summarised against auto from host lengths. A captured row whose lengths are never copied in (the host
    action skipped) is caught as wrong, not timed."""
    from fdlib.bench import ragged
    from fdlib.bench.ragged import format_ragged_table
    res = run_ragged(quick=True, methods=("auto", "default", "captured"), dists=("uniform",), progress=False,
                     ceiling=False)
    recs = {r["method"]: r for r in res["records"]}
    assert set(recs) == {"auto", "default", "captured"}
    for name in ("default", "captured"):
        assert recs[name]["status"] == "ok" and recs[name]["kernel"] == "streamk" and recs[name]["rel_err"] < 1e-2
    text = format_ragged_table(res)
    assert "**default** (auto without host lengths) / auto planned from host lengths:" in text
    assert "**captured**" in text and "1 batches: worst" in text
    real = ragged.captured_call
    monkeypatch.setattr(ragged, "captured_call", lambda run, lens, L_max: (real(run, lens, L_max)[0], lambda: None))
    res = run_ragged(quick=True, methods=("captured",), dists=("uniform",), progress=False, ceiling=False)
    (rec,) = res["records"]
    assert rec["status"] == "failed" and "relative error" in rec["reason"], rec
