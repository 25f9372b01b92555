"""Lab 02 reference solutions: online softmax over blocks of keys, and the merge of two partial states."""
import math  # noqa: F401  (available to the solutions, as in the notebook)

import torch

from fdlib.grading import solution
from fdlib.online_softmax import State


@solution("lab02.online_softmax")
def online_softmax(q, k, v, block, scale):
    """(m, ℓ, Õ) of one query q [D] over keys k [L, D] and values v [L, D], `block` keys at a time."""
    L, D = k.shape
    m = torch.tensor(float("-inf"))        # running max
    l = torch.tensor(0.0)                  # running denominator, relative to m
    o = torch.zeros(D)                     # running unnormalised output Õ, relative to m
    for start in range(0, L, block):
        s = (k[start:start + block].float() @ q.float()) * scale          # scores of this block
        m_new = torch.maximum(m, s.max())
        ref = m_new if torch.isfinite(m_new) else torch.tensor(0.0)       # all -inf so far: any finite reference
        alpha = torch.exp(m - ref)                                        # rescale e^(m_old - m_new), <= 1
        p = torch.exp(s - ref)
        l = l * alpha + p.sum()
        o = o * alpha + p @ v[start:start + block].float()
        m = m_new
    return State(m, l, o)


@solution("lab02.merge")
def merge(a, b):
    """The state of the union of two disjoint key sets; rows of m, ℓ [N] and Õ [N, D] (any leading shape works)."""
    m = torch.maximum(a.m, b.m)
    ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)            # both empty: avoid -inf - (-inf)
    alpha, beta = torch.exp(a.m - ref), torch.exp(b.m - ref)
    return State(m, a.l * alpha + b.l * beta, a.o_tilde * alpha[..., None] + b.o_tilde * beta[..., None])
