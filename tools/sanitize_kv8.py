"""A small decode-attention workload over 8-bit KV caches for compute-sanitizer (memcheck, racecheck): e4m3 and int8
caches with K and V scaled per tensor, per head and per token (and mixed), contiguous and paged (pages of 4: a table
lookup in each tile's iteration; of 16: read a tile ahead or held in registers), ragged lengths including 0 and 1,
per-token scales past each length NaN (never read), table entries past each length -1; every method, the
batch-invariant plan, q_len = 4, and a plan run twice with new per-tensor scales; each result checked against
float64 attention over the dequantized cache.

compute-sanitizer --tool memcheck python tools/sanitize_kv8.py
compute-sanitizer --tool racecheck python tools/sanitize_kv8.py

Without a GPU it runs in Triton's interpreter (slowly), which checks the workload itself, not the memory accesses.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fdlib  # noqa: E402
from fdlib import quant, runtime  # noqa: E402

dev = runtime.DEVICE
torch.manual_seed(0)
B, H_q, H_kv, D = 3, 8, 2, 64
L = 300 if dev == "cuda" else 40
METHODS = ("auto", "split", "unified", "persistent", "balanced", "streamk", "naive", "invariant")
worst = 0.0


def check(out, q, kd, vd, lens, what):
    global worst
    if dev == "cuda":
        torch.cuda.synchronize()
    ref, _ = fdlib.reference_attention(q, kd, vd, lens)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, (what, err)
    worst = max(worst, err)


def run_all(q, k8, v8, ks, vs, kd, vd, lens, bt=None, what=""):
    for method in METHODS:
        kw = dict(batch_invariant=True) if method == "invariant" else dict(method=method)
        out = fdlib.decode_attention(q, k8, v8, lens, block_table=bt, k_scale=ks, v_scale=vs, **kw)
        check(out, q, kd, vd, lens, f"{method} {what}")


def nan_past(s, lens, page=0, bt=None):
    """A per-token scale with NaN wherever no key of the batch lies (those entries are never read)."""
    if not isinstance(s, torch.Tensor) or s.dim() != 3:
        return s
    s = s.clone()
    if not page:
        for b, n in enumerate(lens.tolist()):
            s[b, n:] = float("nan")
        return s
    used = torch.zeros(s.shape[:2], dtype=torch.bool, device=s.device)
    for b, n in enumerate(lens.tolist()):
        for j in range(n):
            used[bt[b, j // page], j % page] = True
    s[~used] = float("nan")
    return s


for kv_dtype in (torch.float8_e4m3fn, torch.int8):
    for k_gran, v_gran in (("tensor", "tensor"), ("head", "head"), ("token", "token"), ("token", "head")):
        q = torch.randn(B, H_q, D, device=dev, dtype=torch.float16)
        k, v = (torch.randn(B, L, H_kv, D, device=dev) for _ in range(2))
        (k8, ks), (v8, vs) = quant.quantize_kv(k, kv_dtype, k_gran), quant.quantize_kv(v, kv_dtype, v_gran)
        kd, vd = quant.dequantize_kv(k8, ks, torch.float64), quant.dequantize_kv(v8, vs, torch.float64)
        for lens in ([L, 0, 1], [L // 2 + 1, L, 17]):
            lens = torch.tensor(lens, device=dev, dtype=torch.int32)
            run_all(q, k8, v8, nan_past(ks, lens), nan_past(vs, lens), kd, vd, lens,
                    what=f"{kv_dtype} K:{k_gran} V:{v_gran} lens={lens.tolist()}")
        for page in (4, 16):   # a paged, ragged batch: pool quantized as stored, pages shuffled, -1 past each length
            per = -(-L // page) + 1
            n_pages = B * per + 5
            pools = [torch.randn(n_pages, page, H_kv, D, device=dev) for _ in range(2)]
            (kp, ks), (vp, vs) = quant.quantize_kv(pools[0], kv_dtype, k_gran), quant.quantize_kv(pools[1], kv_dtype,
                                                                                                    v_gran)
            bt = torch.stack([torch.randperm(n_pages, device=dev)[:per] for _ in range(B)]).to(torch.int32)
            lens = torch.tensor([L, 17, 0], device=dev, dtype=torch.int32)
            bt[1, -(-17 // page):] = -1
            bt[2, :] = -1
            idx = bt.long().clamp(0, n_pages - 1)
            kd = quant.dequantize_kv(kp, ks, torch.float64)[idx].reshape(B, per * page, H_kv, D)
            vd = quant.dequantize_kv(vp, vs, torch.float64)[idx].reshape(B, per * page, H_kv, D)
            run_all(q, kp, vp, nan_past(ks, lens, page, bt), nan_past(vs, lens, page, bt), kd, vd, lens, bt,
                    what=f"{kv_dtype} K:{k_gran} V:{v_gran} pages of {page}")
# several query tokens, per-token scales
q4 = torch.randn(B, 4, H_q, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, L, H_kv, D, device=dev) for _ in range(2))
(k8, ks), (v8, vs) = quant.quantize_kv(k, torch.float8_e4m3fn, "token"), quant.quantize_kv(v, torch.float8_e4m3fn,
                                                                                             "token")
kd, vd = quant.dequantize_kv(k8, ks, torch.float64), quant.dequantize_kv(v8, vs, torch.float64)
lens = torch.tensor([L, 2, 5], device=dev, dtype=torch.int32)
for method in ("auto", "unified", "split", "persistent", "streamk", "invariant"):
    kw = dict(batch_invariant=True) if method == "invariant" else dict(method=method)
    out = fdlib.decode_attention(q4, k8, v8, lens, k_scale=ks, v_scale=vs, **kw)
    if dev == "cuda":
        torch.cuda.synchronize()
    ref, _ = fdlib.reference_attention(q4, kd, vd, lens)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, (method, err)
    worst = max(worst, err)
# a plan run twice with new per-tensor scales (a launch argument: replayed launches must take the new one)
p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device=dev, kv_dtype=torch.int8)
q = torch.randn(B, H_q, D, device=dev, dtype=torch.float16)
(k8, ks), (v8, vs) = quant.quantize_kv(k, torch.int8), quant.quantize_kv(v, torch.int8)
for amp in (1.0, 3.0, 1.0):
    out = p.run(q, k8, v8, lens, k_scale=ks * amp, v_scale=vs)
    check(out, q, quant.dequantize_kv(k8, ks * amp, torch.float64), quant.dequantize_kv(v8, vs, torch.float64), lens,
          f"plan.run K scale x{amp}")
print(f"8-bit caches: worst relative error {worst:.2e} ({dev})")
