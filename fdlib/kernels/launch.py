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

One level up, :func:`record` and :func:`replay` let a plan skip even that: a call's launches, once made
directly, are kept with each pointer marked as one of the call's own tensors (q, K, V, lengths, out, lse,
block table) or a workspace address, and a later call whose tensors are laid out alike (the plan checks shapes,
strides, dtypes and devices) is launched with the new addresses alone: no checks, no strides, no key. On an
H200 that took ``plan.run`` from 0.87x to 0.55x of SDPA cuDNN's host time per call.
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


def _aligned(addrs) -> bool:
    """Every address 16-byte aligned: the specialisation the direct launches are compiled for."""
    addr = 0
    for a in addrs:
        addr |= a
    return addr & 15 == 0


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

    def _key(self, ptrs: tuple, scalars: tuple):
        slots = self.dtype_slots
        return ((scalars, *[t.dtype for t in ptrs]) if slots is None
                else (scalars, *[ptrs[i].dtype for i in slots]))

    def __call__(self, grid, ptrs: tuple, scalars: tuple):
        key = None
        if FAST_LAUNCH:
            addrs = [t.data_ptr() for t in ptrs]
            if _aligned(addrs):
                key = self._key(ptrs, scalars)
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

    def entry(self, ptrs: tuple, scalars: tuple):
        """(launch, function, leading arguments, constexprs) of the direct launch a call with these arguments
        takes, or None where it takes Triton's generic one (a pointer not 16-byte aligned, or not compiled yet)."""
        if not FAST_LAUNCH or not _aligned([t.data_ptr() for t in ptrs]):
            return None
        return self._compiled.get(self._key(ptrs, scalars))


def record(calls: list, roles: tuple, constants: tuple):
    """The direct launches of one call, to be replayed by :func:`replay` with other tensors of the same layout.

    ``calls``: the call's launches, ``(launcher, (grid, ptrs, scalars))`` in order. Each pointer must be one of
    ``roles`` (the caller's tensors, whose addresses change from call to call; recorded as their index) or one
    of ``constants`` (the plan's workspace, recorded as its address). Returns None, and nothing is replayed,
    where a launch would take Triton's generic path or a pointer is neither (a view or a copy made for the
    call), or where one tensor plays two roles (``out`` passed as ``q``; a later call may not alias them):
    such calls keep the checked path."""
    present = [id(r) for r in roles if r is not None]
    if len(set(present)) != len(present):
        return None
    steps = []
    for go, (grid, ptrs, scalars) in calls:
        hit = go.entry(ptrs, scalars)
        if hit is None:
            return None
        launch, function, head, constexprs = hit
        base, fill = [], []
        for i, t in enumerate(ptrs):
            role = next((j for j, r in enumerate(roles) if r is t), None)
            if role is not None:
                base.append(0)
                fill.append((i, role))
            elif any(c is t for c in constants):
                base.append(t.data_ptr())
            else:
                return None
        grid3 = (*grid, 1, 1)[:3]
        steps.append((launch, function, head, base, tuple(fill), (*scalars, *constexprs), grid3))
    return tuple(steps) or None


def replay(steps: tuple, tensors: tuple) -> bool:
    """Launch recorded steps (:func:`record`) with the addresses of ``tensors`` in the roles' order (None for
    an absent one), on the current stream of the first one's device. Returns False, having launched nothing,
    where an address is not 16-byte aligned (the specialisation the steps were compiled for) or a launch hook is
    installed: the caller then takes the checked path."""
    addrs = [0 if t is None else t.data_ptr() for t in tensors]
    if not _aligned(addrs) or not _no_hooks():
        return False
    stream = torch._C._cuda_getCurrentRawStream(tensors[0].get_device())
    for launch, function, head, base, fill, tail, (g0, g1, g2) in steps:
        ptrs = base.copy()
        for i, role in fill:
            ptrs[i] = addrs[role]
        launch(g0, g1, g2, stream, function, *head, *ptrs, *tail)
    return True


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


NO_SCALES = (0, 0, 0, 0, 0, 0, 1.0)
"""The scale scalars of a 16-bit cache's launch (strides of no scale tensor, v_mul = 1)."""


def scale_args(scales, flag) -> tuple:
    """(pointers KS and VS, scalars: K's batch-or-page, slot and head scale strides, V's, v_mul) of a launch: an
    8-bit cache's (``scales`` = (pointers, scalars) of :func:`fdlib.quant.launch_args`), or a 16-bit cache's
    (None: the flag stands in for the pointers, which are never read)."""
    return ((flag, flag), NO_SCALES) if scales is None else scales


def paging(k_cache, block_table, flag):
    """(block-table pointer, its row stride, pages in the pool, L_max) of a launch: a contiguous cache
    [B, L_max, H_kv, D] has no table (the flag stands in for the unused pointer); a paged one
    [n_pages, page_size, H_kv, D] has L_max = max_pages · page_size."""
    if block_table is None:
        return flag, 0, 1, k_cache.shape[1]
    return block_table, block_table.stride(0), k_cache.shape[0], block_table.shape[1] * k_cache.shape[1]


def pack_for(H_kv: int, D: int, max_width: int = 128) -> int:
    """KV heads a program may read as one (:func:`fdlib.kernels.tile.own_dims`): the most, P, with P·D <= max_width
    and P dividing H_kv, for a power-of-two D below max_width (so the pack's D·P is the tile's BLOCK_D); else 1."""
    if D >= max_width or D & (D - 1):
        return 1
    p = max_width // D
    while p > 1 and H_kv % p:
        p //= 2
    return p


def check_pack(pack: int, D: int, q_len: int) -> None:
    """A launch packing ``pack`` KV heads has one query token and a power-of-two width D (the pack's)."""
    if pack > 1 and (q_len != 1 or D & (D - 1) or D % pack):
        raise ValueError(f"pack: {pack} KV heads read as one need one query token and a power-of-two width that "
                         f"pack divides; got q_len={q_len}, D={D}")


def heads_adjacent(t, D: int) -> bool:
    """Whether a cache [..., H_kv, D] holds each token's KV heads side by side (stride(-2) == D, stride(-1) == 1),
    so that several heads read as one are one run of memory (:func:`packed_kv`)."""
    return t.stride(-1) == 1 and (t.shape[-2] == 1 or t.stride(-2) == D)


def packed_kv(k_cache, v_cache, pack: int = 1) -> tuple:
    """(H_kv, K strides, V strides) a launch sees: the cache's own, or with ``pack`` adjacent KV heads read as one
    KV head ``pack`` times as wide (:func:`heads_adjacent` must hold): H_kv / pack heads, head stride × pack."""
    ks, vs = k_cache.stride(), v_cache.stride()
    if pack == 1:
        return k_cache.shape[2], ks, vs
    return k_cache.shape[2] // pack, (ks[0], ks[1], ks[2] * pack, ks[3]), (vs[0], vs[1], vs[2] * pack, vs[3])


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
