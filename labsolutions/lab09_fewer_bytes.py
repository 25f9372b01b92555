"""Lab 09 reference solution: the dequantizing tile load of an 8-bit KV cache, in Triton."""
import triton
import triton.language as tl

from fdlib.grading import solution


@solution("lab09.dequant_tile")
@triton.jit
def dequant_tile(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    """x[j, :] = float(stored[j, :]) * s_j, float32 [N, D]; the rows of keys past the end are 0."""
    x = tl.load(X + offs, mask=valid[:, None], other=0)          # [N, D] bytes; nothing read past the end
    x = x.to(KV_DTYPE, bitcast=True).to(tl.float32)              # the bytes as int8 or e4m3, then their value
    if GRANULARITY == "tensor":
        x = x * tl.load(S)                                        # one scale for the whole cache
    elif GRANULARITY == "head":
        x = x * tl.load(S + h)                                    # the scale of this tile's KV head
    else:
        s = tl.load(S + s_offs, mask=valid, other=0.0)            # [N]: one scale per key
        x = x * s[:, None]                                        # row j times key j's scale
    return x
