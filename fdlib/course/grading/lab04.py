r"""Checks for Lab 04: the stage-2 kernel of the two-stage reduction.

``lab04.stage2_kernel`` is a ``@triton.jit`` kernel with the signature of
:func:`fdlib.kernels.stage2.stage2_kernel`, launched by :func:`fdlib.kernels.stage2.run_stage2` on a grid
``(B, H_q)``. Program (b, h) merges its row's partials :math:`(O_i, \text{lse}_i)`, i < splits:

.. math::  \text{lse} = \log\sum_i e^{\text{lse}_i},\qquad \text{out} = \sum_i e^{\text{lse}_i-\text{lse}}\,O_i

Empty splits (lse_i = −inf, O_i = 0) weigh 0; a row whose splits are all empty gives out = 0, lse = −inf.
The launcher passes ``BLOCK_S = combine_blocks(1, splits, BLOCK_D)[1]``: the next power of two ≥ splits,
but at most 8192 / BLOCK_D (64 splits for D = 128), so with many splits the kernel must loop over them.

Checks launch the learner's kernel through ``run_stage2(..., kernel=fn)`` on partials made by fdlib's
stage 1 and on synthetic partials, and compare out and lse with a float64 merge (or
:func:`fdlib.reference_attention`). Outputs live in guarded buffers: writing past them fails.
"""
from __future__ import annotations

import torch

from fdlib import runtime
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.reference import reference_attention

from .core import TOL, CheckFailure, GuardedBuffer, assert_close, check_case, randn
from .lab03 import split_kv_problem
from .triton_exercise import launch, triton_stub

NAME = "lab04.stage2_kernel"

STUB = triton_stub(NAME, '''
@exercise("lab04.stage2_kernel")
@triton.jit
def stage2_kernel(O_PART, LSE_PART, OUT, LSE, n_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, stride_sb, stride_sh,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the splits of row (b, h) = (program_id(0), program_id(1)).

    Partial i of the row: O_i (D float32) at O_PART + b*stride_pb + h*stride_ph + i*stride_ps + d,
    lse_i (float32) at LSE_PART + b*stride_lb + h*stride_lh + i, for i < n_splits.
    Write out = sum_i e^(lse_i - lse) O_i (in OUT's dtype: .to(OUT.dtype.element_ty)) at
    OUT + b*stride_ob + h*stride_oh + d (d < D), and lse = log sum_i e^(lse_i) at LSE + b*stride_sb + h*stride_sh.
    Empty splits have lse_i = -inf and O_i = 0; if all are empty: out = 0, lse = -inf (no NaN).

    Launched by fdlib.kernels.stage2.run_stage2 with BLOCK_D = next power of two >= max(D, 16) (mask d < D)
    and BLOCK_S = min(next power of two >= n_splits, 8192 // BLOCK_D): for D = 128 that is at most 64, so
    with more than 64 splits BLOCK_S < n_splits and you must loop over the splits in blocks of BLOCK_S
    (for s0 in range(0, n_splits, BLOCK_S)), carrying a running max like the tile update of Lab 03.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    # TODO: load lse_i and O_i (masked: split < n_splits, d < D), subtract the max before tl.exp,
    #       normalise by the sum of the weights, store out and lse.
''')


def merge_reference(o_part: torch.Tensor, lse_part: torch.Tensor):
    """(out, lse) in float64: lse = logsumexp_i lse_i, out = Σ_i e^(lse_i − lse) O_i; all-empty rows give (0, −inf)."""
    o, lse_i = o_part.double().cpu(), lse_part.double().cpu()
    lse = torch.logsumexp(lse_i, dim=-1)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lse_i - ref[..., None])
    return (w[..., None] * o).sum(-2), lse


def _stage2(impl, o_part, lse_part, dtype):
    """Run the learner's kernel through run_stage2 into guarded buffers; returns (out, lse) on the CPU."""
    B, H, S, D = o_part.shape
    dev = runtime.DEVICE
    out = GuardedBuffer((B, H, D), dtype=dtype, device=dev, fill=float("nan"))
    lse = GuardedBuffer((B, H), dtype=torch.float32, device=dev, fill=float("nan"))
    o_in, l_in = o_part.to(dev).contiguous(), lse_part.to(dev).contiguous()
    o_keep, l_keep = o_in.clone(), l_in.clone()
    launch("stage 2 with your kernel", lambda: run_stage2(o_in, l_in, out.view, lse.view, kernel=impl))
    out.verify("out"), lse.verify("lse")
    if not (torch.equal(o_in.nan_to_num(), o_keep.nan_to_num()) and torch.equal(l_in.nan_to_num(), l_keep.nan_to_num())):
        raise CheckFailure("your kernel wrote into the partials O_PART / LSE_PART (they are inputs)")
    return out.view.cpu(), lse.view.cpu()


def _synthetic(impl, gen, *, B, H, S, D, spread=3.0, empty=(), dtype=torch.float32, lse_tol=1e-4):
    """Random partials: O_i ~ N(0, 1), lse_i ~ spread·N(0, 1); ``empty`` lists (b, h, i) (i=None: whole row)."""
    o = randn(gen, B, H, S, D)
    lse = randn(gen, B, H, S, scale=spread)
    for b, h, i in empty:
        sl = (b, h) if i is None else (b, h, i)
        lse[sl] = float("-inf")
        o[sl] = 0.0
    got_o, got_l = _stage2(impl, o, lse, dtype)
    ref_o, ref_l = merge_reference(o, lse)
    atol, rtol = TOL[dtype]
    assert_close(got_o, ref_o, f"out ({S} splits)", atol, rtol)
    assert_close(got_l, ref_l, "lse", lse_tol, 1e-6)


def _from_stage1(impl, gen, *, B, H_q, H_kv, D, L_max, splits, lengths=None, dtype=torch.float32):
    """Partials from fdlib's stage 1, merged by the learner's stage 2; compared with the attention reference."""
    q, k, v, lens, scale, chunk, cfg = split_kv_problem(gen, B=B, H_q=H_q, H_kv=H_kv, D=D, L_max=L_max,
                                                        splits=splits, lengths=lengths, dtype=dtype)
    o_part, lse_part = run_stage1(q, k, v, lens, scale=scale, chunk=chunk, splits=splits, cfg=cfg)
    got_o, got_l = _stage2(impl, o_part, lse_part, dtype)
    ref_o, ref_l = reference_attention(q, k, v, lens, scale)
    atol, rtol = TOL[dtype]
    assert_close(got_o, ref_o, f"out ({splits} splits of {chunk} keys from fdlib's stage 1)", atol, rtol)
    assert_close(got_l, ref_l, "lse", 1e-4, 1e-5)


# ---------------------------------------------------------------------------------------------- the checks
@check_case(NAME, "partials from fdlib's stage 1: B=2, H_q=4, L=64 in 4 splits, D=32 -> attention", points=2)
def _st_basic(impl, gen):
    _from_stage1(impl, gen, B=2, H_q=4, H_kv=2, D=32, L_max=64, splits=4)


@check_case(NAME, "float16 output, head dim 80 (BLOCK_D = 128: mask d < D), ragged lengths 50 and 3")
def _st_fp16(impl, gen):
    _from_stage1(impl, gen, B=2, H_q=2, H_kv=1, D=80, L_max=50, splits=3, lengths=[50, 3], dtype=torch.float16)


@check_case(NAME, "a single split: out = O_0, lse = lse_0")
def _st_single(impl, gen):
    _synthetic(impl, gen, B=2, H=3, S=1, D=16)


@check_case(NAME, "synthetic partials with different lse: weights e^(lse_i − lse), 5 splits", points=2)
def _st_weights(impl, gen):
    _synthetic(impl, gen, B=2, H=2, S=5, D=32, spread=2.0)


@check_case(NAME, "empty splits (lse=−inf, O=0) weigh 0; a row of only empty splits gives out=0, lse=−inf")
def _st_empty(impl, gen):
    _synthetic(impl, gen, B=2, H=2, S=4, D=16, empty=[(0, 0, 0), (0, 0, 3), (1, 1, None), (0, 1, 1)])


@check_case(NAME, "huge lse gaps (±1e4 between splits): subtract the max before exp, no overflow, no NaN")
def _st_huge(impl, gen):
    _synthetic(impl, gen, B=1, H=2, S=4, D=16, spread=1e4, lse_tol=1e-2)


@check_case(NAME, "more splits than one block: 100 splits, D=128 (BLOCK_S=64 < splits: loop over blocks)", points=2)
def _st_many(impl, gen):
    _synthetic(impl, gen, B=1, H=2, S=100, D=128, spread=2.0, empty=[(0, 1, 99)])


@check_case(NAME, "20 splits with large positive lse (~ 100 .. 1000): no overflow in e^(lse_i)")
def _st_big(impl, gen):
    o = randn(gen, 1, 2, 20, 16)
    lse = 100.0 + torch.rand(1, 2, 20, generator=gen) * 900.0
    got_o, got_l = _stage2(impl, o, lse, torch.float32)
    ref_o, ref_l = merge_reference(o, lse)
    assert_close(got_o, ref_o, "out (20 splits)", 2e-5, 2e-5)
    assert_close(got_l, ref_l, "lse", 1e-3, 1e-6)
