"""python -m fdlib.bench --qlen: its arguments, the bottom-right mask it gives the peers, the float64 sample
reference, the ratio table, and a quick run in the interpreter."""
from __future__ import annotations

import json

import pytest
import torch

from fdlib.bench import load_results
from fdlib.bench.__main__ import main, parser
from fdlib.bench.qlen import (QLEN_GRID, _peer_plan, bottom_right_mask, format_qlen_table, ratios, reference_sample,
                              run_qlen)
from fdlib.course.grading.lab08 import limits_reference, verify_reference


def test_arguments():
    a = parser().parse_args(["--qlen", "--q-lens", "1,4", "--B", "1,16", "--L", "8192"])
    assert a.qlen and a.q_lens == (1, 4) and a.B == (1, 16) and a.L == (8192,)
    assert QLEN_GRID["qlens"] == (1, 2, 4, 8) and (1, 131072) in QLEN_GRID["shapes"] and (16, 8192) in QLEN_GRID["shapes"]
    assert main(["--qlen", "--quick", "--B", "1"]) == 2                       # --B without --L
    with pytest.raises(ValueError, match="qlens: expected q_len values from 1 to 16"):
        run_qlen(quick=True, qlens=(0, 4), progress=False)
    with pytest.raises(ValueError, match="methods: unknown"):
        run_qlen(quick=True, methods=("flashinfer",), progress=False)


@pytest.mark.parametrize("q_len,L", [(1, 5), (4, 12), (4, 3), (8, 8), (3, 1)])
def test_mask_is_the_convention(q_len, L):
    """Row t of the mask has exactly the keys 0 .. L - q_len + t (lab08's limits, written as loops)."""
    m = bottom_right_mask(q_len, L)
    assert m.shape == (q_len, L) and m.dtype == torch.bool
    n = limits_reference(torch.tensor([L]), q_len)[0]
    for t in range(q_len):
        assert m[t].tolist() == [j < n[t] for j in range(L)], (q_len, L, t)


def test_reference_sample_matches_the_per_token_reference():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, 6, 16, generator=g), torch.randn(3, 20, 2, 16, generator=g), torch.randn(3, 20, 2, 16, generator=g)
    ref, _ = verify_reference(q, k, v, torch.tensor([20, 20, 20]))
    got = reference_sample(q, k, v, [0, 2])
    torch.testing.assert_close(got, ref[[0, 2]], rtol=1e-12, atol=1e-12)
    full = reference_sample(q, k, v, [1], causal=False)
    ref1, _ = verify_reference(q[:, :1].expand(3, 4, 6, 16).contiguous(), k, v, torch.tensor([23, 23, 23]))
    torch.testing.assert_close(full[0, 0], ref1[1, 0], rtol=1e-12, atol=1e-12)


def test_peer_mask_choice():
    assert _peer_plan("cudnn", 1, "top-left") == ("none (q_len = 1)", "causal")
    assert _peer_plan("cudnn", 4, "top-left") == ("bottom-right bool mask", "causal")
    assert _peer_plan("cudnn", 4, "bottom-right") == ("is_causal", "causal")
    assert _peer_plan("fa2", 4, "top-left") == ("no mask (not causal)", "non-causal")
    # a backend that runs but refuses is_causal at q_len < L (FlashAttention through SDPA on the H200) is still
    # timed: without a mask at q_len = 1, and marked non-causal above it
    assert _peer_plan("fa2", 1, "refused") == ("none (q_len = 1)", "causal")
    assert _peer_plan("fa2", 4, "refused") == ("no mask (not causal)", "non-causal")
    assert _peer_plan("cudnn", 4, "refused") == ("bottom-right bool mask", "causal")


def _rec(method, T, us, L=8192, status="ok"):
    return dict(B=1, L=L, H_q=32, H_kv=8, D=128, dtype="float16", kv_mb=33.6, method=method, q_len=T, status=status,
                mask="m", semantics="causal", eager_us=us * 2, graph_us=us, rel_err=1e-4, tbs=33.6 / us)


def test_ratios_and_table():
    recs = [_rec("fdlib", 1, 10.0), _rec("fdlib", 4, 11.0), _rec("cudnn", 1, 10.0), _rec("cudnn", 4, 50.0),
            _rec("fdlib", 1, 5.0, L=2048), _rec("fdlib", 4, 9.0, L=2048), _rec("fa2", 1, 9.0, status="error")]
    rows = {(r["method"], r["L"]): r for r in ratios(recs)}
    assert rows[("fdlib", 8192)]["ratio"]["4"] == pytest.approx(1.1) and rows[("fdlib", 8192)]["meets_target"] is True
    assert rows[("cudnn", 8192)]["meets_target"] is False and rows[("fdlib", 2048)]["meets_target"] is None
    assert ("fa2", 8192) not in rows and rows[("fdlib", 8192)]["timing"] == "graph"
    res = {"provenance": {"device": "X", "mode": "gpu", "torch": "t", "triton": "tr", "date_utc": "d", "command": "c"},
           "settings": {"heads": [32, 8], "D": 128, "dtype": "float16", "qlens": [1, 4], "target": "T",
                        "is_causal_alignment": {"cudnn": "top-left"}},
           "records": recs, "ratios": ratios(recs), "skipped": []}
    text = format_qlen_table(res)
    assert "| 1 | 8192 | fdlib | graph | 10.0 | 1.00 | 1.10 | met (≤ 1.15) |" in text
    assert "| 1 | 8192 | cudnn | graph | 10.0 | 1.00 | 5.00 | missed (> 1.15) |" in text
    assert "fa2 | 1 | m | error" in text and "cudnn top-left" in text
    assert not format_qlen_table(res, header=False).startswith("device:")


def test_quick_run_writes_a_loadable_file(tmp_path):
    """A quick interpreter run: every contender is right where it runs, files load with provenance."""
    assert main(["--qlen", "--quick", "--out", str(tmp_path), "--name", "q", "--no-progress"]) == 0
    res = load_results(tmp_path / "q.json")
    assert res["kind"] == "qlen" and res["provenance"]["command"].startswith("python -m fdlib.bench --qlen")
    assert (tmp_path / "q.md").read_text().startswith("device:")
    recs = res["records"]
    assert {r["q_len"] for r in recs} == {1, 2, 4}
    for r in recs:
        if r["status"] == "ok":
            assert r["rel_err"] < 1e-2 and r["eager_us"] > 0, r
    fd = [r for r in recs if r["method"] == "fdlib"]
    assert all(r["status"] == "ok" for r in fd if r["q_len"] == 1)
    for r in fd:     # q_len > 1 through decode_attention: right, or refused by name until the kernels take it
        assert r["status"] == "ok" or (r["status"] == "error" and "q:" in r["reason"]), r
    assert json.loads((tmp_path / "q.json").read_text())["ratios"]
    assert main(["--qlen", "--quick", "--out", str(tmp_path), "--name", "q", "--no-progress"]) == 2   # no overwrite
