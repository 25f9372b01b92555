"""fdlib.bench.mathfree: a plan's twin without the attention reads exactly the plan's keys (every method, contiguous
and paged, one split and several), the plan itself is left as it was, and the flat read sums what it reads."""
from __future__ import annotations

import pytest

import fdlib   # before triton (see tests/test_longest_first.py)
from fdlib.bench import ragged
from fdlib.bench.harness import reference_rows, rel_error
from fdlib.bench.mathfree import expected_math_free, flat_read_us, math_free

METHODS = ("auto", "unified", "split", "streamk", "persistent", "balanced")


def _batch(page, lens, H_q=6, H_kv=2, D=32, seed=1):
    shape = dict(dtype="float32", B=len(lens), H_q=H_q, H_kv=H_kv, D=D, mean=40, dist="uniform")
    q, k, v, lens_t, bt = ragged._inputs(shape, lens, page, seed)
    return q, k, v, lens_t, bt


@pytest.mark.parametrize("page", [0, 1, 4, 16])
@pytest.mark.parametrize("method", METHODS)
def test_math_free_twin_reads_the_plans_keys(method, page):
    lens = [37, 1, 64, 0, 19]            # not a multiple of the tile, one key, exactly a tile, an empty row
    q, k, v, lens_t, bt = _batch(page, lens, H_q=6, H_kv=2)       # group 3
    p = fdlib.plan(len(lens), 6, 2, 32, max(lens), dtype=q.dtype, device=q.device, lengths=lens, method=method,
                   page_size=page or None)
    twin = math_free(p)
    got = twin.run(q, k, v, lens_t, block_table=bt)
    n = p.decision.tile.BLOCK_N
    assert rel_error(got, expected_math_free(k, v, lens, n, 6, bt)) < 1e-5, (p.decision, got)
    # the check can fail: the same sums over tiles of another size are another answer
    assert rel_error(got, expected_math_free(k, v, lens, 2 * n, 6, bt)) > 1e-2
    # the plan is untouched: still attention
    out = p.run(q, k, v, lens_t, block_table=bt)
    assert rel_error(out, reference_rows(q, k, v, lens, bt)) < 1e-4


def test_flat_read_times_a_launch_that_read_everything():
    assert flat_read_us(4096, None, graphs=False, warmup_ms=1, rep_eager_ms=1) > 0
    assert flat_read_us(4096, {"BLOCK": 1024, "ITERS": 4, "num_warps": 1}, graphs=False) > 0
    with pytest.raises(ValueError, match="nbytes"):
        flat_read_us(1, None, graphs=False)
