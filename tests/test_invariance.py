"""batch_invariant=True: a sequence's out and lse are bitwise the same whatever its batchmates, the batch size,
its place in the batch, the run, and whether its cache is paged; the default mode is deterministic run to run."""
from __future__ import annotations

import pytest
import torch

import fdlib
from helpers import DEVICE, assert_attention_close

L_MAX, H_Q, H_KV, D = 100, 6, 2, 80      # group 3, D = 80; in the interpreter a split is 32 keys (2 tiles)


def pool(n, dtype, seed):
    """n sequences of one shape: q [n, H_q, D], K/V [n, L_MAX, H_kv, D], lengths (0, 1, tile and split edges)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H_Q, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(n, L_MAX, H_KV, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(n, L_MAX, H_KV, D, generator=g).to(dtype).to(DEVICE)
    edges = [0, 1, 15, 16, 31, 32, 33, 64, 99, 100]
    lens = torch.tensor([edges[i % len(edges)] if i < len(edges) else int(torch.randint(0, L_MAX + 1, (1,),
                         generator=g)) for i in range(n)], dtype=torch.int32, device=DEVICE)
    return q, k, v, lens


def decode(q, k, v, lens, **kw):
    return fdlib.decode_attention(q, k, v, lens, batch_invariant=True, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_sequence_is_bitwise_itself_in_any_batch(dtype):
    n = 14
    q, k, v, lens = pool(n, dtype, seed=1)
    alone = [decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], lens[i:i + 1]) for i in range(n)]
    o_all, l_all = decode(q, k, v, lens)
    assert_attention_close(o_all, l_all, q, k, v, lens, what="batch-invariant mode vs float64")
    g = torch.Generator().manual_seed(2)
    for trial in range(12):                                   # random batchmates, sizes and positions
        size = int(torch.randint(1, 7, (1,), generator=g))
        idx = torch.randperm(n, generator=g)[:size]
        o, lse = decode(q[idx], k[idx], v[idx], lens[idx])
        for pos, i in enumerate(idx.tolist()):
            assert torch.equal(o[pos], alone[i][0][0]), f"trial {trial}: sequence {i} at {pos} of {size}: out differs"
            assert torch.equal(lse[pos], alone[i][1][0]), f"trial {trial}: sequence {i} at {pos}: lse differs"


def test_paged_and_contiguous_agree_bitwise():
    q, k, v, lens = pool(4, torch.float16, seed=3)
    page = 4
    pages_k = k.reshape(4 * L_MAX // page, page, H_KV, D)[torch.arange(4 * L_MAX // page).flip(0)]
    pages_v = v.reshape(4 * L_MAX // page, page, H_KV, D)[torch.arange(4 * L_MAX // page).flip(0)]
    bt = (4 * L_MAX // page - 1 - torch.arange(4 * L_MAX // page, device=DEVICE)).reshape(4, -1).to(torch.int32)
    o1, l1 = decode(q, k, v, lens)
    o2, l2 = decode(q, pages_k, pages_v, lens, block_table=bt)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_default_mode_is_deterministic_run_to_run():
    """The ticket decides who merges, never the order: the same batch gives the same bits every time."""
    q, k, v, lens = pool(6, torch.float32, seed=4)
    for method in ("auto", "unified", "split", "persistent", "balanced"):
        first = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
        for _ in range(3):
            again = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), method


def test_batch_invariant_arguments():
    q, k, v, lens = pool(2, torch.float32, seed=5)
    with pytest.raises(ValueError, match="batch_invariant"):
        fdlib.decode_attention(q, k, v, lens, batch_invariant=True, method="split")
    with pytest.raises(ValueError, match="batch_invariant"):
        fdlib.decode_attention(q, k, v, lens, batch_invariant=True, num_splits=2)
    with pytest.raises(TypeError, match="batch_invariant"):
        fdlib.plan(2, H_Q, H_KV, D, L_MAX, dtype=torch.float32, device=DEVICE, batch_invariant="yes")
    p = fdlib.plan(2, H_Q, H_KV, D, L_MAX, dtype=torch.float32, device=DEVICE, batch_invariant=True)
    assert p.decision.invariant and p.kernel == "unified" and "batch-invariant" in str(p)
