"""Summarise Nsight Compute's per-instruction page (``ncu -i REPORT --page source --print-source sass --csv``) of
the unified kernel: for each kernel profiled, its SASS instructions by how often they ran, where the stall samples
fall (before, inside and after the K/V loop) and, inside the loop, the instructions a tile executes, the samples at
the barrier where a tile waits for its K/V copies, and the place of the copies (LDGSTS) in the tile.

    python tools/ncu_sass.py FILE.csv[.gz] [--tiles N]

``--tiles``: how many times a warp runs the loop (the loop is the instructions from the first to the last that ran
warps × N times; default: N from the commonest count above a warp's one, which the kernel's first instruction
gives). The samples are the profiler's warp-state samples (about one a
few hundred cycles a warp), so counts of a few hundred carry a few percent of noise.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys

MEMORY = ("LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR", "STS", "LDS", "HMMA")


def kernels(path: str) -> list[list[dict]]:
    """The rows of each kernel in the file (a ``"Kernel Name"`` line starts each)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read().split("\n")
    blocks, cur = [], None
    for line in text:
        if line.startswith('"Kernel Name"'):
            cur = []
            blocks.append(cur)
        elif cur is not None and line.strip():
            cur.append(line)
    return [list(csv.DictReader(io.StringIO("\n".join(b)))) for b in blocks]


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(src: str) -> str:
    toks = src.strip().split()
    return (toks[1] if toks[0].startswith("@") else toks[0]).split(".")[0]


def runs(ops: list[tuple[int, str]]) -> str:
    """``OPxN@i``: runs of the same opcode, N of them from the loop's i-th instruction."""
    out, prev, count, start = [], None, 0, 0
    for i, op in ops:
        if op == prev:
            count += 1
            continue
        if prev:
            out.append(f"{prev}x{count}@{start}")
        prev, count, start = op, 1, i
    if prev:
        out.append(f"{prev}x{count}@{start}")
    return " ".join(out)


def summary(rows: list[dict], tiles: int | None) -> list[str]:
    samples = [num(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    executed = [num(r["Instructions Executed"]) for r in rows]
    warps = executed[0]                       # the kernel's first instruction runs once in every warp
    more = collections.Counter(x for x in executed if x > warps)
    per_tile = warps * tiles if tiles else more.most_common(1)[0][0]
    at = [i for i, x in enumerate(executed) if x == per_tile]
    first, last = at[0], at[-1]
    loop = rows[first:last + 1]
    tile_instructions = sum(x for x in executed[first:last + 1] if x >= per_tile) / per_tile
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    waits = [(num(r["Warp Stall Sampling (All Samples)"]), i) for i, r in enumerate(loop)
             if opcode(r["Source"]) == "BAR" and num(r["Instructions Executed"]) >= per_tile]
    wait, at = max(waits) if waits else (0, -1)
    top = collections.Counter()
    for r in rows:
        for c in stalls:
            top[c[6:]] += num(r[c])
    return [
        f"warps {warps:.0f}, tiles a warp {per_tile / warps:.1f} (mean); {len(rows)} SASS lines",
        f"stall samples: before the loop {sum(samples[:first]):.0f}, in it {sum(samples[first:last + 1]):.0f}, "
        f"after it {sum(samples[last + 1:]):.0f}, all {sum(samples):.0f} "
        f"({', '.join(f'{k} {v:.0f}' for k, v in top.most_common(5))})",
        f"loop: {tile_instructions:.0f} instructions a tile; {wait:.0f} samples at its K/V wait (BAR at {at})",
        f"loop's memory and MMA instructions: {runs([(i, opcode(r['Source'])) for i, r in enumerate(loop) if opcode(r['Source']) in MEMORY])}",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--tiles", type=int, default=None)
    args = ap.parse_args(argv)
    for path in args.files:
        for k, rows in enumerate(kernels(path)):
            print(f"{path}, kernel {k}:")
            for line in summary(rows, args.tiles):
                print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
