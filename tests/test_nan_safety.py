"""NaN safety (issue 14, part 4): every merge in the library handles rows whose partials are all empty
(lse = −∞): the answer is O = 0 and lse = −∞, never NaN. The classic failure is −∞ − (−∞) = NaN in the
weight e^(lse_i − max lse) (vllm PR 39148); a second is 0 · NaN when an empty partial's O holds garbage.

Covered: PyTorch merge and merge_lse, Triton stage 2 (more splits than tiles, zero-length rows), the unified,
persistent and balanced kernels' epilogues, the plan path of every kernel, fdlib.distributed's merges, and the
unified-max method. Rows that are not empty must still be right (so a merge that zeroes everything fails)."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch

import fdlib
from fdlib import exact
from fdlib.distributed import merge_stacked
from fdlib.online_softmax import block_state, empty_state, merge, merge_lse
from helpers import DEVICE, assert_attention_close, make_problem

NEG_INF = float("-inf")


def assert_empty_rows(out, lse, rows, what=""):
    """Rows ``rows`` (a bool mask over out's leading dims) are exactly 0 / −∞; nothing anywhere is NaN."""
    out, lse = out.detach().cpu(), lse.detach().cpu()
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    assert (out[rows] == 0).all(), f"{what}: an empty row's out is not 0"
    assert torch.isneginf(lse[rows]).all(), f"{what}: an empty row's lse is not -inf"


# ------------------------------------------------------------------------------------------ PyTorch merges
def test_merge_of_two_empty_states_and_of_empty_with_full():
    e = empty_state((3,), 4)
    m = merge(e, e)
    assert torch.isneginf(m.m).all() and (m.l == 0).all() and (m.o_tilde == 0).all()
    assert_empty_rows(m.output(), m.lse(), torch.ones(3, dtype=torch.bool), "merge(empty, empty)")
    s = torch.tensor([[0.5, -1.0], [NEG_INF, 2.0], [NEG_INF, NEG_INF]])
    v = torch.randn(3, 2, 4)
    full = block_state(s, v)
    for a, b in ((e, full), (full, e)):
        got = merge(a, b)
        torch.testing.assert_close(got.output(), full.output())
        torch.testing.assert_close(got.lse(), full.lse())
    assert_empty_rows(full.output(), full.lse(), torch.tensor([False, False, True]), "all-masked block")


def test_merge_lse_all_empty_splits():
    o = torch.randn(4, 2, 3, 8)
    lse = torch.randn(4, 2, 3)
    o[:, 1], lse[:, 1] = 0.0, NEG_INF          # batch row 1: every split empty
    o[2, 0], lse[2, 0] = 0.0, NEG_INF          # one empty split in a full row
    out, l = merge_lse(o, lse, dim=0)
    rows = torch.tensor([False, True])[:, None].expand(2, 3)
    assert_empty_rows(out, l, rows, "merge_lse")
    keep = torch.tensor([True, True, False, True])
    want_o, want_l = merge_lse(o[keep, 0], lse[keep, 0], dim=0)
    torch.testing.assert_close(out[0], want_o)
    torch.testing.assert_close(l[0], want_l)


def test_merge_lse_ignores_the_O_of_empty_splits():
    o = torch.full((3, 2, 8), float("nan"))
    lse = torch.full((3, 2), NEG_INF)
    o[0, 1], lse[0, 1] = 1.0, 0.0
    out, l = merge_lse(o, lse, dim=0)
    assert_empty_rows(out, l, torch.tensor([True, False]), "merge_lse with garbage O")


# ------------------------------------------------------------------------------------------ Triton stage 2
def test_stage2_rows_with_every_split_empty():
    from fdlib.kernels.stage2 import run_stage2
    g = torch.Generator().manual_seed(2)
    o = torch.randn(3, 4, 5, 16, generator=g).to(DEVICE)
    lse = torch.randn(3, 4, 5, generator=g).to(DEVICE)
    o[1], lse[1] = 0.0, NEG_INF                  # sequence 1: all splits empty
    o[2, :, 3:], lse[2, :, 3:] = 0.0, NEG_INF    # sequence 2: its last splits empty (more splits than tiles)
    out = torch.empty(3, 4, 16, device=DEVICE)
    l = torch.empty(3, 4, device=DEVICE)
    run_stage2(o, lse, out, l)
    rows = torch.tensor([False, True, False])[:, None].expand(3, 4)
    assert_empty_rows(out, l, rows, "stage 2")
    want_o, want_l = merge_lse(o.cpu(), lse.cpu(), dim=2)
    torch.testing.assert_close(out.cpu()[~rows], want_o[~rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l.cpu()[~rows], want_l[~rows], rtol=1e-5, atol=1e-6)


def test_stage2_ignores_the_O_of_empty_splits():
    from fdlib.kernels.stage2 import run_stage2
    o = torch.full((2, 2, 4, 16), float("nan"), device=DEVICE)
    lse = torch.full((2, 2, 4), NEG_INF, device=DEVICE)
    o[0, :, 0], lse[0, :, 0] = 1.0, 0.5
    out = torch.empty(2, 2, 16, device=DEVICE)
    l = torch.empty(2, 2, device=DEVICE)
    run_stage2(o, lse, out, l)
    assert_empty_rows(out, l, torch.tensor([False, True])[:, None].expand(2, 2), "stage 2 with garbage O")


# ------------------------------------------------------------------------------------------ kernels, plan
LENS = [0, 1, 17, 64, 0]


@pytest.mark.parametrize("method,num_splits", [("split", 4), ("split", None), ("unified", 4), ("unified", None),
                                               ("persistent", None), ("balanced", None), ("streamk", None), ("auto", None),
                                               ("naive", None)])
def test_kernels_zero_length_rows_and_more_splits_than_tiles(method, num_splits):
    """64-key rows in 16-key tiles cut into 4 splits: the 1-key row has 3 empty splits, the 0-key rows 4."""
    q, k, v, lens = make_problem(5, 64, 6, 2, 32, torch.float32, seed=21, lens=LENS)
    out, lse = fdlib.decode_attention(q, k, v, lens, method=method, num_splits=num_splits, return_lse=True)
    rows = (lens.cpu() == 0)[:, None].expand(5, 6)
    assert_empty_rows(out, lse, rows, method)
    assert_attention_close(out, lse, q, k, v, lens, what=method)


def test_batch_invariant_mode_zero_length_rows():
    q, k, v, lens = make_problem(5, 64, 6, 2, 32, torch.float32, seed=22, lens=LENS)
    out, lse = fdlib.decode_attention(q, k, v, lens, batch_invariant=True, return_lse=True)
    assert_empty_rows(out, lse, (lens.cpu() == 0)[:, None].expand(5, 6), "batch_invariant")


@pytest.mark.parametrize("method", ["split", "unified", "persistent", "balanced", "streamk", "naive"])
def test_plan_path_every_row_empty(method):
    """A plan run on a batch whose every row is empty (nothing to merge anywhere), then reused on a full one."""
    p = fdlib.plan(3, 8, 4, 32, 48, dtype=torch.float32, device=DEVICE, method=method,
                   num_splits=3 if method in ("split", "unified") else None)
    q, k, v, _ = make_problem(3, 48, 8, 4, 32, torch.float32, seed=23)
    zero = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    out, lse = p.run(q, k, v, zero, return_lse=True)
    assert_empty_rows(out, lse, torch.ones(3, 8, dtype=torch.bool), f"plan {method}")
    full = torch.tensor([48, 5, 0], dtype=torch.int32, device=DEVICE)
    out, lse = p.run(q, k, v, full, return_lse=True)
    assert_attention_close(out, lse, q, k, v, full, what=f"plan {method} after the empty batch")


# ------------------------------------------------------------------------------------------ distributed
def test_merge_stacked_all_empty_even_with_garbage_O():
    o = torch.randn(3, 2, 4, 8)
    lse = torch.randn(3, 2, 4)
    o[:, 1, :2], lse[:, 1, :2] = float("nan"), NEG_INF      # empty everywhere, O garbage
    out, l = merge_stacked(o, lse)
    rows = torch.zeros(2, 4, dtype=torch.bool)
    rows[1, :2] = True
    assert_empty_rows(out, l, rows, "merge_stacked")
    want_o, want_l = merge_lse(o[:, 0], lse[:, 0], dim=0)
    torch.testing.assert_close(out[0], want_o)
    torch.testing.assert_close(l[0], want_l)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_merge_partials_rows_empty_on_every_rank():
    import torch.distributed as dist
    from fdlib.distributed import merge_partials
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        o = torch.randn(2, 4, 8)
        lse = torch.randn(2, 4)
        o[1], lse[1] = 0.0, NEG_INF
        out, l = merge_partials(o, lse)
        assert_empty_rows(out, l, torch.tensor([False, True])[:, None].expand(2, 4), "merge_partials")
        torch.testing.assert_close(out[0], o[0])
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ unified max
@pytest.mark.parametrize("reduce", ["ticket", "atomic"])
@pytest.mark.parametrize("phi", [None, 0.0, 500.0])
def test_unified_max_zero_length_rows(reduce, phi):
    q, k, v, lens = make_problem(5, 64, 6, 2, 32, torch.float32, seed=24, lens=LENS)
    out, lse, st = exact.unified_max_attention(q, k, v, lens, phi=phi, num_splits=4, reduce=reduce,
                                               return_stats=True)
    rows = (lens.cpu() == 0)[:, None].expand(5, 6)
    assert_empty_rows(out, lse, rows, f"unified_max phi={phi}")
    assert not st["marked"][rows].any(), "an empty row is never marked"
    assert_attention_close(out, lse, q, k, v, lens, what=f"unified_max phi={phi}")
    zero = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    out, lse, st = exact.unified_max_attention(q, k, v, zero, phi=phi, num_splits=4, reduce=reduce, return_stats=True)
    assert_empty_rows(out, lse, torch.ones(5, 6, dtype=torch.bool), "unified_max, all empty")
    assert st["recompute_rate"] == 0.0
