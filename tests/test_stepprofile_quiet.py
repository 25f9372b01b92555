"""torch's profiler writes 'USDT:... profiler_start/stop' to the process's stderr (file descriptor 2, below Python),
which a notebook shows as red boxes under Lab 10's profiling cell: fdlib.bench.stepprofile drops those lines and
passes every other line written there through."""
from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import os, torch
from fdlib.bench.stepprofile import profile_step, quiet_profiler_log
x = torch.randn(64, 64)
profile_step(lambda: x @ x, gpu=False)
with quiet_profiler_log():
    os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    os.write(2, b"a real warning from C\n")
"""


def test_profile_step_writes_no_profiler_log_but_keeps_other_lines():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "profiler_start" not in done.stderr and "profiler_stop" not in done.stderr, done.stderr
    assert "a real warning from C" in done.stderr
