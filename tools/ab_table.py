"""A table of an A/B JSON (tools/ab_ragged.py): per case, each method's graph µs, its ratio to a baseline method,
and its % of the read ceiling measured in the same run.

    python tools/ab_table.py results/h100/ab-worklist.json [--base auto] > results/h100/ab-worklist.md
"""
import argparse
import json
import math


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--base", default="auto", help="the method every ratio is to (default: auto, host lengths)")
    args = ap.parse_args(argv)
    data = json.load(open(args.json))
    recs = data["records"]
    prov = data.get("provenance", {})
    ceil = (data.get("ceiling") or {}).get("tbs")
    print(f"# {data.get('kind', 'A/B')}: {prov.get('device', '?')}, {prov.get('date_utc', '?')}")
    print(f"\ncommand: `{prov.get('command', '?')}`; commit {prov.get('git_commit', '?')}; torch {prov.get('torch', '?')}, "
          f"triton {prov.get('triton', '?')}; read ceiling {ceil if ceil is None else round(ceil, 2)} TB/s; graph µs "
          f"(x: time over {args.base}'s on the same case)\n")
    cases, methods = [], []
    for r in recs:
        case = _case(r)
        if case not in cases:
            cases.append(case)
        if r["method"] not in methods:
            methods.append(r["method"])
    print("| case | KV MB | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    ratios = {m: [] for m in methods}
    for case in cases:
        rows = {r["method"]: r for r in recs if _case(r) == case}
        base = rows.get(args.base, {}).get("graph_us")
        cells = []
        for m in methods:
            r = rows.get(m)
            if r is None:
                cells.append("")
                continue
            us = r.get("graph_us")
            if r.get("status") != "ok" or us is None:
                cells.append(f"{r.get('status')}: {r.get('reason', '')[:40]}")
                continue
            x = us / base if base else float("nan")
            if base:
                ratios[m].append(x)
            cells.append(f"{us:.1f} ({x:.2f}x, {r.get('pct_ceiling', float('nan')):.0f}%)")
        kv = next(iter(rows.values())).get("kv_mb", float("nan"))
        print(f"| {case} | {kv:.0f} | " + " | ".join(cells) + " |")
    print("\n| method | geometric mean x | worst x |\n|---|---|---|")
    for m in methods:
        xs = ratios[m]
        if xs:
            print(f"| {m} | {math.exp(sum(map(math.log, xs)) / len(xs)):.3f} | {max(xs):.3f} |")


def _case(r) -> str:
    return r.get("case") or f"B={r.get('B')} {r.get('H_q')}:{r.get('H_kv')} {r.get('dist')} {r.get('mean')} p{r.get('page_size')}"


if __name__ == "__main__":
    main()
