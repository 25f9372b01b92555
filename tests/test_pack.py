"""Packed KV heads (fdlib.plan.pack_decision): small adjacent KV heads read as one wider head, each query head
keeping its own head's dims (fdlib.kernels.tile.own_dims). Against float64, through the unified kernel and the
two-stage path, on contiguous and paged caches, ragged lengths, splits and one split."""
from __future__ import annotations

import sys

import pytest
import torch

import fdlib
from fdlib.kernels.launch import heads_adjacent, pack_for
from fdlib.plan import decide
from helpers import DEVICE, assert_attention_close, counters_zero, gen, make_problem, randn

from test_paged import paged_problem


def test_pack_for_takes_the_most_heads_that_fit_128_dims_and_divide_h_kv():
    assert pack_for(2, 64) == 2
    assert pack_for(8, 64) == 2
    assert pack_for(8, 32) == 4
    assert pack_for(6, 32) == 2       # 4 does not divide 6
    assert pack_for(8, 16) == 8
    assert pack_for(3, 16) == 1       # no power of two above 1 divides 3
    assert pack_for(1, 64) == 1       # MQA: one KV head
    for D in (128, 80, 96, 48, 256):  # wide or not a power of two: never packed
        assert pack_for(8, D) == 1


@pytest.mark.parametrize("method", ["unified", "split", "auto"])
@pytest.mark.parametrize("H_q,H_kv,D", [(16, 2, 64), (8, 4, 32), (24, 6, 32), (8, 8, 16), (6, 2, 64)])
@pytest.mark.parametrize("splits", [1, 3])
def test_packed_heads_match_float64(method, H_q, H_kv, D, splits):
    B, L = 3, 70
    q, k, v, lens = make_problem(B, L, H_q, H_kv, D, torch.float32, seed=H_q * D + splits, lens=[70, 1, 33])
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float32, device=DEVICE, method=method,
                   num_splits=splits if method != "auto" else None, pack_heads=True)
    assert p.decision.pack == pack_for(H_kv, D) > 1, p
    assert f"{p.decision.pack} KV heads read as one" in str(p)
    out, lse = p.run(q, k, v, lens, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what=f"{method} pack={p.decision.pack} splits={splits}")
    assert counters_zero()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_heads_half_precision_with_empty_rows(dtype):
    B, L, H_q, H_kv, D = 4, 48, 8, 2, 64
    q, k, v, lens = make_problem(B, L, H_q, H_kv, D, dtype, seed=5, lens=[0, 17, 48, 16])
    for method, s in (("unified", 2), ("split", 2), ("unified", 1)):
        p = fdlib.plan(B, H_q, H_kv, D, L, dtype=dtype, device=DEVICE, method=method, num_splits=s, pack_heads=True)
        assert p.decision.pack == 2
        out, lse = p.run(q, k, v, lens, return_lse=True)
        assert_attention_close(out, lse, q, k, v, lens, what=f"{method}@{s} {dtype}")


@pytest.mark.parametrize("page", [1, 16])
def test_packed_heads_over_pages(page):
    g = torch.Generator().manual_seed(page)
    B, H_q, H_kv, D = 2, 8, 4, 32
    max_pages = 64 // page
    q, kp, vp, bt, k, v, lens = paged_problem(g, B, H_q, H_kv, D, page, max_pages, max_pages * B + 3, [64, 29])
    for method in ("unified", "split"):
        p = fdlib.plan(B, H_q, H_kv, D, max_pages * page, dtype=torch.float32, device=DEVICE, method=method,
                       num_splits=2, page_size=page, pack_heads=True)
        assert p.decision.pack == 4
        out, lse = p.run(q, kp, vp, lens, block_table=bt, return_lse=True)
        assert_attention_close(out, lse, q, k, v, lens, what=f"{method} pages of {page}")


def test_a_packing_plan_refuses_a_cache_whose_heads_are_not_side_by_side():
    B, L, H_q, H_kv, D = 2, 32, 4, 2, 64
    g = gen(1)
    q = randn((B, H_q, D), torch.float32, g)
    k_bhld = randn((B, H_kv, L, D), torch.float32, g)
    v_bhld = randn((B, H_kv, L, D), torch.float32, g)
    k, v = k_bhld.transpose(1, 2), v_bhld.transpose(1, 2)   # [B, L, H_kv, D] views, head stride L·D
    assert not heads_adjacent(k, D)
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float32, device=DEVICE, method="unified", num_splits=2,
                   pack_heads=True)
    with pytest.raises(ValueError, match=r"k_cache: .*2 adjacent KV heads as one.*pack_heads=False"):
        p.run(q, k, v)

def test_decode_attention_packs_only_caches_whose_heads_lie_side_by_side(monkeypatch):
    from fdlib import api
    monkeypatch.setattr(sys.modules["fdlib.plan"], "packs_by_default", lambda *a: True)   # as on a GPU
    monkeypatch.setattr(api, "_PLANS", type(api._PLANS)())
    monkeypatch.setattr(api, "_CALLS", type(api._CALLS)())
    B, L, H_q, H_kv, D = 2, 40, 4, 2, 64
    q, k, v, lens = make_problem(B, L, H_q, H_kv, D, torch.float32, seed=3, lens=[40, 9])
    # the same values in [B, H_kv, L, D] memory, seen as [B, L, H_kv, D]
    k_view, v_view = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    for kk, vv, pack in ((k, v, 2), (k_view, v_view, 1)):
        p = api.plan_for(q, kk, vv, lens, method="unified", num_splits=2)
        assert p.decision.pack == pack, p
        out = fdlib.decode_attention(q, kk, vv, lens, method="unified", num_splits=2)
        assert_attention_close(out, None, q, k, v, lens, what=f"pack={pack}")


def test_pack_heads_false_and_what_never_packs():
    kw = dict(dtype=torch.float16)
    assert decide(2, 16, 2, 64, 4096, pack_heads=False, method="unified", **kw).pack == 1
    assert decide(2, 16, 2, 64, 4096, pack_heads=True, method="unified", **kw).pack == 2
    assert decide(2, 16, 2, 64, 4096, pack_heads=True, method="unified", q_len=2, **kw).pack == 1
    assert decide(2, 16, 2, 64, 4096, pack_heads=True, method="persistent", **kw).pack == 1
    assert decide(2, 16, 2, 64, 4096, pack_heads=True, batch_invariant=True, **kw).pack == 1
    assert decide(2, 16, 2, 128, 4096, pack_heads=True, method="unified", **kw).pack == 1
    with pytest.raises(TypeError, match="pack_heads"):
        fdlib.plan(2, 16, 2, 64, 64, pack_heads="yes")


def test_packed_heads_asked_for_on_an_8bit_cache_stay_packed():
    """auto on an 8-bit cache of several sequences takes stream-K, host lengths or not, but a pack asked for
    (pack_heads=True, per-tensor scales) is planned as on a 16-bit cache, not dropped for stream-K."""
    kv = dict(dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, k_scale="tensor", v_scale="tensor",
              lengths=[64, 30, 10, 5])
    asked = fdlib.plan(4, 8, 4, 64, 64, pack_heads=True, **kv).decision
    assert (asked.kernel, asked.pack) in (("unified", 2), ("split", 2))
    assert fdlib.plan(4, 8, 4, 64, 64, **kv).decision.kernel == "streamk"


def test_short_caches_take_64_key_tiles_up_to_2048_keys_at_64_rows_and_512_keys_at_128():
    """fdlib.kernels.config.SMALL_BATCH_L: at 65-128 rows one split of 128-key tiles beat two of 64 keys at
    L = 1024 and 2048 on the H200 (results/h200/ab/ab-rows128-tiles.json), 64-key tiles stayed ahead at 512."""
    from fdlib.kernels.config import tile_config_for
    block_n = lambda L, rows: tile_config_for(128, L, compiled_mode=True, rows=rows).BLOCK_N  # noqa: E731
    assert block_n(2048, 64) == block_n(512, 128) == block_n(512, None) == 64
    assert block_n(1024, 128) == block_n(2048, 128) == block_n(513, 65) == 128
    assert block_n(2048, None) == 64          # rows unknown count as small
    assert block_n(4096, 8) == block_n(512, 129) == 128


def test_packing_by_default_needs_a_gpu_d64_enough_rows_and_bytes(monkeypatch):
    """fdlib.plan.packs_by_default: D = 64 pairs, >= 8 packed rows, >= 128 MB of K and V (the measured rule)."""
    pm = sys.modules["fdlib.plan"]   # the module (fdlib.plan is the function)
    f16 = torch.float16
    monkeypatch.setattr(pm.runtime, "INTERPRET", False)
    assert pm.packs_by_default(8, 4, 64, 2, f16, None, None, 65536)           # 537 MB, 16 packed rows
    assert not pm.packs_by_default(1, 4, 64, 2, f16, None, None, 262144)      # 2 packed rows
    assert not pm.packs_by_default(8, 4, 64, 2, f16, None, None, 8192)        # 67 MB
    assert not pm.packs_by_default(8, 4, 64, 2, f16, None, 8192, 65536)       # max_seqlen bounds the bytes
    assert pm.packs_by_default(8, 4, 64, 2, f16, [65536] * 8, None, 65536)
    assert not pm.packs_by_default(8, 8, 32, 4, f16, None, None, 65536)       # D = 32: not measured
    monkeypatch.setattr(pm.runtime, "INTERPRET", True)
    assert not pm.packs_by_default(8, 4, 64, 2, f16, None, None, 65536)
