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


def run_in_tools(code: str, timeout: int = 580) -> str:
    """The standard output of ``code`` run by Python in tools/ (where compile_check builds for sm_90 on the CPU),
    outside the interpreter; fails the test with its output where it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FDLIB_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tools", env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def pipeline_waits(case: str) -> list[int]:
    """tools/compile_check.py's async waits inside the loops of case ``case``, built as a GPU launch would."""
    out = run_in_tools(f"import compile_check as cc\n"
                       f"case = next(c for c in cc.cases() if c[0] == {case!r})\n"
                       f"print(cc.pipeline_waits(cc.compile_kernel(*case[1:4], aligned=True)))")
    return eval(out.strip().splitlines()[-1])


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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stream_k_over_pages_ends_its_rows_in_a_branch():
    """tools/loop_sass.py on the sm_90 builds: over pages the stream-K loop over rows does a row's end (normalise,
    store, restart, the next row's queries) in a branch a tile that ends no row skips, so such a tile issues fewer
    instructions than the contiguous loop, which does it masked on every tile; stream-K's loop for a share inside
    one row (equal rows) issues no more a tile than the unified kernel's; the paged offsets of the unified loop stay
    within 1.5x its contiguous tile (they were 1.53x with signed 64-bit products), and fewer still with a split's
    block table held in registers (TABLE_REGS)."""
    out = run_in_tools("import loop_sass as ls, compile_check as cc\n"
                       "for name, kernel, ptrs, meta in ls.cases():\n"
                       "    if name.startswith(('streamk', 'unified')):\n"
                       "        loops = ls.kv_loops(cc.compile_kernel(kernel, ptrs, meta, aligned=True))\n"
                       "        print(name, ' '.join(f'{len(b)}:{len(b) - s}' for b, s in loops))\n")
    counts = {}
    for line in out.splitlines():
        head, *pairs = line.split(" ")
        while ":" not in pairs[0]:            # the case's name has spaces (PAGE=16 TABLE_REGS=64)
            head, pairs = f"{head} {pairs[0]}", pairs[1:]
        counts[head] = [tuple(map(int, p.split(":"))) for p in pairs]
    (lean0, _), (loop0, tile0) = counts["streamk PAGE=0"]
    (lean16, _), (loop16, tile16) = counts["streamk PAGE=16"]
    unified0, unified16 = counts["unified PAGE=0"][0][1], counts["unified PAGE=16"][0][1]
    assert tile0 == loop0, counts                     # contiguous: every tile does the row end, masked
    assert tile16 < 0.8 * loop16 and tile16 < tile0, counts
    assert lean0 <= unified0 and lean16 <= unified16, counts   # a share inside one row: the unified loop's work
    assert unified16 < 1.5 * unified0, counts
    assert counts["unified PAGE=16 TABLE_REGS=64"][0][1] < unified16, counts   # no table offsets


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_paged_kernels_compile_with_strides_of_one():
    """A GPU launch passes an integer argument equal to 1 as a constant (Triton's specialisation): a pool of
    H_kv = D = 1 in pages of one key has K/V strides of 1. Every paged kernel of tools/compile_check.py, at pages
    of 1 and of 16, compiles with its K/V row and page strides specialised so (a method call on such a stride,
    ``stride.to(...)``, fails to compile)."""
    out = run_in_tools("import compile_check as cc\n"
                       "ones = dict(stride_kb=1, stride_kl=1, stride_vb=1, stride_vl=1)\n"
                       "for name, kernel, ptrs, meta, *warps in cc.cases():\n"
                       "    if 'PAGE=16' not in name or 'q_len' in name:\n"
                       "        continue\n"
                       "    for page in (1, 16):\n"
                       "        cc.compile_kernel(kernel, ptrs, dict(meta, PAGE=page, **ones), *warps)\n"
                       "        print('ok', name, page)\n", timeout=880)
    assert out.count("ok ") >= 10, out
