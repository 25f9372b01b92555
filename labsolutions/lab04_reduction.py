"""Lab 04 reference solution: the stage-2 kernel that merges each row's split partials with log-sum-exp."""
import triton
import triton.language as tl

from fdlib.grading import solution


@solution("lab04.stage2_kernel")
@triton.jit
def stage2_kernel(O_PART, LSE_PART, OUT, LSE, n_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, stride_sb, stride_sh,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row (b, h): lse = log Σ_i e^(lse_i), out = Σ_i e^(lse_i − lse) O_i, over the splits in blocks of BLOCK_S."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    o_row = O_PART + b * stride_pb + h * stride_ph
    lse_row = LSE_PART + b * stride_lb + h * stride_lh
    m = float("-inf")                              # running max of the lse_i seen so far
    den = 0.0                                      # Σ e^(lse_i − m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)    # Σ e^(lse_i − m) O_i
    for s0 in range(0, n_splits, BLOCK_S):         # BLOCK_S may be smaller than n_splits: loop over blocks
        split = s0 + offs_s
        mask_s = split < n_splits
        lse_i = tl.load(lse_row + split, mask=mask_s, other=float("-inf"))
        o_i = tl.load(o_row + split[:, None] * stride_ps + offs_d[None, :],
                      mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_i, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # all empty so far: any finite reference
        alpha = tl.exp(m - m_ref)
        w = tl.exp(lse_i - m_ref)                  # empty splits (lse_i = −inf) weigh 0
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_i, 0)
        m = m_new
    empty = den == 0.0                             # every split empty: out = 0, lse = −inf
    out = acc / tl.where(empty, 1.0, den)
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, den)))
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=mask_d)
    tl.store(LSE + b * stride_sb + h * stride_sh, lse)
