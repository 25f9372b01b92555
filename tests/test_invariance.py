"""batch_invariant=True: a sequence's out and lse are bitwise the same whatever its batchmates, the batch size,
its place in the batch, the run, and whether its cache is paged; the default mode is deterministic run to run."""
from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

import fdlib
from fdlib.kernels.invariant import row_share
from helpers import DEVICE, INTERPRET, assert_attention_close, requires_cuda

L_MAX, H_Q, H_KV, D = 100, 6, 2, 80      # group 3, D = 80; in the interpreter tiles (and the shortest chunks) are 16 keys


def pool(n, dtype, seed):
    """n sequences of one shape: q [n, H_q, D], K/V [n, L_MAX, H_kv, D], lengths (0, 1, tile and split edges)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H_Q, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(n, L_MAX, H_KV, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(n, L_MAX, H_KV, D, generator=g).to(dtype).to(DEVICE)
    edges = [0, 1, 15, 16, 31, 32, 33, 64, 99, 100]
    lens = torch.tensor([edges[i % len(edges)] if i < len(edges) else int(torch.randint(0, L_MAX + 1, (1,),
                         generator=g)) for i in range(n)], dtype=torch.int32, device=DEVICE)
    return q, k, v, lens


def decode(q, k, v, lens, **kw):
    return fdlib.decode_attention(q, k, v, lens, batch_invariant=True, return_lse=True, **kw)


def batch_of(lens, L, dtype, seed):
    """q, K and V of len(lens) sequences with caches of L keys (fresh random values), and the lengths."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), H_Q, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(len(lens), L, H_KV, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(len(lens), L, H_KV, D, generator=g).to(dtype).to(DEVICE)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def share_on(monkeypatch):
    """The device share for every plan of fewer rows than SMs (fdlib.plan.INVARIANT_SHARE = 1; the default, 2,
    takes it only where the host rule gives every row one program)."""
    import sys
    monkeypatch.setattr(sys.modules["fdlib.plan"], "INVARIANT_SHARE", 1)


def plan_on(monkeypatch, sms, B, L, dtype, **kw):
    """The batch-invariant plan of B sequences of L keys for a pretended GPU of ``sms`` SMs (the schedule rules
    read fdlib.plan.sm_count), so that a small batch takes the plans of a large one."""
    import sys
    monkeypatch.setattr(sys.modules["fdlib.plan"], "sm_count", lambda: sms)
    return fdlib.plan(B, H_Q, H_KV, D, L, dtype=dtype, device=DEVICE, batch_invariant=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_sequence_is_bitwise_itself_in_any_batch(dtype):
    n = 14
    q, k, v, lens = pool(n, dtype, seed=1)
    alone = [decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], lens[i:i + 1]) for i in range(n)]
    o_all, l_all = decode(q, k, v, lens)
    assert_attention_close(o_all, l_all, q, k, v, lens, what="batch-invariant mode vs float64")
    g = torch.Generator().manual_seed(2)
    for trial in range(12):                                   # random batchmates, sizes and positions
        size = int(torch.randint(1, 7, (1,), generator=g))
        idx = torch.randperm(n, generator=g)[:size]
        o, lse = decode(q[idx], k[idx], v[idx], lens[idx])
        for pos, i in enumerate(idx.tolist()):
            assert torch.equal(o[pos], alone[i][0][0]), f"trial {trial}: sequence {i} at {pos} of {size}: out differs"
            assert torch.equal(lse[pos], alone[i][1][0]), f"trial {trial}: sequence {i} at {pos}: lse differs"


@pytest.mark.parametrize("page,L", [(4, L_MAX), (16, 96)])
def test_paged_and_contiguous_agree_bitwise(page, L):
    """Pages in reverse order give the bits of a contiguous cache: pages of 4 (each tile's table rows looked up
    in its own iteration) and of 16 (read one tile ahead: fdlib.kernels.tile.attend_tile_ahead), ragged lengths
    with 0, 1 and tile edges; and right against float64."""
    lens = [0, 1, 15, 16, 33, L - 1, L, 50]
    q, k, v, lens = batch_of(lens, L, torch.float16, seed=3)
    n = len(lens) * L // page
    pages_k, pages_v = (t.reshape(n, page, H_KV, D)[torch.arange(n).flip(0)] for t in (k, v))
    bt = (n - 1 - torch.arange(n, device=DEVICE)).reshape(len(lens), -1).to(torch.int32)
    o1, l1 = decode(q, k, v, lens)
    o2, l2 = decode(q, pages_k, pages_v, lens, block_table=bt)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert_attention_close(o2, l2, q, k, v, lens, what=f"invariant, pages of {page}")


def test_default_mode_is_deterministic_run_to_run():
    """The ticket decides who merges, never the order: the same batch gives the same bits every time."""
    q, k, v, lens = pool(6, torch.float32, seed=4)
    for method in ("auto", "unified", "split", "persistent", "balanced", "streamk"):
        first = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
        for _ in range(3):
            again = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), method


def test_batch_invariant_arguments():
    q, k, v, lens = pool(2, torch.float32, seed=5)
    with pytest.raises(ValueError, match="batch_invariant"):
        fdlib.decode_attention(q, k, v, lens, batch_invariant=True, method="split")
    with pytest.raises(ValueError, match="batch_invariant"):
        fdlib.decode_attention(q, k, v, lens, batch_invariant=True, num_splits=2)
    with pytest.raises(TypeError, match="batch_invariant"):
        fdlib.plan(2, H_Q, H_KV, D, L_MAX, dtype=torch.float32, device=DEVICE, batch_invariant="yes")
    p = fdlib.plan(2, H_Q, H_KV, D, L_MAX, dtype=torch.float32, device=DEVICE, batch_invariant=True)
    assert p.decision.invariant and p.kernel == "invariant" and "rows cut by their own lengths" in str(p)


def test_chunks_depend_on_the_row_alone_and_cover_it():
    """A row of L keys is cut into n <= CHUNKS chunks of whole tiles that cover it exactly once; no row of at most
    L_max keys has more chunks than max_chunks(L_max) (the partial slots), although a shorter row may have more
    chunks than a longer one."""
    from fdlib.kernels.invariant import CHUNKS, MIN_TILES, max_chunks, row_chunks
    for block_n in (16, 64, 128):
        worst = 0
        for L in range(0, 40 * block_n + 3):
            chunk, n = row_chunks(L, block_n)
            assert chunk % block_n == 0 and chunk >= MIN_TILES * block_n and 1 <= n <= CHUNKS
            assert (n - 1) * chunk < max(L, 1) <= n * chunk, (L, chunk, n)
            worst = max(worst, n)
            assert worst <= max_chunks(L, block_n), (L, worst, max_chunks(L, block_n))
    assert row_chunks(16 * 16, 16)[1] == 16 and row_chunks(17 * 16, 16)[1] == 9   # not monotone in L


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_schedule_never_changes_the_bits(dtype, monkeypatch):
    """Whatever the programs per row the batch's plan chose (each program computes per_program chunks, one after
    another), every sequence gets the same bits; and the results are right against float64. Rows of 20 tiles
    (16 chunks for the longest) on the runtime's own tiles, lengths on and around chunk edges. The host's rule
    (INVARIANT_SHARE = 0), then the device share of fewer rows than SMs: the same bits."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]   # the module (fdlib.plan is also the function)
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 0)
    block_n = fdlib.plan(1, H_Q, H_KV, D, 64, dtype=dtype, device=DEVICE, batch_invariant=True).decision.tile.BLOCK_N
    L = 20 * block_n
    q, k, v, lens = batch_of([L, 1, 0, 2 * block_n, 2 * block_n + 1, 7 * block_n - 1], L, dtype, seed=6)
    got, seen, kernels = [], set(), set()
    rows = len(lens) * H_KV
    for sms in (rows // 2, 5, 1 * rows, 2 * rows, 3 * rows, 7 * rows, 16 * rows):   # sms // rows programs a row
        p = plan_on(monkeypatch, sms, len(lens), L, dtype)
        seen.add(p.decision.per_program)
        kernels.add(p.kernel)
        slots = p.decision.splits
        got.append(p.run(q, k, v, lens, return_lse=True))
    # per_program 1 compiles the ONE_CHUNK loop, per_program >= the most chunks a row has the ALONE one (no
    # partial stored, no ticket), the others neither; rows >= 2 waves of short rows: the persistent walk
    assert len(seen) >= 4 and 1 in seen and max(seen) >= slots and min(seen - {1}) < slots, (seen, slots)
    assert kernels == ({"invariant", "persistent"} if L <= plan_mod.WALK_L else {"invariant"}), kernels
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 1)
    for sms in (rows + 1, 2 * rows, 16 * rows):                 # fewer rows than SMs: the device share
        p = plan_on(monkeypatch, sms, len(lens), L, dtype)
        assert p.decision.share == sms and p.decision.per_program == 0, p.decision
        got.append(p.run(q, k, v, lens, return_lse=True))
    assert_attention_close(got[0][0], got[0][1], q, k, v, lens, what="batch-invariant kernel vs float64")
    for o, lse in got[1:]:
        assert torch.equal(o, got[0][0]) and torch.equal(lse, got[0][1])


def test_the_schedule_rules_of_a_gpu_plan(monkeypatch):
    """The batch-invariant schedule on an H200's tiles (128 keys, 132 SMs), decided on the host: about one wave of
    programs, one chunk a program where a row gets several and its chunks hold ONE_CHUNK_KEYS keys, and
    FEW_STAGES pipeline stages for one program a row over >= 2 waves of rows of at most FEW_STAGES_L keys."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    monkeypatch.setattr(plan_mod.runtime, "INTERPRET", False)       # the compiled tiles, on this machine's host
    monkeypatch.setattr(plan_mod, "sm_count", lambda: 132)
    decide = lambda B, H_kv, L: plan_mod.invariant_decision(B, 32, H_kv, 128, L, torch.float16)
    assert decide(4, 8, 8192).share == 0                  # the default: the host rule (the share is opt-in)
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 1)
    for B, H_kv in ((4, 8), (1, 8), (16, 8), (2, 32)):   # fewer rows than SMs: the device share (INVARIANT_SHARE)
        d = decide(B, H_kv, 8192)
        assert d.share == 132 and d.per_program == 0 and d.kernel == "invariant" and d.order == 0, d
    for B, H_kv in ((33, 4), (64, 32), (16, 32)):        # no fewer: the host rule
        assert decide(B, H_kv, 8192).share == 0
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 2)  # only where the host rule gives a row one program (ALONE)
    assert decide(16, 8, 8192).share == 132 and decide(9, 8, 8192).share == 132 and decide(8, 8, 8192).share == 0
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 0)  # the host rule below
    d = decide(4, 8, 8192)                   # 32 rows: 4 programs a row, chunks of 512 keys, 4 a program
    assert (d.per_program, d.splits, d.tile.BLOCK_N, d.tile.num_stages) == (4, 16, 128, 3), d
    d = decide(4, 8, 32768)                  # chunks of 2048 keys: one a program
    assert d.chunk == plan_mod.ONE_CHUNK_KEYS and d.per_program == 1, d
    d = decide(1, 8, 131072)                 # 8 rows: 16 programs a row, one chunk each anyway
    assert d.per_program == 1, d
    for B, H_kv, L, stages in ((64, 32, 512, plan_mod.FEW_STAGES), (64, 8, 2048, plan_mod.FEW_STAGES),
                               (16, 32, 512, plan_mod.FEW_STAGES), (64, 32, 8192, 3), (16, 8, 512, 3)):
        d = decide(B, H_kv, L)   # one program a row (ALONE); short rows of >= 264 rows: few stages, persistent walk
        assert d.per_program == d.splits and d.tile.num_stages == stages, (B, H_kv, L, d)
        walk = stages == plan_mod.FEW_STAGES and L <= plan_mod.WALK_L and B * H_kv <= 528   # <= 2 rows a program
        assert d.kernel == ("persistent" if walk else "invariant") and d.invariant, (B, H_kv, L, d)
        if walk:                             # two programs an SM, each walking its share of the rows
            assert d.programs == 256 and d.rows_per_program == 2, d


def test_invariant_waves_set_the_programs_a_row(monkeypatch):
    """INVARIANT_WAVES = W aims the schedule at W waves of programs: ⌊W·SMs / (B·H_kv)⌋ programs a row (at most a
    row's chunks), so rows fewer than the SMs get more than one program each (B=24 28:4: 96 rows of 132 SMs, one
    program a row at W = 1, the longest row alone); the bits are the schedule's business only
    (test_the_schedule_never_changes_the_bits)."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    monkeypatch.setattr(plan_mod.runtime, "INTERPRET", False)
    monkeypatch.setattr(plan_mod, "sm_count", lambda: 132)
    decide = lambda: plan_mod.invariant_decision(24, 28, 4, 128, 65536, torch.bfloat16)
    assert plan_mod.INVARIANT_WAVES == 1
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 1)
    assert decide().share == 132                               # the device share takes these rows (INVARIANT_SHARE)
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 0)        # the host rule
    d = decide()
    assert d.per_program >= d.splits, d                        # one program a row: every chunk (ALONE)
    for waves, programs in ((2, 2), (3, 4)):                   # ⌊264 / 96⌋ = 2, ⌊396 / 96⌋ = 4
        monkeypatch.setattr(plan_mod, "INVARIANT_WAVES", waves)
        d = decide()
        assert d.per_program == (1 if d.chunk >= plan_mod.ONE_CHUNK_KEYS else -(-d.splits // programs)), (waves, d)
        assert d.per_program < d.splits, (waves, d)            # several programs a row: partials and the ticket


@pytest.mark.parametrize("page", [0, 4])
def test_rows_launched_longest_first_never_change_the_bits(page, monkeypatch):
    """INVARIANT_ORDER = 1 (the default): a plan of one program a row launches its rows longest first (grid (H_kv, B, 1), place i
    running the i-th longest row, ordered on the device from the lengths: fdlib.kernels.tile.longest_first), and
    every sequence keeps the bits of b order, over a contiguous cache and pages; the plan's order hint, made from
    the lengths it was planned for, also holds when the call's lengths come in another order (each program then
    sorts them) or are fewer. Right against float64."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    q, k, v, lens = pool(9, torch.float32, seed=21)
    if page:
        n_pages = 9 * L_MAX // page
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(22))
        kp, vp = (t.reshape(n_pages, page, H_KV, D)[perm.argsort().to(t.device)] for t in (k, v))
        bt = perm.reshape(9, -1).to(torch.int32).to(DEVICE)
        extra = dict(block_table=bt)
    else:
        kp, vp, extra = k, v, {}

    def run(p, idx):
        kw = {n: t[idx] for n, t in extra.items()}
        if page:
            return p.run(q[idx], kp, vp, lens[idx], return_lse=True, **kw)
        return p.run(q[idx], kp[idx], vp[idx], lens[idx], return_lse=True)

    monkeypatch.setattr(plan_mod, "sm_count", lambda: 1)          # one program a row at every size
    monkeypatch.setattr(plan_mod, "INVARIANT_ORDER", 0)
    plain = plan_mod.plan(9, H_Q, H_KV, D, L_MAX, dtype=torch.float32, device=DEVICE, batch_invariant=True,
                          page_size=page or None)
    monkeypatch.setattr(plan_mod, "INVARIANT_ORDER", 1)
    ordered = plan_mod.plan(9, H_Q, H_KV, D, L_MAX, dtype=torch.float32, device=DEVICE, batch_invariant=True,
                            page_size=page or None, lengths=lens.tolist())
    assert plain.decision.order == 0 and ordered.decision.order == 16 and ordered.kernel == "invariant", \
        (plain.decision, ordered.decision)
    assert ordered.decision.per_program >= ordered.decision.splits
    assert "rows launched longest first" in str(ordered) and "longest first" not in str(plain)
    everyone = torch.arange(9)
    for idx in (everyone, everyone.flip(0), torch.tensor([4, 0, 8, 2]), torch.tensor([3])):
        want = run(plain, idx)
        got = run(ordered, idx)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), idx
        assert int(ordered.workspace.counters.count_nonzero()) == 0
    assert_attention_close(got[0], got[1], q[idx], k[idx], v[idx], lens[idx], what="longest first vs float64")


def test_rows_launch_longest_first_only_when_they_outnumber_the_sms(monkeypatch):
    """The default invariant plan orders its rows longest first only where B·H_kv rows of one program each exceed
    the SMs (some rows wait for an SM; the order decides which): with no more rows than SMs every row starts at
    once, and an H100 run took B=24 28:4 (96 rows, 132 SMs) from 1.46x to 1.71x the host plan when ordered."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    B, L = 9, 4096

    def order(sms):
        monkeypatch.setattr(plan_mod, "sm_count", lambda: sms)
        d = plan_mod.decide(B, H_Q, H_KV, D, L, torch.float16, batch_invariant=True)
        assert d.kernel == "invariant" and d.per_program >= d.splits, d   # one program a row
        return d.order

    assert order(B * H_KV - 1) == plan_mod.longest_first_order(B) > 0
    assert order(B * H_KV) == 0
    monkeypatch.setattr(plan_mod, "INVARIANT_ORDER", 0)
    assert order(B * H_KV - 1) == 0


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fewer_pipeline_stages_never_change_the_bits(dtype, monkeypatch):
    """Short rows of a large batch run at FEW_STAGES pipeline stages (one program a row, at least
    PERSISTENT_MIN_WAVES waves of rows, L <= FEW_STAGES_L): the same bits as the tiles' own stages, and right
    against float64. The SM count is pretended, so that a small batch takes either plan."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    L = plan_mod.FEW_STAGES_L
    q, k, v, lens = batch_of([L, 1, 0, 127, 128, 129, 1000, L - 1], L, dtype, seed=8)
    got, stages = [], []
    for sms in (1, len(lens) * H_KV):       # rows >= 2 waves of 1 SM: few stages; one wave of rows: the tiles' own
        p = plan_on(monkeypatch, sms, len(lens), L, dtype)
        assert p.decision.per_program >= p.decision.splits and p.kernel == "invariant", p   # ALONE in both
        stages.append(p.decision.tile.num_stages)
        got.append(p.run(q, k, v, lens, return_lse=True))
    assert stages[0] == plan_mod.FEW_STAGES and stages[1] != stages[0], stages
    assert_attention_close(got[0][0], got[0][1], q, k, v, lens, what="batch-invariant kernel, few stages, vs float64")
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_persistent_walk_never_changes_the_bits(dtype, monkeypatch):
    """Rows of at most WALK_L keys in a large batch (at least PERSISTENT_MIN_WAVES waves of rows, at most
    WALK_ROWS rows a program) are walked by the persistent kernel, which folds each row's chunks as they end, at
    FEW_STAGES pipeline stages: the same bits as one program a row at the tiles' own stages, and right against
    float64. The SM count is pretended, so that a small batch takes either plan."""
    import sys
    plan_mod = sys.modules["fdlib.plan"]
    L = plan_mod.WALK_L
    q, k, v, lens = batch_of([L, 1, 0, 127, 128, 129, 300, L - 1], L, dtype, seed=9)
    rows = len(lens) * H_KV
    got, kernels = [], []
    for sms in (rows // (plan_mod.WALK_ROWS * plan_mod.INVARIANT_PER_SM), rows):   # the walk; one wave of rows
        p = plan_on(monkeypatch, sms, len(lens), L, dtype)
        kernels.append(p.kernel)
        got.append(p.run(q, k, v, lens, return_lse=True))
    assert kernels == ["persistent", "invariant"], kernels
    assert_attention_close(got[0][0], got[0][1], q, k, v, lens, what="batch-invariant persistent walk vs float64")
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_several_query_tokens_are_invariant_too():
    q, k, v, lens = pool(5, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    q4 = torch.randn(5, 3, H_Q, D, generator=g).to(DEVICE)
    lens = lens.clamp(min=0)
    o_all, l_all = decode(q4, k, v, lens)
    from test_qlen import assert_close_qlen
    assert_close_qlen(o_all, l_all, q4, k, v, lens, what="batch-invariant q_len=3 vs float64")
    for i in (0, 3, 4):
        o1, l1 = decode(q4[i:i + 1], k[i:i + 1], v[i:i + 1], lens[i:i + 1])
        assert torch.equal(o1[0], o_all[i]) and torch.equal(l1[0], l_all[i])


def test_the_walk_of_several_query_tokens_never_changes_the_bits(monkeypatch):
    """Several query tokens (q_len = 3, each row stopping at its causal limit) in the persistent walk of short
    rows: the bits of one program a row, and right against float64."""
    q, k, v, lens = pool(6, torch.float32, seed=10)
    q3 = torch.randn(6, 3, H_Q, D, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    rows = 6 * H_KV
    got, kernels = [], []
    for sms in (rows // 2, 100 * rows):         # rows = 2 waves of 2 a program (interpreter: 1 an SM); one wave
        p = plan_on(monkeypatch, sms, 6, L_MAX, torch.float32, q_len=3)
        kernels.append(p.kernel)
        got.append(p.run(q3, k, v, lens, return_lse=True))
    assert kernels == ["persistent", "invariant"], kernels
    from test_qlen import assert_close_qlen
    assert_close_qlen(got[0][0], got[0][1], q3, k, v, lens, what="batch-invariant walk, q_len=3, vs float64")
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def paged(k, v, page):
    """K/V [B, L, H_kv, D] as pages of ``page`` keys in reverse order, and the block table."""
    B, L = k.shape[:2]
    n = B * L // page
    pages_k, pages_v = (t.reshape(n, page, H_KV, D)[torch.arange(n).flip(0)] for t in (k, v))
    return pages_k, pages_v, (n - 1 - torch.arange(n, device=DEVICE)).reshape(B, -1).to(torch.int32)


@pytest.mark.parametrize("page", [0, 4, 16])
def test_the_device_share_keeps_each_sequence_bitwise_itself(page, monkeypatch):
    """Fewer rows than SMs (INVARIANT_SHARE): each program takes its row's chunks a program from the lengths on
    the device (fdlib.kernels.invariant.device_share), which change with the batchmates (a long row's programs
    with the batch's tiles), never the bits: a sequence's out and lse are the same alone and in ragged batches of
    several sizes, rows of 0 and 1 keys and one much longer than the rest among them, over a contiguous cache and
    pages of 4 and 16; and right against float64."""
    share_on(monkeypatch)
    from fdlib.kernels.invariant import device_share
    block_n = fdlib.plan(1, H_Q, H_KV, D, 64, dtype=torch.float32, device=DEVICE,
                         batch_invariant=True).decision.tile.BLOCK_N
    L = 20 * block_n
    lens = [L, 0, 1, block_n + 3, 15 * block_n, 2]
    q, k, v, lens_t = batch_of(lens, L, torch.float32, seed=31)
    sms = 16                                            # 2..12 rows: fewer than the SMs, the device share

    def run(idx):
        p = plan_on(monkeypatch, sms, len(idx), L, torch.float32, page_size=page or None)
        assert p.decision.share == sms and "chosen on the device" in str(p), p
        if page:
            kp, vp, bt = paged(k[idx], v[idx], page)
            return p.run(q[idx], kp, vp, lens_t[idx], block_table=bt, return_lse=True)
        return p.run(q[idx], k[idx], v[idx], lens_t[idx], return_lse=True)

    everyone = list(range(len(lens)))
    o_all, l_all = run(everyone)
    assert_attention_close(o_all, l_all, q, k, v, lens_t, what=f"device share, pages of {page}")
    batches = ([0], [1], [2], [0, 3], [4, 0, 1]) if not page else ([0], [5, 0])
    schedules = {tuple(device_share([lens[i] for i in everyone], H_KV, block_n, sms))[0]}
    for idx in batches:
        schedules.add(device_share([lens[i] for i in idx], H_KV, block_n, sms)[idx.index(0)] if 0 in idx else None)
        o, lse = run(idx)
        for pos, i in enumerate(idx):
            assert torch.equal(o[pos], o_all[i]) and torch.equal(lse[pos], l_all[i]), (idx, i)
    assert len(schedules - {None}) >= 2, schedules       # the long row's programs changed with its batchmates


@triton.jit
def share_probe(LENS, OUT, FLAG, n_batch, H_KV, sms, L_MAX, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                CHUNKS: tl.constexpr, MIN_TILES: tl.constexpr):
    """Program i writes what the device share gives it (fdlib.kernels.invariant.row_share): (b, p, L, k, n)."""
    i = tl.program_id(0)
    b, p, L, k, n = row_share(LENS, n_batch, i, H_KV, sms, L_MAX, FLAG, BLOCK_B, BLOCK_N, CHUNKS, MIN_TILES)
    j = tl.arange(0, 8)
    tl.store(OUT + 5 * i + j, tl.where(j == 0, b, tl.where(j == 1, p, tl.where(j == 2, L, tl.where(j == 3, k, n)))),
             mask=j < 5)


def test_the_kernel_chooses_the_device_share_of_the_model(monkeypatch):
    """The kernel's row_share (each program's row, place, chunks a program and the row's programs, from the lengths
    on the device) against the Python model fdlib.kernels.invariant.device_share on ragged batches; the programs of
    a head never exceed the shapes' bound share_programs, and past the last row's programs a program has no row.
    And the SHARE kernel's rows: given the model's programs of rows 0..b, it finishes those rows and no other."""
    share_on(monkeypatch)
    from fdlib.kernels import invariant as inv

    g = torch.Generator().manual_seed(41)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for trial in range(12):
        B = int(torch.randint(1, 20, (1,), generator=g))
        H_kv, block_n, sms = (1, 2, 8)[trial % 3], (16, 128)[trial % 2], int(torch.randint(2, 140, (1,), generator=g))
        L_max = int(torch.randint(1, 40, (1,), generator=g)) * block_n
        lens = torch.randint(0, L_max + 1, (B,), generator=g)
        if trial % 4 == 0:
            lens[0] = L_max                              # one row much longer than the rest
            lens[1:] = lens[1:] // 16
        want = inv.device_share(lens.tolist(), H_kv, block_n, sms)
        P = inv.share_programs(B, H_kv, sms, inv.max_chunks(L_max, block_n))
        assert sum(n for _, n in want) <= P, (lens, want, P)
        out = torch.full((P + 3, 5), -7, dtype=torch.int32, device=DEVICE)
        share_probe[(P + 3,)](lens.to(torch.int32).to(DEVICE), out, flag, B, H_kv, sms, L_max,
                        BLOCK_B=max(16, triton.next_power_of_2(B)), BLOCK_N=block_n, CHUNKS=inv.CHUNKS,
                        MIN_TILES=inv.MIN_TILES)
        rows = [(b, p, int(lens[b]), k, n) for b, (k, n) in enumerate(want) for p in range(n)]
        got = [tuple(r) for r in out.tolist()]
        assert got[:len(rows)] == rows, (trial, lens, got[:len(rows)], rows)
        assert all(r[0] == B and r[4] == 0 for r in got[len(rows):]), (trial, got[len(rows):])
    # the SHARE kernel itself: launched with the programs of rows 0..b only (the model's running sum E_b), it
    # finishes exactly those rows, so its rows' program counts are the model's
    from fdlib.kernels.unified import unified_args
    block_n = fdlib.plan(1, H_Q, H_KV, D, 64, dtype=torch.float32, device=DEVICE,
                         batch_invariant=True).decision.tile.BLOCK_N
    L = 20 * block_n
    lens = [L, 3 * block_n, 1, 17 * block_n, 0]
    q, k, v, lens_t = batch_of(lens, L, torch.float32, seed=42)
    p = plan_on(monkeypatch, 12, len(lens), L, torch.float32)
    want = inv.device_share(lens, H_KV, block_n, 12)
    assert max(n for _, n in want) > 1 and min(n for _, n in want) == 1, want
    ws, ends = p.workspace, torch.tensor([n for _, n in want]).cumsum(0).tolist()
    for b, E in enumerate(ends):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:-1], float("nan"), device=DEVICE)
        ws.counters.zero_()
        grid, ptrs, scalars = unified_args(q, k, v, lens_t, p.scale, 1, p.decision.splits, out, lse, ws.o_part,
                                           ws.lse_part, ws.counters, ws.flag)
        p._launchers[0]((H_KV, E, 1), ptrs, (*scalars, len(lens), 12))
        done = ~torch.isnan(lse).any(-1)
        assert done.tolist() == [i <= b for i in range(len(lens))], (b, E, want, done)
    assert_attention_close(out, lse, q, k, v, lens_t, what="device share vs float64")


def test_the_device_share_plan_launches_a_grid_of_the_shapes(monkeypatch):
    """The device share's launch depends on the shapes alone (nothing read on the host): H_kv·share_programs(B)
    programs whatever the lengths, so a captured graph replays it; with INVARIANT_SHARE = 0 the host's rule."""
    share_on(monkeypatch)
    import sys
    from fdlib.kernels.invariant import max_chunks, share_programs
    plan_mod = sys.modules["fdlib.plan"]
    p = plan_on(monkeypatch, 40, 3, L_MAX, torch.float32)
    d = p.decision
    assert d.share == 40 and p.timeline_programs() == H_KV * share_programs(3, H_KV, 40, d.splits)
    assert share_programs(3, H_KV, 40, max_chunks(L_MAX, d.tile.BLOCK_N)) == min(3 * d.splits, 20 + 2)
    monkeypatch.setattr(plan_mod, "INVARIANT_SHARE", 0)
    d = plan_on(monkeypatch, 40, 3, L_MAX, torch.float32).decision
    assert d.share == 0 and d.per_program >= 1, d


def test_the_documented_device_shares_are_the_models():
    """The table of device_share's docstring (128-key tiles, 132 SMs), recomputed: equal rows as the host's rule
    but B=4 L=32768 (4 programs of 4 chunks, not 16 of one), the long row of B=8 in 8 programs and its short rows
    whole, the longest rows of B=24 28:4 in 3."""
    from fdlib.kernels.invariant import device_share
    share = lambda lens, H_kv: device_share(lens, H_kv, 128, 132)
    assert set(share([8192] * 16, 8)) == {(16, 1)}
    assert set(share([8192] * 4, 8)) == {(4, 4)}
    assert set(share([32768] * 4, 8)) == {(4, 4)}
    assert share([131072], 8) == [(1, 16)]
    assert share([131072] + [2048] * 7, 8) == [(2, 8)] + [(16, 1)] * 7
    lens = [65536 * (b + 1) // 24 for b in range(24)]
    got = dict(zip(lens, share(lens, 4)))
    assert got[65536] == (7, 3) and {n for L, (k, n) in got.items() if L <= 24576} == {1}
    assert {n for L, (k, n) in got.items() if 27306 <= L <= 54613} == {2}
    assert {n for L, (k, n) in got.items() if L >= 57344} == {3}


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_device_share_replays_a_captured_graph_with_ragged_lengths(monkeypatch):
    """A batch-invariant plan of fewer rows than SMs (B=8 32:8), captured while every row is L_max and replayed
    after ragged lengths are written into the same tensor, contiguous and over pages of 16: the device share of
    the new lengths, right against float64 (test_worklist.captured_replays). B=8 32:8 has 64 rows, which the
    default share (2) leaves to the host rule: the share is switched on for every plan of fewer rows than SMs."""
    from test_worklist import captured_replays
    share_on(monkeypatch)
    assert [p.decision.share > 0 for p, _ in captured_replays(batch_invariant=True)] == [True, True]
