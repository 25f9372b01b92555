r"""Timing one decode call with a cold L2: eager launches and CUDA-graph replays.

* **Eager** - ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``. Before every timed run it
  zero-fills a 256 MB buffer (``clear_cache``), so each call reads its KV cache from HBM, not from the L2.
* **CUDA graph** - ``triton.testing.do_bench_cudagraph(fn, rep, return_mode="median")``. In triton 3.6 it
  captures ``n`` calls back to back in one graph and replays it **without** flushing the L2 between calls
  (read ``triton/testing.py``: no ``clear_cache`` in that function). A KV cache smaller than the L2 would then
  be timed from the cache. So the graph callable *rotates* among ``n_copies`` copies of the inputs, enough
  that the copies together hold at least 4x the L2 (:func:`copies_for_l2`): between two reads of the same copy,
  at least 3x the L2 of other KV bytes has streamed through, so every call starts from HBM. A cache already
  larger than 4x the L2 uses one copy. No flush kernel runs inside the graph, so nothing has to be subtracted.
* **Interpreter** (no GPU) - wall-clock median of a few calls; no graphs. The numbers only say that the
  harness runs; they say nothing about a GPU.

Times are returned in microseconds.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from contextlib import nullcontext

import torch
import triton.testing

from .. import runtime

L2_FALLBACK_BYTES = 60 * 2**20
L2_FACTOR = 4
MAX_COPIES = 256


def l2_bytes() -> int:
    """L2 size of the live GPU (60 MiB on an H200); the H200's value when there is no GPU."""
    if torch.cuda.is_available():
        size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
        if size:
            return int(size)
    return L2_FALLBACK_BYTES


def copies_for_l2(kv_bytes: int, l2: int | None = None, factor: int = L2_FACTOR, cap: int = MAX_COPIES) -> int:
    """How many copies of a KV cache of ``kv_bytes`` make at least ``factor`` x L2 together (at least 1)."""
    l2 = l2_bytes() if l2 is None else l2
    if kv_bytes <= 0:
        return 1
    return max(1, min(cap, math.ceil(factor * l2 / kv_bytes)))


class Rotating:
    """A zero-argument callable that calls ``fns[0]``, ``fns[1]``, ... in turn (one per input copy)."""

    def __init__(self, fns):
        self.fns = list(fns)
        self.i = 0

    def __call__(self):
        fn = self.fns[self.i]
        self.i = (self.i + 1) % len(self.fns)
        return fn()


def time_eager(fn, warmup_ms: float = 25, rep_ms: float = 100, cpu_runs: int = 3, context=nullcontext) -> float:
    """Median µs of ``fn()``: do_bench with the L2 flushed before each run (GPU), or wall clock (interpreter)."""
    with context():
        if runtime.MODE == "gpu":
            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3
        times = []
        for _ in range(max(1, cpu_runs)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6


def time_graph(fn, rep_ms: float = 20, context=nullcontext) -> float:
    """Median µs of one ``fn()`` inside a replayed CUDA graph (``fn`` should be a :class:`Rotating`)."""
    if runtime.MODE != "gpu":
        raise RuntimeError("CUDA graphs need a GPU (this run uses the Triton interpreter)")
    with context():
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")) * 1e3


def time_graph_after(fn, before_replay, rep_ms: float = 20) -> float:
    """Median µs of one ``fn()`` inside a CUDA graph captured first and replayed only after ``before_replay()``
    ran: a graph captured before the lengths are known (the tensors ``fn`` reads hold placeholder values), replayed
    once the real lengths are copied into those same tensors. The steps are ``do_bench_cudagraph``'s (one warm
    call, five eager calls for an estimate, a graph of ``rep_ms / estimate`` calls, the median of ten replays);
    the warm and estimate calls, and the capture, see the placeholder values, every timed replay the new ones."""
    if runtime.MODE != "gpu":
        raise RuntimeError("CUDA graphs need a GPU (this run uses the Triton interpreter)")
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = start.elapsed_time(end) / 5
        n = max(1, int(rep_ms / estimate_ms)) if estimate_ms > 0 else 1000
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        torch.cuda.synchronize()
        before_replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / n)
    return statistics.median(times) * 1e3


def captured_call(run, lens: torch.Tensor, L_max: int):
    """(call, set_lengths) of the captured protocol: ``call()`` is ``run(held)``, where ``held`` is a lengths
    tensor holding L_max in every row (what a graph captured before the lengths are known sees); ``set_lengths()``
    is the one host action before the replays, the batch's ``lens`` copied into ``held``
    (:func:`time_graph_after`)."""
    held = torch.full_like(lens, L_max)
    return (lambda: run(held)), (lambda: held.copy_(lens))


def synchronize():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def free_memory():
    """Give cached blocks back between shapes so a large shape does not fail for a small one's leftovers."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
