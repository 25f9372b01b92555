r"""Bench of FlashDecoding++'s unified-max softmax (:mod:`fdlib.exact`) against ``method="unified"``.

For every shape of the grid (:data:`fdlib.bench.harness.DEFAULT_GRID` by default: dtype, B, H_q:H_kv, L, D;
every sequence L long; q, K, V standard normal, q multiplied by ``q_scale`` to widen the logits) the same
splits, chunk and tiles as the unified kernel's plan are used, so the only difference is the arithmetic:

* ``unified``: :meth:`fdlib.DecodePlan.run` of ``method="unified"`` (running max, log-sum-exp merge);
* ``unified_max:ticket`` / ``unified_max:atomic``: :func:`fdlib.exact.run_unified_max` (pass 1 + pass 2),
  launch-only, workspace and φ made before timing (φ per row from the first keys,
  :func:`fdlib.exact.estimate_phi`: a calibration done ahead of time, as the paper does);
* ``unified_max:ticket:pass1``: pass 1 alone (``recompute=False``), to show what the early-exit pass 2 costs.

Correctness first (relative error against the harness's float32 reference, the tolerance of
:func:`fdlib.bench.harness.tolerance`), with the recompute rate (marked rows / rows) of each unified-max call;
then eager and CUDA-graph median µs with :mod:`fdlib.bench.timing` (L2 flushed, or rotating input copies), and
each time divided by ``unified``'s. On the GPU::

    python -m fdlib.bench.unified_max --out results/h200 --name unified-max

In the interpreter (``--quick``) the numbers only show that the bench runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import torch

from .. import exact, runtime
from ..kernels import unified_max as um
from ..plan import plan
from . import harness
from .timing import Rotating, copies_for_l2, free_memory, synchronize, time_eager, time_graph

SCHEMA = "fdlib.bench.unified_max/1"
VARIANTS = ("unified", "unified_max:ticket", "unified_max:atomic", "unified_max:ticket:pass1")
QUICK = dict(B=(2,), L=(64, 200), heads=((4, 2),), D=(32,), dtypes=("float16",))


def _variant_calls(shape, copies, variant):
    """(a zero-argument call per input copy, a function giving the last call's recompute rate or None)."""
    B, H_q, H_kv, L, D = (shape[k] for k in ("B", "H_q", "H_kv", "L", "D"))
    dtype = copies[0].q.dtype
    dev = copies[0].q.device
    p = plan(B, H_q, H_kv, D, L, dtype=dtype, device=dev, method="unified", max_seqlen=L)
    out = torch.empty_like(copies[0].q)
    lse = torch.empty(B, H_q, dtype=torch.float32, device=dev)
    if variant == "unified":
        calls = [(lambda c=c: p.run(c.q, c.k, c.v, c.lens, out=out, lse=lse)[0]) for c in copies]
        return calls, lambda: None
    _, reduce, *rest = variant.split(":")
    d = p.decision
    ws = um.make_workspace(B, H_q, H_kv, D, d.splits, dev, reduce)
    launch = um.launchers(dtype, H_q // H_kv, D, d.splits, d.tile, 0, reduce)
    window = exact.default_window(L)
    recompute = not rest
    phis = [exact.estimate_phi(c.q, c.k, c.lens, p.scale) for c in copies]

    def make(c, phi):
        def call():
            um.run_unified_max(c.q, c.k, c.v, c.lens, scale=p.scale, phi=phi, window=window, out=out, lse=lse,
                               splits=d.splits, chunk=d.chunk, cfg=d.tile, workspace=ws, launch=launch,
                               recompute=recompute)
            return out
        return call

    def rate():
        return float(ws.marks.float().mean())
    return [make(c, f) for c, f in zip(copies, phis)], rate


def _measure(shape, copies, ref, variant, settings) -> dict:
    rec = dict(shape, method=variant, status="ok")
    calls, rate = _variant_calls(shape, copies, variant)
    out = calls[0]()
    synchronize()
    r = rate()
    if r is not None:
        rec["recompute_rate"] = r
    if variant.endswith("pass1"):
        rec["note"] = "pass 1 only: marked rows would be wrong (timing breakdown only)"
    else:
        err = harness.rel_error(out, ref)
        rec["rel_err"] = err
        tol = harness.tolerance(shape["dtype"])
        if not math.isfinite(err) or err >= tol:
            rec.update(status="failed", reason=f"relative error {err:.3g} >= tolerance {tol:g}; not timed")
            return rec
    rec["eager_us"] = time_eager(calls[0], settings["warmup_ms"], settings["rep_ms"], settings["cpu_runs"])
    if settings["graphs"]:
        try:
            rec["graph_us"] = time_graph(Rotating(calls), settings["graph_rep_ms"])
            rec["graph_copies"] = len(calls)
        except Exception as e:  # noqa: BLE001 - a capture failure costs the graph column only
            rec["graph_us"], rec["graph_error"] = None, f"{type(e).__name__}: {e}"[:300]
    return rec


def run_unified_max_bench(B=None, L=None, heads=None, D=None, dtypes=None, variants=VARIANTS, q_scale: float = 1.0,
                          quick: bool = False, graphs=None, warmup_ms=None, rep_ms=None, graph_rep_ms=None,
                          cpu_runs=None, max_kv_gb: float = 20.0, seed: int = 0, progress: bool = True,
                          command: str | None = None) -> dict:
    """Time unified-max against the unified kernel over the grid (module docstring); returns the results dict
    (``schema``, ``provenance``, ``settings``, ``records``, ``summary``; :func:`write` saves it)."""
    grid = QUICK if quick else harness.DEFAULT_GRID
    B, L, heads, D, dtypes = (x if x is not None else grid[k] for x, k in
                              ((B, "B"), (L, "L"), (heads, "heads"), (D, "D"), (dtypes, "dtypes")))
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variants: unknown {v!r}; expected some of {VARIANTS}")
    gpu = runtime.MODE == "gpu"
    settings = harness._settings(gpu, quick, graphs, warmup_ms, rep_ms, graph_rep_ms, cpu_runs, default_cpu_runs=2)
    shapes, skipped = harness.shape_grid(B, L, heads, D, dtypes, max_kv_gb)
    prov = harness.provenance(command)
    bar = harness.Progress(len(shapes) * len(variants), "unified_max", progress)
    records = []
    try:
        for i, shape in enumerate(shapes):
            base = harness.make_inputs(shape, seed + i)
            base.q.mul_(q_scale)
            ref = harness.reference(base)
            n = copies_for_l2(harness.kv_bytes(shape)) if settings["graphs"] else 1
            copies = harness._copies(base, n, "fdlib")
            for v in variants:
                try:
                    rec = _measure(shape, copies, ref, v, settings)
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    rec = dict(shape, method=v, status="error", reason=f"{type(e).__name__}: {e}"[:300])
                    free_memory()
                rec["kv_bytes"] = harness.kv_bytes(shape)
                records.append(rec)
                bar.update(f"{v} B={shape['B']} L={shape['L']}")
            del copies, base, ref
            free_memory()
    finally:
        bar.close()
    _ratios(records)
    return {"schema": SCHEMA, "kind": "unified_max", "provenance": prov,
            "settings": dict({k: v for k, v in settings.items() if k != "progress"}, quick=quick, q_scale=q_scale,
                             seed=seed, variants=list(variants), max_kv_gb=max_kv_gb,
                             inputs="q, K, V ~ N(0, 1), q times q_scale; every sequence L long",
                             phi="per row, the largest logit of its first exact.FIRST_KEYS keys, made before timing",
                             window="exact.default_window(L)", splits="the unified plan's (same chunk and tiles)"),
            "shapes": shapes, "skipped": skipped, "records": records, "summary": summarize(records)}


def _key(r):
    return (r["dtype"], r["B"], r["H_q"], r["H_kv"], r["L"], r["D"])


def _ratios(records):
    """time / unified's time, eager and graph, on every timed record."""
    base = {_key(r): r for r in records if r["method"] == "unified" and r["status"] == "ok"}
    for r in records:
        for mode in ("eager", "graph"):
            us, b = r.get(f"{mode}_us"), base.get(_key(r), {}).get(f"{mode}_us")
            if us and b:
                r[f"{mode}_ratio_unified"] = us / b


def summarize(records) -> dict:
    """Per variant and mode: geometric mean of time / unified's, the shapes where it is faster, and the largest
    recompute rate seen."""
    out = {}
    for v in {r["method"] for r in records} - {"unified"}:
        mine = [r for r in records if r["method"] == v]
        s = {"max_recompute_rate": max((r.get("recompute_rate", 0.0) for r in mine), default=None)}
        for mode in ("eager", "graph"):
            ratios = [r[f"{mode}_ratio_unified"] for r in mine if r.get(f"{mode}_ratio_unified")]
            if ratios:
                s[f"{mode}_geomean_ratio"] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                s[f"{mode}_faster"] = [dict(zip(("dtype", "B", "H_q", "H_kv", "L", "D"), _key(r)),
                                            ratio=r[f"{mode}_ratio_unified"]) for r in mine
                                       if r.get(f"{mode}_ratio_unified", 2) < 1.0]
                s[f"{mode}_shapes"] = len(ratios)
        out[v] = s
    return out


def format_table(results) -> str:
    """A markdown table: one line per shape and variant (µs, ratio to unified, recompute rate)."""
    lines = ["| dtype | B | H_q:H_kv | L | D | variant | eager µs | graph µs | ×unified (graph) | recompute | "
             "status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, p=2: "" if x is None else f"{x:.{p}f}"   # noqa: E731
    for r in results["records"]:
        lines.append(f"| {r['dtype']} | {r['B']} | {r['H_q']}:{r['H_kv']} | {r['L']} | {r['D']} | {r['method']} | "
                     f"{f(r.get('eager_us'), 1)} | {f(r.get('graph_us'), 1)} | "
                     f"{f(r.get('graph_ratio_unified') or r.get('eager_ratio_unified'), 3)} | "
                     f"{f(r.get('recompute_rate'), 4)} | {r['status']} |")
    return "\n".join(lines)


def write(results, out_dir: str, name: str, force: bool = False) -> dict:
    """Write ``<name>.json`` and ``<name>.md`` (table and summary, with the provenance) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, name + ".json"), "md": os.path.join(out_dir, name + ".md")}
    if not force and any(os.path.exists(p) for p in paths.values()):
        raise FileExistsError(f"{paths} exist; pass force=True or another name")
    with open(paths["json"], "w") as fh:
        json.dump(results, fh, indent=1)
    prov = results["provenance"]
    with open(paths["md"], "w") as fh:
        fh.write(f"# unified-max vs unified\n\n{prov['runtime']}\n\ncommit {prov['git_commit']} "
                 f"(dirty: {prov['git_dirty']}), {prov['date_utc']}\n\n`{prov['command']}`\n\n")
        fh.write(format_table(results) + "\n\n## Summary\n\n```\n" + json.dumps(results["summary"], indent=1)
                 + "\n```\n")
    return paths


def main(argv=None) -> int:
    from .__main__ import _heads, _ints, _names
    ap = argparse.ArgumentParser(prog="python -m fdlib.bench.unified_max", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=_ints)
    ap.add_argument("--L", type=_ints)
    ap.add_argument("--heads", type=_heads)
    ap.add_argument("--D", type=_ints)
    ap.add_argument("--dtype", type=_names)
    ap.add_argument("--variants", type=_names, help=f"some of {','.join(VARIANTS)} (default all)")
    ap.add_argument("--q-scale", type=float, default=1.0, help="multiply q (wider logits), default 1")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (interpreter)")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out", default=None, help="output folder (default results/<device-slug>/)")
    ap.add_argument("--name", default="unified-max")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    command = "python -m fdlib.bench.unified_max " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    res = run_unified_max_bench(B=args.B, L=args.L, heads=args.heads, D=args.D, dtypes=args.dtype,
                                variants=args.variants or VARIANTS, q_scale=args.q_scale, quick=args.quick,
                                graphs=False if args.no_graphs else None, command=command)
    print(format_table(res))
    out = args.out
    if out is None:
        from .report import default_out_dir
        out = default_out_dir(res)
    print("wrote", write(res, out, args.name, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
