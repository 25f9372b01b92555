"""The work-list plan (method="worklist"): the schedule kernel's list against the Python model
(:mod:`fdlib.worklist`), attention against float64 on ragged batches (contiguous and paged, odd group and head
dims, several query tokens), a plan made before the lengths are known replayed with new ones, the clamp flag,
and batch invariance by construction."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import fdlib
from fdlib import worklist
from fdlib.kernels.worklist import INLINE_BATCH
from helpers import DEVICE, INTERPRET, assert_attention_close, hyp_settings
from test_paged import paged_problem
from test_qlen import assert_close_qlen, problem


def listed(p) -> list[int]:
    """The list a plan's last call wrote: its count, its unit, then its items."""
    items = p.workspace.items.tolist()
    return items[: 2 + items[0]]


def expected(p, lens) -> list[int]:
    d = p.decision
    N = d.tile.BLOCK_N
    unit = worklist.balanced_chunk(lens, d.chunk, d.budget, N) if d.budget else d.chunk
    count, *items = worklist.encode(worklist.work_list(lens, d.chunk, d.splits, N, d.budget), d.splits)
    return [count, unit, *items]


def rand_problem(lens, H_q, H_kv, D, dtype=torch.float32, seed=0, L_max=None):
    g = torch.Generator().manual_seed(seed)
    B, L = len(lens), L_max or max(lens + [1])
    q = torch.randn(B, H_q, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, L, H_kv, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, L, H_kv, D, generator=g).to(dtype).to(DEVICE)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


# ------------------------------------------------------------------------------------------- the model
def test_model_cuts_each_row_by_its_own_length_and_lists_the_longest_first():
    N, chunk, S = 16, 32, 4
    lens = [0, 1, 37, 160, 100, 37]
    items = worklist.work_list(lens, chunk, S, N)
    assert [it.b for it in items] == [3] * 4 + [4] * 4 + [2, 2, 5, 5, 1, 0]
    assert [(it.start, it.end) for it in items if it.b == 3] == [(0, 48), (48, 96), (96, 144), (144, 160)]
    assert [(it.start, it.end) for it in items if it.b == 2] == [(0, 32), (32, 37)]
    assert [(it.start, it.end) for it in items if it.b == 0] == [(0, 0)]
    assert worklist.encode(items, S)[:3] == [len(items), 3 * S + 0, 3 * S + 1]


@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40), st.sampled_from([16, 64, 128]),
       st.integers(1, 8), st.integers(1, 32), st.sampled_from([0, 1, 7, 66]))
@hyp_settings(300)
def test_model_pieces_cover_every_row_once_within_the_cap(lens, N, chunk_tiles, S, budget):
    """Every row's pieces tile it in order, at most S of them, by each row alone (budget 0) or by the batch."""
    items = worklist.work_list(lens, chunk_tiles * N, S, N, budget)
    assert len(items) <= worklist.capacity(len(lens), S, budget)   # the grid holds the list (plan.work_room)
    for b, L in enumerate(lens):
        mine = [it for it in items if it.b == b]
        assert 1 <= len(mine) <= S and [it.j for it in mine] == list(range(len(mine)))
        assert mine[0].start == 0 and mine[-1].end == L
        assert all(a.end == c.start for a, c in zip(mine, mine[1:]))
        assert all(it.start < it.end for it in mine) or L == 0


def test_pieces_sized_by_the_batch_follow_its_total():
    """A budget of items: equal rows near the unit stay whole (no sliver piece), one long row among short ones is
    cut into about its share of the budget, and the whole batch comes to about the budget."""
    N = 128
    assert worklist.balanced_pieces(8192, 8064, 32, N) == (8192, 1)            # within half a unit: one piece
    lens = [131072] + [1000] * 7
    unit = worklist.balanced_chunk(lens, 4 * N, 33, N)
    items = worklist.work_list(lens, 4 * N, 32, N, budget=33)
    assert unit == N * -(-(1024 + 7 * 8) // 33)
    assert 28 <= sum(it.b == 0 for it in items) <= 32 and len(items) <= 33 + 8
    assert len(worklist.work_list([8192] * 32, 4 * N, 32, N, budget=33)) == 32   # a whole row a piece


# ------------------------------------------------------------------------------------- the device list
@pytest.mark.parametrize("lens", [[0, 1, 37, 160, 100, 37], [5], [160] * 4, [0, 0, 0], [17, 160, 1, 0, 159, 33, 64]])
def test_schedule_kernel_writes_the_models_list(lens):
    q, k, v, L = rand_problem(lens, 4, 2, 16, L_max=160)
    p = fdlib.plan(len(lens), 4, 2, 16, 160, dtype=torch.float32, device=DEVICE, method="worklist", num_splits=4)
    p.run(q, k, v, L)
    assert listed(p) == expected(p, lens)


def test_a_batch_larger_than_one_block_of_the_schedule_is_listed_in_full():
    """More rows than one schedule program lists and than one block it compares with (SCHEDULE_ROWS,
    SCHEDULE_COLS), with ties across blocks."""
    from fdlib.kernels import worklist as wk
    B = wk.SCHEDULE_COLS + wk.SCHEDULE_ROWS + 3
    lens = [(37 * b) % 90 for b in range(B)]
    q, k, v, L = rand_problem(lens, 2, 1, 16, L_max=90)
    p = fdlib.plan(B, 2, 1, 16, 90, dtype=torch.float32, device=DEVICE, method="worklist", num_splits=3)
    out, lse = p.run(q, k, v, L, return_lse=True)
    assert listed(p) == expected(p, lens)
    assert_attention_close(out, lse, q, k, v, L, what="worklist B=%d" % B)


def test_listed_in_registers_or_by_the_schedule_kernel_alike(monkeypatch):
    """A batch of at most INLINE_BATCH rows is listed inside the attention kernel, a larger one by the schedule
    kernel: the same list, the same bits."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    lens = [0, 1, 37, 160, 100, 37, 159, 64]
    q, k, v, L = rand_problem(lens, 4, 2, 16, L_max=160, seed=4)
    got = []
    for inline in (16, 4):
        monkeypatch.setattr(plan_mod, "INLINE_BATCH", inline)
        p = fdlib.plan(len(lens), 4, 2, 16, 160, dtype=torch.float32, device=DEVICE, method="worklist", num_splits=4)
        assert bool(p.decision.inline) == (inline == 16)
        got.append((p.run(q, k, v, L, return_lse=True), listed(p)))
    assert got[0][1] == got[1][1] == expected(p, lens)
    assert torch.equal(got[0][0][0], got[1][0][0]) and torch.equal(got[0][0][1], got[1][0][1])


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens,H_q,H_kv,D", [([0, 1, 17, 64, 100], 6, 2, 80), ([100, 3, 97, 55], 5, 5, 96),
                                            ([33], 8, 2, 64), ([2, 130, 129, 1, 0, 64], 9, 3, 48)])
def test_ragged_batches_vs_float64(lens, H_q, H_kv, D, dtype):
    q, k, v, L = rand_problem(lens, H_q, H_kv, D, dtype, seed=sum(lens))
    p = fdlib.plan(len(lens), H_q, H_kv, D, k.shape[1], dtype=dtype, device=DEVICE, method="worklist")
    assert p.kernel == "worklist"
    out, lse = p.run(q, k, v, L, return_lse=True)
    assert_attention_close(out, lse, q, k, v, L, what=f"worklist {lens}")
    again = p.run(q, k, v, L, return_lse=True)                # counters reset, the same bits
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    assert int(p.workspace.counters.abs().sum()) == 0


@pytest.mark.parametrize("page", [1, 16])
def test_paged_batches_vs_float64(page):
    g = torch.Generator().manual_seed(page)
    lens = [0, 5, 47, 130, 1]
    max_pages = -(-160 // page)
    q, kp, vp, bt, k, v, L = paged_problem(g, len(lens), 6, 2, 80, page, max_pages, 5 * max_pages, lens)
    p = fdlib.plan(len(lens), 6, 2, 80, max_pages * page, dtype=torch.float32, device=DEVICE, method="worklist",
                   page_size=page, num_splits=5)
    out, lse = p.run(q, kp, vp, L, block_table=bt, return_lse=True)
    assert_attention_close(out, lse, q, k, v, L, what=f"worklist pages of {page}")
    assert listed(p) == expected(p, lens)


def test_several_query_tokens_vs_float64():
    lens = [3, 70, 40, 2]
    q, k, v, L = problem(4, 3, 6, 2, 32, 80, lens, seed=3)
    p = fdlib.plan(4, 6, 2, 32, 80, dtype=torch.float32, device=DEVICE, method="worklist", q_len=3)
    out, lse = p.run(q, k, v, L, return_lse=True)
    assert_close_qlen(out, lse, q, k, v, L, what="worklist q_len=3")


def test_a_plan_made_without_lengths_follows_new_lengths_in_the_same_tensor():
    """A serving step captured before the lengths are known: the plan sees none, the lengths tensor is
    written in place between calls (the second call replays the first's launches), and every call is right."""
    H_q, H_kv, D, L_max = 4, 2, 32, 200
    q, k, v, L = rand_problem([L_max] * 5, H_q, H_kv, D, seed=7)
    p = fdlib.plan(5, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, method="worklist")
    for lens in ([L_max] * 5, [3, 200, 0, 150, 17], [1, 1, 199, 2, 64]):
        L.copy_(torch.tensor(lens, dtype=torch.int32))
        out, lse = p.run(q, k, v, L, return_lse=True)
        assert_attention_close(out, lse, q, k, v, L, what=f"worklist replay {lens}")
        assert listed(p) == expected(p, lens)


def test_fewer_sequences_than_planned():
    lens = [9, 100, 0]
    q, k, v, L = rand_problem(lens, 4, 2, 16, seed=1, L_max=120)
    p = fdlib.plan(6, 4, 2, 16, 120, dtype=torch.float32, device=DEVICE, method="worklist")
    out, lse = p.run(q, k, v, L, return_lse=True)
    assert_attention_close(out, lse, q, k, v, L, what="worklist B'=3 of 6")
    assert listed(p) == expected(p, lens)


@pytest.mark.parametrize("invariant", (False, True))
def test_fewer_sequences_than_planned_and_no_lengths_lists_only_the_calls_rows(invariant):
    """cache_seqlens=None (every row L_max) with B' < B through the schedule kernel (B > INLINE_BATCH): the list
    holds the call's B' rows only, never the plan's other rows, whose q, K, V and out the call does not have."""
    B, L_max = INLINE_BATCH + 4, 64
    lens = [L_max] * 2
    q, k, v, L = rand_problem(lens, 2, 1, 16, seed=4, L_max=L_max)
    p = fdlib.plan(B, 2, 1, 16, L_max, dtype=torch.float32, device=DEVICE, method="worklist",
                   batch_invariant=invariant)
    assert not p.decision.inline
    out, lse = p.run(q, k, v, return_lse=True)
    assert_attention_close(out, lse, q, k, v, L, what=f"worklist B'=2 of {B}, no lengths")
    assert listed(p) == expected(p, lens)


@pytest.mark.skipif(INTERPRET, reason="on the CPU runtime lengths are host lengths, refused when out of range")
def test_a_length_outside_the_cache_is_clamped_and_flagged():
    lens = [5, 40]
    q, k, v, L = rand_problem(lens, 2, 1, 16, seed=2, L_max=40)
    p = fdlib.plan(2, 2, 1, 16, 40, dtype=torch.float32, device=DEVICE, method="worklist")
    bad = torch.tensor([5, 41], dtype=torch.int32, device=DEVICE)
    out, lse = p.run(q, k, v, bad, return_lse=True)
    assert p.clamped()
    assert_attention_close(out, lse, q, k, v, L, what="clamped to L_max")
    assert listed(p) == expected(p, lens)


# ------------------------------------------------------------------------------------------ invariance
def test_batch_invariant_by_construction():
    """With batch_invariant=True a sequence's out and lse are the same bits whatever its batchmates, the batch
    size, its place in the batch and whether the cache is paged."""
    H_q, H_kv, D, L_max, page = 6, 2, 32, 192, 16
    g = torch.Generator().manual_seed(11)
    row_q = torch.randn(1, H_q, D, generator=g)
    row_k = torch.randn(1, L_max, H_kv, D, generator=g)
    row_v = torch.randn(1, L_max, H_kv, D, generator=g)
    L_row = 150
    results = []
    for B, at, seed in ((1, 0, 0), (4, 2, 1), (7, 6, 2), (7, 0, 3), (20, 13, 4)):   # B=20: the schedule kernel
        g = torch.Generator().manual_seed(100 + seed)
        q = torch.randn(B, H_q, D, generator=g)
        k = torch.randn(B, L_max, H_kv, D, generator=g)
        v = torch.randn(B, L_max, H_kv, D, generator=g)
        lens = torch.randint(0, L_max + 1, (B,), generator=g)
        q[at], k[at], v[at], lens[at] = row_q[0], row_k[0], row_v[0], L_row
        lens_d = lens.to(torch.int32).to(DEVICE)
        p = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, method="worklist",
                       batch_invariant=True)
        assert p.decision.invariant
        out, lse = p.run(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), lens_d, return_lse=True)
        results.append((out[at].cpu(), lse[at].cpu()))
        # the same batch over shuffled pages
        n = B * L_max // page
        perm = torch.randperm(n, generator=g)
        kp = torch.empty(n, page, H_kv, D)
        vp = torch.empty(n, page, H_kv, D)
        kp[perm] = k.reshape(n, page, H_kv, D)
        vp[perm] = v.reshape(n, page, H_kv, D)
        bt = perm.reshape(B, L_max // page).to(torch.int32)
        pp = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, method="worklist",
                        batch_invariant=True, page_size=page)
        out, lse = pp.run(q.to(DEVICE), kp.to(DEVICE), vp.to(DEVICE), lens_d, block_table=bt.to(DEVICE),
                          return_lse=True)
        results.append((out[at].cpu(), lse[at].cpu()))
    for o, l in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(l, results[0][1])
    assert_attention_close(results[0][0][None], results[0][1][None], row_q, row_k, row_v,
                           torch.tensor([L_row], dtype=torch.int32), what="invariant row")


def captured_replays(**plan_kw):
    """Yield (plan, lengths) after each of two replays, contiguous then over pages of 16: a plan made without
    lengths (``plan_kw``), captured while every row is L_max, replayed after ragged lengths are written into the
    same tensor, checked against float64 (bf16, 32:8, D=128, rows of 0 to 4096 keys)."""
    H_q, H_kv, D, L_max, page = 32, 8, 128, 4096, 16
    lens = [4096, 1, 0, 2049, 77, 4000, 128, 129]
    B = len(lens)
    g = torch.Generator().manual_seed(5)
    q, kp, vp, bt, k, v, L = paged_problem(g, B, H_q, H_kv, D, page, L_max // page, B * L_max // page, lens,
                                           dtype=torch.bfloat16, share=False, unused=0)
    for paged in (False, True):
        p = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.bfloat16, device=DEVICE,
                       page_size=page if paged else None, **plan_kw)
        args = (q, kp, vp) if paged else (q, k, v)
        kw = dict(block_table=bt) if paged else {}
        L.fill_(L_max)
        out = torch.empty_like(q)
        lse = torch.empty(B, H_q, dtype=torch.float32, device=DEVICE)
        p.run(*args, L, out=out, lse=lse, **kw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            p.run(*args, L, out=out, lse=lse, **kw)
        L.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, q, k, v, L, what=f"captured {p.decision.kernel} paged={paged}")
        yield p, lens


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_graph_replayed_with_ragged_lengths_on_a_gpu():
    """Captured while every row is L_max, replayed after ragged lengths are written into the same tensor:
    contiguous and over pages, against float64; the list the replay wrote is the model's."""
    for p, lens in captured_replays(method="worklist"):
        assert listed(p) == expected(p, lens)


def test_decode_attentions_doc_names_every_method():
    """Every method the argument check accepts is described where decode_attention documents ``method``."""
    from fdlib.validate import METHODS
    doc = fdlib.decode_attention.__doc__
    method_doc = doc[doc.index("method:"):doc.index("num_splits:")]
    assert [m for m in METHODS if f'``"{m}"``' not in method_doc] == []


@given(st.lists(st.integers(0, 96), min_size=1, max_size=24), st.integers(1, 6), st.booleans())
@hyp_settings(12)
def test_the_device_list_is_the_models_for_random_batches(lens, S, invariant):
    """Random ragged batches (both sides of the in-register limit of 16 rows), pieces sized by the batch or by each
    row alone: the list the kernels write equals the model's, and every row's output matches float64."""
    q, k, v, L = rand_problem(lens, 2, 1, 16, seed=len(lens), L_max=96)
    p = fdlib.plan(len(lens), 2, 1, 16, 96, dtype=torch.float32, device=DEVICE, method="worklist", num_splits=S,
                   batch_invariant=invariant)
    out, lse = p.run(q, k, v, L, return_lse=True)
    assert listed(p) == expected(p, lens)
    assert_attention_close(out, lse, q, k, v, L, what=f"worklist S={S} invariant={invariant} {lens}")


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
def test_an_8bit_cache_through_the_work_list_vs_float64(kv_dtype, granularity):
    """method="worklist" on an 8-bit cache (fdlib.quant): against float64 of the cache it stands for."""
    from fdlib import quant
    lens = [80, 5, 0, 33]
    q, k, v, L = rand_problem(lens, 4, 2, 32, dtype=torch.float16, seed=12)
    k8, ks = fdlib.quantize_kv(k.float(), kv_dtype, granularity)
    v8, vs = fdlib.quantize_kv(v.float(), kv_dtype, granularity)
    out, lse = fdlib.decode_attention(q, k8, v8, L, k_scale=ks, v_scale=vs, method="worklist", return_lse=True)
    kd, vd = quant.dequantize_kv(k8, ks), quant.dequantize_kv(v8, vs)
    assert_attention_close(out, lse, q, kd, vd, L, what=f"worklist {kv_dtype} {granularity}")
