"""How many splits to cut each sequence into.

* On a GPU every method asks the cost model (:mod:`fdlib.costmodel`), for the unified kernel, so that
  ``"split"`` and ``"unified"`` run the same splits and compare like with like.
* In the interpreter there are no SMs to fill: a simple rule (:func:`simple_rule`, enough programs for
  about two per SM, never more splits than tiles) on a pretend GPU of 8 SMs, which still makes lab-sized
  problems split.
"""
from __future__ import annotations

from . import runtime
from .kernels.config import MAX_SPLITS, cdiv, tile_config

INTERPRETER_SMS = 8


def simple_rule(B: int, H_kv: int, L: int, sms: int, block_n: int) -> int:
    """splits = ⌈2·SMs / (B·H_kv)⌉, at most one split per tile and at most MAX_SPLITS."""
    want = cdiv(2 * sms, max(B * H_kv, 1))
    return max(1, min(want, cdiv(max(L, 1), block_n), MAX_SPLITS))


def choose_splits(p, L_cap) -> int:
    """Splits for a validated problem ``p`` (the same for every method), from its lengths as read on the host
    by validation (``p.lengths``); without them (validate=False, or no cache_seqlens) every sequence counts as
    L_cap long."""
    block_n = tile_config(p.D, L_cap, p.q.element_size(), rows=p.B * p.H_kv).BLOCK_N
    if runtime.INTERPRET:
        return simple_rule(p.B, p.H_kv, L_cap, INTERPRETER_SMS, block_n)
    import torch

    from . import costmodel
    from .gpus import live_gpu
    from .kernels.unified import compiled_resources
    gpu = live_gpu()
    lengths = p.lengths if p.lengths is not None else (L_cap,) * p.B
    cal = None
    if torch.cuda.is_current_stream_capturing():   # never calibrate (launch timing kernels) inside a capture
        cal = costmodel.calibration_cached(gpu) or costmodel.default_calibration(gpu)
    return costmodel.explain(p.B, p.H_q, p.H_kv, lengths, p.D, p.q.element_size(), gpu, "unified", cal=cal,
                             compiled=compiled_resources(p.q.dtype, p.D, p.group, block_n)).chosen
