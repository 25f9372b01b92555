"""Every kernel's load and store masks are boolean, and the persistent kernel stores each output exactly once.

Triton's interpreter holds a mask as a NumPy array. The interpreters of Triton 3.6 to 3.8 took an integer array as
a mask; Triton 3.9's refuses one in ``tl.store`` (``ValueError('mask has unsupported dtype')``), which broke
``method="persistent"`` there: a scalar comparison broadcast into a block mask came out int32 (issue 11).
These tests record the masks of every masked load and store in the interpreter, so the pinned Triton catches
what a newer one would refuse; ``.ci/newest`` runs them on the newest releases too.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fdlib  # noqa: I001  (before triton: fdlib decides TRITON_INTERPRET first)
from fdlib import runtime
from helpers import BLOCK_N, assert_attention_close, make_problem

pytestmark = [pytest.mark.skipif(runtime.MODE != "interpreter", reason="records the interpreter's masks"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]   # Triton interpreter noise

N = BLOCK_N
KERNELS = Path(fdlib.__file__).resolve().parent / "kernels"


def _kernel_line() -> str:
    """file:line of the innermost fdlib kernel frame issuing the current load/store (for the failure message)."""
    f = sys._getframe(2)
    while f is not None:
        if Path(f.f_code.co_filename).resolve().parent == KERNELS:
            return f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"
        f = f.f_back
    return "?"


class MaskLog:
    def __init__(self):
        self.seen = 0
        self.not_bool: set[str] = set()
        self.stored: list[np.ndarray] = []     # addresses each masked store wrote

    def check(self, what: str, mask) -> np.ndarray:
        self.seen += 1
        data = np.asarray(mask.data)
        if data.dtype != np.bool_:
            self.not_bool.add(f"{what} at {_kernel_line()}: mask dtype {data.dtype}")
        return data.astype(bool)


@pytest.fixture
def masks(monkeypatch):
    """Wraps the interpreter's masked load/store (their signatures differ between Triton versions)."""
    from triton.runtime.interpreter import InterpreterBuilder
    log = MaskLog()
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, *args, **kwargs):
        log.check("tl.load", mask)
        return load(self, ptrs, mask, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        on = log.check("tl.store", mask)
        log.stored.append(np.broadcast_to(np.asarray(ptrs.data), on.shape)[on].copy())
        return store(self, ptrs, value, mask, *args, **kwargs)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", masked_load)
    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", masked_store)
    return log


@pytest.mark.parametrize("method, splits", [("persistent", None), ("unified", 1), ("unified", 3), ("split", 3),
                                            ("auto", None)])
def test_masks_are_boolean(masks, method, splits):
    """Ragged lengths (0, 1, tile edges), a group of 3 (padded to 4 query rows) and D=80 (padded to 128): every
    kind of mask the kernels build is used."""
    q, k, v, lens = make_problem(6, 2 * N + 3, 6, 2, 80, torch.float16, seed=11,
                                 lens=[2 * N + 3, 0, 1, N, N + 1, N - 1])
    out, lse = fdlib.decode_attention(q, k, v, lens, method=method, num_splits=splits, return_lse=True)
    assert masks.seen > 0, "no masked load/store was recorded: the interpreter's builder was not patched"
    assert not masks.not_bool, f"{method}: non-boolean masks (Triton 3.9's interpreter refuses them): " + \
        "; ".join(sorted(masks.not_bool))
    assert_attention_close(out, lse, q, k, v, lens, what=f"{method} splits={splits}")


@pytest.mark.parametrize("programs", [1, 3, 16])
def test_persistent_stores_each_output_once(masks, programs):
    """The last-tile masks: a program walking several rows stores a row's O and lse on its last tile only, so
    every element of out and lse is written exactly once (none twice, none never), empty rows included."""
    from test_persistent import EDGE, run
    q, k, v, lens = make_problem(len(EDGE), 2 * N + 1, 6, 2, 80, torch.float32, seed=programs, lens=EDGE)
    out, lse = run(q, k, v, lens, programs)
    assert not masks.not_bool, "; ".join(sorted(masks.not_bool))
    written = np.concatenate(masks.stored) if masks.stored else np.zeros(0, np.uint64)
    for name, t in (("out", out), ("lse", lse)):
        assert t.is_contiguous()
        want = t.data_ptr() + t.element_size() * np.arange(t.numel(), dtype=np.uint64)
        addrs, counts = np.unique(written[(written >= want[0]) & (written <= want[-1])], return_counts=True)
        assert np.array_equal(addrs, want), f"{name}: {t.numel() - len(addrs)} of {t.numel()} elements never stored"
        assert (counts == 1).all(), f"{name}: {(counts > 1).sum()} elements stored more than once"
    assert_attention_close(out, lse, q, k, v, lens, what=f"programs={programs}")
