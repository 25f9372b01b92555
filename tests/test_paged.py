"""Paged KV caches: pages [n_pages, page_size, H_kv, D] behind a block table [B, max_pages] (vLLM / FlashInfer NHD),
through every method, against float64 on the contiguous cache the table describes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fdlib
from helpers import DEVICE, assert_attention_close, counters_zero

METHODS = ("auto", "split", "unified", "persistent", "balanced", "streamk", "naive")


def paged_problem(gen, B, H_q, H_kv, D, page, max_pages, n_pages, lens, dtype=torch.float32, share=True,
                  unused=-1):
    """q, the page pool, a block table (pages shuffled, the first pages of sequence 0 shared with sequence 1
    when ``share``, entries past each length set to ``unused``), and the contiguous K/V it describes."""
    q = torch.randn(B, H_q, D, generator=gen).to(dtype)
    kp = torch.randn(n_pages, page, H_kv, D, generator=gen).to(dtype)
    vp = torch.randn(n_pages, page, H_kv, D, generator=gen).to(dtype)
    bt = torch.stack([torch.randperm(n_pages, generator=gen)[:max_pages] for _ in range(B)]).to(torch.int32)
    if share and B > 1:
        bt[1, : max_pages // 2] = bt[0, : max_pages // 2]
    for b, L in enumerate(lens):
        used = -(-L // page)
        bt[b, used:] = unused
    idx = bt.long().clamp(0, n_pages - 1)
    k = kp[idx].reshape(B, max_pages * page, H_kv, D)
    v = vp[idx].reshape(B, max_pages * page, H_kv, D)
    to = lambda t: t.to(DEVICE)   # noqa: E731
    return to(q), to(kp), to(vp), to(bt), to(k), to(v), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


@settings(max_examples=12, deadline=None)
@given(page=st.sampled_from([1, 4, 16, 64]), B=st.integers(1, 3), H_kv=st.integers(1, 2),
       group=st.sampled_from([1, 3, 4]), D=st.sampled_from([16, 32, 80]), data=st.data())
def test_paged_matches_float64_for_every_method(page, B, H_kv, group, D, data):
    max_pages = max(1, 96 // page) if page < 64 else 2
    L_max = max_pages * page
    edges = [0, 1, page - 1, page, page + 1, 16, 17, L_max - 1, L_max]
    lens = [data.draw(st.sampled_from([x for x in edges if 0 <= x <= L_max] + [data.draw(st.integers(0, L_max))]))
            for _ in range(B)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, kp, vp, bt, k, v, lens_t = paged_problem(gen, B, group * H_kv, H_kv, D, page, max_pages,
                                                max_pages * B + 3, lens)
    for method in METHODS:
        out, lse = fdlib.decode_attention(q, kp, vp, lens_t, block_table=bt, method=method, return_lse=True)
        assert_attention_close(out, lse, q, k, v, lens_t, what=f"{method} page={page} lens={lens}")
    assert counters_zero()


def test_paged_plan_reused_with_new_tables_and_a_smaller_batch():
    gen = torch.Generator().manual_seed(1)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, 3, 8, 2, 32, 16, 4, 20, [64, 20, 0])
    p = fdlib.plan(3, 8, 2, 32, 64, dtype=torch.float32, device=DEVICE, page_size=16)
    assert p.page_size == 16 and "pages of 16" in str(p)
    assert_attention_close(p.run(q, kp, vp, lens, block_table=bt), None, q, k, v, lens, what="first table")
    q2, kp2, vp2, bt2, k2, v2, lens2 = paged_problem(gen, 3, 8, 2, 32, 16, 4, 20, [5, 64, 33])
    assert_attention_close(p.run(q2, kp2, vp2, lens2, block_table=bt2), None, q2, k2, v2, lens2, what="new table")
    out = p.run(q2[:2], kp2, vp2, lens2[:2], block_table=bt2[:2])
    assert_attention_close(out, None, q2[:2], k2[:2], v2[:2], lens2[:2], what="B'=2")
    assert p.clamped() is False, "unused table entries (-1 past each length) are never read"


@pytest.mark.skipif(not torch.cuda.is_available() or fdlib.runtime.INTERPRET,
                    reason="the one-wave tiles are a GPU plan's (the interpreter keeps its own)")
def test_one_wave_plan_matches_float64_on_a_gpu():
    """auto's plan of 1024 equal rows of 1024 keys over shuffled pages of 16 (B=128, 32:8, D=128, fp16) takes
    ONE_WAVE_TILE (fdlib.splits.one_wave_suits), matches float64, and still does with new lengths and a new table
    under the same plan (rows shorter, one of 0, one of 1, one ending inside a page)."""
    from fdlib.kernels.config import ONE_WAVE_TILE
    B, H_q, H_kv, D, page, L = 128, 32, 8, 128, 16, 1024
    gen = torch.Generator().manual_seed(5)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, B, H_q, H_kv, D, page, L // page, B * L // page, [L] * B,
                                              dtype=torch.float16, share=False)
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=DEVICE, lengths=[L] * B, page_size=page)
    assert p.decision.tile == ONE_WAVE_TILE and p.decision.kernel == "unified" and p.decision.splits == 1, str(p)
    out, lse = p.run(q, kp, vp, lens, block_table=bt, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what="one-wave plan")
    new = [L - 1 - (b * 37) % 700 for b in range(B)]
    new[3], new[4], new[5] = 0, 1, 17
    q2, kp2, vp2, bt2, k2, v2, lens2 = paged_problem(gen, B, H_q, H_kv, D, page, L // page, B * L // page, new,
                                                     dtype=torch.float16)
    out2, lse2 = p.run(q2, kp2, vp2, lens2, block_table=bt2, return_lse=True)
    assert_attention_close(out2, lse2, q2, k2, v2, lens2, what="one-wave plan, new lengths and table")
    assert counters_zero() and p.clamped() is False


@pytest.mark.parametrize("method", METHODS)
def test_page_index_outside_the_pool_is_clamped_and_flagged(method):
    """A used table entry outside 0..n_pages-1 reads the nearest page of the pool, never outside it, and sets
    the plan's flag."""
    gen = torch.Generator().manual_seed(2)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, 2, 4, 1, 32, 4, 5, 12, [20, 7], share=False)
    bt[0, 1], bt[1, 0] = 1000, -7
    idx = bt.long().clamp(0, 11)
    k = kp[idx].reshape(2, 20, 1, 32)
    v = vp[idx].reshape(2, 20, 1, 32)
    p = fdlib.plan(2, 4, 1, 32, 20, dtype=torch.float32, device=DEVICE, page_size=4, method=method)
    out = p.run(q, kp, vp, lens, block_table=bt)
    assert_attention_close(out, None, q, k, v, lens, what=f"{method} with clamped page indices")
    assert p.clamped() is True


PAGED_ERRORS = [
    ("int64 table", lambda bt: bt.long(), {}, TypeError, ["block_table", "int32", "int64"]),
    ("1-D table", lambda bt: bt[0], {}, ValueError, ["block_table", "[B=2"]),
    ("table for another batch", lambda bt: bt[:1], {}, ValueError, ["block_table", "[B=2"]),
    ("page of 3", None, {"page": 3}, ValueError, ["page_size", "power of two", "3"]),
    ("not a tensor", lambda bt: bt.tolist(), {}, TypeError, ["block_table", "list"]),
]


@pytest.mark.parametrize("what,edit,over,exc,fragments", PAGED_ERRORS, ids=[e[0] for e in PAGED_ERRORS])
def test_bad_block_tables_get_clear_errors(what, edit, over, exc, fragments):
    gen = torch.Generator().manual_seed(3)
    page = over.get("page", 4)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, 2, 4, 2, 16, page, 3, 8, [5, 2])
    with pytest.raises(exc) as info:
        fdlib.decode_attention(q, kp, vp, lens, block_table=edit(bt) if edit else bt)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in: {info.value}"


def test_a_paged_plan_needs_its_table_and_a_contiguous_plan_refuses_one():
    gen = torch.Generator().manual_seed(4)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, 2, 4, 2, 16, 4, 3, 8, [5, 2])
    paged = fdlib.plan(2, 4, 2, 16, 12, dtype=torch.float32, device=DEVICE, page_size=4)
    with pytest.raises(TypeError, match="block_table"):
        paged.run(q, kp, vp, lens)
    flat = fdlib.plan(2, 4, 2, 16, 12, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table: this plan is for a contiguous cache"):
        flat.run(q, k, v, lens, block_table=bt)
    with pytest.raises(ValueError, match="page_size: L_max=10 must be a positive multiple of page_size=4"):
        fdlib.plan(2, 4, 2, 16, 10, dtype=torch.float32, device=DEVICE, page_size=4)


@pytest.mark.parametrize("dim", [0, 1])
def test_pools_whose_strides_pass_32_bit_offsets_are_refused(dim):
    """The kernels compute a row's offset page·stride + slot·stride from unsigned 32-bit values, so a pool whose
    page stride, or slot stride × page_size, reaches 2**32 elements is refused with a clear error by
    decode_attention and by a plan's run (a view of a small storage: the huge stride's dimension has size 1)."""
    from fdlib.validate import PAGED_OFFSET_LIMIT
    gen = torch.Generator().manual_seed(5)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, 1, 2, 1, 8, 1, 1, 1, [1], share=False)
    strides = [8, 8, 8, 1]
    strides[dim] = PAGED_OFFSET_LIMIT
    wide_k = kp.as_strided(kp.shape, strides)
    with pytest.raises(ValueError) as info:
        fdlib.decode_attention(q, wide_k, vp, lens, block_table=bt)
    assert "k_cache" in str(info.value) and "2**32" in str(info.value)
    plan = fdlib.plan(1, 2, 1, 8, 1, dtype=torch.float32, device=DEVICE, page_size=1)
    assert torch.isfinite(plan.run(q, kp, vp, lens, block_table=bt)).all()
    with pytest.raises(ValueError, match="v_cache: a paged pool's page stride"):
        plan.run(q, kp, vp.as_strided(vp.shape, strides), lens, block_table=bt)


def test_table_regs_hold_one_splits_entries_up_to_table_regs_max():
    """table_regs_for: the block-table entries a split of ``chunk`` keys touches (one more where a split may
    start inside a page), a power of two, at most TABLE_REGS_MAX = 256 (a longer split reloads them a block at a
    time); 0 on small pages and above TABLE_REGS_MAX_D = 128."""
    from fdlib.plan import TABLE_REGS_MAX, TABLE_REGS_MAX_D, decide, table_regs_for
    assert TABLE_REGS_MAX == 256 and TABLE_REGS_MAX_D == 128
    assert ([table_regs_for(c, 16, 128) for c in (16, 64, 512, 1024, 1040, 2048, 4096, 4112, 32768)]
            == [1, 4, 32, 64, 128, 128, 256, 256, 256])
    assert table_regs_for(64, 128, 128) == 2 and table_regs_for(128, 256, 128) == 2   # a split may start in a page
    assert table_regs_for(1024, 4, 128) == 0 and table_regs_for(64, 0, 128) == 0
    assert table_regs_for(1024, 16, 256) == 0
    d = decide(3, 8, 2, 32, 96, torch.float32, lengths=[96, 20, 0], method="unified", paged=16)
    assert d.table_regs == table_regs_for(d.chunk, 16, 32) > 0
    assert decide(3, 8, 2, 32, 96, torch.float32, lengths=[96, 20, 0], method="unified").table_regs == 0


def test_a_split_longer_than_its_table_registers_reloads_them():
    """A plan whose table registers cover fewer pages than a later call's rows (lengths grown since planning: the
    last split runs to L) still matches float64: the split reloads its entries every TABLE_REGS pages."""
    gen = torch.Generator().manual_seed(3)
    q, kp, vp, bt, k, v, lens = paged_problem(gen, 2, 8, 2, 32, 16, 12, 30, [190, 33])
    p = fdlib.plan(2, 8, 2, 32, 192, dtype=torch.float32, device=DEVICE, lengths=[16, 16], page_size=16,
                   method="unified", num_splits=1)
    from fdlib.plan import table_regs_for
    d = p.decision   # 16-key splits in the interpreter, 64-key ones on a GPU: 1 or 4 entries, both under 190 keys
    assert d.splits == 1 and d.table_regs == table_regs_for(d.chunk, 16, 32) and 0 < d.table_regs * 16 < 190, str(p)
    assert_attention_close(p.run(q, kp, vp, lens, block_table=bt), None, q, k, v, lens, what="grown lengths")


@pytest.mark.parametrize("splits_", [1, 2])
def test_a_split_of_more_than_256_entries_holds_its_table_a_block_at_a_time(splits_):
    """Splits of more than TABLE_REGS_MAX = 256 pages (pages of 8, rows of up to 4200 keys: 525 pages) hold 256
    entries at a time and load the next block where the last ends; against float64, with rows that end inside the
    second and third blocks, a row of one page and an empty one."""
    from fdlib.plan import TABLE_REGS_MAX
    gen = torch.Generator().manual_seed(11 + splits_)
    page, max_pages, lens = 8, 525, [4200, 2051, 8, 0]
    q, kp, vp, bt, k, v, lens_t = paged_problem(gen, 4, 2, 1, 16, page, max_pages, 4 * max_pages + 5, lens)
    p = fdlib.plan(4, 2, 1, 16, max_pages * page, dtype=torch.float32, device=DEVICE, method="unified",
                   num_splits=splits_, page_size=page)
    assert p.decision.table_regs == TABLE_REGS_MAX and p.decision.chunk > TABLE_REGS_MAX * page, str(p)
    assert_attention_close(p.run(q, kp, vp, lens_t, block_table=bt), None, q, k, v, lens_t,
                           what=f"{splits_} splits of {p.decision.chunk} keys")


@pytest.mark.parametrize("page", [128, 256])
def test_table_registers_of_splits_that_start_inside_a_page(page):
    """Splits of a chunk that is no multiple of the page start inside a page (table_regs_for counts one entry
    more). With lengths grown since planning the last split runs past its registers' pages and reloads whole
    pages from the one it is in, so a tile never gathers an entry outside its registers: every row against
    float64, no page index clamped."""
    gen = torch.Generator().manual_seed(page)
    B, max_pages = 2, 5
    L_max = page * max_pages
    p = fdlib.plan(B, 4, 1, 32, L_max, dtype=torch.float32, device=DEVICE, lengths=[144, 100], page_size=page,
                   method="unified", num_splits=3)
    d = p.decision
    assert d.splits == 3 and d.table_regs > 0 and d.chunk % page != 0, str(p)
    for lens in ([144, 100], [L_max - 5, 1], [L_max, page + 1]):
        q, kp, vp, bt, k, v, lens_t = paged_problem(gen, B, 4, 1, 32, page, max_pages, B * max_pages + 3, lens)
        out = p.run(q, kp, vp, lens_t, block_table=bt)
        assert_attention_close(out, None, q, k, v, lens_t, what=f"page={page} lens={lens}")
    assert p.clamped() is False
