"""A small work-list workload for compute-sanitizer (memcheck, racecheck): the schedule kernel and the unified
kernel over its list, contiguous and over shuffled pages of 8, ragged lengths with 0 and 1, lengths outside
0..L_max (clamped on the device), a call with fewer sequences than planned, a batch of 300 rows (several
schedule programs, ties across their blocks), back-to-back calls with new lengths in the same tensor, and the
batch-invariant plan; every output checked against float64.

compute-sanitizer --tool memcheck python tools/sanitize_worklist.py
"""
import torch

import fdlib

torch.manual_seed(0)
worst = 0.0


def check(out, q, k, v, lens):
    global worst
    ref, _ = fdlib.reference_attention(q, k, v, lens.clamp(0, k.shape[1]))
    worst = max(worst, (out.float().cpu() - ref.float()).abs().max().item())


H_q, H_kv, D, L = 8, 2, 64, 600
for B, lens in ((3, [600, 0, 1]), (5, [129, 600, 64, 1, 333]), (300, [(37 * b) % 601 for b in range(300)])):
    q = torch.randn(B, H_q, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, L, H_kv, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, L, H_kv, D, device="cuda", dtype=torch.float16)
    lens_d = torch.tensor(lens, device="cuda", dtype=torch.int32)
    for inv in (False, True):
        p = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device="cuda", method="worklist", num_splits=5,
                       batch_invariant=inv)
        check(p.run(q, k, v, lens_d), q, k, v, lens_d)
        lens_d.copy_(lens_d.flip(0))                         # new lengths in the same tensor
        check(p.run(q, k, v, lens_d), q, k, v, lens_d)
        if B > 1:
            check(p.run(q[:2], k[:2], v[:2], lens_d[:2]), q[:2], k[:2], v[:2], lens_d[:2])   # fewer rows than planned
    bad = lens_d.clone()
    bad[0] = L + 50
    if B > 1:
        bad[1] = -3
    check(p.run(q, k, v, bad), q, k, v, bad)
    # over shuffled pages of 8
    page = 8
    n = B * L // page
    perm = torch.randperm(n, device="cuda")
    kp, vp = torch.empty(n, page, H_kv, D, device="cuda", dtype=torch.float16), torch.empty_like(k).view(n, page, H_kv, D)
    kp[perm] = k.reshape(n, page, H_kv, D)
    vp[perm] = v.reshape(n, page, H_kv, D)
    bt = perm.reshape(B, L // page).to(torch.int32)
    pp = fdlib.plan(B, H_q, H_kv, D, L, dtype=torch.float16, device="cuda", method="worklist", page_size=page)
    check(pp.run(q, kp, vp, lens_d, block_table=bt), q, k, v, lens_d)
torch.cuda.synchronize()
print(f"worklist sanitizer workload done, worst abs error {worst:.2e}")
assert worst < 2e-2, worst
