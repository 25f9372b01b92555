"""Launching a Triton kernel with the dispatch paid once.

``kernel[grid](*args, **meta)`` is Triton's generic launch: on every call it binds the arguments, computes
their specialisation (pointer alignment, integers equal to 1 or divisible by 16), hashes it with the options,
looks the compiled kernel up, and only then launches. For a decode step of a few microseconds that dispatch
is a large part of the call's host time (profile: results/h200/host-overhead.md).

:func:`launch` does the generic launch the first time it sees a specialisation, keeps the compiled kernel,
and afterwards calls its launcher directly. The key it checks on every call is the one Triton would compute
for these kernels: the pointers' dtypes and which are 16-byte aligned, and the integer arguments themselves (strides, chunk,
sizes). Anything else (a profiler hook installed, a Triton version whose launcher this was not written
against, the interpreter) takes the generic path, which is always correct.
"""
from __future__ import annotations

import os

import torch
import triton

from .. import runtime

FAST_LAUNCH: bool = (runtime.MODE == "gpu" and triton.__version__.startswith("3.6")
                     and os.environ.get("FDLIB_FAST_LAUNCH", "1") != "0")
"""Direct launches of compiled kernels: on a GPU, with Triton 3.6 (whose launcher signature this calls;
other versions use the generic launch), unless ``FDLIB_FAST_LAUNCH=0``."""

_COMPILED: dict = {}


def _knobs():
    from triton import knobs
    return knobs.runtime


def launch(kernel, grid, ptrs: tuple, scalars: tuple, meta: tuple) -> None:
    """``kernel[grid](*ptrs, *scalars, **dict(meta))``, where the kernel's parameters are the pointers, then
    the scalars, then the constexprs of ``meta`` (name, value) pairs in their order, then launch options
    (``num_warps``, ``num_stages``)."""
    if FAST_LAUNCH:
        key = (kernel, meta, scalars, *[(t.dtype, t.data_ptr() & 15 == 0) for t in ptrs])
        hit = _COMPILED.get(key)
        if hit is not None and _knobs().launch_enter_hook is None:
            run, function, packed, constexprs = hit
            stream = torch._C._cuda_getCurrentRawStream(ptrs[0].get_device())
            run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *ptrs, *scalars, *constexprs)
            return
    kw = dict(meta)
    compiled = kernel[grid](*ptrs, *scalars, **kw)
    if FAST_LAUNCH and compiled is not None:
        names = kernel.arg_names[len(ptrs) + len(scalars):]
        if all(n in kw for n in names):   # the constexprs follow the runtime arguments, as launch() assumes
            _COMPILED[key] = (compiled.run, compiled.function, compiled.packed_metadata, tuple(kw[n] for n in names))
    return compiled
