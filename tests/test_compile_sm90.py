"""Every kernel compiles for an H100/H200 (sm_90) on this machine, GPU or not (tools/compile_check.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FDLIB_INTERPRET")}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "0 failed" in proc.stdout


def pipeline_waits(case: str) -> list[int]:
    """tools/compile_check.py's async waits inside the loops of case ``case``, built as a GPU launch would."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FDLIB_INTERPRET")}
    code = (f"import compile_check as cc\n"
            f"case = next(c for c in cc.cases() if c[0] == {case!r})\n"
            f"print(cc.pipeline_waits(cc.compile_kernel(*case[1:4], aligned=True)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tools", env=env, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", ["unified", "streamk", "persistent"])
def test_the_loop_pipelines_over_pages_as_over_a_contiguous_cache(kernel):
    """With the page table read a tile ahead, the sm_90 builds of the unified, stream-K and persistent kernels
    keep as many groups of K/V copies in flight over pages as on a contiguous cache (a lookup in the same
    iteration as the loads made Triton's pipeliner keep one buffer and wait for every copy: async_wait 0 or 1)."""
    contiguous, paged = pipeline_waits(f"{kernel} PAGE=0"), pipeline_waits(f"{kernel} PAGE=16")
    assert contiguous and max(contiguous) >= 2, contiguous
    assert paged == contiguous, (paged, contiguous)
