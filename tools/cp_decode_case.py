"""Context-parallel decode on several GPUs (fdlib.distributed): check it, then time one step. GPU + NCCL only.

    torchrun --nproc-per-node 2 tools/cp_decode_case.py [--seqlen 262144] [--batch 1] [--heads-q 32]
        [--heads-kv 8] [--head-dim 128] [--dtype fp16] [--iters 200] [--no-graph]

(option names chosen so torchrun's own abbreviation matching leaves them alone)

Every rank holds a contiguous, as-even-as-possible slice of each sequence's cache (fdlib.distributed.
shard_bounds) and calls fdlib.distributed.decode_attention_cp; rank 0 prints everything:

1. provenance: date, command, host, GPUs, torch / CUDA / NCCL / triton / fdlib versions, git commit;
2. correctness, against a float64 reference of the whole cache computed on rank 0's GPU (and against
   single-GPU fdlib.decode_attention on the whole cache): the timed shape at full length, then a ragged batch
   (a sequence only on rank 0, one with a single key on the last rank, an empty one), eager and, unless
   --no-graph, replayed from a CUDA graph; every rank must end with the same out;
3. time per step, CUDA events around each call (median, and mean; µs): the whole CP step, its local decode
   alone, its merge alone (2 all_reduce + a few elementwise kernels) and the merge's share of the step; the
   single-GPU decode of the whole cache on each rank's GPU for comparison; with CUDA graphs, the step and the
   merge replayed from a graph (no launch gaps).

Exit status 1 if a check fails. Run from the repository root (it imports fdlib from there).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fdlib  # noqa: E402  (first of fdlib/triton: decides the runtime)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402

from fdlib.distributed import decode_attention_cp, local_seqlens, merge_partials, shard_bounds  # noqa: E402

DEV = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
OUT_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-5}   # tests/helpers.py's bounds
LSE_ATOL = 1e-3


def args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=262144, help="whole-cache length, split across the ranks")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph capture and replay")
    p.add_argument("--cpu", action="store_true", help="dry run of this script on the CPU: gloo, Triton's "
                   "interpreter (FDLIB_INTERPRET=1), no graphs, host timers; use tiny shapes")
    return p.parse_args()


def say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def provenance(a, ctrl):
    names = [None] * dist.get_world_size()
    gpu = f"{torch.cuda.get_device_name()} (cuda:{torch.cuda.current_device()})" if DEV == "cuda" else "CPU"
    dist.all_gather_object(names, f"rank {dist.get_rank()}: {gpu} on {socket.gethostname()}", group=ctrl)
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown (no git)"
    nccl = torch.cuda.nccl.version() if DEV == "cuda" else "- (gloo)"
    say("== provenance")
    say(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    say(f"command: torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')} "
        f"{' '.join(sys.argv)}   (world size {dist.get_world_size()}, cwd {os.getcwd()})")
    say(f"parsed: {vars(a)}")
    say(f"host: {socket.gethostname()} | python {platform.python_version()} | torch {torch.__version__} | "
        f"CUDA {torch.version.cuda} | NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl} | "
        f"triton {triton.__version__} | fdlib {fdlib.__version__} @ {commit}")
    say(fdlib.describe())
    for n in names:
        say(f"  {n}")


def problem(B, L, H_q, H_kv, D, dtype, seed):
    """The same whole-cache problem on every rank (seeded generator on the GPU)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H_q, D, generator=g, device=DEV).to(dtype)
    k = torch.randn(B, L, H_kv, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(B, L, H_kv, D, generator=g, device=DEV).to(dtype)
    return q, k, v


def my_slice(k, v, lens):
    a, b = shard_bounds(k.shape[1], dist.get_world_size(), dist.get_rank())
    return k[:, a:b].contiguous(), v[:, a:b].contiguous(), local_seqlens(lens, a, b), (a, b)


def reference64(q, k, v, lens):
    """Float64 attention over the whole cache on this GPU: (out [B, H_q, D], lse [B, H_q]); empty rows 0, -inf."""
    B, H_q, D = q.shape
    H_kv = k.shape[2]
    qg = q.double().reshape(B, H_kv, H_q // H_kv, D)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k.double()) / math.sqrt(D)
    keep = torch.arange(k.shape[1], device=q.device)[None, :] < lens[:, None].long()
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("bhgl,blhd->bhgd", p, v.double().masked_fill(~keep[:, :, None, None], 0))
    return o.reshape(B, H_q, D), lse.reshape(B, H_q)


def check(name, out, lse, ref, ctrl):
    """Rank 0 compares with the reference; every rank's out must equal rank 0's. Returns ok (on every rank)."""
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, (out.cpu(), lse.cpu()), group=ctrl)
    ok = True
    if dist.get_rank() == 0:
        ro, rl = ref
        ro, rl = ro.cpu(), rl.cpu()
        o64, l64 = out.double().cpu(), lse.double().cpu()
        empty = torch.isneginf(rl)
        den = ro.abs().amax(-1).clamp_min(1e-30)
        err = ((o64 - ro).abs().amax(-1) / den).max().item()
        fin = ~empty
        lerr = (l64[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
        same = all(torch.equal(o.cpu(), outs[0][0]) and torch.equal(l.cpu(), outs[0][1]) for o, l in outs)
        ok = (err <= OUT_RTOL[out.dtype] and lerr <= LSE_ATOL and torch.equal(torch.isneginf(l64), empty)
              and bool((o64[empty] == 0).all()) and same and bool(torch.isfinite(o64).all()))
        print(f"  {'PASS' if ok else 'FAIL'} {name}: out max row-rel err {err:.2e} (bound {OUT_RTOL[out.dtype]:.0e}), "
              f"lse max abs err {lerr:.2e}, empty rows exact: {bool((o64[empty] == 0).all())}, "
              f"ranks agree: {same}", flush=True)
    flag = [ok]
    dist.broadcast_object_list(flag, src=0, group=ctrl)
    return flag[0]


def capture(fn):
    """A CUDA graph of fn() (warmed up on a side stream first) and its outputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn()
    return g, res


def all_ok(ok, ctrl):
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok), group=ctrl)
    return all(flags)


def time_us(fn, a, ctrl):
    """(median, mean) µs of fn over a.iters calls, CUDA events around each call; ranks start together."""
    for _ in range(a.warmup):
        fn()
    if DEV == "cpu":                                 # --cpu dry run: host clock
        dist.barrier(group=ctrl)
        t = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
        t.sort()
        return t[len(t) // 2], sum(t) / len(t)
    torch.cuda.synchronize()
    dist.barrier(group=ctrl)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
    return t[len(t) // 2], sum(t) / len(t)


def main():
    global DEV
    a = args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(minutes=5)
    if a.cpu:
        DEV, a.no_graph = "cpu", True
        dist.init_process_group("gloo", timeout=timeout)
    else:
        if fdlib.runtime.INTERPRET or not torch.cuda.is_available():
            sys.exit("cp_decode_case.py: needs CUDA GPUs with compiled Triton kernels (or --cpu for a dry run)")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timeout)
    ctrl = dist.new_group(backend="gloo")            # host-side flags and prints: never blocked by a GPU stream
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[a.dtype]
    provenance(a, ctrl)
    ok = True

    # --- correctness: the timed shape at full length
    say(f"== correctness ({world} ranks, contiguous slices from fdlib.distributed.shard_bounds)")
    q, k, v = problem(a.batch, a.seqlen, a.heads_q, a.heads_kv, a.head_dim, dtype, seed=0)
    lens = torch.full((a.batch,), a.seqlen, device=DEV, dtype=torch.int32)
    k_s, v_s, sl, (lo, hi) = my_slice(k, v, lens)
    bounds = [None] * world
    dist.all_gather_object(bounds, (lo, hi), group=ctrl)
    say(f"  slices: {bounds}")
    out, lse = decode_attention_cp(q, k_s, v_s, sl, return_lse=True)
    ref = reference64(q, k, v, lens) if rank == 0 else None
    ok &= check(f"B={a.batch} H {a.heads_q}:{a.heads_kv} D={a.head_dim} L={a.seqlen} {a.dtype} CP vs float64", out, lse, ref, ctrl)
    single = fdlib.decode_attention(q, k, v, lens, return_lse=True)
    ok &= check("same shape, single-GPU decode_attention vs float64", *single, ref, ctrl)
    del ref

    # --- correctness: ragged lengths, eager and from a CUDA graph
    Lr = min(8192, a.seqlen)
    S0 = shard_bounds(Lr, world, 0)[1]
    last = shard_bounds(Lr, world, world - 1)[0]
    qr, kr, vr = problem(4, Lr, a.heads_q, a.heads_kv, a.head_dim, dtype, seed=1)
    lens_r = torch.tensor([Lr, S0 - min(100, S0 // 2), 0, last + 1], device=DEV, dtype=torch.int32)
    kr_s, vr_s, slr, _ = my_slice(kr, vr, lens_r)
    ref_r = reference64(qr, kr, vr, lens_r) if rank == 0 else None
    name = f"ragged B=4 L={Lr} lens {lens_r.tolist()}"
    ok &= check(name + " eager", *decode_attention_cp(qr, kr_s, vr_s, slr, return_lse=True), ref_r, ctrl)
    if not a.no_graph:
        try:
            g, (go, gl) = capture(lambda: decode_attention_cp(qr, kr_s, vr_s, slr, return_lse=True))
            captured = True
        except Exception as e:   # noqa: BLE001  (reported, then the graph parts are skipped on every rank)
            print(f"  rank {rank}: CUDA-graph capture of the CP step failed: {type(e).__name__}: {e}", flush=True)
            captured = False
        if all_ok(captured, ctrl):
            go.zero_()
            g.replay()
            torch.cuda.synchronize()
            ok &= check(name + " CUDA-graph replay", go, gl, ref_r, ctrl)
        else:
            say("  CUDA-graph capture failed on some rank: graph checks and timings skipped")
            a.no_graph = True
    del ref_r

    # --- timing
    say(f"== time per step, µs (median / mean of {a.iters}, "
        f"{'CUDA events' if DEV == 'cuda' else 'host clock (--cpu dry run: meaningless numbers)'} around each call)")
    o_r, lse_r = fdlib.decode_attention(q, k_s, v_s, sl, return_lse=True)
    rows = {
        "CP step (decode_attention_cp)": lambda: decode_attention_cp(q, k_s, v_s, sl, return_lse=True),
        "  its local decode": lambda: fdlib.decode_attention(q, k_s, v_s, sl, return_lse=True),
        "  its merge (merge_partials)": lambda: merge_partials(o_r, lse_r),
        "single GPU, whole cache": lambda: fdlib.decode_attention(q, k, v, lens, return_lse=True),
    }
    if not a.no_graph:
        for label, fn in (("CP step, CUDA-graph replay", rows["CP step (decode_attention_cp)"]),
                          ("  its merge, CUDA-graph replay", rows["  its merge (merge_partials)"])):
            gr, _ = capture(fn)
            rows[label] = gr.replay
    res = {label: time_us(fn, a, ctrl) for label, fn in rows.items()}
    every = [None] * world
    dist.all_gather_object(every, res, group=ctrl)
    say(f"  {'':34s}" + "".join(f"{'rank ' + str(r):>20s}" for r in range(world)))
    for label in res:
        say(f"  {label:34s}" + "".join(f"{e[label][0]:10.1f} /{e[label][1]:8.1f}" for e in every))
    med = {label: max(e[label][0] for e in every) for label in res}     # the slowest rank sets the step
    say(f"  merge share of the eager step: {med['  its merge (merge_partials)'] / med['CP step (decode_attention_cp)']:.0%}"
        f"; speedup over one GPU (eager medians): "
        f"{med['single GPU, whole cache'] / med['CP step (decode_attention_cp)']:.2f}x")
    if not a.no_graph:
        say(f"  merge share of the graph step: "
            f"{med['  its merge, CUDA-graph replay'] / med['CP step, CUDA-graph replay']:.0%}")
    good = all_ok(ok, ctrl)
    say(f"== {'ALL CHECKS PASSED' if good else 'SOME CHECK FAILED'}")
    dist.destroy_process_group()
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
