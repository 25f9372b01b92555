"""Tile-config and split sweep for the Triton decode kernels on a GPU (used to pick fdlib's GPU defaults).

python tools/gpu_tune.py --out DIR   prints a table and writes DIR/tune.json

Every timing is a CUDA-graph replay (triton.testing.do_bench_cudagraph, median) over enough rotated copies
of the KV cache that each call reads from HBM, not from the L2 left by the previous call.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import sys
import time

import torch
import triton

import fdlib
from fdlib.gpus import sm_count
from fdlib.kernels.config import TileConfig, chunk_for
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.kernels.unified import run_unified

L2_BYTES = 60 * 2**20


def make(B, Hq, Hkv, L, D, dtype, copies):
    q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
    ks = [torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype) for _ in range(copies)]
    vs = [torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype) for _ in range(copies)]
    return q, ks, vs


def ref(q, k, v, scale):
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * scale
    p = torch.softmax(s, -1)
    return torch.einsum("bhgl,blhd->bhgd", p, v.float()).reshape(B, Hq, D)


def rotating(fn_for, n):
    state = {"i": 0}

    def fn():
        i = state["i"] % n
        state["i"] += 1
        fn_for(i)
    return fn


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median") * 1e3  # µs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(fdlib.describe(), flush=True)
    shapes = [(1, 32, 8, 131072), (1, 32, 8, 8192), (1, 32, 8, 512), (16, 32, 8, 2048), (4, 32, 32, 32768),
              (64, 32, 32, 2048), (64, 32, 8, 8192), (1, 32, 32, 32768)]
    cfgs = [TileConfig(n, w, s) for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]
    if args.quick:
        shapes, cfgs = shapes[:2], cfgs[:4]
    D, dtype = 128, torch.float16
    sms = sm_count()
    records = []
    for (B, Hq, Hkv, L) in shapes:
        kv_bytes = 2 * B * Hkv * L * D * 2
        copies = max(1, min(16, math.ceil(4 * L2_BYTES / kv_bytes)))
        q, ks, vs = make(B, Hq, Hkv, L, D, dtype, copies)
        scale = 1 / math.sqrt(D)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        r = ref(q, ks[0], vs[0], scale)
        # peers
        qs = q[:, :, None, :]
        kt = [k.transpose(1, 2) for k in ks]
        vt = [v.transpose(1, 2) for v in vs]
        peers = {}
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                def call(i, be=be):
                    with sdpa_kernel(be):
                        return torch.nn.functional.scaled_dot_product_attention(qs, kt[i], vt[i], enable_gqa=Hq != Hkv)
                o = call(0)[:, :, 0]
                err = ((o.float() - r).norm() / r.norm()).item()
                peers[name] = (bench(rotating(call, copies)), err)
            except Exception as e:  # noqa: BLE001
                peers[name] = (None, repr(e)[:120])
        base = {"B": B, "H_q": Hq, "H_kv": Hkv, "L": L, "D": D, "kv_mb": kv_bytes / 1e6, "copies": copies,
                "peers": peers}
        # candidate splits: programs ~ 0.5..8 x SMs
        base_p = B * Hkv
        cand = sorted({1} | {min(256, max(1, 2 ** round(math.log2(max(mult * sms / base_p, 1)))))
                             for mult in (0.5, 1, 2, 4, 8)})
        cand = [s for s in cand if s <= max(1, L // 32)]
        best = {}
        for cfg in cfgs:
            for s in cand:
                chunk, splits = chunk_for(L, s, cfg.BLOCK_N)
                out = torch.empty_like(q)
                lse = torch.empty(B, Hq, device="cuda")
                for method in ("unified", "split"):
                    if method == "split" and cfg != best.get("unified_cfg", cfg):
                        pass
                    def call(i, method=method):
                        if method == "unified":
                            run_unified(q, ks[i], vs[i], lens, scale=scale, chunk=chunk, splits=splits, cfg=cfg,
                                        out=out, lse=lse)
                        else:
                            op, lp = run_stage1(q, ks[i], vs[i], lens, scale=scale, chunk=chunk, splits=splits,
                                                cfg=cfg)
                            run_stage2(op, lp, out, lse)
                    try:
                        call(0)
                        torch.cuda.synchronize()
                        err = ((out.float() - r).norm() / r.norm()).item()
                        t = bench(rotating(call, copies))
                    except Exception as e:  # noqa: BLE001
                        print("FAIL", cfg, s, method, repr(e)[:200], flush=True)
                        continue
                    rec = dict(base, method=method, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, splits=splits, us=t, err=err,
                               tbs=kv_bytes / t / 1e6)
                    records.append(rec)
                    key = method
                    if key not in best or t < best[key]["us"]:
                        best[key] = rec
        c = peers["cudnn"][0]
        f = peers["fa2"][0]
        for m in ("unified", "split"):
            b = best.get(m)
            if b:
                print(f"B={B:3d} Hq={Hq} Hkv={Hkv:2d} L={L:6d} {m:8s} best {b['us']:8.1f}us "
                      f"N={b['BLOCK_N']} w={b['num_warps']} st={b['num_stages']} splits={b['splits']:3d} "
                      f"{b['tbs']:.2f}TB/s err={b['err']:.1e} | cudnn {c} fa2 {f}", flush=True)
        del q, ks, vs
        torch.cuda.empty_cache()
    with open(f"{args.out}/tune.json", "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv),
                   "records": records}, fh)
    # per-config summary: geometric mean of time relative to the best config per (shape, method)
    groups = collections.defaultdict(list)
    for rec in records:
        groups[(rec["B"], rec["H_kv"], rec["L"], rec["method"])].append(rec)
    score = collections.defaultdict(list)
    for key, recs in groups.items():
        bestt = min(x["us"] for x in recs)
        per_cfg = collections.defaultdict(lambda: float("inf"))
        for x in recs:
            k = (x["BLOCK_N"], x["num_warps"], x["num_stages"], x["method"])
            per_cfg[k] = min(per_cfg[k], x["us"])
        for k, t in per_cfg.items():
            score[k].append(t / bestt)
    rows = sorted(((math.exp(sum(map(math.log, v)) / len(v)), max(v), k) for k, v in score.items()))
    print("config (BLOCK_N, warps, stages, method): geomean and worst ratio to per-shape best (best splits each)")
    for g, w, k in rows[:12]:
        print(f"  {k}: geomean {g:.3f} worst {w:.3f}")


if __name__ == "__main__":
    main()
