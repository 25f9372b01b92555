"""The chooser's decisions on every benchmarked batch (``tools/decision_table.py``: H100, H200 and the interpreter,
with no GPU) are the committed table's, line for line: a change to what ``auto`` (or any plan) chooses on a
benchmarked batch must come with the table regenerated (``python tools/decision_table.py
results/cpu/decisions/baseline.txt.gz``), so that the change, and the GPU run it needs, are seen."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_chooser_makes_the_committed_decisions():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "decision_table.py"), "--diff",
                        str(ROOT / "results" / "cpu" / "decisions" / "baseline.txt.gz")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("0 of "), r.stdout[-500:]
