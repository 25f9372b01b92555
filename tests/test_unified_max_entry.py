"""method="unified_max" through the one public entry point, fdlib.decode_attention."""
from __future__ import annotations

import pytest
import torch

import fdlib
from helpers import DEVICE, assert_attention_close, gen, randn


def test_decode_attention_reaches_the_unified_max():
    g = gen(7)
    B, H_q, H_kv, L, D = 3, 8, 2, 70, 32
    q = randn((B, H_q, D), torch.float32, g)
    k = randn((B, L, H_kv, D), torch.float32, g)
    v = randn((B, L, H_kv, D), torch.float32, g)
    lens = torch.tensor([70, 1, 33], dtype=torch.int32, device=DEVICE)
    out, lse = fdlib.decode_attention(q, k, v, lens, method="unified_max", return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what="unified_max")
    out4 = fdlib.decode_attention(q[:, None], k, v, lens, method="unified_max")
    assert out4.shape == (B, 1, H_q, D) and torch.equal(out4[:, 0], out)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(batch_invariant=True), "batch_invariant"),
    (dict(max_seqlen=10), "max_seqlen"),
    (dict(check_lengths=True), "check_lengths"),
])
def test_unified_max_refuses_the_plan_options_by_name(kwargs, fragment):
    q = torch.zeros(1, 4, 16, device=DEVICE)
    k = torch.zeros(1, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=fragment):
        fdlib.decode_attention(q, k, k, method="unified_max", **kwargs)


def test_unified_max_takes_one_query_token_and_no_plan():
    q = torch.zeros(1, 3, 4, 16, device=DEVICE)
    k = torch.zeros(1, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one query token"):
        fdlib.decode_attention(q, k, k, method="unified_max")
    with pytest.raises(ValueError, match="unified_max"):
        fdlib.plan(1, 4, 2, 16, 8, dtype=torch.float32, device=DEVICE, method="unified_max")
