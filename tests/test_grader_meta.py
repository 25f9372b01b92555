"""The graders are tested too: untouched stubs and known-wrong solutions must fail, and nothing a learner's code
does (raise, hang, return garbage, modify inputs, write out of bounds) may break the grader."""
from __future__ import annotations

import time

import pytest
import torch

from fdlib.course.grading import core
from fdlib.course.grading.core import GuardedBuffer, TodoError, call, check_case, run_checks
from fdlib.online_softmax import State
from helpers import assert_one_todo_line, cell_function, not_implemented_stub, todo_stub

NAIVE, ONLINE, MERGE = "lab01.naive_attention", "lab02.online_softmax", "lab02.merge"


# ---------------------------------------------------------------------------------------------- wrong naive attention
def _naive(q, k_cache, v_cache, cache_seqlens, scale, *, use_scale=True, axis=-1, tail="<", head_map="div",
           acc=torch.float32):
    B, H_q, D = q.shape
    L, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    heads = torch.arange(H_q)
    kv_of = heads // group if head_map == "div" else heads % H_kv
    k = k_cache.to(acc)[:, :, kv_of]
    v = v_cache.to(acc)[:, :, kv_of]
    s = torch.einsum("bhd,blhd->bhl", q.to(acc), k) * (scale if use_scale else 1.0)
    pos = torch.arange(L)
    n = cache_seqlens.long()[:, None]
    valid = pos[None] < n if tail == "<" else (pos[None] <= n if tail == "<=" else torch.ones(B, L, dtype=torch.bool))
    s = s.masked_fill(~valid[:, None], float("-inf"))
    if acc != torch.float32:  # accumulate ℓ and Õ key by key in `acc` (e.g. float16)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = torch.zeros(B, H_q, dtype=acc)
        o = torch.zeros(B, H_q, D, dtype=acc)
        for j in range(L):
            l = l + p[..., j]
            o = o + p[..., j, None] * v[:, j]
        out = o / torch.where(l == 0, torch.ones_like(l), l)[..., None]
        lse = (m[..., 0] + torch.log(l)).float()
        return out.to(q.dtype), lse
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=axis)
    p = torch.nan_to_num(p)
    return torch.einsum("bhl,blhd->bhd", p, v).to(q.dtype), lse.float()


WRONG_NAIVE = {
    "no scale": lambda *a: _naive(*a, use_scale=False),
    "softmax over heads": lambda *a: _naive(*a, axis=1),
    "wrong tail mask (<=)": lambda *a: _naive(*a, tail="<="),
    "no length mask": lambda *a: _naive(*a, tail="none"),
    "GQA h % H_kv": lambda *a: _naive(*a, head_map="mod"),
    "fp16 accumulation": lambda *a: _naive(*a, acc=torch.float16),
    "lse not float32": lambda *a: (lambda o, l: (o, l.to(o.dtype)))(*_naive(*a)),
}


def test_correct_variant_passes():
    """The harness of the wrong solutions is itself right when no mistake is switched on."""
    assert run_checks(NAIVE, _naive, quiet=True).ok


@pytest.mark.parametrize("stub", [todo_stub, not_implemented_stub], ids=["todo()", "raise NotImplementedError"])
@pytest.mark.parametrize("name", [NAIVE, ONLINE, MERGE])
def test_stub_is_todo(name, stub, capsys):
    res = run_checks(name, stub)
    assert_one_todo_line(res, capsys.readouterr().out, name)


@pytest.mark.parametrize("name", core.exercises())
def test_shipped_stub_is_todo(name, capsys):
    """The stub its grader module holds (the exercise cell as shipped), run as that cell, prints one TODO line:
    a Python stub calls todo(), a Triton stub is recognised by its code."""
    fn = cell_function(core.stub_source(name), name.split(".")[1])
    try:
        res = run_checks(name, fn)
        assert_one_todo_line(res, capsys.readouterr().out, name)
    finally:
        core._LEARNER.pop(name, None)


@pytest.mark.parametrize("wrong", WRONG_NAIVE, ids=list(WRONG_NAIVE))
def test_wrong_naive_fails(wrong):
    res = run_checks(NAIVE, WRONG_NAIVE[wrong], quiet=True)
    assert res.failed > 0, f"the lab01 checks accept a solution with: {wrong}"


# ---------------------------------------------------------------------------------------------- wrong online softmax
def _online(q, k, v, block, scale, *, rescale=True, update_max=True, safe_inf=True):
    L, D = k.shape
    m, l, o = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(D)
    for start in range(0, L, block):
        s = (k[start:start + block].float() @ q.float()) * scale
        m_new = torch.maximum(m, s.max()) if (update_max or start == 0) else m
        ref = m_new if (not safe_inf or torch.isfinite(m_new)) else torch.tensor(0.0)
        alpha = torch.exp(m - ref) if rescale else torch.tensor(1.0)
        p = torch.exp(s - ref)
        l, o, m = l * alpha + p.sum(), o * alpha + p @ v[start:start + block].float(), m_new
    return State(m, l, o)


WRONG_ONLINE = {
    "missing rescale": lambda *a: _online(*a, rescale=False),
    "max never updated": lambda *a: _online(*a, update_max=False),
    "-inf blocks give NaN": lambda *a: _online(*a, safe_inf=False),
    "normalised output instead of Õ": lambda *a: (lambda s: State(s.m, s.l, s.output()))(_online(*a)),
}


def test_online_variant_passes():
    assert run_checks(ONLINE, _online, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_ONLINE, ids=list(WRONG_ONLINE))
def test_wrong_online_fails(wrong):
    assert run_checks(ONLINE, WRONG_ONLINE[wrong], quiet=True).failed > 0, wrong


# ---------------------------------------------------------------------------------------------- wrong merge
def _ref0(m):
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


WRONG_MERGE = {
    "plain average": lambda a, b: State(torch.maximum(a.m, b.m), (a.l + b.l) / 2, (a.o_tilde + b.o_tilde) / 2),
    "no rescale (plain sum)": lambda a, b: State(torch.maximum(a.m, b.m), a.l + b.l, a.o_tilde + b.o_tilde),
    "drops the second state": lambda a, b: State(a.m.clone(), a.l.clone(), a.o_tilde.clone()),
    "wrong lse formula e^(m - m_old)": lambda a, b: (lambda m: State(
        m, a.l * torch.exp(m - a.m) + b.l * torch.exp(m - b.m),
        a.o_tilde * torch.exp(m - a.m)[:, None] + b.o_tilde * torch.exp(m - b.m)[:, None]))(torch.maximum(a.m, b.m)),
    "-inf - -inf gives NaN": lambda a, b: (lambda m: State(
        m, a.l * torch.exp(a.m - m) + b.l * torch.exp(b.m - m),
        a.o_tilde * torch.exp(a.m - m)[:, None] + b.o_tilde * torch.exp(b.m - m)[:, None]))(torch.maximum(a.m, b.m)),
}


@pytest.mark.parametrize("wrong", WRONG_MERGE, ids=list(WRONG_MERGE))
def test_wrong_merge_fails(wrong):
    assert run_checks(MERGE, WRONG_MERGE[wrong], quiet=True).failed > 0, wrong


# ---------------------------------------------------------------------------------------------- robustness
def _lines(res):
    return [o.line() for o in res.outcomes]


def test_learner_exception_is_reported_and_run_goes_on():
    calls = []

    def boom(*args):
        calls.append(1)
        raise ZeroDivisionError("division by zero on purpose")

    res = run_checks(NAIVE, boom, quiet=True)
    assert res.failed == res.total == len(calls) > 1           # every check ran
    assert all("ZeroDivisionError: division by zero on purpose" in line for line in _lines(res))
    assert "in boom" in _lines(res)[0]


def test_timeout():
    def slow(*args):
        time.sleep(3)

    t0 = time.time()
    res = run_checks(MERGE, slow, quiet=True, timeout_s=0.05)
    assert time.time() - t0 < 2.5
    assert res.failed == res.total and all("timed out after 0.05 s" in line for line in _lines(res))


def test_wrong_shape_and_type():
    res = run_checks(NAIVE, lambda q, *a: (q[:, :1], torch.zeros(q.shape[:2])), quiet=True)
    assert "out: expected shape" in _lines(res)[0]
    res = run_checks(NAIVE, lambda q, *a: q, quiet=True)
    assert "return value: expected a tuple of 2 (out, lse)" in _lines(res)[0]
    res = run_checks(NAIVE, lambda q, *a: (lambda o, l: (o.double(), l))(*_naive(q, *a)), quiet=True)
    assert "out: expected dtype torch.float32, got torch.float64" in _lines(res)[0]
    res = run_checks(NAIVE, lambda q, *a: (torch.empty(q.shape, device="meta"), torch.empty(q.shape[:2])), quiet=True)
    assert "out: expected a tensor on cpu, got one on meta" in _lines(res)[0]
    res = run_checks(ONLINE, lambda *a: [1.0, 2.0], quiet=True)
    assert "expected a tuple of 3" in _lines(res)[0]


def test_mismatch_report_is_useful():
    res = run_checks(NAIVE, lambda *a: (lambda o, l: (o + 0.5, l))(*_naive(*a)), quiet=True)
    line = _lines(res)[0]
    assert line.startswith("❌ FAIL ") and "max abs error 0.5" in line and "worst at index [" in line
    assert "expected" in line and "got" in line


def test_modifying_input_is_caught():
    def in_place(q, k_cache, v_cache, cache_seqlens, scale):
        out = _naive(q, k_cache, v_cache, cache_seqlens, scale)
        k_cache.mul_(2)
        return out

    res = run_checks(NAIVE, in_place, quiet=True)
    assert res.failed == res.total
    assert "your function modified its input `k_cache`" in _lines(res)[0]


@pytest.fixture
def fill_exercise():
    """A throwaway exercise that writes into an output buffer with guard bands."""
    name = "lab99.fill"

    @check_case(name, "fills its output with 1")
    def _fill(impl, gen):
        buf = GuardedBuffer((4, 5))
        call(impl, {"out": buf.view}, outputs=("out",))
        buf.verify("output")
        core.assert_close(buf.view, torch.ones(4, 5), "out", 0, 0)

    yield name
    core._CHECKS.pop(name, None)


def test_guard_bands(fill_exercise):
    assert run_checks(fill_exercise, lambda out: out.fill_(1), quiet=True).ok

    def overrun(out):
        out.fill_(1)
        torch.as_strided(out, (out.numel() + 3,), (1,)).fill_(1)   # three elements past the end

    res = run_checks(fill_exercise, overrun, quiet=True)
    assert "wrote outside its output: 3 element(s) after" in _lines(res)[0]

    def underrun(out):
        torch.as_strided(out, (21,), (1,), out.storage_offset() - 1).fill_(1)

    assert "element(s) before" in _lines(run_checks(fill_exercise, underrun, quiet=True))[0]


def test_grader_never_raises_on_garbage():
    for junk in (None, 3, "x", object()):
        res = run_checks(MERGE, lambda *a, j=junk: j, quiet=True)
        assert res.failed == res.total


def test_check_accepts_function_and_name(capsys):
    @core.exercise("lab02.merge")
    def merge(a, b):
        raise TodoError("implement lab02.merge")

    assert core.check(merge).todo
    assert core.check("lab02.merge").todo
    assert "📝 TODO" in capsys.readouterr().out
    f = core.use("lab02.merge")
    assert f is core.reference("lab02.merge")
    assert "the reference solution runs in its place" in capsys.readouterr().out
    wrong = core.exercise("lab02.merge")(WRONG_MERGE["plain average"])
    assert core.use("lab02.merge", quiet=True) is core.reference("lab02.merge")
    right = core.exercise("lab02.merge")(lambda a, b: core.reference("lab02.merge")(a, b))
    assert core.use("lab02.merge", quiet=True) is right is not wrong
    core._LEARNER.pop("lab02.merge", None)
