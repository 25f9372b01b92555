"""fdlib.bench.readbound: the row read sums exactly the keys of each (sequence, KV head), contiguous and over pages
(shuffled, shared, unused entries), at lengths off the tile, of one key and of none; the flat read sums what it
reads; the checks can fail."""
from __future__ import annotations

import pytest
import torch

import fdlib   # before triton (see tests/test_longest_first.py)
from fdlib import runtime
from fdlib.bench import ragged
from fdlib.bench.harness import rel_error
from fdlib.kernels.config import chunk_for
from fdlib.bench.readbound import expected_row_sums, flat_read_us, row_read, row_read_us


@pytest.mark.parametrize("page", [0, 1, 4, 16])
@pytest.mark.parametrize("D,block_n", [(32, 16), (80, 32)])
def test_row_read_sums_each_rows_keys(page, D, block_n):
    lens = [37, 1, 64, 0, 19]          # off the tile, one key, exactly tiles, an empty row
    shape = dict(dtype="float32", B=len(lens), H_q=6, H_kv=3, D=D)
    q, k, v, lens_t, bt = ragged._inputs(shape, lens, page, 3)
    if page:                           # a shared page and an unused table entry
        bt = torch.cat([bt, bt[:, :1]], 1)
        bt[1, 0] = bt[0, 0]
    out = torch.empty(len(lens) * 3, dtype=torch.float32, device=runtime.DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=runtime.DEVICE)
    row_read(k, v, lens_t, bt, out, flag, block_n, num_warps=1)
    ref = expected_row_sums(k, v, lens, bt)
    assert rel_error(out, ref) < 1e-5
    assert out.view(5, 3)[3].abs().max() == 0           # the empty row read nothing
    one_less = expected_row_sums(k, v, [36] + lens[1:], bt)
    assert rel_error(out, one_less) > 1e-3                   # one key fewer is another answer
    assert int(flag) == 0


@pytest.mark.parametrize("page", [0, 4])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_row_read_splits_sum_to_each_rows_keys(page, splits):
    """Split s of a row holds exactly keys [s·C, (s+1)·C) of it (C: whole tiles, sized for the longest row): the
    splits add up to the row, a split past a short row's end read nothing, and the first split is not the row."""
    lens = [37, 1, 64, 0, 19]
    shape = dict(dtype="float32", B=len(lens), H_q=4, H_kv=2, D=32)
    q, k, v, lens_t, bt = ragged._inputs(shape, lens, page, 5)
    out = torch.empty(len(lens) * 2 * splits, dtype=torch.float32, device=runtime.DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=runtime.DEVICE)
    row_read(k, v, lens_t, bt, out, flag, 16, 1, splits, max(lens))
    parts = out.view(len(lens), 2, splits)
    assert rel_error(parts.sum(2).flatten(), expected_row_sums(k, v, lens, bt)) < 1e-5
    chunk = chunk_for(max(lens), splits, 16)[0]
    first = expected_row_sums(k, v, [min(L, chunk) for L in lens], bt)
    assert rel_error(parts[..., 0].flatten(), first) < 1e-5
    assert parts[1, :, 1:].abs().max() == 0 and parts[3].abs().max() == 0      # past the row's end: nothing
    assert rel_error(parts[..., 0].flatten(), expected_row_sums(k, v, lens, bt)) > 1e-3
    with pytest.raises(ValueError, match="out: expected"):
        row_read(k, v, lens_t, bt, out[1:], flag, 16, 1, splits, max(lens))
    with pytest.raises(ValueError, match="splits: expected at least 1"):
        row_read(k, v, lens_t, bt, out, flag, 16, 1, 0)


def test_row_read_us_checks_what_it_read():
    shape = dict(dtype="float16", B=3, H_q=4, H_kv=2, D=32)
    lens = [40, 7, 1]
    copies = [ragged._inputs(shape, lens, 4, 0)]
    us, err = row_read_us(copies, graphs=False, block_n=16, num_warps=1, warmup_ms=1, rep_eager_ms=1)
    assert us > 0 and err < 1e-4


def test_flat_read_times_a_launch_that_read_everything():
    assert flat_read_us(4096, None, graphs=False, warmup_ms=1, rep_eager_ms=1) > 0
    assert flat_read_us(4096, {"BLOCK": 1024, "ITERS": 4, "num_warps": 1}, graphs=False) > 0
    with pytest.raises(ValueError, match="nbytes"):
        flat_read_us(1, None, graphs=False)
