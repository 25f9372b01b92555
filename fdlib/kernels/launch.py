"""Launching a Triton kernel with the dispatch paid once.

``kernel[grid](*args, **meta)`` is Triton's generic launch: on every call it binds the arguments, computes
their specialisation (pointer alignment, integers equal to 1 or divisible by 16), hashes it with the
constexprs and options, looks the compiled kernel up, and only then launches. For a decode step of a few
microseconds that dispatch is a large part of the call's host time (results/h200/host-overhead.md).

A :class:`Launcher` holds one kernel with its constexprs and options fixed (a plan makes one per kernel it
runs). Its first launch of a specialisation goes through Triton's generic path, which compiles; it keeps the
compiled kernel and afterwards calls Triton's C launcher directly, with the pointers as the integers it has
already read (Triton's generic path asks the driver about each tensor on every call). The key it checks on
every call is what Triton's specialisation depends on for these kernels: the pointers' dtypes and 16-byte
alignment (direct launches only when all are aligned), and the scalar arguments themselves (strides, chunk,
sizes, scale). Anything else (a launch hook installed by a profiler, a Triton version whose launcher this was
not written against, the interpreter) takes the generic path, which
is always correct.
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


def _hooks():
    from triton import knobs
    return knobs.runtime


_RUNTIME = _hooks() if FAST_LAUNCH else None


def _no_hooks() -> bool:
    """No launch hook is installed (Triton 3.6 keeps them in a HookChain; older versions use None)."""
    hook = _RUNTIME.launch_enter_hook
    return hook is None or not getattr(hook, "calls", True)


class Launcher:
    """``kernel[grid](*ptrs, *scalars, **meta)`` for a kernel whose parameters are the pointers, then the
    scalars, then the constexprs of ``meta`` (plus the launch options ``num_warps``/``num_stages``).

    ``dtype_slots``: the pointers whose dtype may change between calls (None: all of them); the caller
    guarantees the others keep theirs (a plan checks q, K, V and out against its dtype). Direct launches
    happen only when every pointer is 16-byte aligned, the specialisation the first launch compiled for;
    anything else goes through Triton's generic launch."""

    __slots__ = ("kernel", "meta", "dtype_slots", "_compiled")

    def __init__(self, kernel, meta: dict, dtype_slots: tuple | None = None):
        self.kernel = kernel
        self.meta = meta
        self.dtype_slots = dtype_slots
        self._compiled: dict = {}

    def __call__(self, grid, ptrs: tuple, scalars: tuple):
        key = None
        if FAST_LAUNCH:
            addrs = [t.data_ptr() for t in ptrs]
            addr = 0
            for a in addrs:
                addr |= a
            if addr & 15 == 0:
                slots = self.dtype_slots
                key = ((scalars, *[t.dtype for t in ptrs]) if slots is None
                       else (scalars, *[ptrs[i].dtype for i in slots]))
                hit = self._compiled.get(key)
                if hit is not None and _no_hooks():
                    launch, function, head, constexprs = hit
                    stream = torch._C._cuda_getCurrentRawStream(ptrs[0].get_device())
                    n = len(grid)
                    # the pointers go as the integers already read: Triton's launcher would call data_ptr()
                    # and ask the driver (cuPointerGetAttribute) about each tensor again on every call
                    launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, *head,
                           *addrs, *scalars, *constexprs)
                    return None
        compiled = self.kernel[grid](*ptrs, *scalars, **self.meta)
        if key is not None and compiled is not None:
            names = self.kernel.arg_names[len(ptrs) + len(scalars):]
            if all(n in self.meta for n in names):   # the constexprs follow the runtime arguments
                self._compiled[key] = (*_direct(compiled), tuple(self.meta[n] for n in names))
        return compiled


def _direct(compiled) -> tuple:
    """(launch, function, leading arguments) that launch ``compiled`` with no Python in between: Triton 3.6's
    C launcher itself when the kernel needs no global or profile scratch (its Python wrapper only allocates
    those), else the wrapper. Both take the grid, the stream and the function first."""
    run = compiled.run
    launch = getattr(run, "launch", None)
    if (launch is not None and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
        return launch, compiled.function, head
    return run, compiled.function, (compiled.packed_metadata, None, None, None)


def paging(k_cache, block_table, flag):
    """(block-table pointer, its row stride, pages in the pool, L_max) of a launch: a contiguous cache
    [B, L_max, H_kv, D] has no table (the flag stands in for the unused pointer); a paged one
    [n_pages, page_size, H_kv, D] has L_max = max_pages · page_size."""
    if block_table is None:
        return flag, 0, 1, k_cache.shape[1]
    return block_table, block_table.stride(0), k_cache.shape[0], block_table.shape[1] * k_cache.shape[1]


def rows4(t, rank: int = 4):
    """``t`` with the query-token axis: a tensor of one rank less (the one-token form, e.g. q ``[B, H_q, D]``,
    partials ``[B, H_q, splits, D]``) gets a size-1 axis 1 (a view), so every kernel indexes
    (b, t, h, ...) with its own strides; a tensor of rank ``rank`` is returned as is."""
    return t.unsqueeze(1) if t.dim() == rank - 1 else t


def strides4(t, rank: int = 4) -> tuple:
    """The strides of ``t`` with the query-token axis: :func:`rows4`'s strides without making the view (a size-1
    axis 1 gets stride 0), so a launch of the one-token form pays for no new tensor."""
    s = t.stride()
    return (s[0], 0, *s[1:]) if len(s) == rank - 1 else s


def q_len_of(q) -> int:
    """Query tokens per sequence of q: ``[B, q_len, H_q, D]`` or ``[B, H_q, D]`` (one)."""
    return q.shape[1] if q.dim() == 4 else 1
