"""Lab 03 reference solution: the tile update of the split-KV (stage-1) kernel, in Triton."""
import triton
import triton.language as tl

from fdlib.grading import solution


@solution("lab03.tile_update")
@triton.jit
def tile_update(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    """(m, ℓ, Õ) after one more tile. q [G, D]; k, v [N, D]; valid [N]; m, ℓ [G]; Õ [G, D]; m in base 2."""
    if FP32_DOT:       # float32 inputs: exact float32 products (no TF32)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:              # fp16/bf16 inputs: tensor cores, float32 accumulation
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))      # scores in base-2 units; masked keys -inf
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)            # nothing seen yet: any finite reference
    alpha = tl.exp2(m - m_ref)                                      # rescale of the old state, <= 1
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc
