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


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", [0, 16])
def test_the_unified_loop_pipelines_over_pages_as_over_a_contiguous_cache(page):
    """With the page table read a tile ahead, the sm_90 build of the unified kernel keeps num_stages - 1 = 2
    groups of K/V copies in flight over pages as on a contiguous cache (a lookup in the same iteration as the
    loads made Triton's pipeliner wait for every copy: async_wait 0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FDLIB_INTERPRET")}
    code = (f"import compile_check as cc\n"
            f"case = next(c for c in cc.cases() if c[0] == 'unified PAGE={page}')\n"
            f"print(cc.pipeline_waits(cc.compile_kernel(*case[1:4], aligned=True)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tools", env=env, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    waits = eval(proc.stdout.strip().splitlines()[-1])
    assert waits and min(waits) == 2, waits
