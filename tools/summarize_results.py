"""Check committed benchmark results against the course's performance targets and write a summary.

python tools/summarize_results.py results/h200 > results/h200/SUMMARY.md

Reads bench-float16.json, bench-bfloat16.json and sweep-fp16.json from the folder (made by
``python -m fdlib.bench``); every number printed is computed here from those files. Timings are CUDA-graph
medians (L2 cold: rotated input copies), as recorded.
"""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def load(folder: Path, name: str):
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def main(folder: Path) -> None:
    benches = [b for b in (load(folder, f"bench-{dt}.json") for dt in ("float16", "bfloat16")) if b]
    out = [f"# Targets checked on the recorded results in `{folder}`", ""]
    for b in benches:
        p = b["provenance"]
        out.append(f"- `{p['command']}` on {p['device']} ({p['sm_count']} SMs), torch {p['torch']}, "
                   f"triton {p['triton']}, CUDA {p['cuda']}, {p['date_utc']}; read ceiling measured in the run "
                   f"{b['ceiling']['tbs']:.2f} TB/s")
    rows, ratios = [], []
    fa2_slower, ceil_miss, uni_slow, uni_b1 = [], [], [], []
    for b in benches:
        ceil = b["ceiling"]["tbs"]
        by = defaultdict(dict)
        for r in b["records"]:
            by[(r["dtype"], r["B"], r["H_q"], r["H_kv"], r["L"])][r["method"]] = r
        for key, m in sorted(by.items()):
            g = {k: v.get("graph_us") for k, v in m.items()}
            if not g.get("auto") or not g.get("cudnn"):
                continue
            kv = m["auto"]["kv_bytes"]
            r = g["auto"] / g["cudnn"]
            ratios.append(r)
            pct = kv / g["auto"] / 1e6 / ceil
            rows.append((key, kv / 1e6, g["auto"], g["cudnn"], g.get("fa2"), r, pct, g.get("unified"), g.get("split"),
                         g.get("split1"), m["auto"].get("splits"), m["auto"].get("kernel", "unified"),
                         g.get("persistent"), ceil))
            if g.get("fa2") and g["auto"] >= g["fa2"]:
                fa2_slower.append(key)
            if kv >= 512e6 and pct < 0.93:
                ceil_miss.append((key, pct, kv / g["cudnn"] / 1e6 / ceil))
            if g.get("unified") and g.get("split"):
                u = g["unified"] / g["split"]
                if u > 1.03:
                    uni_slow.append((key, u))
                if key[1] == 1 and key[4] <= 16384:
                    uni_b1.append((key, u))
    out += ["", "## fdlib `auto` against the peers (CUDA-graph µs)", "",
            "| dtype | B | H_q:H_kv | L | KV MB | auto | kernel | splits | cuDNN | FA2 | auto/cuDNN | % ceiling | "
            "unified/two-stage | no-split/two-stage | persistent/cuDNN |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, kv, a, c, f, r, pct, u, s, s1, sp, kern, pers, _ in rows:
        dt, B, hq, hk, L = key
        out.append(f"| {dt} | {B} | {hq}:{hk} | {L} | {kv:.1f} | {a:.1f} | {kern} | {sp} | {c:.1f} | {f:.1f} | "
                   f"{r:.3f} | {pct:.1%} | {u / s:.3f} | {s1 / s:.1f}× | "
                   f"{f'{pers / c:.3f}' if pers else '-'} |")
    out += ["", "## Targets", ""]
    if ratios:
        out.append(f"- time(auto)/time(cuDNN): geometric mean {geomean(ratios):.4f} over {len(ratios)} shapes "
                   f"(target ≤ 1.00), worst {max(ratios):.3f} (target ≤ 1.15 on every shape): "
                   + ", ".join(f"{k[0]} B={k[1]} {k[2]}:{k[3]} L={k[4]} {x[5]:.3f}" for x in rows
                               for k in [x[0]] if x[5] > 1.15) or "none above")
    out.append(f"- faster than FlashAttention-2 on every shape: {'yes' if not fa2_slower else 'no: ' + str(fa2_slower)}")
    out.append("- ≥ 93% of the read ceiling on every shape with ≥ 512 MB of KV: "
               + ("yes" if not ceil_miss else "missed on " + ", ".join(
                   f"{k[0]} B={k[1]} {k[2]}:{k[3]} L={k[4]} ({p:.1%}; cuDNN {pc:.1%})" for k, p, pc in ceil_miss)))
    out.append("- unified never more than 3% slower than two-stage at the same splits: "
               + ("yes" if not uni_slow else "missed on " + ", ".join(
                   f"{k[0]} B={k[1]} {k[2]}:{k[3]} L={k[4]} ({u:.3f})" for k, u in uni_slow)))
    if uni_b1:
        out.append("- unified vs two-stage at B=1, L ≤ 16k (target ≥ 10% faster, i.e. ratio ≤ 0.909): "
                   + ", ".join(f"{k[0]} {k[2]}:{k[3]} L={k[4]} {u:.3f}" for k, u in uni_b1))
    for key, kv, a, c, f, r, pct, u, s, s1, sp, kern, pers, ceil in rows:
        if key[1:] == (1, 32, 8, 131072):
            out.append(f"- {key[0]} B=1 H 32:8 L=131072: two-stage at its chosen {sp} splits is {s1 / s:.1f}× faster "
                       f"than the same kernel at 1 split (target ≥ 30×) and reads {kv / s:.2f} TB/s (target ≥ 3.6); "
                       f"auto ({kern}) is {s1 / a:.1f}× faster than the no-split kernel at {kv / a:.2f} TB/s. "
                       f"30× would need {s1 / 30:.1f} µs; reading the {kv:.0f} MB once at the ceiling measured in "
                       f"the run takes {kv / ceil:.1f} µs, so the most any kernel could reach against this "
                       f"no-split time is {s1 / (kv / ceil):.1f}×")
    sweep = load(folder, "sweep-fp16.json")
    if sweep:
        out += ["", "## Cost model against an exhaustive sweep of split counts (unified, CUDA-graph µs)", ""]
        for who in ("fdlib_auto", "costmodel", "fa2_rule"):
            rs = [row["chosen"][who]["ratio_to_best"] for row in sweep["sweep"]
                  if row.get("chosen", {}).get(who, {}).get("ratio_to_best")]
            if rs:
                out.append(f"- {who}: best/chosen time {1 / geomean(rs):.3f} geometric mean (target ≥ 0.97), "
                           f"worst {1 / max(rs):.3f} (target ≥ 0.90), over {len(rs)} shapes")
    print("\n".join(out))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/h200"))
