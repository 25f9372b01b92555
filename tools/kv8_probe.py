"""What bounds an 8-bit KV cache's decode loop: one minimal GQA decode loop (one program a KV head and row, one
query group of 16 rows, D = 128; the online-softmax tile update and the products of fdlib's kernels, none of their
masks, pages or splits) timed over a 16-bit cache and over e4m3 and int8 caches, at several tiles.

    python tools/kv8_probe.py --out DIR     # prints a table, writes DIR/kv8-probe.json (GPU only)

Variants: ``conv``, how an 8-bit tile becomes the fp16 operand of ``tl.dot``: ``triton`` (``x.to(tl.float16)``),
``asm`` (:func:`to_fp16` below, four elements a register in full-rate instructions: a candidate, not yet
in fdlib's kernels); ``dot``: ``plain`` (s = q·Kᵀ and
Õ += P·V, the query rows as the MMA's M) or ``trans`` (sᵀ = K·qᵀ and Õᵀ += Vᵀ·Pᵀ, keys and D as M: Hopper's wgmma).
Bandwidth = the cache's bytes / time (median of CUDA-event timings); the read ceiling is measured in the same run
(:func:`fdlib.bench.ceiling.measure_ceiling`)."""
import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

import fdlib
from fdlib.bench.ceiling import measure_ceiling

E4M3_TO_FP16 = tl.constexpr("""{ .reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi; }""")
INT8_TO_FP16 = tl.constexpr("""{ .reg .b32 t, c;
xor.b32 t, $2, 0x80808080;
prmt.b32 $0, t, 0x64646464, 0x4140;
prmt.b32 $1, t, 0x64646464, 0x4342;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c; }""")


@triton.jit
def to_fp16(x):
    """An 8-bit tile (e4m3 or int8) in fp16, exactly. On the GPU four elements a 32-bit register, in full-rate
    instructions: e4m3 by the hardware's pairwise conversion; int8 by the magic-number trick, b = x + 128 (the
    sign bit flipped) placed in the low byte of the fp16 0x6400 = 1024, so the half reads 1024 + b, minus 1152
    (0x6480) gives x."""
    if x.dtype == tl.int8:
        r = tl.inline_asm_elementwise(INT8_TO_FP16, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        r = tl.inline_asm_elementwise(E4M3_TO_FP16, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    return r


@triton.jit
def cast16(x, CONV: tl.constexpr):
    if x.dtype == tl.float16 or x.dtype == tl.bfloat16:
        r = x
    elif CONV == 0:
        r = x.to(tl.float16)
    else:
        r = to_fp16(x)
    return r


@triton.jit
def probe_kernel(Q, K, V, O, L, qk_scale, G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 TRANS: tl.constexpr, CONV: tl.constexpr):
    pid = tl.program_id(0)
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + pid * G * D + offs_g[:, None] * D + offs_d[None, :])
    K = K + pid.to(tl.int64) * L * D
    V = V + pid.to(tl.int64) * L * D
    m = tl.full([G], float("-inf"), tl.float32)
    l = tl.zeros([G], tl.float32)
    if TRANS:
        qT = tl.trans(q)
        accT = tl.zeros([D, G], tl.float32)
        for n0 in range(0, L, BLOCK_N):
            k = cast16(tl.load(K + (n0 + offs_n)[:, None] * D + offs_d[None, :]), CONV)
            v = cast16(tl.load(V + (n0 + offs_n)[:, None] * D + offs_d[None, :]), CONV)
            sT = tl.dot(k.to(q.dtype), qT) * qk_scale
            m_new = tl.maximum(m, tl.max(sT, 0))
            alpha = tl.exp2(m - m_new)
            pT = tl.exp2(sT - m_new[None, :])
            l = l * alpha + tl.sum(pT, 0)
            accT = accT * alpha[None, :] + tl.dot(tl.trans(v.to(q.dtype)), pT.to(q.dtype))
            m = m_new
        acc = tl.trans(accT)
    else:
        acc = tl.zeros([G, D], tl.float32)
        for n0 in range(0, L, BLOCK_N):
            k = cast16(tl.load(K + (n0 + offs_n)[:, None] * D + offs_d[None, :]), CONV)
            v = cast16(tl.load(V + (n0 + offs_n)[:, None] * D + offs_d[None, :]), CONV)
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m = m_new
    tl.store(O + pid * G * D + offs_g[:, None] * D + offs_d[None, :], acc / l[:, None])


def timed(fn, reps=15):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--programs", type=int, default=1056)
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    args = ap.parse_args()
    P, L, D, G = args.programs, args.L, 128, 16
    ceiling = measure_ceiling()
    print(f"{torch.cuda.get_device_name()}: read ceiling {ceiling['tbs']:.2f} TB/s", flush=True)
    q = torch.randn(P, G, D, device="cuda")
    rows = []
    store = {}
    for kv in ("bfloat16", "float8_e4m3fn", "int8"):
        torch.cuda.empty_cache()
        store.clear()
        src = torch.randn(P, L, D, device="cuda", dtype=torch.bfloat16)
        if kv == "int8":
            k = (src * 30).clamp(-127, 127).round().to(torch.int8)
        else:
            k = src.to(getattr(torch, kv))
        v = k.clone()
        del src
        qd = q.to(torch.bfloat16 if kv == "bfloat16" else torch.float16)
        o = torch.empty(P, G, D, device="cuda")
        nbytes = 2 * k.numel() * k.element_size()
        sixteen = k.element_size() == 2
        grid = [(bn, w, 3, 0, 0 if sixteen else 1) for bn, w in itertools.product((64, 128, 256), (4, 8))]
        if not sixteen:   # Triton's own conversion, and the transposed products (wgmma), at the default tiles
            grid += [(128, 4, 3, 0, 0), (128, 4, 3, 1, 1), (128, 8, 4, 0, 1), (256, 8, 4, 0, 1)]
        if args.quick:
            grid = [(128, 4, 3, 0, c) for c in ((0,) if sixteen else (0, 1))]
        for bn, w, s, tr, conv in grid:
            fn = lambda: probe_kernel[(P,)](qd, k, v, o, L, 0.088, G=G, D=D, BLOCK_N=bn, TRANS=tr, CONV=conv,
                                             num_warps=w, num_stages=s)
            t0 = time.time()
            try:
                us = timed(fn)
            except Exception as e:   # out of shared memory / registers for this tile
                print(f"{kv:14} N={bn:3} w={w} s={s} {'trans' if tr else 'plain'} conv={conv}: {type(e).__name__}", flush=True)
                continue
            gbs = nbytes / us / 1e3
            rows.append(dict(kv=kv, BLOCK_N=bn, num_warps=w, num_stages=s, dot="trans" if tr else "plain",
                             conv="asm" if conv else "triton", us=us, gbs=gbs))
            print(f"{kv:14} N={bn:3} w={w} s={s} {'trans' if tr else 'plain'} conv={'asm' if conv else 'triton'}: "
                  f"{us:8.1f} us {gbs:7.0f} GB/s ({time.time() - t0:.1f} s)", flush=True)
        del k, v
    best = {}
    for r in rows:
        if r["kv"] not in best or r["us"] < best[r["kv"]]["us"]:
            best[r["kv"]] = r
    for kv, r in best.items():
        print(f"best {kv}: {r}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv8-probe.json"), "w") as f:
        json.dump(dict(provenance=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                       triton=triton.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       command="python tools/kv8_probe.py " + " ".join(sys.argv[1:]),
                                       commit=os.environ.get("FDLIB_GIT_COMMIT")),
                       programs=P, L=L, D=D, G=G, ceiling=ceiling, rows=rows, best=best), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
