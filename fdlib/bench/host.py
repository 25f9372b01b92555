r"""``python -m fdlib.bench --host-overhead``: wall time per call when calls run back to back.

A decode step of a few microseconds on the GPU is paced by the host whenever one Python call takes longer to
issue than its kernel takes to run: the GPU then idles between steps. This mode times each variant as a loop
would run it,

.. math::  t_{call} = \frac{\text{wall time of } N \text{ calls back to back, then one synchronize}}{N},

after a warm-up (compiles, plans, caches), the median of 5 loops with the variants taking turns in each
(so a drift of the host shifts them all alike). It is the larger of the host's time per call and the GPU's, so on a
short cache it measures the host. Variants, on one shape (default B=1, H 32:8, L=2048, D=128, fp16):

===================  =====================================================================================
``sdpa_cudnn``       ``F.scaled_dot_product_attention`` with ``sdpa_kernel(CUDNN_ATTENTION)`` entered once
                     around the loop (as a user would)
``sdpa_cudnn_ctx``   the same with the context entered on every call
``decode_attention`` ``fdlib.decode_attention(q, k, v, lens)``: the default call (cached plan + run)
``plan.run``         ``plan.run(q, k, v, lens)`` of a plan made once (allocates out)
``plan.run_out``     ``plan.run(q, k, v, lens, out=out)`` into a preallocated out
``graph_replay``     ``graph.replay()`` of a CUDA graph holding one ``plan.run``: the GPU-side floor
``triton_empty``     a bare ``kernel[grid](x)`` launch of an empty Triton kernel: the generic dispatch alone
``torch_empty3``     three ``torch.empty`` calls: the allocator alone
===================  =====================================================================================

It also profiles ``decode_attention`` with cProfile (the functions where the host time goes).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import triton

import fdlib

from .. import runtime
from .harness import DTYPES, provenance

VARIANTS = ("sdpa_cudnn", "sdpa_cudnn_ctx", "decode_attention", "plan.run", "plan.run_out", "graph_replay",
            "triton_empty", "torch_empty3")


def _loop_us(fns: dict, n: int, warmup: int, repeats: int = 5, ctxs: dict | None = None) -> dict:
    """{name: median over ``repeats`` of (wall time of n back-to-back calls, then a synchronize) / n, in µs}.
    The variants take turns within every repeat, so a drift of the host (clocks, other work) shifts them all
    alike instead of whichever ran last; a variant that raises gets its exception instead of a time."""
    sync = torch.cuda.synchronize if runtime.MODE == "gpu" else (lambda: None)
    ctxs = ctxs or {}
    times: dict = {name: [] for name in fns}
    for rep in range(repeats + 1):   # round 0 warms up every variant
        for name, fn in fns.items():
            if isinstance(times[name], Exception):
                continue
            ctx = ctxs[name]() if name in ctxs else None
            try:
                if ctx is not None:
                    ctx.__enter__()
                try:
                    calls = warmup if rep == 0 else n
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    sync()
                    if rep:
                        times[name].append((time.perf_counter() - t0) / n * 1e6)
                finally:
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
            except Exception as e:  # noqa: BLE001 - a peer may be missing; record why
                times[name] = e
    return {name: t if isinstance(t, Exception) else sorted(t)[len(t) // 2] for name, t in times.items()}


@triton.jit
def _empty(x):
    """Does nothing: its launch is Triton's generic dispatch alone."""
    pass


def _variants(q, k, v, lens, bhld):
    p = fdlib.plan(q.shape[0], q.shape[1], k.shape[2], q.shape[2], k.shape[1], dtype=q.dtype, device=q.device)
    out = torch.empty_like(q)
    fns = {
        "decode_attention": lambda: fdlib.decode_attention(q, k, v, lens),
        "plan.run": lambda: p.run(q, k, v, lens),
        "plan.run_out": lambda: p.run(q, k, v, lens, out=out),
        "triton_empty": lambda: _empty[(1,)](q),
        "torch_empty3": lambda: (torch.empty_like(q), torch.empty(q.shape[:2], device=q.device),
                                 torch.empty(8, device=q.device)),
    }
    if runtime.MODE == "gpu":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q4, kt, vt = bhld
        gqa = q4.shape[1] != kt.shape[1]
        fns["sdpa_cudnn"] = lambda: F.scaled_dot_product_attention(q4, kt, vt, enable_gqa=gqa)
        fns["sdpa_cudnn_ctx"] = lambda: _sdpa_ctx(F, sdpa_kernel, SDPBackend, q4, kt, vt, gqa)
        p.run(q, k, v, lens, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            p.run(q, k, v, lens, out=out)
        fns["graph_replay"] = g.replay
        return fns, p, (lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
    return fns, p, None


def _sdpa_ctx(F, sdpa_kernel, SDPBackend, q4, kt, vt, gqa):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q4, kt, vt, enable_gqa=gqa)


def profile_call(fn, n: int = 2000, top: int = 14) -> str:
    """cProfile of n calls of ``fn``: the ``top`` functions by their own time, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    if runtime.MODE == "gpu":
        torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).strip_dirs().sort_stats("tottime").print_stats(top)
    return s.getvalue()


def run_host_overhead(B=1, H_q=32, H_kv=8, L=2048, D=128, dtype="float16", n=300, warmup=50, command=None,
                      progress=True) -> dict:
    """Time every variant (see the module doc) on one shape; a results dict of kind ``"host"``."""
    dt = DTYPES[dtype]
    dev = runtime.DEVICE
    if runtime.MODE != "gpu":   # the interpreter: a tiny shape and a few calls, to show the harness runs
        n, warmup = min(n, 3), min(warmup, 1)
        B, H_q, H_kv, L, D = 1, 4, 2, 64, 32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H_q, D, generator=g, device=dev, dtype=dt)
    k = torch.randn(B, L, H_kv, D, generator=g, device=dev, dtype=dt)
    v = torch.randn(B, L, H_kv, D, generator=g, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    bhld = (q.unsqueeze(2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    fns, plan, sdpa_ctx = _variants(q, k, v, lens, bhld)
    ctxs = {"sdpa_cudnn": sdpa_ctx} if sdpa_ctx is not None else {}
    timed = _loop_us({name: fns[name] for name in VARIANTS if name in fns}, n, warmup, ctxs=ctxs)
    records = []
    for name in VARIANTS:
        if name not in fns:
            records.append({"variant": name, "status": "unavailable", "reason": "needs a CUDA GPU"})
        elif isinstance(timed[name], Exception):
            e = timed[name]
            records.append({"variant": name, "status": "unavailable", "reason": f"{type(e).__name__}: {e}"[:200]})
        else:
            records.append({"variant": name, "status": "ok", "us_per_call": timed[name]})
        if progress:
            import sys
            r = records[-1]
            print(f"host-overhead: {name}: {r.get('us_per_call', r.get('reason'))}", file=sys.stderr, flush=True)
    base = next((r["us_per_call"] for r in records if r["variant"] == "sdpa_cudnn" and r["status"] == "ok"), None)
    for r in records:
        if base and r["status"] == "ok":
            r["ratio_sdpa_cudnn"] = r["us_per_call"] / base
    return {"schema": "fdlib.bench/1", "kind": "host", "provenance": provenance(command),
            "shape": dict(B=B, H_q=H_q, H_kv=H_kv, L=L, D=D, dtype=dtype), "settings": {"calls": n,
            "warmup": warmup, "repeats": 5, "statistic": "median of 5 loops, the variants taking turns in each"}, "plan": str(plan),
            "records": records, "profile_decode_attention": profile_call(fns["decode_attention"],
                                                                          2000 if runtime.MODE == "gpu" else 2)}


def format_host_table(results) -> str:
    prov, sh = results["provenance"], results["shape"]
    lines = [f"device: {prov['device']} | mode: {prov['mode']} | torch {prov['torch']} | triton {prov['triton']} | "
             f"{prov['date_utc']}", f"command: {prov['command']}",
             f"shape: B={sh['B']}, H {sh['H_q']}:{sh['H_kv']}, L={sh['L']}, D={sh['D']}, {sh['dtype']}; "
             f"{results['settings']['calls']} calls back to back, then one synchronize "
             f"({results['settings']['statistic']})", f"plan: {results['plan']}", "",
             "| variant | µs per call | × SDPA cuDNN |", "|---|---|---|"]
    for r in results["records"]:
        if r["status"] == "ok":
            ratio = r.get("ratio_sdpa_cudnn")
            lines.append(f"| {r['variant']} | {r['us_per_call']:.1f} | {'' if ratio is None else f'{ratio:.2f}'} |")
        else:
            lines.append(f"| {r['variant']} | {r['status']}: {r.get('reason', '')} | |")
    lines += ["", "cProfile of decode_attention (own time):", "```", results["profile_decode_attention"].strip(), "```"]
    return "\n".join(lines)
