"""Ragged batches over pages launched longest first: the in-kernel order (tile.longest_first), the plan's choice of
it (auto's rule, or longest_first=True), the greedy model behind auto's rule, and the results against float64 when the lengths change under a plan."""
from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fdlib   # before triton: the interpreter runs triton's own library functions (tl.sort) only then
import triton
import triton.language as tl
from fdlib import runtime, splits
from fdlib.kernels.tile import longest_first, order_holds
from fdlib.kernels.unified import LONGEST_FIRST_MAX_BATCH
from fdlib.plan import decide, longest_first_order, order_hint
from helpers import DEVICE, assert_attention_close, counters_zero
from test_paged import paged_problem


@triton.jit
def _order_kernel(LENS, HINT, OUT, HOLDS, L_MAX, BLOCK_B: tl.constexpr):
    i = tl.program_id(0)
    tl.store(OUT + i, longest_first(LENS, HINT, i, tl.num_programs(0), L_MAX, BLOCK_B))
    tl.store(HOLDS + i, order_holds(LENS, HINT, tl.num_programs(0), L_MAX, BLOCK_B))


@pytest.mark.parametrize("kind", ["right", "stale", "b order", "permutation", "garbage"])
@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 40), L_max=st.integers(1, 300), data=st.data())
def test_longest_first_is_the_stable_descending_order_of_the_clamped_lengths(kind, B, L_max, data):
    # ties (drawn from few values), lengths outside 0..L_max (clamped, as the kernels read them), int32 and int64;
    # the hint checked first: the right order, the plan's order for lengths that have changed since, b order, a
    # random permutation, or garbage (entries outside 0..B-1, repeats): the answer is the order in every case
    lens = data.draw(st.lists(st.sampled_from([-5, 0, 1, 7, L_max, L_max + 9, data.draw(st.integers(0, L_max))]),
                              min_size=B, max_size=B))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    right = order_hint(B, L_max, lens)
    assert right == sorted(range(B), key=lambda b: (-min(max(lens[b], 0), L_max), b))
    stale = order_hint(B, L_max, data.draw(st.lists(st.integers(-3, L_max + 3), min_size=B, max_size=B)))
    perm = data.draw(st.permutations(range(B)))
    garbage = data.draw(st.lists(st.integers(-2 * B, 2 * B), min_size=B, max_size=B))
    hint = {"right": right, "stale": stale, "b order": list(range(B)), "permutation": perm, "garbage": garbage}[kind]
    t = torch.tensor(lens, dtype=dtype, device=DEVICE)
    h = torch.tensor(hint + [7] * (longest_first_order(B) - B), dtype=torch.int32, device=DEVICE)
    out = torch.full((B,), -1, dtype=torch.int32, device=DEVICE)
    holds = torch.full((B,), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(B,)](t, h, out, holds, L_max, BLOCK_B=longest_first_order(B))
    assert out.tolist() == right, (lens, hint)
    # the check passes exactly where the hint (clamped to 0..B-1) is the order: then no program sorts
    assert holds.tolist() == [int([min(max(x, 0), B - 1) for x in hint] == right)] * B, (lens, hint)


def test_a_longest_first_plan_keeps_its_order_before_its_ticket_counters():
    """The plan's hint: the longest-first order of the lengths it was made for, or b order without them, in the
    same buffer as the ticket counters, right before them, where the kernel reads it (COUNTERS − ORDER_B, whatever
    the batch launched)."""
    lens = [40, 3, 77, 0, 12, 77]
    p = fdlib.plan(6, 8, 2, 32, 96, dtype=torch.float32, device=DEVICE, lengths=lens, method="unified",
                   page_size=16, longest_first=True)
    ws = p.workspace
    assert ws.counters.numel() == 6 * 2 and ws.order.numel() == 16
    assert ws.order.data_ptr() + 4 * ws.order.numel() == ws.counters.data_ptr()
    assert ws.order[:6].tolist() == [2, 5, 0, 4, 1, 3] == order_hint(6, 96, lens)
    p = fdlib.plan(6, 8, 2, 32, 96, dtype=torch.float32, device=DEVICE, method="unified", page_size=16,
                   longest_first=True)
    assert p.workspace.order[:6].tolist() == list(range(6))
    assert fdlib.plan(6, 8, 2, 32, 96, dtype=torch.float32, device=DEVICE, lengths=lens, method="unified",
                      page_size=16).workspace.order is None


def test_longest_first_order_is_a_power_of_two_covering_the_batch():
    assert [longest_first_order(B) for B in (1, 16, 17, 100, LONGEST_FIRST_MAX_BATCH)] == \
        [16, 16, 32, 128, max(16, 1 << (LONGEST_FIRST_MAX_BATCH - 1).bit_length())]
    with pytest.raises(ValueError, match="B"):
        longest_first_order(LONGEST_FIRST_MAX_BATCH + 1)


def test_the_plan_orders_only_where_auto_takes_it_or_where_asked(monkeypatch):
    lens = [40, 3, 77, 0, 12]
    # the unified kernel alone keeps b order, over pages and ragged too (the sort cost more than it gave there)
    assert decide(5, 8, 2, 32, 96, torch.float32, lengths=lens, method="unified", paged=16).order == 0
    d = decide(5, 8, 2, 32, 96, torch.float32, lengths=lens, method="unified", paged=16, longest_first=True)
    assert (d.kernel, d.order) == ("unified", 16)
    # auto's rule (fdlib.splits.choose_auto answers "longest_first"): whole rows, ordered; longest_first=False: not
    plan_module = sys.modules["fdlib.plan"]   # the module (fdlib.plan is the function)
    monkeypatch.setattr(plan_module, "choose_auto", lambda *a, **k: ("longest_first", 1))
    d = decide(5, 8, 2, 32, 96, torch.float32, lengths=lens, paged=16)
    assert (d.kernel, d.splits, d.order) == ("unified", 1, 16)
    d = decide(5, 8, 2, 32, 96, torch.float32, lengths=lens, paged=16, longest_first=False)
    assert d.kernel == "unified" and d.order == 0
    p = fdlib.plan(5, 8, 2, 32, 96, dtype=torch.float32, device=DEVICE, lengths=lens, method="unified",
                   page_size=16, longest_first=True)
    assert "longest first" in str(p)
    assert "longest first" not in str(fdlib.plan(5, 8, 2, 32, 96, dtype=torch.float32, device=DEVICE,
                                                 lengths=lens, method="unified", page_size=16))


@pytest.mark.parametrize("kw, match", [(dict(method="split"), "method='unified'"),
                                       (dict(method="unified", B=LONGEST_FIRST_MAX_BATCH + 1), "B <="),
                                       (dict(method="unified", batch_invariant=True), "batch_invariant"),
                                       (dict(method="unified", pack_heads=True), "pack_heads")])
def test_longest_first_true_needs_the_plain_unified_kernel(kw, match):
    B = kw.pop("B", 4)
    with pytest.raises(ValueError, match=match) as e:
        fdlib.plan(B, 8, 2, 32, 64, dtype=torch.float32, device=DEVICE, longest_first=True, **kw)
    assert "longest_first" in str(e.value)


def test_longest_first_takes_a_bool():
    with pytest.raises(TypeError, match="longest_first"):
        fdlib.plan(4, 8, 2, 32, 64, dtype=torch.float32, device=DEVICE, method="unified", longest_first="yes")


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("splits_", [1, 3])
def test_longest_first_plan_matches_float64_when_the_lengths_change(page, splits_):
    """A plan made for one ragged mix, run on it, then on other lengths and tables and on a smaller batch (the
    order follows the device lengths of each call): every row against float64, ticket counters back at zero and
    the plan's order untouched."""
    gen = torch.Generator().manual_seed(7 + page + splits_)
    B, H_q, H_kv, D, max_pages = 6, 6, 2, 80, max(2, 64 // page)
    L_max = max_pages * page
    first = [L_max, 1, 0, page + 1, L_max - 1, 17]
    p = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, lengths=first, method="unified",
                   num_splits=splits_, page_size=page, longest_first=True)
    assert p.decision.order == 16
    # the plan's lengths (its order passes the kernel's check), others (it fails), and a smaller batch than planned
    for lens in (first, [3, L_max, 17, 17, 0, page], [5, L_max, 0, 17]):
        q, kp, vp, bt, k, v, lens_t = paged_problem(gen, len(lens), H_q, H_kv, D, page, max_pages,
                                                    B * max_pages + 2, lens)
        out = p.run(q, kp, vp, lens_t, block_table=bt)
        assert_attention_close(out, None, q, k, v, lens_t, what=f"page={page} splits={splits_} lens={lens}")
    assert counters_zero() and p.workspace.order[:B].tolist() == order_hint(B, L_max, first)


def test_greedy_model_of_rows_handed_longest_first():
    # 4 rows of 10 tiles on 2 SMs: 20 each, balanced
    assert splits.longest_first_imbalance(1, [640] * 4, 64, 2) == pytest.approx(1.0)
    # one row of 100 tiles and three of 1 on 2 SMs: loads 100 and 3, mean 51.5
    assert splits.longest_first_imbalance(1, [6400, 64, 64, 64], 64, 2) == pytest.approx(100 / 51.5)
    # H_kv rows a sequence: 2 heads of one 3-tile sequence on 2 SMs
    assert splits.longest_first_imbalance(2, [192], 64, 2) == pytest.approx(1.0)
    # 2 slots an SM: the four rows (100, 90, 1, 1 tiles) fill the slots at once, SM by SM in turn, so the two
    # long ones share no SM only by the turn: loads 101 and 91, not the greedy 100 and 92
    assert splits.longest_first_imbalance(1, [6400, 5760, 64, 64], 64, 2, per_sm=2) == pytest.approx(101 / 96)


def test_auto_takes_longest_first_only_where_the_rule_says(monkeypatch):
    """On an H200's numbers (132 SMs, 3 programs an SM, 64-key paged tiles, the default calibration): many short
    ragged rows, yes; not on a contiguous cache, not for equal rows, not for a larger batch than the order sorts,
    not where one row at one program's rate outlasts the batch at the bandwidth, not where the long rows of the
    first wave pile up on some SMs (two batches measured slower than stream-K, ab-lpt-rule.json)."""
    from fdlib.bench.ragged import case_lengths
    from fdlib.costmodel import H200_DEFAULT
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(splits, "sm_count", lambda: 132)
    suits = lambda B, H_kv, lens, page=16: splits.longest_first_suits(   # noqa: E731
        B, H_kv, 128, torch.float16, lens, page, H200_DEFAULT, 3)
    g = torch.Generator().manual_seed(0)
    uniform = torch.randint(1, 2049, (128,), generator=g).tolist()
    assert suits(128, 8, uniform)
    assert not suits(128, 8, uniform, page=0)
    assert not suits(128, 8, [1024] * 128)                                       # not ragged
    assert not suits(256, 8, uniform * 2)                                        # > LONGEST_FIRST_MAX_BATCH
    assert not suits(128, 8, [64] * 127 + [65536])                               # one row outlasts the batch
    for case, pos in (("zipf", 3), ("zipf", 4)):                                 # the A/B's draws
        lens = case_lengths(case, 32, 1024 if pos == 3 else 8192, pos)
        assert max(lens) / H200_DEFAULT.rho_tbs <= 32 * sum(lens) / H200_DEFAULT.bw_tbs   # not the rate ...
        assert not suits(32, 32, lens)                                           # ... the first wave
