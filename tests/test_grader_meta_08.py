"""The Lab 08 graders are tested too: untouched stubs and known-wrong key limits, verify attentions and
cross-rank merges (on gloo) must fail their checks; variants written differently from the references pass."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from fdlib.course.grading import core
from fdlib.course.grading.core import run_checks
from fdlib.course.grading.lab08 import GlooRunError, run_on_gloo
from helpers import assert_one_todo_line, not_implemented_stub, todo_stub

LIMITS, VERIFY, MERGE = "lab08.causal_limits", "lab08.verify_attention", "lab08.cross_rank_merge"
needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


# ---------------------------------------------------------------------------------------------- causal_limits
def _limits(cache_seqlens, q_len, *, rule="bottom-right", clamp=True):
    L = cache_seqlens.long()[:, None]
    t = torch.arange(q_len)[None, :]
    n = {"bottom-right": L - q_len + 1 + t, "off by one": L - q_len + t, "top-left": t + 1 + 0 * L,
         "no mask": L + 0 * t, "reversed": L - t}[rule]
    return n.clamp_min(0) if clamp else n


WRONG_LIMITS = {
    "L - q_len + t (own token left out)": lambda *a: _limits(*a, rule="off by one"),
    "top-left aligned (t + 1)": lambda *a: _limits(*a, rule="top-left"),
    "every token sees L_b": lambda *a: _limits(*a, rule="no mask"),
    "tokens in reverse order (L_b - t)": lambda *a: _limits(*a, rule="reversed"),
    "no clamp at 0": lambda *a: _limits(*a, clamp=False),
    "float counts": lambda *a: _limits(*a).double(),
}


def test_limits_variant_passes():
    def loops(cache_seqlens, q_len):
        return torch.tensor([[max(0, int(L) - q_len + 1 + t) for t in range(q_len)] for L in cache_seqlens])
    assert run_checks(LIMITS, _limits, quiet=True).ok
    assert run_checks(LIMITS, loops, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_LIMITS, ids=list(WRONG_LIMITS))
def test_wrong_limits_fail(wrong):
    assert run_checks(LIMITS, WRONG_LIMITS[wrong], quiet=True).failed > 0, wrong


# ---------------------------------------------------------------------------------------------- verify_attention
def _verify(q, k_cache, v_cache, cache_seqlens, scale, *, rule="bottom-right", head_map="div", stable=True,
            acc=torch.float64):
    """Per query token, written differently from the reference solution (a loop over t, softmax by hand)."""
    B, T, H_q, D = q.shape
    L, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    heads = torch.arange(H_q)
    kv = heads // group if head_map == "div" else heads % H_kv
    n = _limits(cache_seqlens, T, rule=rule)
    outs, lses = [], []
    for t in range(T):
        s = torch.einsum("bhd,blhd->bhl", q[:, t].to(acc), k_cache.to(acc)[:, :, kv]) * scale
        s = s.masked_fill(~(torch.arange(L)[None, :] < n[:, t, None])[:, None, :], -math.inf)
        m = s.amax(-1, keepdim=True)
        if stable:
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        else:
            m = torch.zeros_like(m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        vv = torch.nan_to_num(v_cache.to(acc)[:, :, kv])
        outs.append(torch.einsum("bhl,blhd->bhd", p, vv) / torch.where(l == 0, torch.ones_like(l), l))
        lses.append((m + torch.log(l))[..., 0])
    return torch.stack(outs, 1), torch.stack(lses, 1)


WRONG_VERIFY = {
    "no causal mask (every token sees L_b keys)": lambda *a: _verify(*a, rule="no mask"),
    "top-left aligned mask (is_causal on a square)": lambda *a: _verify(*a, rule="top-left"),
    "own token left out (L_b - q_len + t keys)": lambda *a: _verify(*a, rule="off by one"),
    "GQA h % H_kv": lambda *a: _verify(*a, head_map="mod"),
    "no max subtraction": lambda *a: _verify(*a, stable=False),
    "float32 result": lambda *a: _verify(*a, acc=torch.float32),
    "NaN on empty rows": lambda *a: (lambda o, l: (torch.where(torch.isneginf(l)[..., None],
                                                               torch.full_like(o, math.nan), o), l))(*_verify(*a)),
}


def test_verify_variant_passes():
    assert run_checks(VERIFY, _verify, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_VERIFY, ids=list(WRONG_VERIFY))
def test_wrong_verify_fails(wrong):
    assert run_checks(VERIFY, WRONG_VERIFY[wrong], quiet=True).failed > 0, wrong


def test_verify_mismatch_names_the_query_token():
    line = next(o.line() for o in run_checks(VERIFY, WRONG_VERIFY["own token left out (L_b - q_len + t keys)"],
                                             quiet=True).outcomes if o.status == "fail")
    assert "query token t=" in line and "sees" in line


# ---------------------------------------------------------------------------------------------- cross_rank_merge
def _merge_allreduce(o, lse, group=None):
    """The other correct merge: all-reduce MAX of lse, then SUM of the weighted outputs and weights."""
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    packed = torch.cat([w[..., None] * o, w[..., None]], -1)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    total = packed[..., -1]
    safe = torch.where(total == 0, torch.ones_like(total), total)
    return packed[..., :-1] / safe[..., None], torch.where(total == 0, torch.full_like(total, -math.inf),
                                                           m + torch.log(safe))


def _gather(o, lse, group):
    world = dist.get_world_size(group)
    os_, ls = [torch.empty_like(o) for _ in range(world)], [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(os_, o, group=group)
    dist.all_gather(ls, lse, group=group)
    return torch.stack(os_), torch.stack(ls)


def _merge_no_collective(o, lse, group=None):
    return o.clone(), lse.clone()


def _merge_average(o, lse, group=None):
    O, Ls = _gather(o, lse, group)
    return O.mean(0), Ls.amax(0)


def _merge_no_max(o, lse, group=None):
    O, Ls = _gather(o, lse, group)
    w = torch.exp(Ls)                                         # overflows at lse = 1000
    total = w.sum(0)
    return (w[..., None] * O).sum(0) / total[..., None], torch.log(total)


def _merge_nan_on_empty(o, lse, group=None):
    O, Ls = _gather(o, lse, group)
    m = Ls.amax(0)                                            # -inf for a row nobody saw: e^(-inf - -inf) = NaN
    w = torch.exp(Ls - m)
    total = w.sum(0)
    return (w[..., None] * O).sum(0) / total[..., None], m + torch.log(total)


def _merge_lse_is_max(o, lse, group=None):
    from fdlib.online_softmax import merge_lse
    O, Ls = _gather(o, lse, group)
    out, _ = merge_lse(O, Ls, dim=0)
    return out, Ls.amax(0)


def _merge_rank0_only(o, lse, group=None):
    """Right on rank 0 only (reduce to rank 0, others keep their own partial)."""
    from fdlib.online_softmax import merge_lse
    O, Ls = _gather(o, lse, group)
    return merge_lse(O, Ls, dim=0) if dist.get_rank(group) == 0 else (o.clone(), lse.clone())


WRONG_MERGE = {
    "no collective (own partial)": _merge_no_collective,
    "plain average of O": _merge_average,
    "weights e^lse without the max": _merge_no_max,
    "max not made finite (NaN on rows nobody saw)": _merge_nan_on_empty,
    "lse = max of lse_rank": _merge_lse_is_max,
    "right on rank 0 only": _merge_rank0_only,
}


@needs_gloo
def test_merge_variant_passes():
    assert run_checks(MERGE, _merge_allreduce, quiet=True).ok


@needs_gloo
@pytest.mark.parametrize("wrong", WRONG_MERGE, ids=list(WRONG_MERGE))
def test_wrong_merge_fails(wrong):
    res = run_checks(MERGE, WRONG_MERGE[wrong], quiet=True)
    assert res.failed > 0 and not res.todo, wrong


MERGE_CAUSE = {                             # what each wrong merge's first failure names
    "no collective (own partial)": "out is this rank's own partial: nothing combined the ranks",
    "plain average of O": "out is the plain average of the ranks' partials",
    "weights e^lse without the max": "rows that no rank saw (every lse_rank = −inf) come out NaN",
    "max not made finite (NaN on rows nobody saw)": "rows that no rank saw (every lse_rank = −inf) come out NaN",
    "lse = max of lse_rank": "lse is the largest lse_rank",
    "right on rank 0 only": "out is this rank's own partial",
}


@needs_gloo
@pytest.mark.parametrize("wrong", MERGE_CAUSE, ids=list(MERGE_CAUSE))
def test_a_wrong_merge_names_its_cause(wrong):
    """Not two numbers only ("192 of 192 values differ... expected -1.98665, got -0.466848"): the message says
    which mistake gives those numbers."""
    res = run_checks(MERGE, WRONG_MERGE[wrong], quiet=True)
    line = next(o.line() for o in res.outcomes if o.status == "fail")
    assert "Likely cause: " in line and MERGE_CAUSE[wrong] in line.split("Likely cause: ")[1], line


@needs_gloo
def test_the_overflow_of_unscaled_weights_is_named():
    """Weights without the max fail twice: NaN on rows nobody saw (above), and an overflow at lse = +1000."""
    res = run_checks(MERGE, _merge_no_max, quiet=True)
    line = next(o.line() for o in res.outcomes if o.status == "fail" and "+1000" in o.line())
    assert "Likely cause: the weights e^(lse_rank) overflow float32" in line, line


def _hangs(o, lse, group=None):
    if dist.get_rank(group) == 0:                             # only rank 0 enters the collective
        dist.all_reduce(lse.clone(), group=group)
    else:
        time.sleep(60)
    return o, lse


def _raises(o, lse, group=None):
    return o + torch.ones(3)


@needs_gloo
def test_gloo_runner_reports_hangs_and_errors():
    with pytest.raises(GlooRunError, match="did not finish"):
        run_on_gloo(lambda rank, world: _hangs(torch.zeros(1), torch.zeros(1)), 2, timeout_s=8)
    line = run_checks(MERGE, _raises, quiet=True).outcomes[0].line()
    assert line.startswith("❌ FAIL") and "rank 0: your function raised RuntimeError" in line and "Traceback" not in line


# ---------------------------------------------------------------------------------------------- stubs
@pytest.mark.parametrize("stub", [todo_stub, not_implemented_stub], ids=["todo()", "raise NotImplementedError"])
@pytest.mark.parametrize("name", [LIMITS, VERIFY, MERGE])
def test_stub_is_todo(name, stub, capsys):
    if name == MERGE and not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs gloo")
    res = run_checks(name, stub)
    assert_one_todo_line(res, capsys.readouterr().out, name)


def test_solution_sources_paste_into_a_cell():
    for name in (LIMITS, VERIFY, MERGE):
        assert core.solution_source(name).startswith(f'@exercise("{name}")\ndef ')
