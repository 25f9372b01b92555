"""Lab 07 reference solutions: a fixed-order merge, FlashDecoding++'s unified-max partial, and the bug zoo fixed."""
import math  # noqa: F401  (available to the solutions, as in the notebook)

import torch

from fdlib.grading import solution


@solution("lab07.fixed_order_merge")
def fixed_order_merge(o, lse, arrival):
    """Merge the S partials of one row left to right in split order (0, 1, ..., S-1), whatever `arrival` says."""
    m = lse.max()                                               # the max does not depend on any order
    ref = m if torch.isfinite(m) else torch.zeros_like(m)       # all empty: a finite point, no -inf - -inf
    num = torch.zeros_like(o[0])
    den = torch.zeros_like(m)
    for i in range(o.shape[0]):                                 # split order, never arrival order
        w = torch.exp(lse[i] - ref)                             # 0 for an empty split
        if w > 0:
            num = num + w * o[i]
            den = den + w
    if den == 0:
        return torch.zeros_like(o[0]), torch.full_like(m, float("-inf"))
    return num / den, ref + torch.log(den)


@solution("lab07.unified_max_partial")
def unified_max_partial(s, v, phi, w_lo, w_hi):
    """(Õ, ℓ, overflow) of one split with the fixed scale phi instead of the split's max."""
    x = s.float() - phi                                         # -inf for a masked key
    finite = torch.isfinite(x)
    overflow = bool(((x > w_hi) | (x < w_lo))[finite].any())    # some key outside [w_lo, w_hi]
    p = torch.where(finite, torch.exp(x), torch.zeros_like(x))  # e^(s - phi), 0 for masked keys
    return p @ v.float(), p.sum(), overflow                     # float32 accumulation


@solution("lab07.bug_nan_merge")
def bug_nan_merge(o_a, lse_a, o_b, lse_b):
    """Merge two partials; a row empty in both (lse -inf, -inf) gives o = 0, lse = -inf instead of NaN."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # FIX: -inf - (-inf) is NaN; use 0 there
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    den = w_a + w_b
    safe = torch.where(den == 0, torch.ones_like(den), den)     # FIX: 0 / 0 is NaN; the numerator is 0 there
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / safe[..., None]
    return o, m + torch.log(den)                                # log(0) = -inf for an empty row


@solution("lab07.bug_lse_base2")
def bug_lse_base2(o, lse2):
    """Merge partials whose lse is in base 2: weights 2^(lse2 - m), the merged lse converted back to base e."""
    m = lse2.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp2(lse2 - m)                                    # FIX: base 2 weights for base 2 lse
    den = w.sum(0)
    out = (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out, (m + torch.log2(den)) * math.log(2.0)          # FIX: lse = ln(2) * lse2


@solution("lab07.bug_strided_partials")
def bug_strided_partials(o, lse):
    """Merge partials of any layout: each element is read at its own strides."""
    def load(t):
        return torch.as_strided(t, t.shape, t.stride(), t.storage_offset())   # FIX: the tensor's own strides

    o, lse = load(o), load(lse)
    m = lse.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    den = w.sum(0)
    out = (w[..., None] * o).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out, m + torch.log(den)


@solution("lab07.bug_empty_splits")
def bug_empty_splits(q, k, v, length, splits, block, scale):
    """Flash-Decoding of one row; an empty split stores (O, lse) = (0, -inf) and weighs 0 in the merge."""
    chunk = -(-max(length, 1) // splits)
    chunk = -(-chunk // block) * block
    o_parts, lse_parts = [], []
    for i in range(splits):
        lo, hi = i * chunk, min((i + 1) * chunk, length)
        if hi <= lo:                                            # FIX: more splits than tiles: an empty split
            o_parts.append(torch.zeros(v.shape[1]))
            lse_parts.append(torch.tensor(float("-inf")))
            continue
        s = (k[lo:hi].float() @ q.float()) * scale
        m = s.max()
        p = torch.exp(s - m)
        l = p.sum()
        o_parts.append((p @ v[lo:hi].float()) / l)
        lse_parts.append(m + torch.log(l))
    o_parts, lse = torch.stack(o_parts), torch.stack(lse_parts)
    m = lse.max()
    m = m if torch.isfinite(m) else torch.zeros_like(m)
    w = torch.exp(lse - m)
    den = w.sum()
    if den == 0:                                                # FIX: length 0: every split empty
        return torch.zeros(v.shape[1]), torch.tensor(float("-inf"))
    return (w[:, None] * o_parts).sum(0) / den, m + torch.log(den)


@solution("lab07.bug_fp16_sum")
def bug_fp16_sum(s, v, block):
    """One split's (m, ℓ, Õ), tile by tile, with float32 accumulators."""
    n, D = v.shape
    m = s.max() if n else torch.tensor(float("-inf"))
    ref = m if torch.isfinite(m) else torch.zeros_like(m)
    l = torch.zeros((), dtype=torch.float32)                    # FIX: float32 accumulators
    o = torch.zeros(D, dtype=torch.float32)
    for lo in range(0, n, block):
        p = torch.exp(s[lo:lo + block] - ref)
        l = l + p.sum()
        o = o + p @ v[lo:lo + block].float()
    return m.float(), l, o
