"""Context-parallel decode on several GPUs (fdlib.distributed): check it, time it against one GPU, time both merges.

    torchrun --nproc-per-node 2 tools/cp_decode_case.py --out OUT
        [--seqlens 2097152,8388608] [--batch 1] [--heads-q 32] [--heads-kv 8] [--head-dim 128] [--dtype bf16]
        [--partials-batch 64] [--partials-seqlen 4096] [--iters 200] [--no-graph] [--cpu]

(option names chosen so torchrun's own abbreviation matching leaves them alone)

Every rank holds a contiguous, as-even-as-possible slice of each sequence's cache (fdlib.distributed.shard_bounds)
and calls fdlib.distributed.decode_attention_cp. Rank 0 prints everything and writes OUT/cp-decode.json and
OUT/cp-decode.md (provenance from fdlib.bench.harness.provenance, plus the world size, every rank's GPU and
NCCL's version), rewritten after every case, so a case that fails (or a run that is killed) keeps the others:

1. correctness of a ragged batch (a sequence only on rank 0, one with a single key on the last rank, an empty
   one; q_len = 1 and q_len = 4) against float64, with both merges, eager and replayed from a CUDA graph; every
   rank must end with the same out;
2. for every L in --seqlens at B = --batch: the whole cache on one GPU (each rank times it on its own GPU)
   against the CP step with 1/world of it on each, with both merges; the step's local decode alone; the merge
   alone (merge_partials) and the bare collective(s) alone (one all_gather of the packed [B, H_q, D + 1]
   float32 partials; all_reduce MAX + all_reduce SUM); eager and under a CUDA graph; median of --iters calls,
   CUDA events around each (under a graph, an op whose one-call graph replays in under 500 µs is captured
   again up to 50 times in one graph, about 1 ms of work, and the replay's time divided by that count, so the
   graph's launch from the host is not counted as the op's); the slowest rank sets each number. Correctness vs
   a float64 reference of the first and last sequence, computed in chunks of keys on rank 0's GPU;
3. --partials-batch (64) at --partials-seqlen: 1 MB of partials per rank at 32 heads, D = 128; the same timings.

Targets (issue 15): speedup >= 1.8x at 2M; the merge collective <= 25 µs at B = 1 under a CUDA graph.
Exit status 1 if a check fails. Run from the repository root (it imports fdlib from there).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fdlib  # noqa: E402  (first of fdlib/triton: decides the runtime)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fdlib.bench.harness import provenance as bench_provenance  # noqa: E402
from fdlib.distributed import MERGES, decode_attention_cp, local_seqlens, merge_partials, shard_bounds  # noqa: E402

DEV = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
OUT_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-5}   # tests/helpers.py's bounds
LSE_ATOL = 1e-3


def args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="2097152,8388608", help="whole-cache lengths, comma list (default 2M,8M)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--partials-batch", type=int, default=64, help="batch of the large-partials case (0: skip)")
    p.add_argument("--partials-seqlen", type=int, default=4096)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph capture and replay")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for cp-decode.json/.md (default $OUT or .)")
    p.add_argument("--name", default="cp-decode", help="file name stem (default cp-decode)")
    p.add_argument("--cpu", action="store_true", help="dry run of this script on the CPU: gloo, Triton's "
                   "interpreter (FDLIB_INTERPRET=1), no graphs, host timers; use tiny shapes")
    return p.parse_args()


def say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def provenance(a, ctrl):
    """fdlib.bench's provenance plus the world, every rank's GPU and NCCL (gathered on the gloo group)."""
    names = [None] * dist.get_world_size()
    gpu = f"{torch.cuda.get_device_name()} (cuda:{torch.cuda.current_device()})" if DEV == "cuda" else "CPU"
    dist.all_gather_object(names, f"rank {dist.get_rank()}: {gpu} on {socket.gethostname()}", group=ctrl)
    cmd = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')} {' '.join(sys.argv)}"
    prov = bench_provenance(cmd)
    nccl = torch.cuda.nccl.version() if DEV == "cuda" else None
    prov.update(world_size=dist.get_world_size(), ranks=names, backend="nccl" if DEV == "cuda" else "gloo",
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl, parsed=vars(a))
    return prov


def problem(B, L, H_q, H_kv, D, dtype, seed, q_len=1):
    """The same whole-cache problem on every rank (seeded generator on the device, drawn in dtype: no float32
    copy of a 32 GiB cache)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    shape_q = (B, H_q, D) if q_len == 1 else (B, q_len, H_q, D)
    q = torch.randn(*shape_q, generator=g, device=DEV, dtype=dtype)
    k = torch.randn(B, L, H_kv, D, generator=g, device=DEV, dtype=dtype)
    v = torch.randn(B, L, H_kv, D, generator=g, device=DEV, dtype=dtype)
    return q, k, v


def my_slice(k, v):
    a, b = shard_bounds(k.shape[1], dist.get_world_size(), dist.get_rank())
    return k[:, a:b].contiguous(), v[:, a:b].contiguous(), a


def reference64(q, k, v, lens, rows=None, chunk=1 << 18):
    """Float64 attention of sequences ``rows`` (default all) over their first lens[b] keys, in chunks of keys
    merged with their running max (an 8M-key cache never exists in float64 at once). q ``[B, H_q, D]`` or
    ``[B, q_len, H_q, D]`` (query t sees keys 0 .. L_b - q_len + t). Returns (out, lse) on the CPU, the rows
    stacked; rows that see no key give 0, -inf."""
    q4 = q[:, None] if q.dim() == 3 else q
    B, T, H_q, D = q4.shape
    H_kv = k.shape[2]
    rows = list(range(B)) if rows is None else rows
    outs, lses = [], []
    for b in rows:
        L = int(lens[b])
        qb = q4[b].double().reshape(T, H_kv, H_q // H_kv, D) / math.sqrt(D)
        m = torch.full((T, H_kv, H_q // H_kv), -math.inf, dtype=torch.float64, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(T, H_kv, H_q // H_kv, D, dtype=torch.float64, device=q.device)
        limit = L - T + torch.arange(T, device=q.device)                     # the last key query t sees
        for a in range(0, L, chunk):
            kc, vc = k[b, a:min(L, a + chunk)].double(), v[b, a:min(L, a + chunk)].double()
            s = torch.einsum("thgd,lhd->thgl", qb, kc)
            j = torch.arange(a, a + kc.shape[0], device=q.device)
            s = s.masked_fill(j[None, None, None, :] > limit[:, None, None, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            ref = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - ref[..., None])
            alpha = torch.exp(m - ref)
            l = l * alpha + p.sum(-1)
            o = o * alpha[..., None] + torch.einsum("thgl,lhd->thgd", p, vc)
            m = m_new
            del kc, vc, s, p
        empty = l == 0
        safe = torch.where(empty, torch.ones_like(l), l)
        ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        outs.append((o / safe[..., None]).reshape(T, H_q, D).cpu())
        lses.append(torch.where(empty, torch.full_like(l, -math.inf), ref + torch.log(safe)).reshape(T, H_q).cpu())
    out, lse = torch.stack(outs), torch.stack(lses)
    return (out[:, 0], lse[:, 0]) if q.dim() == 3 else (out, lse)


def check(name, out, lse, ref, ctrl, rows=None, log=None):
    """Rank 0 compares rows ``rows`` (default all) with the reference; every rank's out must equal rank 0's.
    Returns ok (on every rank); appends a line to ``log``."""
    if rows is not None:
        out, lse = out[rows], lse[rows]
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
        line = (f"{'PASS' if ok else 'FAIL'} {name}: out max row-rel err {err:.2e} (bound {OUT_RTOL[out.dtype]:.0e}), "
                f"lse max abs err {lerr:.2e}, empty rows exact: {bool((o64[empty] == 0).all())}, ranks agree: {same}")
        print("  " + line, flush=True)
        if log is not None:
            log.append(line)
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


def write_out(doc, a):
    """Rank 0 rewrites OUT/NAME.json and .md (called after every case: partial results survive)."""
    if dist.get_rank() != 0:
        return
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
        fh.write("\n")
    with open(os.path.join(a.out, a.name + ".md"), "w") as fh:
        fh.write(format_md(doc) + "\n")


def format_md(doc):
    p = doc["provenance"]
    lines = [f"device: {p['device']} x {p['world_size']} ({p['backend']}, NCCL {p.get('nccl')}) | torch {p['torch']} | "
             f"triton {p['triton']} | fdlib {p['fdlib']} @ {p.get('git_commit')} | {p['date_utc']}",
             f"command: {p['command']}", "", "checks:"] + [f"- {c}" for c in doc["checks"]]
    lines += ["", "µs, median of the slowest rank (eager / CUDA graph); speedup = 1 GPU / CP step", "",
              "| case | B | L | partials KB/rank | 1 GPU, whole cache | CP step allgather | CP step allreduce | "
              "local decode | merge allgather | merge allreduce | all_gather alone | 2x all_reduce alone | "
              "speedup | status |", "|" + "---|" * 14]

    def cell(t, key):
        e, g = t.get(key, {}).get("eager"), t.get(key, {}).get("graph")
        return f"{'—' if e is None else f'{e:.1f}'} / {'—' if g is None else f'{g:.1f}'}"
    for c in doc["cases"]:
        t = c.get("timings", {})
        sp = c.get("speedup", {})
        spt = " / ".join(f"{k} {v:.2f}x" for k, v in sp.items() if v) or "—"
        lines.append(f"| {c['case']} | {c['B']} | {c['L']} | {c.get('partials_kb_per_rank', 0):.1f} | "
                     + " | ".join(cell(t, k) for k in ("single_gpu", "cp_allgather", "cp_allreduce", "local_decode",
                                                        "merge_allgather", "merge_allreduce", "collective_allgather",
                                                        "collective_allreduce"))
                     + f" | {spt} | {c['status']}{': ' + c['reason'] if c.get('reason') else ''} |")
    return "\n".join(lines)


def collective_only(o, lse, merge):
    """The bare collective(s) of one merge on partials shaped like (o, lse), nothing else."""
    B, H_q, D = o.shape
    if merge == "allgather":
        mine = torch.zeros(B, H_q, D + 1, dtype=torch.float32, device=o.device)
        every = torch.empty(dist.get_world_size() * B, H_q, D + 1, dtype=torch.float32, device=o.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(every, mine)
    m = torch.zeros(B, H_q, dtype=torch.float32, device=o.device)
    packed = torch.zeros(B, H_q, D + 1, dtype=torch.float32, device=o.device)
    return lambda: (dist.all_reduce(m, op=dist.ReduceOp.MAX), dist.all_reduce(packed))


def graph_us(fn, reps, label, a, ctrl):
    """µs of one replay of a CUDA graph holding ``reps`` calls of fn (median, slowest rank), or None where a
    capture failed on some rank (every rank then agrees)."""
    try:
        gr, _ = capture(lambda: [fn() for _ in range(reps)][-1])
        captured = True
    except Exception as e:  # noqa: BLE001
        print(f"  rank {dist.get_rank()}: capture of {label} failed: {type(e).__name__}: {e}", flush=True)
        captured = False
    if not all_ok(captured, ctrl):
        return None
    t, _ = time_us(gr.replay, a, ctrl)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, t, group=ctrl)
    return max(every)


def timed(fns, a, ctrl):
    """{label: {"eager": µs, "graph": µs}}: median of a.iters calls (slowest rank), graph replays unless
    --no-graph; a capture that fails costs that graph number only (the same on every rank)."""
    res = {}
    for label, fn in fns.items():
        med, _ = time_us(fn, a, ctrl)
        entry = {"eager": med}
        if not a.no_graph:
            # A short op is captured `reps` times in one graph and each replay's time divided by reps, so the
            # graph launch (several µs from the host) is not counted as the op's: inside a captured decode step
            # the merge runs back to back with the kernels around it. reps comes from a first graph of one call
            # (the eager time is mostly host work, so it would undercount): enough calls for ~1 ms, at most 50.
            t = graph_us(fn, 1, label, a, ctrl)
            reps = 1 if t is None else max(1, min(50, int(1000.0 / max(t, 1.0))))
            if reps > 1:
                t = graph_us(fn, reps, label, a, ctrl)
            if t is not None:
                entry["graph"] = t / reps
                entry["graph_reps"] = reps
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, entry, group=ctrl)
        res[label] = {k: max(e.get(k) or 0.0 for e in every) or None for k in ("eager", "graph")}
        res[label]["graph_reps"] = entry.get("graph_reps")
        say(f"  {label:24s} eager {res[label]['eager']:9.1f} µs   graph "
            f"{'—' if res[label]['graph'] is None else format(res[label]['graph'], '9.1f')} µs")
    return res


def timing_case(doc, a, ctrl, name, B, L, dtype, rows):
    """One timed shape: single GPU vs CP (both merges), the local decode, the merges and bare collectives."""
    case = dict(case=name, B=B, L=L, H_q=a.heads_q, H_kv=a.heads_kv, D=a.head_dim, dtype=a.dtype, status="running",
                partials_kb_per_rank=B * a.heads_q * (a.head_dim + 1) * 4 / 1024)
    doc["cases"].append(case)
    say(f"== {name}: B={B} L={L} {a.heads_q}:{a.heads_kv} D={a.head_dim} {a.dtype}, "
        f"{case['partials_kb_per_rank']:.1f} KB of partials per rank")
    q, k, v = problem(B, L, a.heads_q, a.heads_kv, a.head_dim, dtype, seed=7)
    lens = torch.full((B,), L, device=DEV, dtype=torch.int32)
    cache = {"k": k, "v": v}                         # the whole cache, dropped once sliced and checked
    del k, v
    t = timed({"single_gpu": lambda: fdlib.decode_attention(q, cache["k"], cache["v"], lens, return_lse=True)},
              a, ctrl)
    whole = fdlib.decode_attention(q, cache["k"], cache["v"], lens, return_lse=True)
    k_s, v_s, start = my_slice(cache["k"], cache["v"])
    ref = reference64(q, cache["k"], cache["v"], lens.cpu(), rows) if dist.get_rank() == 0 else None
    cache.clear()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    ok = check(f"{name} single GPU vs float64 (sequences {rows})", *whole, ref, ctrl, rows, doc["checks"])
    step = {f"cp_{m}": (lambda m=m: decode_attention_cp(q, k_s, v_s, cache_seqlens=lens, slice_start=start,
                                                         merge=m, return_lse=True)) for m in MERGES}
    for m in MERGES:
        ok &= check(f"{name} CP {m} vs float64 (sequences {rows})", *step[f"cp_{m}"](), ref, ctrl, rows, doc["checks"])
    sl = local_seqlens(lens, start, start + k_s.shape[1])
    o_r, lse_r = fdlib.decode_attention(q, k_s, v_s, sl, return_lse=True)
    fns = dict(step)
    fns["local_decode"] = lambda: fdlib.decode_attention(q, k_s, v_s, sl, return_lse=True)
    for m in MERGES:
        fns[f"merge_{m}"] = lambda m=m: merge_partials(o_r, lse_r, merge=m)
        fns[f"collective_{m}"] = collective_only(o_r, lse_r, m)
    t.update(timed(fns, a, ctrl))
    case["timings"] = t
    base = t["single_gpu"]
    case["speedup"] = {f"{m} {mode}": (base[mode] / t[f"cp_{m}"][mode]) if base.get(mode) and t[f"cp_{m}"].get(mode)
                       else None for m in MERGES for mode in ("eager", "graph")}
    case["status"] = "ok" if ok else "check failed"
    return ok


def correctness_case(doc, a, ctrl, dtype):
    """Ragged batch, q_len 1 and 4, both merges, eager and CUDA-graph replay."""
    world = dist.get_world_size()
    Lr = 8192 if DEV == "cuda" else 64
    S0 = shard_bounds(Lr, world, 0)[1]
    last = shard_bounds(Lr, world, world - 1)[0]
    lens = torch.tensor([Lr, S0 - min(100, S0 // 2), 0, last + 1], device=DEV, dtype=torch.int32)
    ok = True
    for q_len in (1, 4):
        q, k, v = problem(4, Lr, a.heads_q, a.heads_kv, a.head_dim, dtype, seed=1 + q_len, q_len=q_len)
        k_s, v_s, start = my_slice(k, v)
        ref = reference64(q, k, v, lens.cpu()) if dist.get_rank() == 0 else None
        for m in MERGES:
            name = f"ragged B=4 L={Lr} lens {lens.tolist()} q_len={q_len} merge={m}"
            fn = lambda m=m: decode_attention_cp(q, k_s, v_s, cache_seqlens=lens, slice_start=start, merge=m,  # noqa: E731
                                                 return_lse=True)
            ok &= check(name + " eager", *fn(), ref, ctrl, log=doc["checks"])
            if not a.no_graph:
                try:
                    g, (go, gl) = capture(fn)
                    captured = True
                except Exception as e:  # noqa: BLE001
                    print(f"  rank {dist.get_rank()}: CUDA-graph capture failed: {type(e).__name__}: {e}", flush=True)
                    captured = False
                if all_ok(captured, ctrl):
                    go.zero_()
                    g.replay()
                    torch.cuda.synchronize()
                    ok &= check(name + " CUDA-graph replay", go, gl, ref, ctrl, log=doc["checks"])
                else:
                    doc["checks"].append(f"FAIL {name}: CUDA-graph capture failed on some rank")
                    ok = False
    return ok


def guarded(doc, a, ctrl, label, fn):
    """Run one case; an exception on any rank is recorded and the run goes on (every rank agrees)."""
    try:
        good, err = bool(fn()), None
    except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
        good, err = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        print(f"  rank {dist.get_rank()}: {label} raised {err}", flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err, group=ctrl)
    errs = [e for e in errs if e]
    if errs:
        if doc["cases"] and doc["cases"][-1].get("status") == "running":
            doc["cases"][-1].update(status="error", reason=errs[0])
        doc["checks"].append(f"FAIL {label}: {errs[0]}")
    write_out(doc, a)
    return good and not errs


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
    dtype = DTYPES[a.dtype]
    doc = {"schema": "fdlib.cp_decode/1", "kind": "cp-decode", "provenance": provenance(a, ctrl), "checks": [],
           "cases": [], "targets": {"speedup_at_2M": 1.8, "merge_collective_graph_us_at_B1": 25.0}}
    say(format_md(doc).split("\n\n")[0])
    ok = guarded(doc, a, ctrl, "correctness (ragged, q_len 1 and 4, both merges)",
                 lambda: correctness_case(doc, a, ctrl, dtype))
    for L in (int(x) for x in a.seqlens.split(",") if x.strip()):
        rows = sorted({0, a.batch - 1})
        ok &= guarded(doc, a, ctrl, f"B={a.batch} L={L}",
                      lambda L=L, rows=rows: timing_case(doc, a, ctrl, f"B={a.batch} L={L}", a.batch, L, dtype, rows))
    if a.partials_batch:
        B, L = a.partials_batch, a.partials_seqlen
        ok &= guarded(doc, a, ctrl, f"B={B} L={L} (large partials)",
                      lambda: timing_case(doc, a, ctrl, f"B={B} L={L} (large partials)", B, L, dtype, [0, B - 1]))
    good = all_ok(ok, ctrl)
    doc["all_checks_passed"] = good
    write_out(doc, a)
    say(format_md(doc))
    say(f"== {'ALL CHECKS PASSED' if good else 'SOME CHECK FAILED'}; wrote {os.path.join(a.out, a.name)}.json/.md")
    dist.destroy_process_group()
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
