"""plan.run's replay of a checked call (fdlib.kernels.launch.record / replay).

A call laid out like an earlier checked one skips the checks and the argument building and launches the
compiled kernel with the new tensors' addresses. On the CPU there is no compiled kernel, so these tests stand in
for Triton's C launcher: the kernel still runs in the interpreter on the checked path (its results are checked
against float64), and the stand-in notes the integers a direct launch is given. Every noted launch must carry
exactly the pointers and scalars the checked path computes for that call's own tensors. The GPU tests
(test_gpu.py) run the same sequences of calls on compiled kernels and check the results.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fdlib
from fdlib.kernels import launch
from fdlib.kernels.unified import unified_args
from helpers import DEVICE, INTERPRET, assert_attention_close, make_problem


# the stand-in launcher needs the interpreter's kernels; a GPU runs the real direct launches instead
# (test_plan.py::test_calls_of_changing_layouts_and_fresh_tensors)
pytestmark = pytest.mark.skipif(not INTERPRET, reason="stands in for the C launcher; on a GPU see test_plan.py")


class _Compiled:
    """What a compiled Triton kernel offers the Launcher: here, a launch that notes its arguments."""


@pytest.fixture
def direct(monkeypatch):
    """Direct launches without a GPU: FAST_LAUNCH on, no hook, stream 0; the first launch of a specialisation
    runs the kernel in the interpreter (the checked path) and leaves a stand-in launch that notes its
    arguments. Returns the list of noted launches: (grid, pointer addresses, scalars and constexprs)."""
    noted = []

    def direct_of(compiled):
        def c_launch(g0, g1, g2, stream, function, *rest):
            noted.append(((g0, g1, g2), rest))
        return c_launch, "function", ()

    real_call = launch.Launcher.__call__

    def call(self, grid, ptrs, scalars):
        before = dict(self._compiled)
        out = real_call(self, grid, ptrs, scalars)
        if self._compiled == before and launch.FAST_LAUNCH and not any(t.data_ptr() & 15 for t in ptrs):
            names = self.kernel.arg_names[len(ptrs) + len(scalars):]
            self._compiled[self._key(ptrs, scalars)] = (*direct_of(None), tuple(self.meta[n] for n in names))
        return out

    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(launch, "_RUNTIME", SimpleNamespace(launch_enter_hook=None))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(launch.Launcher, "__call__", call)
    return noted


def expected(p, q, k, v, lens, out, lse):
    """(grid, addresses + scalars) that the checked path gives the unified kernel for these tensors."""
    d, ws = p.decision, p.workspace
    grid, ptrs, scalars = unified_args(q, k, v, lens, p.scale, d.chunk, d.splits, out, lse, ws.o_part, ws.lse_part,
                                       ws.counters, ws.flag)
    go = p._launchers[0]
    names = go.kernel.arg_names[len(ptrs) + len(scalars):]
    return tuple(grid), (*[t.data_ptr() for t in ptrs], *scalars, *[go.meta[n] for n in names])


def problem(seed, B=3, L=40):
    return make_problem(B, L, 4, 2, 32, torch.float32, seed=seed, lens=[L, 17, 1][:B])


def test_same_layout_is_replayed_with_the_new_tensors(direct):
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2)
    q, k, v, lens = problem(0)
    out, lse = p.run(q, k, v, lens, return_lse=True)     # checked: the interpreter computes, a launch is kept
    assert_attention_close(out, lse, q, k, v, lens, what="checked call")
    assert not direct and len(p._replays) == 1
    for seed in (1, 2):
        q2, k2, v2, lens2 = problem(seed)
        out2, lse2 = p.run(q2, k2, v2, lens2, return_lse=True)
        assert out2.data_ptr() != out.data_ptr() and lse2.shape == (3, 4)
        assert direct[-1] == expected(p, q2, k2, v2, lens2, out2, lse2)
    assert len(direct) == 2


def test_out_lse_and_default_lengths_are_roles_and_their_absence_is_part_of_the_layout(direct):
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2)
    ws = p.workspace
    q, k, v, lens = problem(0)
    for _ in range(2):                                    # out given, lse not asked: the plan's lse buffer
        out = torch.empty_like(q)
        assert p.run(q, k, v, lens, out=out) is out
    assert direct[-1] == expected(p, q, k, v, lens, out, ws.lse)
    for _ in range(2):                                    # no lengths: the plan's full lengths
        got = p.run(q, k, v)
    assert direct[-1] == expected(p, q, k, v, ws.full_lengths, got, ws.lse)
    lse = torch.empty(3, 4, dtype=torch.float32, device=DEVICE)
    for _ in range(2):                                    # lse given: written in place
        got, got_lse = p.run(q, k, v, lens, lse=lse)
        assert got_lse is lse
    assert direct[-1] == expected(p, q, k, v, lens, got, lse)
    assert len(p._replays) == 3


def test_a_replayed_call_on_the_cpu_still_checks_its_lengths(direct):
    """On the CPU a tensor of lengths is on the host and checked on every call as a list is: a call replayed from
    a checked one checks it too, so a length changed in place to one outside 0..L_max raises, not clamps."""
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2)
    q, k, v, lens = problem(0)
    p.run(q, k, v, lens)
    p.run(q, k, v, lens)
    n = len(direct)
    assert n == 1 and len(p._replays) == 1
    lens[1] = 41
    with pytest.raises(ValueError, match="cache_seqlens: lengths must be <= the cache's L_max=40, got a maximum of 41"):
        p.run(q, k, v, lens)
    lens[1] = -1
    with pytest.raises(ValueError, match="cache_seqlens: lengths must be >= 0, got a minimum of -1"):
        p.run(q, k, v, lens)
    assert len(direct) == n


def test_a_new_layout_is_checked_first(direct):
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2)
    q, k, v, lens = problem(0)
    p.run(q, k, v, lens)
    p.run(q, k, v, lens)
    n = len(direct)
    wide = torch.zeros(3, 4, 64, dtype=torch.float32, device=DEVICE)
    wide[..., :32] = q
    qs = wide[..., :32]                                   # strided q: other scalars, checked and computed again
    out, lse = p.run(qs, k, v, lens, return_lse=True)
    assert len(direct) == n
    assert_attention_close(out, lse, q, k, v, lens, what="strided q")
    got, got_lse = p.run(qs, k, v, lens, return_lse=True)   # the strided layout, now replayed
    assert len(direct) == n + 1 and direct[-1] == expected(p, qs, k, v, lens, got, got_lse)
    with pytest.raises(TypeError, match="q: this plan runs float32, got float16"):
        p.run(q.half(), k, v, lens)                       # a layout never checked: the error, not a replay
    q2, k2, v2, lens2 = problem(3, B=2)
    out2, lse2 = p.run(q2, k2, v2, lens2, return_lse=True)   # two live sequences of three: its own layout
    assert_attention_close(out2, lse2, q2, k2, v2, lens2, what="B'=2")


def test_aliased_tensors_are_never_recorded(direct):
    """k passed as v: a later call with distinct k and v, laid out alike, must not reuse k's address for v."""
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2)
    q, k, v, lens = problem(0)
    p.run(q, k, k, lens)
    p.run(q, k, k, lens)
    assert not p._replays
    out, lse = p.run(q, k, v, lens, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what="k and v distinct after an aliased call")


def test_misaligned_pointers_and_launch_hooks_take_the_checked_path(direct, monkeypatch):
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2)
    q, k, v, lens = problem(0)
    p.run(q, k, v, lens)
    p.run(q, k, v, lens)
    n = len(direct)
    flat = torch.zeros(q.numel() + 1, dtype=torch.float32, device=DEVICE)
    flat[1:] = q.reshape(-1)
    q_off = flat[1:].view(3, 4, 32)                       # 4 bytes past a 16-byte boundary, same layout as q
    out, lse = p.run(q_off, k, v, lens, return_lse=True)
    assert len(direct) == n
    assert_attention_close(out, lse, q, k, v, lens, what="misaligned q")
    monkeypatch.setattr(launch, "_RUNTIME", SimpleNamespace(launch_enter_hook=lambda *a: None))
    out, lse = p.run(q, k, v, lens, return_lse=True)      # a profiler's hook sees every launch
    assert len(direct) == n
    assert_attention_close(out, lse, q, k, v, lens, what="with a launch hook")


def test_record_refuses_pointers_made_for_the_call():
    """A pointer that is neither a role nor a workspace tensor (a view or copy made inside the call) makes the
    call unrecordable, so nothing is replayed for it."""
    t = torch.zeros(4)

    class Go:
        def entry(self, ptrs, scalars):
            return ("launch", "function", (), ())
    assert launch.record([(Go(), ((1,), (t,), ()))], (t,), ()) is not None
    assert launch.record([(Go(), ((1,), (t[:2],), ()))], (t,), ()) is None
    assert launch.record([(Go(), ((1,), (t,), ()))], (t, t), ()) is None
    assert launch.record([], (t,), ()) is None


# ------------------------------------------------------------------- decode_attention: a remembered call
def test_decode_attention_replays_a_call_laid_out_like_one_that_ran(direct, monkeypatch):
    """The second call of a layout goes from decode_attention straight to the launches its first call recorded:
    no plan lookup, no checks (both passed for that layout), the new tensors' addresses."""
    fdlib.api.clear_plans()
    q, k, v, lens = problem(0)
    out, lse = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=2, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what="checked call")
    assert not direct and len(fdlib.api._CALLS) == 1
    p = next(iter(fdlib.api._PLANS.values()))

    def no_plan(*a, **kw):
        raise AssertionError("a remembered call looked its plan up")
    monkeypatch.setattr(fdlib.api, "plan_for", no_plan)
    for seed in (1, 2):
        q2, k2, v2, lens2 = problem(seed)
        out2, lse2 = fdlib.decode_attention(q2, k2, v2, lens2, method="unified", num_splits=2, return_lse=True)
        assert direct[-1] == expected(p, q2, k2, v2, lens2, out2, lse2)
    assert len(direct) == 2
    with pytest.raises(AssertionError, match="looked its plan up"):   # another option: another key
        fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=2)


@pytest.mark.parametrize("bad, error", [
    (dict(scale=True), "scale"), (dict(return_lse=1), "return_lse"), (dict(batch_invariant=1), "batch_invariant"),
    (dict(num_splits=2.0), "num_splits"), (dict(validate=True), "validate")])
def test_a_remembered_call_does_not_let_an_equal_hash_through(direct, bad, error):
    """True == 1 == 1.0 hash alike: an option a fresh call refuses is refused after a remembered call too."""
    fdlib.api.clear_plans()
    q, k, v, lens = problem(0)
    opts = dict(scale=1, method="unified", num_splits=2, return_lse=True, batch_invariant=False)
    for _ in range(2):
        fdlib.decode_attention(q, k, v, lens, **opts)
    assert len(direct) == 1
    with pytest.raises((TypeError, ValueError), match=error):
        fdlib.decode_attention(q, k, v, lens, **{**opts, **bad})
    assert len(direct) == 1


def test_a_remembered_call_still_checks_what_it_is_asked_to(direct):
    """check_lengths=True reads and checks the lengths even for a layout remembered; on the CPU a tensor of
    lengths is checked on every call, remembered or not."""
    fdlib.api.clear_plans()
    q, k, v, lens = problem(0)
    for _ in range(2):
        fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=2)
    assert len(direct) == 1
    bad = lens.clone()
    bad[1] = 41
    for check in (True, False):
        with pytest.raises(ValueError, match="cache_seqlens: lengths must be <= the cache's L_max=40"):
            fdlib.decode_attention(q, k, v, bad, method="unified", num_splits=2, check_lengths=check)
    assert len(direct) == 1


def test_a_dropped_plan_takes_its_remembered_calls_with_it(direct, monkeypatch):
    monkeypatch.setattr(fdlib.api, "PLAN_CACHE_SIZE", 2)
    fdlib.api.clear_plans()
    q, k, v, lens = problem(0)
    for _ in range(2):
        fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=2)
    (first,) = [p for p, _ in fdlib.api._CALLS.values()]
    for i in range(2):                                    # two newer plans: the first is dropped
        fdlib.decode_attention(q, k, v, lens, scale=0.1 + i, method="naive")
    assert first not in fdlib.api._PLANS.values()
    assert all(p is not first for p, _ in fdlib.api._CALLS.values())
    n = len(direct)
    out, lse = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=2, return_lse=True)
    assert len(direct) == n                               # planned and checked again
    assert_attention_close(out, lse, q, k, v, lens, what="after the plan was dropped")


def test_host_lengths_are_never_remembered(direct):
    fdlib.api.clear_plans()
    q, k, v, lens = problem(0)
    out, lse = fdlib.decode_attention(q, k, v, lens.tolist(), method="unified", num_splits=2, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what="host lengths")
    fdlib.decode_attention(q, k, v, lens.tolist(), method="unified", num_splits=2, return_lse=True)
    assert not fdlib.api._CALLS
