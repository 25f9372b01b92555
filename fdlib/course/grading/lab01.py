"""Checks for Lab 01: naive decode attention.

``lab01.naive_attention(q, k_cache, v_cache, cache_seqlens, scale) -> (out, lse)`` with
q ``[B, H_q, D]``, caches ``[B, L_max, H_kv, D]``, cache_seqlens ``[B]`` (int32); out ``[B, H_q, D]`` in q's dtype,
lse ``[B, H_q]`` float32. Query head h reads KV head ``h // group`` (group = H_q / H_kv). A sequence of length 0
gives out = 0 and lse = -inf. Every check compares with :func:`fdlib.reference_attention` (float64).
"""
from __future__ import annotations

import math

import torch

from fdlib.reference import reference_attention

from .core import TOL, assert_close, call, check_case, exercise_stub, expect_tensor, expect_tuple, randn

NAME = "lab01.naive_attention"

STUB = exercise_stub(NAME, '''
@exercise("lab01.naive_attention")
def naive_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """Decode attention, the obvious way.

    q [B, H_q, D]; k_cache, v_cache [B, L_max, H_kv, D]; cache_seqlens [B] (int32); scale: a float.
    Returns (out [B, H_q, D] in q's dtype, lse [B, H_q] float32). Query head h reads KV head h // group.
    Keys at positions >= cache_seqlens[b] are ignored; a sequence of length 0 gives out = 0, lse = -inf.
    """
    todo("lab01.naive_attention")
''')


def _case(impl, gen, *, B, H_q, H_kv, D, L_max, lengths=None, dtype=torch.float32, scale=None, spread=1.0,
          lse_tol=None):
    q = randn(gen, B, H_q, D, dtype=dtype, scale=spread)
    k = randn(gen, B, L_max, H_kv, D, dtype=dtype, scale=spread)
    v = randn(gen, B, L_max, H_kv, D, dtype=dtype)
    lens = torch.full((B,), L_max, dtype=torch.int32) if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    sc = 1.0 / math.sqrt(D) if scale is None else scale
    got = call(impl, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens, "scale": sc})
    out, lse = expect_tuple(got, "return value", 2, "out, lse")
    expect_tensor(out, "out", shape=(B, H_q, D), dtype=dtype, device=q.device)
    expect_tensor(lse, "lse", shape=(B, H_q), dtype=torch.float32, device=q.device)
    ref_o, ref_lse = reference_attention(q, k, v, lens, sc)
    atol, rtol = TOL[dtype]
    assert_close(out, ref_o, "out", atol, rtol)
    la = lse_tol if lse_tol is not None else 1e-4
    assert_close(lse, ref_lse, "lse", la, 1e-5)


@check_case(NAME, "one sequence, 4 heads, D=64, full length", points=2)
def _basic(impl, gen):
    _case(impl, gen, B=1, H_q=4, H_kv=4, D=64, L_max=48)


@check_case(NAME, "uses the given scale (scale=0.3, not 1/√D)")
def _scale(impl, gen):
    _case(impl, gen, B=2, H_q=2, H_kv=2, D=32, L_max=40, scale=0.3)


@check_case(NAME, "ragged lengths 1, 37, 64, 63 (keys past the length are ignored)", points=2)
def _ragged(impl, gen):
    _case(impl, gen, B=4, H_q=2, H_kv=2, D=32, L_max=64, lengths=[1, 37, 64, 63])


@check_case(NAME, "a sequence of length 0 gives out = 0 and lse = -inf (no NaN)")
def _empty(impl, gen):
    _case(impl, gen, B=3, H_q=2, H_kv=1, D=16, L_max=20, lengths=[0, 5, 0])


@check_case(NAME, "GQA group 3 (H_q=6, H_kv=2): head h reads KV head h // group", points=2)
def _gqa3(impl, gen):
    _case(impl, gen, B=2, H_q=6, H_kv=2, D=64, L_max=33, lengths=[33, 17])


@check_case(NAME, "GQA group 7, head dim 80 (H_q=14, H_kv=2)")
def _gqa7(impl, gen):
    _case(impl, gen, B=1, H_q=14, H_kv=2, D=80, L_max=50)


@check_case(NAME, "head dim 96, lengths not a multiple of 16")
def _d96(impl, gen):
    _case(impl, gen, B=2, H_q=4, H_kv=1, D=96, L_max=45, lengths=[45, 29])


@check_case(NAME, "huge logits (|score| ~ 1e4) stay finite and exact")
def _huge(impl, gen):
    _case(impl, gen, B=1, H_q=2, H_kv=2, D=16, L_max=30, scale=1.0, spread=30.0, lse_tol=5e-2)


@check_case(NAME, "float16 inputs, L=2048: accumulate in float32, return out in float16")
def _fp16(impl, gen):
    _case(impl, gen, B=1, H_q=2, H_kv=1, D=64, L_max=2048, dtype=torch.float16, lengths=[2000])


@check_case(NAME, "bfloat16 inputs: out in bfloat16, lse in float32")
def _bf16(impl, gen):
    _case(impl, gen, B=2, H_q=4, H_kv=2, D=32, L_max=100, dtype=torch.bfloat16, lengths=[100, 3])
