"""python -m fdlib.bench --ragged: the length draws, and a quick run (interpreter) whose every method is right."""
from __future__ import annotations

import pytest

from fdlib.bench.ragged import DISTS, RAGGED_METHODS, draw_lengths, run_ragged


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


@pytest.mark.parametrize("page_size", [None, 4])
def test_quick_ragged_run_is_right_for_every_method(page_size):
    res = run_ragged(quick=True, page_size=page_size, ceiling=False, progress=False, command="test")
    assert res["kind"] == "ragged" and res["settings"]["page_size"] == (page_size or 0)
    assert len(res["records"]) == len(DISTS) * len(RAGGED_METHODS)
    for r in res["records"]:
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-2 and r["eager_us"] > 0
