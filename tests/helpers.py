"""Shared helpers for fdlib's correctness tests: input builders, tolerances, comparisons, hypothesis settings.

Every comparison is against :func:`fdlib.reference_attention` (float64, CPU) computed from the *same*
(possibly fp16/bf16-rounded) inputs, so the error measured is the kernel's own arithmetic plus the final
rounding of ``out`` to the input dtype.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

import fdlib
from fdlib import api, runtime
from fdlib.course.grading import todo
from fdlib.kernels import unified
from fdlib.kernels.config import tile_config

DEVICE = runtime.DEVICE
INTERPRET = runtime.INTERPRET
BLOCK_N = tile_config(64, 256).BLOCK_N   # keys per tile for the small shapes the CPU tests use: 16 in the
                                        # interpreter; compiled, a multiple of it divides N, so N±1 still straddle tiles
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_METHODS = ("split", "unified", "auto")
ALL_METHODS = TRITON_METHODS + ("naive",)

# Max error of out, per (b, h) row, relative to that row's largest |reference| entry.
# Calibrated against method="naive" (float32 scores) and the kernels on random inputs: fp32 errors are
# ~2e-7, fp16 ~3e-4 (half an fp16 ulp from rounding out), bf16 ~4e-3 (half a bf16 ulp). The bounds keep
# ~3-10x headroom (compiled fp16/bf16 kernels round P to the input dtype for the tensor-core P·V product;
# Triton's interpreter (3.6) converts float32 -> bfloat16 by truncation, not round-to-nearest, so bf16
# outputs there are off by up to one ulp, ~7e-3: measured worst 6.9e-3)
# and stay far below what a dropped key, a wrong tail mask or a wrong merge weight produces (>= 1e-2 rel.
# at the lengths used here; the fp32 tests, at 1e-5, catch those at any length).
OUT_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# lse is float32 for every input dtype, computed from exactly-representable inputs: abs + rel bound.
LSE_ATOL = {torch.float32: 2e-5, torch.float16: 5e-5, torch.bfloat16: 5e-5}
LSE_RTOL = 2e-6

HYPOTHESIS_DB = DirectoryBasedExampleDatabase(str(Path(__file__).resolve().parents[1] / ".hypothesis" / "fdlib-tests"))


def hyp_settings(max_examples: int, **kw):
    """Replayable property-test settings: saved failing examples, printed reproduction blobs, no deadline."""
    return settings(max_examples=max_examples, deadline=None, derandomize=False, database=HYPOTHESIS_DB,
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                    **kw)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g, scale=1.0):
    """Standard normal values (CPU generator, so results are identical on every device), rounded to dtype."""
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype).to(DEVICE)


def make_cache(B, L, H_kv, D, dtype, g, layout="contiguous", scale=1.0):
    """A [B, L, H_kv, D] cache with the requested memory layout (values do not depend on the layout).

    * ``contiguous``: plain token-major tensor.
    * ``slice``: a view into a larger [B, L+7, H_kv+2, D+16] buffer (every stride but the last differs).
    * ``permuted``: stored head-major [B, H_kv, L, D] and permuted to [B, L, H_kv, D].
    """
    base = (torch.randn((B, L, H_kv, D), generator=g, dtype=torch.float32) * scale).to(dtype)
    if layout == "contiguous":
        t = base.to(DEVICE)
    elif layout == "slice":
        big = torch.full((B, L + 7, H_kv + 2, D + 16), float("nan"), dtype=dtype)
        big[:, 3:3 + L, 1:1 + H_kv, 8:8 + D] = base
        t = big.to(DEVICE)[:, 3:3 + L, 1:1 + H_kv, 8:8 + D]
    elif layout == "permuted":
        t = base.permute(0, 2, 1, 3).contiguous().to(DEVICE).permute(0, 2, 1, 3)
    else:
        raise ValueError(layout)
    assert t.stride(-1) == 1
    return t


def make_problem(B, L, H_q, H_kv, D, dtype, seed=0, lens=None, layout="contiguous", v_scale=1.0, q_scale=1.0):
    """(q [B, H_q, D], k, v [B, L, H_kv, D], lens int32 [B] or None) on DEVICE."""
    g = gen(seed)
    q = randn((B, H_q, D), dtype, g, q_scale)
    k = make_cache(B, L, H_kv, D, dtype, g, layout)
    v = make_cache(B, L, H_kv, D, dtype, g, layout, v_scale)
    if lens is not None:
        lens = torch.as_tensor(lens, dtype=torch.int32).to(DEVICE)
    return q, k, v, lens


def row_rel_err(out, ref) -> torch.Tensor:
    """[B, H_q] max |out - ref| over D, relative to the row's max |ref| (rows with ref == 0: absolute)."""
    out = out.detach().to("cpu", torch.float64).reshape(ref.shape)
    den = ref.abs().amax(-1).clamp_min(1e-30)
    err = (out - ref).abs().amax(-1)
    return torch.where(ref.abs().amax(-1) == 0, err, err / den)


def assert_attention_close(out, lse, q, k, v, lens, scale=None, what="", rtol=None, lse_atol=None, ref=None):
    """out (and lse if given) match the float64 reference (or ``ref=(out, lse)`` computed elsewhere, float64);
    empty sequences give exactly 0 and -inf."""
    dtype = q.dtype
    q3 = q[:, 0] if q.dim() == 4 else q
    ref_o, ref_l = fdlib.reference_attention(q3, k, v, lens, scale) if ref is None else (t.cpu() for t in ref)
    assert out.dtype == dtype, f"{what}: out dtype {out.dtype}, expected {dtype}"
    assert tuple(out.shape) == tuple(q.shape), f"{what}: out shape {tuple(out.shape)}, expected {tuple(q.shape)}"
    out3 = out[:, 0] if out.dim() == 4 else out
    assert torch.isfinite(out3.cpu()).all(), f"{what}: non-finite output"
    empty = torch.isneginf(ref_l)                                  # [B, H_q]: length-0 sequences
    if empty.any():
        assert (out3.cpu()[empty] == 0).all(), f"{what}: length-0 rows must be exactly 0"
    err = row_rel_err(out3, ref_o)
    tol = OUT_RTOL[dtype] if rtol is None else rtol
    worst = err.max().item()
    assert worst <= tol, (f"{what}: out rel. err {worst:.3e} > {tol:.1e} at (b, h)="
                          f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])}, lens={_lens_list(lens)}")
    if lse is not None:
        assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(ref_l.shape), f"{what}: lse {lse.dtype} {tuple(lse.shape)}"
        l = lse.detach().to("cpu", torch.float64)
        assert torch.equal(torch.isneginf(l), empty), f"{what}: lse is -inf exactly where the length is 0"
        fin = ~empty
        if fin.any():
            atol = LSE_ATOL[dtype] if lse_atol is None else lse_atol
            lerr = ((l[fin] - ref_l[fin]).abs() / (atol + LSE_RTOL * ref_l[fin].abs())).max().item()
            assert lerr <= 1.0, f"{what}: lse error {lerr:.2f}x the tolerance, lens={_lens_list(lens)}"
    return worst


def _lens_list(lens):
    return None if lens is None else lens.tolist()


def counters_zero() -> bool:
    """Every unified-kernel ticket counter is back at 0 (the kernel resets them itself): the device's shared
    ones and those of every plan decode_attention keeps."""
    plans = [p.workspace.counters for p in api._PLANS.values() if p.workspace.counters is not None]
    return all(int(buf.count_nonzero()) == 0 for buf in [*unified._COUNTERS.values(), *plans])


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------- grader meta-tests
def todo_stub(*args, **kwargs):
    """An untouched exercise body that calls todo()."""
    todo("this exercise")


def not_implemented_stub(*args, **kwargs):
    """An untouched exercise body that raises NotImplementedError."""
    raise NotImplementedError


def assert_one_todo_line(res, out: str, name: str) -> None:
    """A check of an untouched stub prints exactly one TODO line (no traceback) and passes nothing: "implement
    NAME ..." for a stub, "fix NAME ..." for a bug-zoo cell that still holds the buggy code it was shipped with."""
    assert res.todo and not res.ok and res.passed == 0
    assert out.count("\n") == 1 and "Traceback" not in out
    assert out.startswith(("📝 TODO: implement " + name + " ", "📝 TODO: fix " + name + ": ")), out


def cell_function(src: str, name: str):
    """Define a notebook cell's function the way --grade-notebooks does (source kept for @triton.jit). The notebook
    tools (nbformat) are imported here, not with the module, so that the kernel tests run where nbformat is not
    installed (the GPU machine)."""
    from fdlib.course.grading.notebook_tools import PREAMBLE, run_source
    ns = {"__name__": f"cell_{name}"}
    exec(compile(PREAMBLE, "<preamble>", "exec"), ns)
    run_source(src, f"<cell {name}>", ns)
    return ns[name]


def run_device_lengths(p, q, k, v, lens, block_table=None, return_lse=False):
    """``p.run(q, k, v, lens)`` with ``lens`` read by the kernels alone, as a GPU's device lengths are. On a GPU that
    is ``p.run`` itself; on the CPU a tensor of lengths is on the host, where ``run`` checks its values as a list's
    (``ValueError`` outside 0..L_max), so the plan's launch is called directly: the kernels' own clamp and flag
    are what the test sees."""
    if lens.device.type != "cpu":
        return p.run(q, k, v, lens, block_table=block_table, return_lse=return_lse)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    p._launch(q, k, v, lens, out, lse, block_table)
    return (out, lse) if return_lse else out
