"""Judge the cost model on committed H200 measurements, with no GPU: fit its constants to the calibration points
found in a committed split-count sweep, then compare its choices with the measured times.

    python tools/costmodel_offline.py [results/h200]

1. ``sweep-fp16.json`` (``python -m fdlib.bench --sweep-splits``: the unified kernel at every split count on the
   fp16 bench grid): :func:`fdlib.calibration.fit` on the rows of :data:`fdlib.calibration.CALIBRATION_POINTS`
   that it holds, then for each shape best measured time / measured time at the model's choice.
2. ``ab/ab-heads-split-counts.json`` (``tools/ab_kernels.py --methods split``: the two-stage path of head layouts
   at forced split counts): the two-stage model's choice on each shape against the measured counts.

Run it on two trees to compare two versions of the model on the same measurements.
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


def main(folder: Path) -> None:
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


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "results" / "h200")
