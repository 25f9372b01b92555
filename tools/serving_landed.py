"""What the default call does on the serving batches, read from a ``python -m fdlib.bench --serving`` JSON that
has a ``worklist`` row: for each batch and cache, the plan ``auto`` makes without host lengths under today's rule
(:func:`fdlib.plan.device_schedule_suits`: the work list, or the plan for L_cap), the time that plan took in that
run (its ``worklist`` row or its ``default`` row, measured with the work list off), against the host-lengths plan
and the read ceiling measured in the same run; then the targets of a batch of >= 512 MB (>= 90% of the ceiling)
and of every batch (<= 1.05x the host-lengths plan).

    python tools/serving_landed.py results/h100/worklist/serving.json
"""
import json
import sys

import torch

from fdlib.plan import WORK_SPLITS, device_schedule_suits, workspace_bytes


def main(path: str) -> None:
    data = json.load(open(path))
    prov = data["provenance"]
    rows = {}
    for r in data["records"]:
        rows[(r["case"], r["layout"], r["row"])] = r
    print(f"# The default call on the serving batches: {prov['device']}, {prov['date_utc']}\n")
    print(f"From `{prov['command']}` (commit {prov.get('git_commit')}, torch {prov['torch']}, triton {prov['triton']}; "
          f"read ceiling {data['ceiling']['tbs']:.2f} TB/s in the same run). 'old default': the plan for L_cap "
          f"(the run's `default` row, work list off); 'default now': the plan `auto` makes without host lengths "
          f"under `fdlib.plan.device_schedule_suits`, timed as that run's row of the same plan. Graph µs.\n")
    print("| # | batch | cache | KV MB | plan_host | old default | default now (plan) | now × plan_host | now % ceiling |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst, misses = 0.0, []
    for (case, layout, row), host in sorted(rows.items()):
        if row != "plan_host":
            continue
        old = rows[(case, layout, "default")]
        suits = device_schedule_suits(host["B"], host["L_max"], torch.bfloat16, 1,
                                      workspace_bytes(host["B"] * WORK_SPLITS, host["H_q"], host["D"]))
        now = rows[(case, layout, "worklist")] if suits else old
        x = now["us"] / host["us"]
        worst = max(worst, x)
        if x > 1.05 or host["kv_mb"] >= 512 and now["pct_ceiling"] < 90:
            misses.append(f"{host['name']} ({layout})")
        print(f"| {case} | {host['name']} | {layout} | {host['kv_mb']:.0f} | {host['us']:.1f} | {old['us']:.1f} "
              f"({old['us'] / host['us']:.2f}x) | {now['us']:.1f} ({'work list' if suits else 'plan for L_cap'}) | "
              f"{x:.2f}x | {now['pct_ceiling']:.0f}% |")
    print(f"\nWorst: {worst:.2f}x the host-lengths plan. Targets missed ({len(misses)}): {', '.join(misses) or 'none'}.")


if __name__ == "__main__":
    main(sys.argv[1])
