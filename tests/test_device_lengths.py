"""The default call without host lengths (``decode_attention(q, k, v, lens)`` with lengths on the device, or a plan
captured before they are known): ``auto`` takes stream-K, whose launch depends on the shapes alone
(:func:`fdlib.plan.device_schedule_suits`). The rule, and the call against float64 on ragged batches, contiguous and
paged, replayed with new lengths written into the same tensor, and captured in a CUDA graph on a GPU."""
from __future__ import annotations

import sys

import pytest
import torch

import fdlib
from fdlib import api
from fdlib.kernels.streamk import MAX_BATCH
from helpers import DEVICE, INTERPRET, assert_attention_close
from test_paged import paged_problem
from test_worklist import captured_replays, rand_problem


def decision(B=4, L_max=8192, **kw):
    return fdlib.plan(B, 4, 2, 16, L_max, dtype=kw.pop("dtype", torch.float16), device=DEVICE, **kw).decision


def test_auto_without_lengths_takes_stream_k_where_the_rule_says(monkeypatch):
    """Two or more sequences, one query token, no host lengths: stream-K, whatever L_max, max_seqlen or the K/V
    dtype (16, 32 or 8 bits); host lengths, one sequence, several query tokens, batch_invariant=True, forced
    splits and FDLIB_DEVICE_SCHEDULE=0 keep the plans they had."""
    for kw in (dict(B=2), dict(L_max=128), dict(B=256, L_max=2048), dict(max_seqlen=1000), dict(max_seqlen=0),
               dict(dtype=torch.float32), dict(B=MAX_BATCH, L_max=64), dict(kv_dtype=torch.int8),
               dict(kv_dtype=torch.float8_e4m3fn, k_scale="token", v_scale="token"),
               dict(kv_dtype=torch.int8, k_scale="head", v_scale="token")):
        d = decision(**kw)
        assert (d.kernel, d.basis) == ("streamk", "device lengths"), kw
    assert decision(lengths=[8192, 1, 2, 3]).basis == "host lengths"
    assert decision(B=1).kernel != "streamk"
    assert decision(B=MAX_BATCH + 1, L_max=64).kernel != "streamk"
    assert decision(q_len=2).kernel != "streamk"
    assert decision(batch_invariant=True).kernel == "invariant"
    assert decision(num_splits=4).kernel != "streamk"
    assert decision(method="worklist").kernel == "worklist"
    monkeypatch.setattr(sys.modules["fdlib.plan"], "DEVICE_SCHEDULE", 0)   # the module (fdlib.plan: the function)
    assert decision().basis == "capacity" and decision().kernel != "streamk"


def test_the_default_call_with_device_lengths_runs_stream_k_vs_float64():
    """decode_attention(q, k, v, lens), a cache of 300 keys, ragged lengths (a full row, short ones, an empty one,
    a length of 1), group 3, head dim 80: stream-K against float64."""
    lens = [300, 17, 0, 1, 129, 300, 64]
    q, k, v, L = rand_problem(lens, 6, 2, 80, seed=3, L_max=300)
    assert api.plan_for(q, k, v, L).kernel == "streamk"
    out, lse = fdlib.decode_attention(q, k, v, L, return_lse=True)
    assert_attention_close(out, lse, q, k, v, L, what="default call, stream-K")


@pytest.mark.parametrize("paged", [False, True])
def test_a_plan_made_without_lengths_follows_new_lengths_in_the_same_tensor(paged):
    """The plan sees no lengths; they are written in place between calls (the call after the first replays its
    launches): every call is right, contiguous and over pages of 16."""
    H_q, H_kv, D, L_max, page = 4, 2, 32, 192, 16
    B = 5
    g = torch.Generator().manual_seed(11)
    q, kp, vp, bt, k, v, L = paged_problem(g, B, H_q, H_kv, D, page, L_max // page, B * L_max // page,
                                           [L_max] * B, dtype=torch.float32, share=False, unused=0)
    p = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=torch.float32, device=DEVICE, page_size=page if paged else None)
    assert p.decision.kernel == "streamk"
    args, kw = ((q, kp, vp), dict(block_table=bt)) if paged else ((q, k, v), {})
    for lens in ([L_max] * B, [3, 192, 0, 150, 17], [1, 1, 191, 2, 64]):
        L.copy_(torch.tensor(lens, dtype=torch.int32))
        out, lse = p.run(*args, L, return_lse=True, **kw)
        assert_attention_close(out, lse, q, k, v, L, what=f"stream-K without lengths paged={paged} {lens}")


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_graph_replayed_with_ragged_lengths_on_a_gpu():
    """Captured while every row is L_max, replayed after ragged lengths are written into the same tensor:
    contiguous and over pages, bf16, against float64 (test_worklist.captured_replays): auto's stream-K."""
    assert [p.decision.kernel for p, _ in captured_replays()] == ["streamk", "streamk"]


def test_a_call_without_cache_seqlens_is_planned_for_its_equal_rows():
    """decode_attention(q, k, v) with no lengths: every row is L_max, which the host knows, so auto plans those
    equal rows exactly (not stream-K, which a call with lengths on the device takes), and both are right."""
    lens = [96] * 3
    q, k, v, L = rand_problem(lens, 4, 2, 32, seed=4, L_max=96)
    none, dev = api.plan_for(q, k, v), api.plan_for(q, k, v, L)
    assert none.decision.basis == "host lengths" and none.decision.kernel != "streamk"
    assert dev.decision.kernel == "streamk" and none is not dev
    for call in ((q, k, v), (q, k, v, L)):
        out, lse = fdlib.decode_attention(*call, return_lse=True)
        assert_attention_close(out, lse, q, k, v, L, what=f"{len(call)} arguments")


def test_packed_heads_without_lengths_pack_only_when_asked(monkeypatch):
    """Small heads (D=64, H_kv=2) without host lengths: asked for (pack_heads=True), the pack, planned for L_cap;
    by default, even where packing would be the default (packs_by_default), stream-K unpacked: its device
    schedule follows a ragged batch that the pack's plan cannot see."""
    plan_module = sys.modules["fdlib.plan"]
    monkeypatch.setattr(plan_module, "packs_by_default", lambda *a: True)
    p = fdlib.plan(4, 8, 2, 64, 128, dtype=torch.float16, device=DEVICE, pack_heads=True)
    assert p.decision.pack == 2 and p.decision.kernel in ("unified", "split")
    d = fdlib.plan(4, 8, 2, 64, 128, dtype=torch.float16, device=DEVICE).decision
    assert d.kernel == "streamk" and d.pack == 1
    d = fdlib.plan(4, 8, 2, 64, 128, dtype=torch.float16, device=DEVICE, lengths=[128] * 4).decision
    assert d.pack == 2
