"""The Lab 09 grader is tested too: known-wrong dequantizing tile loads fail its checks, and the failure names the
cause (the scale applied twice, a per-token scale on the wrong axis, int8 read as unsigned, ...); a load written
differently from the reference passes; the untouched stub is a TODO."""
from __future__ import annotations

import pytest
import torch

from fdlib.course.grading import core, lab09  # first: importing fdlib picks the runtime before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fdlib.course.grading.core import run_checks  # noqa: E402
from helpers import cell_function  # noqa: E402

NAME = lab09.NAME


@triton.jit
def _load(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr, MISTAKE: tl.constexpr):
    """The tile load with one mistake switched on (MISTAKE = 0: none), written differently from the reference:
    the scale of every granularity is gathered as one [N] column first."""
    if MISTAKE == 7:       # no mask: the bytes (and scales) of keys past the end are read
        raw = tl.load(X + offs)
    else:
        raw = tl.load(X + offs, mask=valid[:, None], other=0)
    if MISTAKE == 3:       # no bitcast: the bytes converted as unsigned integers
        x = raw.to(tl.float32)
    elif MISTAKE == 8:     # always int8, whatever KV_DTYPE says
        x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        x = raw.to(KV_DTYPE, bitcast=True).to(tl.float32)
    if GRANULARITY == "tensor" or MISTAKE == 5:      # 5: the per-tensor rule for every granularity
        where = s_offs * 0
    elif GRANULARITY == "head":
        where = s_offs * 0 + (0 if MISTAKE == 4 else h)   # 4: KV head 0's scale
    else:
        where = s_offs
    if MISTAKE == 7 or MISTAKE == 10:     # 10: the bytes masked, the scales not
        s = tl.load(S + where)
    else:
        s = tl.load(S + where, mask=valid, other=0.0)
    if MISTAKE == 2:       # the per-token scale on the wrong axis (along D)
        y = x * s[None, :]
    elif MISTAKE == 6:     # no scale
        y = x
    elif MISTAKE == 9:     # divided by the scale
        y = x / tl.where(valid, s, 1.0)[:, None]
    else:
        y = s[:, None] * x
    if MISTAKE == 1:       # the scale applied twice
        y = y * s[:, None]
    return y


@triton.jit
def load_ok(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 0)


@triton.jit
def scale_twice(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 1)


@triton.jit
def wrong_axis(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 2)


@triton.jit
def unsigned(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 3)


@triton.jit
def head_zero(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 4)


@triton.jit
def one_scale(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 5)


@triton.jit
def no_scale(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 6)


@triton.jit
def no_mask(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 7)


@triton.jit
def always_int8(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 8)


@triton.jit
def divided(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 9)


@triton.jit
def scales_unmasked(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 10)


@triton.jit
def fp16_tile(X, S, offs, s_offs, valid, h, KV_DTYPE: tl.constexpr, GRANULARITY: tl.constexpr):
    """Right up to rounding the tile to fp16: not the float32 tile asked for."""
    return _load(X, S, offs, s_offs, valid, h, KV_DTYPE, GRANULARITY, 0).to(tl.float16).to(tl.float32)


# wrong load: (the words its failure must contain, the check that must say so)
WRONG = {
    "scale applied twice": (scale_twice, "the scale applied twice", "per-tensor scale, int8"),
    "per-token scale on the wrong axis": (wrong_axis, "a scale on the wrong axis", "per-token scales [B, L, H_kv]"),
    "int8 read as unsigned": (unsigned, "int8 read as unsigned", "per-tensor scale, int8"),
    "e4m3 bytes converted as integers": (unsigned, "converted as integers", "per-tensor scale, e4m3"),
    "KV head 0's scale": (head_zero, "the scale of KV head 0", "per-head scales"),
    "one scale for every granularity": (one_scale, "one scale for the whole tile", "per-token scales [B, L, H_kv]"),
    "no scale": (no_scale, "no scale applied", "per-tensor scale, int8"),
    "keys past the end read": (no_mask, "keys past the end", "the last tile of a sequence"),
    "e4m3 bytes read as int8": (always_int8, "e4m3 bytes read as int8", "per-tensor scale, e4m3"),
    "tile rounded to fp16": (fp16_tile, "differ", "per-tensor scale, int8"),
    "divided by the scale": (divided, "divided by the scale", "per-head scales"),
    "scales of keys past the end read": (scales_unmasked, "NaN", "the last tile of a sequence"),
}


def _line(res, check_title):
    return next(o.line() for o in res.outcomes if o.name.startswith(check_title))


def test_variant_passes():
    res = run_checks(NAME, load_ok, quiet=True)
    assert res.ok, [o.line() for o in res.outcomes if o.status != "pass"]


@pytest.mark.parametrize("wrong", WRONG, ids=list(WRONG))
def test_wrong_load_fails_and_names_the_cause(wrong):
    fn, cause, check_title = WRONG[wrong]
    res = run_checks(NAME, fn, quiet=True)
    assert res.failed > 0 and not res.todo, wrong
    line = _line(res, check_title)
    assert line.startswith("❌ FAIL") and cause in line, line


def test_wrong_axis_is_named_on_a_square_tile_and_fails_on_a_wide_one():
    res = run_checks(NAME, wrong_axis, quiet=True)
    assert "s[:, None]" in _line(res, "per-token scales [B, L, H_kv]")
    assert _line(res, "per-token scales, D = 32").startswith("❌ FAIL")
    assert _line(res, "inside a decode loop").startswith("❌ FAIL")


def test_a_tile_matching_no_known_mistake_gets_the_mismatch_report():
    line = _line(run_checks(NAME, fp16_tile, quiet=True), "per-tensor scale, int8")
    assert "values differ" in line and "worst at index" in line and "matches" not in line


# ---------------------------------------------------------------------------------------------- stubs
def test_stub_is_todo_until_edited(capsys):
    fn = cell_function(lab09.STUB, "dequant_tile")
    try:
        res = run_checks(NAME, fn)
        out = capsys.readouterr().out
        assert res.todo and out.startswith(f"📝 TODO: implement {NAME} ") and out.count("\n") == 1
        edited = cell_function(lab09.STUB.replace("return tl.zeros_like(offs).to(tl.float32)",
                                                  "return tl.zeros_like(offs).to(tl.float32) + 1.0"), "dequant_tile")
        res = run_checks(NAME, edited, quiet=True)
        assert not res.todo and res.failed == res.total
    finally:
        core._LEARNER.pop(NAME, None)


def test_solution_source_runs_as_a_cell():
    fn = cell_function(core.solution_source(NAME), "dequant_tile")
    try:
        assert run_checks(NAME, fn, quiet=True).ok
    finally:
        core._LEARNER.pop(NAME, None)


def test_not_a_triton_function():
    res = run_checks(NAME, lambda *a: None, quiet=True)
    assert res.failed == res.total and "expected a @triton.jit function" in res.outcomes[0].line()


# ---------------------------------------------------------------------------------------------- the decode loop
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_decode_loop_matches_fdlib(dtype):
    """The notebook's decode loop (the reference load) gives fdlib's result over the same 8-bit cache, with a D that
    is not the checks' and a length that is not a whole number of tiles."""
    import fdlib
    from fdlib import runtime
    gen = torch.Generator().manual_seed(9)
    k8, ks, _ = lab09.make_cache(gen, dtype, "head", B=3, L=50, H_kv=2, D=64, lengths=[50, 17, 1])
    v8, vs, _ = lab09.make_cache(gen, dtype, "token", B=3, L=50, H_kv=2, D=64, lengths=[50, 17, 1])
    q = torch.randn(3, 6, 64, generator=gen).half()
    lens = torch.tensor([50, 17, 1], dtype=torch.int32)
    out, lse = lab09.decode_8bit(q, k8, v8, ks, vs, lens)
    dev = runtime.DEVICE
    want = fdlib.decode_attention(q.to(dev), k8.to(dev), v8.to(dev), lens.to(dev), k_scale=ks.to(dev),
                                  v_scale=vs.to(dev))
    assert torch.allclose(out.cpu(), want.float().cpu(), atol=2e-3, rtol=2e-3)
    assert torch.isfinite(lse).all()


def test_decode_loop_rejects_an_odd_head_dim():
    gen = torch.Generator().manual_seed(1)
    k8, ks, _ = lab09.make_cache(gen, torch.int8, "tensor", B=1, L=16, H_kv=1, D=24)
    with pytest.raises(ValueError, match="power of two"):
        lab09.decode_8bit(torch.randn(1, 1, 24), k8, k8, ks, ks, torch.tensor([16]))
