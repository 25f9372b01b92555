"""A small decode-attention workload for compute-sanitizer (memcheck, racecheck): split, unified and persistent
paths, ragged lengths including 0 and 1 and equal rows (stream-K's shares then cut each into whole pieces),
back-to-back unified calls (ticket counters reused), checked vs float64;
lengths outside 0..L_max on the device (clamped by the kernels, never read past the cache); a plan run with a
smaller batch than planned; a paged, ragged batch (shared and unused pages, pages of 4 and 16) through every
method; q_len = 4; the stream-K and batch-invariant kernels; stream-K over many short rows, each share crossing
several windows of rows (contiguous and paged); packed KV heads (contiguous and paged); a paged plan launching its
sequences longest first, on the batch it was planned for and on a smaller one; a split of more than 256 table
entries.

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
for lens in ([300, 0, 1], [129, 300, 64], [1, 2, 299], [300, 300, 300]):   # equal rows: stream-K's whole pieces
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
# A paged, ragged batch: pages of 16 keys (each tile's table rows read a tile ahead) and of 4 (looked up in the
# tile's own iteration), shuffled, a shared prefix, -1 past each length; every method.
for page in (4, 16):
    per = -(-L // page) + 1                                   # table entries a sequence, one unused
    n_pages = 3 * per + 7
    kp = torch.randn(n_pages, page, H_kv, D, device="cuda", dtype=torch.float16)
    vp = torch.randn(n_pages, page, H_kv, D, device="cuda", dtype=torch.float16)
    bt = torch.stack([torch.randperm(n_pages, device="cuda")[:per] for _ in range(B)]).to(torch.int32)
    bt[1, :8] = bt[0, :8]
    lens = torch.tensor([300, 17, 0], device="cuda", dtype=torch.int32)
    bt[1, -(-17 // page):] = -1
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
# Stream-K over many short rows: six sequences a share, so every share crosses windows of ROW_WINDOW = 4 rows;
# contiguous and in pages of 16 (shuffled).
import fdlib.kernels.streamk as sk  # noqa: E402
P_h = fdlib.plan(8, H_q, H_kv, D, 64, dtype=torch.float16, device="cuda", method="streamk").decision.programs // H_kv
Bm, Lm = 6 * P_h, 304
lens = torch.randint(0, 70, (Bm,), device="cuda", dtype=torch.int32)
lens[3] = Lm
qm = torch.randn(Bm, H_q, D, device="cuda", dtype=torch.float16)
km = torch.randn(Bm, Lm, H_kv, D, device="cuda", dtype=torch.float16)
vm = torch.randn(Bm, Lm, H_kv, D, device="cuda", dtype=torch.float16)
ref, _ = fdlib.reference_attention(qm, km, vm, lens)
order = torch.randperm(Bm * (Lm // page), device="cuda")
btm = order.view(Bm, Lm // page).to(torch.int32)
kpm = torch.empty(Bm * (Lm // page), page, H_kv, D, device="cuda", dtype=torch.float16)
vpm = torch.empty_like(kpm)
kpm[order] = km.reshape(-1, page, H_kv, D)
vpm[order] = vm.reshape(-1, page, H_kv, D)
window = sk.ROW_WINDOW
sk.ROW_WINDOW = 4
try:
    for bt_m, kk, vv in ((None, km, vm), (btm, kpm, vpm)):
        p = fdlib.plan(Bm, H_q, H_kv, D, Lm, dtype=torch.float16, device="cuda", method="streamk",
                       page_size=None if bt_m is None else page)
        out = p.run(qm, kk, vv, lens, block_table=bt_m)
        torch.cuda.synchronize()
        worst = max(worst, ((out.double().cpu() - ref).norm() / ref.norm()).item())
finally:
    sk.ROW_WINDOW = window
# Packed KV heads (two heads of 64 dims read as one of 128): the unified kernel and the two-stage path, one and
# three splits, on the contiguous cache and on the pages of 16 (shared, unused and -1 entries) of the last loop
# above; a query head loads and stores only its own dims.
lens = torch.tensor([300, 0, 1], device="cuda", dtype=torch.int32)
ref, _ = fdlib.reference_attention(q, k, v, lens)
idx = bt.long().clamp(0, kp.shape[0] - 1)
lens_p = torch.tensor([300, 17, 0], device="cuda", dtype=torch.int32)
ref_p, _ = fdlib.reference_attention(q, kp[idx].flatten(1, 2), vp[idx].flatten(1, 2), lens_p)
for method, splits in (("unified", 1), ("unified", 3), ("split", 3)):
    for kk, vv, bt_p, ll, rr in ((k, v, None, lens, ref), (kp, vp, bt, lens_p, ref_p)):
        p = fdlib.plan(B, H_q, H_kv, D, L if bt_p is None else bt.shape[1] * 16, dtype=torch.float16, device="cuda",
                       method=method, num_splits=splits, page_size=None if bt_p is None else 16, pack_heads=True)
        assert p.decision.pack == 2, p
        out = p.run(q, kk, vv, ll, block_table=bt_p)
        torch.cuda.synchronize()
        worst = max(worst, ((out.double().cpu() - rr).norm() / rr.norm()).item())
# Sequences launched longest first (the unified kernel's ORDER_B, asked for with longest_first=True, pages of 16),
# planned for one mix of lengths and run on another (the plan's order fails the kernel's check: each program
# sorts), and planned for the lengths it runs (the order passes it); then each plan on a smaller batch than planned
# (its first two sequences: the order, which lies before the ticket counters, is read for two rows only).
ref_2, _ = fdlib.reference_attention(q[:2], kp[idx[:2]].flatten(1, 2), vp[idx[:2]].flatten(1, 2), lens_p[:2])
for splits, planned in ((1, [17, 300, 0]), (3, [17, 300, 0]), (1, lens_p.tolist()), (3, lens_p.tolist())):
    p = fdlib.plan(B, H_q, H_kv, D, bt.shape[1] * 16, dtype=torch.float16, device="cuda", method="unified",
                   num_splits=splits, page_size=16, lengths=planned, longest_first=True)
    assert p.decision.order == 16, p
    for n, ref_n in ((B, ref_p), (2, ref_2)):
        out = p.run(q[:n], kp, vp, lens_p[:n], block_table=bt[:n])
        torch.cuda.synchronize()
        worst = max(worst, ((out.double().cpu() - ref_n).norm() / ref_n.norm()).item())
# A split of more than 256 table entries (pages of 8, a row of 2100 keys: 263 pages) holds them a block of 256 at a
# time and loads the next block where the last ends.
n_l = 2 * 263 + 3
kl = torch.randn(n_l, 8, H_kv, D, device="cuda", dtype=torch.float16)
vl = torch.randn(n_l, 8, H_kv, D, device="cuda", dtype=torch.float16)
btl = torch.randperm(n_l, device="cuda")[: 2 * 263].view(2, 263).to(torch.int32)
lens_l = torch.tensor([2100, 5], device="cuda", dtype=torch.int32)
ref_l, _ = fdlib.reference_attention(q[:2], kl[btl.long()].flatten(1, 2), vl[btl.long()].flatten(1, 2), lens_l)
p = fdlib.plan(2, H_q, H_kv, D, 263 * 8, dtype=torch.float16, device="cuda", method="unified", num_splits=1,
               page_size=8)
assert p.decision.table_regs == 256, p
out = p.run(q[:2], kl, vl, lens_l, block_table=btl)
torch.cuda.synchronize()
worst = max(worst, ((out.double().cpu() - ref_l).norm() / ref_l.norm()).item())
print(f"sanitize case done, worst relative error {worst:.2e}")
assert worst < 2e-3
