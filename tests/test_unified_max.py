"""FlashDecoding++'s unified-max softmax (fdlib.exact, fdlib.kernels.unified_max): exact on every row against
float64 and against the exact unified kernel, marks exactly the rows whose logits leave the window, recomputes
them, and checks its arguments."""
from __future__ import annotations

import math

import pytest
import torch

import fdlib
from fdlib import exact
from fdlib.kernels import unified_max as um
from fdlib.plan import decide
from helpers import DEVICE, assert_attention_close, make_problem

REDUCES = ("ticket", "atomic")
# pass 1 overflows on purpose on the rows it marks; the interpreter's NumPy says so
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


def logits64(q, k, lens, scale=None):
    """float64 logits [B, H_q, L_max] (-inf past each length), for the marks a test expects."""
    B, H_q, D = q.shape
    H_kv = k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    qg = q.cpu().double().reshape(B, H_kv, H_q // H_kv, D)
    s = torch.matmul(qg, k.cpu().double().permute(0, 2, 3, 1)).reshape(B, H_q, -1) * scale
    keep = torch.arange(k.shape[1])[None, :] < lens.cpu()[:, None]
    return s.masked_fill(~keep[:, None, :], float("-inf"))


def call(q, k, v, lens, **kw):
    return exact.unified_max_attention(q, k, v, lens, return_stats=True, **kw)


# ------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("group,D", [(1, 64), (3, 80), (4, 64), (4, 80)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_random_inputs_match_float64_and_the_exact_kernel(reduce, group, D, num_splits):
    H_kv = 2
    lens = [0, 1, 17, 45, 48]
    q, k, v, lens_t = make_problem(5, 48, group * H_kv, H_kv, D, torch.float32, seed=group * 100 + D, lens=lens)
    out, lse, st = call(q, k, v, lens_t, num_splits=num_splits, reduce=reduce)
    what = f"reduce={reduce} group={group} D={D} splits={num_splits}"
    assert_attention_close(out, lse, q, k, v, lens_t, what=what)
    ref_o, ref_l = fdlib.decode_attention(q, k, v, lens_t, method="unified", num_splits=num_splits, return_lse=True)
    torch.testing.assert_close(out, ref_o, rtol=1e-5, atol=1e-6, msg=what)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    torch.testing.assert_close(lse[fin], ref_l[fin], rtol=1e-6, atol=2e-6, msg=what)
    assert not st["marked"].any(), f"{what}: random logits near phi must not be marked"
    assert st["recompute_rate"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v, lens = make_problem(3, 40, 8, 2, 64, dtype, seed=5, lens=[40, 0, 23])
    out, lse = exact.unified_max_attention(q, k, v, lens, num_splits=2, return_lse=True)
    assert_attention_close(out, lse, q, k, v, lens, what=str(dtype))


def test_4d_q_host_lengths_and_default_lengths():
    q, k, v, _ = make_problem(2, 33, 4, 4, 64, torch.float32, seed=6)
    out = exact.unified_max_attention(q[:, None], k, v, [33, 7])
    assert out.shape == (2, 1, 4, 64)
    assert_attention_close(out, None, q[:, None], k, v, torch.tensor([33, 7], dtype=torch.int32))
    assert_attention_close(exact.unified_max_attention(q, k, v), None, q, k, v, None, what="all L_max")


def test_paged_cache():
    from test_paged import paged_problem
    g = torch.Generator().manual_seed(3)
    q, kp, vp, bt, k, v, lens = paged_problem(g, 3, 6, 2, 80, 16, 4, 14, [64, 0, 37])
    out, lse, st = call(q, kp, vp, lens, block_table=bt, num_splits=3)
    assert_attention_close(out, lse, q, k, v, lens, what="paged")
    q[2, 1] = 0
    q[2, 1, 0] = 400.0     # a logit far above phi in sequence 2, head 1: that row alone is marked
    k[2, 5, 0, 0] = 2.0
    kp[bt[2, 0].long(), 5, 0, 0] = 2.0
    out, lse, st = call(q, kp, vp, lens, block_table=bt, num_splits=3, phi=0.0)
    assert_attention_close(out, lse, q, k, v, lens, what="paged, marked")
    want = torch.zeros(3, 6, dtype=torch.bool)
    want[2, 1] = True
    assert torch.equal(st["marked"], want)


def test_nan_in_one_sequence_stays_in_that_sequence():
    q, k, v, lens = make_problem(3, 30, 4, 2, 64, torch.float32, seed=8, lens=[30, 30, 12])
    v[1, 4, 0, 3] = float("nan")
    out, lse, st = call(q, k, v, lens, num_splits=2)
    assert torch.isnan(out[1, :2]).any() and torch.isfinite(out[1, 2:]).all()
    ok = torch.tensor([True, False, True])
    assert_attention_close(out[ok], lse[ok], q[ok], k[ok], v[ok], lens[ok], what="other sequences")


# ------------------------------------------------------------------------------------------- marks
def adversarial(group=3, seed=11):
    """Sequence 1 / head 1 gets one logit of +150 (above phi + w_hi), sequence 2 / head 0 has every logit about
    -100 below its phi (a per-row phi), the rest are ordinary: exactly those two rows must be marked (with
    group >= 2 both sit in KV head 0's group, whose other heads must stay unmarked)."""
    H_kv, D = 2, 64
    H_q = group * H_kv
    q, k, v, lens = make_problem(4, 40, H_q, H_kv, D, torch.float32, seed=seed, lens=[40, 33, 21, 0])
    kv_head = 1 // group
    q[1, 1] = 0
    q[1, 1, 0] = 150.0 * math.sqrt(D) / 4.0
    k[1, 9, kv_head, 0] = 4.0
    phi = torch.zeros(4, H_q)
    phi[2, 0] = 100.0
    want = torch.zeros(4, H_q, dtype=torch.bool)
    want[1, 1] = want[2, 0] = True
    return q, k, v, lens, phi, want


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_adversarial_rows_are_marked_and_recomputed(reduce, group, num_splits):
    q, k, v, lens, phi, want = adversarial(group)
    win = exact.default_window(40)
    assert torch.equal(exact.would_mark(logits64(q, k, lens), phi.double(), win), want)
    out, lse, st = call(q, k, v, lens, phi=phi.to(DEVICE), num_splits=num_splits, reduce=reduce)
    assert torch.equal(st["marked"], want), st["marked"]
    assert st["recompute_rate"] == pytest.approx(2 / (3 * q.shape[1]))
    assert_attention_close(out, lse, q, k, v, lens, what=f"adversarial group={group}")


def test_marked_rows_are_wrong_without_the_recompute_and_unmarked_rows_need_none():
    """Pass 1 alone overflows (or underflows) on exactly the marked rows; every other row is already exact."""
    q, k, v, lens, phi, want = adversarial(4)
    B, H_q, D = q.shape
    d = decide(B, H_q, 2, D, 40, q.dtype, method="unified", num_splits=3)
    ws = um.make_workspace(B, H_q, 2, D, d.splits, q.device)
    out = torch.empty_like(q)
    lse = torch.empty(B, H_q, device=DEVICE)   # the launch-only runner takes every tensor on the device
    um.run_unified_max(q, k, v, lens, scale=1 / 8, phi=phi.to(DEVICE), window=exact.default_window(40), out=out,
                       lse=lse, splits=d.splits, chunk=d.chunk, cfg=d.tile, workspace=ws, recompute=False)
    ref_o, _ = fdlib.reference_attention(q, k, v, lens)
    err = (out.double() - ref_o.to(out.device)).abs().amax(-1).cpu()
    assert torch.equal(ws.marks.bool().cpu(), want)
    # overflow: inf/NaN; underflow: denormal terms, a few bits left (CPU NumPy keeps denormals; a GPU flushes them to 0)
    assert (~torch.isfinite(err[want]) | (err[want] > 1e-4)).all(), err[want]
    assert (err[~want] < 1e-5).all()
    assert int(ws.counters.count_nonzero()) == 0


@pytest.mark.parametrize("phi", [1000.0, -1000.0])
@pytest.mark.parametrize("reduce", REDUCES)
def test_phi_far_off_recomputes_every_row_and_stays_exact(phi, reduce):
    q, k, v, lens = make_problem(3, 40, 6, 2, 80, torch.float32, seed=12, lens=[40, 1, 0])
    out, lse, st = call(q, k, v, lens, phi=phi, num_splits=3, reduce=reduce)
    assert_attention_close(out, lse, q, k, v, lens, what=f"phi={phi}")
    assert st["marked"][:2].all() and not st["marked"][2].any()   # the empty row is never marked
    assert st["recompute_rate"] == 1.0


def test_a_narrow_window_marks_what_would_mark_predicts():
    q, k, v, lens = make_problem(4, 48, 8, 2, 64, torch.float32, seed=13, lens=[48, 30, 5, 17], q_scale=3.0)
    s = logits64(q, k, lens)
    win = exact.Window(-12.0, 4.0)
    phi = exact.calibrate_phi(s[:, :, :8].transpose(0, 1).reshape(8, -1).T.contiguous(), head_dim=-1)
    want = exact.would_mark(s, phi.double()[None, :].expand(4, 8), win)
    assert 0 < int(want.sum()) < want.numel(), "the test needs some rows marked and some not"
    for reduce in REDUCES:
        out, lse, st = call(q, k, v, lens, phi=phi, window=win, num_splits=2, reduce=reduce)
        assert torch.equal(st["marked"], want)
        assert st["recompute_rate"] == pytest.approx(exact.recompute_rate(s, phi.double()[None, :], win))
        assert_attention_close(out, lse, q, k, v, lens, what=f"narrow window, {reduce}")


def test_phi_none_is_estimated_from_the_first_keys():
    q, k, v, lens = make_problem(2, 100, 4, 2, 64, torch.float32, seed=14, lens=[100, 70])
    phi = exact.estimate_phi(q, k, lens, 1 / 8)
    want = logits64(q, k, lens)[:, :, : exact.FIRST_KEYS].amax(-1)
    torch.testing.assert_close(phi.double().cpu(), want, rtol=1e-5, atol=1e-5)
    out, lse, st = call(q, k, v, lens)
    assert not st["marked"].any()
    torch.testing.assert_close(st["phi"], phi.cpu())   # the stats are on the CPU (documented)
    assert_attention_close(out, lse, q, k, v, lens)
    assert torch.equal(exact.estimate_phi(q, k, torch.tensor([0, 0], dtype=torch.int32), 1 / 8).cpu(),
                       torch.zeros(2, 4))


# ----------------------------------------------------------------------------------- workspace, launch-only
@pytest.mark.parametrize("reduce", REDUCES)
def test_workspace_is_left_ready_and_ticket_mode_is_bitwise_repeatable(reduce):
    q, k, v, lens, phi, want = adversarial(3, seed=15)
    B, H_q, D = q.shape
    d = decide(B, H_q, 2, D, 40, q.dtype, method="unified", num_splits=3)
    ws = exact.make_workspace(B, H_q, 2, D, d.splits, q.device, reduce)
    assert ws.nbytes() == exact.workspace_bytes(B, H_q, 2, D, d.splits, reduce)
    outs = []
    for _ in range(3):
        out = torch.empty_like(q)
        lse = torch.empty(B, H_q, device=DEVICE)
        exact.run_unified_max(q, k, v, lens, scale=1 / 8, phi=phi.to(DEVICE), window=exact.default_window(40),
                              out=out, lse=lse, num_splits=d.splits, chunk=d.chunk, cfg=d.tile, workspace=ws)
        outs.append((out, lse))
        assert int(ws.counters.count_nonzero()) == 0
        for t in (ws.acc, ws.l_sum, ws.f_sum):
            assert t is None or int(t.count_nonzero()) == 0
        assert torch.equal(ws.marks.bool().cpu(), want)
        assert_attention_close(out, lse, q, k, v, lens)
    if reduce == "ticket":
        assert all(torch.equal(o, outs[0][0]) and torch.equal(l, outs[0][1]) for o, l in outs)


# ------------------------------------------------------------------------------------------- window, phi
def test_default_window_is_inside_float32_and_shrinks_with_L():
    w1, w = exact.default_window(1), exact.default_window(131072)
    assert w1.lo == pytest.approx(-125 * math.log(2)) and w1.hi == pytest.approx(exact.LN_FLT_MAX - math.log(65504))
    assert exact.LN_FLT_MIN < w.lo < w.hi < exact.LN_FLT_MAX - math.log(131072)
    assert w.lo == pytest.approx(math.log(131072) - 125 * math.log(2))
    # L terms of e^b times V stay finite, every term >= e^a is normal
    assert 131072 * math.exp(w.hi) * 65504 < exact.FLT_MAX and math.exp(w.lo) > exact.FLT_MIN
    with pytest.raises(ValueError, match="acc_dtype"):
        exact.default_window(4096, acc_dtype=torch.float16)
    with pytest.raises(ValueError, match="L_max"):
        exact.default_window(0)


def test_calibrate_phi_and_recompute_rate():
    s = torch.tensor([[[1.0, 5.0, float("-inf")], [-2.0, -3.0, 0.5]],
                      [[2.0, 0.0, 0.0], [float("-inf")] * 3]])          # [B=2, H_q=2, N=3]
    phi = exact.calibrate_phi(s)
    assert torch.equal(phi, torch.tensor([5.0, 0.5]))
    assert torch.equal(exact.calibrate_phi(torch.full((2, 3), float("-inf"))), torch.zeros(2))
    win = exact.Window(-4.0, 1.0)
    # rows: (0,0): 1-5=-4 ok, 5-5=0 ok -> no; (0,1): -3-0.5=-3.5 ok -> no; (1,0): 0-5 = -5 < -4 -> yes; (1,1) empty
    assert torch.equal(exact.would_mark(s, phi, win), torch.tensor([[False, False], [True, False]]))
    assert exact.recompute_rate(s, phi, win) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="sample_logits"):
        exact.calibrate_phi(torch.tensor([[float("nan")]]))


def test_recompute_curve():
    phis = [-200.0, 0.0, 5.0, 200.0]
    c = exact.recompute_curve(phis, rows=64, L=512)
    assert c["phi"] == phis and set(c["rate"]) == {"gaussian", "student_t"}
    for kind, rate in c["rate"].items():
        assert rate[0] == 1.0 and rate[-1] == 1.0, kind       # phi far below or above every logit
    assert c["rate"]["gaussian"][1] == c["rate"]["gaussian"][2] == 0.0   # phi at the logits' level
    assert all(t >= g for t, g in zip(c["rate"]["student_t"], c["rate"]["gaussian"]))
    narrow = exact.recompute_curve([10.0], rows=256, L=512, window=(-20.0, 2.0))["rate"]
    assert narrow["student_t"][0] > narrow["gaussian"][0]     # heavy tails leave a window more often
    a = exact.synthetic_logits("student_t", rows=4, L=8, seed=3)
    assert torch.equal(a, exact.synthetic_logits("student_t", rows=4, L=8, seed=3))


# ------------------------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("kw,exc,match", [
    (dict(window=(1.0, -1.0)), ValueError, "window: expected finite w_lo < w_hi"),
    (dict(window=(-100.0, 10.0)), ValueError, "window: w_lo=-100.00 lets e"),
    (dict(window=(-10.0, 88.0)), ValueError, "window: w_hi=88.00 lets a sum"),
    (dict(window="wide"), TypeError, "window: expected a pair"),
    (dict(phi=torch.zeros(5)), ValueError, r"phi: expected a number, \[H_q=4\]"),
    (dict(phi=torch.zeros(3, 4)), ValueError, r"phi: expected"),
    (dict(phi=float("nan")), ValueError, "phi: every value must be finite"),
    (dict(phi="zero"), TypeError, "phi: expected a number"),
    (dict(phi=True), TypeError, "phi: expected a number"),
    (dict(reduce="tree"), ValueError, "reduce: expected one of"),
    (dict(return_stats=1), TypeError, "return_stats: expected a bool"),
    (dict(num_splits=0), ValueError, "num_splits"),
])
def test_bad_arguments(kw, exc, match):
    q, k, v, lens = make_problem(2, 16, 4, 2, 16, torch.float32, seed=1, lens=[16, 3])
    with pytest.raises(exc, match=match):
        exact.unified_max_attention(q, k, v, lens, **kw)


def test_bad_tensors_name_the_argument():
    q, k, v, lens = make_problem(2, 16, 4, 2, 16, torch.float32, seed=1, lens=[16, 3])
    with pytest.raises(ValueError, match="q: H_q=3"):
        exact.unified_max_attention(q[:, :3], k, v, lens)
    with pytest.raises(ValueError, match="cache_seqlens: lengths must be <= "):
        exact.unified_max_attention(q, k, v, [16, 17])
    with pytest.raises(TypeError, match="k_cache/v_cache: dtype"):
        exact.unified_max_attention(q, k.half(), v.half(), lens)
    with pytest.raises(ValueError, match="workspace: made for"):
        ws = um.make_workspace(2, 4, 2, 16, 2, q.device)
        um.run_unified_max(q, k, v, lens, scale=0.25, phi=torch.zeros(4), window=(-10, 10), out=q.clone(),
                           lse=torch.empty(2, 4), splits=1, chunk=16, cfg=None, workspace=ws)


# ------------------------------------------------------------------------------------------- bench hook
def test_bench_hook_runs_and_checks_correctness_first(tmp_path):
    from fdlib.bench import unified_max as bench
    res = bench.run_unified_max_bench(quick=True, L=(40,), variants=("unified", "unified_max:ticket"), q_scale=30.0,
                                      progress=False, cpu_runs=1, command="test")
    recs = {r["method"]: r for r in res["records"]}
    assert all(r["status"] == "ok" for r in recs.values()), res["records"]
    assert recs["unified_max:ticket"]["rel_err"] < 1e-2
    assert recs["unified_max:ticket"]["recompute_rate"] == 1.0     # logits ~30x wider: every row leaves the window
    assert recs["unified_max:ticket"]["eager_ratio_unified"] > 0
    assert "unified_max:ticket" in res["summary"]
    paths = bench.write(res, str(tmp_path), "um")
    assert "unified_max:ticket" in open(paths["md"]).read()
    with pytest.raises(ValueError, match="variants"):
        bench.run_unified_max_bench(quick=True, variants=("fast",), progress=False)
