"""A small decode-attention workload for compute-sanitizer (memcheck, racecheck): split, unified and persistent paths,
ragged lengths including 0 and 1, back-to-back unified calls (ticket counters reused), checked vs float64; lengths
outside 0..L_max on the device (clamped by the kernels, never read past the cache); a plan run with a smaller
batch than planned; a paged, ragged batch (shared and unused pages) through every method; q_len = 4; the
stream-K and batch-invariant kernels.

compute-sanitizer --tool memcheck python tools/sanitize_case.py
"""
import torch

import fdlib
from fdlib.kernels.config import persistent_config
from fdlib.kernels.persistent import run_persistent

torch.manual_seed(0)
B, H_q, H_kv, L, D = 3, 8, 2, 300, 64
q = torch.randn(B, H_q, D, device="cuda", dtype=torch.float16)
k = torch.randn(B, L, H_kv, D, device="cuda", dtype=torch.float16)
v = torch.randn(B, L, H_kv, D, device="cuda", dtype=torch.float16)
worst = 0.0
for lens in ([300, 0, 1], [129, 300, 64], [1, 2, 299]):
    lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    ref, _ = fdlib.reference_attention(q, k, v, lens)
    for method, splits in (("split", 3), ("unified", 3), ("unified", 5), ("unified", 1), ("persistent", None),
                           ("streamk", None), ("invariant", None)):
        out = (fdlib.decode_attention(q, k, v, lens, batch_invariant=True) if method == "invariant" else
               fdlib.decode_attention(q, k, v, lens, method=method, num_splits=splits))
        torch.cuda.synchronize()
        worst = max(worst, ((out.double().cpu() - ref).norm() / ref.norm()).item())
    out, lse = torch.empty_like(q), torch.empty(B, H_q, device="cuda")   # the persistent kernel, 3 rows a program
    run_persistent(q, k, v, lens, scale=D ** -0.5, cfg=persistent_config(D), out=out, lse=lse, programs=2)
    torch.cuda.synchronize()
    worst = max(worst, ((out.double().cpu() - ref).norm() / ref.norm()).item())
bad = torch.tensor([L + 1000, -5, 7], device="cuda", dtype=torch.int32)
ref, _ = fdlib.reference_attention(q, k, v, bad.clamp(0, L))
for method, splits in (("split", 3), ("unified", 3), ("persistent", None), ("streamk", None), ("auto", None)):
    p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device="cuda", method=method, num_splits=splits)
    out = p.run(q, k, v, bad)
    torch.cuda.synchronize()
    worst = max(worst, ((out.double().cpu() - ref).norm() / ref.norm()).item())
    assert p.clamped(), method
    small = p.run(q[:2], k[:2], v[:2], bad[:2])                            # B' = 2 < B = 3
    torch.cuda.synchronize()
    worst = max(worst, ((small.double().cpu() - ref[:2]).norm() / ref[:2].norm()).item())
# A paged, ragged batch: pages of 16 keys, shuffled, a shared prefix, -1 past each length; every method.
page, n_pages = 16, 64
kp = torch.randn(n_pages, page, H_kv, D, device="cuda", dtype=torch.float16)
vp = torch.randn(n_pages, page, H_kv, D, device="cuda", dtype=torch.float16)
bt = torch.stack([torch.randperm(n_pages, device="cuda")[:19] for _ in range(B)]).to(torch.int32)
bt[1, :8] = bt[0, :8]
lens = torch.tensor([300, 17, 0], device="cuda", dtype=torch.int32)
bt[1, 2:] = -1
bt[2, :] = -1
idx = bt.long().clamp(0, n_pages - 1)
ref, _ = fdlib.reference_attention(q, kp[idx].flatten(1, 2), vp[idx].flatten(1, 2), lens)
for method in ("split", "unified", "persistent", "balanced", "streamk", "auto"):
    out = fdlib.decode_attention(q, kp, vp, lens, block_table=bt, method=method)
    torch.cuda.synchronize()
    worst = max(worst, ((out.double().cpu() - ref).norm() / ref.norm()).item())
# Four query tokens per sequence (speculative decoding): every method, ragged lengths including one shorter
# than q_len.
q4 = torch.randn(B, 4, H_q, D, device="cuda", dtype=torch.float16)
lens = torch.tensor([300, 2, 129], device="cuda", dtype=torch.int32)
ref, _ = fdlib.reference_attention(q4, k, v, lens)
for method in ("split", "unified", "persistent", "balanced", "streamk", "auto"):
    out = fdlib.decode_attention(q4, k, v, lens, method=method)
    torch.cuda.synchronize()
    worst = max(worst, ((out.double().cpu() - ref).norm() / ref.norm()).item())
print(f"sanitize case done, worst relative error {worst:.2e}")
assert worst < 2e-3
