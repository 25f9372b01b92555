r"""Where one decode step's time goes: a ``torch.profiler`` trace of the step, its device work sorted by kind.

A step's span is the time from its first kernel's start to its last kernel's end. Every kernel (or copy) of
the span falls into one category by its name (:data:`CATEGORIES`, first match wins):

* ``cat``: a concatenation launched by the cache's ``update`` (``DynamicCache`` appends with ``torch.cat``;
  :func:`annotate_cache` marks the calls). Rotary embedding's own small ``cat`` of two halves is elementwise;
* ``attention``: SDPA's kernels (cuDNN, FlashAttention, memory-efficient) or fdlib's;
* ``gemm``: the matrix products (projections, MLP, the LM head);
* ``cache write``: in-place writes and copies (``index_copy_``, memcpy, memset), and whatever else the cache's
  ``update`` launches;
* ``elementwise``: everything else: norms, rotary, activations, residual adds, casts (small kernels);

and ``gaps`` = span − the time at least one kernel runs: the device idle between launches (on a CPU, where the
"kernels" are the innermost aten ops, the host's Python time between them). Categories and gaps add up to the
span.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile

import torch

from .timing import synchronize

CACHE_UPDATE = "fdlib.bench: cache update"
"""The ``record_function`` label around a cache's ``update`` while a step is profiled."""
CATEGORIES = (
    ("attention", ("fmha", "flash", "cudnn", "attention", "sdpa", "stage1_kernel", "stage2_kernel", "unified",
                   "balanced_kernel", "persistent_kernel", "streamk_kernel", "invariant_kernel", "fdlib")),
    ("gemm", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "cublas", "matmul", "aten::mm", "aten::addmm",
              "aten::bmm", "splitk", "dot_kernel")),
    ("cache write", ("index_copy", "indexfunc", "index_put", "memcpy", "memset", "aten::copy_", "scatter")),
)
CAT = ("catarraybatchedcopy", "aten::cat", "cat_kernel", "fused_cat")
ORDER = ("cat",) + tuple(name for name, _ in CATEGORIES) + ("elementwise", "gaps")
"""The summary's categories, in the order tables list them."""


def category(name: str, in_cache_update: bool = False) -> str:
    """The category of a kernel or op called ``name`` (module doc), launched inside a cache's ``update`` or not."""
    low = name.lower()
    if in_cache_update:
        return "cat" if any(k in low for k in CAT) else "cache write"
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise"


class annotate_cache:
    """``with annotate_cache(cache):`` every ``cache.update`` call runs inside ``record_function(CACHE_UPDATE)``,
    so the profile can tell the cache's kernels from the model's."""

    def __init__(self, cache):
        self.cache = cache

    def __enter__(self):
        from torch.profiler import record_function
        orig = self.cache.update

        def update(*args, **kwargs):
            with record_function(CACHE_UPDATE):
                return orig(*args, **kwargs)
        self.cache.update = update
        return self

    def __exit__(self, *exc):
        del self.cache.update   # the instance attribute goes; the class's method shows again
        return False


def innermost(spans):
    """The spans ``(name, start, end)`` that hold no other span (nested CPU ops: keep the leaves)."""
    spans = sorted(spans, key=lambda s: (s[1], -s[2]))
    keep = []
    for i, (name, a, b) in enumerate(spans):
        nxt = spans[i + 1] if i + 1 < len(spans) else None
        if nxt is None or nxt[1] >= b:   # the next span starts after this one ends: nothing inside
            keep.append((name, a, b))
    return keep


def busy_time(spans) -> float:
    """Length of the union of the intervals ``(start, end)`` of ``spans``."""
    total, end = 0.0, None
    for _, a, b, *_ in sorted(spans, key=lambda s: s[1]):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(spans, steps: int = 1) -> dict:
    """Per-step ms of each category (:data:`ORDER`) of ``spans`` ``[(name, start_us, end_us, in_cache_update)]``,
    the span, the kernel count and the eight kernels that take longest (summed by name and category)."""
    if not spans:
        return dict(span_ms=0.0, ms={c: 0.0 for c in ORDER}, kernels=0, top=[], steps=steps)
    start = min(s[1] for s in spans)
    span = max(s[2] for s in spans) - start
    ms = {c: 0.0 for c in ORDER}
    by_name: dict = {}
    for name, a, b, tagged in spans:
        cat = category(name, tagged)
        ms[cat] += (b - a) / 1e3 / steps
        t, n = by_name.get((name, cat), (0.0, 0))
        by_name[(name, cat)] = (t + (b - a) / 1e3 / steps, n + 1)
    # kernels overlapping in time (none in a single-stream step) would make the categories exceed the span
    ms["gaps"] = max(0.0, (span - busy_time(spans)) / 1e3 / steps)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:8]
    return dict(span_ms=span / 1e3 / steps, ms=ms, kernels=len(spans) // steps,
                top=[dict(name=n[:120], ms=t, count=c // steps, category=cat) for (n, cat), (t, c) in top],
                steps=steps)


def _inside(t: float, intervals) -> bool:
    return any(a <= t <= b for a, b in intervals)


def trace_spans(trace: dict, device: bool) -> list:
    """``(name, start_us, end_us, in_cache_update)`` of a Chrome trace's device kernels, copies and memsets
    (``device``: launched from inside a :data:`CACHE_UPDATE` range, found through the launch's correlation id),
    or of its innermost CPU ops (inside such a range)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]

    def interval(e):
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])
    marked = [interval(e) for e in events if e.get("name") == CACHE_UPDATE and e.get("cat") == "user_annotation"]
    if device:
        launches = {e.get("args", {}).get("correlation"): float(e["ts"]) for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver")}   # Triton launches through the driver
        out = []
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                at = launches.get(e.get("args", {}).get("correlation"))
                out.append((e["name"], *interval(e), at is not None and _inside(at, marked)))
        return out
    ops = innermost([(e["name"], *interval(e)) for e in events if e.get("cat") == "cpu_op"])
    return [(name, a, b, _inside(a, marked)) for name, a, b in ops]


PROFILER_LOG = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")
"""The line torch's profiler writes to the process's stderr (file descriptor 2, below Python) when it starts and
stops: ``USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start``."""


@contextlib.contextmanager
def quiet_profiler_log():
    """Inside: what C code writes to file descriptor 2 goes to a temporary file; on the way out every line of it
    but the profiler's own start/stop lines (:data:`PROFILER_LOG`) is written to ``sys.stderr``, so a notebook
    shows a warning or an error as before, without the profiler's log."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not PROFILER_LOG.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def profile_step(fn, gpu: bool, steps: int = 1) -> dict:
    """Run ``fn`` ``steps`` times (already warm) under ``torch.profiler``; :func:`summarize` of its device work
    (``gpu``) or of its innermost CPU ops, plus ``source`` saying which. (A cache's kernels are told apart only
    where its ``update`` runs inside :func:`annotate_cache`.)"""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    synchronize()
    with quiet_profiler_log(), profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        synchronize()
    with tempfile.TemporaryDirectory(prefix="fdlib-profile-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    out = summarize(trace_spans(trace, gpu), steps)
    out["source"] = ("CUDA kernels, copies and memsets (torch.profiler)" if gpu else
                     "innermost CPU ops (torch.profiler; no GPU: gaps are host time between ops)")
    return out


def format_profiles(profiles) -> str:
    """Markdown: one row per profiled step, ms per category and share of the span."""
    lines = ["| B | context | variant | span ms | " + " | ".join(ORDER) + " | kernels |",
             "|---|---|---|---|" + "---|" * len(ORDER) + "---|"]
    for p in profiles:
        s = p["summary"]
        span = s["span_ms"] or 1.0
        cells = " | ".join(f"{s['ms'][c]:.3f} ({s['ms'][c] / span:.0%})" for c in ORDER)
        lines.append(f"| {p['B']} | {p['context']} | {p['variant']} | {s['span_ms']:.3f} | {cells} | "
                     f"{s['kernels']} |")
    for p in profiles:
        lines += ["", f"Longest kernels, B={p['B']} context={p['context']} {p['variant']} "
                      f"({p['summary'].get('source', '')}):"]
        lines += [f"- {k['ms']:.3f} ms ×{k['count']} [{k['category']}] {k['name']}" for k in p["summary"]["top"]]
    return "\n".join(lines)
