"""Judge the cost model on committed H200 measurements, with no GPU: fit its constants to the calibration points
found in a committed split-count sweep, then compare its choices with the measured times.

    python tools/costmodel_offline.py [FOLDER [OLDER_HEADS_SWEEP.json ...]] [--second-program PHI]

1. ``sweep-fp16.json`` (``python -m fdlib.bench --sweep-splits``: the unified kernel at every split count on the
   fp16 bench grid): :func:`fdlib.calibration.fit` on the rows of :data:`fdlib.calibration.CALIBRATION_POINTS`
   that it holds, then for each shape best measured time / measured time at the model's choice.
2. ``ab/ab-heads-split-counts.json`` (``tools/ab_kernels.py --methods split``: the two-stage path of head layouts
   at forced split counts): the two-stage model's choice on each shape against the measured counts.
3. ``heads-sweep.json`` (and older head-layout sweeps given after the folder, e.g. one from the git history):
   auto's choice (kernel, splits) for each shape under the model with the calibration of ``FDLIB_OFFLINE_CAL``
   (a ``calibration-*.json``, default ``calibration.json``: use the one of the heads sweep's run), and its
   time where one of the sweeps measured that choice, against the fastest measured point of the shape (a mix
   of runs: a few percent of run-to-run spread is in these ratios).

Run it on two trees to compare two versions of the model on the same measurements; ``--second-program`` sets
φ of the per-SM term (:data:`fdlib.costmodel.SECOND_PROGRAM`) for this run.
"""
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fdlib import calibration, costmodel  # noqa: E402
from fdlib.gpus import PRESETS  # noqa: E402


def auto_choice(B, H_q, H_kv, D, L, gpu, cal):
    """auto's (kernel, splits) by :func:`fdlib.splits.auto_path`, offline (no compiled resources)."""
    from fdlib import splits
    return splits.auto_path(costmodel.explain(B, H_q, H_kv, L, D, 2, gpu, "unified", cal=cal),
                            costmodel.explain(B, H_q, H_kv, L, D, 2, gpu, "split", cal=cal), H_q // H_kv, D)


def heads(folder: Path, older: list, gpu) -> None:
    """Section 3 of the module doc."""
    import os
    cal_path = Path(os.environ.get("FDLIB_OFFLINE_CAL", folder / "calibration.json"))
    cal = costmodel.Calibration(**json.loads(cal_path.read_text()))
    pts, shapes = {}, set()
    for path in [folder / "heads-sweep.json", *older]:
        for r in json.loads(Path(path).read_text())["records"]:
            if r.get("graph_us"):
                k = (r["B"], r["H_q"], r["H_kv"], r["D"], r["L"])
                shapes.add(k)
                kern = r.get("kernel") if r["method"] == "auto" else r["method"]
                if kern in ("split", "unified"):
                    pts.setdefault(k, {}).setdefault((kern, r["splits"]), []).append(r["graph_us"])
    est, miss, unknown = [], [], []
    for k in sorted(shapes):
        ch = auto_choice(*k, gpu, cal)
        best = min(float(np.mean(v)) for v in pts[k].values())
        if ch in pts[k]:
            est.append(float(np.mean(pts[k][ch])) / best)
            if est[-1] > 1.02:
                miss.append(f"B={k[0]} {k[1]}:{k[2]} D={k[3]} L={k[4]} {ch[0]}@{ch[1]} {est[-1]:.3f}")
        else:
            unknown.append(f"B={k[0]} {k[1]}:{k[2]} D={k[3]} L={k[4]} {ch[0]}@{ch[1]}")
    print(f"heads sweeps ({len(shapes)} shapes, calibration {cal_path.name}, second program "
          f"{costmodel.SECOND_PROGRAM}): auto's choice measured on {len(est)}, geometric mean against the fastest "
          f"point {math.exp(np.mean(np.log(est))):.3f}, above 1.02 on {len(miss)}: {', '.join(miss) or 'none'}; "
          f"never measured: {', '.join(unknown) or 'none'}")


def main(folder: Path, older: list = ()) -> None:
    gpu = PRESETS["H200"]
    sweep = json.loads((folder / "sweep-fp16.json").read_text())
    measured = {(row["B"], row["H_kv"], row["L"], p["splits"]): p["us"]
                for row in sweep["sweep"] for p in row["points"] if p["status"] == "ok"}
    rows = [(B, H, L, s, measured[(B, H, L, s)]) for (B, H, L, s) in calibration.CALIBRATION_POINTS
            if (B, H, L, s) in measured]
    cal = calibration.fit(rows, gpu)
    print(f"fitted on {len(rows)} of {len(calibration.CALIBRATION_POINTS)} calibration points of sweep-fp16.json: "
          f"{cal}")
    ratios = []
    for row in sweep["sweep"]:
        pts = {p["splits"]: p["us"] for p in row["points"] if p["status"] == "ok"}
        chosen = costmodel.explain(row["B"], row["H_q"], row["H_kv"], row["L"], row["D"], 2, gpu, "unified",
                                   cal=cal).chosen
        near = min(pts, key=lambda s: abs(s - chosen))
        ratios.append((min(pts.values()) / pts[near], row["B"], row["H_kv"], row["L"], chosen, min(pts, key=pts.get)))
    worst = min(ratios)
    print(f"unified, sweep-fp16 ({len(ratios)} shapes): best/chosen geometric mean "
          f"{math.exp(np.mean([math.log(r[0]) for r in ratios])):.4f}, worst {worst[0]:.3f} at B={worst[1]} "
          f"H_kv={worst[2]} L={worst[3]} (chose {worst[4]}, best {worst[5]})")
    path = folder / "ab" / "ab-heads-split-counts.json"
    if path.exists():
        shapes = {}
        for r in json.loads(path.read_text())["head"]:
            used = int(re.search(r"(\d+) split\(s\)", r["plan"]).group(1))
            shapes.setdefault((r["B"], r["H_q"], r["H_kv"], r["D"], r["L"]), {}).setdefault(used, []).append(r["us"])
        for (B, hq, hkv, D, L), pts in shapes.items():
            pts = {s: float(np.mean(t)) for s, t in pts.items()}
            chosen = costmodel.explain(B, hq, hkv, L, D, 2, gpu, "split", cal=cal).chosen
            near = min(pts, key=lambda s: abs(s - chosen))
            best = min(pts, key=pts.get)
            print(f"two-stage, B={B} {hq}:{hkv} D={D} L={L}: chose {chosen} splits ({B * hkv * chosen} programs), "
                  f"measured at {near}: {pts[near]:.1f} µs; best {best} ({B * hkv * best} programs): {pts[best]:.1f} "
                  f"µs; best/chosen {pts[best] / pts[near]:.3f}")

    if (folder / "heads-sweep.json").exists():
        heads(folder, older, gpu)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--second-program" in args:
        i = args.index("--second-program")
        costmodel.SECOND_PROGRAM = float(args[i + 1])
        del args[i:i + 2]
    main(Path(args[0]) if args else ROOT / "results" / "h200", args[1:])
