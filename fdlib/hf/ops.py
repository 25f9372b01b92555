"""``torch.ops.fdlib.hf_decode``: the decode attention of a :class:`~fdlib.hf.DecodeCache` as one opaque op, so
``torch.compile`` traces a decode step without a graph break (fdlib's launches stay outside the traced graph).

The op names its cache by ``cache.key`` (an int: ops take no Python objects) and runs the cache's plan for
q_len = q.shape[1] and ``scale``; plans are made once per (q_len, scale) by the cache, on their first use.
"""
from __future__ import annotations

import torch

from ..compiled import no_gradient
from .cache import CACHES


@torch.library.custom_op("fdlib::hf_decode", mutates_args=())
def hf_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
              block_table: torch.Tensor | None, cache_key: int, scale: float) -> torch.Tensor:
    """out ``[B, T, H_q, D]`` (contiguous, whatever q's strides) of :func:`fdlib.hf.attention.decode` (q
    ``[B, T, H_q, D]``)."""
    cache = CACHES.get(cache_key)
    if cache is None:
        raise RuntimeError(f"fdlib::hf_decode: no live DecodeCache with key {cache_key}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return cache.plan(q.shape[1], scale).run(q, k_cache, v_cache, lengths, out=out, block_table=block_table)


@hf_decode.register_fake
def _(q, k_cache, v_cache, lengths, block_table, cache_key, scale):
    """Shapes only: a contiguous out of q's shape and dtype."""
    return q.new_empty(q.shape)


no_gradient(hf_decode)   # a model run outside no_grad: its q requires grad, as eagerly
