"""The stream-K kernel (method="streamk"): equal shares of a ragged batch's tiles, rows cut wherever the
shares fall and merged with the ticket; against float64, on contiguous and paged caches, with several query
tokens, and its slot layout."""
from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, strategies as st

import fdlib
from fdlib.kernels.streamk import shares, slots_for
from helpers import DEVICE, assert_attention_close, hyp_settings
from test_paged import paged_problem
from test_qlen import assert_close_qlen, problem


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 50))
@hyp_settings(200)
def test_pieces_of_different_rows_never_share_a_slot(row_tiles, programs):
    """Row r cut over programs p_a..p_b stores its pieces at slots 2p_a+1 .. 2p_a+n: a contiguous run (what the
    merge reads), inside 0 .. 2P-1, disjoint from every other row's."""
    P = min(programs, sum(row_tiles))   # the programs that take part (those with a tile)
    used = set()
    for r in shares(row_tiles, programs):
        n = r["p_b"] - r["p_a"] + 1
        if n == 1:
            assert r["slots"] == []
            continue
        assert r["slots"] == list(range(2 * r["p_a"] + 1, 2 * r["p_a"] + 1 + n))
        assert max(r["slots"]) < slots_for(P) and not used & set(r["slots"])
        used |= set(r["slots"])


def test_every_program_gets_an_equal_share():
    row_tiles = [1, 1, 97, 3, 1, 40, 1, 1]
    P = 7
    rows = shares(row_tiles, P)
    T = sum(row_tiles)
    bounds = [p * T // P for p in range(P + 1)]
    assert max(b - a for a, b in zip(bounds, bounds[1:])) - min(b - a for a, b in zip(bounds, bounds[1:])) <= 1
    assert rows[2]["p_b"] - rows[2]["p_a"] + 1 >= 4       # the long row is cut over several programs


@pytest.mark.parametrize("lens", [[0, 1, 17, 64, 100], [100, 100, 100, 100, 100], [0, 0, 0, 0, 1], [3, 97, 1, 0, 55],
                                  [17]])   # [17]: fewer tiles (2 per head) than programs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_batches_vs_float64(lens, dtype):
    g = torch.Generator().manual_seed(sum(lens))
    B, H_q, H_kv, D, L = len(lens), 6, 2, 80, max(lens + [1])       # group 3, D = 80
    q = torch.randn(B, H_q, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, L, H_kv, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, L, H_kv, D, generator=g).to(dtype).to(DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=dtype, device=DEVICE, method="streamk")
    assert p.kernel == "streamk" and "programs" in str(p)
    out, lse = p.run(q, k, v, lens_t, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what=f"streamk {lens}")
    again = p.run(q, k, v, lens_t, return_lse=True)                      # deterministic, counters reset
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    assert int(p.workspace.counters.abs().sum()) == 0


@pytest.mark.parametrize("window", [1, 2, 4])
def test_shares_walked_in_windows_of_rows(window, monkeypatch):
    """The loop finds each tile's row within windows of ROW_WINDOW sequences: shares that span several
    windows (many short rows, a few long) give what one window over the batch gives, and match float64. The
    batch has six sequences a share, whatever the device's program count."""
    import fdlib.kernels.streamk as sk
    H_q, H_kv, D = 4, 2, 16
    probe = fdlib.plan(8, H_q, H_kv, D, 64, dtype=torch.float32, device=DEVICE, method="streamk").decision
    N, P_h = probe.tile.BLOCK_N, probe.programs // H_kv
    B = 6 * P_h
    lens = [(13 * i) % (N + 5) for i in range(B)]
    lens[3], lens[B // 2] = 4 * N + 1, 3 * N
    L = max(lens)
    rows = shares([max(1, -(-n // N)) for n in lens], P_h)
    spans = [sum(1 for r in rows if r["p_a"] <= p <= r["p_b"]) for p in range(P_h)]
    assert max(spans) > window                         # the premise: a share crosses window boundaries
    g = torch.Generator().manual_seed(window)
    q = torch.randn(B, H_q, D, generator=g).to(DEVICE)
    k, v = (torch.randn(B, L, H_kv, D, generator=g).to(DEVICE) for _ in range(2))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    whole = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float32, device=DEVICE, method="streamk").run(
        q, k, v, lens_t, return_lse=True)
    monkeypatch.setattr(sk, "ROW_WINDOW", window)
    plan = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float32, device=DEVICE, method="streamk")
    assert plan.decision.tile.BLOCK_N == N and plan.decision.programs == P_h * H_kv
    out, lse = plan.run(q, k, v, lens_t, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what=f"streamk, windows of {window} rows")
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])


@given(st.integers(1, 9), st.sampled_from([(4, 4), (6, 2), (8, 1)]), st.sampled_from([16, 80]),
       st.integers(1, 3), st.data())
@hyp_settings(12)
def test_property_vs_float64(B, heads, D, q_len, data):
    H_q, H_kv = heads
    L_max = data.draw(st.integers(q_len, 130))
    lens = data.draw(st.lists(st.integers(0, L_max), min_size=B, max_size=B))
    q, k, v, lens_t = problem(B, q_len, H_q, H_kv, D, L_max, lens, seed=B + D + q_len)
    p = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, method="streamk", q_len=q_len)
    out, lse = p.run(q, k, v, lens_t, return_lse=True)
    assert_close_qlen(out, lse, q, k, v, lens_t, what=f"streamk B={B} {H_q}:{H_kv} D={D} q_len={q_len}")


def test_paged_cache_agrees_with_contiguous():
    g = torch.Generator().manual_seed(3)
    q, kp, vp, bt, k, v, lens_t = paged_problem(g, 4, 4, 2, 32, 8, 8, 40, [33, 0, 64, 7])
    out, lse = fdlib.decode_attention(q, kp, vp, lens_t, block_table=bt, method="streamk", return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what="streamk paged")
    dense = fdlib.decode_attention(q, k, v, lens_t, method="streamk", return_lse=True)
    torch.testing.assert_close(out, dense[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B,P_h,expect", [(8, 33, 32), (16, 33, 32), (32, 33, 32), (33, 33, 33), (1, 33, 33),
                                          (4, 8, 8), (3, 8, 8), (5, 8, 8), (12, 33, 33), (40, 33, 33)])
def test_equal_rows_are_cut_into_whole_pieces(B, P_h, expect):
    """On rows of equal length the shares are B·⌊P_h/B⌋ when that leaves at most one program in ALIGN_IDLE
    idle: every row is cut into the same number of pieces and no share holds parts of two rows (B=8 of 33
    programs: 32, four pieces a row); else P_h shares cut wherever they fall (B=12: 24 would idle 9 of 33)."""
    from fdlib.kernels.streamk import ALIGN_IDLE, active_shares
    assert ALIGN_IDLE == 8
    tiles = [64] * B
    assert active_shares(tiles, P_h) == expect
    rows = shares(tiles, P_h)
    if expect % B == 0 and expect < P_h:
        assert all(r["p_b"] - r["p_a"] + 1 == expect // B for r in rows)          # the same pieces a row
        assert [r["p_a"] for r in rows] == [b * expect // B for b in range(B)]   # each row's own shares
    assert active_shares([64] * (B - 1) + [63], P_h) == P_h or B == 1            # one row shorter: not equal


def test_equal_rows_aligned_vs_float64(monkeypatch):
    """The kernel takes the same rule: on a batch of equal rows where it launches fewer shares than P_h (one
    KV head, so that the interpreter's 8 programs make P_h = 8 and 7 rows take 7 shares), against float64, and
    the same output as with the rule off (ALIGN_IDLE = 0), where the shares cut rows wherever they fall."""
    import fdlib.kernels.streamk as sk
    H_q, H_kv, D = 4, 1, 16
    probe = fdlib.plan(2, H_q, H_kv, D, 64, dtype=torch.float32, device=DEVICE, method="streamk").decision
    N, P_h = probe.tile.BLOCK_N, probe.programs // H_kv
    L = 5 * N + 3                                                    # 6 tiles a row
    B = next(b for b in range(P_h, 0, -1) if sk.active_shares([6] * b, P_h) not in (P_h, 6 * b))
    assert sk.active_shares([6] * B, P_h) == B * (P_h // B) < P_h
    g = torch.Generator().manual_seed(B)
    q = torch.randn(B, H_q, D, generator=g).to(DEVICE)
    k, v = (torch.randn(B, L, H_kv, D, generator=g).to(DEVICE) for _ in range(2))
    lens_t = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
    out, lse = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float32, device=DEVICE, method="streamk").run(
        q, k, v, lens_t, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what=f"streamk, {B} equal rows")
    monkeypatch.setattr(sk, "ALIGN_IDLE", 0)
    assert sk.active_shares([6] * B, P_h) == P_h
    cut = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float32, device=DEVICE, method="streamk").run(
        q, k, v, lens_t, return_lse=True)
    torch.testing.assert_close(out, cut[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, cut[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 2, 4, 7])
@pytest.mark.parametrize("page", [0, 4, 16])
@pytest.mark.parametrize("q_len", [1, 2])
def test_share_inside_one_row_vs_float64(B, page, q_len):
    """Equal rows whose shares each lie inside one row (B·⌊P_h/B⌋ shares, the interpreter's P_h = 8 at one KV
    head) take the unified kernel's loop over one split: against float64 on a contiguous cache and over pages
    below and at TABLE_AHEAD_PAGE (the table read in the tile's iteration, and one tile ahead), with one and two
    query tokens; rows of one piece (B = 7: 7 shares of 8) end with no merge, rows of several hand off to the merge."""
    from fdlib.kernels.streamk import ALIGN_IDLE, active_shares
    from fdlib.kernels.tile import TABLE_AHEAD_PAGE
    assert 4 < TABLE_AHEAD_PAGE.value <= 16
    H_q, H_kv, D = 6, 1, 80
    probe = fdlib.plan(B, H_q, H_kv, D, 64, dtype=torch.float32, device=DEVICE, method="streamk").decision
    N, P_h = probe.tile.BLOCK_N, probe.programs // H_kv
    L = 3 * N + 5                                                     # 4 tiles a row, the last one short
    s = P_h // B
    assert s >= 1 and ALIGN_IDLE * B * s >= (ALIGN_IDLE - 1) * P_h   # the kernel's test for a share in one row
    assert active_shares([4] * B, P_h) == min(B * s, 4 * B)
    g = torch.Generator().manual_seed(10 * B + page + q_len)
    if page:
        max_pages = -(-L // page)
        q2, kp, vp, bt, k, v, lens_t = paged_problem(g, B, H_q, H_kv, D, page, max_pages, B * max_pages + 3,
                                                     [L] * B, share=False)
        q = torch.randn(B, q_len, H_q, D, generator=g).to(DEVICE)
        kp, vp, bt, k, v, lens_t = (x.to(DEVICE) for x in (kp, vp, bt, k, v, lens_t))
        out, lse = fdlib.decode_attention(q, kp, vp, lens_t, block_table=bt, method="streamk", return_lse=True)
    else:
        q, k, v, lens_t = problem(B, q_len, H_q, H_kv, D, L, [L] * B, seed=B + q_len)
        out, lse = fdlib.decode_attention(q, k, v, lens_t, method="streamk", return_lse=True)
    assert_close_qlen(out, lse, q, k[:, :L], v[:, :L], lens_t, what=f"streamk B={B} page={page} q_len={q_len}")


def test_share_inside_one_row_8bit_per_token():
    """The loop over one row reads an 8-bit cache with per-token scales as the general loop does: the same
    output as the cache it stands for, dequantized, through the same kernel, within float32 rounding."""
    H_q, H_kv, D, B = 4, 1, 32, 4
    probe = fdlib.plan(B, H_q, H_kv, D, 64, dtype=torch.float16, device=DEVICE, method="streamk").decision
    L = 2 * probe.tile.BLOCK_N + 9
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H_q, D, generator=g).to(torch.float16).to(DEVICE)
    k, v = (torch.randn(B, L, H_kv, D, generator=g).to(DEVICE) for _ in range(2))
    (k8, ks), (v8, vs) = (fdlib.quantize_kv(x, torch.float8_e4m3fn, "token") for x in (k, v))
    lens_t = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
    out = fdlib.decode_attention(q, k8, v8, lens_t, method="streamk", k_scale=ks, v_scale=vs)
    kd, vd = ((x.float() * s[..., None]).to(torch.float16) for x, s in ((k8, ks), (v8, vs)))
    ref, _ = fdlib.reference_attention(q, kd, vd, lens_t)
    torch.testing.assert_close(out.double().cpu(), ref.cpu().double(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("page", [0, 16])
def test_one_plan_moves_between_shares_in_one_row_and_cut_rows(page, monkeypatch):
    """One plan (B=4 at one KV head, P_h = 8 programs: the interpreter's SMs, and on a GPU the plan's SM count set
    to 8 at one program an SM) called with lengths that move it between the loop over one row (equal tiles a row,
    and ⌊P_h/B⌋ shares a row idling at most one program in ALIGN_IDLE) and the general loop, in turn, against
    float64 with the ticket counters back at 0 after each call: equal rows; rows of equal tiles but unequal lengths
    (each row stopping at its own length, the boundary the lengths alone do not show); one row a tile shorter; fewer
    sequences (B' = 3 of equal rows: 2 shares a row would idle 2 of 8); rows of 0 keys; a row of one tile; over pages
    too, the entries past each length −1. Lengths are written in tiles of N keys (the plan's BLOCK_N: 16 in the
    interpreter, larger on a GPU), so the same cases hold on both."""
    from fdlib.kernels.streamk import ALIGN_IDLE
    from fdlib.splits import INTERPRETER_SMS
    pm = sys.modules["fdlib.plan"]   # the module (fdlib.plan is the function)
    monkeypatch.setattr(pm, "sm_count", lambda: INTERPRETER_SMS)
    monkeypatch.setattr(pm, "persistent_per_sm", lambda: 1)
    H_q, H_kv, D, B = 3, 1, 80, 4
    N = fdlib.plan(B, H_q, H_kv, D, 64, dtype=torch.float32, device=DEVICE, method="streamk",
                   page_size=page or None).decision.tile.BLOCK_N
    L_max = 4 * N
    p = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, method="streamk",
                   page_size=page or None)
    P_h = p.decision.programs // H_kv
    assert P_h == 8 and p.decision.tile.BLOCK_N == N
    t = lambda tiles, extra: tiles * N + extra   # noqa: E731  (a length: whole tiles, then extra keys)
    calls = [([t(3, 5)] * 4, True), ([t(3, 5), t(3, 1), t(3, 4), t(3, 2)], True),
             ([t(3, 0), t(3, 5), t(3, 5), t(3, 5)], False), ([t(2, 1)] * 4, True), ([t(3, 5)] * 3, False),
             ([t(2, 8), t(2, 3)], True), ([t(3, 5), t(2, 8)], False), ([0] * 4, True), ([t(1, 1)], True),
             ([t(4, 0), t(4, -1), t(3, 1), t(4, 0)], True)]
    for i, (lens, one_row) in enumerate(calls):
        Bc, tiles = len(lens), {max(1, -(-n // N)) for n in lens}
        s = P_h // Bc
        assert (len(tiles) == 1 and s >= 1 and ALIGN_IDLE * Bc * s >= (ALIGN_IDLE - 1) * P_h) == one_row
        g = torch.Generator().manual_seed(10 * i + page)
        if page:
            q, kp, vp, bt, k, v, lens_t = paged_problem(g, Bc, H_q, H_kv, D, page, L_max // page,
                                                        Bc * L_max // page + 3, lens, share=False)
            out, lse = p.run(q, kp, vp, lens_t, block_table=bt, return_lse=True)
        else:
            q, k, v, lens_t = problem(Bc, 1, H_q, H_kv, D, L_max, lens, seed=10 * i)
            out, lse = p.run(q, k, v, lens_t, return_lse=True)
        if q.dim() == 4:
            assert_close_qlen(out, lse, q, k, v, lens_t, what=f"streamk call {i} lens={lens}")
        else:
            assert_attention_close(out, lse, q, k, v, lens_t, what=f"streamk page={page} call {i} lens={lens}")
        assert int(p.workspace.counters.count_nonzero()) == 0
