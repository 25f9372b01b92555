"""Quick GPU correctness smoke: every method, several dtypes/head dims/groups, ragged lengths, vs float64."""
import sys

import torch

import fdlib

torch.manual_seed(0)
bad = 0
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    for (B, Hq, Hkv, L, D) in [(3, 32, 8, 3000, 128), (2, 28, 4, 777, 80), (2, 12, 12, 513, 96), (1, 8, 1, 40000, 64),
                               (2, 16, 2, 1000, 256), (4, 6, 2, 1, 128)]:
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype)
        lens = torch.randint(0, L + 1, (B,), device="cuda", dtype=torch.int32)
        lens[0] = L
        ro, rl = fdlib.reference_attention(q, k, v, lens)
        for method, ns in [("naive", None), ("split", None), ("split", 1), ("split", 7), ("unified", None),
                           ("unified", 1), ("unified", 5), ("auto", None)]:
            o, l = fdlib.decode_attention(q, k, v, lens, method=method, num_splits=ns, return_lse=True)
            err = ((o.double().cpu() - ro).norm() / ro.norm()).item()
            fin = torch.isfinite(rl)
            lerr = (l.double().cpu()[fin] - rl[fin]).abs().max().item()
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-4}[dtype]
            ok = err < tol and lerr < 1e-2 and torch.equal(torch.isinf(l.cpu()), torch.isinf(rl))
            bad += not ok
            if not ok:
                print("BAD", dtype, (B, Hq, Hkv, L, D), method, ns, f"{err:.2e} {lerr:.2e}", flush=True)
print("smoke:", "all good" if bad == 0 else f"{bad} failures", flush=True)
sys.exit(1 if bad else 0)
