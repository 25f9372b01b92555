"""Compiled kernels on a CUDA GPU: large shapes, a back-to-back stress test, CUDA-graph replay, error paths.

Every test is marked ``gpu`` and skipped without CUDA (or when fdlib was forced into the interpreter).
Self-contained and sized to finish in well under two minutes on an H100/H200, compile time included.
"""
from __future__ import annotations

import math

import pytest
import torch

import fdlib
from fdlib import runtime
from fdlib.calibration import calibration_for
from fdlib.gpus import live_gpu
from fdlib.kernels import launch
from fdlib.kernels.config import chunk_for, tile_config
from fdlib.plan import decide
from fdlib.reference import _scores, _softmax_av
from helpers import assert_attention_close, counters_zero

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or runtime.INTERPRET,
                       reason="needs a CUDA GPU with compiled Triton kernels"),
    pytest.mark.timeout(300),
]
METHODS = ("split", "unified", "persistent", "auto")


def gpu_reference(q, k, v, lens, scale=None):
    """The float64 reference formula (fdlib.reference), evaluated on the GPU for sizes the CPU is too slow for."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q.double(), k.double(), lens.long(), scale, torch.float64)
    o, lse = _softmax_av(s, v.double(), torch.float64, lens.long())
    return o, lse


def problem(B, L, H_kv, group, D, dtype, seed, lens=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H_kv * group, D, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, L, H_kv, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(B, L, H_kv, D, generator=g, device="cuda").to(dtype)
    if lens is None:
        lens = torch.randint(0, L + 1, (B,), generator=g, device="cuda")
        lens[0] = L
        if B > 2:
            lens[1], lens[2] = 0, 1
    return q, k, v, torch.as_tensor(lens, device="cuda").to(torch.int32)


LARGE = [  # B, L, H_kv, group, D, dtype
    (16, 4096, 8, 4, 128, torch.float16),
    (2, 32768, 8, 8, 128, torch.bfloat16),
    (4, 8192, 4, 1, 64, torch.float16),
    (3, 16384, 2, 4, 80, torch.float32),
    (8, 2048, 4, 8, 96, torch.bfloat16),
    (2, 4096, 2, 4, 256, torch.float16),
    (1, 32768, 1, 8, 128, torch.float16),     # B=1: the case split-KV exists for
]


@pytest.mark.parametrize("B,L,H_kv,group,D,dtype", LARGE, ids=lambda x: str(x).replace("torch.", ""))
def test_large_shapes(B, L, H_kv, group, D, dtype):
    q, k, v, lens = problem(B, L, H_kv, group, D, dtype, seed=L + D)
    ref = gpu_reference(q, k, v, lens)
    outs = {}
    for method in METHODS:
        out, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
        assert_attention_close(out, lse, q, k, v, lens, ref=ref, what=f"{method} {B}x{L} D={D} g={group}")
        outs[method] = out
    for method in ("split", "unified"):
        out, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True, num_splits=37)
        assert_attention_close(out, lse, q, k, v, lens, ref=ref, what=f"{method} 37 splits")
    torch.cuda.synchronize()
    assert counters_zero()


@pytest.mark.parametrize("B,L,H_kv,group,dtype,auto_takes_it", [(64, 512, 32, 1, torch.float16, "H200"),
                                                                 (64, 2048, 8, 4, torch.bfloat16, "H200"),
                                                                 (64, 512, 8, 4, torch.bfloat16, "H100 H200"),
                                                                 (300, 300, 1, 3, torch.float16, None),
                                                                 (64, 2048, 32, 1, torch.float16, "H200")])
def test_persistent_and_auto_on_many_rows(B, L, H_kv, group, dtype, auto_takes_it):
    """Many rows of short caches, ragged (0, 1 and L among them), against float64; auto takes the persistent kernel
    on the GPUs named (a word of the GPU's name) where their benchmarks showed it faster, given the host lengths of
    equal rows as those benchmarks were, and the unified kernel on
    the other measured GPU: on an H200 at every shape here, on an H100 only at B=64 32:8 rows of 512 keys, 993
    keys a program (``results/h100/gpu-check/grid/ab-persistent.md``: the others stream 3972 and more, where the
    unified kernel was faster)."""
    from fdlib.gpus import live_gpu
    from fdlib.splits import PERSISTENT_MAX_KEYS
    q, k, v, lens = problem(B, L, H_kv, group, 128, dtype, seed=B + L)
    gpu = next((w for w in live_gpu().name.split() if w in PERSISTENT_MAX_KEYS), None)
    if auto_takes_it is not None and gpu is not None:
        # the measured regime: a plan given the host lengths of equal rows (without lengths, the device schedule)
        kernel = decide(B, group * H_kv, H_kv, 128, L, dtype, lengths=(L,) * B).kernel
        assert kernel == ("persistent" if gpu in auto_takes_it.split() else "unified"), (gpu, kernel)
    ref = gpu_reference(q, k, v, lens)
    for method in ("auto", "persistent"):
        out, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
        assert_attention_close(out, lse, q, k, v, lens, ref=ref, what=f"{method} B={B} L={L}")


def test_persistent_in_a_cuda_graph_with_lengths_changed_in_place():
    B, L, H_kv, group, D = 128, 1024, 4, 4, 128
    q, k, v, lens = problem(B, L, H_kv, group, D, torch.float16, seed=13, lens=[L] * B)
    static_lens = lens.clone()
    fdlib.decode_attention(q, k, v, static_lens, method="persistent")   # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fdlib.decode_attention(q, k, v, static_lens, method="persistent")
    g = torch.Generator(device="cuda").manual_seed(14)
    for i in range(50):
        new = torch.randint(0, L + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
        new[i % B] = 0
        static_lens.copy_(new)
        graph.replay()
        expected = fdlib.decode_attention(q, k, v, new, method="unified", num_splits=1)
        diff = (static_out.float() - expected.float()).abs().max().item()
        assert diff <= 2e-3, f"replay {i}: persistent graph vs eager unified@1: max |diff| {diff:.3e}"
    assert_attention_close(static_out, None, q, k, v, new, ref=gpu_reference(q, k, v, new), what="last replay")


def test_stress_back_to_back_unified_vs_split():
    """2000 unified calls in a row with changing lengths and split counts; each must match the two-stage path
    run on the same inputs (same arithmetic in float32: differences are at most an output rounding)."""
    B, L, H_kv, group, D = 4, 2048, 2, 4, 128
    q, k, v, _ = problem(B, L, H_kv, group, D, torch.float16, seed=7, lens=[L] * B)
    g = torch.Generator(device="cuda").manual_seed(8)
    worst = torch.zeros((), device="cuda")
    for i in range(2000):
        lens = torch.randint(0, L + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
        if i % 7 == 0:
            lens[i % B] = 0
        splits = None if i % 3 == 0 else 1 + i % 40
        a = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=splits)
        b = fdlib.decode_attention(q, k, v, lens, method="split", num_splits=splits)
        worst = torch.maximum(worst, (a.float() - b.float()).abs().max())
    torch.cuda.synchronize()
    assert worst.item() <= 2e-3, f"unified vs split: max |diff| {worst.item():.3e}"
    assert counters_zero()
    # and the last one against float64
    out = fdlib.decode_attention(q, k, v, lens, method="unified")
    assert_attention_close(out, None, q, k, v, lens, ref=gpu_reference(q, k, v, lens))


def test_cuda_graph_replay_with_lengths_changed_in_place():
    B, L, H_kv, group, D = 3, 4096, 4, 4, 128
    q, k, v, lens = problem(B, L, H_kv, group, D, torch.float16, seed=9, lens=[L, L // 2, 5])
    static_lens = lens.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):       # warm up: compile, create the ticket counters
        for _ in range(3):
            fdlib.decode_attention(q, k, v, static_lens, method="unified")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fdlib.decode_attention(q, k, v, static_lens, method="unified")
    g = torch.Generator(device="cuda").manual_seed(10)
    worst = 0.0
    for i in range(300):
        new = torch.randint(0, L + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
        if i % 10 == 0:
            new[1] = 0
        if i % 10 == 1:
            new[:] = L
        static_lens.copy_(new)
        graph.replay()
        expected = fdlib.decode_attention(q, k, v, new, method="split")
        diff = (static_out.float() - expected.float()).abs().max().item()
        worst = max(worst, diff)
        if i % 50 == 0:   # now and then against float64 as well
            assert_attention_close(static_out, None, q, k, v, new, ref=gpu_reference(q, k, v, new),
                                   what=f"replay {i}")
    torch.cuda.synchronize()
    assert worst <= 2e-3, f"graph replay vs eager split: max |diff| {worst:.3e}"
    assert counters_zero()


def test_error_before_launch_leaves_counters_valid():
    q, k, v, lens = problem(4, 4096, 2, 4, 128, torch.float16, seed=11)
    good = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=16)
    bad_calls = [
        dict(num_splits=0), dict(scale=float("nan")),
        dict(cache_seqlens=torch.tensor([1, 2, 3, 5000], dtype=torch.int32, device="cuda"), check_lengths=True),
        dict(cache_seqlens=torch.tensor([1, 2, 3, 5000], dtype=torch.int32)),       # on the host: checked at once
        dict(cache_seqlens=[1, 2, -3, 4]),
    ]
    for bad in bad_calls:
        args = dict(cache_seqlens=lens, method="unified", num_splits=16)
        args.update(bad)
        with pytest.raises(ValueError):
            fdlib.decode_attention(q, k, v, **args)
    again = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=16)
    torch.cuda.synchronize()
    assert torch.equal(good, again)
    assert counters_zero()
    assert_attention_close(again, None, q, k, v, lens, ref=gpu_reference(q, k, v, lens))


@pytest.mark.parametrize("method", ["split", "unified"])
def test_out_of_memory_names_the_bytes(method):
    """A workspace that cannot exist (B·H_q·splits·(D+1)·4 bytes, ~275 GB at 256 splits) raises torch.OutOfMemoryError with
    a message naming the bytes; nothing is launched and a later call works."""
    B, H_kv, group, D, L = 64, 8, 4096, 128, 32768
    splits = chunk_for(L, 256, tile_config(D, L).BLOCK_N)[1]        # 256 with tiles of <= 128 keys
    q = torch.zeros(B, H_kv * group, D, dtype=torch.float16, device="cuda")
    k = torch.zeros(B, L, 1, D, dtype=torch.float16, device="cuda").expand(B, L, H_kv, D)   # one KV head of memory
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    with pytest.raises(oom) as info:
        fdlib.decode_attention(q, k, k, method=method, num_splits=splits)
    msg = str(info.value)
    need = B * H_kv * group * splits * (D + 1) * 4       # the plan's split workspace
    assert "bytes" in msg and str(need) in msg, msg
    del q, k
    torch.cuda.empty_cache()
    q, k, v, lens = problem(2, 1024, 2, 4, 64, torch.float16, seed=12)
    out = fdlib.decode_attention(q, k, v, lens, method=method)
    assert_attention_close(out, None, q, k, v, lens, ref=gpu_reference(q, k, v, lens))
    assert counters_zero()


# ---------------------------------------------------------------------------------------------- plan / run
def _fresh_shape(seed, B=3, L=3000, H_kv=2, group=4, D=128, dtype=torch.float16):
    """A shape no other test uses, so that its plan is made inside the test."""
    return problem(B, L + seed, H_kv, group, D, dtype, seed=seed)


def test_default_call_never_syncs():
    """Under torch.cuda.set_sync_debug_mode("error") a default call, plan creation included, does no
    device-to-host copy and no synchronisation (the calibration is loaded once per GPU beforehand)."""
    calibration_for(live_gpu())
    runtime.smoke_check()
    for method in METHODS:
        q, k, v, lens = _fresh_shape(seed=21 + METHODS.index(method))
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
            out2 = fdlib.decode_attention(q, k, v, lens, method=method)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_attention_close(out, lse, q, k, v, lens, ref=gpu_reference(q, k, v, lens), what=method)
        assert torch.equal(out, out2)


@pytest.mark.parametrize("warm", [True, False], ids=["after-one-eager-call", "cold"])
def test_default_call_captures_as_written(warm):
    """The default call, exactly as written, inside torch.cuda.graph; replays follow lengths changed in place."""
    q, k, v, lens = _fresh_shape(seed=40 + warm, L=5000)
    static = lens.clone()
    if warm:
        fdlib.decode_attention(q, k, v, static)
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fdlib.decode_attention(q, k, v, static)
    g = torch.Generator(device="cuda").manual_seed(3)
    for i in range(20):
        static.copy_(torch.randint(0, k.shape[1] + 1, (q.shape[0],), generator=g, device="cuda", dtype=torch.int32))
        graph.replay()
        assert_attention_close(out, None, q, k, v, static, ref=gpu_reference(q, k, v, static), what=f"replay {i}")
    assert counters_zero()


@pytest.mark.parametrize("method", METHODS + ("balanced", "streamk"))
def test_captured_plan_replayed_with_new_lengths(method):
    """plan.run captured once; 100 replays with lengths rewritten in place (0, 1, L, and lengths longer than the
    plan's host lengths: the last split runs to the row's end) match the float64 reference."""
    B, L = 6, 6000
    q, k, v, lens = problem(B, L, 2, 4, 128, torch.bfloat16, seed=50)
    p = fdlib.plan(B, 8, 2, 128, L, dtype=torch.bfloat16, device="cuda", lengths=[300] * B, method=method)
    static = lens.clone()
    out = torch.empty_like(q)
    lse = torch.empty(B, 8, device="cuda")
    p.run(q, k, v, static, out=out, lse=lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.run(q, k, v, static, out=out, lse=lse)
    g = torch.Generator(device="cuda").manual_seed(51)
    for i in range(100):
        new = torch.randint(0, L + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
        new[i % B] = (0, 1, L)[i % 3]
        static.copy_(new)
        graph.replay()
        if i % 10 == 9:
            assert_attention_close(out, lse, q, k, v, static, ref=gpu_reference(q, k, v, static),
                                   what=f"{p} replay {i}")
    torch.cuda.synchronize()
    assert p.workspace.counters is None or int(p.workspace.counters.count_nonzero()) == 0
    assert p.clamped() is False


def test_plan_workspace_reused_over_1000_calls():
    """1000 plan.run calls with changing lengths into caller-owned out/lse: no new memory, the same workspace,
    counters back at 0, and the last result right; the direct launch gives bit-identical results to Triton's
    generic launch."""
    B, L = 4, 8192
    q, k, v, _ = problem(B, L, 8, 4, 128, torch.float16, seed=60)
    p = fdlib.plan(B, 32, 8, 128, L, dtype=torch.float16, device="cuda", method="unified", num_splits=12)
    out = torch.empty_like(q)
    lse = torch.empty(B, 32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(61)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    p.run(q, k, v, lens, out=out, lse=lse)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ptrs = [t.data_ptr() for t in (p.workspace.o_part, p.workspace.lse_part, p.workspace.counters)]
    for i in range(1000):
        lens = torch.randint(0, L + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
        p.run(q, k, v, lens, out=out, lse=lse)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= 4096, "plan.run allocated memory"    # only the lens draws
    assert ptrs == [t.data_ptr() for t in (p.workspace.o_part, p.workspace.lse_part, p.workspace.counters)]
    assert int(p.workspace.counters.count_nonzero()) == 0
    assert_attention_close(out, lse, q, k, v, lens, ref=gpu_reference(q, k, v, lens), what="call 1000")
    assert launch.FAST_LAUNCH == triton_version_is_36() and (not launch.FAST_LAUNCH or p._launchers[0]._compiled)
    fast = out.clone()
    saved = launch.FAST_LAUNCH
    launch.FAST_LAUNCH = False
    try:
        p.run(q, k, v, lens, out=out, lse=lse)
    finally:
        launch.FAST_LAUNCH = saved
    assert torch.equal(fast, out), "direct and generic launches differ"


def triton_version_is_36():
    import triton
    return triton.__version__.startswith("3.6")


def test_torch_compile_fullgraph_on_the_gpu():
    """A decode step calling fdlib.decode_attention compiles with inductor and fullgraph=True; same numbers."""
    q, k, v, lens = problem(2, 4096, 2, 4, 128, torch.float16, seed=70)
    w = torch.randn(128, 128, device="cuda", dtype=torch.float16) / 12

    def step(q, k, v, lens):
        return fdlib.decode_attention(q @ w, k, v, lens).float().sum(-1)

    got = torch.compile(step, fullgraph=True)(q, k, v, lens)
    torch.testing.assert_close(got, step(q, k, v, lens), atol=2e-2, rtol=2e-3)


def test_batch_invariance_over_200_random_batches():
    """Each of 24 sequences (ragged, fp16, 32:8, D=128, L_max=8192) decoded alone, then in 200 random batches
    of 1 to 16 (random batchmates and positions): out and lse bitwise equal every time."""
    n, L = 24, 8192
    q, k, v, lens = problem(n, L, 8, 4, 128, torch.float16, seed=80)
    alone = [fdlib.decode_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], lens[i:i + 1], batch_invariant=True,
                                    return_lse=True) for i in range(n)]
    g = torch.Generator().manual_seed(81)
    for trial in range(200):
        idx = torch.randperm(n, generator=g)[:int(torch.randint(1, 17, (1,), generator=g))].cuda()
        o, lse = fdlib.decode_attention(q[idx], k[idx], v[idx], lens[idx], batch_invariant=True, return_lse=True)
        for pos, i in enumerate(idx.tolist()):
            assert torch.equal(o[pos], alone[i][0][0]) and torch.equal(lse[pos], alone[i][1][0]), (trial, i, pos)
    assert_attention_close(alone[0][0], alone[0][1], q[:1], k[:1], v[:1], lens[:1],
                           ref=gpu_reference(q[:1], k[:1], v[:1], lens[:1]))


def paged_gpu(B, L_max, H_kv, group, D, page, dtype, seed, lens):
    """A shuffled page pool with a shared prefix (rows 0 and 1) and -1 past each length; the contiguous K/V the
    table describes, for the reference."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = -(-L_max // page)
    n_pages = B * max_pages + 5
    q = torch.randn(B, H_kv * group, D, generator=g, device="cuda").to(dtype)
    kp = torch.randn(n_pages, page, H_kv, D, generator=g, device="cuda").to(dtype)
    vp = torch.randn(n_pages, page, H_kv, D, generator=g, device="cuda").to(dtype)
    bt = torch.stack([torch.randperm(n_pages, generator=g, device="cuda")[:max_pages] for _ in range(B)])
    bt = bt.to(torch.int32)
    if B > 1:
        bt[1, : max_pages // 2] = bt[0, : max_pages // 2]
    lens = torch.as_tensor(lens, device="cuda", dtype=torch.int32)
    used = (lens.long() + page - 1) // page
    bt[torch.arange(max_pages, device="cuda")[None, :] >= used[:, None]] = -1
    idx = bt.long().clamp(0, n_pages - 1)
    k = kp[idx].reshape(B, max_pages * page, H_kv, D)
    v = vp[idx].reshape(B, max_pages * page, H_kv, D)
    return q, kp, vp, bt, k, v, lens


@pytest.mark.parametrize("page", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("method", METHODS + ("balanced", "streamk", "naive"))
def test_paged_ragged_large(page, method):
    """Compiled kernels on a paged, ragged batch (lengths 0, 1, page and tile edges, long rows): float64 agrees."""
    B, L_max = 6, 9000
    lens = [L_max, 0, 1, page + 1, 4095, 257]
    q, kp, vp, bt, k, v, lens = paged_gpu(B, L_max, 4, 4, 128, page, torch.float16, seed=90 + page, lens=lens)
    out, lse = fdlib.decode_attention(q, kp, vp, lens, block_table=bt, method=method, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, ref=gpu_reference(q, k, v, lens), what=f"{method} page={page}")
    assert counters_zero()


D256 = [  # B, L, H_kv, group, page, splits: the heads-sweep batches of D = 256 near which an H100 A/B of the chooser's
    (8, 8192, 2, 8, 16, 8),      # constants met an illegal memory access (results/h100/chooser-ab/README.md)
    (8, 8192, 4, 4, 16, 5),
    (1, 8192, 4, 4, 16, 20),
    (1, 65536, 2, 8, 0, 80),
    (8, 65536, 2, 8, 0, 10),
    (8, 65536, 2, 8, 16, 14),
]


@pytest.mark.parametrize("B,L,H_kv,group,page,splits", D256, ids=lambda x: str(x))
@pytest.mark.parametrize("method", ("unified", "split", "auto"))
def test_head_dim_256_batches(B, L, H_kv, group, page, splits, method):
    """D = 256 (32-key tiles), over pages of 16 and contiguous, at the split counts the chooser's A/Bs planned (auto:
    its own), against float64."""
    D, dtype = 256, torch.float16
    if page:
        q, kp, vp, bt, k, v, lens = paged_gpu(B, L, H_kv, group, D, page, dtype, seed=L + B, lens=[L] * B)
    else:
        q, kp, vp, lens = problem(B, L, H_kv, group, D, dtype, seed=L + B, lens=[L] * B)
        bt, k, v = None, kp, vp
    out, lse = fdlib.decode_attention(q, kp, vp, lens, block_table=bt, method=method, return_lse=True,
                                      num_splits=None if method == "auto" else splits)
    torch.cuda.synchronize()
    assert_attention_close(out, lse, q, k, v, lens, ref=gpu_reference(q, k, v, lens),
                           what=f"{method} D=256 B={B} L={L} {H_kv * group}:{H_kv} page={page} splits={splits}")
    assert counters_zero()


@pytest.mark.parametrize("method", METHODS + ("balanced", "streamk"))
def test_captured_paged_plan_replayed_with_new_lengths_and_tables(method):
    """A paged plan captured once; replays with lengths and block tables rewritten in place stay exact."""
    B, L_max, page = 5, 5008, 16
    q, kp, vp, bt, k, v, lens = paged_gpu(B, L_max, 2, 4, 128, page, torch.bfloat16, seed=95, lens=[5008] * B)
    p = fdlib.plan(B, 8, 2, 128, L_max, dtype=torch.bfloat16, device="cuda", lengths=[400] * B, method=method,
                   page_size=page)
    s_lens, s_bt = lens.clone(), bt.clone()
    out, lse = torch.empty_like(q), torch.empty(B, 8, device="cuda")
    p.run(q, kp, vp, s_lens, block_table=s_bt, out=out, lse=lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.run(q, kp, vp, s_lens, block_table=s_bt, out=out, lse=lse)
    g = torch.Generator().manual_seed(96)
    n_pages = kp.shape[0]
    for i in range(20):
        new = torch.randint(0, L_max + 1, (B,), generator=g)
        new[i % B] = (0, 1, L_max)[i % 3]
        table = torch.stack([torch.randperm(n_pages, generator=g)[:bt.shape[1]] for _ in range(B)]).to(torch.int32)
        s_lens.copy_(new)
        s_bt.copy_(table)
        graph.replay()
        idx = s_bt.long()
        k2 = kp[idx].reshape(B, -1, 2, 128)
        v2 = vp[idx].reshape(B, -1, 2, 128)
        assert_attention_close(out, lse, q, k2, v2, s_lens, ref=gpu_reference(q, k2, v2, s_lens),
                               what=f"{p} replay {i}")
    assert p.clamped() is False


@pytest.mark.parametrize("method", METHODS + ("balanced", "streamk"))
def test_default_mode_is_bitwise_deterministic_run_to_run(method):
    """The same batch decoded 50 times by the compiled kernels gives the same bits every time: the ticket picks
    which program merges, never the order of the sum."""
    q, k, v, lens = problem(5, 12000, 4, 4, 128, torch.float16, seed=100)
    first = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
    for _ in range(50):
        o, lse = fdlib.decode_attention(q, k, v, lens, method=method, return_lse=True)
        assert torch.equal(o, first[0]) and torch.equal(lse, first[1]), method


def test_paged_plans_made_before_the_first_launch_match_later_ones():
    """In a fresh process, auto's plans over pages of 16 made before the unified kernel's first launch (the cost
    model's estimate of programs an SM) have the splits of the same plans made after a launch (the compiled
    kernel's count). They once differed: 16 against 32 splits at B=1 32:8 L=131072 (174.1 against 129.3 µs)."""
    import os
    import subprocess
    import sys
    code = """
import torch, fdlib
from fdlib.calibration import calibration_for
from fdlib.gpus import live_gpu
calibration_for(live_gpu())
shapes = [(1, 131072), (16, 32768), (64, 2048), (4, 32768), (8, 8192)]
plan = lambda B, L: fdlib.plan(B, 32, 8, 128, L, dtype=torch.float16, device="cuda", lengths=[L] * B,
                               method="unified", page_size=16)
before = [plan(B, L).splits for B, L in shapes]
B, L = 2, 4096
p = plan(B, L)
pages = torch.randn(B * L // 16, 16, 8, 128, device="cuda", dtype=torch.float16)
table = torch.arange(B * L // 16, device="cuda", dtype=torch.int32).reshape(B, -1)
q = torch.randn(B, 32, 128, device="cuda", dtype=torch.float16)
p.run(q, pages, pages, torch.full((B,), L, device="cuda", dtype=torch.int32), block_table=table)
torch.cuda.synchronize()
after = [plan(B, L).splits for B, L in shapes]
print(before, after)
assert before == after, (before, after)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-3000:]
