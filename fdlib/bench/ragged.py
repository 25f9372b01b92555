r"""``python -m fdlib.bench --ragged``: ragged batches, contiguous or paged, as continuous batching makes them.

Every shape draws one length per sequence from a distribution of mean :math:`\bar L`:

* ``constant``: every row :math:`\bar L`;
* ``uniform``: uniform in :math:`[1, 2\bar L]`;
* ``zipf``: most rows short, a few long: :math:`L = 1 + \lfloor \bar L\, x\rfloor` with x drawn from a Lomax
  (Pareto II) law of shape 1.5 scaled to mean 1, capped at :math:`8\bar L`.

The cache is either contiguous ``[B, L_max, H_kv, D]`` (L_max the longest row) or pages of ``--page-size`` keys
behind a block table over a pool of exactly the pages the rows use: shuffled (``--page-order shuffled``, the
default: each sequence's pages anywhere in the pool) or in order (``sequential``: sequence b's pages consecutive,
after sequence b-1's, as a fresh allocator hands them out; FlashInfer's anchor timings used that). The bytes a step
must read are :math:`2\sum_b L_b H_{kv} D\,\text{elem}`; effective bandwidth is those bytes over the time, and % of
ceiling compares it with the read ceiling measured in the same run. SDPA takes no ragged lengths without a mask, so
the peers are fdlib's own methods. Each method is planned per batch from the batch's lengths on the host
(``fdlib.plan(..., lengths=...)``, outside the timed region), and the timed step is ``plan.run``: a serving engine
knows its lengths when it builds a step, as FlashInfer's ``plan()`` outside a graph and ``run()`` inside it do. Two more
methods time ``auto`` as it runs without host lengths (:data:`PROTOCOLS`): ``default``, the call
``decode_attention(q, k, v, lens)`` with the lengths on the device, and ``captured``, a graph captured while every
length reads L_max and replayed with the batch's lengths. With
lengths, ``auto`` may take the stream-K or balanced kernel (:func:`fdlib.splits.choose_auto`). Timings as in the
dense bench (:mod:`fdlib.bench.timing`: eager with the L2 flushed, CUDA graphs rotating over copies of the inputs).
An 8-bit cache (``--kv-dtype``, ``--kv-scale``: :mod:`fdlib.bench.kv8`): the pool quantized as it is stored, per-token
scales ``[n_pages, page_size, H_kv]``; the bytes a step reads are then its own (:func:`fdlib.bench.kv8.bytes_per_key`).
"""
from __future__ import annotations

import math

import torch

from .. import runtime
from . import kv8
from .harness import DTYPES, Progress, measure_ceiling_or_none, provenance, reference_rows, rel_error
from .timing import (Rotating, captured_call, copies_for_l2, free_memory, synchronize, time_eager, time_graph,
                     time_graph_after)

DISTS = ("constant", "uniform", "zipf")
RAGGED_GRID = dict(B=(8, 32, 128), heads=((32, 8), (32, 32)), D=(128,), dtypes=("float16", "bfloat16"),
                   means=(1024, 8192, 32768), dists=DISTS)
QUICK_RAGGED = dict(B=(3,), heads=((4, 2),), D=(32,), dtypes=("float16",), means=(40,), dists=DISTS)
RAGGED_METHODS = ("auto", "split", "unified", "persistent", "balanced", "streamk")


def draw_lengths(dist: str, B: int, mean: int, seed: int = 0) -> list[int]:
    """B lengths from ``dist`` (see the module doc) with mean ``mean``, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    if dist == "constant":
        return [mean] * B
    if dist == "uniform":
        return torch.randint(1, 2 * mean + 1, (B,), generator=g).tolist()
    if dist == "zipf":
        a = 1.5
        u = torch.rand(B, generator=g, dtype=torch.float64)
        x = ((1 - u) ** (-1 / a) - 1) * (a - 1)           # Lomax(shape a), scaled to mean 1
        return [int(v) for v in torch.clamp(1 + torch.floor(mean * x), 1, 8 * mean).tolist()]
    raise ValueError(f"dist: expected one of {', '.join(DISTS)}, got {dist!r}")


def parse_case(text: str) -> tuple[dict, int]:
    """(shape, page size) of one batch named ``B:H_q:H_kv:dist:mean:page`` (D=128, fp16; page 0: a contiguous
    cache), the form ``tools/ab_ragged.py`` and ``tools/record_timeline.py`` take; ``dist`` may end in ``/desc``
    (:func:`case_lengths`)."""
    try:
        B, H_q, H_kv, dist, mean, page = text.split(":")
        return dict(dtype="float16", B=int(B), H_q=int(H_q), H_kv=int(H_kv), D=128, dist=dist,
                    mean=int(mean)), int(page)
    except ValueError:
        raise ValueError(f"--cases: expected B:H_q:H_kv:dist:mean:page (e.g. 128:32:8:uniform:1024:16), "
                         f"got {text!r}") from None


def case_lengths(dist: str, B: int, mean: int, seed: int) -> list[int]:
    """:func:`draw_lengths`, where ``dist/desc`` (e.g. ``uniform/desc``) gives the same lengths sorted longest
    first over b, so that the grid kernels launch their longest rows first (b is stage 1's fastest grid axis and
    the unified kernel's second, after the KV head). ``onelong``: row 0 of ``mean`` keys, the others uniform in
    1..mean/8."""
    base, _, order = dist.partition("/")
    if order not in ("", "desc"):
        raise ValueError(f"dist: expected one of {', '.join(DISTS)}, optionally with '/desc', got {dist!r}")
    if base == "onelong":   # one row of ``mean`` keys, the others uniform in 1..mean/8 (a long chat among short)
        lens = [mean] + draw_lengths("uniform", B - 1, max(1, mean // 16), seed)
    else:
        lens = draw_lengths(base, B, mean, seed)
    return sorted(lens, reverse=True) if order else lens


PAGE_ORDERS = ("shuffled", "sequential")


def _inputs(shape, lens, page_size, seed, page_order="shuffled"):
    """q, K and V (contiguous, or a page pool with its table: pages shuffled or in order), the lengths on the
    device."""
    dt, dev = DTYPES[shape["dtype"]], runtime.DEVICE
    B, Hq, Hkv, D = (shape[k] for k in ("B", "H_q", "H_kv", "D"))
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g, device=dev, dtype=dt)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    if not page_size:
        L_max = max(max(lens), 1)
        k = torch.randn(B, L_max, Hkv, D, generator=g, device=dev, dtype=dt)
        v = torch.randn(B, L_max, Hkv, D, generator=g, device=dev, dtype=dt)
        return q, k, v, lens_t, None
    pages = [max(1, -(-L // page_size)) for L in lens]
    n = sum(pages)
    k = torch.randn(n, page_size, Hkv, D, generator=g, device=dev, dtype=dt)
    v = torch.randn(n, page_size, Hkv, D, generator=g, device=dev, dtype=dt)
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if page_order == "shuffled"
             else torch.arange(n)).to(torch.int32)
    bt = torch.zeros(B, max(pages), dtype=torch.int32)
    at = 0
    for b, p in enumerate(pages):
        bt[b, :p] = order[at:at + p]
        at += p
    return q, k, v, lens_t, bt.to(dev)


def run_ragged(B=None, heads=None, D=None, dtypes=None, means=None, dists=None, methods=None, page_size=None,
               page_order="shuffled", max_kv_gb=20.0, quick=False, graphs=None, warmup_ms=None, rep_ms=None,
               graph_rep_ms=None, seed=0, ceiling=True, ceiling_gib=None, progress=True, command=None, kv_dtype=None,
               kv_scale=None) -> dict:
    """Time fdlib's methods on the ragged grid (see the module doc); a results dict of kind ``"ragged"``.
    ``kv_dtype``/``kv_scale``: an 8-bit cache (:mod:`fdlib.bench.kv8`)."""
    kv8.check(kv_dtype, kv_scale)
    kv = kv8.shape_fields(kv_dtype, kv_scale)
    if page_order not in PAGE_ORDERS:
        raise ValueError(f"page_order: expected one of {', '.join(PAGE_ORDERS)}, got {page_order!r}")
    grid = dict(QUICK_RAGGED if quick else RAGGED_GRID)
    for name, val in (("B", B), ("heads", heads), ("D", D), ("dtypes", dtypes), ("means", means), ("dists", dists)):
        if val:
            grid[name] = tuple(val)
    gpu = runtime.MODE == "gpu"
    settings = {"graphs": gpu and graphs is not False, "warmup_ms": warmup_ms or 25, "rep_ms": rep_ms or 100,
                "graph_rep_ms": graph_rep_ms or 20, "cpu_runs": 1, "page_size": page_size or 0,
                "page_order": page_order if page_size else None,
                "l2_handling": "eager: 256 MB zero-fill before each call; graphs: rotate over copies holding >= 4x L2",
                "kv_cache": kv8.describe(kv) if kv else None}
    ceil = measure_ceiling_or_none(ceiling and gpu, ceiling_gib or 4, settings)
    methods = tuple(methods or RAGGED_METHODS)
    shapes = [dict(dtype=dt, B=b, H_q=hq, H_kv=hkv, D=d, mean=m, dist=dist, **kv)
              for dt in grid["dtypes"] for (hq, hkv) in grid["heads"] for d in grid["D"] for b in grid["B"]
              for m in grid["means"] for dist in grid["dists"]]
    records, skipped = [], []
    bar = Progress(len(shapes), "ragged", progress)
    for i, shape in enumerate(shapes):
        lens = draw_lengths(shape["dist"], shape["B"], shape["mean"], seed + i)
        base, stored = case_record(shape, lens, page_size)
        if stored > max_kv_gb * 1e9:
            skipped.append(dict(base, reason=f"cache {stored / 1e9:.1f} GB > --max-kv-gb {max_kv_gb}"))
            bar.update()
            continue
        copies, ref = case_inputs(shape, lens, page_size, seed + i, page_order, stored, settings["graphs"])
        for name in methods:
            records.append(_measure(name, copies, ref, base, settings, ceil))
        del copies, ref
        free_memory()
        bar.update()
    bar.close()
    return {"schema": "fdlib.bench/1", "kind": "ragged", "provenance": provenance(command), "settings": settings,
            "ceiling": ceil, "records": records, "skipped": skipped}


def case_record(shape, lens, page_size):
    """(the record fields of one ragged batch, the bytes its cache stores): ``shape`` with the lengths' mean
    and maximum, the page size and the MB a step reads (every row's keys and values, and an 8-bit cache's per-token
    scales: :func:`fdlib.bench.kv8.bytes_per_key`). The bytes stored are its 16-bit cache's (an 8-bit run makes it
    first)."""
    elem = DTYPES[shape["dtype"]].itemsize
    need = 2 * shape["H_kv"] * shape["D"] * elem
    stored = need * (shape["B"] * max(lens) if not page_size else sum(-(-L // page_size) * page_size for L in lens))
    base = dict(shape, L_mean=sum(lens) / len(lens), L_max=max(lens), page_size=page_size or 0,
                kv_mb=shape["H_kv"] * kv8.bytes_per_key(shape, elem) * sum(lens) / 1e6)
    return base, stored


def case_inputs(shape, lens, page_size, seed, page_order, stored, graphs):
    """(copies of the batch's (q, K, V, lengths, table) to rotate over, enough to hold >= 4x the L2 under CUDA
    graphs, else one; the reference rows). An 8-bit cache's copies are (q, K, V, lengths, table, K's scale, V's
    scale), its reference over the 16-bit cache it stands for."""
    inp = _inputs(shape, lens, page_size, seed, page_order)
    q, k, v, lens_t, bt = inp
    if kv8.fmt(shape) is not None:
        k8, v8, ks, vs, k, v = kv8.quantize(k, v, shape)
        inp = (q, k8, v8, lens_t, bt, ks, vs)
    ref = reference_rows(q, k, v, lens_t.tolist(), bt)
    del k, v
    n = copies_for_l2(int(stored)) if graphs else 1
    return [inp] + [tuple(kv8.clone(t) for t in inp) for _ in range(n - 1)], ref


PROTOCOLS = ("default", "captured")
"""Method names of :func:`_measure` that time auto as a serving engine calls it without host lengths:
``default`` is ``fdlib.decode_attention(q, k, v, lens)`` with the lengths on the device (its cached plan, made
without reading them); ``captured`` is a plan made without lengths whose call is captured in a CUDA graph while
its lengths tensor holds L_max in every row, replayed after the batch's lengths are copied into that tensor
(:func:`fdlib.bench.timing.time_graph_after`; the interpreter runs one call with L_max, then one with the lengths)."""


def _measure(name, copies, ref, base, settings, ceil, num_splits=None, plan_kw=None):
    """One method's record on one batch (``num_splits``: the plan's forced split count, None for its own;
    ``plan_kw``: more arguments of :func:`fdlib.plan`, e.g. ``longest_first=True``); ``name`` in
    :data:`PROTOCOLS`: auto without host lengths."""
    import fdlib
    from ..api import plan_for
    from ..validate import check_inputs
    rec = dict(base, method=name, status="ok")
    held = []                                   # captured: each copy's (host action before the replays, output)

    def make(c):
        """A serving step: plan once for this batch (outside any graph; from its host lengths unless ``name`` is
        a protocol), run every call."""
        q, k, v, lens, bt, *scales = c
        ks, vs = scales or (None, None)
        if name == "default":
            p = plan_for(q, k, v, lens, block_table=bt, k_scale=ks, v_scale=vs)
            return p, (lambda: fdlib.decode_attention(q, k, v, lens, block_table=bt, k_scale=ks, v_scale=vs))
        method = "auto" if name == "captured" else name
        shape = check_inputs(q, k, v, lens, None, method, None, False, bt, ks, vs)   # these tensors' checked sizes
        kv = shape.kv
        kw = dict(lengths=None if name == "captured" else lens.tolist(), method=method,
                  page_size=shape.page_size or None, num_splits=num_splits,
                  kv_dtype=kv and kv.dtype, k_scale=kv and kv.k, v_scale=kv and kv.v)
        kw.update(plan_kw or {})   # lengths=None: a plan made without them, as decode_attention's
        p = fdlib.plan(shape.B, shape.H_q, shape.H_kv, shape.D, shape.L_max, dtype=q.dtype, device=q.device, **kw)
        if name != "captured":
            return p, (lambda: p.run(q, k, v, lens, block_table=bt, k_scale=ks, v_scale=vs))
        out = torch.empty_like(q)
        call, put = captured_call(lambda at: p.run(q, k, v, at, block_table=bt, k_scale=ks, v_scale=vs, out=out),
                                  lens, shape.L_max)
        held.append((put, out))
        return p, call

    def set_lengths():
        for put, _ in held:
            put()
    try:
        plans, calls = zip(*(make(c) for c in copies))
        d = plans[0].decision
        rec.update(kernel=d.kernel, splits=d.splits, longest_first=bool(d.order))
        if name == "captured":   # the answer checked is what the replays (or the interpreter's calls) wrote
            if settings["graphs"]:
                rec["graph_us"] = time_graph_after(Rotating(calls), set_lengths, settings["graph_rep_ms"])
            else:
                calls[0]()
                set_lengths()
                rec["eager_us"] = time_eager(calls[0], settings["warmup_ms"], settings["rep_ms"],
                                             settings["cpu_runs"])
            out = held[0][1]
        else:
            out = calls[0]()
        synchronize()
        rec["rel_err"] = rel_error(out, ref)
        if not math.isfinite(rec["rel_err"]) or rec["rel_err"] >= 1e-2:
            return dict(rec, status="failed", reason=f"relative error {rec['rel_err']:.3g}")
        if name != "captured":
            rec["eager_us"] = time_eager(calls[0], settings["warmup_ms"], settings["rep_ms"], settings["cpu_runs"])
            if settings["graphs"]:
                rec["graph_us"] = time_graph(Rotating(calls), settings["graph_rep_ms"])
    except Exception as e:  # noqa: BLE001 - one method's failure is recorded, the run goes on
        return dict(rec, status="error", reason=f"{type(e).__name__}: {e}"[:300])
    t = rec.get("graph_us") or rec["eager_us"]
    rec["tbs"] = base["kv_mb"] / t                  # MB/µs = TB/s
    if ceil and ceil.get("tbs"):
        rec["pct_ceiling"] = 100 * rec["tbs"] / ceil["tbs"]
    return rec


def format_ragged_table(results) -> str:
    prov = results["provenance"]
    ceil = results.get("ceiling") or {}
    lines = [f"device: {prov['device']} | mode: {prov['mode']} | torch {prov['torch']} | triton {prov['triton']} | "
             f"{prov['date_utc']}", f"command: {prov['command']}",
             f"read ceiling: {ceil['tbs']:.2f} TB/s" if ceil.get("tbs") else "read ceiling: not measured",
             f"page size: {results['settings']['page_size'] or 'contiguous cache'}"]
    if results["settings"].get("kv_cache"):
        lines.append(f"KV cache: {results['settings']['kv_cache']}")
    lines += ["",
             "| dtype | B | H_q:H_kv | dist | mean L | max L | KV MB | method | kernel | µs (eager / graph) | TB/s | "
             "% ceiling |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["records"]:
        lead = (f"| {r['dtype']} | {r['B']} | {r['H_q']}:{r['H_kv']} | {r['dist']} | {r['L_mean']:.0f} | {r['L_max']} "
                f"| {r['kv_mb']:.1f} | {r['method']} |")
        if r["status"] != "ok":
            lines.append(f"{lead} | {r['status']}: {r.get('reason', '')} | | |")
            continue
        e, g = r.get("eager_us"), r.get("graph_us")
        times = " / ".join("—" if t is None else f"{t:.1f}" for t in (e, g))
        pct = "" if r.get("pct_ceiling") is None else f"{r['pct_ceiling']:.0f}"
        lines.append(f"{lead} {r.get('kernel')} | {times} | {r['tbs']:.2f} | {pct} |")
    for s in results.get("skipped", []):
        lines.append(f"skipped: {s['dtype']} B={s['B']} {s['H_q']}:{s['H_kv']} {s['dist']} mean {s['mean']} ({s['reason']})")
    return "\n".join(lines + protocol_summary(results["records"]))


def _time(r):
    return r.get("graph_us") or r.get("eager_us")


def protocol_summary(records) -> list[str]:
    """Markdown lines: for each of :data:`PROTOCOLS` that ran, its time over ``auto``'s (planned from the host
    lengths) on the same batch: worst, geometric mean, the batches over 1.05x, and the lowest % of the ceiling
    on batches of >= 512 MB (what a default call without host lengths is held to); nothing when neither ran beside
    ``auto``."""
    key = lambda r: (r["dtype"], r["B"], r["H_q"], r["H_kv"], r["dist"], r["L_mean"], r["L_max"])   # noqa: E731
    host = {key(r): _time(r) for r in records if r["method"] == "auto" and r["status"] == "ok"}
    out = []
    for name in PROTOCOLS:
        rows = [(r, _time(r) / host[key(r)]) for r in records
                if r["method"] == name and r["status"] == "ok" and host.get(key(r)) and _time(r)]
        failed = [r for r in records if r["method"] == name and r["status"] != "ok"]
        if not rows and not failed:
            continue
        out += ["", f"**{name}** (auto without host lengths) / auto planned from host lengths:"]
        if rows:
            ratios = [x for _, x in rows]
            gmean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            big = [r.get("pct_ceiling") for r, _ in rows if r["kv_mb"] >= 512 and r.get("pct_ceiling") is not None]
            over = [f"B={r['B']} {r['H_q']}:{r['H_kv']} {r['dist']} {r['L_mean']:.0f} ({x:.2f}x)"
                    for r, x in rows if x > 1.05]
            out.append(f"{len(rows)} batches: worst {max(ratios):.3f}x, geometric mean {gmean:.3f}x; "
                       f"over 1.05x: {', '.join(over) or 'none'}"
                       + (f"; lowest % of ceiling at >= 512 MB: {min(big):.0f}% ({len(big)} batches)" if big else ""))
        if failed:
            out.append(f"not ok: {len(failed)} ({', '.join(r['status'] for r in failed)})")
    return out
