"""Bad arguments to fdlib.decode_attention raise ValueError/TypeError naming the argument and what came."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

import fdlib
import fdlib.api
import fdlib.validate
from fdlib.kernels.config import chunk_for, tile_config
from helpers import DEVICE, assert_attention_close, counters_zero, make_problem, run_device_lengths

B, L, H_Q, H_KV, D = 2, 20, 4, 2, 32


def base():
    q, k, v, lens = make_problem(B, L, H_Q, H_KV, D, torch.float32, seed=0, lens=[L, 7])
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lens)


def non_contig_last(t):
    """Same shape, last-dim stride 2."""
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    return big[..., ::2]


def with_(**over):
    def build():
        args = base()
        kw = {}
        for name, val in over.items():
            val = val(args) if callable(val) else val
            (args if name in args else kw)[name] = val
        return args, kw
    return build


f = torch.float32
def Z(*shape, **kw):
    kw.setdefault("device", DEVICE)
    return torch.zeros(*shape, **kw)


def T(data, **kw):
    kw.setdefault("device", DEVICE)
    return torch.tensor(data, **kw)


CASES = [
    # (id, builder, exception, fragments that must all appear in the message)
    ("q_2d", with_(q=Z(B, D)), ValueError, ["q:", "2-D", "[2, 32]"]),
    ("q_5d", with_(q=Z(B, 1, 1, H_Q, D)), ValueError, ["q:", "5-D"]),
    ("q_len_0", with_(q=Z(B, 0, H_Q, D)), ValueError, ["q:", "[2, 0, 4, 32]", "1 <= q_len <= 16", "q_len=0"]),
    ("q_len_17", with_(q=Z(B, 17, H_Q, D)), ValueError, ["q:", "[2, 17, 4, 32]", "1 <= q_len <= 16", "q_len=17"]),
    ("q_len_over_L_max", with_(q=Z(B, 3, H_Q, D), k_cache=Z(B, 2, H_KV, D), v_cache=Z(B, 2, H_KV, D),
                               cache_seqlens=None),
     ValueError, ["q:", "3 query tokens", "q_len <= L_max", "L_max=2"]),
    ("k_3d", with_(k_cache=Z(B, L, D)), ValueError, ["k_cache:", "3-D"]),
    ("v_5d", with_(v_cache=Z(B, L, H_KV, D, 1)), ValueError, ["v_cache:", "5-D"]),
    ("kv_shape_mismatch", with_(v_cache=Z(B, L + 1, H_KV, D)), ValueError,
     ["v_cache:", "[2, 20, 2, 32]", "[2, 21, 2, 32]"]),
    ("batch_mismatch", with_(k_cache=Z(3, L, H_KV, D), v_cache=Z(3, L, H_KV, D)), ValueError,
     ["k_cache:", "batch size 3", "2"]),
    ("head_dim_mismatch", with_(k_cache=Z(B, L, H_KV, 16), v_cache=Z(B, L, H_KV, 16)),
     ValueError, ["k_cache:", "head dim 16", "D=32"]),
    ("hq_not_multiple", with_(q=Z(B, 5, D)), ValueError, ["H_q=5", "H_kv=2"]),
    ("hkv_zero", with_(k_cache=Z(B, L, 0, D), v_cache=Z(B, L, 0, D)), ValueError, ["H_kv=0"]),
    ("head_dim_0", with_(q=Z(B, H_Q, 0), k_cache=Z(B, L, H_KV, 0),
                         v_cache=Z(B, L, H_KV, 0)), ValueError, ["head dim", "got 0"]),
    ("head_dim_257", with_(q=Z(B, H_Q, 257), k_cache=Z(B, L, H_KV, 257),
                           v_cache=Z(B, L, H_KV, 257)), ValueError, ["head dim", "256", "got 257"]),
    ("batch_0", with_(q=Z(0, H_Q, D), k_cache=Z(0, L, H_KV, D), v_cache=Z(0, L, H_KV, D),
                      cache_seqlens=None), ValueError, ["batch size", "got 0"]),
    ("k_fp16", with_(k_cache=lambda a: a["k_cache"].half()), TypeError, ["k_cache", "float32", "float16"]),
    ("v_bf16", with_(v_cache=lambda a: a["v_cache"].bfloat16()), TypeError, ["v_cache", "bfloat16"]),
    ("q_int", with_(q=lambda a: a["q"].to(torch.int32)), TypeError, ["q:", "dtype", "int32"]),
    ("all_float64", with_(q=lambda a: a["q"].double(), k_cache=lambda a: a["k_cache"].double(),
                          v_cache=lambda a: a["v_cache"].double()), TypeError, ["q:", "float64"]),
    ("q_complex", with_(q=lambda a: Z(B, H_Q, D, dtype=torch.complex64)), TypeError, ["q:", "complex64"]),
    ("q_last_dim_strided", with_(q=lambda a: non_contig_last(a["q"])), ValueError, ["q:", "contiguous", "stride"]),
    ("k_last_dim_strided", with_(k_cache=lambda a: non_contig_last(a["k_cache"])), ValueError,
     ["k_cache:", "contiguous"]),
    ("v_transposed", with_(v_cache=lambda a: Z(B, L, D, H_KV).transpose(-1, -2)), ValueError,
     ["v_cache:", "contiguous"]),
    ("lens_float", with_(cache_seqlens=T([3.0, 4.0])), TypeError, ["cache_seqlens", "float32"]),
    ("lens_bool", with_(cache_seqlens=T([True, False])), TypeError, ["cache_seqlens", "torch.bool"]),
    ("lens_int16", with_(cache_seqlens=T([3, 4], dtype=torch.int16)), TypeError, ["cache_seqlens", "int16"]),
    ("lens_shape_3", with_(cache_seqlens=T([3, 4, 5], dtype=torch.int32)), ValueError,
     ["cache_seqlens", "[2]", "[3]"]),
    ("lens_shape_2x1", with_(cache_seqlens=T([[3], [4]], dtype=torch.int32)), ValueError,
     ["cache_seqlens", "[2, 1]"]),
    ("lens_scalar", with_(cache_seqlens=T(3, dtype=torch.int32)), ValueError, ["cache_seqlens", "[]"]),
    ("lens_negative", with_(cache_seqlens=[3, -1]), ValueError,
     ["cache_seqlens", ">= 0", "-1"]),
    ("lens_too_long", with_(cache_seqlens=[21, 3]), ValueError,
     ["cache_seqlens", "L_max=20", "21"]),
    ("lens_list_float", with_(cache_seqlens=[3.0, 4]), TypeError, ["cache_seqlens", "ints"]),
    ("lens_list_short", with_(cache_seqlens=[3]), ValueError, ["cache_seqlens", "expected 2", "[1]"]),
    ("lens_device_negative", with_(cache_seqlens=T([3, -1], dtype=torch.int32), check_lengths=True), ValueError,
     ["cache_seqlens", ">= 0", "-1"]),
    ("lens_device_too_long", with_(cache_seqlens=T([3, 25], dtype=torch.int32), check_lengths=True), ValueError,
     ["cache_seqlens", "L_max=20", "25"]),
    ("check_lengths_str", with_(check_lengths="yes"), TypeError, ["check_lengths", "str"]),
    ("lens_other_device", with_(cache_seqlens=T([3, 4], dtype=torch.int32, device="meta")), ValueError,
     ["cache_seqlens", "device", "meta"]),
    ("k_other_device", with_(k_cache=Z(B, L, H_KV, D, device="meta"),
                             v_cache=Z(B, L, H_KV, D, device="meta")), ValueError,
     ["k_cache", "device", "meta"]),
    ("splits_0", with_(num_splits=0), ValueError, ["num_splits", "256", "got 0"]),
    ("splits_257", with_(num_splits=257), ValueError, ["num_splits", "got 257"]),
    ("splits_negative", with_(num_splits=-3), ValueError, ["num_splits", "got -3"]),
    ("splits_float", with_(num_splits=2.0), TypeError, ["num_splits", "float"]),
    ("splits_bool", with_(num_splits=True), TypeError, ["num_splits", "bool"]),
    ("splits_str", with_(num_splits="4"), TypeError, ["num_splits", "str"]),
    ("splits_with_naive", with_(num_splits=4, method="naive"), ValueError, ["num_splits", "naive"]),
    ("splits_with_persistent", with_(num_splits=2, method="persistent"), ValueError, ["num_splits", "persistent", "got 2"]),
    ("method_unknown", with_(method="flash"), ValueError, ["method", "'flash'", "'unified'"]),
    ("method_none", with_(method=None), ValueError, ["method", "None"]),
    ("method_case", with_(method="Split"), ValueError, ["method", "'Split'"]),
    ("scale_nan", with_(scale=float("nan")), ValueError, ["scale", "nan"]),
    ("scale_inf", with_(scale=math.inf), ValueError, ["scale", "inf"]),
    ("scale_neg_inf", with_(scale=-math.inf), ValueError, ["scale", "-inf"]),
    ("scale_beyond_float32", with_(scale=1e39), ValueError, ["scale", "1e+39", "float32"]),
    ("scale_beyond_float32_neg", with_(scale=-4e38), ValueError, ["scale", "-4e+38", "float32"]),
    ("scale_int_beyond_float", with_(scale=-10 ** 400), ValueError, ["scale", "-1000", "float32"]),
    ("scale_str", with_(scale="0.1"), TypeError, ["scale", "str"]),
    ("scale_bool", with_(scale=True), TypeError, ["scale", "bool"]),
    ("scale_tensor", with_(scale=T(0.1)), TypeError, ["scale", "Tensor"]),
    ("return_lse_int", with_(return_lse=1), TypeError, ["return_lse", "int"]),
    ("return_lse_none", with_(return_lse=None), TypeError, ["return_lse", "NoneType"]),
    ("validate_gone", with_(validate=False), TypeError, ["validate", "check_lengths", "max_seqlen"]),
    ("q_list", with_(q=[[0.0]]), TypeError, ["q:", "torch.Tensor", "list"]),
    ("k_numpy", with_(k_cache=np.zeros((B, L, H_KV, D), np.float32)), TypeError, ["k_cache", "ndarray"]),
    ("v_none", with_(v_cache=None), TypeError, ["v_cache", "NoneType"]),
]


@pytest.mark.parametrize("builder,exc,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(builder, exc, fragments):
    args, kw = builder()
    with pytest.raises(exc) as info:
        fdlib.decode_attention(**args, **kw)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in message: {msg}"
    assert counters_zero(), "a rejected call must leave the ticket counters untouched"


def test_at_least_thirty_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("method", ["naive", "split", "unified"])
def test_a_rejected_call_does_not_disturb_the_next(method):
    args = base()
    with pytest.raises(ValueError):
        fdlib.decode_attention(**args, method=method, num_splits=0 if method != "naive" else None, scale=math.nan)
    out, lse = fdlib.decode_attention(**args, method=method, return_lse=True)
    assert_attention_close(out, lse, args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"])
    assert counters_zero()


def test_accepted_edge_values():
    """Things that look odd but are valid: int scale, negative/zero scale, numpy float scale, int64 lengths,
    length 0 everywhere, D=1 with any last stride, 256 splits."""
    args = base()
    for kw in (dict(scale=1), dict(scale=0.0), dict(scale=-0.5), dict(scale=np.float64(0.2)), dict(num_splits=256)):
        out = fdlib.decode_attention(**args, **kw)
        assert torch.isfinite(out).all()
    args["cache_seqlens"] = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    out, lse = fdlib.decode_attention(**args, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


class _NoHostCopy:
    """Trap: any read of a tensor's values on the host (int(), .item(), .tolist(), bool(), .cpu()) raises."""
    NAMES = ("__int__", "__index__", "__bool__", "__float__", "item", "tolist", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.mp, self.on = monkeypatch, False
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        trap = self

        def method(self, *a, **k):
            if trap.on:
                raise AssertionError(f"host read of a tensor ({name}) during a default decode_attention call")
            return orig(self, *a, **k)
        return method


@pytest.mark.parametrize("method", ["naive", "split", "unified", "persistent", "auto"])
def test_default_call_reads_nothing_back_and_clamps_bad_lengths(monkeypatch, method):
    """A default call never reads device tensor values on the host (the plan is made from shapes alone); device
    lengths outside 0..L_max are clamped on the device (the result is that of the clamped lengths) and the
    plan's flag records it; check_lengths=True reads them and raises instead. On the CPU, q's device is the host:
    there a tensor of lengths is read and checked like a list (ValueError, no device to sync with), so the trapped
    calls pass no lengths (all L_max) and the kernels' clamp is reached through the plan's launch."""
    args = base()
    q, k, v = args["q"], args["k_cache"], args["v_cache"]
    fdlib.api.clear_plans()
    trap = _NoHostCopy(monkeypatch)
    bad = torch.tensor([-4, L + 5], dtype=torch.int32, device=DEVICE)
    on_host = bad.device.type == "cpu"
    trap.on = True
    out, lse = fdlib.decode_attention(q, k, v, None if on_host else bad, method=method, return_lse=True)   # made, run
    out2 = fdlib.decode_attention(q, k, v, None if on_host else args["cache_seqlens"], method=method)   # cached plan
    trap.on = False
    p = fdlib.api.plan_for(q, k, v, method=method)
    if on_host:
        full = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
        assert_attention_close(out, lse, q, k, v, full, what=f"{method} plan made under the trap")
        assert_attention_close(out2, None, q, k, v, full, what=f"{method} cached plan")
        with pytest.raises(ValueError, match="cache_seqlens: lengths must be >= 0"):
            fdlib.decode_attention(q, k, v, bad, method=method)
        out, lse = run_device_lengths(p, q, k, v, bad, return_lse=True)
    else:
        assert_attention_close(out2, None, q, k, v, args["cache_seqlens"], what=f"{method} cached plan")
    clamped = torch.tensor([0, L], dtype=torch.int32, device=DEVICE)
    assert_attention_close(out, lse, q, k, v, clamped, what=f"{method} with clamped lengths")
    assert p.clamped() is True and p.clamped() is False     # read, then reset
    with pytest.raises(ValueError, match="cache_seqlens"):
        fdlib.decode_attention(q, k, v, bad, method=method, check_lengths=True)
    assert counters_zero()


def test_splits_follow_max_seqlen_or_capacity_never_length_values(monkeypatch):
    """decode_attention chooses splits for the cache's capacity L_max, or for max_seqlen when given; its plans
    are keyed by shapes, never by the lengths' values; fdlib.plan takes host lengths."""
    args = base()
    q, k, v = args["q"], args["k_cache"], args["v_cache"]
    short = torch.tensor([9, 7], dtype=torch.int32, device=DEVICE)
    p1 = fdlib.api.plan_for(q, k, v, args["cache_seqlens"], method="split")
    p2 = fdlib.api.plan_for(q, k, v, short, method="split")
    assert p1 is p2 and p1.decision.L_cap == L and p1.decision.basis == "capacity"
    p3 = fdlib.api.plan_for(q, k, v, short, method="split", max_seqlen=9)
    assert p3.decision.L_cap == 9 and p3.decision.basis == "max_seqlen"
    out = fdlib.decode_attention(q, k, v, args["cache_seqlens"], method="split", max_seqlen=9)   # rows > 9: covered
    assert_attention_close(out, None, q, k, v, args["cache_seqlens"], what="rows longer than max_seqlen")
    p4 = fdlib.plan(B, H_Q, H_KV, D, L, dtype=torch.float32, device=DEVICE, lengths=[9, 7], method="split")
    assert p4.decision.L_cap == 9 and p4.decision.basis == "host lengths"
    assert counters_zero()


@pytest.mark.parametrize("method", ["split", "unified"])
def test_out_of_memory_is_reported_with_bytes(monkeypatch, method):
    """fdlib re-raises torch.OutOfMemoryError with the bytes its plan's workspace needed; simulated here."""
    plan_mod = importlib.import_module("fdlib.plan")    # the module (fdlib.plan is also the function)
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def boom(*a, **k):
        raise oom("CUDA out of memory. Tried to allocate 1.00 GiB")
    monkeypatch.setattr(plan_mod, "Workspace", boom)
    fdlib.api.clear_plans()
    args = base()
    splits = chunk_for(L, 2, tile_config(D, L).BLOCK_N)[1]   # 2 in the interpreter (16-key tiles), 1 compiled
    with pytest.raises(oom) as info:
        fdlib.decode_attention(**args, method=method, num_splits=2)
    msg = str(info.value)
    slots = B * splits if method == "split" or splits > 1 else 0     # the two-stage path keeps one partial per split
    expected = plan_mod.workspace_bytes(slots, H_Q, D)
    assert expected > 0 or method == "unified"
    assert "bytes" in msg and str(expected) in msg and f"splits={splits}" in msg, msg
