"""The cost model's calibration without a GPU: the fit on synthetic timings, and the import graph (the formulas
in fdlib.costmodel never import the API or the planner; measuring lives in fdlib.calibration)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fdlib import calibration, costmodel
from fdlib.gpus import GPU, PRESETS
from fdlib.kernels.config import tile_config_for

ROOT = Path(__file__).resolve().parent.parent
H200 = PRESETS["H200"]
RHO_GRID = np.geomspace(0.01, 0.2, 41)        # the fit's grids (fdlib.calibration.fit)
BW_GRID = np.linspace(0.7, 1.1, 33)


def _rows(gpu, cal, D=128, dtype_bytes=2):
    """(B, H_kv, L, splits, µs) at the calibration points, timed by the model itself."""
    rows = []
    for B, H_kv, L, s in calibration.CALIBRATION_POINTS:
        cfg = tile_config_for(D, L, compiled_mode=True, elem_bytes=dtype_bytes, rows=B * H_kv)
        r = costmodel.kernel_programs_per_sm(gpu, D, dtype_bytes, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages)
        rows.append((B, H_kv, L, s, costmodel.predict([L] * B, H_kv, D, dtype_bytes, s, gpu, cal, cfg.BLOCK_N,
                                                      r).time_us))
    return rows


FIELDS = ("bw_tbs", "rho_tbs", "t_launch_us", "t_wave_us", "t_merge_us", "t_split_us")


@pytest.mark.parametrize("cal", [
    costmodel.H200_DEFAULT,
    costmodel.Calibration(bw_tbs=float(BW_GRID[16] * H200.bandwidth_tbs), rho_tbs=float(RHO_GRID[25]),
                          t_launch_us=3.0, t_wave_us=1.5, t_merge_us=0.5, t_split_us=0.1),
], ids=["H200 defaults", "other constants"])
def test_fit_recovers_the_constants_of_the_model(cal):
    """Timings made by predict() with known BW, ρ (on the fit's grid) and t_* give back those constants."""
    got = calibration.fit(_rows(H200, cal), H200)
    for name in FIELDS:
        assert getattr(got, name) == pytest.approx(getattr(cal, name), rel=0.02), name
    assert got.source == "calibrated on H200 (rms rel. error 0.0%)"


def test_fit_then_cache_round_trip(tmp_path, monkeypatch):
    """calibrate()'s path after the timings: fit, save to the disk cache, and every later ask (the cost model's
    included) gets that calibration back (no GPU: the rows are the model's own)."""
    monkeypatch.setenv("FDLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_CAL", {})
    live = GPU("Test GPU (live)", sms=H200.sms, bandwidth_tbs=H200.bandwidth_tbs, l2_mb=H200.l2_mb)
    assert calibration.calibration_cached(live) is None
    cal = calibration.fit(_rows(live, costmodel.H200_DEFAULT), live)
    calibration._save(live, cal)
    assert (tmp_path / "calibration-test-gpu--live.json").exists()
    assert calibration.calibration_cached(live) == cal
    monkeypatch.setenv("FDLIB_NO_CALIBRATE", "1")
    assert calibration.calibration_for(live) == cal
    ex = costmodel.explain(1, 32, 8, 131072, gpu=live)           # cal=None: the cached calibration
    assert ex.calibration == cal


def test_presets_use_defaults():
    assert calibration.calibration_for(H200) is costmodel.H200_DEFAULT
    a100 = PRESETS["A100 SXM4 80GB"]
    assert calibration.calibration_for(a100) == costmodel.default_calibration(a100)
    assert costmodel.explain(1, 32, 8, 131072, gpu="H200").calibration is costmodel.H200_DEFAULT


def test_costmodel_does_not_import_the_api():
    """fdlib.costmodel (and an explain() on a preset, which reaches fdlib.calibration) imports neither
    fdlib.api nor fdlib.plan. The package's own __init__ imports the API for users, so the check loads
    fdlib as a bare package in a fresh interpreter."""
    code = f"""
import sys, types
pkg = types.ModuleType("fdlib"); pkg.__path__ = [{str(ROOT / 'fdlib')!r}]; sys.modules["fdlib"] = pkg
import fdlib.costmodel as cm
assert "fdlib.api" not in sys.modules and "fdlib.plan" not in sys.modules, sorted(sys.modules)
ex = cm.explain(1, 32, 8, 131072, gpu="H200")
assert "fdlib.calibration" in sys.modules and ex.chosen > 1
leaked = [m for m in ("fdlib.api", "fdlib.plan", "fdlib.splits") if m in sys.modules]
assert not leaked, leaked
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def _fdlib_imports(path: Path) -> set[str]:
    """fdlib modules a source file imports anywhere (module top or inside a function), as written."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fdlib")):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("fdlib"))
    return names


def test_only_calibration_measures():
    """No import of the API anywhere in the formulas (a lazy one closed the cycle api -> splits -> costmodel
    -> api before); the calibration times the kernels directly, never through the planner, whose auto reads it
    (no circle calibration -> plan -> splits -> calibration)."""
    assert _fdlib_imports(ROOT / "fdlib" / "costmodel.py") <= {".gpus", ".kernels.config", ".occupancy", ".calibration"}
    assert _fdlib_imports(ROOT / "fdlib" / "calibration.py") <= {".costmodel", ".gpus", ".kernels.config",
                                                                 ".kernels.unified"}


@pytest.mark.parametrize("s", [1, 3])
def test_a_calibration_point_launches_what_a_forced_unified_plan_launches(s):
    """calibrate() times the unified kernel directly (no planner): the same bits as
    fdlib.plan(method="unified", num_splits=s).run on the same inputs, launch after launch."""
    import torch
    import fdlib
    from fdlib import runtime
    from fdlib.calibration import unified_point
    B, H_q, H_kv, D, L = 2, 4, 2, 32, 70
    fn, (q, kv, out, lse) = unified_point(B, H_q, H_kv, D, L, s, copies=2, device=runtime.DEVICE,
                                          compiled=not runtime.INTERPRET)
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=runtime.DEVICE, method="unified", num_splits=s)
    for k, v in kv:
        fn()
        want, want_lse = p.run(q, k, v, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
