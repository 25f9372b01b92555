r"""``python -m fdlib.bench --qlen``: several query tokens per sequence (speculative decoding's verify step).

q is ``[B, q_len, H_q, D]`` against a cache of L keys per sequence that already holds the q_len new tokens;
query t sees keys 0 … L − q_len + t (the causal mask aligned **bottom-right**, ``flash_attn_with_kvcache``'s
convention). The bytes a step reads, 2·B·H_kv·L·D·elem, do not depend on q_len, so on memory-bound shapes
the time should not either: the target is time(q_len = 4) / time(q_len = 1) ≤ 1.15 for L ≥ 8k.

Contenders, timed as in the dense bench (:mod:`fdlib.bench.timing`: eager with the L2 flushed, CUDA graphs
rotating over copies of the inputs that hold ≥ 4× the L2):

* ``fdlib``: ``fdlib.decode_attention(q, k, v, lens)`` with ``method="auto"`` (q 3-D at q_len = 1);
* ``cudnn``, ``fa2``: ``F.scaled_dot_product_attention`` under ``SDPBackend.CUDNN_ATTENTION`` /
  ``FLASH_ATTENTION`` (q ``[B, H_q, q_len, D]``, K/V ``[B, H_kv, L, D]``, ``enable_gqa``). Each gets the
  correct mask in the best form it takes, and the record says which (``mask``):

  - ``none (q_len = 1)``: one query sees every key, no mask is needed;
  - ``is_causal`` where the backend's own causal flag is aligned bottom-right (probed on a small problem in
    the same run, :func:`is_causal_alignment`; SDPA documents top-left alignment, which is wrong here);
  - ``bottom-right bool mask``: an explicit ``attn_mask [1, 1, q_len, L]`` (:func:`bottom_right_mask`);
  - ``no mask (not causal)``: a backend that takes neither (FlashAttention through SDPA): timed on the
    non-causal problem as an upper bound on its speed, checked against the non-causal reference, and marked
    ``"semantics": "non-causal"``; it does not compute the verify step.

Correctness first, on samples: the first and last sequence of every shape against float64 attention with the
same mask semantics (:func:`reference_sample`); a contender at or above 1e-2 relative error is not timed.
"""
from __future__ import annotations

import math

import torch

from .. import runtime
from .harness import DTYPES, Progress, provenance, rel_error
from .timing import Rotating, copies_for_l2, free_memory, synchronize, time_eager, time_graph

QLENS = (1, 2, 4, 8)
QLEN_SHAPES = ((1, 131072), (16, 8192), (1, 8192), (4, 8192), (1, 32768), (4, 32768))
"""(B, L) pairs: the issue's two shapes, then L = 8k and 32k at B = 1 and 4."""
QLEN_GRID = dict(shapes=QLEN_SHAPES, heads=(32, 8), D=128, dtype="float16", qlens=QLENS)
QUICK_QLEN = dict(shapes=((2, 40), (1, 64)), heads=(4, 2), D=32, dtype="float16", qlens=(1, 2, 4))
QLEN_METHODS = ("fdlib", "cudnn", "fa2")
PEER_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "fa2": "FLASH_ATTENTION"}
TARGET_RATIO, TARGET_MIN_L, TARGET_QLEN = 1.15, 8192, 4
TOL = 1e-2


# ----------------------------------------------------------------------------------------------- the mask
def bottom_right_mask(q_len: int, L: int, device=None) -> torch.Tensor:
    """Bool ``[q_len, L]``: True where query t may see key j, i.e. j ≤ L − q_len + t (the new tokens are the
    cache's last q_len entries). Row t has L − q_len + 1 + t Trues (at least 0)."""
    t = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    return j <= L - q_len + t


def reference_sample(q, k, v, rows, causal=True):
    """Float64 ``out [len(rows), q_len, H_q, D]`` of sequences ``rows`` (q ``[B, q_len, H_q, D]``, K/V
    ``[B, L, H_kv, D]``, every sequence L long), bottom-right causal or (``causal=False``) every key seen."""
    _, T, H_q, D = q.shape
    L, H_kv = k.shape[1], k.shape[2]
    group = H_q // H_kv
    outs = []
    for b in rows:
        qb = q[b].double().reshape(T, H_kv, group, D)
        s = torch.einsum("thgd,lhd->hgtl", qb, k[b].double()) / math.sqrt(D)          # [H_kv, group, T, L]
        if causal:
            s = s.masked_fill(~bottom_right_mask(T, L, q.device), float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("hgtl,lhd->thgd", p, v[b].double())
        outs.append(o.reshape(T, H_q, D))
        del s, p
    return torch.stack(outs)


# ----------------------------------------------------------------------------------------------- contenders
def is_causal_alignment(backend_name: str) -> str:
    """How SDPA's ``is_causal=True`` is aligned under ``backend_name`` when q_len < L: "bottom-right",
    "top-left", "refused" (the backend runs, but not with is_causal at q_len < L), or "unavailable: <why>"
    (the backend does not run at all). Probed on a small fp16 problem on this device."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev, dt = runtime.DEVICE, torch.float16 if runtime.MODE == "gpu" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=g, device=dev, dtype=dt)
    k = torch.randn(1, 2, 17, 64, generator=g, device=dev, dtype=dt)
    v = torch.randn(1, 2, 17, 64, generator=g, device=dev, dtype=dt)
    try:
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True).double()
    except Exception as e:  # noqa: BLE001 - a backend this device or torch lacks
        try:    # is_causal refused at q_len < L; does the backend run without it?
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                F.scaled_dot_product_attention(q, k, v)
            return "refused"
        except Exception:  # noqa: BLE001
            return f"unavailable: {type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
    ref = {}
    for name, mask in (("bottom-right", bottom_right_mask(3, 17, dev)), ("top-left", torch.ones(3, 17, dtype=torch.bool,
                                                                                                device=dev).tril())):
        s = (q.double() @ k.double().transpose(-1, -2) / 8.0).masked_fill(~mask, float("-inf"))
        ref[name] = torch.softmax(s, -1) @ v.double()
    return min(ref, key=lambda n: float((got - ref[n]).abs().max()))


def _fdlib_call(q4, k, v, lens):
    import fdlib
    q = q4[:, 0] if q4.shape[1] == 1 else q4
    return lambda: fdlib.decode_attention(q, k, v, lens)


def _peer_plan(name: str, T: int, alignment: str) -> tuple[str, str]:
    """(mask form, semantics) the peer ``name`` is given at q_len = T."""
    if T == 1:
        return "none (q_len = 1)", "causal"
    if alignment == "bottom-right":
        return "is_causal", "causal"
    if name == "fa2":
        return "no mask (not causal)", "non-causal"
    return "bottom-right bool mask", "causal"


def _peer_call(name, q4, k_bhld, v_bhld, mask_form):
    import torch.nn.functional as F
    q = q4.transpose(1, 2)                                            # [B, H_q, T, D]
    kw = {"enable_gqa": True} if q.shape[1] != k_bhld.shape[1] else {}
    if mask_form == "is_causal":
        kw["is_causal"] = True
    elif mask_form == "bottom-right bool mask":
        kw["attn_mask"] = bottom_right_mask(q.shape[2], k_bhld.shape[2], q.device)[None, None]
    return lambda: F.scaled_dot_product_attention(q, k_bhld, v_bhld, **kw).transpose(1, 2)   # [B, T, H_q, D]


# ----------------------------------------------------------------------------------------------- the run
def run_qlen(shapes=None, heads=None, D=None, dtype=None, qlens=None, methods=None, quick=False, graphs=None,
             warmup_ms=None, rep_ms=None, graph_rep_ms=None, seed=0, max_kv_gb=20.0, progress=True,
             command=None) -> dict:
    """Time every contender at every q_len on every (B, L); a results dict of kind ``"qlen"`` with the
    records and, per shape and contender, time(q_len) / time(q_len = 1) (``ratios``)."""
    grid = dict(QUICK_QLEN if quick else QLEN_GRID)
    for key, val in (("shapes", shapes), ("heads", heads), ("D", D), ("dtype", dtype), ("qlens", qlens)):
        if val:
            grid[key] = val
    if grid["dtype"] not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {grid['dtype']!r}")
    qls = tuple(sorted(set(int(x) for x in grid["qlens"])))
    if not qls or qls[0] < 1 or qls[-1] > 16:
        raise ValueError(f"qlens: expected q_len values from 1 to 16, got {list(grid['qlens'])}")
    methods = tuple(methods or QLEN_METHODS)
    bad = [m for m in methods if m not in QLEN_METHODS]
    if bad:
        raise ValueError(f"methods: unknown {bad}; expected some of {', '.join(QLEN_METHODS)}")
    H_q, H_kv = grid["heads"]
    Dh, dt = grid["D"], DTYPES[grid["dtype"]]
    gpu = runtime.MODE == "gpu"
    settings = {"graphs": gpu and graphs is not False, "warmup_ms": warmup_ms or (5 if quick else 25),
                "rep_ms": rep_ms or (10 if quick else 100), "graph_rep_ms": graph_rep_ms or (5 if quick else 20),
                "cpu_runs": 1, "qlens": list(qls), "heads": [H_q, H_kv], "D": Dh, "dtype": grid["dtype"],
                "tolerance": TOL, "target": f"time(q_len={TARGET_QLEN}) / time(q_len=1) <= {TARGET_RATIO} "
                                            f"for L >= {TARGET_MIN_L}",
                "l2_handling": "eager: 256 MB zero-fill before each call; graphs: rotate over copies holding >= 4x L2"}
    alignment = {n: is_causal_alignment(PEER_BACKENDS[n]) for n in methods if n in PEER_BACKENDS}
    settings["is_causal_alignment"] = alignment
    records, skipped = [], []
    bar = Progress(len(grid["shapes"]) * len(qls), "fdlib.bench --qlen", progress)
    for i, (B, L) in enumerate(grid["shapes"]):
        kv_bytes = 2 * B * H_kv * L * Dh * dt.itemsize
        base = dict(B=int(B), L=int(L), H_q=H_q, H_kv=H_kv, D=Dh, dtype=grid["dtype"], kv_mb=kv_bytes / 1e6)
        if kv_bytes > max_kv_gb * 1e9:
            skipped.append(dict(base, reason=f"KV {kv_bytes / 1e9:.1f} GB > {max_kv_gb} GB"))
            continue
        try:
            records.extend(_run_shape(base, qls, methods, alignment, settings, seed + i, bar))
        except Exception as e:  # noqa: BLE001 - e.g. no memory for this shape's inputs: the others go on
            records.append(dict(base, method="*", q_len=None, status="error", reason=f"{type(e).__name__}: {e}"[:300]))
            free_memory()
    bar.close()
    return {"schema": "fdlib.bench/1", "kind": "qlen", "provenance": provenance(command), "settings": settings,
            "records": records, "skipped": skipped, "ratios": ratios(records)}


def _run_shape(base, qls, methods, alignment, settings, seed, bar):
    dev, dt = runtime.DEVICE, DTYPES[base["dtype"]]
    B, L, H_q, H_kv, D = (base[k] for k in ("B", "L", "H_q", "H_kv", "D"))
    g = torch.Generator(device=dev).manual_seed(seed)
    k = torch.randn(B, L, H_kv, D, generator=g, device=dev, dtype=dt)
    v = torch.randn(B, L, H_kv, D, generator=g, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    n = copies_for_l2(int(base["kv_mb"] * 1e6)) if settings["graphs"] else 1
    kv = [(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)]
    peers = [m for m in methods if m in PEER_BACKENDS]
    kv_bhld = [(a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()) for a, b in kv] if peers else []
    rows = sorted({0, B - 1})
    out = []
    for T in qls:
        q = torch.randn(B, T, H_q, D, generator=g, device=dev, dtype=dt)
        refs = {}
        for name in methods:
            rec = dict(base, method=name, q_len=T, status="ok", l2_copies=n)
            if name == "fdlib":
                rec.update(mask="in-kernel (bottom-right)", semantics="causal")
                calls = [_fdlib_call(q, a, b, lens) for a, b in kv]
                context = None
            else:
                mask_form, sem = _peer_plan(name, T, alignment[name])
                rec.update(mask=mask_form, semantics=sem, backend=f"SDPBackend.{PEER_BACKENDS[name]}")
                if alignment[name].startswith("unavailable"):
                    out.append(dict(rec, status="unavailable", reason=alignment[name][len("unavailable: "):]))
                    continue
                if runtime.MODE != "gpu":
                    rec["note"] = "no GPU: torch's CPU implementation behind this backend flag, not the CUDA kernel"
                calls = [_peer_call(name, q, a, b, mask_form) for a, b in kv_bhld]
                context = _backend_context(PEER_BACKENDS[name])
            sem = rec["semantics"]
            if sem not in refs:
                refs[sem] = reference_sample(q, k, v, rows, causal=sem == "causal")
            out.append(_measure(rec, calls, context, refs[sem], rows, settings))
        bar.update(f"B={B} L={L} q_len={T}")
        del q, refs
        free_memory()
    del kv, kv_bhld
    free_memory()
    return out


def _backend_context(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return lambda: sdpa_kernel(getattr(SDPBackend, backend_name))


def _measure(rec, calls, context, ref, rows, settings):
    from contextlib import nullcontext
    ctx = context or nullcontext
    try:
        with ctx():
            o = calls[0]()
            synchronize()
        if o.dim() == 3:
            o = o[:, None]
        rec["rel_err"] = rel_error(o[rows], ref)
        del o
        if not math.isfinite(rec["rel_err"]) or rec["rel_err"] >= TOL:
            return dict(rec, status="failed", reason=f"relative error {rec['rel_err']:.3g} >= {TOL}; not timed")
        rec["eager_us"] = time_eager(calls[0], settings["warmup_ms"], settings["rep_ms"], settings["cpu_runs"],
                                     context=ctx)
        if settings["graphs"]:
            try:
                rec["graph_us"] = time_graph(Rotating(calls), settings["graph_rep_ms"], context=ctx)
            except Exception as e:  # noqa: BLE001 - a capture failure costs the graph column only
                rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - one contender's failure is recorded, the run goes on
        free_memory()
        return dict(rec, status="error", reason=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300])
    t = rec.get("graph_us") or rec["eager_us"]
    rec["tbs"] = rec["kv_mb"] / t
    return rec


def ratios(records) -> list[dict]:
    """Per (B, L, contender): its time at every q_len over its time at q_len = 1 (graph timings where every
    point has one, else eager), and whether the q_len = 4 target is met (L ≥ 8k only)."""
    by = {}
    for r in records:
        if r.get("status") == "ok" and r.get("q_len"):
            by.setdefault((r["B"], r["L"], r["method"]), {})[r["q_len"]] = r
    out = []
    for (B, L, m), pts in by.items():
        if 1 not in pts:
            continue
        timing = "graph" if all(p.get("graph_us") for p in pts.values()) else "eager"
        base = pts[1][f"{timing}_us"]
        row = dict(B=B, L=L, method=m, timing=timing, q1_us=base,
                   ratio={str(T): p[f"{timing}_us"] / base for T, p in sorted(pts.items())},
                   mask={str(T): p["mask"] for T, p in sorted(pts.items())})
        r4 = row["ratio"].get(str(TARGET_QLEN))
        row["meets_target"] = None if (r4 is None or L < TARGET_MIN_L) else bool(r4 <= TARGET_RATIO)
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------- report
def format_qlen_table(results, header: bool = True) -> str:
    """Markdown: µs per (shape, contender, q_len) with the mask given, then time(q_len) / time(q_len = 1)."""
    prov, st = results["provenance"], results["settings"]
    lines = []
    if header:
        lines += [f"device: {prov['device']} | mode: {prov['mode']} | torch {prov['torch']} | triton {prov['triton']} "
                  f"| {prov['date_utc']}", f"command: {prov['command']}"]
    lines += [f"H {st['heads'][0]}:{st['heads'][1]}, D={st['D']}, {st['dtype']}; every sequence L keys; "
              f"target: {st['target']}",
              "SDPA is_causal alignment probed in this run: "
              + (", ".join(f"{k} {v}" for k, v in st.get("is_causal_alignment", {}).items()) or "—"), "",
              "| B | L | contender | q_len | mask given | µs (eager / graph) | TB/s | rel. err |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["records"]:
        lead = f"| {r['B']} | {r['L']} | {r['method']} | {r.get('q_len') or '—'} | {r.get('mask', '—')} |"
        if r["status"] != "ok":
            lines.append(f"{lead} {r['status']}: {r.get('reason', '')} | | |")
            continue
        g = r.get("graph_us")
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
        note = " (non-causal)" if r.get("semantics") == "non-causal" else ""
        lines.append(f"{lead} {r['eager_us']:.1f} / {'—' if g is None else f'{g:.1f}'} | {r['tbs']:.2f} | {err}{note} |")
    qls = st["qlens"]
    lines += ["", "time(q_len) / time(q_len = 1)", "",
              "| B | L | contender | timing | µs at q_len=1 | " + " | ".join(f"q_len={T}" for T in qls)
              + f" | q_len={TARGET_QLEN} target |", "|---|---|---|---|---|" + "---|" * (len(qls) + 1)]
    for row in results.get("ratios", []):
        cells = [f"{row['ratio'][str(T)]:.2f}" if str(T) in row["ratio"] else "—" for T in qls]
        met = {True: f"met (≤ {TARGET_RATIO})", False: f"missed (> {TARGET_RATIO})", None: "—"}[row["meets_target"]]
        lines.append(f"| {row['B']} | {row['L']} | {row['method']} | {row['timing']} | {row['q1_us']:.1f} | "
                     + " | ".join(cells) + f" | {met} |")
    for s in results.get("skipped", []):
        lines.append(f"skipped: B={s['B']} L={s['L']} ({s['reason']})")
    return "\n".join(lines)


def write_qlen(results, out_dir=None, name=None, force=False) -> dict:
    """NAME.json and NAME.md in ``out_dir`` (default ``results/<device>/``; NAME default ``qlen-<UTC stamp>``);
    an existing file is an error unless ``force`` (:func:`fdlib.bench.report.write_results`)."""
    from .report import write_results
    return write_results(results, out_dir, name, force=force, plot=False, table=format_qlen_table)
