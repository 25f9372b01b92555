"""fdlib.decode_attention under torch.compile keeps the eager call's contract: a bad argument raises the eager
error, the same type and the same message, with fullgraph=True or not, on aot_eager and inductor (even where the
compiled function never reads the result); 8-bit caches run compiled, their scales tensors or floats, and give the
eager call's bits. Shapes are tiny: the CPU traces once a case."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fdlib
from fdlib import quant
from helpers import make_problem

BACKENDS = ("aot_eager", "inductor")

BAD = {   # argument -> the call's keyword arguments (one bad argument each)
    "method": dict(method="fast"),
    "num_splits=0": dict(num_splits=0),
    "num_splits=True": dict(num_splits=True),
    "scale=nan": dict(scale=float("nan")),
    "scale=True": dict(scale=True),
    "scale=10**400": dict(scale=10 ** 400),
    "k_scale=0 on a 16-bit cache": dict(k_scale=0),
    "return_lse": dict(return_lse=1),
    "batch_invariant": dict(batch_invariant=1),
    "check_lengths": dict(check_lengths="yes"),
    "max_seqlen=5.0": dict(max_seqlen=5.0),
    "max_seqlen=99": dict(max_seqlen=99),
    "validate": dict(validate=True),
    "k_scale on a 16-bit cache": dict(k_scale=1.0),
    "k_scale tensor on a 16-bit cache": dict(k_scale=torch.ones(2)),
    "k_scale=True on a 16-bit cache": dict(k_scale=True),
    "block_table": dict(block_table="pages"),
    "unified_max with batch_invariant": dict(method="unified_max", batch_invariant=1),
    "unified_max with scale=True": dict(method="unified_max", scale=True),
    "streamk with num_splits": dict(method="streamk", num_splits=8),
}


def raised(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the error is what is compared
        return e
    raise AssertionError("the call raised nothing")


def assert_same_error(got, want):
    assert type(got) is type(want), f"compiled: {type(got).__name__}: {got}\neager: {type(want).__name__}: {want}"
    assert str(got) == str(want)


@pytest.fixture(scope="module")
def problem():
    return make_problem(2, 32, 4, 2, 16, torch.float32, seed=5, lens=[32, 3])


@pytest.mark.parametrize("fullgraph", (False, True))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD))
def test_compiled_call_raises_the_eager_error(problem, case, backend, fullgraph):
    kw = BAD[case]

    def step(q, k, v, lens):
        return fdlib.decode_attention(q, k, v, lens, **kw)

    want = raised(step, *problem)
    torch._dynamo.reset()
    assert_same_error(raised(torch.compile(step, backend=backend, fullgraph=fullgraph), *problem), want)


@pytest.mark.parametrize("fullgraph", (False, True))
def test_compiled_errors_found_when_the_op_runs_are_the_eager_ones(problem, fullgraph):
    """Errors of tensors and lengths (the op's eager call finds them), lengths in a list included: a list of ints
    goes to the op as it came, so its count and values are checked as the eager call checks them."""
    q, k, v, lens = problem
    cases = [((q, k, v, lens.float()), {}), ((q, k, v, [3, 2, 1]), {}), ((q, k, v, [40, 2]), {}),
             ((q, k, v, [3.0, 2]), {}), ((q, k[:1], v[:1], lens), {}), ((q.half(), k, v, lens), {}),
             ((q, k, v, "lens"), {})]
    for args, kw in cases:
        want = raised(lambda *a: fdlib.decode_attention(*a, **kw), *args)
        torch._dynamo.reset()
        step = torch.compile(lambda *a: fdlib.decode_attention(*a, **kw), backend="aot_eager", fullgraph=fullgraph)
        assert_same_error(raised(step, *args), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_call_raises_where_nothing_reads_its_result(problem, backend):
    """The error is raised by an op in the graph; the compiler keeps it although no output depends on it."""
    def step(q, k, v, lens):
        fdlib.decode_attention(q, k, v, lens, method="fast")
        return q + 1

    want = raised(step, *problem)
    torch._dynamo.reset()
    assert_same_error(raised(torch.compile(step, backend=backend, fullgraph=True), *problem), want)


def test_one_compiled_step_takes_new_lengths_in_a_list_and_new_scales(problem):
    """Lengths in a list and a float scale that change from call to call (dynamo makes them symbolic after the first
    change): the eager bits each time, and a bad value of either raises the eager error."""
    q, k, v, _ = problem

    def step(q, k, v, lens, s):
        return fdlib.decode_attention(q, k, v, lens, scale=s, return_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for lens, s in (([32, 3], 0.25), ([5, 7], 0.3), ([9, 1], 0.35), ([0, 32], 0.5)):
        out, lse = compiled(q, k, v, lens, s)
        want_out, want_lse = step(q, k, v, lens, s)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for args in (([40, 3], 0.2), ([4, 3], float("inf")), ([4, -1], 0.2)):
        assert_same_error(raised(compiled, q, k, v, *args), raised(step, q, k, v, *args))


@pytest.mark.parametrize("fullgraph", (False, True))
def test_int_options_that_change_then_go_bad_raise_the_eager_error(problem, fullgraph):
    """num_splits, max_seqlen and an int scale that change from call to call (dynamo makes an int symbolic after
    the first change, and the checks' messages write the value out): good values give the eager bits in one
    trace after the first change (no trace a value), then a bad value raises the eager error, not dynamo's."""
    q, k, v, lens = problem
    runs = {"num_splits": ((2, 4, 8), (0, 300)), "max_seqlen": ((8, 16, 32), (99, -1)), "scale": ((1, 2), (10 ** 400,)),
            ("method", "persistent", "num_splits"): ((1, 1), (2, 3))}
    for name, (good, bad) in runs.items():
        kw = {name[0]: name[1]} if isinstance(name, tuple) else {}
        arg = name[2] if isinstance(name, tuple) else name

        def step(q, k, v, lens, x, kw=kw, arg=arg):
            return fdlib.decode_attention(q, k, v, lens, **kw, **{arg: x})

        traces = []

        def backend(gm, example_inputs):
            traces.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
        for x in good:
            assert torch.equal(compiled(q, k, v, lens, x), step(q, k, v, lens, x)), (arg, x)
        assert len(traces) <= 2, (arg, len(traces))   # the first value, then one symbolic trace for the rest
        for x in bad:
            assert_same_error(raised(compiled, q, k, v, lens, x), raised(step, q, k, v, lens, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_that_require_grad_compile_as_they_run_eagerly(problem, backend):
    """A q (or a per-head scale) that requires grad, as in a model outside no_grad: the eager call gives out and
    lse that require none, so the compiled one gives the same bits, not a compiler failure (once AOT autograd's
    "no autograd formula was registered" for the ops), and a bad argument still raises the eager error."""
    q, k, v, lens = problem
    qg = q.clone().requires_grad_()

    def step(q, k, v, lens, **kw):
        return fdlib.decode_attention(q, k, v, lens, return_lse=True, **kw)

    want = step(qg, k, v, lens)
    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(qg, k, v, lens)
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(got, want))
    torch._dynamo.reset()
    bad = torch.compile(lambda *a: step(*a, method="fast"), backend=backend, fullgraph=True)
    assert_same_error(raised(bad, qg, k, v, lens), raised(lambda *a: step(*a, method="fast"), qg, k, v, lens))
    q8, k8, v8, lens8, ks, vs = kv8(torch.int8, "head", "token")
    q8, ks = q8.clone().requires_grad_(), ks.clone().requires_grad_()
    want = step(q8, k8, v8, lens8, k_scale=ks, v_scale=vs)
    torch._dynamo.reset()
    got = torch.compile(lambda *a: step(*a[:4], k_scale=a[4], v_scale=a[5]), backend=backend,
                        fullgraph=True)(q8, k8, v8, lens8, ks, vs)
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(got, want))


NUMPY_BAD = [dict(scale=np.float32(0.2)), dict(max_seqlen=np.int64(5)), dict(num_splits=np.int64(2)),
             dict(return_lse=np.bool_(True)), dict(check_lengths=np.bool_(True)),
             dict(batch_invariant=np.bool_(False)), dict(max_seqlen=np.float64(5)), dict(scale=np.int64(1)),
             dict(k_scale=np.float64(0.5)), dict(scale=np.array([0.2, 0.3])), dict(scale=np.float64("nan"))]


@pytest.mark.parametrize("fullgraph", (False, True))
def test_numpy_scalars_compile_as_they_run_eagerly(problem, fullgraph):
    """NumPy scalars, which dynamo traces as arrays: scale=np.float64 (accepted eagerly, a float subclass; 1 /
    np.sqrt(D) is one) gives the eager bits, 8-bit scales too, where the trace once refused it ("got ndarray");
    and a NumPy scalar the eager call refuses raises its error, named by its type (once "got ndarray", or dynamo's
    own Unsupported for return_lse=np.bool_)."""
    q, k, v, lens = problem

    def step(q, k, v, lens, **kw):
        return fdlib.decode_attention(q, k, v, lens, **kw)

    for kw in (dict(scale=np.float64(0.2)), dict(scale=1 / np.sqrt(16), return_lse=True)):
        torch._dynamo.reset()
        got = torch.compile(lambda *a: step(*a, **kw), backend="aot_eager", fullgraph=fullgraph)(q, k, v, lens)
        want = step(q, k, v, lens, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) if isinstance(want, tuple) else \
            torch.equal(got, want)
    q8, k8, v8, lens8, ks, vs = kv8(torch.float8_e4m3fn, "tensor", "tensor")
    torch._dynamo.reset()
    scales = dict(k_scale=np.float64(ks), v_scale=np.float64(vs), scale=np.float64(0.3))
    got = torch.compile(lambda *a: step(*a, **scales), backend="aot_eager", fullgraph=fullgraph)(q8, k8, v8, lens8)
    assert torch.equal(got, step(q8, k8, v8, lens8, **scales))
    for kw in NUMPY_BAD:
        want = raised(lambda *a: step(*a, **kw), q, k, v, lens)
        torch._dynamo.reset()
        got = raised(torch.compile(lambda *a: step(*a, **kw), backend="aot_eager", fullgraph=fullgraph), q, k, v, lens)
        assert_same_error(got, want)


# ------------------------------------------------------------------------------------------ 8-bit caches
def kv8(kv_dtype, k_gran, v_gran, seed=7):
    q, k, v, lens = make_problem(2, 32, 4, 2, 16, torch.float32, seed=seed, lens=[32, 9])
    (k8, ks), (v8, vs) = quant.quantize_kv(k, kv_dtype, k_gran), quant.quantize_kv(v, kv_dtype, v_gran)
    return q.half(), k8, v8, lens, ks, vs


@pytest.mark.parametrize("fullgraph", (False, True))
@pytest.mark.parametrize("kv_dtype,k_gran,v_gran", [(torch.float8_e4m3fn, "tensor", "head"),
                                                    (torch.int8, "head", "token"),
                                                    (torch.float8_e4m3fn, "token", "tensor")])
def test_compiled_8bit_call_gives_the_eager_bits(kv_dtype, k_gran, v_gran, fullgraph):
    """An 8-bit cache compiles (the scales reach the op: a float as a float, a tensor as a tensor), after an eager
    warm-up or not, and gives the eager call's out and lse bit for bit; a float scale passed as an argument of the
    compiled function too."""
    q, k8, v8, lens, ks, vs = kv8(kv_dtype, k_gran, v_gran)

    def step(q, k8, v8, lens, ks, vs):
        return fdlib.decode_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs, return_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)
    out, lse = compiled(q, k8, v8, lens, ks, vs)
    want_out, want_lse = step(q, k8, v8, lens, ks, vs)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out, lse = compiled(q, k8, v8, lens, ks, vs)         # after the eager warm-up
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    if k_gran == "tensor":   # another float scale: the compiled call reads the new value
        out2 = compiled(q, k8, v8, lens, ks * 2, vs)[0]
        assert torch.equal(out2, step(q, k8, v8, lens, ks * 2, vs)[0])


def test_compiled_8bit_call_over_pages_and_with_inductor():
    q, k8, v8, lens, ks, vs = kv8(torch.int8, "head", "head")
    kp, vp = k8.reshape(8, 8, 2, 16), v8.reshape(8, 8, 2, 16)       # pages of 8: sequence b's are 4b .. 4b+3
    bt = torch.arange(8, dtype=torch.int32, device=q.device).reshape(2, 4)

    def step(q, kp, vp, lens, bt, ks, vs):
        return fdlib.decode_attention(q, kp, vp, lens, block_table=bt, k_scale=ks, v_scale=vs)

    torch._dynamo.reset()
    out = torch.compile(step, backend="inductor", fullgraph=True)(q, kp, vp, lens, bt, ks, vs)
    assert torch.equal(out, step(q, kp, vp, lens, bt, ks, vs))
    assert torch.equal(out, fdlib.decode_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs))


@pytest.mark.parametrize("fullgraph", (False, True))
def test_compiled_8bit_errors_are_the_eager_ones(fullgraph):
    q, k8, v8, lens, ks, vs = kv8(torch.float8_e4m3fn, "head", "tensor")
    bad_head = ks.clone()
    bad_head[1] = -1.0
    cases = [dict(k_scale=None, v_scale=vs), dict(k_scale=ks, v_scale=-2.0), dict(k_scale=ks, v_scale="s"),
             dict(k_scale=True, v_scale=vs), dict(k_scale=bad_head, v_scale=vs, check_lengths=True),
             dict(k_scale=ks.double(), v_scale=vs), dict(k_scale=ks, v_scale=vs, method="unified_max"),
             dict(k_scale=ks[:1], v_scale=vs), dict(k_scale=ks, v_scale=1e39),
             # ints: named as ints (the op takes a float: "got 0.0" for 0), and one too large for a float (once
             # dynamo's internal OverflowError)
             dict(k_scale=ks, v_scale=0), dict(k_scale=ks, v_scale=-2), dict(k_scale=ks, v_scale=10 ** 400),
             dict(k_scale=ks, v_scale=vs, scale=10 ** 400), dict(k_scale=ks, v_scale=vs, scale=2 ** 130)]
    if bad_head.device.type == "cpu":   # a per-head scale's values are read unasked only on the host (no sync)
        cases.append(dict(k_scale=bad_head, v_scale=vs))
    for kw in cases:
        def step(q, k8, v8, lens):
            return fdlib.decode_attention(q, k8, v8, lens, **kw)

        want = raised(step, q, k8, v8, lens)
        torch._dynamo.reset()
        assert_same_error(raised(torch.compile(step, backend="aot_eager", fullgraph=fullgraph), q, k8, v8, lens),
                          want)
