"""Context-parallel decode (fdlib.distributed): the merge's math in one process, then 2 and 3 gloo processes on
the CPU (Triton's interpreter) against the float64 reference on the whole cache, and 2 GPUs with NCCL (gpu).

Children are spawned (torch.multiprocessing): each imports this module, whose first import is fdlib, so the
runtime (and TRITON_INTERPRET, inherited from this process's environment) is decided before any kernel is
defined. Every rank saves its (out, lse) to a file; the parent compares them with the reference.
"""
from __future__ import annotations

import fdlib  # noqa: I001  (first: decides the runtime before any kernel is defined, here and in every child)

import math
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fdlib import runtime
from fdlib.distributed import (DEFAULT_MERGE, MERGES, decode_attention_cp, decode_slice, local_seqlens,
                               merge_partials, merge_stacked, shard_bounds)
from fdlib.online_softmax import merge_lse
from fdlib.reference import reference_attention
from hypothesis import given
from hypothesis import strategies as st
from helpers import assert_attention_close, gen, hyp_settings, make_problem

HAVE_GLOO = dist.is_available() and dist.is_gloo_available()
needs_gloo = pytest.mark.skipif(not HAVE_GLOO or not runtime.INTERPRET,
                                reason="needs torch.distributed with gloo, and Triton's interpreter for CPU tensors "
                                       "(with compiled kernels, test_two_gpus_nccl covers the same)")
INF = float("inf")


# ------------------------------------------------------------------------------------------ merge math
def test_merge_stacked_matches_lse_merge_and_keeps_empty_rows_clean():
    """merge_stacked (the merge's code with amax/sum for the collectives) = online_softmax.merge_lse, with
    empty splits, rows empty on every split, and lse values whose plain exp overflows float32."""
    g = gen(1)
    o = torch.randn(3, 2, 4, 8, generator=g)
    lse = torch.randn(3, 2, 4, generator=g) * 30
    lse[0, 0, 0] = -INF                     # one empty split
    lse[:, 1, 1] = -INF                     # empty on every split
    lse[1, 0, 2], lse[2, 0, 2] = 1000.0, 999.0     # e^1000 overflows: only the max-shifted form survives
    lse[:, 1, 3] = -1000.0                  # e^-1000 underflows to 0 for every split
    o[0, 0, 0] = float("nan")               # an empty split's O is ignored, whatever it holds
    out, l = merge_stacked(o, lse)
    ref_o, ref_l = merge_lse(torch.where(torch.isneginf(lse)[..., None], 0.0, o), lse, dim=0)
    torch.testing.assert_close(out, ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l, ref_l, rtol=1e-6, atol=1e-5)
    assert torch.isfinite(out).all()
    assert (out[1, 1] == 0).all() and torch.isneginf(l[1, 1])
    assert l[0, 2].item() == pytest.approx(1000.0 + math.log1p(math.exp(-1.0)), abs=1e-4)
    assert l[1, 3].item() == pytest.approx(-1000.0 + math.log(3.0), abs=1e-4)
    assert out.dtype == torch.float32 and l.dtype == torch.float32


def test_merge_of_key_slices_is_attention_over_the_whole_cache():
    """Reference attention over disjoint key slices (one empty for some rows), merged: attention over all keys."""
    B, L, H_q, H_kv, D = 3, 29, 4, 2, 16
    q, k, v, _ = make_problem(B, L, H_q, H_kv, D, torch.float64, seed=2)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    lens = torch.tensor([29, 6, 0])
    bounds = [0, 7, 7, 20, 29]              # a zero-width slice; sequence 1 lives in the first slice only
    parts = [reference_attention(q, k[:, a:b], v[:, a:b], local_seqlens(lens, a, b))
             for a, b in zip(bounds, bounds[1:])]
    out, l = merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ref_o, ref_l = reference_attention(q, k, v, lens)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l, ref_l, rtol=1e-12, atol=1e-12)
    assert (out[2] == 0).all() and torch.isneginf(l[2]).all()


def test_merge_dtypes_shapes_and_nan():
    g = gen(3)
    o = torch.randn(2, 2, 1, 3, 8, generator=g).to(torch.bfloat16)     # [splits, B, 1, H_q, D]
    lse = torch.randn(2, 2, 3, generator=g)
    out, l = merge_stacked(o, lse)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (2, 1, 3, 8) and l.dtype == torch.float32
    ref, _ = merge_lse(o.float()[:, :, 0], lse, dim=0)
    torch.testing.assert_close(out[:, 0].float(), ref, rtol=8e-3, atol=8e-3)
    lse[1, 0, 0] = float("nan")                                       # NaN in one split: that row only
    out, l = merge_stacked(o, lse)
    assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(l[0, 0])
    assert torch.isfinite(out[1]).all() and torch.isfinite(l[1]).all()


def test_merge_errors_name_the_argument():
    o, lse = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="lse: expected shape"):
        merge_partials(o, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="o: expected"):
        merge_partials(torch.zeros(2, 3), lse)
    with pytest.raises(TypeError, match="o: expected a floating-point"):
        merge_partials(o.int(), lse)
    with pytest.raises(TypeError, match="lse: "):
        merge_partials(o, lse.long())
    with pytest.raises(ValueError, match="lse: expected shape"):
        merge_stacked(o[None], lse)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="group: torch.distributed is not initialized"):
            merge_partials(o, lse)


def test_slicing_helpers():
    assert [shard_bounds(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_bounds(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    assert local_seqlens([0, 5, 9, 30], 4, 9) == [0, 1, 5, 5]
    t = local_seqlens(torch.tensor([0, 5, 9, 30]), 4, 9)
    assert t.dtype == torch.int32 and t.tolist() == [0, 1, 5, 5]
    with pytest.raises(ValueError, match="rank"):
        shard_bounds(10, 2, 2)


# ------------------------------------------------------------------------------------------ q_len > 1, one process
def causal_lengths(lens, T: int, t: int) -> torch.Tensor:
    """Keys query t of q_len = T sees, per sequence: L_b - T + 1 + t, at least 0 (the new tokens are in the cache)."""
    return (lens.to(torch.int64) - (T - 1) + t).clamp_min(0)


def assert_causal_close(out, lse, q, k, v, lens, what):
    """out, lse vs the float64 reference: for a q_len-T q, query t is one-token decode over its first
    L_b - T + 1 + t keys (fdlib.reference_attention per query token)."""
    if q.dim() == 4 and q.shape[1] > 1:
        T = q.shape[1]
        assert tuple(out.shape) == tuple(q.shape) and tuple(lse.shape) == (q.shape[0], T, q.shape[2]), what
        for t in range(T):
            assert_attention_close(out[:, t], lse[:, t], q[:, t], k, v, causal_lengths(lens, T, t),
                                   what=f"{what}, query {t} of {T}")
    else:
        assert_attention_close(out, lse, q, k, v, lens, what=what)


def _slices_merged(q, k, v, lens, bounds, **kw):
    """decode_slice on every slice [bounds[i], bounds[i+1]) in this process, merged with merge_stacked."""
    parts = [decode_slice(q, k[:, a:b], v[:, a:b], cache_seqlens=lens, slice_start=a, **kw)
             for a, b in zip(bounds, bounds[1:])]
    return merge_stacked(torch.stack([p[0].float() for p in parts]), torch.stack([p[1] for p in parts]))


@given(T=st.integers(2, 6), H_kv=st.integers(1, 3), group=st.sampled_from([1, 3, 4]),
       lens=st.lists(st.integers(0, 40), min_size=1, max_size=4), cuts=st.lists(st.integers(0, 40), max_size=3),
       data=st.data())
@hyp_settings(max_examples=12)
def test_qlen_slices_merge_to_causal_attention(T, H_kv, group, lens, cuts, data):
    """q_len > 1 (hypothesis: q_len, group, ragged lengths incl. 0 and < q_len, any cut points incl. empty
    slices and cuts inside the new tokens): each slice's partial, merged, is causal attention over the cache."""
    L = 40
    bounds = [0, *sorted(cuts), L]
    B, D = len(lens), 16
    q, k, v, lens_t = make_problem(B, L, H_kv * group, H_kv, D, torch.float32, seed=len(lens) * 7 + T, lens=lens)
    q4 = torch.randn(B, T, H_kv * group, D, generator=gen(T)).to(q.device)
    out, lse = _slices_merged(q4, k, v, lens_t, bounds)
    assert_causal_close(out, lse, q4, k.cpu(), v.cpu(), lens_t.cpu(), f"bounds {bounds}, lens {lens}, q_len {T}")


def test_qlen_zero_width_slices():
    """Slices holding no position at all (at the start, in the middle, at the end) weigh nothing."""
    q, k, v, lens = make_problem(2, 20, 4, 2, 16, torch.float32, seed=11, lens=[20, 3])
    q4 = torch.randn(2, 3, 4, 16, generator=gen(12)).to(q.device)
    for bounds in ([0, 0, 20], [0, 9, 9, 20], [0, 20, 20]):
        out, lse = _slices_merged(q4, k, v, lens, bounds)
        assert_causal_close(out, lse, q4, k.cpu(), v.cpu(), lens.cpu(), f"bounds {bounds}")


def test_qlen_one_slice_fp16_paged_and_errors():
    """The whole cache as one slice (world size 1's work) in fp16, then as pages behind a shuffled block table;
    a 4-D q needs cache_seqlens and slice_start; errors name the argument."""
    B, L, H_q, H_kv, D, T, P = 3, 32, 8, 2, 32, 4, 8
    q, k, v, lens = make_problem(B, L, H_q, H_kv, D, torch.float16, seed=5, lens=[32, 5, 2])
    q4 = torch.randn(B, T, H_q, D, generator=gen(6)).to(torch.float16).to(q.device)
    out, lse = decode_slice(q4, k, v, cache_seqlens=lens, slice_start=0)
    assert_causal_close(out.to(torch.float16), lse, q4, k.cpu(), v.cpu(), lens.cpu(), "one slice fp16")
    perm = torch.randperm(B * L // P, generator=gen(7))
    pages_k = k.reshape(B * L // P, P, H_kv, D)[torch.argsort(perm)]
    pages_v = v.reshape(B * L // P, P, H_kv, D)[torch.argsort(perm)]
    table = perm.reshape(B, L // P).to(torch.int32).to(q.device)
    assert torch.equal(pages_k[table[1, 2].long()], k[1, 2 * P:3 * P])
    out_p, lse_p = decode_slice(q4, pages_k, pages_v, cache_seqlens=lens, slice_start=0, block_table=table)
    assert_causal_close(out_p.to(torch.float16), lse_p, q4, k.cpu(), v.cpu(), lens.cpu(), "one slice fp16, paged")
    with pytest.raises(ValueError, match="cache_seqlens, slice_start: q has q_len=4"):
        decode_slice(q4, k, v, lens)
    with pytest.raises(ValueError, match="cache_seqlens, slice_start: pass both"):
        decode_slice(q4, k, v, cache_seqlens=lens)
    with pytest.raises(ValueError, match="slice_start: expected an int"):
        decode_slice(q4, k, v, cache_seqlens=lens, slice_start=-1)
    with pytest.raises(ValueError, match="slice_seqlens: pass either"):
        decode_slice(q4, k, v, lens, cache_seqlens=lens, slice_start=0)
    with pytest.raises(ValueError, match="cache_seqlens: expected"):
        decode_slice(q4, k, v, cache_seqlens=lens[:2], slice_start=0)


def test_merge_qlen_layout_and_merge_name():
    """merge_stacked takes [splits, B, q_len, H_q, D] partials; a bad merge name is refused by name."""
    g = gen(8)
    o, lse = torch.randn(3, 2, 4, 3, 8, generator=g), torch.randn(3, 2, 4, 3, generator=g)
    lse[:, 1, 2] = -INF
    out, l = merge_stacked(o, lse)
    ref_o, ref_l = merge_lse(o, lse, dim=0)
    torch.testing.assert_close(out, ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l, ref_l, rtol=1e-6, atol=1e-5)
    assert (out[1, 2] == 0).all() and torch.isneginf(l[1, 2]).all()
    with pytest.raises(ValueError, match="merge: expected one of 'allgather', 'allreduce'"):
        merge_partials(o[0], lse[0], merge="ring")


# ------------------------------------------------------------------------------------------ world size 1
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_gloo
def test_world_size_one_group_in_process():
    """A one-rank gloo group: the merge is the identity (0 for empty rows), decode_attention_cp =
    decode_attention, and the errors of decode_attention name this function's arguments."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        q, k, v, lens = make_problem(2, 21, 4, 2, 16, torch.float32, seed=4, lens=[21, 0])
        want_o, want_l = fdlib.decode_attention(q, k, v, lens, return_lse=True)
        out, l = decode_attention_cp(q, k, v, lens, return_lse=True)
        torch.testing.assert_close(out, want_o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(l, want_l, rtol=1e-6, atol=1e-6)
        assert decode_attention_cp(q, k, v, lens).shape == q.shape
        lse = want_l.clone()
        for merge in MERGES:
            merged, merged_l = merge_partials(want_o, lse, group=dist.group.WORLD, merge=merge)
            torch.testing.assert_close(merged, want_o, rtol=0, atol=0)
            assert torch.equal(torch.isneginf(merged_l), torch.isneginf(want_l)), merge
            assert torch.equal(lse, want_l), "merge_partials must not modify its inputs"
        q4 = torch.randn(2, 3, 4, 16, generator=gen(9))
        out4, lse4 = decode_attention_cp(q4, k, v, cache_seqlens=lens, slice_start=0, return_lse=True)
        assert_causal_close(out4, lse4, q4, k, v, lens, "world size 1, q_len 3")
        with pytest.raises(ValueError, match="merge: expected one of"):
            decode_attention_cp(q, k, v, lens, merge="tree")
        with pytest.raises(ValueError, match="slice_seqlens"):
            decode_attention_cp(q, k, v, torch.tensor([1, 2, 3], dtype=torch.int32))
        with pytest.raises(ValueError, match="k_slice"):
            decode_attention_cp(q, k[:, :, :, :8], v[:, :, :, :8], lens)
        with pytest.raises(TypeError, match="return_lse"):
            decode_attention_cp(q, k, v, lens, return_lse=1)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ several processes
def _worker(rank, world, init, backend, cases, problem_dir, out_dir):
    import fdlib  # noqa: F401,F811  (already first through this module's import; said again for the reader)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        sub = dist.new_group(list(range(world)))          # an explicit group as well as the default one
        for i, case in enumerate(cases):
            p = torch.load(f"{problem_dir}/case{i}.pt")
            q, k, v, lens = (p[n].to(device) for n in ("q", "k", "v", "lens"))
            a, b = case["bounds"][rank], case["bounds"][rank + 1]
            kw = dict(case.get("kwargs", {}), merge=case.get("merge", DEFAULT_MERGE))
            if q.dim() == 4 and q.shape[1] > 1:            # q_len > 1: whole lengths and the slice's start
                kw.update(cache_seqlens=lens, slice_start=a)
                sl = None
            else:
                sl = local_seqlens(lens, a, b)
                if case.get("host_lengths"):
                    sl = sl.tolist()
            group = sub if case.get("subgroup") else None
            out, lse = decode_attention_cp(q, k[:, a:b], v[:, a:b], sl, group=group, return_lse=True, **kw)
            res = {"out": out.cpu(), "lse": lse.cpu()}
            if case.get("graph"):                         # capture one step in a CUDA graph and replay it
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    decode_attention_cp(q, k[:, a:b], v[:, a:b], sl, group=group, return_lse=True, **kw)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    g_out, g_lse = decode_attention_cp(q, k[:, a:b], v[:, a:b], sl, group=group, return_lse=True,
                                                       **kw)
                g_out.zero_()
                graph.replay()
                torch.cuda.synchronize()
                res.update(graph_out=g_out.cpu(), graph_lse=g_lse.cpu())
            torch.save(res, f"{out_dir}/case{i}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(world, backend, cases, tmp_path, device="cpu"):
    """Save every case's problem, spawn ``world`` ranks, compare each rank's (out, lse) with the reference."""
    problems = []
    for i, case in enumerate(cases):
        B, L, H_q, H_kv, D, dtype, lens = (case[n] for n in ("B", "L", "H_q", "H_kv", "D", "dtype", "lens"))
        assert len(case["bounds"]) == world + 1 and case["bounds"][0] == 0 and case["bounds"][-1] == L
        q, k, v, lens = make_problem(B, L, H_q, H_kv, D, dtype, seed=10 + i, lens=lens)
        q, k, v, lens = q.cpu(), k.cpu(), v.cpu(), lens.cpu()
        if case.get("q_len", 1) > 1:
            q = torch.randn(B, case["q_len"], H_q, D, generator=gen(20 + i)).to(dtype)
        torch.save({"q": q, "k": k, "v": v, "lens": lens}, tmp_path / f"case{i}.pt")
        problems.append((q, k, v, lens))
    mp.spawn(_worker, args=(world, f"tcp://127.0.0.1:{_free_port()}", backend, cases, str(tmp_path),
                            str(tmp_path)), nprocs=world, join=True)
    for i, (case, (q, k, v, lens)) in enumerate(zip(cases, problems)):
        first = None
        for rank in range(world):
            r = torch.load(tmp_path / f"case{i}_rank{rank}.pt")
            what = (f"case {i} ({world} ranks, {backend}, merge {case.get('merge', DEFAULT_MERGE)}, "
                    f"bounds {case['bounds']}), rank {rank}")
            assert_causal_close(r["out"], r["lse"], q, k, v, lens, what)
            if "graph_out" in r:
                assert_causal_close(r["graph_out"], r["graph_lse"], q, k, v, lens, what + " graph")
            if first is None:
                first = r
            else:       # every rank ends with the same answer
                assert torch.equal(r["out"], first["out"]) and torch.equal(r["lse"], first["lse"]), what


@needs_gloo
@pytest.mark.timeout(180)
def test_two_ranks_gloo(tmp_path):
    """Uneven slices [0, 13) and [13, 37); sequence 1 (length 9) is empty on rank 1, sequence 2 everywhere;
    then fp16 with the split kernels and the slice lengths as a host list; each with both merges; then
    q_len = 3 and 4 (speculative decoding) with the new tokens on one rank, straddling the boundary, and on
    the other rank, sequences shorter than q_len, a length-0 sequence."""
    cases = []
    for merge in MERGES:
        cases += [
            dict(B=3, L=37, H_q=4, H_kv=2, D=32, dtype=torch.float32, lens=[37, 9, 0], bounds=[0, 13, 37],
                 merge=merge),
            dict(B=2, L=40, H_q=4, H_kv=1, D=16, dtype=torch.float16, lens=[40, 26], bounds=[0, 27, 40],
                 kwargs=dict(method="split", num_splits=2), host_lengths=True, merge=merge),
        ]
    cases += [
        dict(B=5, L=30, H_q=6, H_kv=2, D=16, dtype=torch.float32, lens=[30, 14, 12, 2, 0], bounds=[0, 13, 30],
             q_len=3, merge="allgather"),
        dict(B=4, L=24, H_q=4, H_kv=4, D=32, dtype=torch.float16, lens=[24, 11, 9, 3], bounds=[0, 10, 24],
             q_len=4, merge="allreduce", kwargs=dict(method="unified")),
    ]
    _run(2, "gloo", cases, tmp_path)


@needs_gloo
@pytest.mark.timeout(180)
def test_three_ranks_gloo(tmp_path):
    """Three ranks: an explicit subgroup; in the second case the middle rank holds no position at all and
    sequence 1 (length 17) exactly fills rank 0's slice; both merges; q_len = 2 across all three ranks."""
    cases = []
    for merge in MERGES:
        cases += [
            dict(B=3, L=40, H_q=4, H_kv=2, D=16, dtype=torch.float32, lens=[33, 4, 0], bounds=[0, 6, 25, 40],
                 subgroup=True, merge=merge),
            dict(B=3, L=30, H_q=2, H_kv=2, D=32, dtype=torch.float16, lens=[30, 17, 0], bounds=[0, 17, 17, 30],
                 kwargs=dict(method="unified"), merge=merge),
        ]
    cases.append(dict(B=4, L=21, H_q=3, H_kv=1, D=16, dtype=torch.float32, lens=[21, 8, 7, 1], bounds=[0, 7, 8, 21],
                      q_len=2, merge="allreduce", subgroup=True))
    _run(3, "gloo", cases, tmp_path)


def _mismatch_worker(rank, world, init, out_dir):
    """Two ranks, each holding 16 of 32 keys: calls whose shapes differ across the ranks (B=3 against B=2, then
    the merges), each recorded as its error's message or its result, between calls that agree."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        q, k, v, lens = make_problem(3, 32, 4, 2, 16, torch.float32, seed=41, lens=[32, 20, 9])
        a, b = shard_bounds(32, world, rank)
        sl = local_seqlens(lens, a, b)
        mine = 3 if rank == 0 else 2                       # rank 0 has B=3, rank 1 B=2

        def attempt(**kw):
            n = kw.pop("B")
            try:
                return decode_attention_cp(q[:n], k[:n, a:b], v[:n, a:b], sl[:n], return_lse=True, **kw)
            except ValueError as e:
                return str(e)

        res = {"first": attempt(B=mine),                      # the group's first call: checked by default
               "agreed": attempt(B=2),                        # checked again (the first did not pass), and right
               "every call": attempt(B=5 - mine, check_shapes=True),
               "merges": attempt(B=2, check_shapes=True, merge=MERGES[rank])}
        o, l = decode_attention_cp(q[:2], k[:2, a:b], v[:2, a:b], sl[:2], return_lse=True)
        try:
            merge_partials(o[:mine - 1], l[:mine - 1], check_shapes=True)    # B=2 against B=1
        except ValueError as e:
            res["merge_partials"] = str(e)
        torch.save(res, f"{out_dir}/mismatch_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@needs_gloo
@pytest.mark.timeout(180)
def test_ranks_with_different_shapes_all_raise_gloo(tmp_path):
    """B=3 on rank 0 and B=2 on rank 1 (16 of 32 keys each): every rank raises the same ValueError naming both
    ranks' shapes, on the group's first call by default and on every call with check_shapes=True; different
    merges too; merge_partials as well. Calls that agree go on working, and give attention over all 32 keys."""
    mp.spawn(_mismatch_worker, args=(2, f"tcp://127.0.0.1:{_free_port()}", str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"mismatch_rank{r}.pt") for r in range(2)]
    q, k, v, lens = make_problem(3, 32, 4, 2, 16, torch.float32, seed=41, lens=[32, 20, 9])
    for r in res:
        assert r["first"] == res[0]["first"] and isinstance(r["first"], str), r["first"]
        assert r["first"].startswith("q: the ranks of the group called decode_attention_cp with different shapes")
        assert "rank 0: B=3, q_len=1, H_q=4, D=16, float32" in r["first"] and "rank 1: B=2," in r["first"]
        assert r["every call"] == r["first"].replace("B=3", "B=@").replace("B=2", "B=3").replace("B=@", "B=2")
        assert "merge='allgather'" in r["merges"] and "merge='allreduce'" in r["merges"], r["merges"]
        assert r["merge_partials"].startswith("o: the ranks of the group called merge_partials with different"), r
        assert "rank 0: B=2" in r["merge_partials"] and "rank 1: B=1" in r["merge_partials"]
        out, lse = r["agreed"]
        assert_attention_close(out, lse, q[:2], k[:2], v[:2], lens[:2], what="the call after a refused one")
    assert torch.equal(res[0]["agreed"][0], res[1]["agreed"][0])


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(runtime.INTERPRET or not torch.cuda.is_available() or torch.cuda.device_count() < 2
                    or not (dist.is_available() and dist.is_nccl_available()),
                    reason="needs 2 CUDA GPUs, compiled Triton kernels and NCCL")
def test_two_gpus_nccl(tmp_path):
    """The same on 2 GPUs with NCCL, larger: uneven slices, ragged lengths, fp16 and bf16, CUDA-graph replay."""
    cases = [
        dict(B=4, L=4096, H_q=32, H_kv=8, D=128, dtype=torch.float16, lens=[4096, 1000, 0, 3001],
             bounds=[0, 1500, 4096], graph=True),
        dict(B=3, L=2048, H_q=8, H_kv=1, D=64, dtype=torch.bfloat16, lens=[2048, 700, 0], bounds=[0, 1024, 2048],
             kwargs=dict(method="split"), merge="allreduce"),
        dict(B=4, L=4096, H_q=32, H_kv=8, D=128, dtype=torch.float16, lens=[4096, 1503, 1500, 2], bounds=[0, 1500, 4096],
             q_len=4, graph=True, merge="allreduce"),
        dict(B=2, L=2048, H_q=32, H_kv=8, D=128, dtype=torch.bfloat16, lens=[2048, 1025], bounds=[0, 1024, 2048],
             q_len=4, graph=True, merge="allgather"),
    ]
    _run(2, "nccl", cases, tmp_path)
