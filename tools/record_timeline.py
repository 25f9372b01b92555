"""Record per-program timelines of the split, balanced and stream-K plans on a GPU, for Lab 06's Gantt charts.

    python tools/record_timeline.py --out OUT_DIR [--seed 0] [--repeats 5]

For each of Lab 06's ragged batches (``fdlib.timeline.BATCH``: B=32, H 32:8, D=128, fp16; lengths
``fdlib.timeline.batch_lengths``: "uniform" in 1..32768, the batch of issue 13, and "zipf", Zipf-like of mean 8192,
both from ``--seed``), it plans each method (``split``, ``balanced``, ``streamk``, and ``auto`` for reference)
with the host lengths, runs it once to compile, then ``--repeats`` times with the timeline flag
(``plan.run(q, k, v, lens, timeline=plan.timeline_buffer())``: one row (SM id, start ns, end ns) per program, from
the GPU's global timer) and keeps the run of median makespan. It writes ``OUT_DIR/timeline-<batch>.json``
(``fdlib.timeline.save_recorded``, read back by ``fdlib.timeline.load_recorded``) with the provenance of
``fdlib.bench.harness.provenance`` (device, versions, date, this command). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

import fdlib
from fdlib import runtime, timeline
from fdlib.bench.harness import provenance, reference_rows, rel_error

METHODS = ("split", "balanced", "streamk", "auto")


def record_batch(name: str, seed: int, repeats: int, methods=METHODS) -> tuple[dict, list]:
    """(batch description, runs) of one batch: every method's plan, run ``repeats`` times with the timeline on."""
    b = timeline.BATCH
    B, H_q, H_kv, D = b["B"], b["H_q"], b["H_kv"], b["D"]
    dtype = getattr(torch, b["dtype"])
    lengths = timeline.batch_lengths(name, seed, B)
    L_max = max(lengths)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H_q, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, L_max, H_kv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, L_max, H_kv, D, device="cuda", dtype=dtype, generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ref = reference_rows(q, k, v, lengths)                              # float32, one sequence at a time
    batch = dict(b, name=name, seed=seed, lengths=lengths, L_max=L_max,
                 kv_mb=2 * sum(lengths) * H_kv * D * dtype.itemsize / 1e6)
    runs = []
    for method in methods:
        plan = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=dtype, device="cuda", lengths=lengths, method=method)
        out = plan.run(q, k, v, lens)                                   # compile, and check the numbers
        torch.cuda.synchronize()
        err = rel_error(out, ref)
        if not err < 1e-2:
            raise RuntimeError(f"{name} batch, method {method}: relative error {err:.3g} against the reference")
        recorded = []
        for _ in range(repeats):
            buf = plan.timeline_buffer()
            plan.run(q, k, v, lens, timeline=buf)
            torch.cuda.synchronize()
            rows = buf.cpu()
            ran = rows[:, 2] > 0
            span = int(rows[ran, 2].max() - rows[ran, 1].min()) if bool(ran.any()) else 0
            recorded.append((span, rows.tolist()))
        recorded.sort(key=lambda r: r[0])
        span, rows = recorded[len(recorded) // 2]
        d = plan.decision
        mode = (f"{method}: {d.kernel} kernel, {d.splits} splits of {d.chunk} keys"
                + (f", budget {d.budget}" if d.kernel == "balanced" else "")
                + (f", {d.programs} programs" if d.kernel == "streamk" else ""))
        runs.append(dict(method=method, mode=mode, kernel=d.kernel, splits=d.splits, chunk=d.chunk,
                         budget=d.budget, block_n=d.tile.BLOCK_N if d.tile else None, rel_err=err,
                         makespans_us=[r[0] / 1e3 for r in recorded], programs=rows))
        print(f"{name:8s} {mode}: makespan {span / 1e3:.1f} µs (median of {repeats}), relative error {err:.2e}",
              flush=True)
    return batch, runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for timeline-<batch>.json")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and the inputs (default 0)")
    ap.add_argument("--repeats", type=int, default=5, help="recorded runs per method; the median makespan is kept")
    ap.add_argument("--batches", default="uniform,zipf", help="comma-separated: uniform, zipf")
    args = ap.parse_args(argv)
    if runtime.MODE != "gpu":
        print("record_timeline: needs a CUDA GPU (the timestamps come from the GPU's global timer)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "tools/record_timeline.py", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                   else argv)])
    for name in args.batches.split(","):
        batch, runs = record_batch(name.strip(), args.seed, args.repeats)
        path = timeline.save_recorded(out / f"timeline-{name.strip()}.json", batch, runs, provenance(command))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
