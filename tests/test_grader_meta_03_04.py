"""The graders of Labs 03 and 04 are tested too: the untouched stubs must print one TODO line, and known-wrong
Triton versions of the tile update (Lab 03) and of the stage-2 merge kernel (Lab 04) must fail their checks."""
from __future__ import annotations

import pytest

from fdlib.course.grading import core, lab03, lab04  # first: importing fdlib picks the runtime before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fdlib.course.grading.core import run_checks
from helpers import cell_function

TILE, STAGE2 = lab03.NAME, lab04.NAME


# ---------------------------------------------------------------------------------------------- stubs
# (the shipped stubs print one TODO line: tests/test_grader_meta.py::test_shipped_stub_is_todo)
@pytest.mark.parametrize("name", [TILE, STAGE2])
def test_solution_source_runs_as_a_cell(name):
    """What reveal_solution writes into a cell defines a function that passes (source from a Triton function)."""
    fn = cell_function(core.solution_source(name), name.split(".")[1])
    assert run_checks(name, fn, quiet=True).ok
    core._LEARNER.pop(name, None)


def test_edited_stub_is_not_todo():
    """Changing the code (not only comments) of the stub makes it a real attempt, graded as such."""
    src = lab03.STUB.replace("return m, l, acc", "return m, l * 2, acc")
    res = run_checks(TILE, cell_function(src, "tile_update"), quiet=True)
    assert not res.todo and res.failed > 0
    core._LEARNER.pop(TILE, None)


def test_not_a_triton_function():
    res = run_checks(TILE, lambda *a: a[4:7], quiet=True)
    assert res.failed == res.total and "expected a @triton.jit function" in res.outcomes[0].line()


# ---------------------------------------------------------------------------------------------- wrong tile updates
@triton.jit
def _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr, MISTAKE: tl.constexpr):
    """The tile update with one mistake switched on (MISTAKE = 0: none)."""
    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    if MISTAKE == 3:     # no tail mask: keys past the end keep their (zero-loaded) score
        s = s * qk_scale
    else:
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    if MISTAKE == 4:     # natural exp of base-2 scores
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
    else:
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
    if MISTAKE == 2:     # ℓ not rescaled
        l = l + tl.sum(p, 1)
    else:
        l = l * alpha + tl.sum(p, 1)
    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    if MISTAKE == 1:     # Õ not rescaled
        acc = acc + pv
    elif MISTAKE == 5:   # Õ accumulated in float16
        acc = (acc * alpha[:, None] + pv).to(tl.float16).to(tl.float32)
    else:
        acc = acc * alpha[:, None] + pv
    if MISTAKE == 6:     # m never updated
        m_new = m
    return m_new, l, acc


@triton.jit
def tile_ok(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 0)


@triton.jit
def tile_no_alpha_acc(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 1)


@triton.jit
def tile_no_alpha_l(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 2)


@triton.jit
def tile_no_mask(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 3)


@triton.jit
def tile_exp(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 4)


@triton.jit
def tile_fp16_acc(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 5)


@triton.jit
def tile_m_frozen(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    return _tile(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT, 6)


WRONG_TILE = {
    "acc not rescaled by alpha": tile_no_alpha_acc,
    "l not rescaled by alpha": tile_no_alpha_l,
    "no tail mask (masked keys not -inf)": tile_no_mask,
    "exp instead of exp2": tile_exp,
    "acc accumulated in float16": tile_fp16_acc,
    "m never updated": tile_m_frozen,
}


def test_tile_variant_passes():
    """The harness of the wrong versions is itself right when no mistake is switched on."""
    assert run_checks(TILE, tile_ok, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_TILE, ids=list(WRONG_TILE))
def test_wrong_tile_update_fails(wrong):
    res = run_checks(TILE, WRONG_TILE[wrong], quiet=True)
    assert not res.todo and res.failed > 0, f"the lab03 checks accept a tile update with: {wrong}"


# ---------------------------------------------------------------------------------------------- wrong stage 2
@triton.jit
def _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh,
           D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, MISTAKE: tl.constexpr):
    """Stage 2 with one mistake switched on (MISTAKE = 0: none)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    n_used = n_splits - 1 if MISTAKE == 3 else n_splits            # 3: drops the last split
    m = float("-inf")
    den = 0.0
    cnt = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    stop = BLOCK_S if MISTAKE == 6 else n_used                      # 6: assumes BLOCK_S >= splits (no loop)
    for s0 in range(0, stop, BLOCK_S):
        split = s0 + offs_s
        mask_s = split < n_used
        lse_i = tl.load(LSE_PART + b * stride_lb + h * stride_lh + split, mask=mask_s, other=float("-inf"))
        o_i = tl.load(O_PART + b * stride_pb + h * stride_ph + split[:, None] * stride_ps + offs_d[None, :],
                      mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        if MISTAKE == 2:   # 2: weights e^(lse_i), no max subtracted
            m_new = 0.0
        else:
            m_new = tl.maximum(m, tl.max(lse_i, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        w = tl.exp(lse_i - m_ref)
        if MISTAKE == 1:   # 1: plain average of the non-empty O_i
            w = tl.where(lse_i > float("-inf"), 1.0, 0.0)
            alpha = 1.0
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_i, 0)
        cnt += tl.sum(mask_s.to(tl.float32), 0)
        m = m_new
    empty = den == 0.0
    if MISTAKE == 4:       # 4: not normalised by the sum of the weights
        out = acc
    else:
        out = acc / tl.where(empty, 1.0, den)
    if MISTAKE == 5:       # 5: lse = max_i lse_i
        lse = m
    else:
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, den)))
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=mask_d)
    tl.store(LSE + b * stride_sb + h * stride_sh, lse)


@triton.jit
def s2_ok(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
          stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 0)


@triton.jit
def s2_average(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
               stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 1)


@triton.jit
def s2_no_max(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
              stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
              BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 2)


@triton.jit
def s2_drop_last(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                 stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 3)


@triton.jit
def s2_unnormalised(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                    stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 4)


@triton.jit
def s2_lse_max(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
               stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 5)


@triton.jit
def s2_no_loop(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
               stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr):
    _merge(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
           stride_ob, stride_oh, stride_sb, stride_sh, D, BLOCK_S, BLOCK_D, 6)


WRONG_STAGE2 = {
    "plain average of the O_i": s2_average,
    "weights e^(lse_i) without subtracting the max": s2_no_max,
    "drops the last split": s2_drop_last,
    "not normalised by the sum of weights": s2_unnormalised,
    "lse = max_i lse_i": s2_lse_max,
    "assumes BLOCK_S >= splits (no loop)": s2_no_loop,
}


def test_stage2_variant_passes():
    assert run_checks(STAGE2, s2_ok, quiet=True).ok


@pytest.mark.parametrize("wrong", WRONG_STAGE2, ids=list(WRONG_STAGE2))
def test_wrong_stage2_fails(wrong):
    res = run_checks(STAGE2, WRONG_STAGE2[wrong], quiet=True)
    assert not res.todo and res.failed > 0, f"the lab04 checks accept a stage-2 kernel that {wrong}"


def test_stage2_out_of_bounds_write_is_caught():
    """A kernel that stores BLOCK_D values per row without the d < D mask writes past `out` (D=80)."""
    res = run_checks(STAGE2, s2_unmasked, quiet=True)
    assert res.failed > 0 and any("wrote outside its out" in o.line() for o in res.outcomes)


@triton.jit
def s2_unmasked(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, tl.zeros([BLOCK_D], tl.float32).to(OUT.dtype.element_ty))
    tl.store(LSE + b * stride_sb + h * stride_sh, 0.0)


def test_learner_exception_is_a_fail_line():
    res = run_checks(STAGE2, s2_raises, quiet=True)
    assert res.failed == res.total and "raised" in res.outcomes[0].line() and "Traceback" not in res.outcomes[0].line()


@triton.jit
def s2_raises(O_PART, LSE_PART, OUT, LSE, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
              stride_ob, stride_oh, stride_sb, stride_sh, D: tl.constexpr, BLOCK_S: tl.constexpr,
              BLOCK_D: tl.constexpr):
    x = tl.load(O_PART + tl.arange(0, 3))   # arange of a non-power-of-two length: Triton refuses it
    tl.store(OUT, x)
