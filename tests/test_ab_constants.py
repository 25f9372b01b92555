"""tools/ab_constants.py, the A/B of a chooser constant on the batches whose auto decision it changes: it finds
exactly those batches, times both settings on the same inputs (here in the interpreter, on a tiny batch), and
leaves every constant and cache as it found them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import ab_constants  # noqa: E402
import decision_cases  # noqa: E402

import fdlib.plan  # noqa: E402,F401

plan_module = sys.modules["fdlib.plan"]   # the module (fdlib.plan is also the function)

TINY = [("ragged float16 B=3 4:2 tiny", 3, 4, 2, 32, "float16", [5, 70, 33], 0, 1, None),
        ("serving tiny int8", 3, 4, 2, 32, "bfloat16", [5, 70, 1], 16, 1, (torch.int8, "token", "token")),
        ("qlen tiny", 2, 4, 2, 32, "float16", [9, 9], 0, 2, None)]


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(decision_cases, "cases", lambda: iter(TINY))


def test_spread_keeps_the_ends_and_the_order():
    assert ab_constants.spread(list(range(46)), 8) == [0, 6, 13, 19, 26, 32, 39, 45]
    assert ab_constants.spread([3, 1], 8) == [3, 1]
    assert ab_constants.spread(list(range(5)), 1) == [0]


@pytest.mark.parametrize("text", ["NOEQUALS", "1X=3", "TWO_STAGE_SPLITS=[1,", "TWO_STAGE_SPLITS=abc"])
def test_a_bad_set_names_what_it_expected(text):
    with pytest.raises(SystemExit, match="--set"):
        ab_constants.parse_set(text)


def test_an_unknown_constant_is_refused():
    with pytest.raises(SystemExit, match="no fdlib module has NO_SUCH_RULE"):
        ab_constants.constant("NO_SUCH_RULE", 1)


def test_changed_finds_the_plannings_a_constant_decides(tiny):
    # in the interpreter, auto without host lengths takes stream-K (DEVICE_SCHEDULE), as an 8-bit cache does with
    # them too; off, both plan for the longest row; several query tokens (qlen) are not among the kinds timed
    found = ab_constants.changed("DEVICE_SCHEDULE", 0, ab_constants.KINDS)
    assert [(c[0], given) for c, given, _, _ in found] == [(TINY[0][0], False), (TINY[1][0], True),
                                                          (TINY[1][0], False)]
    assert all(a.kernel == "streamk" and b.kernel != "streamk" for _, _, a, b in found)
    assert plan_module.DEVICE_SCHEDULE == 1   # restored
    assert ab_constants.changed("DEVICE_SCHEDULE", 1, ab_constants.KINDS) == []
    only = ab_constants.changed("DEVICE_SCHEDULE", 0, ab_constants.KINDS, match="int8")   # --match: by label
    assert [(c[0], given) for c, given, _, _ in only] == [(TINY[1][0], True), (TINY[1][0], False)]


def test_the_ab_times_both_settings_and_restores_them(tiny, tmp_path):
    out = tmp_path / "ab.json"
    ab_constants.main([str(out), "--set", "DEVICE_SCHEDULE=0", "--kinds", "ragged"])
    res = json.loads(out.read_text())
    assert res["complete"] and res["kind"] == "ab-constants" and "provenance" in res
    (rec,) = res["records"]
    assert rec["status"] == "ok" and rec["planned"] == "device" and rec["kernels"] == ["streamk", "unified"]
    assert rec["order"] == "default first"
    assert rec["ratio"] == pytest.approx(rec["us_changed"] / rec["us_default"])
    assert res["summary"]["DEVICE_SCHEDULE=0"]["timed"] == 1
    assert plan_module.DEVICE_SCHEDULE == 1


def test_list_shows_what_a_gpu_would_time():
    # --list plans as tools/decision_table.py sees an H100 (it sets the process up so: a subprocess): the two-stage
    # rule at 32 splits decides one batch of the heads sweep, planned with host lengths and without
    import subprocess
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_constants.py"), "-", "--list", "--identity", "H100",
                        "--set", "TWO_STAGE_SPLITS=1000000"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "TWO_STAGE_SPLITS=1000000: 2 plannings of auto change (H100)"
    assert all("heads D=64 B=1 16:4 L=262144" in x and "split s=32" in x and "-> unified s=32" in x
               for x in lines[1:3])


def test_a_timed_plan_that_is_not_the_decided_one_is_flagged(tiny, tmp_path, monkeypatch):
    from fdlib.bench import ragged
    monkeypatch.setattr(ragged, "_measure", lambda name, *a, **k: dict(status="ok", kernel="unified", splits=1,
                                                                        eager_us=1.0, graph_us=1.0))
    out = tmp_path / "ab.json"
    ab_constants.main([str(out), "--set", "DEVICE_SCHEDULE=0", "--kinds", "ragged"])
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["status"] == "mismatch" and "decided" in rec["reason"] and "ratio" not in rec


def test_max_cases_must_be_a_count(tiny):
    with pytest.raises(SystemExit, match="--max-cases: expected a count >= 1, got 0"):
        ab_constants.main(["-", "--set", "DEVICE_SCHEDULE=0", "--max-cases", "0"])
