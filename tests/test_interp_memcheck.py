"""tools/interp_memcheck.py, the interpreter's memcheck: an address past a tensor's storage is reported, one inside
is not, and a paged D=256 batch at a GPU's 32-key tiles reads and writes only its tensors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fdlib import runtime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import interp_memcheck  # noqa: E402

pytestmark = pytest.mark.skipif(runtime.MODE != "interpreter", reason="checks the interpreter's loads and stores")


def _read(n_read: int):
    import triton
    import triton.language as tl

    @triton.jit
    def copy(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs))
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(n_read, dtype=torch.float32)
    copy[(1,)](x, y, N=n_read)


@pytest.mark.parametrize("n_read, caught", [(8, False), (16, True)])
def test_an_address_past_a_tensor_is_reported(n_read, caught):
    report: list[str] = []
    st = interp_memcheck.install(report)
    try:
        _read(n_read)   # 16: floats 8..15 of an 8-float tensor lie in the allocator's padding, in no tensor
    finally:
        interp_memcheck.uninstall(st)
    assert st.checked >= 2 * n_read
    assert bool(report) == caught, report
    if caught:
        assert "load" in report[0] and "outside every tensor" in report[0]


def test_an_atomic_past_a_tensor_is_reported():
    import numpy as np
    import triton
    import triton.language as tl

    @triton.jit
    def bump(C, at):
        tl.atomic_add(C + at, 1)
    c = torch.zeros(4, dtype=torch.int32)
    elsewhere = np.zeros(4, np.int32)    # memory no tensor holds (the write must land somewhere that is ours)
    report: list[str] = []
    st = interp_memcheck.install(report)
    try:
        bump[(1,)](c, 1)                 # in the tensor
        assert not report
        bump[(1,)](c, (elsewhere.ctypes.data - c.data_ptr()) // 4)
    finally:
        interp_memcheck.uninstall(st)
    assert c.tolist() == [0, 1, 0, 0] and elsewhere.tolist() == [1, 0, 0, 0]
    assert report and report[0].startswith("atomic"), report


def test_a_paged_d256_batch_stays_in_its_tensors(capsys):
    from triton.runtime.interpreter import InterpreterBuilder
    import fdlib.plan  # noqa: F401
    plan_module = sys.modules["fdlib.plan"]
    before = (plan_module.tile_config, InterpreterBuilder.create_masked_load)
    rc = interp_memcheck.main(["--D", "256", "--page", "16", "--B", "2", "--heads", "4:2", "--L", "100",
                               "--splits", "3", "--ragged"])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = [x for x in text.splitlines() if "accesses out of bounds" in x]
    assert len(lines) == 2 and all("BLOCK_N=32" in x and ", 0 accesses out of bounds" in x for x in lines), text
    assert all(int(x.split("; ")[1].split()[0]) > 1000 for x in lines), text     # addresses were checked
    assert (plan_module.tile_config, InterpreterBuilder.create_masked_load) == before   # all put back
