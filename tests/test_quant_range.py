"""Scales far from 1 on 8-bit caches: per-token V scales with fp16 queries, where the weights times the scale
once went through fp16 before P·V (|V| ~ 1e-5 lost half the answer; a scale of 1e5 gave inf). Every method
against float64 attention over the dequantized cache, at the fp16 kernels' tolerance."""
from __future__ import annotations

import pytest
import torch

import fdlib
from fdlib import quant
from helpers import DEVICE
from test_quant import METHODS

ATOL_REL = 2e-2   # relative to max |O| of the reference: fp16 products, float32 accumulation


@pytest.mark.parametrize("kv_dtype", (torch.float8_e4m3fn, torch.int8))
@pytest.mark.parametrize("magnitude", (1e-5, 1e-4, 1e3))
@pytest.mark.parametrize("q_dtype", (torch.float16, torch.bfloat16))
def test_per_token_v_scales_keep_tiny_and_huge_values(kv_dtype, magnitude, q_dtype):
    g = torch.Generator().manual_seed(int(magnitude * 1e5) % 997 + (kv_dtype == torch.int8))
    B, H_q, H_kv, D, L_max = 2, 6, 2, 32, 45
    q = torch.randn(B, H_q, D, generator=g).to(q_dtype)
    k = torch.randn(B, L_max, H_kv, D, generator=g)
    v = torch.randn(B, L_max, H_kv, D, generator=g) * magnitude
    v[:, ::7] *= 30                                  # scales differing across the tile
    (k8, ks), (v8, vs) = quant.quantize_kv(k, kv_dtype, "token"), quant.quantize_kv(v, kv_dtype, "token")
    kd, vd = quant.dequantize_kv(k8, ks, torch.float64), quant.dequantize_kv(v8, vs, torch.float64)
    lens = torch.tensor([L_max, 17], dtype=torch.int32)
    want, _ = fdlib.reference_attention(q, kd, vd, lens)
    for method in METHODS:
        got = fdlib.decode_attention(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), lens.to(DEVICE), method=method,
                                     k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE)).double().cpu()
        assert torch.isfinite(got).all(), f"{method}: non-finite output"
        err = (got - want).abs().max() / want.abs().max()
        assert err < ATOL_REL, f"{method}: relative max error {err:.3g} (|V| ~ {magnitude:g})"


def test_a_huge_per_token_v_scale_on_the_smallest_stored_value():
    """Stored 2^-9 (e4m3's smallest subnormal) times a per-token scale of 1e5: 195.3, not inf."""
    B, H_q, H_kv, D, L = 1, 2, 1, 16, 3
    q = torch.randn(B, H_q, D).half()
    k8 = torch.zeros(B, L, H_kv, D).to(torch.float8_e4m3fn)
    v8 = torch.full((B, L, H_kv, D), 2.0 ** -9).to(torch.float8_e4m3fn)
    ks = torch.ones(B, L, H_kv)
    vs = torch.full((B, L, H_kv), 1e5)
    lens = torch.tensor([L], dtype=torch.int32)
    for method in METHODS:
        got = fdlib.decode_attention(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), lens.to(DEVICE), method=method,
                                     k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE)).float().cpu()
        assert torch.allclose(got, torch.full_like(got, 1e5 * 2.0 ** -9), rtol=1e-3), f"{method}: {got.flatten()[:3]}"
