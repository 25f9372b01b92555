"""A/B of the chooser's constants on a GPU: does a rule earn its place?

    python tools/ab_constants.py OUT.json --set NAME=VALUE [--set NAME=VALUE ...] [--kinds dense,heads,ragged,...]
    python tools/ab_constants.py - --set NAME=VALUE --list [--identity H100|H200]     # no GPU: the cases only

For each ``--set`` (one constant of :mod:`fdlib.splits` or :mod:`fdlib.plan` at another value, a Python literal;
a value that turns its rule off asks whether the rule can go), it finds the benchmarked batches
(``tools/decision_cases.py``: the dense grid, the heads sweep, the ragged grid, the ab_ragged batches, the serving
batches with their 8-bit caches; one query token) on which ``auto``'s decision changes, planned from host lengths
(``host``) or without them (``device``, as ``decode_attention`` with lengths on the device), and times each of
those batches both ways, one after the other on the same inputs (the default first on every other batch, the
constant at VALUE first on the others), and checks that the kernel and splits timed are those decided. Times are
graph µs of the ragged bench (:func:`fdlib.bench.ragged._measure`: CUDA graphs rotating over copies holding
>= 4x the L2, checked against float64 rows), with the read ceiling measured in the same run.

On a GPU the decisions are the live chooser's (its own calibration, this GPU's SMs); ``--list`` prints them on
the CPU for ``--identity`` as ``tools/decision_table.py`` sees that GPU. The JSON carries the device, versions,
date, command and commit; each record pairs a batch's two times, and the summary gives, per constant, the
geometric mean and the worst of VALUE's time over the default's.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from decision_cases import constant, parse_set  # noqa: E402

KINDS = ("dense", "heads", "ragged", "ab", "serving")
"""The case families (the first word of a decision-table label) this tool times; ``qlen`` (several query tokens)
is left out: the ragged bench times one query token."""


def decision(case, given: bool):
    """``auto``'s Decision on a case, planned from host lengths (``given``) or without them."""
    from fdlib import quant
    from fdlib.bench import harness
    from fdlib.plan import decide

    from decision_cases import paged_cap
    label, B, hq, hk, D, dt, lens, page, q_len, kv = case
    dtype = harness.DTYPES[dt]
    fmt = quant.plan_format(*kv, dtype) if kv else None
    pack = False if fmt is not None and (fmt.k != "tensor" or fmt.v != "tensor") else None
    return decide(B, hq, hk, D, paged_cap(lens, page), fmt or dtype, lengths=tuple(lens) if given else None,
                  q_len=q_len, paged=page, pack_heads=pack)


def changed(name, value, kinds, match: str = "") -> list[tuple]:
    """(case, given, default Decision, Decision at VALUE) of every case and planning whose decision differs
    (cases of the ``kinds`` families whose label holds ``match``)."""
    from decision_cases import cases
    seen, runs = set(), []
    for case in cases():
        label, page = case[0], case[7]
        if label.split()[0] in kinds and match in label and (label, page) not in seen:
            seen.add((label, page))
            runs += [(case, given) for given in (True, False)]
    base = [decision(case, given) for case, given in runs]
    with constant(name, value):
        other = [decision(case, given) for case, given in runs]
    return [(case, given, a, b) for (case, given), a, b in zip(runs, base, other) if a != b]


def spread(found: list, n: int) -> list:
    """At most ``n`` of ``found``, evenly spread over it (first and last included), in its order."""
    if len(found) <= n:
        return list(found)
    if n <= 1:
        return found[:max(n, 0)]
    return [found[round(i * (len(found) - 1) / (n - 1))] for i in range(n)]


def shape_of(case) -> dict:
    """The ragged bench's shape dict of a decision-table case."""
    label, B, hq, hk, D, dt, lens, page, q_len, kv = case
    shape = dict(dtype=dt, B=B, H_q=hq, H_kv=hk, D=D, dist=label, mean=round(sum(lens) / len(lens)))
    if kv:
        shape.update(kv_dtype=str(kv[0]).removeprefix("torch."), kv_scale=kv[1])
    return shape


def short(d) -> str:
    """A Decision in a few words: kernel, splits, and what else is not at its default."""
    from dataclasses import fields
    parts = [d.kernel, f"s={d.splits}"]
    for f in fields(d)[2:]:
        v = getattr(d, f.name)
        if f.name == "tile":
            parts.append(f"tile={v.BLOCK_N}/{v.num_warps}/{v.num_stages}" if v else "tile=-")
        elif f.name not in ("basis", "chunk", "L_cap") and v != f.default:
            parts.append(f"{f.name}={v}")
    return " ".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the JSON to write ('-' with --list)")
    ap.add_argument("--set", action="append", required=True, metavar="NAME=VALUE",
                    help="a chooser constant at another value (Python literal); each --set is its own A/B")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"case families to time (default {','.join(KINDS)})")
    ap.add_argument("--match", default="", help="only the batches whose label holds this text (e.g. 'D=256')")
    ap.add_argument("--list", action="store_true", help="print the cases whose decision changes and stop (no GPU)")
    ap.add_argument("--identity", default="H100", choices=("H100", "H200", "H200+launched"),
                    help="with --list on a machine without a GPU: the GPU the chooser plans for")
    ap.add_argument("--max-cases", type=int, default=40, help="time at most this many changed cases a constant "
                                                              "(evenly spread over those found; default 40)")
    ap.add_argument("--max-kv-gb", type=float, default=20.0, help="skip batches storing more (GB, default 20)")
    args = ap.parse_args(argv)
    if args.max_cases < 1:
        raise SystemExit(f"--max-cases: expected a count >= 1, got {args.max_cases}")
    sets = [parse_set(s) for s in args.set]
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"--kinds: expected some of {', '.join(KINDS)}, got {', '.join(bad)}")
    if args.list:
        os.environ.update(FDLIB_INTERPRET="1", TRITON_INTERPRET="1", FDLIB_NO_CALIBRATE="1")
        import decision_table
        decision_table.become(args.identity)
        for name, value in sets:
            found = changed(name, value, kinds, args.match)
            print(f"{name}={value!r}: {len(found)} plannings of auto change ({args.identity})")
            for case, given, a, b in found:
                print(f"    {'host' if given else 'device'} | {case[0]} | {where(case[7])} | {short(a)} -> "
                      f"{short(b)}")
        return
    run(args, sets, kinds, argv)


def run(args, sets, kinds, argv) -> None:
    from fdlib import runtime
    from fdlib.bench import ragged
    from fdlib.bench.harness import measure_ceiling_or_none, provenance
    from fdlib.bench.timing import free_memory
    gpu = runtime.MODE == "gpu"
    settings = {"graphs": gpu, "warmup_ms": 10, "rep_ms": 30, "graph_rep_ms": 10, "cpu_runs": 1}
    ceil = measure_ceiling_or_none(gpu, 4, settings)
    out = {"schema": "fdlib.bench/1", "kind": "ab-constants", "settings": settings, "ceiling": ceil,
           "provenance": provenance("python tools/ab_constants.py " + " ".join(argv or sys.argv[1:])),
           "records": [], "summary": {}, "complete": False}
    for name, value in sets:
        found = changed(name, value, kinds, args.match)
        picked = spread(found, args.max_cases)
        print(f"{name}={value!r}: {len(found)} plannings change; timing {len(picked)}", flush=True)
        ratios = []
        for i, (case, given, a, b) in enumerate(picked):
            shape, lens, page = shape_of(case), case[6], case[7]
            base, stored = ragged.case_record(shape, lens, page)
            rec = dict(constant=name, value=repr(value), case=case[0], page=page, planned="host" if given else "device",
                       default=short(a), changed=short(b), kv_mb=base["kv_mb"])
            if stored > args.max_kv_gb * 1e9:
                out["records"].append(dict(rec, status="skipped", reason=f"{stored / 1e9:.1f} GB stored"))
                continue
            print(f"  ... {rec['planned']} {case[0]} {'p%d' % page if page else 'c'}: {short(a)} / {short(b)}",
                  flush=True)   # named before it runs: a kernel that faults takes the process with it
            copies, ref = ragged.case_inputs(shape, lens, page, i, "shuffled", stored, gpu)
            kw = {} if given else {"lengths": None}

            def default():
                return ragged._measure("auto", copies, ref, base, settings, ceil, None, kw)

            def at_value():
                with constant(name, value):
                    return ragged._measure("auto", copies, ref, base, settings, ceil, None, kw)
            if i % 2:   # every other batch the other way round, so that neither setting always runs first
                rb, ra = at_value(), default()
            else:
                ra, rb = default(), at_value()
            del copies, ref
            free_memory()
            key = "graph_us" if gpu else "eager_us"
            status = "ok" if ra["status"] == rb["status"] == "ok" else "failed"
            reason = " / ".join(r.get("reason", "") for r in (ra, rb) if r["status"] != "ok") or None
            # the plans timed are the ones decided (kernel and splits; the tiles are not in the record)
            ran = [(r.get("kernel"), r.get("splits")) for r in (ra, rb)]
            decided = [(a.kernel, a.splits), (b.kernel, b.splits)]
            if status == "ok" and ran != decided:
                status, reason = "mismatch", f"timed {ran}, decided {decided}"
            rec.update(status=status, reason=reason, order="default first" if i % 2 == 0 else "changed first",
                       us_default=ra.get(key), us_changed=rb.get(key), kernels=[k for k, _ in ran],
                       pct_ceiling=[ra.get("pct_ceiling"), rb.get("pct_ceiling")])
            if status == "ok":
                rec["ratio"] = rb[key] / ra[key]
                ratios.append(rec["ratio"])
            out["records"].append(rec)
            print(f"  {rec['planned']:6s} {case[0]:52s} {'p%d' % page if page else 'c':4s} {short(a):34s} "
                  f"{rec.get('us_default') or float('nan'):8.1f} -> {short(b):34s} "
                  f"{rec.get('us_changed') or float('nan'):8.1f} us  x{rec.get('ratio', float('nan')):.3f}",
                  flush=True)
            _save(args.out, out)
        out["summary"][f"{name}={value!r}"] = dict(
            changed=len(found), timed=len(ratios), gmean=math.exp(sum(map(math.log, ratios)) / len(ratios))
            if ratios else None, worst=max(ratios, default=None), best=min(ratios, default=None))
        print(f"{name}={value!r}: {out['summary'][f'{name}={value!r}']}", flush=True)
        _save(args.out, out)
    out["complete"] = True
    _save(args.out, out)


def _save(path: str, out: dict) -> None:
    """The JSON, and beside it (``.md``) its table: one row a batch, then the summary."""
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    if path.endswith(".json"):
        with open(path[:-5] + ".md", "w") as f:
            f.write(markdown(out))


def where(page: int) -> str:
    """A batch's cache in words."""
    return f"pages of {page}" if page else "contiguous"


def markdown(out: dict) -> str:
    """The records as a table (µs: graph, else eager in the interpreter), the summary after it."""
    prov = out["provenance"]
    ceil = (out.get("ceiling") or {}).get("tbs")

    def num(v, fmt=".1f"):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    lines = [f"# Chooser constants A/B ({prov.get('device')}, {prov.get('date_utc')})", "",
             f"`{prov.get('command')}`; torch {prov.get('torch')}, triton {prov.get('triton')}, commit "
             f"{prov.get('git_commit')}" + (f"; read ceiling {ceil:.2f} TB/s" if ceil else ""), "",
             "| constant | batch | cache | planned | default | µs | changed | µs | changed / default |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in out["records"]:
        last = num(r["ratio"], ".3f") if "ratio" in r else f"{r['status']}: {r.get('reason')}"
        lines.append(f"| {r['constant']}={r['value']} | {r['case']} | {where(r['page'])} | {r['planned']} | "
                     f"{r['default']} | {num(r.get('us_default'))} | {r['changed']} | {num(r.get('us_changed'))} | "
                     f"{last} |")
    lines += ["", "| setting | plannings changed | timed | geometric mean | best | worst |",
              "|---|---|---|---|---|---|"]
    for k, v in out["summary"].items():
        lines.append(f"| {k} | {v['changed']} | {v['timed']} | {num(v['gmean'], '.3f')} | {num(v['best'], '.3f')} | "
                     f"{num(v['worst'], '.3f')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
