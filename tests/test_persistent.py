"""The persistent no-split kernel against the float64 reference: rows walked by fewer programs than rows,
ragged lengths (0, 1, tile edges), groups that are not powers of two, odd head dims, strided inputs, every
dtype, and the rule that makes ``method="auto"`` pick it."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import fdlib
from fdlib.kernels.config import tile_config
from fdlib.kernels.persistent import MAX_ROWS_PER_PROGRAM, programs_for, run_persistent
from fdlib.splits import PERSISTENT_MIN_WAVES, choose_kernel, persistent_max_keys, persistent_per_sm, sm_count
from helpers import BLOCK_N, DEVICE, DTYPES, assert_attention_close, hyp_settings, make_problem

N = BLOCK_N
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # Triton interpreter noise
EDGE = [0, 1, N - 1, N, N + 1, 2 * N - 1, 2 * N + 1, 3]


def run(q, k, v, lens, programs, scale=None):
    """Call the kernel directly with a chosen number of programs (the API picks it from the SM count)."""
    B, H_q, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H_q), float("nan"), device=q.device)
    run_persistent(q, k, v, lens, scale=scale, cfg=tile_config(D, k.shape[1]), out=out, lse=lse, programs=programs)
    return out, lse


@pytest.mark.parametrize("programs", [1, 2, 3, 7, 16, 40])
def test_programs_walk_every_row(programs):
    """1 program for all 16 rows, a few rows each, one row each, more programs than rows (clamped)."""
    q, k, v, lens = make_problem(len(EDGE), 2 * N + 1, 4, 2, 32, torch.float32, seed=programs, lens=EDGE)
    out, lse = run(q, k, v, lens, programs)
    assert_attention_close(out, lse, q, k, v, lens, what=f"programs={programs}")


@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
def test_group_sizes(group):
    H_kv = 3 if group < 7 else 2
    q, k, v, lens = make_problem(3, 3 * N + 2, group * H_kv, H_kv, 32, torch.float32, seed=group,
                                 lens=[3 * N + 2, N - 3, 0])
    out, lse = run(q, k, v, lens, 4)
    assert_attention_close(out, lse, q, k, v, lens, what=f"group={group}")


@pytest.mark.parametrize("D", [32, 64, 80, 96, 128])
def test_head_dims(D):
    q, k, v, lens = make_problem(3, 2 * N + 3, 4, 2, D, torch.float32, seed=D, lens=[2 * N + 3, N, 1])
    out, lse = run(q, k, v, lens, 2)
    assert_attention_close(out, lse, q, k, v, lens, what=f"D={D}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "slice", "permuted"])
def test_dtypes_and_layouts(dtype, layout):
    q, k, v, lens = make_problem(4, 2 * N + 5, 6, 3, 64, dtype, seed=9, lens=[2 * N + 5, 9, 0, N], layout=layout)
    out, lse = run(q, k, v, lens, 5)
    assert_attention_close(out, lse, q, k, v, lens, what=f"{dtype} {layout}")


def test_strided_q_and_lengths_through_the_api():
    q_big, k, v, _ = make_problem(3, 40, 8, 2, 32, torch.float32, seed=8)
    q = q_big[:, ::2]
    lens = torch.tensor([33, -5, 6, 99, 0, 7], dtype=torch.int64, device=DEVICE)[::2]
    out, lse = fdlib.decode_attention(q, k, v, lens, method="persistent", return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what="strided q/lens")


def test_matches_unified_at_one_split():
    """Same tiles, same float32 arithmetic per row: the persistent kernel and the unified one at 1 split agree
    to rounding (the order of the tiles within a row is the same)."""
    q, k, v, lens = make_problem(5, 4 * N + 7, 8, 2, 64, torch.float16, seed=3, lens=[4 * N + 7, 0, 2 * N + 1, 5, N])
    a = fdlib.decode_attention(q, k, v, lens, method="persistent")
    b = fdlib.decode_attention(q, k, v, lens, method="unified", num_splits=1)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


@given(B=st.integers(1, 6), L=st.integers(1, 5 * BLOCK_N), H_kv=st.integers(1, 3),
       group=st.sampled_from([1, 3, 4, 5, 8]), D=st.sampled_from([32, 64, 80, 96]),
       dtype=st.sampled_from(DTYPES), programs=st.integers(1, 9), seed=st.integers(0, 2**20), data=st.data())
@hyp_settings(20)
@pytest.mark.timeout(240)
def test_property_vs_float64(B, L, H_kv, group, D, dtype, programs, seed, data):
    lens = data.draw(st.lists(st.one_of(st.integers(0, L), st.sampled_from([0, 1, L])), min_size=B, max_size=B),
                     label="lens")
    q, k, v, lens_t = make_problem(B, L, group * H_kv, H_kv, D, dtype, seed=seed, lens=lens)
    out, lse = run(q, k, v, lens_t, programs)
    assert_attention_close(out, lse, q, k, v, lens_t, what=f"programs={programs}")


def test_programs_for():
    assert programs_for(2048, 132, 2) == 256                     # 8 rows each
    assert programs_for(512, 132, 2) == 256                      # 2 rows each
    assert programs_for(530, 132, 2) == 177                      # 3 or 2 rows each
    assert programs_for(100, 132, 2) == 100                      # never more programs than rows
    assert programs_for(1 << 20, 132, 2) == (1 << 20) // MAX_ROWS_PER_PROGRAM   # rows per program bounded
    assert programs_for(0, 132, 2) == 1
    for rows in range(1, 700, 7):                                # every program has k or k - 1 rows
        P = programs_for(rows, 132, 2)
        k = -(-rows // P)
        assert P <= max(264, rows // MAX_ROWS_PER_PROGRAM) and (k - 1) * P < rows <= k * P


def test_auto_picks_persistent_for_many_short_rows_of_one_split():
    sms = sm_count()
    rows = PERSISTENT_MIN_WAVES * sms
    short = persistent_max_keys() * sms * persistent_per_sm() // rows    # the longest L that still qualifies

    assert choose_kernel(rows, 1, short, 1) == "persistent"
    assert choose_kernel(rows, 1, short, 2) == "unified"                   # split rows need the merge
    assert choose_kernel(rows - 1, 1, short, 1) == "unified"               # fewer rows than the threshold
    assert choose_kernel(rows, 1, short + 1, 1) == "unified"               # more work a program: start-up amortised


def test_auto_through_the_persistent_kernel_is_right():
    """Enough rows (B·H_kv >= 2·SMs of the interpreter's pretend GPU) for auto to take the persistent path."""
    B = PERSISTENT_MIN_WAVES * sm_count() // 2
    lens = [(7 * i) % (2 * N + 2) for i in range(B)]
    q, k, v, lens_t = make_problem(B, 2 * N + 1, 6, 2, 32, torch.float32, seed=5, lens=lens)
    # planned for equal rows at the capacity: with these ragged host lengths a GPU's auto takes the stream-K
    # kernel instead (fdlib.splits.streamk_suits), and so does a plan made without lengths (device_schedule_suits)
    p = fdlib.plan(B, 6, 2, 32, 2 * N + 1, dtype=torch.float32, lengths=[2 * N + 1] * B)
    if p.splits != 1:
        pytest.skip("the split rule splits this shape here; the persistent path is not taken")
    assert p.kernel == "persistent"
    out, lse = p.run(q, k, v, lens_t, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens_t, what="auto (persistent)")


@pytest.mark.parametrize("name,keys", [("NVIDIA H100 80GB HBM3 (live)", 1536), ("NVIDIA H200 (live)", 65536),
                                       ("NVIDIA A100-SXM4-80GB (live)", 1536), ("NVIDIA GH200 480GB (live)", 1536)])
def test_persistent_limit_by_gpu(monkeypatch, name, keys):
    """The limit follows the live GPU's name (measured on H100 and H200 runs); a GPU not measured takes the
    smallest, so that the persistent kernel runs only where it was measured faster."""
    import fdlib.gpus as gpus
    import fdlib.splits as splits
    monkeypatch.setattr(splits.runtime, "INTERPRET", False)
    monkeypatch.setattr(gpus, "live_gpu", lambda: gpus.GPU(name, sms=132, bandwidth_tbs=3.35, l2_mb=50))
    assert splits.persistent_max_keys() == keys
