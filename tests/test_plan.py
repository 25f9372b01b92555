"""fdlib.plan / DecodePlan.run (interpreter or GPU): decisions, correctness against float64, reuse across calls,
host lengths, mismatches, the plan cache of decode_attention, and the torch.compile op."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fdlib
import fdlib.api
from helpers import DEVICE, INTERPRET, assert_attention_close, counters_zero, make_problem, run_device_lengths

METHODS = ("auto", "split", "unified", "persistent", "balanced", "streamk", "naive")


def small(B=3, L=37, H_q=6, H_kv=2, D=80, dtype=torch.float32, seed=0, lens=(37, 16, 1)):
    return make_problem(B, L, H_q, H_kv, D, dtype, seed=seed, lens=list(lens))


@pytest.mark.parametrize("method", METHODS)
def test_plan_run_matches_float64_on_ragged_odd_sizes(method):
    """Group 3, D=80, lengths 37 (not a multiple of the tile), 16 (one tile), 1; then reused with new lengths."""
    q, k, v, lens = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, method=method)
    out, lse = p.run(q, k, v, lens, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what=f"plan.run {method}")
    for new in ([0, 5, 37], [17, 33, 2], [36, 0, 0]):
        lens2 = torch.tensor(new, dtype=torch.int32, device=DEVICE)
        out, lse = p.run(q, k, v, lens2, return_lse=True)
        assert_attention_close(out, lse, q, k, v, lens2, what=f"plan.run {method} lengths {new}")
    assert counters_zero() and p.workspace.counters is None or int(p.workspace.counters.count_nonzero()) == 0


def test_plan_owns_its_workspace_and_reuses_it():
    """The workspace lives in the plan (no module globals), is sized for its splits, and stays the same memory
    over many calls; out and lse passed by the caller are written in place and returned."""
    L = 400    # three splits fit with 16-key (interpreter) and 64- or 128-key (GPU) tiles
    q, k, v, lens = small(L=L, lens=(L, 16, 1))
    p = fdlib.plan(3, 6, 2, 80, L, dtype=torch.float32, device=DEVICE, method="unified", num_splits=3)
    ws = p.workspace
    assert p.kernel == "unified" and p.splits == 3
    # [B, q_len, H_q, splits, D] and [B, q_len, H_q, splits], q_len = 1
    assert ws.o_part.shape == (3, 1, 6, 3, 80) and ws.lse_part.shape == (3, 1, 6, 3) and ws.counters.shape == (6,)
    ptrs = [t.data_ptr() for t in (ws.o_part, ws.lse_part, ws.counters, ws.flag, ws.lse)]
    out = torch.empty_like(q)
    lse = torch.empty(3, 6, dtype=torch.float32, device=DEVICE)
    for i in range(8):
        lens_i = torch.tensor([(97 * i) % (L + 1), (31 * i) % (L + 1), i], dtype=torch.int32, device=DEVICE)
        got, got_lse = p.run(q, k, v, lens_i, out=out, lse=lse)
        assert got is out and got_lse is lse
        assert int(ws.counters.count_nonzero()) == 0
    assert_attention_close(out, lse, q, k, v, lens_i, what="after 8 calls")
    assert ptrs == [t.data_ptr() for t in (ws.o_part, ws.lse_part, ws.counters, ws.flag, ws.lse)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.B = 4


def test_smaller_batch_4d_q_and_default_lengths():
    """A plan for B=3 runs a batch of 2 (a serving step with fewer live sequences), a [B, 1, H_q, D] q, and
    no lengths (all L_max)."""
    q, k, v, lens = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE)
    out = p.run(q[:2, None], k[:2], v[:2], lens[:2])
    assert out.shape == (2, 1, 6, 80)
    assert_attention_close(out[:, 0], None, q[:2], k[:2], v[:2], lens[:2], what="B'=2 < B=3, 4-D q")
    full = torch.full((3,), 37, dtype=torch.int32, device=DEVICE)
    assert_attention_close(p.run(q, k, v), None, q, k, v, full, what="no lengths")


@pytest.mark.parametrize("method", METHODS + ("worklist",))
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fewer_sequences_than_planned_without_lengths(method):
    """A plan for B=4 called with 2, 1 and no sequences and no lengths (every row L_max; the plan's all-L_max
    lengths hold 4 rows, the call's q 2, 1 or 0): every method answers the call's rows, against float64. A
    division by zero in a kernel (the interpreter warns: stream-K's aligned shares divided by the call's B = 0)
    fails it."""
    p = fdlib.plan(4, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, method=method)
    for B in (2, 1, 0):
        q, k, v, _ = make_problem(B, 37, 6, 2, 80, torch.float32, seed=B)
        out, lse = p.run(q, k, v, return_lse=True)
        assert out.shape == q.shape and lse.shape == (B, 6)
        if B:
            full = torch.full((B,), 37, dtype=torch.int32, device=DEVICE)
            assert_attention_close(out, lse, q, k, v, full, what=f"{method}: B'={B} of 4, no lengths")


def test_host_lengths_are_read_without_the_device_and_checked_at_once():
    q, k, v, lens = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, lengths=[37, 16, 1])
    assert p.decision.basis == "host lengths" and p.decision.L_cap == 37
    out = p.run(q, k, v, [37, 16, 1])
    assert_attention_close(out, None, q, k, v, lens, what="host list lengths")
    with pytest.raises(ValueError, match=r"cache_seqlens: lengths must be <= the cache's L_max=37, got a maximum of 38"):
        p.run(q, k, v, [38, 1, 1])
    with pytest.raises(ValueError, match="cache_seqlens: lengths must be >= 0"):
        p.run(q, k, v, [3, -1, 1])
    with pytest.raises(ValueError, match=r"cache_seqlens: expected 3 lengths"):
        p.run(q, k, v, [3, 1])
    with pytest.raises(TypeError, match="cache_seqlens"):
        p.run(q, k, v, "37,16,1")
    with pytest.raises(ValueError, match="lengths"):
        fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, lengths=[40, 1, 1])


def test_device_lengths_out_of_range_are_clamped_and_flagged():
    q, k, v, _ = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE)
    assert p.clamped() is False
    bad = torch.tensor([50, -3, 5], dtype=torch.int32, device=DEVICE)
    out = run_device_lengths(p, q, k, v, bad)     # on the CPU run checks a tensor's values like a list's
    assert_attention_close(out, None, q, k, v, bad.clamp(0, 37), what="clamped lengths")
    assert p.clamped() is True and p.clamped() is False


MISMATCH = [
    ("q heads", lambda q, k, v: (q[:, :4], k, v), ValueError, ["q:", "[B, 6, 80]", "[3, 4, 80]"]),
    ("q batch too large", lambda q, k, v: (torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])), ValueError,
     ["q:", "B <= 3", "[6, 6, 80]"]),
    ("q dtype", lambda q, k, v: (q.half(), k, v), TypeError, ["q:", "float32", "float16"]),
    ("k L_max", lambda q, k, v: (q, k[:, :30], v), ValueError, ["k_cache:", "[3, 37, 2, 80]", "[3, 30, 2, 80]"]),
    ("v dtype", lambda q, k, v: (q, k, v.double()), TypeError, ["v_cache:", "float64"]),
    ("v not a tensor", lambda q, k, v: (q, k, None), TypeError, ["v_cache:", "NoneType"]),
    ("k batch", lambda q, k, v: (q[:2], k, v[:2]), ValueError, ["k_cache:", "[2, 37, 2, 80]", "[3, 37, 2, 80]"]),
]


@pytest.mark.parametrize("what,edit,exc,fragments", MISMATCH, ids=[m[0] for m in MISMATCH])
def test_tensors_that_do_not_fit_the_plan_get_clear_errors(what, edit, exc, fragments):
    q, k, v, lens = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE)
    q2, k2, v2 = edit(q, k, v)
    with pytest.raises(exc) as info:
        p.run(q2, k2, v2)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in: {info.value}"


def test_out_and_lse_buffers_are_checked():
    q, k, v, lens = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match=r"out: this plan expects shape \[3, 6, 80\], got \[3, 6, 64\]"):
        p.run(q, k, v, lens, out=torch.empty(3, 6, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"lse: expected a float32 tensor of shape \[3, 6\]"):
        p.run(q, k, v, lens, lse=torch.empty(3, 6, dtype=torch.float16, device=DEVICE))


PLAN_ARGS = [
    (dict(B=0), ValueError, "B"), (dict(H_q=5), ValueError, "H_q"), (dict(D=300), ValueError, "D"),
    (dict(D=80.0), TypeError, "D"), (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(method="fast"), ValueError, "method"), (dict(num_splits=0), ValueError, "num_splits"),
    (dict(max_seqlen=38), ValueError, "max_seqlen"), (dict(lengths=[1, 2]), ValueError, "^lengths:"),
    (dict(scale=float("inf")), ValueError, "scale"),
]


@pytest.mark.parametrize("over,exc,name", PLAN_ARGS, ids=[a[2] + "-" + str(i) for i, a in enumerate(PLAN_ARGS)])
def test_plan_rejects_bad_arguments(over, exc, name):
    args = dict(B=3, H_q=6, H_kv=2, D=80, L_max=37, dtype=torch.float32, device=DEVICE) | over
    with pytest.raises(exc, match=name):
        fdlib.plan(**args)


@pytest.mark.parametrize("method, splits", [("unified", 2), ("unified", 1), ("persistent", None),
                                            ("streamk", None), ("split", 2), ("batch_invariant", None)])
def test_calls_of_changing_layouts_and_fresh_tensors(method, splits):
    """One plan over a run of calls that change what a replay of an earlier call could get wrong: fresh
    tensors every call, out and lse given or not, lengths given or not, a strided q, K passed as V, fewer
    live sequences, and a layout seen before coming back. On a GPU the repeated layouts replay the
    recorded launch (fdlib.kernels.launch.replay); every result is checked against float64."""
    inv = method == "batch_invariant"
    p = fdlib.plan(3, 4, 2, 32, 40, dtype=torch.float32, device=DEVICE, method="auto" if inv else method,
                   num_splits=splits, batch_invariant=inv)
    for i, how in enumerate(["plain", "plain", "out", "out", "lse", "lse", "nolens", "nolens", "strided",
                             "strided", "kv", "kv", "two", "two", "plain", "plain"]):
        B = 2 if how == "two" else 3
        q, k, v, lens = make_problem(B, 40, 4, 2, 32, torch.float32, seed=100 + i, lens=[40, 17, 1][:B])
        kw = {}
        if how == "out":
            kw["out"] = torch.full_like(q, float("nan"))
        if how == "lse":
            kw["lse"] = torch.full((B, 4), float("nan"), device=DEVICE)
        if how == "nolens":
            lens = None
        if how == "strided":
            wide = torch.zeros(B, 4, 64, dtype=torch.float32, device=DEVICE)
            wide[..., :32] = q
            q = wide[..., :32]
        if how == "kv":
            v = k
        res = p.run(q, k, v, lens, return_lse=True, **kw)
        out, lse = res
        if "out" in kw:
            assert out is kw["out"]
        if "lse" in kw:
            assert lse is kw["lse"]
        assert_attention_close(out, lse, q, k, v, lens, what=f"{method} call {i} ({how})")


def test_decode_attention_caches_plans_by_shape_never_by_lengths():
    fdlib.api.clear_plans()
    q, k, v, lens = small()
    for new in ([37, 16, 1], [2, 2, 2], [0, 0, 37]):
        fdlib.decode_attention(q, k, v, torch.tensor(new, dtype=torch.int32, device=DEVICE))
    assert len(fdlib.api._PLANS) == 1
    fdlib.decode_attention(q, k, v, lens, method="split")
    fdlib.decode_attention(q[:2], k[:2], v[:2], lens[:2])
    assert len(fdlib.api._PLANS) == 3
    for i in range(fdlib.api.PLAN_CACHE_SIZE + 5):      # bounded: least recently used plans are dropped
        fdlib.decode_attention(q, k, v, lens, scale=0.1 + i / 1000, method="naive")
    assert len(fdlib.api._PLANS) == fdlib.api.PLAN_CACHE_SIZE


# ---------------------------------------------------------------------------------------------- torch.compile
def test_registered_op_and_its_fake_implementation():
    """torch.ops.fdlib.decode_attention exists; under FakeTensorMode it gives out like q and lse [B, H_q]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v, lens = small()
    with FakeTensorMode() as mode:
        fq, fk, fv, fl = (mode.from_tensor(t) for t in (q, k, v, lens))
        out, lse = torch.ops.fdlib.decode_attention(fq, fk, fv, fl, None, "auto", None, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (3, 6) and lse.dtype == torch.float32
    real_out, real_lse = torch.ops.fdlib.decode_attention(q, k, v, lens, None, "auto", None, None)
    assert_attention_close(real_out, real_lse, q, k, v, lens, what="the registered op")


def test_torch_compile_fullgraph_without_a_graph_break():
    """A small model step calling fdlib.decode_attention compiles with fullgraph=True (no graph break); the
    aot_eager backend keeps the CPU test quick and runs the op's fake implementation while tracing."""
    q, k, v, lens = small()
    w = torch.randn(80, 80, device=DEVICE)

    def step(q, k, v, lens):
        out = fdlib.decode_attention(q @ w, k, v, lens)
        return out * 2.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, lens)
    want = step(q, k, v, lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- timeline
@pytest.mark.parametrize("method,want", [
    ("unified", lambda p: 3 * 2 * p.splits), ("split", lambda p: 3 * 2 * p.splits),
    ("balanced", lambda p: (p.decision.budget + 3) * 2), ("persistent", lambda p: min(p.decision.programs, 3 * 2)),
    ("streamk", lambda p: p.decision.programs),
    ("worklist", lambda p: 2 * 3 * -(-min(3 * p.splits, p.decision.budget + 3) // 3))])   # the list's room
def test_timeline_buffer_is_sized_for_the_launch(method, want):
    """One zeroed int64 row of (SM id, start ns, end ns) per program of one launch (stage 1's for the two-stage
    path); the normal launch path never builds the TIMELINE kernels."""
    p = fdlib.plan(3, 6, 2, 80, 200, dtype=torch.float16, device=DEVICE, method=method,
                   num_splits=3 if method in ("unified", "split") else None)
    buf = p.timeline_buffer()
    assert buf.dtype == torch.int64 and buf.device == p.device and tuple(buf.shape) == (want(p), 3)
    assert int(buf.count_nonzero()) == 0 and p.timeline_programs() == want(p)
    assert p._timeline == {}


def test_timeline_of_the_naive_method_is_refused():
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, method="naive")
    with pytest.raises(ValueError, match="timeline: method='naive' runs PyTorch, no Triton kernel"):
        p.timeline_buffer()


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's error")
def test_timeline_in_the_interpreter_raises_a_clear_error():
    q, k, v, lens = small()
    p = fdlib.plan(3, 6, 2, 80, 37, dtype=torch.float32, device=DEVICE, method="unified")
    with pytest.raises(RuntimeError, match=r"timeline: .*globaltimer.*interpreter \(TRITON_INTERPRET=1\)"):
        p.run(q, k, v, lens, timeline=p.timeline_buffer())


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU and compiled kernels")
@pytest.mark.parametrize("method", ["unified", "split", "balanced", "persistent", "streamk", "worklist"])
def test_timeline_on_the_gpu_records_every_program(method):
    """Each launched program writes its SM (0 <= sm < SMs) and start <= end (ns, within the call's wall time);
    results equal the normal launch bitwise; a bad buffer is refused."""
    q, k, v, lens = small(B=3, L=4096, H_q=32, H_kv=8, D=128, dtype=torch.float16, lens=(4096, 100, 1))
    p = fdlib.plan(3, 32, 8, 128, 4096, dtype=torch.float16, device=DEVICE, method=method)
    want = p.run(q, k, v, lens)
    buf = p.timeline_buffer()
    got = p.run(q, k, v, lens, timeline=buf)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    t = buf.cpu()
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    assert ((t[:, 0] >= 0) & (t[:, 0] < sms)).all()
    assert (t[:, 1] > 0).all() and (t[:, 2] >= t[:, 1]).all()
    assert int(t[:, 2].max() - t[:, 1].min()) < 10**9      # one launch: well under a second
    with pytest.raises(ValueError, match=r"timeline: expected a contiguous int64 tensor \[>= \d+, 3\]"):
        p.run(q, k, v, lens, timeline=buf.to(torch.int32))
