"""The balanced schedule for ragged batches (fdlib.schedule) and the kernel that builds it on the device
(method="balanced"), against float64."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fdlib
from fdlib import schedule
from fdlib.kernels.balanced import MAX_BATCH
from helpers import DEVICE, assert_attention_close, counters_zero, make_problem


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=40), budget=st.integers(1, 300),
       block_n=st.sampled_from([16, 64, 128]))
def test_schedule_covers_every_key_once_in_near_equal_items(lengths, budget, block_n):
    s = schedule.balanced(lengths, budget, block_n)
    its = schedule.items(lengths, budget, block_n)
    B = len(lengths)
    assert len(its) == s.items <= budget + B                                  # the workspace bound
    covered = {b: [] for b in range(B)}
    for b, start, end in its:
        covered[b].append((start, end))
        assert end - start <= s.chunk_tiles * block_n                         # no item above c tiles
    for b, L in enumerate(lengths):
        spans = covered[b]
        assert spans and spans[0][0] == 0 and spans[-1][1] == L                 # every row, from 0 to L
        assert all(a[1] == c[0] for a, c in zip(spans, spans[1:]))              # contiguous, no overlap
        assert len(spans) == int(s.splits[b]) and int(s.first[b]) == sum(int(x) for x in s.splits[:b])
    tiles = sum(max(1, -(-L // block_n)) for L in lengths)
    assert s.chunk_tiles == max(1, -(-tiles // budget))


@pytest.mark.parametrize("lens", [[150, 1, 0, 37, 150, 3], [0, 0, 0, 0, 0, 0], [150] * 6, [1, 2, 3, 4, 5, 150]],
                         ids=["ragged", "all-empty", "dense", "one-long"])
def test_balanced_kernel_matches_float64(lens):
    q, k, v, lens_t = make_problem(6, 150, 6, 2, 80, torch.float32, seed=sum(lens), lens=lens)
    out, lse = fdlib.decode_attention(q, k, v, lens_t, method="balanced", return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what=f"balanced {lens}")
    assert counters_zero()


def test_balanced_plan_reuse_smaller_batch_and_paged_cache():
    q, k, v, lens = make_problem(4, 96, 8, 2, 32, torch.bfloat16, seed=9, lens=[96, 0, 17, 64])
    p = fdlib.plan(4, 8, 2, 32, 96, dtype=torch.bfloat16, device=DEVICE, method="balanced")
    assert p.kernel == "balanced" and p.decision.budget >= 4
    for new in ([96, 0, 17, 64], [5, 96, 96, 1], [0, 0, 1, 0]):
        lens_i = torch.tensor(new, dtype=torch.int32, device=DEVICE)
        assert_attention_close(p.run(q, k, v, lens_i), None, q, k, v, lens_i, what=f"lengths {new}")
    assert_attention_close(p.run(q[:3], k[:3], v[:3], lens[:3]), None, q[:3], k[:3], v[:3], lens[:3], what="B'=3")
    # the same cache as pages of 16 behind a block table (pages in reverse order)
    pages = k.reshape(4 * 6, 16, 2, 32).flip(0).contiguous()
    vpages = v.reshape(4 * 6, 16, 2, 32).flip(0).contiguous()
    bt = (4 * 6 - 1 - torch.arange(4 * 6, device=DEVICE)).reshape(4, 6).to(torch.int32)
    out = fdlib.decode_attention(q, pages, vpages, lens, block_table=bt, method="balanced")
    assert_attention_close(out, None, q, k, v, lens, what="balanced, paged")
    assert int(p.workspace.counters.count_nonzero()) == 0


def test_balanced_refuses_batches_above_its_register_budget():
    with pytest.raises(ValueError, match=f"B <= {MAX_BATCH}"):
        fdlib.plan(MAX_BATCH + 1, 2, 1, 16, 64, dtype=torch.float32, device=DEVICE, method="balanced")
