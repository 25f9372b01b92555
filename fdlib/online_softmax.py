r"""Online softmax: the partial state of attention over a block of keys, and how two states merge.

Attention of one query over a set of keys :math:`J` is fully described by three numbers per query
(plus a vector):

* :math:`m = \max_{j\in J} s_j`  - the running max (kept so that no exponential overflows);
* :math:`\ell = \sum_{j\in J} e^{s_j - m}`  - the softmax denominator, measured relative to m;
* :math:`\tilde O = \sum_{j\in J} e^{s_j - m}\, v_j`  - the unnormalised output.

Equivalently (O, lse) with :math:`O = \tilde O/\ell` and :math:`\text{lse} = m + \log\ell`.
An empty block is :math:`(m, \ell, \tilde O) = (-\infty, 0, 0)`, i.e. lse = -inf.

Merging the states of two disjoint key sets A and B:

.. math::
    m = \max(m_A, m_B),\quad
    \ell = \ell_A e^{m_A - m} + \ell_B e^{m_B - m},\quad
    \tilde O = \tilde O_A e^{m_A - m} + \tilde O_B e^{m_B - m}

The factors :math:`e^{m_{old} - m}` (the *rescale*) are at most 1, so nothing overflows however large
the logits are. The merge is associative and commutative: splitting the keys any way and merging in any
order gives the same softmax, which is what lets Flash-Decoding cut the sequence across programs.
The Triton kernels do exactly this arithmetic (``fdlib.kernels.tile``); this module is the PyTorch
version the labs build and test first.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

NEG_INF = float("-inf")


class State(NamedTuple):
    """Partial attention state over some keys. Shapes: m, l ``[...]``; o_tilde ``[..., D]``."""
    m: torch.Tensor
    l: torch.Tensor
    o_tilde: torch.Tensor

    def output(self) -> torch.Tensor:
        """O = Õ / ℓ (0 where the block was empty)."""
        l = torch.where(self.l == 0, torch.ones_like(self.l), self.l)
        return self.o_tilde / l[..., None]

    def lse(self) -> torch.Tensor:
        """lse = m + log ℓ (-inf where the block was empty)."""
        return torch.where(self.l == 0, torch.full_like(self.m, NEG_INF),
                           _finite(self.m) + torch.log(torch.where(self.l == 0, torch.ones_like(self.l), self.l)))


def _finite(m: torch.Tensor) -> torch.Tensor:
    """m with -inf replaced by 0: the reference point used when a whole block is empty (avoids -inf - -inf)."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def empty_state(shape, d, dtype=torch.float32, device="cpu") -> State:
    return State(torch.full(shape, NEG_INF, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros((*shape, d), dtype=dtype, device=device))


def block_state(s: torch.Tensor, v: torch.Tensor) -> State:
    """State of one block from its scores ``s [..., N]`` (-inf marks a masked key) and values ``v [..., N, D]``."""
    m = s.amax(dim=-1)
    p = torch.exp(s - _finite(m)[..., None])
    return State(m, p.sum(dim=-1), torch.matmul(p[..., None, :], v)[..., 0, :])


def merge(a: State, b: State) -> State:
    """Merge two partial states (math in the module docstring). Associative, commutative, -inf safe."""
    m = torch.maximum(a.m, b.m)
    ref = _finite(m)
    alpha, beta = torch.exp(a.m - ref), torch.exp(b.m - ref)
    return State(m, a.l * alpha + b.l * beta, a.o_tilde * alpha[..., None] + b.o_tilde * beta[..., None])


def merge_lse(o: torch.Tensor, lse: torch.Tensor, dim: int = 0):
    r"""Merge normalised partials along ``dim``: :math:`O = \sum_i w_i O_i` with
    :math:`w_i = e^{\text{lse}_i - \text{lse}}`, :math:`\text{lse} = \log\sum_i e^{\text{lse}_i}`.

    ``o`` has one more (last) dimension than ``lse``. Splits with lse = -inf get weight 0; if every split is
    empty the result is O = 0, lse = -inf. This is the stage-2 reduction of Flash-Decoding.
    """
    dim = dim % lse.dim()
    lse_max = lse.amax(dim=dim, keepdim=True)
    w = torch.exp(lse - _finite(lse_max))
    total = w.sum(dim=dim)
    safe = torch.where(total == 0, torch.ones_like(total), total)
    o = torch.where(torch.isneginf(lse)[..., None], torch.zeros((), dtype=o.dtype, device=o.device), o)
    out = (w[..., None] * o).sum(dim=dim) / safe[..., None]   # an empty split's O never enters (0·NaN is NaN)
    lse_out = torch.where(total == 0, torch.full_like(total, NEG_INF), _finite(lse_max.squeeze(dim)) + torch.log(safe))
    return out, lse_out


def blockwise_attention(q, k, v, block: int, scale: float, length: int | None = None) -> State:
    r"""Attention of queries ``q [..., D]`` over keys ``k, v [..., L, D]``, one block of ``block`` keys at a time.

    Keys at positions >= ``length`` are masked. Returns the final :class:`State`; ``state.output()`` equals
    ``softmax(q kᵀ·scale) v`` and ``state.lse()`` its log-sum-exp.
    """
    L = k.shape[-2]
    length = L if length is None else length
    state = empty_state(q.shape[:-1], v.shape[-1], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for start in range(0, L, block):
        kb, vb = k[..., start:start + block, :], v[..., start:start + block, :]
        s = torch.matmul(q[..., None, :].to(state.m.dtype), kb.to(state.m.dtype).transpose(-1, -2))[..., 0, :] * scale
        pos = torch.arange(start, start + kb.shape[-2], device=q.device)
        s = s.masked_fill(pos >= length, NEG_INF)
        state = merge(state, block_state(s, vb.to(state.m.dtype)))
    return state
