"""Where the time goes at the shapes that missed their targets (GPU only; writes DIR/explore.json).

python tools/gpu_explore.py --out DIR [--part short|small|all]

* ``short``: short caches at large batch (one split per row). The plain unified grid at one split against the
  persistent kernel (fdlib/kernels/persistent.py) over tile sizes, stages, warps and programs per SM, and cuDNN.
* ``small``: B = 1, L <= 16k. Stage 1 alone, stage 1 + stage 2, unified, and unified with its ticket step
  replaced (no atomic: nobody merges, timing only; relaxed atomic: timing only) at several split counts,
  and an empty kernel: how much of the time is launch, map, hand-off and merge.

Every timing is a CUDA-graph replay over rotated input copies (fdlib.bench.timing), median, in µs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch
import triton
import triton.language as tl

import fdlib
from fdlib.bench.timing import Rotating, copies_for_l2, time_graph
from fdlib.gpus import sm_count
from fdlib.kernels.config import TileConfig, chunk_for, tile_config
from fdlib.kernels.persistent import run_persistent
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.kernels.unified import run_unified
from fdlib.plan import decide


@triton.jit
def ticket_none(counter_ptr, n_splits):
    """Timing only: no hand-off at all (nobody merges; the output is not the answer)."""
    return n_splits < 0


@triton.jit
def ticket_relaxed(counter_ptr, n_splits):
    """Timing only: the ticket without ordering (a real kernel needs acquire-release)."""
    ticket = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    is_last = ticket == n_splits - 1
    if is_last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return is_last


@triton.jit
def empty_kernel(X):
    pass


def inputs(B, Hq, Hkv, L, D, dtype, n):
    q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
    ks = [torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype) for _ in range(n)]
    vs = [torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype) for _ in range(n)]
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q, ks, vs, lens


def ref(q, k, v):
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) / math.sqrt(D)
    return torch.einsum("bhgl,blhd->bhgd", torch.softmax(s, -1), v.float()).reshape(B, Hq, D)


def timed(make, n, r, out, check=True):
    """(µs, rel. error) of the call ``make(i)`` rotating over n copies; error of copy 0 (None if unchecked)."""
    make(0)()
    torch.cuda.synchronize()
    err = float((out.float() - r).norm() / r.norm()) if check else None
    return time_graph(Rotating([make(i) for i in range(n)]), rep_ms=10), err


def cudnn_us(q, ks, vs, n):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q4 = q[:, :, None, :]
    kt = [k.transpose(1, 2).contiguous() for k in ks]
    vt = [v.transpose(1, 2).contiguous() for v in vs]
    gqa = q.shape[1] != ks[0].shape[2]

    def make(i):
        return lambda: torch.nn.functional.scaled_dot_product_attention(q4, kt[i], vt[i], enable_gqa=gqa)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t = time_graph(Rotating([make(i) for i in range(n)]), rep_ms=10)
    del kt, vt
    return t


def part_short(records, sms):
    shapes = [(64, 32, 32, 512), (64, 32, 8, 512), (64, 32, 8, 2048), (16, 32, 32, 2048), (64, 32, 32, 2048),
              (16, 32, 8, 512), (16, 32, 8, 2048), (4, 32, 32, 512)]
    cfgs = [TileConfig(n, w, s) for n, w, s in itertools.product((64, 128), (4, 8), (2, 3))]
    D, dtype = 128, torch.float16
    for (B, Hq, Hkv, L) in shapes:
        kvb = 2 * B * Hkv * L * D * 2
        n = copies_for_l2(kvb)
        q, ks, vs, lens = inputs(B, Hq, Hkv, L, D, dtype, n)
        r = ref(q, ks[0], vs[0])
        base = dict(B=B, H_q=Hq, H_kv=Hkv, L=L, D=D, kv_bytes=kvb, copies=n)
        records.append(dict(base, method="cudnn", us=cudnn_us(q, ks, vs, n)))
        out = torch.empty_like(q)
        lse = torch.empty(B, Hq, device="cuda")
        cur = tile_config(D, L, 2, rows=B * Hkv)
        chunk, _ = chunk_for(L, 1, cur.BLOCK_N)
        t, e = timed(lambda i: (lambda: run_unified(q, ks[i], vs[i], lens, scale=1 / math.sqrt(D), chunk=chunk, splits=1,
                                                    cfg=cur, out=out, lse=lse)), n, r, out)
        records.append(dict(base, method="unified@1", BLOCK_N=cur.BLOCK_N, num_warps=cur.num_warps,
                            num_stages=cur.num_stages, us=t, err=e))
        for cfg in cfgs:
            for per_sm in (1, 2, 3, 4):
                P = sms * per_sm
                try:
                    t, e = timed(lambda i: (lambda: run_persistent(q, ks[i], vs[i], lens, scale=1 / math.sqrt(D),
                                                                   cfg=cfg, out=out, lse=lse, programs=P)), n, r, out)
                except Exception as ex:  # noqa: BLE001
                    print("FAIL", cfg, per_sm, repr(ex)[:200], flush=True)
                    continue
                records.append(dict(base, method="persistent", BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages, per_sm=per_sm, programs=P, us=t, err=e))
        rs = [x for x in records if all(x.get(k) == base[k] for k in ("B", "H_kv", "L"))]
        c = next(x["us"] for x in rs if x["method"] == "cudnn")
        u = next(x["us"] for x in rs if x["method"] == "unified@1")
        best = min((x for x in rs if x["method"] == "persistent"), key=lambda x: x["us"])
        ceil_us = kvb / 4.65e6
        print(f"B={B} {Hq}:{Hkv} L={L}: cudnn {c:.1f} unified@1 {u:.1f} ({u / c:.3f}) persistent best {best['us']:.1f} "
              f"({best['us'] / c:.3f}, {100 * ceil_us / best['us']:.1f}% of 4.65) N={best['BLOCK_N']} "
              f"w={best['num_warps']} st={best['num_stages']} per_sm={best['per_sm']} err={best['err']:.1e}",
              flush=True)
        del q, ks, vs
        torch.cuda.empty_cache()


def part_small(records):
    D, dtype = 128, torch.float16
    x = torch.zeros(1, device="cuda")
    t_empty = time_graph(Rotating([lambda: empty_kernel[(1,)](x)]), rep_ms=10)
    records.append(dict(method="empty", us=t_empty))
    print(f"empty kernel in a graph: {t_empty:.2f} us", flush=True)
    for (Hq, Hkv), L in itertools.product(((32, 8), (32, 32)), (512, 2048, 8192, 16384)):
        B = 1
        kvb = 2 * B * Hkv * L * D * 2
        n = copies_for_l2(kvb)
        q, ks, vs, lens = inputs(B, Hq, Hkv, L, D, dtype, n)
        r = ref(q, ks[0], vs[0])
        base = dict(B=B, H_q=Hq, H_kv=Hkv, L=L, D=D, kv_bytes=kvb, copies=n)
        records.append(dict(base, method="cudnn", us=cudnn_us(q, ks, vs, n)))
        cfg = tile_config(D, L, 2, rows=B * Hkv)
        scale = 1 / math.sqrt(D)
        out = torch.empty_like(q)
        lse = torch.empty(B, Hq, device="cuda")
        chosen = decide(B, Hq, Hkv, D, L, q.dtype, method="unified").splits
        line = [f"B=1 {Hq}:{Hkv} L={L} cudnn {records[-1]['us']:.1f} chosen {chosen}:"]
        for s in sorted({chosen, 2, 4, 8, 16, 32}):
            chunk, splits = chunk_for(L, s, cfg.BLOCK_N)
            if splits != s:
                continue
            parts = {}
            launch = dict(scale=scale, chunk=chunk, splits=splits, cfg=cfg)     # every kernel's launch scalars
            op, lp = run_stage1(q, ks[0], vs[0], lens, **launch)
            variants = {
                "stage1": (lambda i: (lambda: run_stage1(q, ks[i], vs[i], lens, **launch)), False),
                "stage2": (lambda i: (lambda: run_stage2(op, lp, out, lse)), False),
                "two_stage": (lambda i: (lambda: run_stage2(*run_stage1(q, ks[i], vs[i], lens, **launch), out, lse)),
                              True),
                "unified": (lambda i: (lambda: run_unified(q, ks[i], vs[i], lens, **launch, out=out, lse=lse)), True),
                "unified_noticket": (lambda i: (lambda: run_unified(q, ks[i], vs[i], lens, **launch, out=out, lse=lse,
                                                                    ticket_fn=ticket_none)), False),
                "unified_relaxed": (lambda i: (lambda: run_unified(q, ks[i], vs[i], lens, **launch, out=out, lse=lse,
                                                                   ticket_fn=ticket_relaxed)), False),
            }
            for name, (make, chk) in variants.items():
                t, e = timed(make, n, r, out, check=chk)
                parts[name] = t
                records.append(dict(base, method=name, splits=splits, chosen=chosen, us=t, err=e))
            line.append(f" s={splits}: " + " ".join(f"{k}={v:.2f}" for k, v in parts.items()))
        print("\n   ".join(line), flush=True)
        del q, ks, vs
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--part", default="all", choices=("short", "small", "all"))
    args = ap.parse_args()
    print(fdlib.describe(), flush=True)
    sms = sm_count()
    records = []
    t0 = time.time()
    try:
        if args.part in ("small", "all"):
            part_small(records)
        if args.part in ("short", "all"):
            part_short(records, sms)
    finally:
        with open(f"{args.out}/explore.json", "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "sm_count": sms, "torch": torch.__version__,
                       "triton": triton.__version__, "cuda": torch.version.cuda,
                       "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "command": " ".join(["tools/gpu_explore.py", *sys.argv[1:]]),
                       "seconds": round(time.time() - t0, 1), "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
