"""How many splits to cut each sequence into.

``method="split"`` uses the simple rule of Lab 03 (:func:`simple_rule`): enough programs for about two
per SM, never more splits than tiles. ``method="auto"``/``"unified"`` ask the cost model
(:mod:`fdlib.costmodel`) once it is available for this GPU.
"""
from __future__ import annotations

import triton

from . import runtime
from .kernels.config import MAX_SPLITS, tile_config

INTERPRETER_SMS = 8
"""The interpreter has no SMs; splitting rules pretend the CPU is a GPU this small so labs still split."""


def simple_rule(B: int, H_kv: int, L: int, sms: int, block_n: int) -> int:
    """splits = ⌈2·SMs / (B·H_kv)⌉, at most one split per tile and at most MAX_SPLITS."""
    want = triton.cdiv(2 * sms, max(B * H_kv, 1))
    return max(1, min(want, triton.cdiv(max(L, 1), block_n), MAX_SPLITS))


def choose_splits(p, L_cap, lens, method) -> int:
    sms = runtime.sm_count() or INTERPRETER_SMS
    if runtime.INTERPRET:
        sms = INTERPRETER_SMS
    return simple_rule(p.B, p.H_kv, L_cap, sms, tile_config().BLOCK_N)
