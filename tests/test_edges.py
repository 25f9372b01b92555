"""Edges of fdlib's call surface (interpreter or GPU): torch.compile keeps every option and takes pages;
check_lengths=True checks the block table in the same single read; fdlib.clamped() reads the clamp flag; the checks
hold on a cached plan; plan.run's outputs and table are keyword-only; errors name the argument; lengths in a CPU
tensor are checked like a list on the CPU; streamk refuses num_splits as persistent does; naive flags what the
kernels flag. The cross-rank check of decode_attention_cp is in test_distributed.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fdlib
import fdlib.api
from helpers import DEVICE, assert_attention_close, make_problem
from test_paged import paged_problem


def compiled(fn):
    """fn compiled whole (no graph break); aot_eager keeps the CPU test quick and runs the op's fake while tracing."""
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def pool_problem(lens=(13, 9), seed=3):
    """B=2, pages of 4, 4 entries a sequence, a pool of 8 pages (no page shared), -1 past each length."""
    return paged_problem(torch.Generator().manual_seed(seed), 2, 4, 2, 16, 4, 4, 8, list(lens), share=False)


class _HostReads:
    """Counts reads of a tensor's values on the host (int(), .item(), .tolist(), bool(), .cpu(), ...)."""
    NAMES = ("__int__", "__index__", "__bool__", "__float__", "item", "tolist", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.n, self.on = 0, False
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))

    def _wrap(self, orig):
        reads = self

        def method(self, *a, **k):
            reads.n += reads.on
            return orig(self, *a, **k)
        return method


# --------------------------------------------------------------------------------- torch.compile
def test_compiled_call_is_batch_invariant_like_the_eager_one():
    """batch_invariant=True under torch.compile: the eager invariant bits, and a sequence alone gives the same
    bits as in the batch (the default mode's bits differ at this shape: rows of four of the invariant plan's tiles,
    which it cuts into four chunks, where the default call's plan cuts them otherwise (in the interpreter two splits
    of 32 keys); the invariant tiles are 16 keys in the interpreter, larger on a GPU)."""
    N = fdlib.plan(3, 4, 2, 16, 64, dtype=torch.float32, device=DEVICE, batch_invariant=True).decision.tile.BLOCK_N
    L = 4 * N
    q, k, v, lens = make_problem(3, L, 4, 2, 16, torch.float32, seed=31, lens=[L, 23 * L // 64, 40 * L // 64])

    def step(q, k, v, lens):
        return fdlib.decode_attention(q, k, v, lens, batch_invariant=True, return_lse=True)

    out, lse = compiled(step)(q, k, v, lens)
    want_out, want_lse = step(q, k, v, lens)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    default_out = fdlib.decode_attention(q, k, v, lens)
    assert not torch.equal(default_out, want_out), "this shape must tell the two modes apart"
    alone_out, alone_lse = compiled(step)(q[1:2], k[1:2], v[1:2], lens[1:2])
    assert torch.equal(alone_out[0], out[1]) and torch.equal(alone_lse[0], lse[1])
    assert_attention_close(out, lse, q, k, v, lens, what="compiled, batch-invariant")


def test_compiled_call_checks_lengths_and_the_table():
    """check_lengths=True under torch.compile: a length of 33 at L_max=32 raises ValueError naming cache_seqlens;
    over pages, a used table entry outside the pool raises naming block_table, and without check_lengths the
    compiled call clamps it and fdlib.clamped() says so."""
    q, k, v, _ = make_problem(2, 32, 4, 2, 16, torch.float32, seed=5)
    bad = torch.tensor([33, 5], dtype=torch.int32, device=DEVICE)
    checked = compiled(lambda q, k, v, lens: fdlib.decode_attention(q, k, v, lens, check_lengths=True))
    with pytest.raises(ValueError, match="cache_seqlens: .*<= .*32"):
        checked(q, k, v, bad)
    q, kp, vp, bt, k, v, lens = pool_problem()
    bt[1, 0] = 999
    paged_checked = compiled(lambda q, kp, vp, lens, bt: fdlib.decode_attention(q, kp, vp, lens, block_table=bt,
                                                                               check_lengths=True))
    with pytest.raises(ValueError, match=r"block_table: .*\[1, 0\] = 999"):
        paged_checked(q, kp, vp, lens, bt)
    fdlib.clamped()
    paged = compiled(lambda q, kp, vp, lens, bt: fdlib.decode_attention(q, kp, vp, lens, block_table=bt))
    out = paged(q, kp, vp, lens, bt)
    assert fdlib.clamped() is True
    k[1, :4], v[1, :4] = kp[7], vp[7]          # sequence 1's first page read as the pool's last, 7
    assert_attention_close(out, None, q, k, v, lens, what="compiled, clamped page index")


def test_compiled_call_checks_its_options_as_the_eager_one():
    """Options the op's schema would coerce (check_lengths=1, scale=True, num_splits=True) are refused by name
    under torch.compile too, with the eager call's type (every bad argument: test_compile_contract.py)."""
    q, k, v, lens = make_problem(2, 32, 4, 2, 16, torch.float32, seed=5, lens=[32, 3])
    for kw, exc, msg in ((dict(check_lengths=1), TypeError, "check_lengths: expected a bool"),
                         (dict(scale=True), TypeError, "scale: expected"),
                         (dict(num_splits=True), TypeError, "num_splits: expected an int"),
                         (dict(method="streamk", num_splits=8), ValueError, "num_splits: method='streamk'")):
        torch._dynamo.reset()
        with pytest.raises(exc, match=msg):
            compiled(lambda q, k, v, lens: fdlib.decode_attention(q, k, v, lens, **kw))(q, k, v, lens)


def test_compiled_call_takes_a_block_table():
    """torch.compile(fullgraph=True) of a step over a paged cache: out and lse match float64, for every method."""
    q, kp, vp, bt, k, v, lens = pool_problem(lens=(16, 7))
    for method in ("auto", "split", "balanced", "naive", "unified_max"):
        step = compiled(lambda q, kp, vp, lens, bt, m=method: fdlib.decode_attention(
            q, kp, vp, lens, block_table=bt, method=m, return_lse=True))
        out, lse = step(q, kp, vp, lens, bt)
        assert_attention_close(out, lse, q, k, v, lens, what=f"compiled over pages, {method}")


# ---------------------------------------------------------------------- the block table and the flag
def test_check_lengths_checks_the_block_table_entries_a_length_reaches():
    """With pages of 4: length 13 reaches entries 0..3, length 9 entries 0..2. An entry it reaches outside
    0..7 (999, -1, 8) raises ValueError naming block_table, the sequence, the entry, its value and the pool;
    anything past a length (-1, 999) is accepted; without lengths every entry is reached."""
    q, kp, vp, bt, k, v, lens = pool_problem()
    for (b, j), val in (((1, 0), 999), ((0, 3), -1), ((1, 2), 8)):
        bad = bt.clone()
        bad[b, j] = val
        with pytest.raises(ValueError) as info:
            fdlib.decode_attention(q, kp, vp, lens, block_table=bad, check_lengths=True)
        msg = str(info.value)
        for part in ("block_table", f"sequence {b}", f"[{b}, {j}] = {val}", "8 pages", "0..7"):
            assert part in msg, (part, msg)
    past = bt.clone()
    past[1, 3] = 999                         # past sequence 1's length (9 keys: entries 0..2)
    out = fdlib.decode_attention(q, kp, vp, lens, block_table=past, check_lengths=True)
    assert_attention_close(out, None, q, k, v, lens, what="entries past the length are not checked")
    with pytest.raises(ValueError, match=r"block_table: .*\[1, 3\] = 999"):
        fdlib.decode_attention(q, kp, vp, None, block_table=past, check_lengths=True)
    with pytest.raises(ValueError, match=r"block_table: .*\[1, 3\] = 999"):
        fdlib.decode_attention(q, kp, vp, [13, 16], block_table=past, check_lengths=True)


def test_check_lengths_reads_lengths_and_table_in_one_read(monkeypatch):
    """check_lengths=True over pages reads the device once, whether it passes or raises; the default call
    reads nothing. (No lengths: every entry is reached; on the CPU a tensor of lengths is read as a list is.)"""
    q, kp, vp, bt, k, v, lens = pool_problem()
    bt[bt < 0] = 0
    reads = _HostReads(monkeypatch)
    fdlib.decode_attention(q, kp, vp, None, block_table=bt)         # the plan is made before counting
    reads.on = True
    fdlib.decode_attention(q, kp, vp, None, block_table=bt)
    assert reads.n == 0
    fdlib.decode_attention(q, kp, vp, None, block_table=bt, check_lengths=True)
    assert reads.n == 1
    bt[0, 2] = 8
    with pytest.raises(ValueError, match=r"block_table: sequence 0 reads entry \[0, 2\] = 8"):
        fdlib.decode_attention(q, kp, vp, None, block_table=bt, check_lengths=True)
    assert reads.n == 2


def test_clamp_flag_is_public_and_outlives_the_plan_cache(monkeypatch):
    """fdlib.clamped() says whether a decode_attention call clamped a page index (or a device length) since the
    last check, then resets; the flag is read only when asked, and survives the plan being dropped from the
    cache."""
    q, kp, vp, bt, k, v, lens = pool_problem()
    fdlib.clamped()
    fdlib.decode_attention(q, kp, vp, lens, block_table=bt)
    assert fdlib.clamped() is False
    bt[1, 0] = 999
    reads = _HostReads(monkeypatch)
    reads.on = True
    fdlib.decode_attention(q, kp, vp, None, block_table=bt)
    reads.on = False
    assert reads.n == 0
    q2, k2, v2, lens2 = make_problem(2, 8, 2, 1, 8, torch.float32, seed=1, lens=[8, 3])
    for i in range(fdlib.api.PLAN_CACHE_SIZE + 1):                 # every plan of the bad call dropped
        fdlib.decode_attention(q2, k2, v2, lens2, scale=0.1 + i / 1000, method="naive")
    assert fdlib.clamped() is True and fdlib.clamped() is False
    assert fdlib.clamped(reset=False) is False


# ---------------------------------------------------------------------------- checks and errors
def test_checks_hold_on_a_cached_plan():
    """A value accepted once does not let an invalid one of an equal hash through later (True == 1 == 1.0)."""
    q, k, v, lens = make_problem(2, 20, 4, 2, 16, torch.float32, seed=2, lens=[20, 7])
    for name, good, bad, err in (("scale", 1.0, True, TypeError), ("num_splits", 1, True, TypeError),
                                 ("batch_invariant", False, 0, TypeError), ("max_seqlen", 5, 5.0, TypeError),
                                 ("max_seqlen", 5, np.int64(5), TypeError)):
        fdlib.decode_attention(q, k, v, lens, **{name: good})
        with pytest.raises(err, match=name):
            fdlib.decode_attention(q, k, v, lens, **{name: bad})


def test_run_takes_out_lse_and_block_table_by_keyword_only():
    q, kp, vp, bt, k, v, lens = pool_problem()
    p = fdlib.plan(2, 4, 2, 16, 16, dtype=torch.float32, device=DEVICE, page_size=4)
    with pytest.raises(TypeError, match="positional argument"):
        p.run(q, kp, vp, lens, bt)
    out = torch.empty_like(q)
    assert p.run(q, kp, vp, lens, out=out, block_table=bt) is out
    assert_attention_close(out, None, q, k, v, lens, what="keywords")
    p2 = fdlib.plan(2, 4, 2, 16, 16, dtype=torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="positional argument"):
        p2.run(q, k, v, lens, out)


def test_plan_errors_name_lengths():
    for bad, err, part in (([40, 1, 1], ValueError, "<= the cache's L_max=37"), ([3, 1], ValueError, "expected 3"),
                           ("37,1,1", TypeError, "expected"), (torch.tensor([1.0, 2.0, 3.0]), TypeError, "dtype")):
        with pytest.raises(err, match=f"^lengths: .*{part}"):
            fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, lengths=bad)


@pytest.mark.parametrize("bad", [np.int64(5), torch.tensor(5), 5.0, True])
def test_max_seqlen_of_another_type_is_a_type_error(bad):
    q, k, v, lens = make_problem(2, 20, 4, 2, 16, torch.float32, seed=2, lens=[20, 7])
    with pytest.raises(TypeError, match="^max_seqlen: expected an int"):
        fdlib.plan(2, 4, 2, 16, 20, dtype=torch.float32, device=DEVICE, max_seqlen=bad)
    with pytest.raises(TypeError, match="^max_seqlen: expected an int"):
        fdlib.decode_attention(q, k, v, lens, max_seqlen=bad)
    with pytest.raises(ValueError, match="^max_seqlen: expected an int in 0..L_max=20, got 21"):
        fdlib.plan(2, 4, 2, 16, 20, dtype=torch.float32, device=DEVICE, max_seqlen=21)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_plan_on_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="^device: 'cuda'.*no CUDA"):
        fdlib.plan(2, 4, 2, 16, 20, device="cuda")
    with pytest.raises(ValueError, match="^device: "):
        fdlib.plan(2, 4, 2, 16, 20, device="tpu:7")


def test_a_pool_of_no_pages_says_so():
    q, kp, vp, bt, k, v, lens = pool_problem()
    with pytest.raises(ValueError, match=r"^k_cache: the page pool holds no page \(shape \[0, 4, 2, 16\]\)"):
        fdlib.decode_attention(q, kp[:0], vp[:0], lens, block_table=bt)
    p = fdlib.plan(2, 4, 2, 16, 16, dtype=torch.float32, device=DEVICE, page_size=4)
    with pytest.raises(ValueError, match=r"^k_cache: the page pool holds no page"):
        p.run(q, kp[:0], vp[:0], lens, block_table=bt)
    with pytest.raises(ValueError, match=r"^v_cache: expected the shape of k_cache"):
        fdlib.decode_attention(q, kp, vp[:0], lens, block_table=bt)


def test_lengths_in_a_cpu_tensor_are_checked_like_a_list():
    """On the CPU a tensor of lengths costs nothing to read, so it is checked on every call as a list is
    (ValueError naming cache_seqlens), also by a call replayed from an earlier one and after a change in place;
    on a GPU a CPU tensor is host lengths, checked the same way."""
    q, k, v, lens = make_problem(3, 37, 6, 2, 16, torch.float32, seed=0, lens=[37, 16, 1])
    p = fdlib.plan(3, 6, 2, 16, 37, dtype=torch.float32, device=DEVICE)
    for bad in ([50, -3, 5], torch.tensor([50, -3, 5], dtype=torch.int32), torch.tensor([0, 38, 5])):
        with pytest.raises(ValueError, match="^cache_seqlens: lengths must be"):
            p.run(q, k, v, bad)
        with pytest.raises(ValueError, match="^cache_seqlens: lengths must be"):
            fdlib.decode_attention(q, k, v, bad)
        with pytest.raises(ValueError, match="^cache_seqlens: lengths must be"):
            fdlib.decode_attention(q, k, v, bad, method="unified_max")
    host = torch.tensor([37, 16, 1], dtype=torch.int32)
    for _ in range(2):                                  # checked, then laid out like the checked call
        assert_attention_close(p.run(q, k, v, host), None, q, k, v, lens, what="CPU tensor lengths")
    host[1] = 38
    with pytest.raises(ValueError, match="^cache_seqlens: lengths must be <= the cache's L_max=37, got a maximum "
                                         "of 38"):
        p.run(q, k, v, host)


def test_streamk_refuses_num_splits_as_persistent_does():
    q, k, v, lens = make_problem(2, 20, 4, 2, 16, torch.float32, seed=2, lens=[20, 7])
    for method in ("persistent", "streamk"):
        with pytest.raises(ValueError, match=f"^num_splits: method='{method}' .* got 8"):
            fdlib.plan(2, 4, 2, 16, 20, dtype=torch.float32, device=DEVICE, method=method, num_splits=8)
        with pytest.raises(ValueError, match=f"^num_splits: method='{method}' .* got 8"):
            fdlib.decode_attention(q, k, v, lens, method=method, num_splits=8)
        out = fdlib.decode_attention(q, k, v, lens, method=method, num_splits=1)
        assert_attention_close(out, None, q, k, v, lens, what=f"{method}, num_splits=1")


@pytest.mark.parametrize("method", ["naive", "unified", "streamk"])
def test_unused_table_entries_raise_no_flag_in_any_method(method):
    """-1 (or 999) past a sequence's length is never read, and no method raises the flag for it; a used entry
    outside the pool does, in every method."""
    q, kp, vp, bt, k, v, lens = pool_problem(lens=(13, 5))
    p = fdlib.plan(2, 4, 2, 16, 16, dtype=torch.float32, device=DEVICE, page_size=4, method=method)
    assert bt[1, 2] == -1 and bt[1, 3] == -1
    bt[1, 3] = 999
    out = p.run(q, kp, vp, lens, block_table=bt)
    assert_attention_close(out, None, q, k, v, lens, what=f"{method}, unused entries")
    assert p.clamped() is False
    bt[1, 1] = -1                                        # used by sequence 1 (keys 4..5)
    p.run(q, kp, vp, lens, block_table=bt)
    assert p.clamped() is True
